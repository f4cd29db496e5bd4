package plan

import (
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/report"
)

// WriteHTML writes the sweep as a self-contained HTML page (see
// report.Page): what produced it (r.Provenance), the
// recommendation, the table of WriteTable (the recommended row
// highlighted), and against fleet size, one line per policy: each SLO
// target's fleet-level value with the target as a horizontal line (TTFT p90
// when no target bounds TTFT), goodput with the goodput>= requirement, and
// the hit rate with the pooled-cache reference of each size and the
// infinite-cache ceiling; the recommended point is marked on every chart.
func (r *Result) WriteHTML(w io.Writer) error { return r.HTMLPage().Write(w) }

// HTMLPage lays out the page WriteHTML writes.
func (r *Result) HTMLPage() report.Page {
	t := &report.Table{Head: []string{"engines", "policy", "errors", "hit %", "pooled-cache hit %", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
		"ITL p50 ms", "ITL p99 ms", "E2E p90 ms", "out tok/s", "util %", "goodput %", "good/GPU/s", "P→D ms p90", "meets SLO"}}
	for k, row := range r.Rows {
		t.Rows = append(t.Rows, row.cells(r.MinGoodput))
		if r.Recommendation != nil && k == r.Recommendation.Row {
			t.RowClass = map[int]string{k: "recommended"}
		}
	}
	sizes := make([]float64, len(r.Engines))
	hi := 1.0
	for i, n := range r.Engines {
		sizes[i] = float64(n)
		hi = max(hi, float64(n))
	}
	x := report.Axis{Label: "engines", Ticks: sizes, Format: func(v float64) string { return strconv.Itoa(int(v)) }, Min: 0, Max: hi * 1.04}
	var rec *Row
	if r.Recommendation != nil && r.Recommendation.Row < len(r.Rows) {
		rec = &r.Rows[r.Recommendation.Row]
	}

	var charts []report.Chart
	hasTTFT := false
	var targets []Check
	if len(r.Rows) > 0 {
		targets = r.Rows[0].Checks
	}
	for i, c := range targets {
		hasTTFT = hasTTFT || strings.HasPrefix(c.Target, string(TTFT)+"_")
		series := r.perPolicy(func(row *Row) float64 {
			if i < len(row.Checks) {
				return row.Checks[i].ObservedMs
			}
			return math.NaN()
		})
		series = append(series, report.HLine("SLO "+c.Target+" ≤ "+fmtMs(c.LimitMs), "slo", c.LimitMs, report.SLOColor))
		if rec != nil && i < len(rec.Checks) {
			series = append(series, r.mark(rec, rec.Checks[i].ObservedMs))
		}
		ch := report.LineChart(c.Target+" vs fleet size", x, report.Axis{Label: c.Target + " (log scale)", Log: true, Format: report.FormatMs}, series)
		ch.Key = "slo-" + c.Target
		ch.Note = fmt.Sprintf("Fleet-level %s of each run; red dashed line: the SLO's %s. A run whose percentile reaches into failed requests is infinitely slow and not drawn.", c.Target, fmtMs(c.LimitMs))
		charts = append(charts, ch)
	}
	if !hasTTFT {
		series := r.perPolicy(func(row *Row) float64 { return row.Summary.TTFT.P90 })
		if rec != nil {
			series = append(series, r.mark(rec, rec.Summary.TTFT.P90))
		}
		ch := report.LineChart("TTFT p90 vs fleet size", x, report.Axis{Label: "TTFT p90 (log scale)", Log: true, Format: report.FormatMs}, series)
		ch.Key = "ttft-p90"
		charts = append(charts, ch)
	}

	good := r.perPolicy(func(row *Row) float64 {
		if row.Summary.Goodput == nil {
			return math.NaN()
		}
		return row.Summary.Goodput.Share
	})
	if r.MinGoodput > 0 {
		good = append(good, report.HLine(fmt.Sprintf("SLO goodput ≥ %g%%", r.MinGoodput*100), "slo", r.MinGoodput, report.SLOColor))
	}
	if rec != nil && rec.Summary.Goodput != nil {
		good = append(good, r.mark(rec, rec.Summary.Goodput.Share))
	}
	gc := report.LineChart("Goodput vs fleet size", x, report.Axis{Label: "goodput (share of requests meeting the SLO)", Min: 0, Max: 1.05, Format: report.FormatPercent,
		Ticks: []float64{0, 0.2, 0.4, 0.6, 0.8, 1}}, good)
	gc.Key = "goodput"
	charts = append(charts, gc)

	hit := r.perPolicy(func(row *Row) float64 { return row.Summary.HitRate })
	pooled := report.Series{Name: "pooled cache", Kind: report.SeriesRef, Key: "pooled", Color: report.RefColor}
	for _, n := range r.Engines {
		for k := range r.Rows {
			if row := &r.Rows[k]; row.Engines == n && row.Summary.PooledHitRate != nil {
				pooled.X, pooled.Y = append(pooled.X, float64(n)), append(pooled.Y, *row.Summary.PooledHitRate)
				break
			}
		}
	}
	if len(pooled.X) > 0 {
		hit = append(hit, pooled)
	}
	if v := r.InfiniteHitRate; v != nil {
		hit = append(hit, report.InfiniteCacheLine(*v))
	}
	if rec != nil {
		hit = append(hit, r.mark(rec, rec.Summary.HitRate))
	}
	hc := report.LineChart("Prefix-cache hit rate vs fleet size", x, report.Axis{Label: "hit rate (Σcached / Σprompt)", Format: report.FormatPercent}, hit)
	hc.Key = "hit-rate"
	hc.Note = "Dashed: the pooled cache of each size (one cache with the whole fleet's KV capacity: what a perfect router could approach without replicating prefixes) and the infinite cache (the trace's ceiling)."
	charts = append(charts, hc)

	facts := []report.Fact{}
	if p := r.Provenance; p != nil {
		facts = report.ProvenanceFacts(p)
	}
	facts = append(facts,
		report.Fact{Key: "SLO", Field: "slo", Value: r.SLO, Mono: true},
		report.Fact{Key: "swept", Field: "swept", Value: fmt.Sprintf("%s engines × %s: %d runs of %d requests, %s wall (%d at once)",
			joinInts(r.Engines), strings.Join(r.Policies, ", "), len(r.Rows), r.Requests, fmtMs(r.WallS*1000), r.Workers)},
		report.Fact{Key: "recommendation", Field: "recommendation", Value: strings.TrimPrefix(r.Verdict(), "recommendation: ")})
	var alerts []report.Alert
	if r.Recommendation == nil {
		alerts = append(alerts, report.Alert{Key: "no-fleet", Text: r.Verdict()})
	}
	text := []string{"Latencies are simulated engine time (virtual time: no network, no gateway overhead; see plan/README.md, \"Caveats\"). The highlighted row is the recommendation: the smallest swept fleet meeting the SLO, with the best policy at that size."}
	sub := "SLO " + r.SLO
	if p := r.Provenance; p != nil {
		sub = fmt.Sprintf("infergate %s · started %s · SLO %s", p.Version, p.Start, r.SLO)
	}
	return report.Page{Title: "infergate plan: SLO " + r.SLO, Subtitle: sub, Sections: []report.Section{
		{Title: "Run", Alerts: alerts, Facts: facts},
		{Title: "Fleet sizing sweep", Text: text, Table: t},
		{Title: "TTFT by prompt length", Text: []string{"Requests and TTFT percentiles per prompt-length bucket, per row of the sweep (k = 1,024 tokens)."}, Table: report.BucketTable(r.bucketRuns())},
		{Title: "Against fleet size", Charts: charts},
	}}
}

