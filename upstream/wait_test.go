package upstream

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// TestHeaderWaitsConcurrent arms, aborts and disarms waits from many
// goroutines: the list stays consistent (race detector), an abort reaches
// exactly the waits armed at the time, and a disarmed wait reports it.
func TestHeaderWaitsConcurrent(t *testing.T) {
	var l Waits
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	var wg sync.WaitGroup
	var aborted atomic.Int64
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var w Wait
			w.list = &l
			for range 200 {
				w.arm(nil, func() {})
				if w.disarm() {
					aborted.Add(1)
				}
			}
		}()
	}
	stop, done := make(chan struct{}), make(chan struct{})
	var n atomic.Int64
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
				n.Add(int64(l.AbortAll()))
			}
		}
	}()
	wg.Wait()
	close(stop)
	<-done
	if l.head != nil {
		t.Error("waits left linked after every disarm")
	}
	// Every abort counted by AbortAll is seen by exactly one disarm.
	if got, want := aborted.Load(), n.Load(); got != want {
		t.Errorf("disarm saw %d aborts, AbortAll made %d", got, want)
	}

	// A wait armed on a connection is aborted by a past deadline on it.
	var w Wait
	w.list = &l
	w.arm(a, nil)
	if l.AbortAll() != 1 {
		t.Fatal("armed wait not aborted")
	}
	if _, err := a.Read(make([]byte, 1)); !IsTimeout(err) {
		t.Errorf("read after abort: %v, want a timeout", err)
	}
	if !w.disarm() || w.disarm() {
		t.Error("disarm: want true once, then false")
	}
}
