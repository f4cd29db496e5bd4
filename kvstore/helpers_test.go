package kvstore

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/internal/redistest"
	"github.com/infergate/infergate/kvevents"
)

// wait is the bound of every wait in these tests: generous, never a
// measured duration.
const wait = redistest.Wait

// startRedis starts a real redis-server (internal/redistest) and returns
// its address.
func startRedis(t testing.TB) string {
	t.Helper()
	return redistest.Start(t, 0).Addr
}

// sink is a kvevents.Handler that keeps every event received and the set
// of hashes the stream says are held.
type sink struct {
	mu     sync.Mutex
	events []kvevents.Event
	held   map[uint64]bool
	resets int
}

func newSink() *sink { return &sink{held: map[uint64]bool{}} }

func (s *sink) KVBatch(_ uint64, b *kvevents.Batch) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range b.Events {
		e.BlockHashes = append([]uint64(nil), e.BlockHashes...)
		e.TokenIDs = append([]uint32(nil), e.TokenIDs...)
		s.events = append(s.events, e)
		for _, h := range e.BlockHashes {
			switch e.Type {
			case kvevents.BlockStored:
				s.held[h] = true
			case kvevents.BlockRemoved:
				delete(s.held, h)
			}
		}
	}
}

func (s *sink) KVReset(kvevents.ResetReason) {
	s.mu.Lock()
	s.resets++
	s.mu.Unlock()
}

// await polls until f (called with the sink locked) holds, failing the
// test after wait.
func (s *sink) await(t testing.TB, what string, f func(*sink) bool) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for {
		s.mu.Lock()
		ok := f(s)
		n := len(s.events)
		s.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting %v for %s; %d events so far", wait, what, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// find returns the last event of type typ for hash h.
func (s *sink) find(typ kvevents.Type, h uint64) (kvevents.Event, bool) {
	for i := len(s.events) - 1; i >= 0; i-- {
		if e := s.events[i]; e.Type == typ && len(e.BlockHashes) > 0 && e.BlockHashes[0] == h {
			return e, true
		}
	}
	return kvevents.Event{}, false
}

// subscribe runs a subscriber of the publisher at endpoint (with its
// replay socket) into a new sink until the test's end.
func subscribe(t testing.TB, endpoint, replay string) *sink {
	t.Helper()
	sub, err := kvevents.NewSubscriber(kvevents.SubscriberConfig{Endpoint: endpoint, ReplayEndpoint: replay})
	if err != nil {
		t.Fatal(err)
	}
	s := newSink()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = sub.Run(ctx, s) }()
	t.Cleanup(func() { cancel(); <-done })
	return s
}