// bucketRuns labels the rows for the TTFT-by-prompt-length table ("8 ×
// cache-aware") and returns their summaries.
func (r *Result) bucketRuns() ([]string, []measure.Summary) {
	names := make([]string, len(r.Rows))
	sums := make([]measure.Summary, len(r.Rows))
	for k := range r.Rows {
		names[k] = fmt.Sprintf("%d × %s", r.Rows[k].Engines, r.Rows[k].label())
		sums[k] = r.Rows[k].Summary
	}
	return names, sums
}

// perPolicy returns one data series per policy of value against fleet
// size (NaN and +Inf values are not drawn).
func (r *Result) perPolicy(value func(*Row) float64) []report.Series {
	var out []report.Series
	at := map[string]int{}
	for k := range r.Rows {
		row := &r.Rows[k]
		name := row.label()
		j, ok := at[name]
		if !ok {
			j = len(out)
			at[name] = j
			out = append(out, report.Series{Name: name})
		}
		out[j].X, out[j].Y = append(out[j].X, float64(row.Engines)), append(out[j].Y, value(row))
	}
	return out
}

// label is the row's policy with its P/D split, if any.
func (row *Row) label() string {
	if l := row.PD.Label(); l != "" {
		return row.Policy + " " + l
	}
	return row.Policy
}

// mark is the recommended run's point at y.
func (r *Result) mark(rec *Row, y float64) report.Series {
	return report.Series{Name: fmt.Sprintf("recommended: %d × %s", rec.Engines, rec.label()), Kind: report.SeriesMark, Key: "recommended",
		X: []float64{float64(rec.Engines)}, Y: []float64{y}, Color: "#111111"}
}
