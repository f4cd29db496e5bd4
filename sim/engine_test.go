package sim

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// seqTokens returns n distinct tokens starting at base*1_000_000.
func seqTokens(base, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(base*1_000_000 + i)
	}
	return t
}

func concat(parts ...[]uint32) []uint32 { return slices.Concat(parts...) }

// run steps the engine until idle, returning the simulated end time and all
// outputs by request id. It fails the test if the engine does not drain.
func run(t testing.TB, e *Engine, now time.Duration) (time.Duration, map[string][]Output) {
	t.Helper()
	outs := map[string][]Output{}
	for steps := 0; e.HasWork(); steps++ {
		if steps > 1_000_000 {
			t.Fatal("engine did not drain")
		}
		r := e.Step(now)
		now += r.Duration
		if at, ok := e.NextLoad(); ok && r.Duration == 0 {
			now = max(now, at) // nothing ran: only lower-tier loads are in flight
		}
		for _, o := range r.Outputs {
			outs[o.ID] = append(outs[o.ID], o)
		}
	}
	return now, outs
}

// checkEngine verifies block accounting against the requests' block tables.
func checkEngine(t *testing.T, e *Engine) {
	t.Helper()
	checkPool(t, e.pool)
	refs := make([]int32, len(e.pool.blocks))
	for _, s := range e.running {
		for _, id := range s.blocks {
			refs[id]++
		}
		if need := (s.computed + 15) / 16; len(s.blocks) < need {
			t.Fatalf("%s: %d blocks for %d computed tokens", s.id, len(s.blocks), s.computed)
		}
	}
	loads := 0
	for i := 0; i < e.waiting.len(); i++ {
		s := e.waiting.buf[e.waiting.head+i]
		if s.loading {
			loads++
		}
		loadedRemote := s.loadBlocks > 0 && s.computed == min(s.loadBlocks*16, len(s.tokens)-1)
		if len(s.blocks) > 0 && (s.loading || s.computed == s.loadBlocks*16 || loadedRemote) {
			// Loading from a lower tier or a prefill engine, or loaded: it holds its blocks.
			if len(s.blocks) != s.loadBlocks {
				t.Fatalf("waiting %s holds %d blocks, loads %d", s.id, len(s.blocks), s.loadBlocks)
			}
			for _, id := range s.blocks {
				refs[id]++
			}
			continue
		}
		if len(s.blocks) != 0 || s.computed != 0 {
			t.Fatalf("waiting %s holds %d blocks, %d computed", s.id, len(s.blocks), s.computed)
		}
	}
	if loads != e.loads {
		t.Fatalf("%d requests loading, engine counts %d", loads, e.loads)
	}
	held := 0
	for _, h := range e.held {
		for _, id := range h.blocks {
			refs[id]++
		}
		held += len(h.blocks)
	}
	if held != e.heldBlocks {
		t.Fatalf("%d blocks held for decode engines, engine counts %d", held, e.heldBlocks)
	}
	for i, r := range refs {
		if e.pool.blocks[i].ref != r {
			t.Fatalf("block %d: ref %d, held by %d requests", i, e.pool.blocks[i].ref, r)
		}
	}
}

func TestAddValidation(t *testing.T) {
	e := NewEngine(Config{NumBlocks: 10}) // 160 tokens
	cases := []struct {
		r    Request
		want error
	}{
		{Request{ID: "a", Tokens: nil, MaxTokens: 1}, ErrEmptyPrompt},
		{Request{ID: "a", Tokens: seqTokens(1, 4), MaxTokens: 0}, ErrBadMaxTokens},
		{Request{ID: "a", Tokens: seqTokens(1, 161), MaxTokens: 1}, ErrNoCapacity},
		{Request{ID: "a", Tokens: seqTokens(1, 100), MaxTokens: 62}, ErrNoCapacity},
		{Request{ID: "a", Tokens: seqTokens(1, 100), MaxTokens: 61}, nil}, // 160 KV tokens
		{Request{ID: "a", Tokens: seqTokens(1, 4), MaxTokens: 1}, ErrDuplicateID},
	}
	for i, c := range cases {
		if err := e.Add(&c.r, 0); !errors.Is(err, c.want) {
			t.Errorf("case %d: got %v, want %v", i, err, c.want)
		}
	}
	p := DefaultProfile()
	p.MaxModelLen = 100
	e = NewEngine(Config{Profile: p, NumBlocks: 100})
	if err := e.Add(&Request{ID: "x", Tokens: seqTokens(1, 90), MaxTokens: 11}, 0); !errors.Is(err, ErrTooLong) {
		t.Errorf("max model len: got %v", err)
	}
	// A max_tokens near the int range (the API accepts 2^63-1) is too
	// long, with or without a model length: the sum with the prompt
	// overflowed negative, passed, and Add's make panicked (one request
	// crashed infergate sim and up).
	for _, mml := range []int{100, 0} {
		p.MaxModelLen = mml
		e = NewEngine(Config{Profile: p, NumBlocks: 100})
		for _, mt := range []int{math.MaxInt, math.MaxInt - 3, math.MaxInt / 2} {
			if err := e.Add(&Request{ID: "x", Tokens: seqTokens(1, 4), MaxTokens: mt}, 0); !errors.Is(err, ErrTooLong) && !errors.Is(err, ErrNoCapacity) {
				t.Errorf("max model len %d, max tokens %d: got %v", mml, mt, err)
			}
		}
	}
	_, outs := run(t, NewEngineWith(t, 10, seqTokens(1, 100), 61), 0)
	if n := len(outs["r"]); n != 61 {
		t.Fatalf("request filling the cache exactly: %d tokens, want 61", n)
	}
}

