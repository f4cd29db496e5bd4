package bench

import (
	"bytes"
	"fmt"
	"html/template"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// HTMLRun is one run of an HTML report: its Summary, its per-request Records
// and, when known, which engine served each request.
type HTMLRun struct {
	Summary Summary
	Records []Record
	// Engine is the index of the engine each record was routed to (-1:
	// none), parallel to Records; nil when unknown (a gateway does not say).
	Engine []int
	// EnginePromptTokens, used when Engine is nil, is the prompt tokens each
	// engine counted itself (sim.Stats.PromptTokens), in engine order; nil
	// when unknown.
	EnginePromptTokens []int64
}

// Report size bounds: points per CDF line, arrival windows per time series,
// samples of the in-flight series.
const (
	cdfPoints      = 500
	timeWindows    = 50
	inFlightPoints = 200
)

// Chart is a line or bar chart laid out in SVG pixel coordinates, rendered
// by the "chart" template of WriteHTMLPage. Build one with LineChart or
// BarChart.
type Chart struct {
	Title, XLabel, YLabel string
	W, H                  int
	X0, Y0, X1, Y1        float64 // plot area: left, top, right, bottom
	XTicks, YTicks        []Tick
	Lines                 []Line
	Bars                  []Bar
	Legend                []LegendItem
	Note                  string
}

// Tick is an axis tick at pixel position Pos.
type Tick struct {
	Pos   float64
	Label string
}

// Line is one series as an SVG path ("M x y L x y ...").
type Line struct {
	Name, Color, D string
}

// Bar is one rectangle of a bar chart.
type Bar struct {
	X, Y, W, H float64
	Color      string
	Title      string
}

// LegendItem is one legend entry, at pixel position X, Y.
type LegendItem struct {
	X, Y        float64
	Color, Name string
}

// Series is a named list of (x, y) points in data units.
type Series struct {
	Name string
	X, Y []float64
}

// Axis describes one axis of a LineChart: its label, whether it is
// logarithmic, and optional fixed bounds (Min == Max: from the data).
type Axis struct {
	Label    string
	Log      bool
	Min, Max float64
	// Format formats a tick value (default: %g).
	Format func(float64) string
	// Ticks, if set, are the tick values to use.
	Ticks []float64
}

var palette = []string{"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"}

// Color is the i-th colour of the report's palette.
func Color(i int) string { return palette[i%len(palette)] }

const (
	chartW, chartH                  = 640, 360
	padL, padR, padT, padB, legendH = 70.0, 20.0, 30.0, 50.0, 20.0
)

func newChart(title string) Chart {
	return Chart{Title: title, W: chartW, H: chartH, X0: padL, Y0: padT + legendH, X1: chartW - padR, Y1: chartH - padB}
}

func (c *Chart) legend(names []string) {
	x := c.X0
	for i, n := range names {
		c.Legend = append(c.Legend, LegendItem{X: x, Y: padT, Color: Color(i), Name: n})
		x += 24 + 7*float64(len(n))
	}
}

// LineChart lays out series on axes x and y; series i gets Color(i).
func LineChart(title string, x, y Axis, series []Series) Chart {
	c := newChart(title)
	c.XLabel, c.YLabel = x.Label, y.Label
	names := make([]string, len(series))
	for i, s := range series {
		names[i] = s.Name
	}
	c.legend(names)
	xlo, xhi := bounds(x, series, func(s Series) []float64 { return s.X })
	ylo, yhi := bounds(y, series, func(s Series) []float64 { return s.Y })
	xs := scale(x.Log, xlo, xhi, c.X0, c.X1)
	ys := scale(y.Log, ylo, yhi, c.Y1, c.Y0)
	c.XTicks = ticks(x, xlo, xhi, xs)
	c.YTicks = ticks(y, ylo, yhi, ys)
	for i, s := range series {
		d := make([]byte, 0, 16*len(s.X))
		for k := range s.X {
			if x.Log && s.X[k] <= 0 || y.Log && s.Y[k] <= 0 || math.IsNaN(s.X[k]) || math.IsNaN(s.Y[k]) {
				continue
			}
			if len(d) == 0 {
				d = append(d, 'M')
			} else {
				d = append(d, " L"...)
			}
			d = strconv.AppendFloat(d, xs(s.X[k]), 'f', 1, 64)
			d = append(d, ' ')
			d = strconv.AppendFloat(d, ys(s.Y[k]), 'f', 1, 64)
		}
		if len(d) > 0 {
			c.Lines = append(c.Lines, Line{Name: s.Name, Color: Color(i), D: string(d)})
		}
	}
	return c
}

// bounds returns the axis range: fixed, or the data's (positive data only on
// a log axis, widened to powers of ten).
func bounds(a Axis, series []Series, get func(Series) []float64) (lo, hi float64) {
	if a.Min != a.Max {
		return a.Min, a.Max
	}
	lo, hi = math.Inf(1), math.Inf(-1)
	for _, s := range series {
		for _, v := range get(s) {
			if a.Log && v <= 0 || math.IsNaN(v) {
				continue
			}
			lo, hi = min(lo, v), max(hi, v)
		}
	}
	if math.IsInf(lo, 1) {
		lo, hi = 1, 10
	}
	if a.Log {
		lo, hi = math.Pow(10, math.Floor(math.Log10(lo))), math.Pow(10, math.Ceil(math.Log10(hi)))
		if hi <= lo {
			hi = lo * 10
		}
		return lo, hi
	}
	if a.Min == 0 && a.Max == 0 && lo > 0 {
		lo = 0
	}
	if hi <= lo {
		hi = lo + 1
	}
	return lo, hi
}

func scale(log bool, lo, hi, p0, p1 float64) func(float64) float64 {
	if log {
		llo, lhi := math.Log10(lo), math.Log10(hi)
		return func(v float64) float64 { return p0 + (math.Log10(v)-llo)/(lhi-llo)*(p1-p0) }
	}
	return func(v float64) float64 { return p0 + (v-lo)/(hi-lo)*(p1-p0) }
}

func ticks(a Axis, lo, hi float64, pos func(float64) float64) []Tick {
	f := a.Format
	if f == nil {
		f = func(v float64) string { return strconv.FormatFloat(v, 'g', 4, 64) }
	}
	vals := a.Ticks
	if vals == nil {
		if a.Log {
			for v := lo; v <= hi*1.0001; v *= 10 {
				vals = append(vals, v)
			}
		} else {
			step := niceStep((hi - lo) / 5)
			for v := math.Ceil(lo/step) * step; v <= hi+step*1e-9; v += step {
				vals = append(vals, v)
			}
		}
	}
	out := make([]Tick, 0, len(vals))
	for _, v := range vals {
		if v < lo-1e-9*math.Abs(lo) || v > hi+1e-9*math.Abs(hi) {
			continue
		}
		out = append(out, Tick{Pos: math.Round(pos(v)*10) / 10, Label: f(v)})
	}
	return out
}

func niceStep(raw float64) float64 {
	if raw <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if raw <= m*p {
			return m * p
		}
	}
	return 10 * p
}

