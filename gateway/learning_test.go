package gateway

import (
	"context"
	"net/http"
	"slices"
	"sync"
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

// TestLearnOnFinish: with routing.prefix.learn_on_finish a request's end
// (its answer's 2xx status seen, then Done) makes its prompt the most
// recent blocks of its endpoint in the approximate index, as the engine's
// free queue does; so a prompt routed later but finished earlier is
// evicted first. Without it, the prompt routed first is.
func TestLearnOnFinish(t *testing.T) {
	for _, on := range []bool{false, true} {
		cfg := eppBenchConfig(sched.CacheAware, 2, 1)
		for i := range cfg.Endpoints {
			cfg.Endpoints[i].KVBlocks = 128 // 2 prompts of 64 blocks (16 tokens each)
		}
		cfg.Routing.Prefix.LearnOnFinish = &on
		g, err := New(context.Background(), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		h := finishHarness{t, g}
		pick, end := h.pick, h.end
		a := pick(0)
		home := a.Destinations()[0]
		for i := 1; i <= 2; i++ { // b and c fill a's endpoint
			pk := pick(i)
			if d := pk.Destinations()[0]; d != home {
				t.Fatalf("learn_on_finish %v: request %d went to %s, a to %s", on, i, d, home)
			}
			end(pk)
		}
		end(a)       // a ends last
		d := pick(3) // evicts 32 blocks: a's tail by routing order, b's by finish order
		end(d)
		again := pick(0)
		want := 512
		if on {
			want = 1024
		}
		if got := again.x.predicted; again.Destinations()[0] != home || got != want {
			t.Errorf("learn_on_finish %v: a again on %s (home %s), predicted %d cached tokens, want %d",
				on, again.Destinations()[0], home, got, want)
		}
		end(again)
		g.Close()
	}
}

// TestLearnOnFinishAcrossReload: a reload that keeps the pool's policy
// (routing unchanged) between a pick and its end must not leave the pick's
// pin in the kept index. Before the fix the release was skipped for a
// replaced pool, so a's blocks stayed pinned for good: when d later
// overflowed the endpoint, b's and c's blocks were evicted instead of a's
// tail (a ended first), and a was predicted whole (1,024 cached tokens)
// where the engine, freeing by finish, holds 512.
func TestLearnOnFinishAcrossReload(t *testing.T) {
	on := true
	cfg := eppBenchConfig(sched.CacheAware, 2, 1)
	for i := range cfg.Endpoints {
		cfg.Endpoints[i].KVBlocks = 128 // 2 prompts of 64 blocks (16 tokens each)
	}
	cfg.Routing.Prefix.LearnOnFinish = &on
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	h := finishHarness{t, g}
	pick, end := h.pick, h.end
	a := pick(0)
	home := a.Destinations()[0]
	old := g.state.Load().pools["m0"]
	if err := g.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	now := g.state.Load().pools["m0"]
	if now == old || now.policy != old.policy {
		t.Fatalf("the reload did not replace the pool keeping its policy (replaced %v, policy kept %v)",
			now != old, now.policy == old.policy)
	}
	end(a) // a ends first, after the reload
	for i := 1; i <= 2; i++ {
		pk := pick(i)
		if d := pk.Destinations()[0]; d != home {
			t.Fatalf("request %d went to %s, a to %s", i, d, home)
		}
		end(pk)
	}
	d := pick(3) // evicts 32 blocks: a's tail, the first to finish
	end(d)
	again := pick(0)
	if got := again.x.predicted; again.Destinations()[0] != home || got != 512 {
		t.Errorf("a again on %s (home %s), predicted %d cached tokens, want 512 (a's pin left by the reload: 1024)",
			again.Destinations()[0], home, got)
	}
	end(again)
}

// TestSettleHurries: while a pool waits for the settler, picks that find
// settleHurry learns queued ask the settler to end its wait (settleNow),
// and those that find fewer do not.
func TestSettleHurries(t *testing.T) {
	// One learn per pick: without learn_on_finish (on, each Done would
	// queue a second one, the pin's release).
	cfg := eppBenchConfig(sched.CacheAware, 8, 1)
	off := false
	cfg.Routing.Prefix.LearnOnFinish = &off
	g, err := New(context.Background(), cfg, nil)
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

// finishRecorder is a pool's policy that records which slots its
// Finisher is told of, and passes everything on.
type finishRecorder struct {
	sched.Policy
	mu    sync.Mutex
	slots []int
}

var _ sched.Finisher = (*finishRecorder)(nil) // a signature change must not make it silently no Finisher

func (f *finishRecorder) LearnsOnFinish() bool { return f.Policy.(sched.Finisher).LearnsOnFinish() }

func (f *finishRecorder) Finished(i int, hashes []uint64, pinned bool) {
	f.mu.Lock()
	f.slots = append(f.slots, i)
	f.mu.Unlock()
	f.Policy.(sched.Finisher).Finished(i, hashes, pinned)
}

// TestLearnOnFinishServedElsewhere: when the proxy reports that a fallback
// served the request (Picked.Served), the pin the pick took on the picked
// endpoint is released, and Done then releases the endpoint that served
// it. Before, Done released only the serving endpoint's slot: the picked
// endpoint's pin stayed for good, one per request sent to a fallback.
func TestLearnOnFinishServedElsewhere(t *testing.T) {
	on := true
	cfg := eppBenchConfig(sched.CacheAware, 2, 1)
	cfg.Routing.Prefix.LearnOnFinish = &on
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	p := g.state.Load().pools["m0"]
	rec := &finishRecorder{Policy: p.policy}
	p.policy = rec
	pk, ref := g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathCompletions,
		Header: http.Header{}, Body: withModel(eppTokens(0, 0, 1024, 1024), 0, 1)})
	if ref != nil {
		t.Fatalf("refused: %d %s", ref.Status, ref.Body)
	}
	picked, other := pk.i, 1-pk.i
	pk.Served(p.endpoints[other].addr)
	pk.ResponseHeaders(http.StatusOK, http.Header{})
	pk.Done()
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if !slices.Equal(rec.slots, []int{picked, other}) {
		t.Fatalf("released slots %v, want the picked %d (its pin) then the serving %d", rec.slots, picked, other)
	}
}

// finishHarness drives pool m0 of a learn_on_finish test gateway: pick(i)
// routes request i (sharing its first 512 tokens with request 0, which has
// 1,024 of its own) and waits for the settler, end answers 200 and ends it.
type finishHarness struct {
	t *testing.T
	g *Gateway
}

func (h finishHarness) settle() {
	h.t.Helper()
	s := h.g.state.Load().pools["m0"].policy.(sched.Settler)
	for deadline := time.Now().Add(10 * time.Second); s.Unsettled(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			h.t.Fatal("the settler left learning queued for 10 s")
		}
	}
}

func (h finishHarness) pick(i int) *Picked {
	h.t.Helper()
	shared := 512
	if i == 0 {
		shared = 1024
	}
	pk, ref := h.g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathCompletions,
		Header: http.Header{}, Body: withModel(eppTokens(i, 0, shared, 1024), 0, 1)})
	if ref != nil {
		h.t.Fatalf("refused: %d %s", ref.Status, ref.Body)
	}
	h.settle()
	return pk
}

func (h finishHarness) end(pk *Picked) {
	pk.ResponseHeaders(http.StatusOK, http.Header{})
	pk.Done()
	h.settle()
}
