package measure

import (
	"math"
	"testing"
)

func TestPercentile(t *testing.T) {
	xs := []float64{1, 2, 3, 4}
	// Values from numpy.percentile([1, 2, 3, 4], p).
	for _, tc := range []struct{ p, want float64 }{
		{0, 1}, {25, 1.75}, {50, 2.5}, {90, 3.7}, {99, 3.97}, {100, 4}, {-5, 1}, {150, 4},
	} {
		if got := Percentile(xs, tc.p); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("Percentile(%v, %v) = %v, want %v", xs, tc.p, got, tc.want)
		}
	}
	if Percentile(nil, 50) != 0 || Percentile([]float64{7}, 99) != 7 {
		t.Error("empty or single-sample percentile wrong")
	}
	// 1..100: p-th percentile is 1 + 0.99·p.
	hundred := make([]float64, 100)
	for i := range hundred {
		hundred[i] = float64(i + 1)
	}
	if got := Percentile(hundred, 90); math.Abs(got-90.1) > 1e-12 {
		t.Errorf("p90 of 1..100 = %v, want 90.1", got)
	}
}

func syntheticRecords() []Record {
	return []Record{
		{Index: 0, ArrivalMs: 0, TTFTMs: 100, ITLMs: []float64{10, 20}, E2EMs: 130, PromptTokens: 1000, CachedTokens: 0, OutputTokens: 3, Status: 200},
		{Index: 1, ArrivalMs: 500, TTFTMs: 300, ITLMs: []float64{30}, E2EMs: 330, PromptTokens: 1000, CachedTokens: 800, OutputTokens: 2, Status: 200},
		{Index: 2, ArrivalMs: 1000, TTFTMs: 200, ITLMs: []float64{40, 50, 60}, E2EMs: 350, PromptTokens: 2000, CachedTokens: 1000, OutputTokens: 4, Status: 200},
		// A failure counts in requests, errors and duration only.
		{Index: 3, ArrivalMs: 1500, E2EMs: 2500, Status: 503, Error: "HTTP 503: overloaded"},
	}
}

func TestSummarize(t *testing.T) {
	s := Summarize("prefix", syntheticRecords())
	near := func(name string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-9 {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	if s.Policy != "prefix" || s.Requests != 4 || s.Errors != 1 {
		t.Errorf("policy %q requests %d errors %d", s.Policy, s.Requests, s.Errors)
	}
	if s.PromptTokens != 4000 || s.CachedTokens != 1800 || s.PrefillTokensComputed != 2200 || s.OutputTokens != 9 {
		t.Errorf("tokens %d %d %d %d", s.PromptTokens, s.CachedTokens, s.PrefillTokensComputed, s.OutputTokens)
	}
	near("hit_rate", s.HitRate, 0.45)
	near("duration_s", s.DurationS, 4)              // failure ends at 1500 + 2500 ms
	near("output_tok_per_s", s.OutputTokPerS, 2.25) // 9 tokens / 4 s
	near("ttft p50", s.TTFT.P50, 200)
	near("ttft p90", s.TTFT.P90, 280)
	near("ttft p99", s.TTFT.P99, 298)
	near("ttft mean", s.TTFT.Mean, 200)
	// ITL pools every gap: 10 20 30 40 50 60.
	near("itl p50", s.ITL.P50, 35)
	near("itl p99", s.ITL.P99, 59.5)
	near("e2e p50", s.E2E.P50, 330)
	if s.MeanEngineUtilization != nil {
		t.Error("utilization should be unknown")
	}

	empty := Summarize("x", nil)
	if empty.HitRate != 0 || empty.OutputTokPerS != 0 || empty.TTFT != (Latency{}) {
		t.Errorf("empty summary %+v", empty)
	}
}

func TestTTFTByPromptLength(t *testing.T) {
	var recs []Record
	add := func(prompt int, ttft float64) {
		recs = append(recs, Record{PromptTokens: prompt, TTFTMs: ttft, E2EMs: ttft})
	}
	for i := range 10 {
		add(100+i, float64(10+i)) // <8k: 10..19 ms
	}
	add(8191, 30)                                                    // still <8k
	add(8192, 1000)                                                  // 8-32k
	add(40000, 2000)                                                 // 32-64k
	add(65536, 5000)                                                 // >=64k
	add(130000, 9000)                                                // >=64k
	recs = append(recs, Record{PromptTokens: 200000, Error: "boom"}) // failed: left out
	s := Summarize("p", recs)
	b := s.TTFTByPromptLength
	if len(b) != 4 {
		t.Fatalf("%d buckets", len(b))
	}
	want := []struct {
		name     string
		n        int
		p50, p99 float64
	}{{"<8k", 11, 15, Percentile([]float64{10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 30}, 99)}, {"8-32k", 1, 1000, 1000}, {"32-64k", 1, 2000, 2000}, {">=64k", 2, 7000, 5000 + 0.99*4000}}
	for i, w := range want {
		if b[i].Name != w.name || b[i].Requests != w.n || b[i].TTFT.P50 != w.p50 || math.Abs(b[i].TTFT.P99-w.p99) > 1e-9 {
			t.Errorf("bucket %d: %+v, want %+v", i, b[i], w)
		}
	}
	if e := Summarize("p", nil).TTFTByPromptLength; len(e) != 4 || e[3].Requests != 0 {
		t.Fatalf("no records: %+v", e)
	}
}
