package report

import (
	"fmt"
	"math"
	"strconv"
)

// Chart is a line or bar chart laid out in SVG pixel coordinates, rendered
// by the "chart" template of Page.Write. Build one with LineChart or
// BarChart.
type Chart struct {
	Title, XLabel, YLabel string
	// Key is the figure's data-chart attribute ("ttft-cdf", "hit-rate",
	// ...), for scripts and tests reading a report.
	Key            string
	W, H           int
	X0, Y0, X1, Y1 float64 // plot area: left, top, right, bottom
	XTicks, YTicks []Tick
	Lines          []Line
	Bars           []Bar
	Marks          []Marker
	Legend         []LegendItem
	Note           string
}

// Tick is an axis tick at pixel position Pos.
type Tick struct {
	Pos   float64
	Label string
}

// Line is one series as an SVG path ("M x y L x y ...").
type Line struct {
	Name, Color, D string
	// Kind is the path's class: "series" (data), "ref" (a reference curve)
	// or "hline" (a horizontal reference line).
	Kind string
	// Dash is the SVG stroke-dasharray ("" solid) and Width the stroke width.
	Dash  string
	Width float64
	// Key is the path's data-key attribute (Series.Key) and Value, for an
	// hline, its data-value: the line's y in data units.
	Key, Value string
	// Label is drawn at (LabelX, LabelY): an hline's name, at its right end.
	Label          string
	LabelX, LabelY float64
	// Dots mark the points of a data series with few of them (pixels).
	Dots []Point
}

// Point is a pixel position.
type Point struct{ X, Y float64 }

// Marker is a marked point (SeriesMark): a ringed dot, named in the legend
// and its tooltip.
type Marker struct {
	X, Y        float64 // pixels
	Color, Name string
	// Key is its data-key; DataX and DataY its position in data units
	// (data-x, data-y attributes).
	Key, DataX, DataY string
}

// Bar is one rectangle of a bar chart, with its value as Title (a
// tooltip) and, when wide enough, as Label above it.
type Bar struct {
	X, Y, W, H   float64
	Color        string
	Title, Label string
	// Value is the bar's value in data units (its data-value attribute).
	Value float64
}

// LegendItem is one legend entry, at pixel position X, Y: a colour box for
// data, a dashed line for a reference, a ring for a marked point.
type LegendItem struct {
	X, Y        float64
	Color, Name string
	// Kind is "box", "line" or "mark"; Dash the line's dash pattern.
	Kind, Dash string
	// SwatchX and SwatchY place a line's right end or a ring's centre.
	SwatchX, SwatchY float64
}

// SeriesKind says how a chart draws a Series.
type SeriesKind int

// The kinds of Series.
const (
	// SeriesData is a measured series: a solid line (bars in a bar chart)
	// in the next colour of the palette; with few points, each is dotted.
	SeriesData SeriesKind = iota
	// SeriesRef is a reference curve (what an ideal cache would hit over
	// time): dashed, in Series.Color.
	SeriesRef
	// SeriesHLine is a horizontal reference line at Y[0] across the whole
	// plot (an SLO threshold, a hit-rate ceiling), dashed and labelled with
	// its name at its right end.
	SeriesHLine
	// SeriesMark marks its points (X[i], Y[i]) with a ringed dot, named in
	// the legend (the recommended fleet).
	SeriesMark
)

// Series is a named list of (x, y) points in data units.
type Series struct {
	Name string
	X, Y []float64
	// Kind is how the series is drawn (default SeriesData).
	Kind SeriesKind
	// Color overrides the colour (default: the palette for data, dark grey
	// for references and marks).
	Color string
	// Dash overrides a reference's dash pattern (SVG stroke-dasharray).
	Dash string
	// Key is the drawn element's data-key attribute ("pooled", "infinite",
	// "slo", "recommended", ...).
	Key string
}