// FormatMs formats a duration in ms for an axis: "10 ms", "1 s", "2 min".
func FormatMs(v float64) string {
	switch {
	case v >= 60000 && math.Mod(v, 60000) == 0:
		return strconv.FormatFloat(v/60000, 'g', 4, 64) + " min"
	case v >= 1000:
		return strconv.FormatFloat(v/1000, 'g', 4, 64) + " s"
	}
	return strconv.FormatFloat(v, 'g', 4, 64) + " ms"
}

// FormatPercent formats a fraction as a percentage for an axis.
func FormatPercent(v float64) string { return strconv.FormatFloat(v*100, 'g', 4, 64) + "%" }

// BarChart lays out grouped bars: groups along x (labelled groups[g]), one
// bar per series in each group, heights values[s][g] on a linear y axis from
// 0; series s gets Color(s).
func BarChart(title, xlabel string, y Axis, groups, series []string, values [][]float64) Chart {
	c := newChart(title)
	c.XLabel, c.YLabel = xlabel, y.Label
	c.legend(series)
	hi := y.Max
	for _, vs := range values {
		for _, v := range vs {
			hi = max(hi, v)
		}
	}
	if hi <= 0 {
		hi = 1
	}
	ys := scale(false, 0, hi, c.Y1, c.Y0)
	c.YTicks = ticks(Axis{Format: y.Format}, 0, hi, ys)
	if len(groups) == 0 || len(series) == 0 {
		return c
	}
	gw := (c.X1 - c.X0) / float64(len(groups))
	bw := gw * 0.8 / float64(len(series))
	for g, name := range groups {
		gx := c.X0 + float64(g)*gw
		c.XTicks = append(c.XTicks, Tick{Pos: math.Round((gx+gw/2)*10) / 10, Label: name})
		for s := range series {
			v := values[s][g]
			c.Bars = append(c.Bars, Bar{X: gx + gw*0.1 + float64(s)*bw, Y: ys(v), W: bw, H: c.Y1 - ys(v),
				Color: Color(s), Title: fmt.Sprintf("%s, %s: %s", series[s], name, formatY(y, v))})
		}
	}
	return c
}

