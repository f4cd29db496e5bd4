package plan

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/report"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
)

// sweepResult is a 2-size × 2-policy sweep whose 8-engine prefix run is
// recommended, with references and an SLO of two targets and a goodput
// requirement.
func sweepResult() Result {
	res := Result{SLO: "ttft_p90=2s,itl_p99=100ms,goodput>=0.9", MinGoodput: 0.9, Requests: 100, Engines: []int{4, 8}, Policies: []string{"prefix", "least-request"}}
	inf := 0.374
	res.InfiniteHitRate = &inf
	for _, n := range res.Engines {
		for j, p := range res.Policies {
			pooled := 0.1 + 0.02*float64(n)
			s := measure.Summary{Policy: p, Requests: 100, HitRate: pooled - 0.05*float64(j), PooledHitRate: &pooled,
				Goodput: &measure.Goodput{SLO: res.SLO, Requests: 10 * n, Share: float64(n) / 8.5}}
			s.TTFT.P90 = 8000 / float64(n)
			s.ITL.P99 = 400 / float64(n)
			res.Rows = append(res.Rows, Row{Engines: n, Policy: p, Summary: s, MeetsSLO: n == 8, Checks: []Check{
				{Target: "ttft_p90", LimitMs: 2000, ObservedMs: s.TTFT.P90, OK: s.TTFT.P90 <= 2000},
				{Target: "itl_p99", LimitMs: 100, ObservedMs: s.ITL.P99, OK: s.ITL.P99 <= 100}}})
		}
	}
	res.Recommendation = &Recommendation{Engines: 8, Policy: "prefix", Row: 2}
	return res
}

func charts(p report.Page) map[string]report.Chart {
	out := map[string]report.Chart{}
	for _, s := range p.Sections {
		for _, c := range s.Charts {
			out[c.Key] = c
		}
	}
	return out
}

// hlineAt returns the value and pixel y of c's horizontal line keyed key.
func hlineAt(t *testing.T, c report.Chart, key string) (float64, float64) {
	t.Helper()
	for _, l := range c.Lines {
		if l.Kind == "hline" && l.Key == key {
			v, err := strconv.ParseFloat(l.Value, 64)
			if err != nil {
				t.Fatalf("%s: %s line value %q", c.Title, key, l.Value)
			}
			var x0, y0, x1, y1 float64
			if _, err := fmt.Sscanf(l.D, "M%g %g L%g %g", &x0, &y0, &x1, &y1); err != nil || y0 != y1 || x0 != c.X0 || x1 != c.X1 {
				t.Fatalf("%s: %s line %q is not horizontal across the plot", c.Title, key, l.D)
			}
			return v, y0
		}
	}
	t.Fatalf("%s: no %s line", c.Title, key)
	return 0, 0
}

// logY is where value v falls on c's log axis, from its ticks (powers of ten).
func logY(t *testing.T, c report.Chart, v float64) float64 {
	t.Helper()
	if len(c.YTicks) < 2 {
		t.Fatalf("%s: %d y ticks", c.Title, len(c.YTicks))
	}
	a, b := c.YTicks[0], c.YTicks[len(c.YTicks)-1]
	decades := float64(len(c.YTicks) - 1)
	lo := parseMsTick(t, a.Label)
	return a.Pos + (math.Log10(v)-math.Log10(lo))/decades*(b.Pos-a.Pos)
}

func parseMsTick(t *testing.T, s string) float64 {
	t.Helper()
	for unit, f := range map[string]float64{" ms": 1, " s": 1000, " min": 60000} {
		if num, ok := strings.CutSuffix(s, unit); ok {
			v, err := strconv.ParseFloat(num, 64)
			if err == nil {
				return v * f
			}
		}
	}
	t.Fatalf("tick %q", s)
	return 0
}

