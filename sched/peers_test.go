package sched

import (
	"slices"
	"strings"
	"testing"
)

// fixedMatch is a MatchSource that reports the same leading blocks per
// endpoint for every prompt (capped at the prompt's length).
// (A pointer: the framework compares match sources.)
type fixedMatch struct{ m []int }

func fm(m ...int) *fixedMatch { return &fixedMatch{m} }

func (f *fixedMatch) Match(hashes []uint64, matched []int) {
	for i := range matched {
		matched[i] = 0
		if i < len(f.m) {
			matched[i] = min(f.m[i], len(hashes))
		}
	}
}

// near reports whether a and b are equal within rounding.
func near(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if d := a[i] - b[i]; d > 1e-12 || d < -1e-12 {
			return false
		}
	}
	return true
}

func TestPeerProfilesBuild(t *testing.T) {
	for _, name := range []string{LLMD, SGLang, Dynamo} {
		if !slices.Contains(Names(), name) {
			t.Errorf("Names() lacks %s", name)
		}
		if err := Validate(Config{Policy: name}); err != nil {
			t.Errorf("Validate(%s) = %v", name, err)
		}
		p := mustNew(t, Config{Policy: name}, 4)
		if !p.NeedsHashes() {
			t.Errorf("%s does not ask for hashes", name)
		}
		if _, ok := p.(Forgetter); !ok && name != Dynamo { // Dynamo's index is the pool's
			t.Errorf("%s keeps per-endpoint state but is no Forgetter", name)
		}
	}
	if !UsesPrecise(Config{Policy: Dynamo}) || UsesPrecise(Config{Policy: LLMD}) || UsesPrecise(Config{Policy: SGLang}) {
		t.Error("only dynamo reads the precise index")
	}
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Policy: LLMD, Prefix: PrefixConfig{BlockSize: 48}}, "multiple of prefix.block_size"},
		{Config{Policy: LLMD, LLMD: LLMDConfig{MaxPrefixBlocksToMatch: -1}}, "max_prefix_blocks_to_match"},
		{Config{Policy: SGLang, SGLang: SGLangConfig{CacheThreshold: 1.5}}, "cache_threshold"},
		{Config{Policy: SGLang, SGLang: SGLangConfig{BalanceRelThreshold: 0.5}}, "balance_rel_threshold"},
		{Config{Policy: Dynamo, Dynamo: DynamoConfig{Temperature: -1}}, "router_temperature"},
		{Config{Policy: "p", Profiles: map[string]ProfileConfig{"p": {Scorers: []ScorerConfig{{Type: ScorerQueue, Weight: 1}}, Picker: PickerSGLang}}}, "needs an sglang-tree"},
		{Config{Policy: "p", Profiles: map[string]ProfileConfig{"p": {Scorers: []ScorerConfig{{Type: ScorerQueue, Weight: 1}}, Picker: PickerDynamoCost}}}, "needs a prefix"},
	} {
		if err := Validate(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate(%+v) = %v, want %q", tc.cfg.Policy, err, tc.want)
		}
	}
}

// llm-d's prefix scorer matches whole 64-token blocks only, caps the match
// at 256 of them, and reports matches in routing blocks.
func TestLLMDPrefixBlocks(t *testing.T) {
	s, err := newLLMDPrefix(LLMDConfig{}, 16, 3)
	if err != nil {
		t.Fatal(err)
	}
	a := req(tokens(64*300, 1)) // 300 blocks of 64 tokens, 1,200 of 16
	s.ix.Insert(0, *s.strided(a.Hashes))
	// Endpoint 1 holds a prompt equal to a's first 127 tokens: one whole
	// 64-token block.
	b := req(append(tokens(127, 1), 99999))
	s.ix.Insert(1, *s.strided(b.Hashes))
	m := make([]int, 3)
	s.Match(a.Hashes, m)
	if want := []int{256 * 4, 1 * 4, 0}; !slices.Equal(m, want) {
		t.Fatalf("matched = %v, want %v (routing blocks)", m, want)
	}
	// A prompt of 63 tokens has no whole block: nothing to match.
	s.Match(req(tokens(63, 1)).Hashes, m)
	if !slices.Equal(m, []int{0, 0, 0}) {
		t.Fatalf("63-token prompt matched %v", m)
	}
}

