// Package report lays out measurements (package measure) for people: the
// JSON report and text table of a benchmark's runs (Report), lag warnings,
// the self-contained HTML page of a benchmark (HTMLReport) and the kit
// every HTML report is built from: pages of sections with facts, tables and
// alerts (Page) and SVG line and bar charts (LineChart, BarChart). It
// imports measure and nothing that serves or sends HTTP; `infergate bench`
// and package plan write their reports with it.
package report

import (
	"html/template"
	"io"
	"strconv"
	"strings"
	"time"
)

// Table is an HTML table: a header row and body rows of cells.
type Table struct {
	Head []string
	Rows [][]string
	// RowClass gives rows a class by index ("recommended"); a cell
	// containing "BEHIND" or starting with "no (" is marked bad, "yes" good.
	RowClass map[int]string
}

// Fact is one line of a section's key-value table: what produced a report.
type Fact struct {
	// Key is the label and Field the row's data-field attribute ("command",
	// "version", "trace", ...), for scripts and tests reading a report.
	Key, Field string
	Value      string
	// Mono shows Value in a monospace font (command lines, digests, paths).
	Mono bool
}

// Alert is a warning shown in a red box at the top of its section: a run
// that fell behind its time scale, failed requests.
type Alert struct {
	// Key is the box's data-alert attribute ("behind", "errors").
	Key, Text string
}

// Section is one titled part of a page: alerts, a key-value table, notes,
// a table and charts, in that order.
type Section struct {
	Title  string
	Alerts []Alert
	Facts  []Fact
	Text   []string
	Table  *Table
	Charts []Chart
}

// Page is a self-contained HTML page of sections.
type Page struct {
	// Title is the page's title and heading; Subtitle, if set, the line
	// under it.
	Title, Subtitle string
	Sections        []Section
}

// Write writes p as a self-contained HTML page (inline CSS and SVG, no
// scripts, no external resources) with its sections in order;
// html/template escapes every string.
func (p Page) Write(w io.Writer) error {
	return pageTmpl.Execute(w, struct {
		Page
		Generated string
	}{p, time.Now().UTC().Format(time.RFC3339)})
}

