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
