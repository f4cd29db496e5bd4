package report

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/data"
	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/trace"
)

// synthRun makes n synthetic records for policy, served round-robin by
// engines engines.
func synthRun(policy string, n, engines int, seed uint64) HTMLRun {
	rng := rand.New(rand.NewPCG(seed, 1))
	recs := make([]measure.Record, n)
	eng := make([]int, n)
	for i := range recs {
		itl := make([]float64, 20)
		for k := range itl {
			itl[k] = 5 + rng.ExpFloat64()*20
		}
		recs[i] = measure.Record{Policy: policy, Index: i, ArrivalMs: float64(i) * 50, TTFTMs: 50 + rng.ExpFloat64()*500,
			ITLMs: itl, E2EMs: 2000 + rng.Float64()*3000, PromptTokens: 4000, CachedTokens: rng.IntN(4000), OutputTokens: 21, Status: 200}
		eng[i] = i % engines
	}
	recs[3].Error = "boom"
	return HTMLRun{Summary: measure.Summarize(policy, recs), Records: recs, Engine: eng}
}

func TestWriteHTML(t *testing.T) {
	runs := []HTMLRun{synthRun("round-robin", 12000, 8, 1), synthRun("prefix<&>", 12000, 8, 2)}
	var b bytes.Buffer
	if err := WriteHTML(&b, `bench <script>alert(1)</script>`, runs); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	if b.Len() > 2<<20 {
		t.Errorf("report of 2×12k requests is %d bytes, want < 2 MiB", b.Len())
	}
	for _, want := range []string{"<!DOCTYPE html>", "</html>", "<table>", `<td class="txt">round-robin</td>`, `<td class="txt">prefix&lt;&amp;&gt;</td>`,
		"TTFT CDF", "ITL CDF", "hit rate over time", "TTFT p50 over time", "in flight", "Per-endpoint request share", "share of requests"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if strings.Contains(out, "<script>") {
		t.Error("title not escaped")
	}
	if got := strings.Count(out, "<svg"); got != 9 {
		t.Errorf("%d <svg>, want 9", got)
	}
	// 5 line charts × 2 policies.
	if got := len(regexp.MustCompile(`<path d="M[0-9.]+ [0-9.]+ L`).FindAllString(out, -1)); got != 10 {
		t.Errorf("%d non-empty paths, want 10", got)
	}
	if got := strings.Count(out, "<rect x="); got < 16 {
		t.Errorf("%d rects, want ≥ 16 bars", got)
	}
	for _, bad := range []string{"http://", "https://", "<script", "<link", " src="} {
		if strings.Contains(out, bad) {
			t.Errorf("report contains %q", bad)
		}
	}
	// Each CDF line has at most cdfPoints points.
	for _, m := range regexp.MustCompile(`<path d="([^"]*)"`).FindAllStringSubmatch(out, -1) {
		if n := strings.Count(m[1], "L") + 1; n > cdfPoints {
			t.Errorf("path with %d points, want ≤ %d", n, cdfPoints)
		}
	}
}

func TestWriteHTMLEngineUnknown(t *testing.T) {
	r := synthRun("target", 100, 4, 3)
	r.Engine = nil
	var b bytes.Buffer
	if err := WriteHTML(&b, "t", []HTMLRun{r, {Summary: measure.Summarize("empty", nil)}}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "Not known for this run") {
		t.Error("no note for unknown engines")
	}
	r.EnginePromptTokens = []int64{10, 20, 30, 40}
	b.Reset()
	if err := WriteHTML(&b, "t", []HTMLRun{r}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "share of prompt tokens") {
		t.Error("no prompt-token share chart")
	}
}

func TestCDF(t *testing.T) {
	xs := make([]float64, 10000)
	for i := range xs {
		xs[i] = float64(len(xs) - i)
	}
	x, y := CDF(xs)
	if len(x) != cdfPoints || x[0] != 1 || x[len(x)-1] != 10000 || y[len(y)-1] != 1 {
		t.Errorf("CDF: %d points, first %v, last %v/%v", len(x), x[0], x[len(x)-1], y[len(y)-1])
	}
	if x, _ := CDF([]float64{3}); fmt.Sprint(x) != "[3]" {
		t.Errorf("CDF of one: %v", x)
	}
}

// TestWriteHTMLBehind: a run that fell behind its time scale says so in
// the report, beside its row.
func TestWriteHTMLBehind(t *testing.T) {
	r := synthRun("prefix", 100, 4, 3)
	r.Summary.FleetLag = &measure.Lag{Samples: 10, P50: 5, P99: 1342, Max: 5211}
	r.Summary.CheckLag(0)
	var b bytes.Buffer
	if err := WriteHTML(&b, "t", []HTMLRun{r, synthRun("round-robin", 100, 4, 4)}); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"<th>lag p99 ms</th>", `<td class="num bad">1342 BEHIND</td>`, "WARNING: prefix fell behind its time scale"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if strings.Contains(out, "round-robin fell behind") {
		t.Error("a run without lag reported behind")
	}
}

func pageCharts(p Page) map[string]Chart {
	out := map[string]Chart{}
	for _, s := range p.Sections {
		for _, c := range s.Charts {
			out[c.Key] = c
		}
	}
	return out
}

// TestHTMLReportPercentiles: the ITL and TTFT percentile bars are each
// run's pooled gaps' and TTFTs' p50, p90, p99, as Summarize computes them.
func TestHTMLReportPercentiles(t *testing.T) {
	runs := []HTMLRun{synthRun("round-robin", 500, 4, 1), synthRun("prefix", 500, 4, 2)}
	cs := pageCharts(HTMLReport{Title: "t", Runs: runs}.Page())
	for key, get := range map[string]func(measure.Summary) measure.Latency{
		"itl-percentiles": func(s measure.Summary) measure.Latency { return s.ITL }, "ttft-percentiles": func(s measure.Summary) measure.Latency { return s.TTFT }} {
		c := cs[key]
		if len(c.Bars) != 6 {
			t.Fatalf("%s: %d bars, want 3 percentiles × 2 runs", key, len(c.Bars))
		}
		for g, p := range []string{"p50", "p90", "p99"} {
			if c.XTicks[g].Label != p {
				t.Errorf("%s: group %d is %q", key, g, c.XTicks[g].Label)
			}
			for i, r := range runs {
				l := get(r.Summary)
				want := []float64{l.P50, l.P90, l.P99}[g]
				if got := c.Bars[g*len(runs)+i].Value; got != want {
					t.Errorf("%s %s %s: bar %v, want the summary's %v", key, r.Summary.Policy, p, got, want)
				}
			}
		}
	}
}

// TestHTMLReportReferences: the hit-rate chart has the runs' pooled and
// infinite references as horizontal lines at their values, the table has
// them beside each run's hit rate, and with References the hit rate over
// time gains both caches' curves.
func TestHTMLReportReferences(t *testing.T) {
	moon, err := trace.LoadMooncake(data.Embedded + data.Mooncake)
	if err != nil {
		t.Fatal(err)
	}
	recs := moon[:200]
	refs := measure.NewReferences(recs, 8000, 16)
	runs := []HTMLRun{synthRun("round-robin", len(recs), 4, 1), synthRun("prefix", len(recs), 4, 2)}
	for i := range runs {
		refs.Apply(&runs[i].Summary, runs[i].Records)
	}
	pooled, inf := *runs[0].Summary.PooledHitRate, *runs[0].Summary.InfiniteHitRate
	// Record 3 failed (synthRun): the references leave it out, as HitRate does.
	all, _ := refs.All()
	if pooled == *all {
		t.Fatalf("the run's pooled reference %v equals the whole replay's: the failed request was counted", pooled)
	}
	page := HTMLReport{Title: "t", Runs: runs, References: refs}.Page()
	cs := pageCharts(page)
	hit := cs["hit-rate"]
	for key, want := range map[string]float64{"pooled": pooled, "infinite": inf} {
		found := false
		for _, l := range hit.Lines {
			if l.Kind == "hline" && l.Key == key {
				found = true
				if l.Value != strconv.FormatFloat(want, 'g', -1, 64) {
					t.Errorf("%s line at %s, want %v", key, l.Value, want)
				}
				var y0, y1 float64
				fmt.Sscanf(l.D, "M%g %g L%g %g", new(float64), &y0, new(float64), &y1)
				if y0 != y1 {
					t.Errorf("%s line not horizontal: %s", key, l.D)
				}
			}
		}
		if !found {
			t.Errorf("no %s line on the hit-rate chart", key)
		}
	}
	keys := map[string]string{}
	for _, l := range cs["hit-rate-time"].Lines {
		keys[l.Key] = l.Kind
	}
	if keys["pooled"] != "ref" || keys["infinite"] != "ref" {
		t.Errorf("hit rate over time: lines %v, want pooled and infinite reference curves", keys)
	}
	var tab *Table
	var buckets *Table
	for _, s := range page.Sections {
		switch s.Title {
		case "Summary":
			tab = s.Table
		case "TTFT by prompt length":
			buckets = s.Table
		}
	}
	if buckets == nil || len(buckets.Rows) != len(runs) || len(buckets.Head) != 1+2*len(measure.PromptBuckets) {
		t.Errorf("TTFT by prompt length: %+v", buckets)
	}
	if tab.Head[4] != "pooled-cache hit %" || tab.Head[5] != "infinite-cache hit %" ||
		tab.Rows[0][4] != fmt.Sprintf("%.1f", pooled*100) || tab.Rows[0][5] != fmt.Sprintf("%.1f", inf*100) {
		t.Errorf("table %q, row %q", tab.Head, tab.Rows[0])
	}
	var b bytes.Buffer
	if err := WriteHTMLReport(&b, HTMLReport{Title: "t", Runs: runs, References: refs}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`class="hline" fill="none" stroke="#333333" stroke-width="1.6" stroke-dasharray="8 4" data-key="pooled" data-value="` + strconv.FormatFloat(pooled, 'g', -1, 64) + `"`,
		`data-key="infinite" data-value="` + strconv.FormatFloat(inf, 'g', -1, 64) + `"`, `data-chart="itl-percentiles"`} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("report lacks %q", want)
		}
	}
}

