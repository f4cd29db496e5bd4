package kvevents

import (
	"context"
	"sync"
	"testing"
	"time"
)

// The subscriber's end-to-end tests, which check what it delivers through
// the gateway's index, are in ../fleet (kvevents_test.go); the ones of its
// bounds against hostile peers are in zmtpguard_test.go.

// kvRunning is a subscriber running in the background.
type kvRunning struct {
	sub    *Subscriber
	cancel context.CancelFunc
	done   chan error
}

// stop cancels Run and checks that it returns promptly.
func (r *kvRunning) stop(t *testing.T) {
	t.Helper()
	if r.cancel == nil {
		return
	}
	r.cancel()
	r.cancel = nil
	start := time.Now()
	select {
	case err := <-r.done:
		if err != context.Canceled {
			t.Errorf("Run returned %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("Run took %v to return after cancel", d)
	}
}

// kvRecorder is a Handler that records what a subscriber delivers.
type kvRecorder struct {
	mu     sync.Mutex
	seqs   []uint64
	resets []ResetReason
	stored int // BlockStored events delivered
}

func (r *kvRecorder) KVBatch(seq uint64, b *Batch) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seqs = append(r.seqs, seq)
	for _, ev := range b.Events {
		if ev.Type == BlockStored {
			r.stored++
		}
	}
}

func (r *kvRecorder) KVReset(why ResetReason) {
	r.mu.Lock()
	r.resets = append(r.resets, why)
	r.mu.Unlock()
}

func (r *kvRecorder) snapshot() ([]uint64, []ResetReason) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]uint64(nil), r.seqs...), append([]ResetReason(nil), r.resets...)
}

// storedEvents returns the number of BlockStored events delivered.
func (r *kvRecorder) storedEvents() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stored
}
