package sim

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"
)

func pdEngine(t *testing.T, abort time.Duration) *Engine {
	t.Helper()
	return NewEngine(Config{NumBlocks: 64, PD: PDConfig{AbortTimeout: abort}})
}

// A prefill request's blocks outlive it until Release, Abort or the abort
// timeout, counted in KV usage.
func TestPrefillHoldsBlocksForDecode(t *testing.T) {
	e := pdEngine(t, time.Minute)
	prompt := seqTokens(0, 100) // 7 blocks: 6 full, 1 partial
	must(t, e.Add(&Request{ID: "p", Tokens: prompt, MaxTokens: 1, HoldKV: true}, 0))
	end, outs := run(t, e, 0)
	if o := outs["p"]; len(o) != 1 || !o[0].Finished {
		t.Fatalf("prefill leg outputs %+v", o)
	}
	st := e.Stats()
	if st.HeldRequests != 1 || st.HeldBlocks != 7 || st.KVUsage == 0 || !e.Holds("p") {
		t.Fatalf("after the prefill leg: %+v", st)
	}
	checkEngine(t, e)
	ids := e.HeldBlockIDs("p")
	if len(ids) != 7 || e.HeldBlockIDs("nope") != nil {
		t.Fatalf("HeldBlockIDs = %v", ids)
	}
	for i, id := range ids {
		if b := e.pool.blocks[id]; b.ref != 1 || b.cached != (i < 6) {
			t.Fatalf("held block %d (id %d): %+v", i, id, b)
		}
	}
	ids[0] = -1 // a copy
	if e.HeldBlockIDs("p")[0] == -1 {
		t.Fatal("HeldBlockIDs returned the engine's own slice")
	}
	if err := e.Add(&Request{ID: "p", Tokens: prompt, MaxTokens: 1}, end); !errors.Is(err, ErrDuplicateID) {
		t.Fatalf("re-adding a held id: %v", err)
	}
	if !e.Release("p") || e.Release("p") {
		t.Fatal("Release: want true once, then false")
	}
	st = e.Stats()
	if st.HeldRequests != 0 || st.HeldBlocks != 0 || st.KVUsage != 0 || st.HeldReleased != 1 {
		t.Fatalf("after Release: %+v", st)
	}
	checkEngine(t, e)
	// The prompt's full blocks stay in the prefix cache.
	if got := len(e.pool.index); got != 6 {
		t.Fatalf("%d blocks cached after release, want 6", got)
	}

	// Abort releases held blocks; the timeout expires them.
	must(t, e.Add(&Request{ID: "q", Tokens: seqTokens(500, 40), MaxTokens: 1, HoldKV: true}, end))
	end, _ = run(t, e, end)
	e.Abort("q")
	if e.Stats().HeldBlocks != 0 || e.Stats().HeldReleased != 2 {
		t.Fatalf("Abort of a held request: %+v", e.Stats())
	}
	must(t, e.Add(&Request{ID: "r", Tokens: seqTokens(900, 40), MaxTokens: 1, HoldKV: true}, end))
	end, _ = run(t, e, end)
	if at, ok := e.NextHeldExpiry(); !ok || at != end+time.Minute {
		t.Fatalf("NextHeldExpiry = %v, %v; want %v", at, ok, end+time.Minute)
	}
	if n := e.ExpireHeld(end + time.Minute - 1); n != 0 {
		t.Fatal("expired before the timeout")
	}
	if n := e.ExpireHeld(end + time.Minute); n != 1 || e.Stats().HeldExpired != 1 || e.Stats().HeldBlocks != 0 {
		t.Fatalf("ExpireHeld at the timeout: %d, %+v", n, e.Stats())
	}
	checkEngine(t, e)
}