// TestLineChartMarks: a horizontal line sits at its value's pixel row and
// widens the axis to include it; a mark sits at its point.
func TestLineChartMarks(t *testing.T) {
	c := LineChart("t", Axis{Min: 0, Max: 10}, Axis{Label: "y"}, []Series{
		{Name: "a", X: []float64{1, 2, 3}, Y: []float64{10, 20, 30}},
		HLine("limit", "slo", 50, SLOColor),
		{Name: "best", Kind: SeriesMark, Key: "recommended", X: []float64{2}, Y: []float64{20}},
	})
	ys := scale(false, 0, 50, c.Y1, c.Y0)
	xs := scale(false, 0, 10, c.X0, c.X1)
	if len(c.Lines) != 2 || c.Lines[1].Kind != "hline" || c.Lines[1].Value != "50" || c.Lines[1].D != fmt.Sprintf("M%.1f %.1f L%.1f %.1f", c.X0, ys(50), c.X1, ys(50)) {
		t.Errorf("lines %+v", c.Lines)
	}
	if ys(50) != c.Y0 {
		t.Errorf("the axis does not reach the line: top %v, line %v", c.Y0, ys(50))
	}
	if len(c.Lines[0].Dots) != 3 {
		t.Errorf("%d dots on a 3-point series", len(c.Lines[0].Dots))
	}
	if m := c.Marks; len(m) != 1 || m[0].X != round1(xs(2)) || m[0].Y != round1(ys(20)) || m[0].DataY != "20" {
		t.Errorf("marks %+v", m)
	}
	if len(c.Legend) != 3 || c.Legend[1].Kind != "line" || c.Legend[2].Kind != "mark" || c.Legend[1].Color != SLOColor {
		t.Errorf("legend %+v", c.Legend)
	}
}

