package plan

import (
	"bytes"
	"fmt"
	"strings"
	"testing"

	"github.com/infergate/infergate/measure"
)

// judgeSummary is a run with hit rate hit (fraction), pooled reference
// pooled, TTFT percentiles p50/p90/p99 (ms) and the bucket p90s (ms; 0: an
// empty bucket).
func judgeSummary(hit, pooled, p50, p90, p99 float64, buckets ...float64) measure.Summary {
	s := measure.Summary{HitRate: hit, TTFT: measure.Latency{P50: p50, P90: p90, P99: p99}}
	if pooled > 0 {
		s.PooledHitRate = &pooled
	}
	for i, v := range buckets {
		b := measure.BucketLatency{PromptBucket: measure.PromptBuckets[i], TTFT: measure.Latency{P90: v}}
		if v > 0 {
			b.Requests = 10
		}
		s.TTFTByPromptLength = append(s.TTFTByPromptLength, b)
	}
	return s
}

func cellsByTarget(cells []Cell) map[string]Cell {
	m := map[string]Cell{}
	for _, c := range cells {
		m[c.Case.String()+" "+c.Target] = c
	}
	return m
}

func TestJudgeCells(t *testing.T) {
	c0 := Case{"mooncake", 0}
	refs := map[string]Runs{
		"llm-d":  {c0: judgeSummary(0.162, 0.169, 6300, 22700, 46800)},
		"sglang": {c0: judgeSummary(0.175, 0.169, 2380, 14500, 29600)},
		"dynamo": {c0: judgeSummary(0.090, 0.169, 3120, 8680, 22500)},
	}
	base := Runs{c0: judgeSummary(0.055, 0.169, 4400, 18600, 36500, 16000, 18000, 20000, 0)}
	cases := []Case{c0}

	// Wins every cell: equal to the best is no worse.
	win := Runs{c0: judgeSummary(0.176, 0.169, 2380, 8680, 22500, 17500, 1000, 1000, 0)}
	cells := Judge(win, refs, "least-request", base, cases, DefaultTargets)
	if lost := Lost(cells); len(lost) != 0 {
		t.Fatalf("lost %+v", lost)
	}
	// hit/pooled, 3 references, 3 percentiles, 3 non-empty buckets.
	if len(cells) != 10 {
		t.Fatalf("%d cells, want 10: %+v", len(cells), cells)
	}

	// cache-aware's Mooncake row: 94% of pooled, below llm-d and sglang,
	// p99 above dynamo's; bucket <8k 1% over the slack.
	ca := Runs{c0: judgeSummary(0.159, 0.169, 2030, 6620, 24900, 1.11*16000, 5960, 10590, 28900)}
	m := cellsByTarget(Judge(ca, refs, "least-request", base, cases, DefaultTargets))
	for target, won := range map[string]bool{
		"hit/pooled": false, "hit>=llm-d": false, "hit>=sglang": false, "hit>=dynamo": true,
		"ttft_p50": true, "ttft_p90": true, "ttft_p99": false,
		"p90 <8k": false, "p90 8-32k": true, "p90 32-64k": true,
	} {
		c, ok := m["mooncake s0 "+target]
		if !ok {
			t.Fatalf("no cell %s", target)
		}
		if c.Won != won {
			t.Errorf("%s: won %v, want %v (%+v)", target, c.Won, won, c)
		}
	}
	if _, ok := m["mooncake s0 p90 >=64k"]; ok {
		t.Error("a cell for a bucket the baseline has no request in")
	}
	if c := m["mooncake s0 ttft_p99"]; c.Against != "dynamo" || c.Want != 22500 || c.Margin() >= 0 {
		t.Errorf("p99 cell %+v (margin %g), want against dynamo's 22,500 ms, negative margin", c, c.Margin())
	}
	if c := m["mooncake s0 hit/pooled"]; c.Want != 0.95*0.169 {
		t.Errorf("hit/pooled bound %g, want %g", c.Want, 0.95*0.169)
	}

	// The baseline is a bound of the percentiles too.
	fastBase := Runs{c0: judgeSummary(0.055, 0.169, 2000, 18600, 36500, 16000)}
	m = cellsByTarget(Judge(win, refs, "least-request", fastBase, cases, DefaultTargets))
	if c := m["mooncake s0 ttft_p50"]; c.Won || c.Against != "least-request" {
		t.Errorf("p50 cell %+v, want lost against least-request", c)
	}

	// Tolerances turn near misses into ties.
	tol := DefaultTargets
	tol.HitTolerance, tol.TTFTTolerance = 0.004, 0.11
	m = cellsByTarget(Judge(ca, refs, "least-request", base, cases, tol))
	if !m["mooncake s0 hit>=llm-d"].Won || m["mooncake s0 hit>=sglang"].Won || !m["mooncake s0 ttft_p99"].Won {
		t.Errorf("with tolerances: %+v", m)
	}
}

