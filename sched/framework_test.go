package sched

import (
	"math"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/infergate/infergate/prefix"
)

func newProfileT(t testing.TB, cfg Config, pool Pool) *Profile {
	t.Helper()
	p, err := NewPolicy(cfg, pool)
	if err != nil {
		t.Fatal(err)
	}
	if s, ok := p.(stateless); ok {
		return s.p
	}
	pr, ok := p.(*Profile)
	if !ok {
		t.Fatalf("%s is %T, not a profile", cfg.Policy, p)
	}
	return pr
}

func caps(n, c int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = c
	}
	return out
}

func only(name string, sc ...ScorerConfig) Config {
	return Config{Policy: name, Profiles: map[string]ProfileConfig{name: {Scorers: sc}}}
}

func TestProfileConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		pc   ProfileConfig
		want string
	}{
		{"noscorer", ProfileConfig{}, "no scorers"},
		{"badfilter", ProfileConfig{Filters: []string{"x"}, Scorers: []ScorerConfig{{Type: ScorerQueue, Weight: 1}}}, `unknown filter "x"`},
		{"badscorer", ProfileConfig{Scorers: []ScorerConfig{{Type: "y", Weight: 1}}}, `unknown scorer "y"`},
		{"badweight", ProfileConfig{Scorers: []ScorerConfig{{Type: ScorerQueue, Weight: -1}}}, "weight -1"},
		{"nanweight", ProfileConfig{Scorers: []ScorerConfig{{Type: ScorerQueue, Weight: math.NaN()}}}, "weight NaN"},
		{"badpicker", ProfileConfig{Scorers: []ScorerConfig{{Type: ScorerQueue, Weight: 1}}, Picker: "z"}, `unknown picker "z"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewPolicy(Config{Policy: "p", Profiles: map[string]ProfileConfig{"p": tc.pc}}, Pool{Capacity: caps(2, 10)})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), `"p"`) {
				t.Fatalf("err = %v, want it to name the profile and contain %q", err, tc.want)
			}
		})
	}
	if _, err := NewPolicy(Config{Policy: PrecisePrefix}, Pool{Capacity: caps(2, 10)}); err == nil || !strings.Contains(err.Error(), "KV events") {
		t.Fatalf("precise-prefix without an index: %v", err)
	}
	if err := Validate(Config{Policy: PrecisePrefix}); err != nil {
		t.Fatalf("Validate(precise-prefix) = %v", err)
	}
	if err := Validate(Config{Policy: "nope"}); err == nil {
		t.Fatal("Validate accepted an unknown policy")
	}
}

func TestProfileYAML(t *testing.T) {
	src := `
policy: mine
hot_spot: {abs: 3, rel: 1.5}
session: {max_sessions: 10}
cost: {prefill_tokens_per_second: 5000}
profiles:
  mine:
    filters: [model, adapter-capacity, hot-spot]
    scorers:
      - {type: prefix, weight: 2}
      - {type: session, weight: 3}
      - {type: cost, weight: 1}
      - {type: queue, weight: 0.5}
      - {type: kv-utilization, weight: 0.5}
      - {type: in-flight-tokens, weight: 0.5}
      - {type: lora, weight: 1}
    picker: power-of-two
`
	var cfg Config
	dec := yaml.NewDecoder(strings.NewReader(src))
	dec.KnownFields(true)
	if err := dec.Decode(&cfg); err != nil {
		t.Fatal(err)
	}
	p := newProfileT(t, cfg, Pool{Capacity: caps(4, 100)})
	if p.Name() != "mine" || !p.NeedsHashes() || len(p.filters) != 3 || len(p.scorers) != 7 || p.picker.Name() != PickerPowerOfTwo {
		t.Fatalf("profile %+v", p)
	}
	if h := p.filters[2].(hotSpotFilter).cfg; h.Abs != 3 || h.Rel != 1.5 {
		t.Fatalf("hot spot %+v", h)
	}
	if UsesPrecise(cfg) || !UsesPrecise(Config{Policy: PrecisePrefix}) {
		t.Fatal("UsesPrecise")
	}
}

func TestFilters(t *testing.T) {
	eps := []Endpoint{
		{Ready: true, Models: []string{"a1", "m"}, Adapters: []string{"a1"}, MaxAdapters: 1, InFlight: 20},
		{Ready: true, Models: nil, Adapters: []string{"a2"}, MaxAdapters: 1, InFlight: 5},
		{Ready: true, Models: []string{"other"}, InFlight: 0},
		{Ready: true, Adapters: nil, MaxAdapters: 2, InFlight: 9},
	}
	c := &Cycle{Req: &Request{Model: "m", Adapter: "a1"}, Eps: eps}
	got := modelFilter{}.Filter(c, []int{0, 1, 2, 3})
	if want := []int{0, 1, 3}; !equalInts(got, want) {
		t.Fatalf("model filter %v, want %v", got, want)
	}
	got = adapterCapacityFilter{}.Filter(c, []int{0, 1, 3})
	if want := []int{0, 3}; !equalInts(got, want) {
		t.Fatalf("adapter filter %v, want %v", got, want)
	}
	// Preference: nobody fits → keep all.
	c.Req.Adapter = "a3"
	if got = (adapterCapacityFilter{}).Filter(c, []int{0, 1}); !equalInts(got, []int{0, 1}) {
		t.Fatalf("adapter filter emptied the set: %v", got)
	}
	c.Req.Adapter = ""
	got = hotSpotFilter{cfg: HotSpotConfig{Abs: 8, Rel: 2}}.Filter(c, []int{0, 1, 2, 3})
	// Least loaded 0: 20 and 9 exceed it by more than 8 (and 2×0) → hot.
	if want := []int{1, 2}; !equalInts(got, want) {
		t.Fatalf("hot spot %v, want %v", got, want)
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestScorers(t *testing.T) {
	eps := []Endpoint{
		{Ready: true, InFlight: 4, InFlightTokens: 400, Metrics: true, Waiting: 2, KVUtil: 0.9, Adapters: []string{"a"}, MaxAdapters: 1, PendingPrefillTokens: 0},
		{Ready: true, InFlight: 0, InFlightTokens: 0, Metrics: true, Waiting: 0, KVUtil: 0.1, MaxAdapters: 1, PendingPrefillTokens: 3000},
		{Ready: true, InFlight: 2, InFlightTokens: 200, Metrics: false, Adapters: []string{"b"}, MaxAdapters: 1, PendingPrefillTokens: 1000},
	}
	cands := []int{0, 1, 2}
	sc := make([]float64, 3)
	p := newProfileT(t, only("x", ScorerConfig{Type: ScorerPrefix, Weight: 1}, ScorerConfig{Type: ScorerCost, Weight: 1}), Pool{Capacity: caps(3, 1000)})
	toks := tokens(160, 1)
	r := &Request{Hashes: prefix.Hashes(nil, toks, 16, 0), PromptTokens: 160, Adapter: "a"}
	p.scorers[0].Scorer.(*prefixScorer).ix.Insert(0, r.Hashes[:5])
	c := &Cycle{p: p, Req: r, Eps: eps, matched: make([]int, 3), other: make([]int, 3)}

	check := func(name string, s Scorer, want ...float64) {
		t.Helper()
		s.Score(c, cands, sc)
		for k := range want {
			if math.Abs(sc[k]-want[k]) > 1e-9 {
				t.Fatalf("%s scores %v, want %v", name, sc, want)
			}
		}
	}
	check("queue", queueScorer{}, 0, 1, 0.5) // one endpoint without metrics: in flight 4, 0, 2 for all
	check("kv", kvUtilScorer{}, 0.1, 0.9, 0) // the one without metrics unscored
	check("tokens", inFlightTokensScorer{}, 0, 1, 0.5)
	check("lora", loraScorer{}, 1, 0.5, 0)
	check("prefix", p.scorers[0].Scorer, 0.5, 0, 0)
	// cost: own = 160−80 = 80 on 0; 160 on 1 (+3000), 160 on 2 (+1000).
	check("cost", p.scorers[1].Scorer, 1, 80.0/3160, 80.0/1160)
	// With every endpoint's rate known, time replaces tokens: endpoint 1
	// is 40× faster, so its 3,160 tokens take less time than 0's 80.
	eps[0].PrefillTokensPerSecond, eps[1].PrefillTokensPerSecond, eps[2].PrefillTokensPerSecond = 1000, 40000, 1000
	check("cost-rates", p.scorers[1].Scorer, (3160.0/40000)/(80.0/1000), 1, (3160.0/40000)/(1160.0/1000))
	eps[2].PrefillTokensPerSecond = 0 // one unknown: all use the default
	check("cost-partial", p.scorers[1].Scorer, 1, 80.0/3160, 80.0/1160)

	ss := &sessionScorer{table: newSessionTable(2)}
	c.Req.SessionKey = "s1"
	check("session-first", ss, 0, 0, 0)
	ss.Learn(c, 2)
	check("session-home", ss, 0, 0, 1)
	ss.forget(2)
	check("session-forgot", ss, 0, 0, 0)
	ss.Learn(c, 1)
	for _, k := range []string{"s2", "s3"} { // capacity 2: s1 evicted
		c.Req.SessionKey = k
		ss.Learn(c, 0)
	}
	c.Req.SessionKey = "s1"
	check("session-evicted", ss, 0, 0, 0)
	c.Req.SessionKey = "s3"
	check("session-kept", ss, 1, 0, 0)
}

func TestPickers(t *testing.T) {
	p := newProfileT(t, only("x", ScorerConfig{Type: ScorerQueue, Weight: 1}), Pool{Capacity: caps(4, 10)})
	c := &Cycle{p: p}
	cands := []int{0, 1, 2, 3}
	counts := make([]int, 4)
	for range 4000 {
		counts[maxScorePicker{}.Pick(c, cands, []float64{0.2, 0.9, 0.9, 0.1})]++
	}
	if counts[0]+counts[3] != 0 || counts[1] < 1800 || counts[2] < 1800 {
		t.Fatalf("max-score tie-break %v", counts)
	}
	clear(counts)
	for range 10000 {
		counts[weightedRandomPicker{}.Pick(c, cands, []float64{1, 3, 0, 0})]++
	}
	if counts[2]+counts[3] != 0 || counts[1] < 7200 || counts[1] > 7800 {
		t.Fatalf("weighted random %v (want ≈ 2500/7500)", counts)
	}
	clear(counts)
	for range 12000 {
		counts[powerOfTwoPicker{}.Pick(c, cands, []float64{0, 1, 2, 3})]++
	}
	// P(pick k) = P(k sampled and the other lower): 0, 1/6, 2/6, 3/6.
	for k, want := range []float64{0, 2000, 4000, 6000} {
		if math.Abs(float64(counts[k])-want) > 400 {
			t.Fatalf("power of two %v", counts)
		}
	}
	if (maxScorePicker{}).Pick(c, nil, nil) != -1 || (weightedRandomPicker{}).Pick(c, nil, nil) != -1 || (powerOfTwoPicker{}).Pick(c, nil, nil) != -1 {
		t.Fatal("pickers on no candidates")
	}
}

// TestMaxScorePickerPreferred: a Preferred endpoint (a replica's share)
// within PreferredTolerance of the best total is taken instead of it;
// one further off is not; without Preferred endpoints the best wins.
func TestMaxScorePickerPreferred(t *testing.T) {
	p := newProfileT(t, only("x", ScorerConfig{Type: ScorerQueue, Weight: 1}), Pool{Capacity: caps(4, 10)})
	eps := make([]Endpoint, 4)
	c := &Cycle{p: p, Eps: eps}
	cands := []int{0, 1, 2, 3}
	pick := func(total ...float64) int { return maxScorePicker{tol: DefaultTieTolerance}.Pick(c, cands, total) }
	if k := pick(1, 0.9, 0.5, 0.2); k != 0 {
		t.Fatalf("no preference: picked %d, want the best (0)", k)
	}
	eps[1].Preferred, eps[3].Preferred = true, true
	for range 100 {
		if k := pick(1, 1-PreferredTolerance+0.01, 0.5, 0.2); k != 1 {
			t.Fatalf("preferred 1 within the margin: picked %d, want 1", k)
		}
		if k := pick(1, 1-PreferredTolerance-0.01, 0.5, 0.2); k != 0 {
			t.Fatalf("preferred 1 beyond the margin: picked %d, want the best (0)", k)
		}
		if k := pick(0.5, 1, 0.2, 0.9); k != 1 {
			t.Fatalf("preferred 1 best: picked %d", k)
		}
	}
}

func TestProfileNoReady(t *testing.T) {
	for _, name := range []string{PowerOfTwo, CacheAware} {
		p := newProfileT(t, Config{Policy: name}, Pool{Capacity: caps(3, 10)})
		eps := ready(3)
		for i := range eps {
			eps[i].Ready = false
		}
		if d := p.Pick(req(tokens(64, 1)), eps); d.Endpoint != -1 {
			t.Fatalf("%s picked %d with nothing ready", name, d.Endpoint)
		}
		eps[1].Ready = true
		if d := p.Pick(req(tokens(64, 1)), eps); d.Endpoint != 1 {
			t.Fatalf("%s picked %d, only 1 is ready", name, d.Endpoint)
		}
	}
	// The model filter is hard: nobody serves the model → no pick.
	p := newProfileT(t, Config{Policy: CacheAware}, Pool{Capacity: caps(2, 10)})
	eps := ready(2)
	eps[0].Models, eps[1].Models = []string{"a"}, []string{"b"}
	if d := p.Pick(&Request{Model: "c"}, eps); d.Endpoint != -1 {
		t.Fatalf("picked %d for an unserved model", d.Endpoint)
	}
}

func TestCacheAwareFollowsSessions(t *testing.T) {
	p := newProfileT(t, Config{Policy: CacheAware}, Pool{Capacity: caps(4, 10000)})
	eps := ready(4)
	home := make([]int, 8)
	sessions := make([][]uint32, 8)
	for s := range sessions {
		sessions[s] = tokens(1600, uint32(s)*100000)
		d := p.Pick(req(sessions[s]), eps)
		home[s] = d.Endpoint
		eps[d.Endpoint].InFlight++
	}
	for s := range sessions {
		follow := append(append([]uint32{}, sessions[s]...), tokens(200, 7)...)
		d := p.Pick(req(follow), eps)
		if d.Endpoint != home[s] || d.MatchedBlocks != 100 {
			t.Fatalf("session %d → %d (matched %d), home %d", s, d.Endpoint, d.MatchedBlocks, home[s])
		}
	}
	// Forget drops the index: the session no longer matches.
	p.Forget(home[0])
	follow := append(append([]uint32{}, sessions[0]...), tokens(200, 7)...)
	if d := p.Pick(req(follow), eps); d.MatchedBlocks != 0 && d.Endpoint == home[0] {
		t.Fatalf("matched %d after Forget", d.MatchedBlocks)
	}
}

// TestHotSpotSkewedWorkload: 90% of requests share one 8k-token prefix (then
// a short unique suffix), 10% are unique. Requests stay in flight for 32
// arrivals. Without the hot-spot filter the cache-aware profile piles the
// shared-prefix requests on the first endpoint that held the prefix; with it,
// no endpoint takes more than its fair share plus a small margin.
func TestHotSpotSkewedWorkload(t *testing.T) {
	const (
		n        = 8
		requests = 4000
		life     = 32
	)
	shared := tokens(8192, 1)
	run := func(filters []string) (maxShare float64, counts []int) {
		cfg := Config{Policy: "p", Seed: 7, HotSpot: HotSpotConfig{Abs: 2, Rel: 1.5}, Profiles: map[string]ProfileConfig{"p": {
			Filters: filters,
			Scorers: []ScorerConfig{{Type: ScorerPrefix, Weight: 1}, {Type: ScorerCost, Weight: 1}},
		}}}
		p := newProfileT(t, cfg, Pool{Capacity: caps(n, 100000)})
		eps := ready(n)
		counts = make([]int, n)
		type inflight struct{ ep, pending int }
		var q []inflight
		toks := make([]uint32, 0, 8192+64)
		for i := range requests {
			toks = toks[:0]
			if i%10 != 9 {
				toks = append(toks, shared...)
			} else {
				toks = append(toks, tokens(8192, uint32(i)*10000+500000)...)
			}
			toks = append(toks, tokens(64, uint32(i)*1000+90000000)...)
			r := req(toks)
			d := p.Pick(r, eps)
			counts[d.Endpoint]++
			pend := len(toks) - 16*d.MatchedBlocks
			eps[d.Endpoint].InFlight++
			eps[d.Endpoint].PendingPrefillTokens += pend
			q = append(q, inflight{d.Endpoint, pend})
			if len(q) > life {
				f := q[0]
				q = q[1:]
				eps[f.ep].InFlight--
				eps[f.ep].PendingPrefillTokens -= f.pending
			}
		}
		for _, c := range counts {
			maxShare = max(maxShare, float64(c)/requests)
		}
		return maxShare, counts
	}
	unprotected, uc := run(nil)
	protected, pc := run([]string{FilterHotSpot})
	t.Logf("max share without hot-spot filter %.3f %v; with %.3f %v (fair %.3f)", unprotected, uc, protected, pc, 1.0/n)
	// Fair share 1/8 = 12.5%; in-flight per endpoint is held within
	// max(abs, (rel−1)·least) = 2 of the least loaded (of 32 in flight, 4
	// each), so the share may exceed fair by about 2/32 at most.
	if margin := 1.0/n + 2.0/life; protected > margin {
		t.Fatalf("with the hot-spot filter an endpoint took %.3f of requests (fair share + margin = %.3f): %v", protected, margin, pc)
	}
	if unprotected < 0.3 {
		t.Fatalf("test workload is not skewed enough: without the filter max share is only %.3f", unprotected)
	}
}

func TestProfileAllocFree(t *testing.T) {
	if raceEnabled {
		t.Skip("sync.Pool drops items under the race detector")
	}
	// Pick queues its learning and Settle applies it, as the gateway's
	// settler goroutine and the virtual fleet do; without it the queue fills
	// after 21 Picks of this prompt and Learn inserts inline, into an
	// endpoint whose tables may still grow. Warm: every endpoint the picks
	// spread to holds the prompt.
	for _, name := range []string{CacheAware, CacheAwareTTFT} {
		p := newProfileT(t, Config{Policy: name}, Pool{Capacity: caps(16, 100000)})
		eps := ready(16)
		r := req(tokens(12000, 1))
		for range 64 {
			p.Pick(r, eps)
			p.Settle()
		}
		if n := testing.AllocsPerRun(50, func() { p.Pick(r, eps); p.Settle() }); n != 0 {
			t.Fatalf("%s: Pick and Settle allocate %.0f times", name, n)
		}
	}
}

// BenchmarkDecision64x1M is one scheduling decision with 64 endpoints whose
// indexes hold 1,000,000 blocks in all, on a 12k-token prompt (750 blocks)
// whose first 2,000 tokens every endpoint holds and whose rest one endpoint
// holds: filters, prefix + cost + LoRA scorers and the max-score picker.
// Each profile reads the filled indexes (its approximate scorer shares the
// filled approximate index). Sub-benchmarks:
//
//   - decide: filter, score and pick, nothing learnt (the learners off).
//   - pick: Pick as the gateway runs it: the decision and its learning
//     queued (prefix.Index.Learn: the 750 hashes copied), the queue
//     settled between the timed decisions, as the gateway's settler
//     goroutine does (learning.go; waking it is the gateway's cost,
//     measured by BenchmarkEPPDecision) — the pick path's cost.
//   - pick+settle: Pick, then Settle on the same goroutine: the learning
//     applied inline (an LRU touch per block), as the virtual fleet does
//     after every decision and as Pick did until 2026-12-05 — the CPU a
//     decision costs in all, wherever its learning runs.
//
// Reports p99-ns over the timed decisions besides ns/op. Until 2026-12-05
// precise-prefix/decide learnt into a fresh approximate index of its own
// (the precise-prefix profile's prefix ×0.5 scorer learns, and the
// benchmark switched off learning for cache-aware only): its 24–39 µs and
// 390–2,600 B/op were that index's Insert and growth, not the precise
// index's lookup. Since 2026-12-06 precise-prefix without tiers has no
// approximate index at all (its speculative entries bridge the events'
// lag); the tiered case keeps it.
func BenchmarkDecision64x1M(b *testing.B) {
	const n, perEndpoint = 64, 1_000_000 / 64
	ix, _ := prefix.NewIndex(caps(n, perEndpoint))
	px, _ := prefix.NewPreciseIndex(n, 16)
	var engineKey uint64
	storeIn := func(e int, m prefix.Medium, toks []uint32) {
		keys := make([]uint64, len(toks)/16)
		for i := range keys {
			engineKey++
			keys[i] = engineKey
		}
		_ = px.Stored(e, m, keys, 0, false, toks, 0)
	}
	store := func(e int, toks []uint32) { storeIn(e, prefix.MediumGPU, toks) }
	for e := range n {
		// Fill each endpoint with distinct 750-block prompts.
		for k := 0; k < perEndpoint/750+1; k++ {
			toks := tokens(12000, uint32(e*1000+k)*20000+1_000_000_000)
			ix.Insert(e, prefix.Hashes(nil, toks, 16, 0))
			store(e, toks)
		}
	}
	reqs := make([]*Request, 64)
	for i := range reqs {
		toks := append(tokens(2000, 0), tokens(10000, uint32(i+1)*100000)...)
		reqs[i] = req(toks)
		for e := range n {
			ix.Insert(e, reqs[i].Hashes[:125])
			store(e, toks[:2000])
		}
		ix.Insert(i%n, reqs[i].Hashes)
		store(i%n, toks)
		storeIn((i+1)%n, prefix.MediumCPU, toks) // the next endpoint has it in host memory
	}
	b.Logf("approximate index: %d blocks on endpoint 0; precise index: %+v", ix.Len(0), px.Stats())
	eps := ready(n)
	for i := range eps {
		eps[i].InFlight = i % 5
		eps[i].InFlightTokens = (i % 11) * 3000
		eps[i].PendingPrefillTokens = (i % 7) * 1000
	}
	for _, tc := range []struct {
		name, policy string
		tiered       bool
		learn        learnMode
		batch        bool // routing.cost.batch priced (batch70B)
		keep         bool // every 8th endpoint hot (routing.balance.keep_fastest, the default, prices them)
		off          bool // routing.balance.keep_fastest: false (the filter before 2026-12-06)
	}{
		{"cache-aware/decide", CacheAware, false, learnOff, false, false, false},
		{"cache-aware/decide-batch", CacheAware, false, learnOff, true, false, false},
		{"cache-aware/decide-keep-fastest", CacheAware, false, learnOff, false, true, false},
		{"cache-aware/decide-hot-no-keep", CacheAware, false, learnOff, false, true, true},
		{"cache-aware/pick", CacheAware, false, learnQueued, false, false, false},
		{"cache-aware/pick+settle", CacheAware, false, learnInline, false, false, false},
		{"cache-aware-ttft/decide", CacheAwareTTFT, false, learnOff, false, false, false},
		{"cache-aware-ttft/pick", CacheAwareTTFT, false, learnQueued, false, false, false},
		{"precise-prefix/decide", PrecisePrefix, false, learnOff, false, false, false},
		{"precise-prefix/pick", PrecisePrefix, false, learnQueued, false, false, false},
		{"precise-prefix/tiered", PrecisePrefix, true, learnOff, false, false, false},
	} {
		b.Run(tc.name, func(b *testing.B) {
			pool := Pool{Capacity: caps(n, perEndpoint), Precise: px.On(prefix.MediumGPU)}
			if tc.tiered {
				// GPU, host memory (the next endpoint's copy), no remote.
				t := &Tiers{Source: px, Remote: -1, LoadSeconds: make([][NumTiers]float64, n), Latency: make([][NumTiers]float64, n)}
				for e := range n {
					t.LoadSeconds[e] = [NumTiers]float64{0, 26e-6, 187e-6, 120e-6}
				}
				pool.Tiers = t
			}
			cfg := Config{Policy: tc.policy}
			if tc.batch {
				cfg = batch70B(cfg)
			}
			eps := eps
			if tc.keep {
				// Hot endpoints make the filter (keep_fastest, the
				// default) price every candidate.
				if tc.off {
					off := false
					cfg.Balance.KeepFastest = &off
				}
				eps = slices.Clone(eps)
				for e := 0; e < n; e += 8 {
					eps[e].InFlight = 40
				}
			}
			p := newProfileT(b, cfg, pool)
			// Share the filled index with the approximate scorer (the
			// cost scorer reads cache-aware's through p.match).
			for _, ws := range p.scorers {
				if ps, ok := ws.Scorer.(*prefixScorer); ok {
					ps.ix, p.approx = ix, ix
					if p.match != MatchSource(px.On(prefix.MediumGPU)) {
						p.match = ix
					}
				}
			}
			if tc.learn == learnOff {
				p.learners = nil
			}
			benchPicks(b, p, tc.learn, func(i int) { p.Pick(reqs[i%len(reqs)], eps) })
			ix.Settle()
		})
	}
}

// BenchmarkDecision1000 is one decision among 1,000 endpoints, on a
// 12k-token prompt with varied load: the policies without a prefix index
// (load-profile is a weighted profile of load scorers: hot-spot filter,
// cost ×1, queue ×1, max-score), and cache-aware, whose approximate index
// holds 1,000,000 blocks (1,000 per endpoint; 16 groups of owners tables,
// prefix.Index) with every endpoint holding the prompt's first 2,000 tokens
// and one endpoint all of it, as BenchmarkDecision64x1M;
// cache-aware/decide-one-holder decides 800-token prompts that one
// endpoint each holds and no other any part of (the gateway's chats of
// BenchmarkEPPDecision: the candidates' passes, not Match, are the cost).
// The precise index still tracks at most prefix.MaxEndpoints (64)
// endpoints.
func BenchmarkDecision1000(b *testing.B) {
	const n, perEndpoint = 1000, 1_000_000 / 1000
	eps := ready(n)
	for i := range eps {
		eps[i].InFlight = i % 5
		eps[i].InFlightTokens = (i % 11) * 3000
		eps[i].PendingPrefillTokens = (i % 7) * 1000
	}
	reqs := make([]*Request, 64)
	for i := range reqs {
		reqs[i] = req(append(tokens(2000, 0), tokens(10000, uint32(i+1)*100000)...))
	}
	load := Config{Policy: "load", Profiles: map[string]ProfileConfig{"load": {
		Filters: []string{FilterHotSpot},
		Scorers: []ScorerConfig{{Type: ScorerCost, Weight: 1}, {Type: ScorerQueue, Weight: 1}},
	}}}
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"least-request", Config{Policy: LeastRequest}},
		{"power-of-two", Config{Policy: PowerOfTwo}},
		{"load-profile", load},
	} {
		b.Run(tc.name, func(b *testing.B) {
			p := newProfileT(b, tc.cfg, Pool{Capacity: caps(n, 100000)})
			benchPicks(b, p, learnOff, func(i int) { p.Pick(reqs[i%len(reqs)], eps) })
		})
	}
	var ix *prefix.Index // built by the first cache-aware case
	// Sessions of their own (one endpoint holds each, nobody else any of
	// it: BenchmarkEPPDecision's chats), the index's groups but the
	// holder's answering with one lookup: the per-endpoint passes' cost.
	own := make([]*Request, 64)
	for i := range own {
		own[i] = req(tokens(800, uint32(i+1)*7919+2_000_000_000))
	}
	for _, tc := range []struct {
		name  string
		learn learnMode
		reqs  []*Request
	}{
		{"cache-aware/decide", learnOff, reqs},
		{"cache-aware/pick", learnQueued, reqs},
		{"cache-aware/decide-one-holder", learnOff, own},
	} {
		b.Run(tc.name, func(b *testing.B) {
			if ix == nil {
				ix, _ = prefix.NewIndex(caps(n, perEndpoint))
				for e := range n {
					// Fill each endpoint with distinct 750-block prompts.
					for k := 0; k < perEndpoint/750+1; k++ {
						ix.Insert(e, prefix.Hashes(nil, tokens(12000, uint32(e*1000+k)*20000+1_000_000_000), 16, 0))
					}
				}
				for i, r := range reqs {
					for e := range n {
						ix.Insert(e, r.Hashes[:125])
					}
					ix.Insert(i*n/len(reqs), r.Hashes)
				}
				for i, r := range own {
					ix.Insert((i*n/len(own)+7)%n, r.Hashes)
				}
				b.Logf("approximate index: %d blocks on endpoint 0, %d on endpoint %d", ix.Len(0), ix.Len(n-1), n-1)
			}
			p := newProfileT(b, Config{Policy: CacheAware}, Pool{Capacity: caps(n, perEndpoint)})
			for _, ws := range p.scorers {
				if ps, ok := ws.Scorer.(*prefixScorer); ok {
					ps.ix, p.approx, p.match = ix, ix, ix
				}
			}
			if tc.learn == learnOff {
				p.learners = nil
			}
			want := min(125, len(tc.reqs[0].Hashes))
			benchPicks(b, p, tc.learn, func(i int) {
				r := tc.reqs[i%len(tc.reqs)]
				if d := p.Pick(r, eps); d.MatchedBlocks < want {
					b.Fatalf("request %d: matched %d blocks at endpoint %d", i%len(tc.reqs), d.MatchedBlocks, d.Endpoint)
				}
			})
			ix.Settle()
		})
	}
}

// learnMode is how a decision benchmark applies the learning Pick queues.
type learnMode int

const (
	learnOff    learnMode = iota // nothing learnt (the profile's learners off)
	learnQueued                  // queued by Pick, applied between the timed decisions
	learnInline                  // Settle after every Pick, timed with it
)

// benchPicks times f (one Pick of p) by benchDecisions, applying p's
// queued learning as mode says.
func benchPicks(b *testing.B, p *Profile, mode learnMode, f func(i int)) {
	if p.spec != nil && mode != learnOff {
		// The speculative entries' arena grows to the blocks it has held
		// and then allocates nothing (TestSpeculativeAllocFree): a ring of
		// decisions first, as a gateway that has served a thousand
		// requests, so that B/op is the steady state's (until 2026-12-06
		// the growth read as ~210 B/op amortised over 20,000 picks).
		for i := range specSlots {
			f(i)
			p.Settle()
		}
	}
	switch mode {
	case learnInline:
		benchDecisions(b, nil, func(i int) { f(i); p.Settle() })
	case learnQueued:
		// The previous decision's learning is applied before each
		// decision, outside the samples (not outside ns/op), as a
		// settler that keeps up with the request rate has done.
		benchDecisions(b, func(int) { p.Settle() }, f)
	default:
		benchDecisions(b, nil, f)
	}
}

// benchDecisions times each call of f and reports, besides ns/op, the
// median and 99th percentile of the calls' wall-clock durations (p50-ns,
// p99-ns), read with time.Now (the vDSO clock: ~25 ns a read, measured
// by an empty f at p50 and p99 under 100 ns). The samples are allocated
// before the timer; pre, if not nil, runs before each call, outside the
// samples (not outside ns/op).
//
// Until 2026-12-05 each sample also read the thread's CPU time
// (clock_gettime CLOCK_THREAD_CPUTIME_ID, a real system call) around f, and
// reported its percentiles as the decision's cost: on this host an empty f
// read 1.7 µs at p50 and 12 µs at p99 that way (5.4 µs/op for the two
// calls), more than the decision itself, and the calls' cache and branch
// predictor disturbance inflated f's own wall time. A wall-clock p99 on a
// loaded host includes the waits for a core: state the load beside it.
func benchDecisions(b *testing.B, pre, f func(i int)) {
	samples := make([]time.Duration, 0, 1<<16)
	f(0)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if pre != nil {
			pre(i)
		}
		t0 := time.Now()
		f(i)
		if len(samples) < cap(samples) {
			samples = append(samples, time.Since(t0))
		}
	}
	b.StopTimer()
	slices.Sort(samples)
	if len(samples) > 0 {
		b.ReportMetric(float64(samples[len(samples)/2]), "p50-ns")
		b.ReportMetric(float64(samples[len(samples)*99/100]), "p99-ns")
	}
}

// TestIdleFleetSpreadsNewSessions: on an idle fleet, new conversations that
// share only a chat template's first block are not piled onto the endpoint
// that happens to hold that block (the e2e test against Ollama found this:
// a 2-slot engine then thrashes); they spread, while a follow-up still goes
// home.
func TestIdleFleetSpreadsNewSessions(t *testing.T) {
	for _, name := range []string{CacheAware, PrecisePrefix} {
		ix, _ := prefix.NewIndex(caps(4, 100000))
		p := newProfileT(t, Config{Policy: name}, Pool{Capacity: caps(4, 100000), Precise: ix})
		eps := ready(4)
		counts := make([]int, 4)
		var firstHome int
		var first []uint32
		for s := range 40 {
			toks := append(tokens(16, 7), tokens(2000, uint32(s+1)*100000)...)
			r := req(toks)
			d := p.Pick(r, eps)
			counts[d.Endpoint]++
			ix.Insert(d.Endpoint, r.Hashes) // what the engine now holds
			if s == 0 {
				firstHome, first = d.Endpoint, toks
			}
		}
		for e, n := range counts {
			if n < 4 {
				t.Fatalf("%s: endpoint %d got %d of 40 new sessions: %v", name, e, n, counts)
			}
		}
		follow := append(append([]uint32{}, first...), tokens(100, 3)...)
		if d := p.Pick(req(follow), eps); d.Endpoint != firstHome {
			t.Fatalf("%s: follow-up went to %d, home %d", name, d.Endpoint, firstHome)
		}
	}
}

// TestFinishedLearnsAgain: with prefix.learn_on_finish a finished prompt
// becomes its endpoint's most recent blocks, so the next eviction takes a
// prompt routed after it but not finished since, as the engine's LRU free
// queue does; without it the index evicts by routing order.
func TestFinishedLearnsAgain(t *testing.T) {
	seq := func(base uint64) []uint64 { return []uint64{base + 1, base + 2, base + 3, base + 4} }
	a, b, c := seq(100), seq(200), seq(300)
	for _, on := range []bool{false, true} {
		cfg := Config{Policy: CacheAware, Prefix: PrefixConfig{LearnOnFinish: &on}}
		p := newProfileT(t, cfg, Pool{Capacity: []int{8, 8}})
		if p.LearnsOnFinish() != on {
			t.Fatalf("learn_on_finish %v: LearnsOnFinish %v", on, p.LearnsOnFinish())
		}
		if on {
			p.approx.LearnPinned(0, a) // routed first, and running
		} else {
			p.approx.Insert(0, a) // routed first
		}
		p.approx.Insert(0, b)    // routed second: the index is full
		p.Finished(0, a, on)     // a ends after b was routed
		p.Finished(1, nil, true) // nothing to learn
		p.Settle()
		p.approx.Insert(0, c) // evicts the least recent 4 blocks
		m := make([]int, 2)
		p.approx.Match(a, m)
		wantA := 0
		if on {
			wantA = 4
		}
		if m[0] != wantA || m[1] != 0 {
			t.Fatalf("learn_on_finish %v: a matched %v, want [%d 0]", on, m, wantA)
		}
		p.approx.Match(b, m)
		if want := 4 - wantA; m[0] != want {
			t.Fatalf("learn_on_finish %v: b matched %d blocks on endpoint 0, want %d", on, m[0], want)
		}
	}
	// A policy without an approximate index is no Finisher.
	lr, err := NewPolicy(Config{Policy: LeastRequest}, Pool{Capacity: []int{8}})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := lr.(Finisher); ok {
		t.Fatalf("least-request (%T) is a Finisher", lr)
	}
}

// TestPinsOnlyWhatRuns: with learn_on_finish a pick pins its prompt only
// when the endpoint's KV cache holds it beside every prompt in flight
// there (prefixScorer.runs), and says so in Request.Pinned; a pick past
// that bound learns unpinned, as without learn_on_finish, and its end
// changes nothing: the engine would not hold its prompt running, nor keep
// it once done.
func TestPinsOnlyWhatRuns(t *testing.T) {
	r := req(tokens(64, 1)) // 4 blocks of 16
	other := func(k uint32) []uint64 { return prefix.Hashes(nil, tokens(64, 1000*k), 16, 0) }
	for _, c := range []struct {
		inFlight int // tokens already in flight on the endpoint
		pinned   bool
	}{
		{0, true},
		{64, true},    // 64 + 64 = the 128-token capacity: fits
		{65, false},   // one token over
		{1000, false}, // an engine far behind
	} {
		p := newProfileT(t, Config{Policy: CacheAware}, Pool{Capacity: []int{8}}) // 8 blocks: 128 tokens
		eps := ready(1)
		eps[0].InFlightTokens = c.inFlight
		r.Pinned = !c.pinned // the pick sets it either way
		if d := p.Pick(r, eps); d.Endpoint != 0 {
			t.Fatalf("picked %d", d.Endpoint)
		}
		if r.Pinned != c.pinned {
			t.Fatalf("in flight %d: Request.Pinned %v, want %v", c.inFlight, r.Pinned, c.pinned)
		}
		p.Settle()
		// Two other prompts fill the index: a pinned prompt outlives them.
		p.approx.Insert(0, other(1))
		p.approx.Insert(0, other(2))
		m := make([]int, 1)
		p.approx.Match(r.Hashes, m)
		if want := map[bool]int{true: 4, false: 0}[c.pinned]; m[0] != want {
			t.Fatalf("in flight %d: the pick's prompt matched %d blocks after two others, want %d (pinned %v)", c.inFlight, m[0], want, c.pinned)
		}
		// Its end: released and the freshest when it was pinned; nothing
		// (not learnt again) when it was not.
		p.Finished(0, r.Hashes, r.Pinned)
		p.Settle()
		p.approx.Match(r.Hashes, m)
		if want := map[bool]int{true: 4, false: 0}[c.pinned]; m[0] != want {
			t.Fatalf("in flight %d: after the end matched %d, want %d", c.inFlight, m[0], want)
		}
		p.approx.Insert(0, other(3)) // evicts the least recent unpinned prompt
		p.approx.Match(r.Hashes, m)
		if want := map[bool]int{true: 4, false: 0}[c.pinned]; m[0] != want {
			t.Fatalf("in flight %d: after a third prompt matched %d, want %d (released as the freshest)", c.inFlight, m[0], want)
		}
	}
}

// TestUnpinnedEndKeepsOthersPins: a request learnt unpinned (its endpoint
// overfull) whose prompt hashes equal a running pinned request's (tokens
// that differ only past the last full block) ends without taking that
// pin; and a pinned request whose prompt's tail was evicted while every
// block was pinned releases the rest of its pins at its end. Both went
// wrong when the end found the pin by the prompt's last block (a review
// of 2026-12-06).
func TestUnpinnedEndKeepsOthersPins(t *testing.T) {
	a := req(tokens(64, 1))
	p := newProfileT(t, Config{Policy: CacheAware}, Pool{Capacity: []int{8}}) // 128 tokens
	eps := ready(1)
	p.Pick(a, eps)                        // runs: pinned
	twin := req(append(tokens(64, 1), 7)) // the same 4 full blocks, one token more
	eps[0].InFlightTokens = 100           // overfull now: learnt unpinned
	p.Pick(twin, eps)
	if !a.Pinned || twin.Pinned {
		t.Fatalf("Pinned %v %v, want true false", a.Pinned, twin.Pinned)
	}
	p.Finished(0, twin.Hashes, twin.Pinned) // the twin ends first
	p.Settle()
	other := func(k uint32) []uint64 { return prefix.Hashes(nil, tokens(64, 1000*k), 16, 0) }
	p.approx.Insert(0, other(1))
	p.approx.Insert(0, other(2)) // evicts an unpinned prompt, not a's
	m := make([]int, 1)
	if p.approx.Match(a.Hashes, m); m[0] != 4 {
		t.Fatalf("a's prompt matched %d blocks while it runs, want 4 (its pin kept)", m[0])
	}

	// Every block pinned: a's tail goes first; its end releases the rest.
	p2 := newProfileT(t, Config{Policy: CacheAware}, Pool{Capacity: []int{4}}) // 64 tokens
	b, c := req(tokens(32, 1)), req(tokens(32, 500))
	p2.Pick(b, ready(1))
	p2.Pick(c, ready(1))
	p2.Settle()
	p2.approx.LearnPinned(0, other(3)[:1]) // one more pinned block: b's tail evicted
	p2.Settle()
	p2.Finished(0, b.Hashes, b.Pinned)
	p2.Finished(0, c.Hashes, c.Pinned)
	p2.Settle()
	for k := uint32(4); k < 8; k++ {
		p2.approx.Insert(0, other(k)) // four unpinned prompts: every released block goes
	}
	if p2.approx.Match(b.Hashes, m); m[0] != 0 {
		t.Fatalf("b's prompt still holds %d blocks after four others: a pin leaked", m[0])
	}
}

// TestPeerFinisher: a profile that pins its own picks (learn_on_finish,
// the default) pins a peer's learn until ReleasePeer; with learn_on_finish
// off, and for P/D profiles (which never pin), PinsPeers is false.
func TestPeerFinisher(t *testing.T) {
	off := false
	for name, c := range map[string]struct {
		cfg  Config
		pd   bool
		want bool
	}{
		"default":     {Config{Policy: CacheAware}, false, true},
		"off":         {Config{Policy: CacheAware, Prefix: PrefixConfig{LearnOnFinish: &off}}, false, false},
		"pd":          {Config{Policy: CacheAware}, true, false},
		"round-robin": {Config{Policy: RoundRobin}, false, false},
	} {
		var p Policy
		var err error
		if c.pd {
			var pd *PD
			pd, err = NewPD(c.cfg, Pool{Capacity: []int{100, 100}})
			if err == nil {
				p = pd.Decode()
			}
		} else {
			p, err = NewPolicy(c.cfg, Pool{Capacity: []int{100, 100}})
		}
		if err != nil {
			t.Fatal(name, err)
		}
		f, ok := p.(PeerFinisher)
		if got := ok && f.PinsPeers(); got != c.want {
			t.Errorf("%s: PinsPeers %v, want %v", name, got, c.want)
		}
	}
	// Pinned: a peer's prompt survives 2× the endpoint's capacity of later
	// prompts until ReleasePeer, then is evicted as usual.
	p, _ := NewPolicy(Config{Policy: CacheAware}, Pool{Capacity: []int{64, 64}})
	pr := p.(*Profile)
	a := seqHashes(1, 32)
	for _, release := range []bool{false, true} {
		pr.approx.Clear(0)
		pr.LearnPeerPinned(0, a)
		if release {
			pr.ReleasePeer(0, a)
		}
		for k := range 4 {
			pr.FinishPeer(0, seqHashes(k+2, 32))
		}
		got := make([]int, 2)
		pr.approx.Match(a, got)
		if want := map[bool]int{false: 32, true: 0}[release]; got[0] != want {
			t.Errorf("released %v: %d blocks held, want %d", release, got[0], want)
		}
	}
}

func seqHashes(seed, n int) []uint64 {
	h := make([]uint64, n)
	for i := range h {
		h[i] = uint64(seed)<<32 | uint64(i+1)
	}
	return h
}