// A decode request reads the prompt's blocks at the interconnect's
// bandwidth, recomputes one token, and reports prompt − 1 cached tokens.
func TestDecodeReadsPromptFromPrefill(t *testing.T) {
	d := pdEngine(t, 0)
	cfg := d.Config()
	prompt := seqTokens(0, 1000) // 63 blocks: 62 full, 1 partial
	must(t, d.Add(&Request{ID: "x", Tokens: prompt, MaxTokens: 4, RemotePrefill: true}, 0))
	r := d.Step(0)
	if r.Duration != 0 || len(r.Outputs) != 0 || d.Stats().Loading != 1 {
		t.Fatalf("first step: %+v, %+v", r, d.Stats())
	}
	at, ok := d.NextLoad()
	p := cfg.Profile
	want := p.KVTransferLatency + time.Duration(63*cfg.BlockBytes()/p.KVTransferBandwidth*float64(time.Second))
	if !ok || at != want {
		t.Fatalf("read ends at %v, want %v", at, want)
	}
	checkEngine(t, d)
	r = d.Step(at)
	if len(r.Transferred) != 1 || r.Transferred[0] != "x" {
		t.Fatalf("Transferred = %v", r.Transferred)
	}
	if len(r.Outputs) != 1 || !r.Outputs[0].FirstToken || r.Cost.Tokens != 1 {
		t.Fatalf("after the read, one token is recomputed and sampled: %+v cost %+v", r.Outputs, r.Cost)
	}
	o := r.Outputs[0]
	if o.CachedTokens != 999 || o.TransferredTokens != 999 || o.TierTokens[TierGPU] != 0 {
		t.Fatalf("usage: cached %d transferred %d gpu %d", o.CachedTokens, o.TransferredTokens, o.TierTokens[TierGPU])
	}
	if got := len(d.pool.index); got != 62 {
		t.Fatalf("%d read blocks cached, want the 62 full ones", got)
	}
	end, _ := run(t, d, at+r.Duration)
	if st := d.Stats(); st.TransferredBlocks != 63 || st.PrefillTokens > 1 {
		t.Fatalf("stats %+v", st)
	}
	checkEngine(t, d)

	// A second request sharing 31 full blocks reads only the rest.
	must(t, d.Add(&Request{ID: "y", Tokens: concat(prompt[:496], seqTokens(5000, 504)), MaxTokens: 2, RemotePrefill: true}, end))
	_, outs := run(t, d, end)
	if o := outs["y"][0]; o.TierTokens[TierGPU] != 496 || o.TransferredTokens != 999-496 {
		t.Fatalf("partial local hit: %+v", o)
	}
	if st := d.Stats(); st.TransferredBlocks != 63+32 {
		t.Fatalf("transferred %d blocks, want %d", st.TransferredBlocks, 63+32)
	}

	// Reading costs far less than computing.
	agg := pdEngine(t, 0)
	must(t, agg.Add(&Request{ID: "x", Tokens: prompt, MaxTokens: 1}, 0))
	aggEnd, _ := run(t, agg, 0)
	if at+r.Duration >= aggEnd {
		t.Fatalf("read+1 token %v, not faster than computing the prompt %v", at+r.Duration, aggEnd)
	}

	cpu := NewEngine(Config{Profile: Profiles()["tiny-llama-cpu-ollama"]})
	if err := cpu.Add(&Request{ID: "z", Tokens: prompt[:10], MaxTokens: 1, RemotePrefill: true}, 0); !errors.Is(err, ErrNoInterconnect) {
		t.Fatalf("remote prefill without an interconnect: %v", err)
	}
}

