package sched

import (
	"math"
	"strings"
	"testing"
)

// ttftOnly is a profile of the ttft scorer alone on the precise source
// (weight 0: the match only), work weight α.
func ttftOnly(alpha float64) Config {
	return Config{
		Policy: "t",
		TTFT:   TTFTConfig{WorkWeight: &alpha},
		Profiles: map[string]ProfileConfig{"t": {Scorers: []ScorerConfig{
			{Type: ScorerPrecisePrefix, Weight: 0}, {Type: ScorerTTFT, Weight: 1},
		}}},
	}
}

// The ttft scorer's cost is W + (1 + α)·U / rate: exact values, min–max.
func TestTTFTScorerValues(t *testing.T) {
	// 1,600-token prompt (100 blocks); endpoint 0 holds 80 blocks, 1 none, 2 none.
	p := newProfileT(t, ttftOnly(2), Pool{Capacity: caps(3, 1000), Precise: fm(80, 0, 0)})
	eps := ready(3)
	eps[0].PendingPrefillTokens = 2000
	eps[1].PendingPrefillTokens = 0
	eps[2].PendingPrefillTokens = 500
	r := req(tokens(1600, 1))
	c := &Cycle{p: p, Req: r, Eps: eps, matched: make([]int, 3), other: make([]int, 3)}
	sc := make([]float64, 3)
	s := p.scorers[1].Scorer.(*ttftScorer)
	s.cost.estimateWork(c, []int{0, 1, 2}, sc, 2, 0, 0.05)
	// Costs in tokens at 10,000 tokens/s: 2000 + 3·320, 0 + 3·1600, 500 + 3·1600.
	want := []float64{2960.0 / 1e4, 4800.0 / 1e4, 5300.0 / 1e4}
	for k := range want {
		if math.Abs(sc[k]-want[k]) > 1e-12 {
			t.Fatalf("cost %v, want %v", sc, want)
		}
	}
	c.matchedDone = false
	s.Score(c, []int{0, 1, 2}, sc)
	want = []float64{1, (5300.0 - 4800) / (5300 - 2960), 0}
	for k := range want {
		if math.Abs(sc[k]-want[k]) > 1e-12 {
			t.Fatalf("scores %v, want %v", sc, want)
		}
	}
	// Equal costs score 1 each.
	eps[0].PendingPrefillTokens, eps[2].PendingPrefillTokens = 0, 0
	p2 := newProfileT(t, ttftOnly(2), Pool{Capacity: caps(3, 1000), Precise: fm(0, 0, 0)})
	c = &Cycle{p: p2, Req: r, Eps: eps, matched: make([]int, 3), other: make([]int, 3)}
	p2.scorers[1].Scorer.Score(c, []int{0, 1, 2}, sc)
	if sc[0] != 1 || sc[1] != 1 || sc[2] != 1 {
		t.Fatalf("equal costs scored %v, want all 1", sc)
	}
}

// A short follow-up leaves its prefix's home when the home is busy with
// another request's long prefill; a long prompt's hit outweighs seconds of
// backlog (the two halves of issue 19's long-tail p99).
func TestTTFTScorerHeadOfLine(t *testing.T) {
	pool := Pool{Capacity: caps(2, 100000), Precise: fm(1<<30, 0)} // endpoint 0 holds every prompt
	p := newProfileT(t, ttftOnly(2), pool)
	eps := ready(2)
	// Endpoint 0 is prefilling a 100k-token prompt (10 s at 10,000 tokens/s).
	eps[0].PendingPrefillTokens = 100_000
	short := req(tokens(2000, 1)) // saves 3·0.2 s at most
	if d := p.Pick(short, eps); d.Endpoint != 1 {
		t.Fatalf("short follow-up behind a 100k prefill: %+v, want the idle endpoint", d)
	}
	long := req(tokens(48_000, 1)) // its hit saves 3·4.8 s, more than the 10 s wait
	if d := p.Pick(long, eps); d.Endpoint != 0 {
		t.Fatalf("48k-token follow-up: %+v, want its home", d)
	}
	// α = 0: only its own first token counts, 4.8 s cold elsewhere against 10 s: it leaves.
	if d := newProfileT(t, ttftOnly(0), pool).Pick(long, eps); d.Endpoint != 1 {
		t.Fatalf("48k-token follow-up at work weight 0: %+v, want the idle endpoint", d)
	}
	// The default policy's ratio cost keeps the short one at home (the miss this scorer closes).
	ca := newProfileT(t, Config{Policy: PrecisePrefix}, pool)
	if d := ca.Pick(short, eps); d.Endpoint != 0 {
		t.Fatalf("precise-prefix: %+v, expected to wait at home", d)
	}
}

