package virtual

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
)

// longPromptTrace returns n requests of 3k–12k-token prompts (a shared
// 1k-token prefix among four) with 40–120 output tokens, 0–300 ms apart: a
// load on which prefill chunks stall the decodes of aggregated engines.
func longPromptTrace(n int, seed uint64) []Request {
	rng := rand.New(rand.NewPCG(seed, 2))
	reqs := make([]Request, n)
	var at time.Duration
	for i := range reqs {
		at += time.Duration(rng.IntN(300)) * time.Millisecond
		toks := slices.Concat(seqTokens(1+rng.IntN(4), 1024), seqTokens(100+i, 2048+rng.IntN(9000)))
		reqs[i] = Request{Arrival: at, Tokens: toks, MaxTokens: 40 + rng.IntN(81)}
	}
	return reqs
}

func pdFleet(t *testing.T, prefill int, pd sched.PDConfig) *Fleet {
	t.Helper()
	f, err := NewFleet(Config{Engines: 4, Prefill: prefill, Routing: sched.Config{Policy: sched.CacheAware, PD: pd}})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func p99(xs []time.Duration) time.Duration {
	slices.Sort(xs)
	if len(xs) == 0 {
		return 0
	}
	return xs[(len(xs)-1)*99/100]
}

// A 2P2D fleet splits the long prompts: every request completes, its TTFT
// covers the prefill leg and the read, the prefill engines hold nothing at
// the end, and decodes no longer stall behind prefill chunks.
func TestPDFleetSplitsAndReleases(t *testing.T) {
	reqs := longPromptTrace(120, 1)
	agg := pdFleet(t, 0, sched.PDConfig{})
	ra, err := agg.Run(reqs)
	if err != nil {
		t.Fatal(err)
	}
	f := pdFleet(t, 2, sched.PDConfig{Threshold: 1024})
	res, err := f.Run(reqs)
	if err != nil {
		t.Fatal(err)
	}
	var itlAgg, itlPD []time.Duration
	split := 0
	for i := range res {
		r, a := &res[i], &ra[i]
		if r.Err != nil || a.Err != nil {
			t.Fatalf("request %d: %v / %v", i, r.Err, a.Err)
		}
		if r.OutputTokens != reqs[i].MaxTokens || r.Engine < 2 {
			t.Fatalf("request %d: %d tokens on engine %d (decode engines are 2 and 3)", i, r.OutputTokens, r.Engine)
		}
		itlAgg, itlPD = append(itlAgg, a.ITL...), append(itlPD, r.ITL...)
		if r.Prefill < 0 {
			if r.PDReason != sched.PDReasonShort {
				t.Fatalf("request %d whole for %q", i, r.PDReason)
			}
			continue
		}
		split++
		if r.Prefill > 1 || !(r.Arrival < r.HandOff && r.HandOff < r.Transferred && r.Transferred < r.FirstToken) {
			t.Fatalf("request %d: P %d, arrival %v hand-off %v read %v first token %v", i, r.Prefill, r.Arrival, r.HandOff, r.Transferred, r.FirstToken)
		}
		if r.TransferredTokens < 1 || r.CachedTokens >= r.PromptTokens {
			t.Fatalf("request %d: transferred %d, cached (P's) %d of %d", i, r.TransferredTokens, r.CachedTokens, r.PromptTokens)
		}
	}
	if split < len(reqs)/2 {
		t.Fatalf("only %d of %d long prompts split", split, len(reqs))
	}
	for i, st := range f.Stats() {
		if st.HeldBlocks != 0 || st.HeldRequests != 0 || st.HeldExpired != 0 {
			t.Fatalf("engine %d after the run: %d requests' %d blocks held, %d expired", i, st.HeldRequests, st.HeldBlocks, st.HeldExpired)
		}
		if i < 2 && st.HeldReleased == 0 {
			t.Fatalf("prefill engine %d released nothing", i)
		}
	}
	if a, p := p99(itlAgg), p99(itlPD); p*2 > a {
		t.Fatalf("ITL p99: P/D %v, aggregated %v: want at most half", p, a)
	}
	// Deterministic: the same fleet again gives the same results.
	again, _ := pdFleet(t, 2, sched.PDConfig{Threshold: 1024}).Run(reqs)
	for i := range res {
		if again[i].FirstToken != res[i].FirstToken || again[i].Prefill != res[i].Prefill {
			t.Fatalf("request %d differs between two identical runs", i)
		}
	}
}

// Always-split and local=any: every request splits; with local=any short
// requests may run whole on a prefill engine.
func TestPDFleetDeciders(t *testing.T) {
	reqs := longPromptTrace(40, 3)
	res, err := pdFleet(t, 1, sched.PDConfig{Threshold: -1}).Run(reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i := range res {
		if res[i].Prefill != 0 || res[i].Err != nil {
			t.Fatalf("always-split request %d: P %d, %v", i, res[i].Prefill, res[i].Err)
		}
	}
	res, err = pdFleet(t, 2, sched.PDConfig{Threshold: 1 << 20, Local: sched.PDLocalAny}).Run(reqs)
	if err != nil {
		t.Fatal(err)
	}
	onPrefill := 0
	for i := range res {
		if res[i].Prefill >= 0 || res[i].Err != nil {
			t.Fatalf("never-split request %d: P %d, %v", i, res[i].Prefill, res[i].Err)
		}
		if res[i].Engine < 2 {
			onPrefill++
		}
	}
	if onPrefill == 0 {
		t.Fatal("local=any put no whole request on a prefill engine")
	}
}

func TestPDFleetConfig(t *testing.T) {
	for _, c := range []Config{
		{Engines: 2, Prefill: 2},
		{Engines: 2, Prefill: -1},
		{Engines: 3, Prefill: 1, Policy: mustPolicy(t)},
		{Engines: 2, Prefill: 1, Engine: sim.Config{Profile: sim.Profiles()["tiny-llama-cpu-ollama"]}},
	} {
		if _, err := NewFleet(c); err == nil {
			t.Errorf("NewFleet(%+v) accepted", c)
		}
	}
}

func mustPolicy(t *testing.T) sched.Policy {
	p, err := sched.NewPolicy(sched.Config{Policy: sched.RoundRobin}, sched.Pool{Capacity: []int{1, 1, 1}})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// A decode budget (sim.PDConfig.DecodeMaxNumBatchedTokens) applies to the
// decode engines only; prefill engines keep the fleet's.
func TestPDFleetDecodeBudget(t *testing.T) {
	f, err := NewFleet(Config{Engines: 4, Prefill: 1, Engine: sim.Config{PD: sim.PDConfig{DecodeMaxNumBatchedTokens: 256}},
		Routing: sched.Config{Policy: sched.CacheAware, PD: sched.PDConfig{PrefillBusy: sched.PDBusyCost}}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range f.engines {
		want := sim.DefaultMaxNumBatchedTokens
		if i >= 1 {
			want = 256
		}
		if got := f.engines[i].e.Config().MaxNumBatchedTokens; got != want {
			t.Fatalf("engine %d budget %d, want %d", i, got, want)
		}
	}
	reqs := longPromptTrace(40, 5)
	res, err := f.Run(reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i := range res {
		if res[i].Err != nil || res[i].Engine < 1 || res[i].OutputTokens != reqs[i].MaxTokens {
			t.Fatalf("request %d: engine %d, %d of %d tokens, %v", i, res[i].Engine, res[i].OutputTokens, reqs[i].MaxTokens, res[i].Err)
		}
	}
}