func TestJudgeMissingRuns(t *testing.T) {
	c0, c1 := Case{"rag", 0}, Case{"rag", 1}
	refs := map[string]Runs{"sglang": {c0: judgeSummary(0.96, 0.96, 40, 70, 2100)}}
	base := Runs{c0: judgeSummary(0.69, 0.96, 1700, 10000, 18000, 0, 10000)}
	cand := Runs{c0: judgeSummary(0.96, 0.96, 40, 70, 2000, 0, 70)}
	cells := Judge(cand, refs, "least-request", base, []Case{c0, c1}, DefaultTargets)
	lost := Lost(cells)
	if len(lost) != 1 || lost[0].Case != c1 || !lost[0].Missing {
		t.Fatalf("lost %+v, want the missing case alone", lost)
	}
	// A reference missing a case loses the cells it bounds.
	cand[c1] = cand[c0]
	base[c1] = base[c0]
	lost = Lost(Judge(cand, refs, "least-request", base, []Case{c1}, DefaultTargets))
	if len(lost) != 4 { // hit>=sglang, p50, p90, p99
		t.Fatalf("lost %+v, want 4 cells bounded by the missing reference", lost)
	}
	for _, c := range lost {
		if !c.Missing {
			t.Errorf("cell %+v not marked missing", c)
		}
	}
}

func TestVersus(t *testing.T) {
	c0 := Case{"long-tail", 0}
	a := []Cell{{Case: c0, Target: "hit/pooled", Won: true}, {Case: c0, Target: "ttft_p99"}, {Case: c0, Target: "ttft_p90", Won: true}}
	b := []Cell{{Case: c0, Target: "hit/pooled"}, {Case: c0, Target: "ttft_p99", Won: true}}
	gained, givenUp := Versus(a, b)
	if len(gained) != 1 || gained[0].Target != "ttft_p99" {
		t.Errorf("gained %+v", gained)
	}
	if len(givenUp) != 2 || givenUp[0].Target != "hit/pooled" || givenUp[1].Target != "ttft_p90" || !givenUp[1].Missing {
		t.Errorf("given up %+v", givenUp)
	}
}

func TestWriteCells(t *testing.T) {
	var b bytes.Buffer
	cells := []Cell{
		{Case: Case{"long-tail", 1}, Target: "ttft_p99", Got: 19700, Want: 15900, Against: "dynamo"},
		{Case: Case{"mooncake", 2}, Target: "hit>=sglang", Got: 0.1665, Want: 0.1755, Against: "sglang"},
		{Case: Case{"rag", 0}, Target: "p90 8-32k", Against: "least-request", Missing: true},
		{Case: Case{"rag", 1}, Target: "run", Missing: true},
	}
	if err := WriteCells(&b, cells); err != nil {
		t.Fatal(err)
	}
	got := b.String()
	for _, want := range []string{
		"long-tail s1       ttft_p99         19.700s  want <=   15.900s (dynamo)   -23.9%",
		"mooncake s2        hit>=sglang       16.65%  want >=    17.55% (sglang)    -5.1%",
		"rag s0             p90 8-32k      missing run (least-request)",
		"rag s1             run            missing run\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("output lacks %q:\n%s", want, got)
		}
	}
}

// TestLeague: each candidate is judged against the others, never itself,
// and the standings are ordered by cells lost.
func TestLeague(t *testing.T) {
	c0 := Case{"mooncake", 0}
	cands := map[string]Runs{
		"a": {c0: judgeSummary(0.170, 0.169, 2000, 8000, 23000)},  // loses hit>=b, p99 to c
		"b": {c0: judgeSummary(0.175, 0.169, 2400, 14000, 29000)}, // loses p50, p90, p99
		"c": {c0: judgeSummary(0.090, 0.169, 3100, 8600, 22000)},  // wins p99 alone
	}
	base := Runs{c0: judgeSummary(0.055, 0.169, 4400, 18600, 36500)}
	st := League(cands, "least-request", base, []Case{c0}, DefaultTargets)
	var got []string
	for _, s := range st {
		got = append(got, fmt.Sprintf("%s:%d/%d", s.Label, s.Lost, len(s.Cells)))
		for _, c := range s.Cells {
			if c.Target == "hit>="+s.Label || c.Against == s.Label {
				t.Errorf("%s judged against itself: %+v", s.Label, c)
			}
		}
	}
	// hit/pooled, two rivals' hit rates, three percentiles: 6 cells each.
	if want := "a:2/6 b:3/6 c:5/6"; strings.Join(got, " ") != want {
		t.Fatalf("standings %v, want %s", got, want)
	}
	m := cellsByTarget(st[0].Cells)
	if c := m["mooncake s0 ttft_p99"]; c.Won || c.Against != "c" {
		t.Errorf("a's p99 cell %+v, want lost against c", c)
	}
	// Judged with itself among its references, b would tie its own hit rate.
	if m := cellsByTarget(Judge(cands["b"], cands, "least-request", base, []Case{c0}, DefaultTargets)); !m["mooncake s0 hit>=b"].Won {
		t.Error("Judge against a set holding the candidate: its own hit cell is not a tie")
	}
}