func TestTTFTConfigErrors(t *testing.T) {
	for _, a := range []float64{-1, math.Inf(1), math.NaN()} {
		err := Validate(ttftOnly(a))
		if err == nil || !strings.Contains(err.Error(), "ttft.work_weight") {
			t.Errorf("work_weight %g: %v", a, err)
		}
	}
	cfg := ttftOnly(1)
	cfg.Cost.PrefillTokensPerSecond = -5
	if err := Validate(cfg); err == nil || !strings.Contains(err.Error(), "prefill_tokens_per_second") {
		t.Errorf("negative rate: %v", err)
	}
	if err := Validate(Config{TTFT: TTFTConfig{}, Policy: "t", Profiles: map[string]ProfileConfig{"t": {Scorers: []ScorerConfig{{Type: ScorerTTFT, Weight: 1}}}}}); err != nil {
		t.Errorf("default work weight: %v", err)
	}
}

func TestTTFTScorerAllocFree(t *testing.T) {
	if raceEnabled {
		t.Skip("sync.Pool drops items under the race detector")
	}
	p := newProfileT(t, ttftOnly(2), Pool{Capacity: caps(16, 100000), Precise: fm(3, 5, 700)})
	r := req(tokens(12000, 1))
	eps := ready(16)
	p.Pick(r, eps)
	if n := testing.AllocsPerRun(50, func() { p.Pick(r, eps) }); n != 0 {
		t.Errorf("Pick allocates %.0f times", n)
	}
}

// The built-in cache-aware-ttft profile on its approximate index: new
// sessions sharing only a template block spread over an idle fleet, a
// follow-up goes home, and a short follow-up does not wait behind another
// request's 100k-token prefill there.
func TestCacheAwareTTFTProfile(t *testing.T) {
	p := newProfileT(t, Config{Policy: CacheAwareTTFT}, Pool{Capacity: caps(4, 100000)})
	if !p.NeedsHashes() || p.approx == nil {
		t.Fatal("cache-aware-ttft has no approximate index")
	}
	eps := ready(4)
	counts := make([]int, 4)
	var firstHome int
	var first []uint32
	for s := range 40 {
		toks := append(tokens(16, 7), tokens(2000, uint32(s+1)*100000)...)
		d := p.Pick(req(toks), eps)
		p.Settle()
		counts[d.Endpoint]++
		if s == 0 {
			firstHome, first = d.Endpoint, toks
		}
	}
	for e, n := range counts {
		if n < 4 {
			t.Fatalf("endpoint %d got %d of 40 new sessions: %v", e, n, counts)
		}
	}
	follow := append(append([]uint32{}, first...), tokens(100, 3)...)
	d := p.Pick(req(follow), eps)
	p.Settle()
	if d.Endpoint != firstHome || d.MatchedBlocks == 0 {
		t.Fatalf("follow-up: %+v, home %d", d, firstHome)
	}
	eps[firstHome].PendingPrefillTokens = 100_000
	follow = append(follow, tokens(100, 4)...)
	if d := p.Pick(req(follow), eps); d.Endpoint == firstHome {
		t.Fatalf("short follow-up waits behind a 100k-token prefill at home: %+v", d)
	}
}

// block_weight charges each request in flight the request's prefill time:
// a long cold prompt goes where it blocks fewest sessions.
func TestTTFTBlockWeight(t *testing.T) {
	cfg := ttftOnly(2)
	b := 0.1
	cfg.TTFT.BlockWeight = &b
	p := newProfileT(t, cfg, Pool{Capacity: caps(2, 100000), Precise: fm(0, 0)})
	eps := ready(2)
	eps[0].InFlight, eps[0].PendingPrefillTokens = 20, 0
	eps[1].InFlight, eps[1].PendingPrefillTokens = 2, 20_000 // 2 s of backlog
	long := req(tokens(100_000, 9))                          // 10 s: 20 in flight cost 20 s more on 0, 2 cost 2 s on 1
	if d := p.Pick(long, eps); d.Endpoint != 1 {
		t.Fatalf("long cold prompt: %+v, want the endpoint with fewer sessions", d)
	}
	b = 0
	if d := newProfileT(t, cfg, Pool{Capacity: caps(2, 100000), Precise: fm(0, 0)}).Pick(long, eps); d.Endpoint != 0 {
		t.Fatalf("block_weight 0: %+v, want the shorter backlog", d)
	}
	b = -1
	if err := Validate(cfg); err == nil || !strings.Contains(err.Error(), "ttft.block_weight") {
		t.Fatalf("negative block_weight: %v", err)
	}
}
