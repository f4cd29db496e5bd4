package gateway

import (
	"context"
	"testing"
	"time"

	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
)

// A slot of a precise index changes hands at a reload (an endpoint
// replaced, one added to another model's pool, a discovery change): what
// the engine that leaves told the slot is forgotten, and what the engine
// that takes it tells it is kept. These tests fix the order of the three
// writers of a slot — the leaving engine's feed (its last batch, its
// onDown forget), the reload's forget, the arriving engine's feed — at
// the interleavings that broke it, with hooks (Gateway.slotsHook,
// kvFeed.forgetHook) and the feeds' own lock, never with sleeps. A batch
// is delivered "now" as the feed's subscriber goroutine would: at once
// when the feed is free, else (held by the commit) from a goroutine that
// waits for it (deliverNow).

// deliverNow runs deliver, a batch or reset through feed f, as f's
// subscriber would at this instant: at once when nothing holds f, else
// on a goroutine that waits for f; the returned func waits until it ran.
func deliverNow(t *testing.T, f *kvFeed, deliver func()) (wait func()) {
	t.Helper()
	if f.mu.TryLock() {
		f.mu.Unlock()
		deliver()
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		deliver()
	}()
	return func() {
		t.Helper()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatal("a batch waited 30 s for its feed")
		}
	}
}

// matchBlocks is how many leading blocks of toks (hashed for model)
// slot e of ix holds on its GPU, and how many blocks toks has.
func matchBlocks(ix *prefix.PreciseIndex, model string, toks []uint32, e int) (got, want int) {
	h := prefix.Hashes(nil, toks, prefix.DefaultBlockSize, prefix.Seed(model+"\x00"))
	return ix.MatchEndpoint(h, prefix.MediumGPU, e), len(h)
}

// TestReslotRetargetedFeedKeepsEvents: an engine that stays (its KV feed
// kept) joins another model's pool in the slot a removed endpoint leaves.
// Its feed's batch that arrives while the reload hands the slot over —
// after the feed is given the new slot's applier, before the slot is
// forgotten (the worst instant: slotsHook) — must be in the new slot after
// the reload. Until 2026-12-05 commit gave the feed its new applier and
// then forgot the slot, erasing the batch: the engine's blocks were unknown
// to the new pool until stored again.
func TestReslotRetargetedFeedKeepsEvents(t *testing.T) {
	const tokens = 512
	dead := deadKVAddr(t)
	cfg := eppBenchConfig(sched.PrecisePrefix, 2, 2) // endpoint 0: m0, endpoint 1: m1
	for i := range cfg.Endpoints {
		cfg.Endpoints[i].KVEvents = &KVEventsConfig{Endpoint: dead}
	}
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	waitKVStarted(t, g, nil)
	f0 := kvFeedOf(g, 0)
	m1 := g.PreciseIndex("m1")
	storeKV(kvFeedOf(g, 1), 1, growPrompt(1, tokens), "")
	if got, want := matchBlocks(m1, "m1", growPrompt(1, tokens), 0); got != want {
		t.Fatalf("m1's endpoint holds %d of %d blocks before the reload", got, want)
	}

	// Endpoint 1 leaves; endpoint 0 serves m1 too, in endpoint 1's slot.
	next := cfg
	both := cfg.Endpoints[0]
	both.Model = "m1"
	next.Endpoints = []EndpointConfig{cfg.Endpoints[0], both}
	var wait func()
	g.slotsHook = func() { wait = deliverNow(t, f0, func() { storeKV(f0, 2, growPrompt(2, tokens), "") }) }
	if err := g.Reload(next); err != nil {
		t.Fatal(err)
	}
	g.slotsHook = nil
	if wait == nil {
		t.Fatal("the reload handed no slot over")
	}
	wait()
	if kvFeedOf(g, 0) != f0 || g.PreciseIndex("m1") != m1 {
		t.Fatal("the reload replaced the kept feed or the index")
	}
	if got, want := matchBlocks(m1, "m1", growPrompt(2, tokens), 0); got != want {
		t.Fatalf("m1's slot 0 holds %d of the %d blocks its new engine stored while the slot changed hands", got, want)
	}
	if got, _ := matchBlocks(m1, "m1", growPrompt(1, tokens), 0); got != 0 {
		t.Fatalf("m1's slot 0 still holds %d blocks of the endpoint that left", got)
	}
	if got, want := matchBlocks(g.PreciseIndex("m0"), "m0", growPrompt(2, tokens), 0); got != want {
		t.Fatalf("m0's slot 0 holds %d of %d blocks", got, want)
	}
}