func formatY(a Axis, v float64) string {
	if a.Format != nil {
		return a.Format(v)
	}
	return strconv.FormatFloat(v, 'g', 4, 64)
}

// CDF returns up to cdfPoints points (value, fraction ≤ value) of xs's
// empirical CDF; it sorts xs in place.
func CDF(xs []float64) (x, y []float64) {
	n := len(xs)
	if n == 0 {
		return nil, nil
	}
	slices.Sort(xs)
	m := min(n, cdfPoints)
	for k := range m {
		i := k * (n - 1) / max(m-1, 1)
		x = append(x, xs[i])
		y = append(y, float64(i+1)/float64(n))
	}
	return x, y
}

// Table is an HTML table: a header row and body rows of cells.
type Table struct {
	Head []string
	Rows [][]string
}

// Section is one titled part of a page: an optional paragraph, a table and
// charts.
type Section struct {
	Title  string
	Text   []string
	Table  *Table
	Charts []Chart
}

// WriteHTMLPage writes a self-contained HTML page (inline CSS and SVG, no
// scripts, no external resources) with the sections in order; html/template
// escapes every string.
func WriteHTMLPage(w io.Writer, title string, sections []Section) error {
	return pageTmpl.Execute(w, struct {
		Title     string
		Generated string
		Sections  []Section
	}{title, time.Now().UTC().Format(time.RFC3339), sections})
}

// SummaryTable is r's text table (WriteTable) as a Table.
func SummaryTable(runs []Summary) *Table {
	t := &Table{Head: []string{"policy", "requests", "errors", "hit %", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
		"ITL p50 ms", "ITL p99 ms", "out tok/s", "prefill tok", "util %", "lag p99 ms"}}
	for _, s := range runs {
		util := "-"
		if s.MeanEngineUtilization != nil {
			util = fmt.Sprintf("%.1f", *s.MeanEngineUtilization*100)
		}
		t.Rows = append(t.Rows, []string{s.Policy, strconv.Itoa(s.Requests), strconv.Itoa(s.Errors),
			fmt.Sprintf("%.1f", s.HitRate*100), fmt.Sprintf("%.0f", s.TTFT.P50), fmt.Sprintf("%.0f", s.TTFT.P90),
			fmt.Sprintf("%.0f", s.TTFT.P99), fmt.Sprintf("%.1f", s.ITL.P50), fmt.Sprintf("%.1f", s.ITL.P99),
			fmt.Sprintf("%.0f", s.OutputTokPerS), strconv.FormatInt(s.PrefillTokensComputed, 10), util, s.lagCell()})
	}
	return t
}

