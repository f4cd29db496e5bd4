package sched

import (
	"math"
	"strings"
	"testing"
)

// batch70B is the batch model of the simulator's default profile
// (Llama-3.1-70B bf16 on 4×H100; BatchConfig's docs): 8,670 prefill
// tokens/s, a 21.3 ms step, 23.2e6 KV tokens/s.
func batch70B(cfg Config) Config {
	cfg.Cost.PrefillTokensPerSecond = 8670
	cfg.Cost.Batch = BatchConfig{StepSeconds: 0.0213, KVTokensPerSecond: 23.2e6}
	return cfg
}

// The step-time model's TTFT and work, by hand: s₀ 20 ms, κ 1e7 KV tokens/s,
// rate 10,000 tokens/s, budget 8,192.
// costOnly is a profile of the cost scorer alone on the precise source.
var costOnly = Config{Policy: "c", Profiles: map[string]ProfileConfig{"c": {Scorers: []ScorerConfig{
	{Type: ScorerPrecisePrefix, Weight: 0}, {Type: ScorerCost, Weight: 1}}}}}

func TestBatchModelEstimate(t *testing.T) {
	m, err := newBatchModel(BatchConfig{StepSeconds: 0.02, KVTokensPerSecond: 1e7})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name       string
		q, u, n, k float64
		ttft, work float64
	}{
		// Idle: a step starts at once; 100 tokens ride under the 20 ms floor.
		{"idle short", 0, 100, 0, 0, 0.02, 0},
		// Idle, 1,000 tokens: 0.1 s of compute, 80 ms of it beyond the floor.
		{"idle long", 0, 1000, 0, 0, 0.1, 0.08},
		// Decoding 10 requests holding 100k tokens: floor 30 ms, half of the
		// step in progress, then one floor step.
		{"decoding", 0, 100, 10, 1e5, 0.015 + 0.03, 0},
		// 20,000 tokens pending (the step in progress among them): three steps
		// compute them, its 1,000 and 30 decode tokens; its own 0.1 s is work.
		{"backlog", 20000, 1000, 10, 0, 2.103, 0.1},
	} {
		ttft, work := m.estimate(c.q, c.u, c.n, c.k, 1e4)
		if math.Abs(ttft-c.ttft) > 1e-12 || math.Abs(work-c.work) > 1e-12 {
			t.Errorf("%s: ttft %g work %g, want %g and %g", c.name, ttft, work, c.ttft, c.work)
		}
	}
}

// With the batch priced, a short prompt whose cached part rides under the
// step's memory floor leaves its prefix's busy home for an idle endpoint
// (issue 19's azure and chat cells), while a long prompt's hit, worth more
// than the half step, keeps it home; unpriced, both stay home.
func TestBatchPricedIdleEndpoint(t *testing.T) {
	pool := Pool{Capacity: caps(2, 100000), Precise: fm(1<<30, 0)} // endpoint 0 holds every prompt
	eps := ready(2)
	eps[0].InFlight, eps[0].InFlightTokens = 12, 12*1500 // decoding, no backlog
	short := req(tokens(96, 1))                          // 96 tokens: 11 ms of compute, under the 21.3 ms floor
	long := req(tokens(4000, 1))                         // 0.46 s of prefill saved at home
	p := newProfileT(t, batch70B(ttftOnly(10)), pool)
	if d := p.Pick(short, eps); d.Endpoint != 1 {
		t.Fatalf("short prompt, batch priced: %+v, want the idle endpoint", d)
	}
	if d := p.Pick(long, eps); d.Endpoint != 0 {
		t.Fatalf("long prompt, batch priced: %+v, want its home", d)
	}
	// The cost scorer alone (argmin of the TTFT estimate): the same.
	pc := newProfileT(t, batch70B(costOnly), pool)
	if d := pc.Pick(short, eps); d.Endpoint != 1 {
		t.Fatalf("cost, short prompt: %+v, want the idle endpoint", d)
	}
	if d := pc.Pick(long, eps); d.Endpoint != 0 {
		t.Fatalf("cost, long prompt: %+v, want its home", d)
	}
	// Unpriced (the default), the 96-token hit is worth 9.6 ms at 10,000 tokens/s against nothing.
	if d := newProfileT(t, costOnly, pool).Pick(short, eps); d.Endpoint != 0 {
		t.Fatalf("unpriced, short prompt: %+v, want its home", d)
	}
}

func TestBatchConfigErrors(t *testing.T) {
	for _, b := range []BatchConfig{
		{StepSeconds: -1}, {StepSeconds: math.NaN()}, {StepSeconds: math.Inf(1)},
		{StepSeconds: 0.02, KVTokensPerSecond: -1}, {StepSeconds: 0.02, StepTokens: -1},
	} {
		cfg := ttftOnly(1)
		cfg.Cost.Batch = b
		if err := Validate(cfg); err == nil || !strings.Contains(err.Error(), "cost.batch") {
			t.Errorf("%+v: %v", b, err)
		}
	}
	if err := Validate(batch70B(Config{Policy: CacheAware})); err != nil {
		t.Errorf("cache-aware priced: %v", err)
	}
}

func TestBatchPricedAllocFree(t *testing.T) {
	if raceEnabled {
		t.Skip("sync.Pool drops items under the race detector")
	}
	for _, cfg := range []Config{batch70B(ttftOnly(2)), batch70B(costOnly)} {
		p := newProfileT(t, cfg, Pool{Capacity: caps(16, 100000), Precise: fm(3, 5, 700)})
		r := req(tokens(12000, 1))
		eps := ready(16)
		eps[3].InFlight, eps[3].InFlightTokens, eps[3].PendingPrefillTokens = 4, 9000, 300
		p.Pick(r, eps)
		if n := testing.AllocsPerRun(50, func() { p.Pick(r, eps) }); n != 0 {
			t.Errorf("%s: Pick allocates %.0f times", cfg.Policy, n)
		}
	}
}