// NewEngineWith returns an engine of numBlocks blocks holding one request "r".
func NewEngineWith(t *testing.T, numBlocks int, prompt []uint32, maxTokens int) *Engine {
	t.Helper()
	e := NewEngine(Config{NumBlocks: numBlocks})
	if err := e.Add(&Request{ID: "r", Tokens: prompt, MaxTokens: maxTokens}, 0); err != nil {
		t.Fatal(err)
	}
	return e
}

func TestPrefixHit(t *testing.T) {
	e := NewEngine(Config{NumBlocks: 1000})
	shared := seqTokens(1, 100) // 6 full blocks (96 tokens) + 4
	must(t, e.Add(&Request{ID: "a", Tokens: concat(shared, seqTokens(2, 50)), MaxTokens: 4}, 0))
	run(t, e, 0)
	must(t, e.Add(&Request{ID: "b", Tokens: concat(shared, seqTokens(3, 50)), MaxTokens: 4}, 0))
	_, outs := run(t, e, 0)
	if got := outs["b"][0].CachedTokens; got != 96 {
		t.Fatalf("cached tokens %d, want 96 (6 full shared blocks)", got)
	}
	// A different Extra (adapter, cache salt) shares nothing.
	must(t, e.Add(&Request{ID: "c", Tokens: concat(shared, seqTokens(3, 50)), MaxTokens: 4, Extra: 1}, 0))
	_, outs = run(t, e, 0)
	if got := outs["c"][0].CachedTokens; got != 0 {
		t.Fatalf("salted request hit %d tokens", got)
	}
	st := e.Stats()
	if st.PrefixQueries != 3*150 || st.PrefixHits != 96 {
		t.Fatalf("prefix stats %d/%d, want 450/96", st.PrefixHits, st.PrefixQueries)
	}
	if st.PromptTokens != 450 || st.GenerationTokens != 12 || st.Running != 0 || st.Waiting != 0 || st.KVUsage != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestPrefixHitCappedBelowPromptLength(t *testing.T) {
	e := NewEngine(Config{NumBlocks: 1000})
	p := seqTokens(1, 96) // exactly 6 blocks
	must(t, e.Add(&Request{ID: "a", Tokens: p, MaxTokens: 1}, 0))
	run(t, e, 0)
	must(t, e.Add(&Request{ID: "b", Tokens: p, MaxTokens: 1}, 0))
	r := e.Step(0)
	if got := r.Outputs[0].CachedTokens; got != 80 {
		t.Fatalf("identical 96-token prompt hit %d tokens, want 80 (cap at len-1, whole blocks)", got)
	}
	if r.Cost.Tokens != 16 {
		t.Fatalf("computed %d tokens, want 16", r.Cost.Tokens)
	}
	// A 97-token prompt whose first 96 are cached hits all 96.
	must(t, e.Add(&Request{ID: "c", Tokens: concat(p, []uint32{5}), MaxTokens: 1}, 0))
	if r := e.Step(0); r.Outputs[0].CachedTokens != 96 || r.Cost.Tokens != 1 {
		t.Fatalf("97-token prompt: cached %d, computed %d", r.Outputs[0].CachedTokens, r.Cost.Tokens)
	}
}

func TestMultiTurnHitsOutputBlocks(t *testing.T) {
	e := NewEngine(Config{NumBlocks: 1000})
	turn1 := seqTokens(1, 40)
	must(t, e.Add(&Request{ID: "t1", Tokens: turn1, MaxTokens: 50}, 0))
	_, outs := run(t, e, 0)
	var reply []uint32
	for _, o := range outs["t1"] {
		reply = append(reply, o.Token)
	}
	turn2 := concat(turn1, reply, seqTokens(2, 30))
	must(t, e.Add(&Request{ID: "t2", Tokens: turn2, MaxTokens: 1}, 0))
	_, outs = run(t, e, 0)
	// Prompt and reply hold 90 tokens, 89 of them in KV (the last sampled
	// token is never fed back): 5 full blocks = 80 tokens.
	if got := outs["t2"][0].CachedTokens; got != 80 {
		t.Fatalf("second turn cached %d tokens, want 80", got)
	}
}

func TestDeterministicOutputs(t *testing.T) {
	gen := func(seed uint64, prompt []uint32) []uint32 {
		e := NewEngine(Config{NumBlocks: 100, Seed: seed})
		must(t, e.Add(&Request{ID: "a", Tokens: prompt, MaxTokens: 20}, 0))
		_, outs := run(t, e, 0)
		var toks []uint32
		for _, o := range outs["a"] {
			toks = append(toks, o.Token)
		}
		return toks
	}
	a, b := gen(1, seqTokens(1, 30)), gen(1, seqTokens(1, 30))
	if !slices.Equal(a, b) {
		t.Fatal("same prompt and seed gave different outputs")
	}
	if slices.Equal(a, gen(2, seqTokens(1, 30))) || slices.Equal(a, gen(1, seqTokens(2, 30))) {
		t.Fatal("outputs do not depend on seed and prompt")
	}
}

func TestChunkedPrefill(t *testing.T) {
	e := NewEngine(Config{NumBlocks: 1000, MaxNumBatchedTokens: 512})
	must(t, e.Add(&Request{ID: "long", Tokens: seqTokens(1, 2000), MaxTokens: 3}, 0))
	var chunks []int
	for {
		r := e.Step(0)
		if r.Cost.Tokens > 512 {
			t.Fatalf("step computed %d tokens over the 512 budget", r.Cost.Tokens)
		}
		chunks = append(chunks, r.Cost.Tokens)
		if len(r.Outputs) > 0 {
			if !r.Outputs[0].FirstToken {
				t.Fatal("first output not marked FirstToken")
			}
			break
		}
	}
	if !slices.Equal(chunks, []int{512, 512, 512, 464}) {
		t.Fatalf("prefill chunks %v, want [512 512 512 464]", chunks)
	}
	// A short request arriving mid-prefill shares the budget: decodes first.
	e = NewEngine(Config{NumBlocks: 1000, MaxNumBatchedTokens: 512})
	must(t, e.Add(&Request{ID: "short", Tokens: seqTokens(2, 10), MaxTokens: 100}, 0))
	e.Step(0)
	must(t, e.Add(&Request{ID: "long", Tokens: seqTokens(1, 2000), MaxTokens: 3}, 0))
	r := e.Step(0)
	if r.Cost.Tokens != 512 || len(r.Outputs) != 1 || r.Outputs[0].ID != "short" {
		t.Fatalf("mixed step: %d tokens, outputs %+v", r.Cost.Tokens, r.Outputs)
	}
}

func TestDecodeBatching(t *testing.T) {
	e := NewEngine(Config{NumBlocks: 1000})
	for i := range 8 {
		must(t, e.Add(&Request{ID: string(rune('a' + i)), Tokens: seqTokens(i, 20), MaxTokens: 5}, 0))
	}
	r := e.Step(0) // all 8 prefills fit the budget
	if r.Cost.Tokens != 160 || len(r.Outputs) != 8 {
		t.Fatalf("prefill step: %d tokens, %d outputs", r.Cost.Tokens, len(r.Outputs))
	}
	for range 4 {
		r = e.Step(0)
		if r.Cost.Tokens != 8 || len(r.Outputs) != 8 {
			t.Fatalf("decode step: %d tokens, %d outputs", r.Cost.Tokens, len(r.Outputs))
		}
	}
	for _, o := range r.Outputs {
		if !o.Finished || o.OutputTokens != 5 {
			t.Fatalf("output %+v, want finished after 5 tokens", o)
		}
	}
	if e.HasWork() || e.Stats().KVUsage != 0 {
		t.Fatal("engine not idle after all finished")
	}
}

func TestMaxNumSeqs(t *testing.T) {
	e := NewEngine(Config{NumBlocks: 1000, MaxNumSeqs: 3})
	for i := range 5 {
		must(t, e.Add(&Request{ID: string(rune('a' + i)), Tokens: seqTokens(i, 20), MaxTokens: 5}, 0))
	}
	e.Step(0)
	if st := e.Stats(); st.Running != 3 || st.Waiting != 2 {
		t.Fatalf("running %d waiting %d, want 3 and 2", st.Running, st.Waiting)
	}
	_, outs := run(t, e, 0)
	if len(outs) != 5 {
		t.Fatalf("%d requests finished, want 5", len(outs))
	}
}

func TestPreemptionTinyCache(t *testing.T) {
	// 24 blocks = 384 tokens; 12 requests each need up to 14 blocks.
	e := NewEngine(Config{NumBlocks: 24, MaxNumBatchedTokens: 256})
	for i := range 12 {
		must(t, e.Add(&Request{ID: string(rune('a' + i)), Tokens: seqTokens(i%3, 100+i), MaxTokens: 120}, 0))
	}
	outs := map[string][]Output{}
	for steps := 0; e.HasWork(); steps++ {
		if steps > 100_000 {
			t.Fatal("no progress: deadlock or livelock")
		}
		r := e.Step(0)
		for _, o := range r.Outputs {
			outs[o.ID] = append(outs[o.ID], o)
		}
		checkEngine(t, e)
	}
	if len(outs) != 12 {
		t.Fatalf("%d requests finished, want 12", len(outs))
	}
	for id, os := range outs {
		last := os[len(os)-1]
		if len(os) != 120 || !last.Finished || last.OutputTokens != 120 {
			t.Fatalf("%s: %d outputs, last %+v", id, len(os), last)
		}
		for i, o := range os {
			if o.FirstToken != (i == 0) {
				t.Fatalf("%s: FirstToken on output %d", id, i)
			}
		}
	}
	st := e.Stats()
	if st.Preemptions == 0 {
		t.Fatal("expected preemptions with a tiny cache")
	}
	if st.KVUsage != 0 || e.pool.numFree != 24 {
		t.Fatalf("blocks leaked: usage %v", st.KVUsage)
	}
	t.Logf("preemptions: %d", st.Preemptions)
}

func TestAbort(t *testing.T) {
	e := NewEngine(Config{NumBlocks: 100, MaxNumSeqs: 1})
	must(t, e.Add(&Request{ID: "a", Tokens: seqTokens(1, 100), MaxTokens: 50}, 0))
	must(t, e.Add(&Request{ID: "b", Tokens: seqTokens(2, 100), MaxTokens: 50}, 0))
	e.Step(0)
	if e.Stats().KVUsage == 0 {
		t.Fatal("running request holds no blocks")
	}
	e.Abort("b") // waiting
	e.Abort("a") // running
	e.Abort("zzz")
	if e.HasWork() || e.Stats().KVUsage != 0 {
		t.Fatalf("after aborts: %+v", e.Stats())
	}
	checkEngine(t, e)
	// The ID may be reused after it is aborted.
	must(t, e.Add(&Request{ID: "a", Tokens: seqTokens(1, 100), MaxTokens: 1}, 0))
	_, outs := run(t, e, 0)
	if outs["a"][0].CachedTokens != 96 {
		t.Fatalf("aborted request's blocks not cached: hit %d", outs["a"][0].CachedTokens)
	}
}

// TestRandomizedInvariants drives the engine with random arrivals, aborts and
// shared prefixes under memory pressure and checks block accounting each step.
func TestRandomizedInvariants(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	e := NewEngine(Config{NumBlocks: 64, MaxNumBatchedTokens: 128, MaxNumSeqs: 8})
	var live []string
	next := 0
	for step := 0; step < 20000; step++ {
		if rng.IntN(3) == 0 {
			id := string(rune('A'+next%26)) + string(rune('0'+next/26%10)) + string(rune('a'+next/260%26))
			next++
			prompt := concat(seqTokens(rng.IntN(4), rng.IntN(100)), seqTokens(10+next, 1+rng.IntN(200)))
			if err := e.Add(&Request{ID: id, Tokens: prompt, MaxTokens: 1 + rng.IntN(300), Extra: uint64(rng.IntN(2))}, 0); err == nil {
				live = append(live, id)
			} else if !errors.Is(err, ErrNoCapacity) && !errors.Is(err, ErrDuplicateID) {
				t.Fatal(err)
			}
		}
		if rng.IntN(20) == 0 && len(live) > 0 {
			i := rng.IntN(len(live))
			e.Abort(live[i]) // may already be finished: a no-op
			live = slices.Delete(live, i, i+1)
		}
		e.Step(0)
		checkEngine(t, e)
	}
	_, _ = run(t, e, 0)
	checkEngine(t, e)
	if e.pool.numFree != 64 {
		t.Fatalf("blocks leaked: %d free of 64", e.pool.numFree)
	}
	if st := e.Stats(); st.Preemptions == 0 || st.PrefixHits == 0 {
		t.Fatalf("test did not exercise preemption and prefix hits: %+v", st)
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
