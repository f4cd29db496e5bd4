package plan

import (
	"fmt"
	"io"
	"strconv"

	"github.com/infergate/infergate/bench"
)

// WriteHTML writes the sweep as a self-contained HTML page (see
// bench.WriteHTMLPage): the recommendation, the table of WriteTable, and
// TTFT p90 and goodput against fleet size, one line per policy.
func (r *Result) WriteHTML(w io.Writer) error {
	t := &bench.Table{Head: []string{"engines", "policy", "errors", "hit %", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
		"ITL p50 ms", "ITL p99 ms", "E2E p90 ms", "out tok/s", "util %", "goodput %", "meets SLO"}}
	ttft := make([]bench.Series, len(r.Policies))
	good := make([]bench.Series, len(r.Policies))
	for j, p := range r.Policies {
		ttft[j].Name, good[j].Name = p, p
	}
	for k, row := range r.Rows {
		t.Rows = append(t.Rows, row.cells(r.MinGoodput))
		s := row.Summary
		if len(r.Policies) == 0 {
			continue
		}
		j := k % len(r.Policies)
		ttft[j].X, ttft[j].Y = append(ttft[j].X, float64(row.Engines)), append(ttft[j].Y, s.TTFT.P90)
		if s.Goodput != nil {
			good[j].X, good[j].Y = append(good[j].X, float64(row.Engines)), append(good[j].Y, s.Goodput.Share)
		}
	}
	sizes := make([]float64, len(r.Engines))
	for i, n := range r.Engines {
		sizes[i] = float64(n)
	}
	x := bench.Axis{Label: "engines", Ticks: sizes, Format: func(v float64) string { return strconv.Itoa(int(v)) }}
	lo, hi := 0.0, 1.0
	for _, n := range sizes {
		hi = max(hi, n)
	}
	x.Min, x.Max = lo, hi
	charts := []bench.Chart{
		bench.LineChart("TTFT p90 vs fleet size", x, bench.Axis{Label: "TTFT p90 (log scale)", Log: true, Format: bench.FormatMs}, ttft),
		bench.LineChart("Goodput vs fleet size", x, bench.Axis{Label: "goodput (share of requests meeting the SLO)", Min: 0, Max: 1, Format: bench.FormatPercent}, good),
	}
	text := []string{r.Verdict(),
		fmt.Sprintf("SLO %s; %d requests per run; latencies are simulated engine time.", r.SLO, r.Requests)}
	return bench.WriteHTMLPage(w, "infergate plan: SLO "+r.SLO, []bench.Section{{Title: "Fleet sizing sweep", Text: text, Table: t, Charts: charts}})
}