func TestLLMDProfileScores(t *testing.T) {
	p := newProfileT(t, Config{Policy: LLMD}, Pool{Capacity: caps(4, 1000)})
	eps := ready(4)
	for i := range eps {
		eps[i].Metrics, eps[i].KVUtil = true, 0.5
	}
	// Cold requests go round the endpoints that never had one (no-hit-LRU
	// ranks them first, in order), then the least recently used.
	var got []int
	for i := range 6 {
		got = append(got, p.Pick(req(tokens(256, uint32(i+1)*100000)), eps).Endpoint)
	}
	if want := []int{0, 1, 2, 3, 0, 1}; !slices.Equal(got, want) {
		t.Fatalf("cold requests went to %v, want %v", got, want)
	}
	// A follow-up of the first prompt returns to endpoint 0: prefix 3 ×
	// 1.0 beats the others' no-hit-LRU 0.5 + equal queue and KV scores.
	follow := req(append(tokens(256, 100000), tokens(64, 7)...))
	if d := p.Pick(follow, eps); d.Endpoint != 0 || d.MatchedBlocks != 16 {
		t.Fatalf("follow-up: %+v, want endpoint 0 with 16 routing blocks", d)
	}
	// The longest queue and a full KV cache outweigh half a match: on 0,
	// 3 × 0.5 + 2 × 0 (queue) + 2 × 0.05 + 2 × 0.5 = 2.6 against 0 + 2 + 1
	// + 1 = 4 elsewhere.
	eps[0].Waiting, eps[0].KVUtil = 10, 0.95
	half := req(append(tokens(128, 100000), tokens(128, 5)...)) // 2 of the first prompt's 4 blocks
	if d := p.Pick(half, eps); d.Endpoint == 0 {
		t.Fatalf("picked the endpoint with the long queue: %+v", d)
	}
}

func TestNoHitLRUScores(t *testing.T) {
	s := &noHitLRU{size: 8}
	c := &Cycle{p: &Profile{}, Eps: ready(4), Req: &Request{}}
	c.matched, c.matchedDone = make([]int, 4), true
	cands := []int{0, 1, 2, 3}
	scores := make([]float64, 4)
	s.Score(c, cands, scores)
	if want := []float64{1, 1 - 1.0/3, 1 - 2.0/3, 0}; !near(scores, want) {
		t.Fatalf("never used: %v, want %v", scores, want)
	}
	s.Learn(c, 2) // 2 gets a cold request, then 0
	s.Learn(c, 0)
	s.Score(c, cands, scores)
	// never used 1, 3 first; then 2 (oldest), 0 (newest).
	if want := []float64{0, 1, 1 - 2.0/3, 1 - 1.0/3}; !near(scores, want) {
		t.Fatalf("after 2, 0: %v, want %v", scores, want)
	}
	c.matched[3] = 1 // warm: neutral, and no LRU update
	s.Score(c, cands, scores)
	if !slices.Equal(scores, []float64{0.5, 0.5, 0.5, 0.5}) {
		t.Fatalf("warm request: %v", scores)
	}
	s.Learn(c, 1)
	if !slices.Equal(s.order, []int32{2, 0}) {
		t.Fatalf("a warm request moved the LRU: %v", s.order)
	}
}

func TestSGLangRule(t *testing.T) {
	p := newProfileT(t, Config{Policy: SGLang}, Pool{Capacity: caps(3, 1000)})
	eps := ready(3)
	a := tokens(1600, 1)
	// Empty trees: the smallest tree (all equal) is any; then a's blocks
	// make that endpoint's tree the largest, so an unrelated prompt goes
	// elsewhere.
	first := p.Pick(req(a), eps).Endpoint
	other := p.Pick(req(tokens(1600, 500000)), eps).Endpoint
	if other == first {
		t.Fatalf("unrelated prompt went to the larger tree %d", first)
	}
	// A follow-up matching 1600 of 2000 tokens (rate 0.8 > 0.3) returns.
	if d := p.Pick(req(append(a, tokens(400, 900000)...)), eps); d.Endpoint != first || d.MatchedBlocks != 100 {
		t.Fatalf("follow-up: %+v, want endpoint %d with 100 blocks", d, first)
	}
	// A match of 400 of 2000 tokens (0.2 ≤ 0.3): the smallest tree, the
	// third endpoint, which has none.
	third := 3 - first - other
	if d := p.Pick(req(append(tokens(400, 1), tokens(1600, 700000)...)), eps); d.Endpoint != third {
		t.Fatalf("low match rate went to %d, want the smallest tree %d", d.Endpoint, third)
	}
	// Imbalance (100 − 10 > 64 and 100 > 1.5·10) sends to the least
	// loaded, whatever the match.
	eps[first].InFlight, eps[other].InFlight, eps[third].InFlight = 100, 10, 50
	if d := p.Pick(req(append(a, 5)), eps); d.Endpoint != other {
		t.Fatalf("imbalanced: %d, want least loaded %d", d.Endpoint, other)
	}
	// The imbalanced pick was learnt too: other's tree now holds a. 100
	// vs 40: gap 60 ≤ 64, balanced: the longest match (first holds a and
	// its follow-up) wins.
	eps[other].InFlight, eps[third].InFlight = 40, 40
	long := append(append(slices.Clone(a), tokens(400, 900000)...), 6)
	if d := p.Pick(req(long), eps); d.Endpoint != first {
		t.Fatalf("balanced by the abs threshold: %d, want %d", d.Endpoint, first)
	}
}

