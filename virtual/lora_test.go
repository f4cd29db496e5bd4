package virtual

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
)

// loraTrace returns n requests of a multi-adapter workload: each names one
// of adapters LoRA adapters (Zipf-distributed, s = 1.1, as S-LoRA's and
// dLoRA's evaluations skew adapter popularity), its prompt the adapter's
// 512-token system prompt and a unique 64–575-token question, 16–64
// output tokens; Poisson arrivals at rate requests per second.
func loraTrace(n, adapters int, rate float64, seed uint64, shared bool) ([]Request, []string) {
	rng := rand.New(rand.NewPCG(seed, 7))
	zipf := rand.NewZipf(rng, 1.1, 1, uint64(adapters-1))
	names := make([]string, adapters)
	for i := range names {
		names[i] = "lora-" + string(rune('a'+i))
	}
	reqs := make([]Request, n)
	var at time.Duration
	for i := range reqs {
		at += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		a := int(zipf.Uint64())
		sys := 512
		if !shared {
			sys = 0
		}
		toks := slices.Concat(seqTokens(1000+a, sys), seqTokens(5000+i, 64+rng.IntN(512)))
		reqs[i] = Request{Arrival: at, Tokens: toks, MaxTokens: 16 + rng.IntN(49), Adapter: names[a]}
	}
	return reqs, names
}

// loraRun replays reqs on engines engines serving adapters (max_loras 2
// per batch, 4 kept loaded) under policy, and returns its TTFT p50 and
// p90, prompt-cache hit rate and adapter loads.
func loraRun(t *testing.T, reqs []Request, adapters []string, engines int, policy string) (p50, p90 time.Duration, hit float64, loads int64) {
	t.Helper()
	cfg := Config{Engines: engines, Engine: sim.Config{LoRA: sim.LoRAConfig{Adapters: adapters, MaxLoras: 2, MaxCPULoras: 4}}}
	cfg.Routing.Policy = policy
	cfg.Routing.Profiles = map[string]sched.ProfileConfig{
		// cache-aware without the adapter parts: no adapter-capacity
		// filter, no lora scorer.
		"cache-aware-no-lora": {Filters: []string{sched.FilterModel, sched.FilterHotSpot},
			Scorers: []sched.ScorerConfig{{Type: sched.ScorerPrefix, Weight: 2}, {Type: sched.ScorerCost, Weight: 1}}},
		// Load alone (the cost scorer's estimated wait), and with the
		// adapter parts.
		"cost":      {Scorers: []sched.ScorerConfig{{Type: sched.ScorerCost, Weight: 1}}},
		"cost-lora": {Filters: []string{sched.FilterAdapterCapacity}, Scorers: []sched.ScorerConfig{{Type: sched.ScorerCost, Weight: 1}, {Type: sched.ScorerLoRA, Weight: 0.5}}},
	}
	f, err := NewFleet(cfg)
	if err != nil {
		t.Fatal(err)
	}
	res, err := f.Run(reqs)
	if err != nil {
		t.Fatal(err)
	}
	ttft := make([]time.Duration, 0, len(res))
	var prompt, cached int
	for i, r := range res {
		if r.Err != nil || r.OutputTokens != reqs[i].MaxTokens {
			t.Fatalf("%s: request %d: %v, %d tokens", policy, i, r.Err, r.OutputTokens)
		}
		ttft = append(ttft, r.FirstToken-r.Arrival)
		prompt, cached = prompt+r.PromptTokens, cached+r.CachedTokens
	}
	slices.Sort(ttft)
	for i := range engines {
		loads += f.engines[i].e.Stats().LoRALoads
	}
	return ttft[len(ttft)/2], ttft[len(ttft)*9/10], float64(cached) / float64(prompt), loads
}

// TestLoRAScorerVirtual compares, in virtual time, the default policy
// (cache-aware) with and without its adapter parts (adapter-capacity
// filter, lora scorer ×0.5), and load alone (cost) with and without them,
// on a skewed workload of 8 adapters over 4 engines that run 2 at a time
// (seeds 1–3), with and without per-adapter system prompts. With unique
// prompts the adapter parts must cut the adapter loads and TTFT p90 on
// every seed; with shared ones prefix affinity already keeps each
// adapter's requests together, and both variants must hit the adapter's
// cached system prompt (hashed under the adapter). Figures: go test -run
// TestLoRAScorerVirtual -v ./virtual (sim/README.md "LoRA adapters").
func TestLoRAScorerVirtual(t *testing.T) {
	workloads, seeds := []bool{false, true}, uint64(3)
	if raceEnabled { // single-goroutine replays, ~10x slower: the asserted core only
		workloads, seeds = []bool{false}, 1
	}
	type run struct {
		p50, p90 time.Duration
		hit      float64
		loads    int64
	}
	pairs := [][2]string{{sched.CacheAware, "cache-aware-no-lora"}, {"cost-lora", "cost"}}
	for _, shared := range workloads {
		for seed := uint64(1); seed <= seeds; seed++ {
			reqs, names := loraTrace(1500, 8, 12, seed, shared)
			for _, pair := range pairs {
				var got [2]run
				for k, policy := range pair {
					r := &got[k]
					r.p50, r.p90, r.hit, r.loads = loraRun(t, reqs, names, 4, policy)
					t.Logf("shared prompts %-5v seed %d  %-20s TTFT p50 %6.1f ms  p90 %7.1f ms  hit %4.1f%%  adapter loads %d",
						shared, seed, policy, float64(r.p50)/1e6, float64(r.p90)/1e6, 100*r.hit, r.loads)
				}
				with, without := got[0], got[1]
				switch {
				case !shared && (with.loads >= without.loads || with.p90 >= without.p90):
					t.Errorf("seed %d: %s loaded adapters %d times, TTFT p90 %v; %s %d, %v",
						seed, pair[0], with.loads, with.p90, pair[1], without.loads, without.p90)
				case shared && (with.hit < 0.5 || without.hit < 0.5):
					t.Errorf("seed %d: adapter system prompts hit %.2f and %.2f", seed, with.hit, without.hit)
				}
			}
		}
	}
}