// TestReslotLateForgetOfRemovedEndpoint: an endpoint leaves rotation (its
// engine shutting down, as a deleted pod's does) just as a reload removes
// it; its onDown hook, which forgets its slot in the precise index, runs
// across the reload that gives the slot to a new endpoint. The forget
// must not erase what the new endpoint's feed stores there. Until
// 2026-12-05 onDown read the feed's appliers and forgot their slots
// without the feed's lock: read before the reload detached the feed, the
// forget could land after the new endpoint's first events
// (forgetHook: the worst instant), and the index lost them.
func TestReslotLateForgetOfRemovedEndpoint(t *testing.T) {
	const tokens = 512
	dead := deadKVAddr(t)
	cfg := preciseKVConfig(2, dead)
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	waitKVStarted(t, g, nil)
	st := g.state.Load()
	leaving, fa := st.endpoints[0], kvFeedOf(g, 0)
	ix := g.PreciseIndex("m0")
	storeKV(fa, 1, growPrompt(1, tokens), "")

	// Endpoint 0 is replaced by a new one, which takes slot 0.
	next := cfg
	added := preciseKVConfig(3, dead).Endpoints[2]
	next.Endpoints = []EndpointConfig{added, cfg.Endpoints[1]}
	reloaded := make(chan error, 1)
	arrive := func() { // the new endpoint's subscription starts, then its first batch
		waitKVStarted(t, g, nil)
		storeKV(kvFeedOf(g, 0), 2, growPrompt(2, tokens), "")
	}
	arrived := false
	fa.forgetHook = func() {
		if fa.mu.TryLock() {
			// The forget is not ordered with the reload: let the reload
			// and the new endpoint's first batch happen first.
			fa.mu.Unlock()
			reloaded <- g.Reload(next)
			arrive()
			arrived = true
			return
		}
		go func() { reloaded <- g.Reload(next) }() // it waits for the forget
	}
	leaving.setReady(true)
	leaving.setReady(false) // its onDown hooks run
	select {
	case err := <-reloaded:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the reload did not end")
	}
	if !arrived {
		arrive()
	}
	if p := g.state.Load().pools["m0"]; p.endpoints[0] == leaving || p.endpoints[0].name != mustURL(t, added.URL) {
		t.Fatalf("slot 0 is %s after the reload", p.endpoints[0].name)
	}
	if got, want := matchBlocks(ix, "m0", growPrompt(2, tokens), 0); got != want {
		t.Fatalf("slot 0 holds %d of the %d blocks its new engine stored (the old engine's late forget erased them)", got, want)
	}
	if got, _ := matchBlocks(ix, "m0", growPrompt(1, tokens), 0); got != 0 {
		t.Fatalf("slot 0 still holds %d blocks of the endpoint that left", got)
	}
}

// TestReslotRemovedFeedLateBatch pins the reverse order: a removed
// endpoint's feed runs until the endpoint is drained, so its last batches
// may arrive while the reload hands its slot over, or after. None of them
// lands in the slot once the reload has begun handing it over (the feed is
// detached, waiting for a batch in progress, before the slot is forgotten):
// the new endpoint's slot holds its own blocks only.
func TestReslotRemovedFeedLateBatch(t *testing.T) {
	const tokens = 512
	dead := deadKVAddr(t)
	cfg := preciseKVConfig(2, dead)
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	waitKVStarted(t, g, nil)
	fa := kvFeedOf(g, 0)
	ix := g.PreciseIndex("m0")
	storeKV(fa, 1, growPrompt(1, tokens), "")

	next := cfg
	next.Endpoints = []EndpointConfig{preciseKVConfig(3, dead).Endpoints[2], cfg.Endpoints[1]}
	var wait func()
	g.slotsHook = func() { wait = deliverNow(t, fa, func() { storeKV(fa, 3, growPrompt(3, tokens), "") }) }
	if err := g.Reload(next); err != nil {
		t.Fatal(err)
	}
	g.slotsHook = nil
	wait()
	storeKV(fa, 4, growPrompt(4, tokens), "") // after the reload, before the drain
	waitKVStarted(t, g, nil)
	storeKV(kvFeedOf(g, 0), 2, growPrompt(2, tokens), "")
	for s := 1; s <= 4; s++ {
		got, want := matchBlocks(ix, "m0", growPrompt(s, tokens), 0)
		if s == 2 && got != want {
			t.Fatalf("slot 0 holds %d of the %d blocks its new engine stored", got, want)
		}
		if s != 2 && got != 0 {
			t.Fatalf("slot 0 holds %d blocks of prompt %d, stored by the endpoint that left", got, s)
		}
	}
}

// mustURL is u normalised as an endpoint's name.
func mustURL(t *testing.T, u string) string {
	t.Helper()
	n, err := normalizeURL(u)
	if err != nil {
		t.Fatal(err)
	}
	return n
}