// TestResultHTMLPage: every SLO target has its chart against fleet size
// with a horizontal line at the target's value, goodput one at the
// goodput>= requirement, the hit rate the pooled reference of each size
// and the infinite one; the recommended run is marked on each at its
// value, and its row is highlighted.
func TestResultHTMLPage(t *testing.T) {
	res := sweepResult()
	cs := charts(res.HTMLPage())
	rec := res.Rows[2]
	for i, key := range []string{"slo-ttft_p90", "slo-itl_p99"} {
		c, ok := cs[key]
		if !ok {
			t.Fatalf("no chart %s (have %v)", key, cs)
		}
		limit := rec.Checks[i].LimitMs
		v, y := hlineAt(t, c, "slo")
		if v != limit {
			t.Errorf("%s: SLO line at %v, want %v", key, v, limit)
		}
		if want := logY(t, c, limit); math.Abs(y-want) > 0.2 {
			t.Errorf("%s: SLO line at y=%v px, want %v (where %v ms falls on the axis)", key, y, want, limit)
		}
		if len(c.Marks) != 1 || c.Marks[0].Key != "recommended" || c.Marks[0].DataX != "8" || c.Marks[0].DataY != strconv.FormatFloat(rec.Checks[i].ObservedMs, 'g', -1, 64) {
			t.Errorf("%s: marks %+v, want the recommended run (8, %v)", key, c.Marks, rec.Checks[i].ObservedMs)
		}
		if n := len(c.Lines); n != 3 {
			t.Errorf("%s: %d lines, want 2 policies + the SLO", key, n)
		}
	}
	if _, ok := cs["ttft-p90"]; ok {
		t.Error("a TTFT p90 chart beside the SLO's own TTFT chart")
	}
	if v, _ := hlineAt(t, cs["goodput"], "slo"); v != 0.9 {
		t.Errorf("goodput SLO line at %v, want 0.9", v)
	}
	hit := cs["hit-rate"]
	if v, _ := hlineAt(t, hit, "infinite"); v != 0.374 {
		t.Errorf("infinite line at %v", v)
	}
	var pooled *report.Line
	for i := range hit.Lines {
		if hit.Lines[i].Key == "pooled" {
			pooled = &hit.Lines[i]
		}
	}
	if pooled == nil || pooled.Kind != "ref" || strings.Count(pooled.D, "L") != 1 {
		t.Errorf("pooled reference: %+v, want a dashed curve through both sizes", pooled)
	}
	if m := hit.Marks; len(m) != 1 || m[0].DataY != strconv.FormatFloat(rec.Summary.HitRate, 'g', -1, 64) {
		t.Errorf("hit-rate marks %+v", m)
	}

	var b bytes.Buffer
	if err := res.WriteHTML(&b); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	if strings.Contains(out, "recommendation: 8") {
		t.Error("the recommendation fact repeats its label in its value")
	}
	for _, want := range []string{"8 engines, policy prefix", `<td class="txt">least-request</td>`, `<tr class="recommended">`,
		`data-key="slo" data-value="2000"`, `data-key="slo" data-value="100"`, `data-key="recommended" data-x="8"`, "SLO ttft_p90 ≤ 2s",
		`data-field="slo"`, `<th>pooled-cache hit %</th>`, "<td class=\"num\">26.0</td>"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if strings.Contains(out, "http") {
		t.Error("external reference")
	}

	// No fleet meets it: an alert, no mark.
	res.Recommendation = nil
	p := res.HTMLPage()
	if len(p.Sections[0].Alerts) != 1 || !strings.Contains(p.Sections[0].Alerts[0].Text, "no fleet in range") {
		t.Errorf("alerts %+v", p.Sections[0].Alerts)
	}
	if c := charts(p)["slo-ttft_p90"]; len(c.Marks) != 0 {
		t.Errorf("marks without a recommendation: %+v", c.Marks)
	}
}

// TestRunReferences: every row carries the pooled reference of its fleet
// size and the infinite one, equal to measure.PooledCacheHitRate and
// trace.InfiniteCacheHitRate of the replayed records; NoReferences skips
// them.
func TestRunReferences(t *testing.T) {
	recs := conversationTrace(60)
	slo, _ := ParseSLO("ttft_p90=60s")
	opts := Options{Records: recs, Engines: []int{1, 2}, Policies: []string{"prefix", "least-request"}, SLO: slo,
		Engine: sim.Config{Profile: sim.DefaultProfile(), NumBlocks: 2000}}
	res, err := Run(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	ec := opts.Engine.WithDefaults()
	wantInf := trace.InfiniteCacheHitRate(recs)
	if res.InfiniteHitRate == nil || math.Abs(*res.InfiniteHitRate-wantInf) > 1e-12 {
		t.Errorf("infinite %v, want %v", res.InfiniteHitRate, wantInf)
	}
	for _, row := range res.Rows {
		want := measure.PooledCacheHitRate(recs, row.Engines*ec.NumBlocks, ec.BlockSize)
		s := row.Summary
		if s.PooledHitRate == nil || *s.PooledHitRate != want || s.InfiniteHitRate == nil || math.Abs(*s.InfiniteHitRate-wantInf) > 1e-12 {
			t.Errorf("%d engines, %s: pooled %v (want %v), infinite %v (want %v)", row.Engines, row.Policy, s.PooledHitRate, want, s.InfiniteHitRate, wantInf)
		}
	}
	if p1, p2 := *res.Rows[0].Summary.PooledHitRate, *res.Rows[2].Summary.PooledHitRate; !(p2 > p1) {
		t.Errorf("pooled reference of 2 engines %v not above 1 engine's %v: the capacity does not count", p2, p1)
	}
	opts.NoReferences = true
	res, err = Run(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	if res.InfiniteHitRate != nil || res.Rows[0].Summary.PooledHitRate != nil {
		t.Error("NoReferences computed references")
	}
}

// conversationTrace is n requests of 20 conversations whose turns extend
// the previous one by a 512-token block, 1 s apart.
func conversationTrace(n int) []trace.Record {
	recs := make([]trace.Record, n)
	for i := range recs {
		conv, turn := i%20, i/20
		ids := []int64{0}
		for k := 0; k <= turn+1; k++ {
			ids = append(ids, int64(1000*(conv+1)+k))
		}
		recs[i] = trace.Record{Timestamp: time.Duration(i) * time.Second, InputLength: 512 * len(ids), OutputLength: 4, HashIDs: ids}
	}
	return recs
}