var pageTmpl = template.Must(template.New("page").Funcs(template.FuncMap{
	"barmid": func(b Bar) float64 { return b.X + b.W/2 },
	"cellclass": func(s string) string {
		c := "txt"
		if _, err := strconv.ParseFloat(strings.ReplaceAll(strings.TrimSuffix(s, " BEHIND"), "/", ""), 64); err == nil || s == "-" {
			c = "num"
		}
		switch {
		case strings.Contains(s, "BEHIND") || strings.HasPrefix(s, "no ("):
			return c + " bad"
		case s == "yes":
			return c + " good"
		}
		return c
	},
}).Parse(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{{.Title}}</title>
<style>
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px 32px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 8px;padding-bottom:4px;border-bottom:1px solid #ddd}
.sub{color:#555;font-size:13px;margin:0 0 12px}
table{border-collapse:collapse;margin:10px 0;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f0f0f0;vertical-align:bottom}td.txt{text-align:left}td:first-child,th:first-child{text-align:left}
tr.recommended td{background:#eaf6ea;font-weight:600}
td.bad{color:#a00000;font-weight:600}td.num,table:not(.facts) td:nth-child(-n+2){white-space:nowrap}td.good{color:#176417}
table.facts{table-layout:fixed;width:100%;max-width:1200px}
table.facts th{width:120px;text-align:left;background:#f6f6f6;font-weight:600;vertical-align:top}
table.facts td{text-align:left;overflow-wrap:anywhere}
code{font-family:ui-monospace,"SFMono-Regular",Menlo,Consolas,monospace;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere}
.alert{border:2px solid #c00000;background:#fff0f0;color:#7a0000;padding:8px 12px;margin:8px 0;font-weight:600;max-width:1200px}
.charts{display:flex;flex-wrap:wrap;gap:16px}
figure{margin:0;border:1px solid #ddd;padding:4px}
figcaption{font-size:12px;color:#555;max-width:640px}
svg text{font-size:12px;fill:#222}
svg .grid{stroke:#e5e5e5}
svg .axis{stroke:#444}
svg text.reflabel{font-size:11px;font-weight:600}
svg text.barlabel{font-size:10px;fill:#333}
.note{font-size:13px;color:#555;max-width:1200px}
</style></head><body>
<h1>{{.Title}}</h1>
{{with .Subtitle}}<p class="sub">{{.}}</p>
{{end}}<p class="note">Generated {{.Generated}} by infergate. Self-contained: no scripts, no external resources.</p>
{{range .Sections}}<section>
<h2>{{.Title}}</h2>
{{range .Alerts}}<div class="alert" role="alert" data-alert="{{.Key}}">{{.Text}}</div>
{{end}}{{with .Facts}}<table class="facts"><tbody>
{{range .}}<tr data-field="{{.Field}}"><th>{{.Key}}</th><td>{{if .Mono}}<code>{{.Value}}</code>{{else}}{{.Value}}{{end}}</td></tr>
{{end}}</tbody></table>
{{end}}{{range .Text}}<p class="note">{{.}}</p>
{{end}}{{with .Table}}{{$t := .}}<table><thead><tr>{{range .Head}}<th>{{.}}</th>{{end}}</tr></thead><tbody>
{{range $i, $r := .Rows}}<tr{{with index $t.RowClass $i}} class="{{.}}"{{end}}>{{range $r}}<td{{with cellclass .}} class="{{.}}"{{end}}>{{.}}</td>{{end}}</tr>
{{end}}</tbody></table>
{{end}}{{with .Charts}}<div class="charts">
{{range .}}{{template "chart" .}}{{end}}</div>
{{end}}</section>
{{end}}</body></html>
{{define "chart"}}<figure{{with .Key}} data-chart="{{.}}"{{end}}><svg width="{{.W}}" height="{{.H}}" viewBox="0 0 {{.W}} {{.H}}" role="img" aria-label="{{.Title}}">
<text x="{{.X0}}" y="18" style="font-weight:bold;font-size:14px">{{.Title}}</text>
{{$c := .}}{{range .YTicks}}<line class="grid" x1="{{$c.X0}}" x2="{{$c.X1}}" y1="{{.Pos}}" y2="{{.Pos}}"/><text x="{{$c.X0}}" dx="-4" y="{{.Pos}}" dy="4" text-anchor="end">{{.Label}}</text>
{{end}}{{range .XTicks}}<line class="grid" x1="{{.Pos}}" x2="{{.Pos}}" y1="{{$c.Y0}}" y2="{{$c.Y1}}"/><text x="{{.Pos}}" y="{{$c.Y1}}" dy="16" text-anchor="middle">{{.Label}}</text>
{{end}}<line class="axis" x1="{{.X0}}" x2="{{.X1}}" y1="{{.Y1}}" y2="{{.Y1}}"/><line class="axis" x1="{{.X0}}" x2="{{.X0}}" y1="{{.Y0}}" y2="{{.Y1}}"/>
<text x="{{.X1}}" y="{{.H}}" dy="-8" text-anchor="end">{{.XLabel}}</text>
<text transform="rotate(-90)" x="-{{.Y0}}" y="14" text-anchor="end">{{.YLabel}}</text>
{{range .Bars}}{{$b := .}}<rect x="{{printf "%.1f" .X}}" y="{{printf "%.1f" .Y}}" width="{{printf "%.1f" .W}}" height="{{printf "%.1f" .H}}" fill="{{.Color}}" data-value="{{.Value}}"><title>{{.Title}}</title></rect>{{with .Label}}<text class="barlabel" x="{{printf "%.1f" (barmid $b)}}" y="{{printf "%.1f" $b.Y}}" dy="-3" text-anchor="middle">{{.}}</text>{{end}}
{{end}}{{range .Lines}}<path d="{{.D}}" class="{{.Kind}}" fill="none" stroke="{{.Color}}" stroke-width="{{.Width}}"{{with .Dash}} stroke-dasharray="{{.}}"{{end}}{{with .Key}} data-key="{{.}}"{{end}}{{with .Value}} data-value="{{.}}"{{end}}><title>{{.Name}}</title></path>
{{$l := .}}{{range .Dots}}<circle cx="{{.X}}" cy="{{.Y}}" r="2.5" fill="{{$l.Color}}"/>{{end}}{{with .Label}}<text class="reflabel" x="{{$l.LabelX}}" y="{{$l.LabelY}}" text-anchor="end" style="fill:{{$l.Color}}">{{.}}</text>
{{end}}{{end}}{{range .Marks}}<g class="mark"{{with .Key}} data-key="{{.}}"{{end}} data-x="{{.DataX}}" data-y="{{.DataY}}"><circle cx="{{.X}}" cy="{{.Y}}" r="7" fill="none" stroke="{{.Color}}" stroke-width="2.5"/><circle cx="{{.X}}" cy="{{.Y}}" r="2.5" fill="{{.Color}}"/><title>{{.Name}}</title></g>
{{end}}{{range .Legend}}{{if eq .Kind "line"}}<line x1="{{.X}}" x2="{{.SwatchX}}" y1="{{.SwatchY}}" y2="{{.SwatchY}}" stroke="{{.Color}}" stroke-width="2" stroke-dasharray="{{.Dash}}"/>{{else if eq .Kind "mark"}}<circle cx="{{.SwatchX}}" cy="{{.SwatchY}}" r="5" fill="none" stroke="{{.Color}}" stroke-width="2"/>{{else}}<rect x="{{.X}}" y="{{.Y}}" width="14" height="10" fill="{{.Color}}"/>{{end}}<text x="{{.X}}" dx="18" y="{{.Y}}" dy="10">{{.Name}}</text>
{{end}}</svg>{{with .Note}}<figcaption>{{.}}</figcaption>{{end}}</figure>
{{end}}`))