// Prefill and decode requests mixed with ordinary ones, with releases and
// aborts at random: the block accounting holds throughout.
func TestPDRandomizedInvariants(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	e := NewEngine(Config{NumBlocks: 48, MaxNumBatchedTokens: 64, PD: PDConfig{AbortTimeout: 50 * time.Millisecond}})
	now := time.Duration(0)
	held := []string{}
	for i := range 400 {
		id := string(rune('A'+i%26)) + string(rune('a'+i/26))
		req := &Request{ID: id, Tokens: seqTokens(rng.IntN(4)*64, 1+rng.IntN(120)), MaxTokens: 1 + rng.IntN(8)}
		switch rng.IntN(3) {
		case 0:
			req.HoldKV, req.MaxTokens = true, 1
		case 1:
			req.RemotePrefill = true
		}
		if err := e.Add(req, now); err != nil && !errors.Is(err, ErrNoCapacity) {
			t.Fatal(err)
		}
		if req.HoldKV {
			held = append(held, id)
		}
		for range rng.IntN(4) {
			r := e.Step(now)
			now += r.Duration
			if at, ok := e.NextLoad(); ok && r.Duration == 0 {
				now = max(now, at)
			}
			checkEngine(t, e)
		}
		if len(held) > 0 && rng.IntN(3) == 0 {
			k := rng.IntN(len(held))
			if rng.IntN(2) == 0 {
				e.Release(held[k])
			} else {
				e.Abort(held[k])
			}
			held = append(held[:k], held[k+1:]...)
			checkEngine(t, e)
		}
	}
	run(t, e, now)
	e.ExpireHeld(now + time.Hour)
	checkEngine(t, e)
	if st := e.Stats(); st.HeldBlocks != 0 || st.KVUsage != 0 {
		t.Fatalf("after draining and expiry: %+v", st)
	}
}

// ForDecode gives a decode engine its own token budget; the budget rule
// keeps the mixed step within the ITL and is the largest such.
func TestDecodeTokenBudget(t *testing.T) {
	c := Config{MaxNumBatchedTokens: 4096, PD: PDConfig{DecodeMaxNumBatchedTokens: 384}}
	if got := c.ForDecode().MaxNumBatchedTokens; got != 384 {
		t.Fatalf("ForDecode budget %d, want 384", got)
	}
	if got := (Config{MaxNumBatchedTokens: 4096}).ForDecode().MaxNumBatchedTokens; got != 4096 {
		t.Fatalf("ForDecode without a decode budget: %d, want 4096", got)
	}
	if err := (Config{PD: PDConfig{DecodeMaxNumBatchedTokens: -1}}).Validate(); err == nil {
		t.Fatal("negative decode_max_num_batched_tokens accepted")
	}
	p := DefaultProfile()
	step := func(decodes, chunk, ctx int) time.Duration {
		var c StepCost
		for range decodes {
			c.Add(1, 12000)
		}
		c.Add(chunk, ctx)
		return p.StepTime(c)
	}
	prev := 0
	for _, itl := range []time.Duration{50 * time.Millisecond, 75 * time.Millisecond, 100 * time.Millisecond} {
		b := DecodeTokenBudget(p, itl, 32, 12000, 64000)
		if chunk := b - 32; chunk < 1 || step(32, chunk, 64000) > itl || step(32, chunk+1, 64000) <= itl {
			t.Fatalf("ITL %v: budget %d is not the largest within it", itl, b)
		}
		if b <= prev {
			t.Fatalf("ITL %v: budget %d not above %d", itl, b, prev)
		}
		prev = b
	}
	// Longer context, smaller chunk.
	if a, b := DecodeTokenBudget(p, 100*time.Millisecond, 32, 12000, 8000), DecodeTokenBudget(p, 100*time.Millisecond, 32, 12000, 64000); a <= b {
		t.Fatalf("budget at 8k context %d, at 64k %d", a, b)
	}
	// The table in sim/README.md ("Disaggregated prefill and decode").
	for _, ctx := range []int{8000, 32000, 64000, 100000} {
		t.Logf("32 decodes of 12k tokens, chunk after %d tokens: budget %d (50 ms), %d (75 ms), %d (100 ms)", ctx,
			DecodeTokenBudget(p, 50*time.Millisecond, 32, 12000, ctx), DecodeTokenBudget(p, 75*time.Millisecond, 32, 12000, ctx),
			DecodeTokenBudget(p, 100*time.Millisecond, 32, 12000, ctx))
	}
	for _, chunk := range []int{256, 384, 512, 8192} {
		var c StepCost
		c.Add(chunk, 8000)
		t.Logf("a %d-token chunk after 8000 tokens alone: %v, %.0f tokens/s", chunk, p.StepTime(c), float64(chunk)/p.StepTime(c).Seconds())
	}
	// No room: the decodes alone overrun it.
	if got := DecodeTokenBudget(p, time.Millisecond, 32, 12000, 0); got != 32 {
		t.Fatalf("1 ms: %d, want 32", got)
	}
}
