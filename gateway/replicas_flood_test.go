package gateway

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/replica"
)

// TestReplicasStaggerFlood: many staggered decisions wait while the
// reader applies a flood of learns, most of a replica ranked after this
// one (which wake every waiter and release none), some of the one ranked
// before, some malformed, and some requests end: every decision is
// taken (by a learn, its deadline or its request's end), the race
// detector sees nothing, and no waiter is left behind.
func TestReplicasStaggerFlood(t *testing.T) {
	r, p := staggeredReplicas(false)
	learn := func(id string) []byte {
		return replica.AppendLearn(nil, id, time.Now().UnixNano(), "m", "http://e0", 16, 16, []uint64{1})
	}
	const waiters = 64
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var reader sync.WaitGroup
	reader.Add(1)
	go func() { // the reader
		defer reader.Done()
		c, a := learn("c"), learn("a")
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			switch {
			case i%97 == 0:
				r.apply(a, false)
			case i%13 == 0:
				r.apply(c[:len(c)-1], false) // malformed
			default:
				r.apply(c, false)
			}
		}
	}()
	for w := range waiters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 20 {
				ctx, cancel := context.WithCancel(context.Background())
				if (w+i)%5 == 0 {
					cancel()
				}
				r.stagger(ctx, p)
				cancel()
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("staggered decisions not taken")
	}
	close(stop)
	reader.Wait()
	if n := r.turns.waiting.Load(); n != 0 {
		t.Fatalf("%d waiters left", n)
	}
	if n := staggerCount(t, r, ""); n != waiters*20 {
		t.Fatalf("%d waits observed, want %d", n, waiters*20)
	}
}