// WriteHTML writes a benchmark report for runs: the summary table, TTFT and
// ITL CDFs, hit rate, TTFT p50 and requests in flight over time, and the
// share of requests (or prompt tokens) each engine served.
func WriteHTML(w io.Writer, title string, runs []HTMLRun) error {
	sums := make([]Summary, len(runs))
	for i, r := range runs {
		sums[i] = r.Summary
	}
	msAxis := Axis{Log: true, Format: FormatMs}
	frac := Axis{Label: "fraction of requests ≤ x", Min: 0, Max: 1, Format: FormatPercent}
	var ttft, itl, hit, ttftT, inflight []Series
	for _, r := range runs {
		name := r.Summary.Policy
		var tv, iv []float64
		for i := range r.Records {
			if rec := &r.Records[i]; rec.Error == "" {
				tv = append(tv, rec.TTFTMs)
				iv = append(iv, rec.ITLMs...)
			}
		}
		x, y := CDF(tv)
		ttft = append(ttft, Series{name, x, y})
		x, y = CDF(iv)
		itl = append(itl, Series{name, x, y})
		h, t := windows(r.Records)
		hit = append(hit, h)
		ttftT = append(ttftT, t)
		inflight = append(inflight, inFlight(r.Records))
	}
	for i := range hit {
		hit[i].Name, ttftT[i].Name, inflight[i].Name = sums[i].Policy, sums[i].Policy, sums[i].Policy
	}
	frac.Label = "fraction of requests ≤ x"
	itlFrac := frac
	itlFrac.Label = "fraction of gaps ≤ x"
	secs := Axis{Label: "arrival time (s, engine time)"}
	charts := []Chart{
		LineChart("TTFT CDF", Axis{Label: "TTFT (log scale)", Log: true, Format: FormatMs}, frac, ttft),
		LineChart("ITL CDF", Axis{Label: "inter-token latency (log scale)", Log: msAxis.Log, Format: FormatMs}, itlFrac, itl),
		LineChart(fmt.Sprintf("Prefix-cache hit rate over time (%d arrival windows)", timeWindows), secs,
			Axis{Label: "hit rate (Σcached / Σprompt)", Min: 0, Max: 1, Format: FormatPercent}, hit),
		LineChart(fmt.Sprintf("TTFT p50 over time (%d arrival windows)", timeWindows), secs,
			Axis{Label: "TTFT p50 (log scale)", Log: true, Format: FormatMs}, ttftT),
		LineChart("Requests in flight over time", Axis{Label: "time (s, engine time)"},
			Axis{Label: "in flight (requests)"}, inflight),
	}
	charts = append(charts, endpointChart(runs))
	text := []string{"Latencies are engine time (see bench/README.md). Failed requests are left out of the latency and hit-rate charts.",
		"Lag p99: how far a real-time run fell behind its time scale (the larger of the fleet's step lag and the client's send lag, engine time); BEHIND past the run's margin, when its latencies measure the host, not the modelled hardware.",
		"In flight: requests sent and not yet finished (from arrival and end-to-end latency), a proxy for queue depth."}
	var warnings bytes.Buffer
	_, _ = Report{Runs: sums}.WriteLagWarnings(&warnings)
	for line := range strings.Lines(warnings.String()) {
		text = append(text, strings.TrimSpace(line))
	}
	return WriteHTMLPage(w, title, []Section{{Title: "Summary", Text: text, Table: SummaryTable(sums), Charts: charts}})
}

