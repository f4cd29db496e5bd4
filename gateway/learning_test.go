package gateway

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
)

// TestSettlerAppliesLearning: a pick's learning is queued off the pick
// path and the gateway's settler applies it; meanwhile and afterwards the
// next request with the same prompt goes to the same endpoint.
func TestSettlerAppliesLearning(t *testing.T) {
	g, err := New(context.Background(), eppBenchConfig(sched.CacheAware, 8, 1), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	p := g.state.Load().pools["m0"]
	s, ok := p.policy.(sched.Settler)
	if !ok {
		t.Fatalf("cache-aware policy %T is not a sched.Settler", p.policy)
	}
	pick := func(i int) string {
		t.Helper()
		pk, ref := g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathCompletions,
			Header: http.Header{}, Body: withModel(eppTokens(i, i, 1024, 1024), 0, 1)})
		if ref != nil {
			t.Fatalf("refused: %d %s", ref.Status, ref.Body)
		}
		dest := pk.Destinations()[0]
		pk.Done()
		return dest
	}
	home := make([]string, 16)
	for i := range home {
		home[i] = pick(i)
	}
	for deadline := time.Now().Add(10 * time.Second); s.Unsettled(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the settler left learning queued for 10 s")
		}
	}
	for i, want := range home {
		if got := pick(i); got != want {
			t.Fatalf("prompt %d went to %s after settling, first to %s", i, got, want)
		}
	}
}

// TestSettleHurries: while a pool waits for the settler, picks that find
// settleHurry learns queued ask the settler to end its wait (settleNow),
// and those that find fewer do not.
func TestSettleHurries(t *testing.T) {
	g, err := New(context.Background(), eppBenchConfig(sched.CacheAware, 8, 1), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	p := g.state.Load().pools["m0"]
	s := p.settler()
	// The pool counts as waiting, but the settler was never told: its
	// learns stay queued and the hurry token stays in the channel.
	p.settleQueued.Store(true)
	for i := range settleHurry {
		if len(g.settleNow) != 0 {
			t.Fatalf("hurried with %d learns queued, want at %d", s.Queued(), settleHurry)
		}
		pk, ref := g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathCompletions,
			Header: http.Header{}, Body: withModel(eppTokens(i, i, 64, 64), 0, 1)})
		if ref != nil {
			t.Fatalf("refused: %d %s", ref.Status, ref.Body)
		}
		pk.Done()
		if s.Queued() != i+1 {
			t.Fatalf("%d learns queued after %d picks", s.Queued(), i+1)
		}
	}
	if len(g.settleNow) != 1 {
		t.Fatalf("not hurried with %d learns queued", s.Queued())
	}
	// Handed to the settler, the pool's learns are applied.
	p.settleQueued.Store(false)
	g.settleLater(p)
	for deadline := time.Now().Add(10 * time.Second); s.Unsettled(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the settler left learning queued for 10 s")
		}
	}
}