// HLine is a horizontal reference line at y named name (see SeriesHLine).
func HLine(name, key string, y float64, color string) Series {
	return Series{Name: name, Y: []float64{y}, Kind: SeriesHLine, Key: key, Color: color}
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

var palette = []string{"#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22", "#d62728"}

// Color is the i-th colour of the report's palette. Red comes last: it
// marks SLO thresholds and runs that fell behind.
func Color(i int) string { return palette[i%len(palette)] }

// Colours of reference lines: the pooled cache (and other references),
// the infinite cache, an SLO.
const (
	RefColor      = "#333333"
	InfiniteColor = "#000000"
	SLOColor      = "#c00000"
)

const (
	chartW, chartH                  = 640, 360
	padL, padR, padT, padB, legendH = 70.0, 20.0, 30.0, 50.0, 18.0
	dotsMax                         = 30 // data series with at most this many points get dots
)

func newChart(title string) Chart {
	return Chart{Title: title, W: chartW, H: chartH, X0: padL, Y0: padT + legendH, X1: chartW - padR, Y1: chartH - padB}
}

// legend lays out the legend of series, wrapping rows at the chart's width,
// and moves the plot area's top below it. Data series take palette colours
// in order.
func (c *Chart) legend(series []Series) {
	x, y := c.X0, padT
	for i, s := range series {
		w := 30 + 7*float64(len([]rune(s.Name)))
		if x > c.X0 && x+w > float64(c.W)-padR {
			x, y = c.X0, y+legendH
		}
		it := LegendItem{X: x, Y: y, Name: s.Name, Color: seriesColor(series, i), Kind: "box", SwatchX: x + 14, SwatchY: y + 5}
		switch s.Kind {
		case SeriesRef, SeriesHLine:
			it.Kind, it.Dash = "line", seriesDash(s)
		case SeriesMark:
			it.Kind, it.SwatchX = "mark", x+7
		}
		c.Legend = append(c.Legend, it)
		x += w
	}
	c.Y0 = y + legendH
}

// seriesColor is series[i]'s colour: its own, else the palette colour of
// its rank among the data series, else RefColor.
func seriesColor(series []Series, i int) string {
	if series[i].Color != "" {
		return series[i].Color
	}
	if series[i].Kind != SeriesData {
		return RefColor
	}
	k := 0
	for j := range i {
		if series[j].Kind == SeriesData {
			k++
		}
	}
	return Color(k)
}

func seriesDash(s Series) string {
	switch {
	case s.Dash != "":
		return s.Dash
	case s.Kind == SeriesHLine:
		return "8 4"
	case s.Kind == SeriesRef:
		return "3 3"
	}
	return ""
}

// LineChart lays out series on axes x and y. Data series take the palette's
// colours in order; references, horizontal lines and marks are drawn over
// them, and the y axis spans their values too.
func LineChart(title string, x, y Axis, series []Series) Chart {
	c := newChart(title)
	c.XLabel, c.YLabel = x.Label, y.Label
	c.legend(series)
	xlo, xhi := bounds(x, series, func(s Series) []float64 {
		if s.Kind == SeriesHLine {
			return nil
		}
		return s.X
	})
	ylo, yhi := bounds(y, series, func(s Series) []float64 { return s.Y })
	xs := scale(x.Log, xlo, xhi, c.X0, c.X1)
	ys := scale(y.Log, ylo, yhi, c.Y1, c.Y0)
	c.XTicks = ticks(x, xlo, xhi, xs)
	c.YTicks = ticks(y, ylo, yhi, ys)
	skip := func(xv, yv float64) bool {
		return x.Log && xv <= 0 || y.Log && yv <= 0 || !finite(xv) || !finite(yv)
	}
	for i, s := range series {
		color := seriesColor(series, i)
		switch s.Kind {
		case SeriesHLine:
			if len(s.Y) == 0 || skip(xlo, s.Y[0]) {
				continue
			}
			py := round1(ys(s.Y[0]))
			c.Lines = append(c.Lines, Line{Name: s.Name, Color: color, Kind: "hline", Dash: seriesDash(s), Width: 1.6, Key: s.Key,
				Value: strconv.FormatFloat(s.Y[0], 'g', -1, 64), D: fmt.Sprintf("M%.1f %.1f L%.1f %.1f", c.X0, py, c.X1, py),
				Label: s.Name, LabelX: c.X1 - 4, LabelY: py - 4})
			continue
		case SeriesMark:
			for k := range s.X {
				if k >= len(s.Y) || skip(s.X[k], s.Y[k]) {
					continue
				}
				c.Marks = append(c.Marks, Marker{X: round1(xs(s.X[k])), Y: round1(ys(s.Y[k])), Color: color, Name: s.Name, Key: s.Key,
					DataX: strconv.FormatFloat(s.X[k], 'g', -1, 64), DataY: strconv.FormatFloat(s.Y[k], 'g', -1, 64)})
			}
			continue
		}
		d := make([]byte, 0, 16*len(s.X))
		var dots []Point
		n := 0
		for k := range s.X {
			if k >= len(s.Y) || skip(s.X[k], s.Y[k]) {
				continue
			}
			n++
			if len(d) == 0 {
				d = append(d, 'M')
			} else {
				d = append(d, " L"...)
			}
			px, py := xs(s.X[k]), ys(s.Y[k])
			d = strconv.AppendFloat(d, px, 'f', 1, 64)
			d = append(d, ' ')
			d = strconv.AppendFloat(d, py, 'f', 1, 64)
			dots = append(dots, Point{round1(px), round1(py)})
		}
		if len(d) == 0 {
			continue
		}
		l := Line{Name: s.Name, Color: color, D: string(d), Kind: "series", Width: 1.8, Key: s.Key}
		if s.Kind == SeriesRef {
			l.Kind, l.Dash, l.Width = "ref", seriesDash(s), 1.6
		} else if n <= dotsMax {
			l.Dots = dots
		}
		c.Lines = append(c.Lines, l)
	}
	c.spreadLabels()
	return c
}

// spreadLabels moves the label of an hline that would overlap an earlier
// one's below its line.
func (c *Chart) spreadLabels() {
	for i := range c.Lines {
		if c.Lines[i].Kind != "hline" {
			continue
		}
		for j := range i {
			if c.Lines[j].Kind == "hline" && math.Abs(c.Lines[j].LabelY-c.Lines[i].LabelY) < 13 {
				c.Lines[i].LabelY = c.Lines[j].LabelY + 13
			}
		}
	}
}

func finite(v float64) bool {
	return !math.IsNaN(v) && !math.IsInf(v, 0) && math.Abs(v) < math.MaxFloat64
}

func round1(v float64) float64 { return math.Round(v*10) / 10 }

// bounds returns the axis range: fixed, or the data's (positive data only on
// a log axis, widened to powers of ten).
func bounds(a Axis, series []Series, get func(Series) []float64) (lo, hi float64) {
	if a.Min != a.Max {
		return a.Min, a.Max
	}
	lo, hi = math.Inf(1), math.Inf(-1)
	for _, s := range series {
		for _, v := range get(s) {
			if a.Log && v <= 0 || !finite(v) {
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
		out = append(out, Tick{Pos: round1(pos(v)), Label: f(v)})
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
// bar per series in each group, heights values[s][g] on a y axis from 0
// (or, with y.Log, from the power of ten below the smallest value), each
// labelled with its value when wide enough; series s gets Color(s). refs
// are horizontal reference lines (SeriesHLine) drawn over the bars; the y
// axis spans them too.
func BarChart(title, xlabel string, y Axis, groups, series []string, values [][]float64, refs ...Series) Chart {
	c := newChart(title)
	c.XLabel, c.YLabel = xlabel, y.Label
	all := make([]Series, 0, len(series)+len(refs))
	for _, s := range series {
		all = append(all, Series{Name: s})
	}
	c.legend(append(all, refs...))
	hi, lo := y.Max, math.Inf(1)
	for _, vs := range values {
		for _, v := range vs {
			if finite(v) {
				hi = max(hi, v)
				if v > 0 {
					lo = min(lo, v)
				}
			}
		}
	}
	for _, r := range refs {
		if len(r.Y) > 0 && finite(r.Y[0]) {
			hi = max(hi, r.Y[0])
			if r.Y[0] > 0 {
				lo = min(lo, r.Y[0])
			}
		}
	}
	if hi <= 0 {
		hi = 1
	}
	hi *= 1.08 // room for the bars' labels
	base := 0.0
	var ys func(float64) float64
	if y.Log {
		if math.IsInf(lo, 1) {
			lo = hi
		}
		base, hi = math.Pow(10, math.Floor(math.Log10(lo))), math.Pow(10, math.Ceil(math.Log10(hi)))
		if hi <= base {
			hi = base * 10
		}
		ys = scale(true, base, hi, c.Y1, c.Y0)
		c.YTicks = ticks(Axis{Log: true, Format: y.Format}, base, hi, ys)
	} else {
		ys = scale(false, 0, hi, c.Y1, c.Y0)
		c.YTicks = ticks(Axis{Format: y.Format}, 0, hi, ys)
	}
	py := func(v float64) float64 {
		if !finite(v) || v <= base {
			return c.Y1
		}
		return ys(v)
	}
	if len(groups) > 0 && len(series) > 0 {
		gw := (c.X1 - c.X0) / float64(len(groups))
		bw := min(gw*0.8/float64(len(series)), 90)
		inner := bw * float64(len(series))
		for g, name := range groups {
			gx := c.X0 + float64(g)*gw
			c.XTicks = append(c.XTicks, Tick{Pos: round1(gx + gw/2), Label: name})
			for s := range series {
				v := values[s][g]
				b := Bar{X: gx + (gw-inner)/2 + float64(s)*bw, Y: py(v), W: bw, H: c.Y1 - py(v), Value: v,
					Color: Color(s), Title: fmt.Sprintf("%s, %s: %s", series[s], name, formatBar(y, v))}
				if bw >= 28 {
					b.Label = formatBar(y, v)
				}
				c.Bars = append(c.Bars, b)
			}
		}
	}
	for _, r := range refs {
		if len(r.Y) == 0 || !finite(r.Y[0]) || y.Log && r.Y[0] <= 0 {
			continue
		}
		py := round1(ys(r.Y[0]))
		color := r.Color
		if color == "" {
			color = RefColor
		}
		c.Lines = append(c.Lines, Line{Name: r.Name, Color: color, Kind: "hline", Dash: seriesDash(Series{Kind: SeriesHLine, Dash: r.Dash}), Width: 1.6,
			Key: r.Key, Value: strconv.FormatFloat(r.Y[0], 'g', -1, 64), D: fmt.Sprintf("M%.1f %.1f L%.1f %.1f", c.X0, py, c.X1, py),
			Label: r.Name, LabelX: c.X1 - 4, LabelY: py - 4})
	}
	c.spreadLabels()
	return c
}

// formatBar formats a bar's value: with the axis's format, to 3
// significant digits.
func formatBar(a Axis, v float64) string {
	if !finite(v) {
		return "inf"
	}
	v, _ = strconv.ParseFloat(strconv.FormatFloat(v, 'g', 3, 64), 64)
	return formatY(a, v)
}

func formatY(a Axis, v float64) string {
	if a.Format != nil {
		return a.Format(v)
	}
	return strconv.FormatFloat(v, 'g', 4, 64)
}