// windows buckets successful records by arrival into timeWindows windows and
// returns per window the hit rate (Σcached/Σprompt) and TTFT p50, at the
// window's midpoint (s).
func windows(recs []Record) (hit, ttft Series) {
	var span float64
	for i := range recs {
		span = max(span, recs[i].ArrivalMs)
	}
	if len(recs) == 0 {
		return
	}
	width := max(span, 1) / timeWindows
	type win struct {
		cached, prompt int64
		ttft           []float64
	}
	ws := make([]win, timeWindows)
	for i := range recs {
		r := &recs[i]
		if r.Error != "" {
			continue
		}
		k := min(int(r.ArrivalMs/width), timeWindows-1)
		ws[k].cached += int64(r.CachedTokens)
		ws[k].prompt += int64(r.PromptTokens)
		ws[k].ttft = append(ws[k].ttft, r.TTFTMs)
	}
	for k, w := range ws {
		mid := (float64(k) + 0.5) * width / 1000
		if w.prompt > 0 {
			hit.X, hit.Y = append(hit.X, mid), append(hit.Y, float64(w.cached)/float64(w.prompt))
		}
		if len(w.ttft) > 0 {
			slices.Sort(w.ttft)
			ttft.X, ttft.Y = append(ttft.X, mid), append(ttft.Y, Percentile(w.ttft, 50))
		}
	}
	return hit, ttft
}

// inFlight samples the number of requests in [arrival, arrival+e2e) at
// inFlightPoints evenly spaced times (s).
func inFlight(recs []Record) Series {
	var s Series
	var end float64
	for i := range recs {
		end = max(end, recs[i].ArrivalMs+recs[i].E2EMs)
	}
	if len(recs) == 0 || end <= 0 {
		return s
	}
	step := end / (inFlightPoints - 1)
	diff := make([]int, inFlightPoints+1)
	for i := range recs {
		a, b := recs[i].ArrivalMs, recs[i].ArrivalMs+recs[i].E2EMs
		// Samples k with a <= k·step < b.
		lo := int(math.Ceil(a / step))
		hi := int(math.Ceil(b/step)) - 1
		lo, hi = max(lo, 0), min(hi, inFlightPoints-1)
		if lo <= hi {
			diff[lo]++
			diff[hi+1]--
		}
	}
	n := 0
	for k := range inFlightPoints {
		n += diff[k]
		s.X, s.Y = append(s.X, float64(k)*step/1000), append(s.Y, float64(n))
	}
	return s
}

// endpointChart is the per-engine share of requests (Engine known for every
// run) or of prompt tokens (engine counters), else a note.
func endpointChart(runs []HTMLRun) Chart {
	byReq, byTok := len(runs) > 0, len(runs) > 0
	n := 0
	for _, r := range runs {
		byReq = byReq && r.Engine != nil
		byTok = byTok && r.EnginePromptTokens != nil
		for _, e := range r.Engine {
			n = max(n, e+1)
		}
		n = max(n, len(r.EnginePromptTokens))
	}
	names := make([]string, len(runs))
	for i, r := range runs {
		names[i] = r.Summary.Policy
	}
	groups := make([]string, n)
	for e := range groups {
		groups[e] = strconv.Itoa(e)
	}
	values := make([][]float64, len(runs))
	pct := Axis{Format: FormatPercent}
	switch {
	case byReq:
		for i, r := range runs {
			values[i] = make([]float64, n)
			for _, e := range r.Engine {
				if e >= 0 && len(r.Engine) > 0 {
					values[i][e] += 1 / float64(len(r.Engine))
				}
			}
		}
		pct.Label = "share of requests"
		return BarChart("Per-endpoint request share", "engine", pct, groups, names, values)
	case byTok:
		for i, r := range runs {
			values[i] = make([]float64, n)
			var sum int64
			for _, t := range r.EnginePromptTokens {
				sum += t
			}
			for e, t := range r.EnginePromptTokens {
				if sum > 0 {
					values[i][e] = float64(t) / float64(sum)
				}
			}
		}
		pct.Label = "share of prompt tokens"
		c := BarChart("Per-endpoint share of prompt tokens (engines' own counters)", "engine", pct, groups, names, values)
		c.Note = "The gateway does not report which engine served a request; these are the prompt tokens each simulated engine counted."
		return c
	}
	c := BarChart("Per-endpoint request share: unknown", "engine", pct, nil, nil, nil)
	c.Note = "Not known for this run: the endpoint does not report which engine served each request."
	return c
}

