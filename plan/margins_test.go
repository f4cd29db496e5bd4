package plan

import (
	"math"
	"testing"
)

// TestMargins: ratios to the best, ranks and the geometric mean, by hand.
func TestMargins(t *testing.T) {
	c0, c1 := Case{"mooncake", 0}, Case{"mooncake", 1}
	cands := map[string]Runs{
		"a": {c0: judgeSummary(0.170, 0.169, 2000, 8000, 23000), c1: judgeSummary(0.5, 0.5, 1, 1, 1)},
		"b": {c0: judgeSummary(0.175, 0.169, 2400, 14000, 29000), c1: judgeSummary(0.5, 0.5, 9, 9, 9)},
		"c": {c0: judgeSummary(0.090, 0.169, 3100, 8600, 22000)}, // no c1: c1 counts for nobody
	}
	base := Runs{c0: judgeSummary(0.055, 0.169, 4400, 18600, 36500), c1: judgeSummary(0.1, 0.5, 5, 5, 5)}
	got := Margins(cands, base, []Case{c0, c1})
	want := []struct {
		label    string
		excess   float64
		meanRank float64
		best     int
	}{
		{"a", math.Pow(0.175/0.170*23000/22000, 0.25) - 1, 1.5, 2},
		{"b", math.Pow(1.2*1.75*29000/22000, 0.25) - 1, 2.25, 1},
		{"c", math.Pow(0.175/0.090*3100/2000*8600/8000, 0.25) - 1, 2.25, 1},
	}
	if len(got) != len(want) {
		t.Fatalf("%d margins, want %d: %+v", len(got), len(want), got)
	}
	for i, w := range want {
		g := got[i]
		if g.Label != w.label || g.Cells != 4 || math.Abs(g.Excess-w.excess) > 1e-12 || g.MeanRank != w.meanRank || g.Best != w.best {
			t.Errorf("margin %d: %+v, want %s cells 4 excess %.6f mean rank %.2f best %d", i, g, w.label, w.excess, w.meanRank, w.best)
		}
	}
	if h := got[1].ByMetric["ttft_p90"]; math.Abs(h-0.75) > 1e-12 {
		t.Errorf("b's p90 excess %v, want 0.75", h)
	}
	if h := got[0].ByMetric["ttft_p50"]; h != 0 {
		t.Errorf("a's p50 excess %v, want 0 (the best)", h)
	}
}

// TestMarginsTwins: what Margins is for. Two near-twin profiles split the
// TTFT cells between them, so League ranks first a policy with the best
// hit rate and three times their latencies; Margins ranks it last.
func TestMarginsTwins(t *testing.T) {
	c0 := Case{"mooncake", 0}
	cands := map[string]Runs{
		"twin1": {c0: judgeSummary(0.170, 0.169, 2000, 6300, 20100, 3000)},
		"twin2": {c0: judgeSummary(0.169, 0.169, 2010, 6200, 20000, 2990)},
		"rule":  {c0: judgeSummary(0.171, 0.169, 3200, 14700, 33000, 12000)},
	}
	base := Runs{c0: judgeSummary(0.055, 0.169, 4400, 18600, 36500, 16000)}
	st := League(cands, "least-request", base, []Case{c0}, DefaultTargets)
	// rule loses p50, p90, p99; twin1 hit>=rule, p90, p99; twin2 both hits and p50.
	if st[0].Label != "rule" || st[0].Lost != 3 || st[1].Lost != 3 || st[2].Lost != 3 {
		t.Fatalf("league %+v: want rule first, tied at 3 cells (the degenerate ranking Margins exists for)", st)
	}
	m := Margins(cands, base, []Case{c0})
	if m[len(m)-1].Label != "rule" || m[0].Label == "rule" {
		t.Fatalf("margins order %s %s %s, want rule last", m[0].Label, m[1].Label, m[2].Label)
	}
	// 5 cells: hit, 3 percentiles, one bucket.
	if m[0].Cells != 5 {
		t.Errorf("%d cells, want 5", m[0].Cells)
	}
	// A zero hit rate keeps the ratio finite.
	cands["zero"] = Runs{c0: judgeSummary(0, 0.169, 2000, 6300, 20000, 3000)}
	for _, g := range Margins(cands, base, []Case{c0}) {
		if math.IsInf(g.Excess, 0) || math.IsNaN(g.Excess) {
			t.Errorf("%s: excess %v", g.Label, g.Excess)
		}
	}
}

// TestMarginsEdges: no candidates is no margins (not a panic), and a NaN
// (a Summary built in code; JSON has none) leaves its cell out for every
// candidate instead of making every excess NaN.
func TestMarginsEdges(t *testing.T) {
	c0 := Case{"mooncake", 0}
	base := Runs{c0: judgeSummary(0.055, 0.169, 4400, 18600, 36500, 16000)}
	if m := Margins(nil, base, []Case{c0}); m != nil {
		t.Errorf("no candidates: %+v, want nil", m)
	}
	cands := map[string]Runs{
		"a": {c0: judgeSummary(0.170, 0.169, 2000, 6300, 20100, 3000)},
		"b": {c0: judgeSummary(0.170, 0.169, 2000, math.NaN(), 20100, 3000)},
	}
	for _, g := range Margins(cands, base, []Case{c0}) {
		if g.Cells != 4 || g.Excess != 0 || g.MeanRank != 1 {
			t.Errorf("%s: %+v, want 4 cells (p90 left out), excess 0, mean rank 1", g.Label, g)
		}
		if _, ok := g.ByMetric["ttft_p90"]; ok {
			t.Errorf("%s: p90 measured with a NaN", g.Label)
		}
	}
}