func TestDynamoCost(t *testing.T) {
	pool := Pool{Capacity: caps(3, 1000), Precise: fm(0, 50, 100)}
	p := newProfileT(t, Config{Policy: Dynamo}, pool)
	eps := ready(3)
	r := req(tokens(1600, 1)) // 100 blocks
	// Endpoint 2 holds the whole prompt: no prefill, logit 100; cheapest.
	if d := p.Pick(r, eps); d.Endpoint != 2 || d.MatchedBlocks != 100 {
		t.Fatalf("idle: %+v, want 2 with 100 blocks", d)
	}
	// logit = prefill + decode blocks: 2 has 0 + 300 + 100, 1 has 50 +
	// 100, 0 has 100 + 100.
	eps[2].InFlightTokens = 16 * 300
	if d := p.Pick(r, eps); d.Endpoint != 1 {
		t.Fatalf("busy holder: %+v, want 1", d)
	}
	// A prefill backlog counts as prefill blocks.
	eps[1].PendingPrefillTokens = 16 * 400
	if d := p.Pick(r, eps); d.Endpoint != 0 {
		t.Fatalf("backlogged: %+v, want 0", d)
	}
	// With a temperature every endpoint can be drawn, the cheapest most.
	hot := newProfileT(t, Config{Policy: Dynamo, Dynamo: DynamoConfig{Temperature: 1}}, pool)
	count := make([]int, 3)
	for range 3000 {
		count[hot.Pick(r, eps).Endpoint]++
	}
	if count[0] <= count[1] || count[0] <= count[2] || count[1] == 0 || count[2] == 0 {
		t.Fatalf("softmax draws %v: want every endpoint, endpoint 0 most", count)
	}
}

func TestPeerProfilesAllocFree(t *testing.T) {
	if raceEnabled {
		t.Skip("sync.Pool drops items under the race detector")
	}
	r := req(tokens(12000, 1))
	eps := ready(16)
	for _, name := range []string{LLMD, SGLang, Dynamo} {
		p := newProfileT(t, Config{Policy: name}, Pool{Capacity: caps(16, 100000), Precise: fm(3, 5)})
		p.Pick(r, eps)
		p.Pick(r, eps)
		if n := testing.AllocsPerRun(50, func() { p.Pick(r, eps) }); n != 0 {
			t.Errorf("%s: Pick allocates %.0f times", name, n)
		}
	}
}

// The ttft-bound filter drops candidates whose estimated TTFT exceeds the
// fastest's by more than slack cold prefills, whatever their match.
func TestTTFTBoundFilter(t *testing.T) {
	prof := ProfileConfig{
		Filters: []string{FilterTTFTBound},
		Scorers: []ScorerConfig{{Type: ScorerPrecisePrefix, Weight: 10}, {Type: ScorerCost, Weight: 1}},
	}
	cfg := Config{Policy: "b", Profiles: map[string]ProfileConfig{"b": prof}}
	// Endpoint 0 holds the whole 1,600-token prompt (100 blocks), 1 none.
	pool := Pool{Capacity: caps(2, 1000), Precise: fm(100, 0)}
	p := newProfileT(t, cfg, pool)
	eps := ready(2)
	r := req(tokens(1600, 1))
	// At the default 10,000 tokens/s the cold prefill is 0.16 s. A backlog
	// of 1,000 tokens (0.1 s) on the holder is within the bound: affinity.
	eps[0].PendingPrefillTokens = 1000
	if d := p.Pick(r, eps); d.Endpoint != 0 {
		t.Fatalf("small backlog: %+v, want the holder", d)
	}
	// 100,000 tokens (10 s, another request's long prefill) is not: the
	// holder is filtered out however strongly its match scores.
	eps[0].PendingPrefillTokens = 100000
	if d := p.Pick(r, eps); d.Endpoint != 1 {
		t.Fatalf("long backlog: %+v, want the idle endpoint", d)
	}
	// Slack 100 (16 s) lets affinity wait for it again.
	cfg.TTFTBound.Slack = 100
	if d := newProfileT(t, cfg, pool).Pick(r, eps); d.Endpoint != 0 {
		t.Fatalf("slack 100: %+v, want the holder", d)
	}
	cfg.TTFTBound.Slack = -1
	if err := Validate(cfg); err == nil || !strings.Contains(err.Error(), "ttft_bound.slack") {
		t.Fatalf("negative slack: %v", err)
	}
}