// TestReportProvenance: the JSON report and the HTML page carry the
// provenance; a secret given on the command line is in neither.
func TestReportProvenance(t *testing.T) {
	p := measure.NewProvenance("v9", []string{"infergate", "bench", "--target", "http://u:pw-123@h:1/v1", "--token=tok-456"}, time.Now())
	p.Clock, p.Target, p.TimeScale, p.Speedup = "real", measure.RedactValue("http://u:pw-123@h:1/v1"), 1, 2
	tf, err := measure.DescribeFile(data.Embedded + data.Mooncake)
	if err != nil {
		t.Fatal(err)
	}
	p.Workload = &measure.Workload{Kind: "mooncake", Files: []measure.SourceFile{tf}, Records: 12031, Replayed: 100}
	run := synthRun("target", 100, 4, 1)
	var js bytes.Buffer
	if err := (Report{Runs: []measure.Summary{run.Summary}, Provenance: p}).WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var back struct {
		Provenance measure.Provenance `json:"provenance"`
	}
	if err := json.Unmarshal(js.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	if bp := back.Provenance; bp.Version != "v9" || bp.Workload == nil || bp.Workload.Files[0].SHA256 != tf.SHA256 || bp.Clock != "real" || len(bp.Command) != 5 {
		t.Errorf("JSON provenance %+v", bp)
	}
	var h bytes.Buffer
	if err := WriteHTMLReport(&h, HTMLReport{Title: "t", Runs: []HTMLRun{run}, Provenance: p}); err != nil {
		t.Fatal(err)
	}
	for _, out := range []string{js.String(), h.String()} {
		if strings.Contains(out, "pw-123") || strings.Contains(out, "tok-456") {
			t.Errorf("secret in a report:\n%s", out)
		}
	}
	for _, want := range []string{`data-field="command"`, `data-field="version"`, "<code>" + tf.Path, tf.SHA256, `data-field="lag"`,
		"real time: arrivals ÷ 2", "infergate v9 ·"} {
		if !strings.Contains(h.String(), want) {
			t.Errorf("HTML lacks %q", want)
		}
	}
}

// TestMeasuredRun: the HTML report's run loses its warm-up records and
// their engines.
func TestMeasuredRun(t *testing.T) {
	recs := []measure.Record{{ArrivalMs: 0}, {ArrivalMs: 100}, {ArrivalMs: 1000}, {ArrivalMs: 1500}}
	(measure.Warmup{Duration: time.Second}).Mark(recs)
	if m := MeasuredRun(HTMLRun{Records: recs, Engine: []int{0, 1, 2, 3}}); len(m.Records) != 2 || !slices.Equal(m.Engine, []int{2, 3}) {
		t.Errorf("MeasuredRun: %d records, engines %v", len(m.Records), m.Engine)
	}
}

// TestHTMLReportTiers: runs that report KV tiers get the hits-by-tier charts
// and table; runs that do not, none.
func TestHTMLReportTiers(t *testing.T) {
	plain := synthRun("gpu-only", 200, 4, 3)
	tiered := synthRun("tiered", 200, 4, 4)
	for i := range tiered.Records {
		r := &tiered.Records[i]
		r.TierTokens = &[measure.NumTiers]int{r.CachedTokens / 2, r.CachedTokens / 4, 0, r.CachedTokens - r.CachedTokens/2 - r.CachedTokens/4}
		p := *r.TierTokens
		p[1] += 16
		r.PredictedTierTokens = &p
	}
	tiered.Summary = measure.Summarize("tiered", tiered.Records)
	if s := tiered.Summary; s.TierHitRate == nil || s.TierPredictionMAE == nil || s.TierPredictionMAE.Host != 16 || s.TierPredictionMAE.GPU != 0 {
		t.Fatalf("summary tiers: %+v %+v", s.TierHitRate, s.TierPredictionMAE)
	}
	var b bytes.Buffer
	if err := WriteHTML(&b, "tiers", []HTMLRun{plain, tiered}); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"Hits by tier, as the engines served them", "as the precise index predicted them", "MAE gpu/host/disk/remote tokens", "0/16/0/0"} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	b.Reset()
	if err := WriteHTML(&b, "plain", []HTMLRun{plain}); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(b.String(), "Hits by tier") {
		t.Error("a report without tiers has tier charts")
	}
}