var pageTmpl = template.Must(template.New("page").Parse(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{{.Title}}</title>
<style>
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;margin:12px 0;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}
.charts{display:flex;flex-wrap:wrap;gap:16px}
figure{margin:0;border:1px solid #ddd;padding:4px}
figcaption{font-size:12px;color:#555;max-width:640px}
svg text{font-size:12px;fill:#222}
svg .grid{stroke:#e5e5e5}
svg .axis{stroke:#444}
.note{font-size:13px;color:#555}
</style></head><body>
<h1>{{.Title}}</h1>
<p class="note">Generated {{.Generated}} by infergate. Self-contained: no scripts, no external resources.</p>
{{range .Sections}}<section>
<h2>{{.Title}}</h2>
{{range .Text}}<p class="note">{{.}}</p>
{{end}}{{with .Table}}<table><thead><tr>{{range .Head}}<th>{{.}}</th>{{end}}</tr></thead><tbody>
{{range .Rows}}<tr>{{range .}}<td>{{.}}</td>{{end}}</tr>
{{end}}</tbody></table>
{{end}}<div class="charts">
{{range .Charts}}{{template "chart" .}}{{end}}</div>
</section>
{{end}}</body></html>
{{define "chart"}}<figure><svg width="{{.W}}" height="{{.H}}" viewBox="0 0 {{.W}} {{.H}}" role="img" aria-label="{{.Title}}">
<text x="{{.X0}}" y="18" style="font-weight:bold;font-size:14px">{{.Title}}</text>
{{$c := .}}{{range .YTicks}}<line class="grid" x1="{{$c.X0}}" x2="{{$c.X1}}" y1="{{.Pos}}" y2="{{.Pos}}"/><text x="{{$c.X0}}" dx="-4" y="{{.Pos}}" dy="4" text-anchor="end">{{.Label}}</text>
{{end}}{{range .XTicks}}<line class="grid" x1="{{.Pos}}" x2="{{.Pos}}" y1="{{$c.Y0}}" y2="{{$c.Y1}}"/><text x="{{.Pos}}" y="{{$c.Y1}}" dy="16" text-anchor="middle">{{.Label}}</text>
{{end}}<line class="axis" x1="{{.X0}}" x2="{{.X1}}" y1="{{.Y1}}" y2="{{.Y1}}"/><line class="axis" x1="{{.X0}}" x2="{{.X0}}" y1="{{.Y0}}" y2="{{.Y1}}"/>
<text x="{{.X1}}" y="{{.H}}" dy="-8" text-anchor="end">{{.XLabel}}</text>
<text transform="rotate(-90)" x="-{{.Y0}}" y="14" text-anchor="end">{{.YLabel}}</text>
{{range .Bars}}<rect x="{{printf "%.1f" .X}}" y="{{printf "%.1f" .Y}}" width="{{printf "%.1f" .W}}" height="{{printf "%.1f" .H}}" fill="{{.Color}}"><title>{{.Title}}</title></rect>
{{end}}{{range .Lines}}<path d="{{.D}}" fill="none" stroke="{{.Color}}" stroke-width="1.8"><title>{{.Name}}</title></path>
{{end}}{{range .Legend}}<rect x="{{.X}}" y="{{.Y}}" width="14" height="10" fill="{{.Color}}"/><text x="{{.X}}" dx="18" y="{{.Y}}" dy="10">{{.Name}}</text>
{{end}}</svg>{{with .Note}}<figcaption>{{.}}</figcaption>{{end}}</figure>
{{end}}`))