// BenchmarkPeerPick is one decision of each peer profile with 16
// endpoints on a 12k-token prompt (the llm-d profile's 64-token index,
// SGLang's tree, Dynamo's cost on a fixed precise match), learning
// included.
func BenchmarkPeerPick(b *testing.B) {
	eps := ready(16)
	for i := range eps {
		eps[i].Metrics, eps[i].KVUtil, eps[i].InFlight = true, 0.3, i%5
	}
	for _, name := range []string{LLMD, SGLang, Dynamo} {
		b.Run(name, func(b *testing.B) {
			p := newProfileT(b, Config{Policy: name}, Pool{Capacity: caps(16, 100000), Precise: fm(3, 5, 700)})
			reqs := make([]*Request, 64)
			for i := range reqs {
				reqs[i] = req(append(tokens(4000, 1), tokens(8000, uint32(i+1)*100000)...))
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				p.Pick(reqs[i%len(reqs)], eps)
			}
		})
	}
}

// The peer profiles run at their own defaults whatever routing.prefix's
// learn_on_finish says: it belongs to the approximate index of the prefix
// scorer, which no peer profile has (each keeps its own index: llm-d's
// learns at every decision, SGLang's tree at every insert, Dynamo reads
// the engines' events), so the reference rows of the policy table do not
// move with it. cache-aware, which does learn on finish, is the control:
// the same sequence of picks and ends decides differently there.
func TestPeersIgnoreLearnOnFinish(t *testing.T) {
	decide := func(name string, on bool) []int {
		cfg := Config{Policy: name, Prefix: PrefixConfig{LearnOnFinish: &on}}
		// Small caches, so that the order of eviction decides hits.
		p, err := NewPolicy(cfg, Pool{Capacity: caps(4, 96), Precise: fm(0, 0, 0, 0)})
		if err != nil {
			t.Fatal(err)
		}
		fin, _ := p.(Finisher)
		if name != CacheAware && fin != nil && fin.LearnsOnFinish() {
			t.Fatalf("%s learns on finish with learn_on_finish %v", name, on)
		}
		type running struct {
			ep     int
			hashes []uint64
			pinned bool
		}
		var (
			eps      = ready(4)
			inFlight []running
			out      []int
			x        = uint64(1)
		)
		next := func(n int) int { // xorshift: the same sequence for every run
			x ^= x << 13
			x ^= x >> 7
			x ^= x << 17
			return int(x % uint64(n))
		}
		sessions := make([][]uint32, 12)
		for s := range sessions {
			sessions[s] = tokens(16*(4+next(24)), uint32(s+1)<<20)
		}
		for range 400 {
			s := next(len(sessions))
			sessions[s] = append(sessions[s], tokens(16*(1+next(8)), uint32(next(1<<30)))...)
			if len(sessions[s]) > 16*64 { // a new session in its slot
				sessions[s] = tokens(16*(4+next(24)), uint32(next(1<<30)))
			}
			r := req(sessions[s])
			d := p.Pick(r, eps)
			out = append(out, d.Endpoint)
			eps[d.Endpoint].InFlight++
			eps[d.Endpoint].InFlightTokens += r.PromptTokens
			inFlight = append(inFlight, running{d.Endpoint, r.Hashes, r.Pinned})
			for len(inFlight) > 6 { // a random one of the oldest ends
				k := next(3)
				e := inFlight[k]
				inFlight = append(inFlight[:k], inFlight[k+1:]...)
				eps[e.ep].InFlight--
				eps[e.ep].InFlightTokens -= len(e.hashes) * 16
				if fin != nil && fin.LearnsOnFinish() {
					fin.Finished(e.ep, e.hashes, e.pinned)
				}
			}
			if st, ok := p.(Settler); ok {
				st.Settle()
			}
		}
		return out
	}
	for _, name := range []string{LLMD, SGLang, Dynamo} {
		if off, on := decide(name, false), decide(name, true); !slices.Equal(off, on) {
			t.Errorf("%s decides differently with learn_on_finish", name)
		}
	}
	if off, on := decide(CacheAware, false), decide(CacheAware, true); slices.Equal(off, on) {
		t.Error("control: cache-aware decides the same with and without learn_on_finish; the sequence does not exercise eviction")
	}
}
