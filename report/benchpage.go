package report

import (
	"bytes"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/infergate/infergate/measure"
)

// HTMLRun is one run of an HTML report: its Summary, its per-request Records
// and, when known, which engine served each request.
type HTMLRun struct {
	Summary measure.Summary
	Records []measure.Record
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

// SummaryTable is r's text table (WriteTable) as a Table, with the runs'
// reference hit rates (pooled and infinite cache) beside their own.
func SummaryTable(runs []measure.Summary) *Table {
	t := &Table{Head: []string{"policy", "requests", "errors", "hit %", "pooled-cache hit %", "infinite-cache hit %",
		"TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms", "out tok/s", "prefill tok", "util %", "lag p99 ms"}}
	for _, s := range runs {
		t.Rows = append(t.Rows, []string{RunName(s), strconv.Itoa(s.Requests), strconv.Itoa(s.Errors),
			fmt.Sprintf("%.1f", s.HitRate*100), Percent(s.PooledHitRate), Percent(s.InfiniteHitRate),
			fmt.Sprintf("%.0f", s.TTFT.P50), fmt.Sprintf("%.0f", s.TTFT.P90), fmt.Sprintf("%.0f", s.TTFT.P99),
			fmt.Sprintf("%.1f", s.ITL.P50), fmt.Sprintf("%.1f", s.ITL.P90), fmt.Sprintf("%.1f", s.ITL.P99),
			fmt.Sprintf("%.0f", s.OutputTokPerS), strconv.FormatInt(s.PrefillTokensComputed, 10), Percent(s.MeanEngineUtilization), lagCell(s)})
	}
	return t
}

// Percent formats a fraction as a percentage with one decimal ("73.4"),
// "-" for nil (unknown).
func Percent(v *float64) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf("%.1f", *v*100)
}

// RunName labels a run in tables and legends: its policy, and its rate
// in a --rate sweep ("prefix @ 2 req/s").
func RunName(s measure.Summary) string {
	if s.RateRPS > 0 {
		return fmt.Sprintf("%s @ %g req/s", s.Policy, s.RateRPS)
	}
	return s.Policy
}

// HTMLReport is a benchmark report for WriteHTMLReport.
type HTMLReport struct {
	Title string
	Runs  []HTMLRun
	// Provenance says what produced the runs (nil: not shown).
	Provenance *measure.Provenance
	// References, if set, are the replayed records' reference hits
	// (NewReferences): the hit rate over time gains the pooled and
	// infinite cache's curves. The hit-rate chart's reference lines and the
	// table's reference columns are the runs' Summary.PooledHitRate and
	// InfiniteHitRate.
	References *measure.References
}

// WriteHTML is WriteHTMLReport of runs under title, with no provenance and
// no reference curves.
func WriteHTML(w io.Writer, title string, runs []HTMLRun) error {
	return WriteHTMLReport(w, HTMLReport{Title: title, Runs: runs})
}

// WriteHTMLReport writes a benchmark report: what produced it (command,
// build, host, workload, profile, clock, lag) with a warning per run that
// fell behind or had failures, the summary table with the reference hit
// rates, TTFT and ITL CDFs and percentiles, the hit rate against the
// pooled- and infinite-cache references overall and over time, TTFT p50 and
// requests in flight over time, and the share of requests (or prompt
// tokens) each engine served.
func WriteHTMLReport(w io.Writer, r HTMLReport) error { return r.Page().Write(w) }

// Page lays out the report WriteHTMLReport writes.
func (r HTMLReport) Page() Page {
	runs := r.Runs
	sums := make([]measure.Summary, len(runs))
	names := make([]string, len(runs))
	for i, run := range runs {
		sums[i] = run.Summary
		names[i] = RunName(run.Summary)
	}
	frac := Axis{Label: "fraction of requests ≤ x", Min: 0, Max: 1, Format: FormatPercent}
	var ttft, itl, hit, ttftT, inflight []Series
	ttftPct := make([][]float64, len(runs))
	itlPct := make([][]float64, len(runs))
	for i, run := range runs {
		tv, iv := latencies(run.Records)
		ttftPct[i], itlPct[i] = percentiles(tv), percentiles(iv)
		x, y := CDF(tv)
		ttft = append(ttft, Series{Name: names[i], X: x, Y: y})
		x, y = CDF(iv)
		itl = append(itl, Series{Name: names[i], X: x, Y: y})
		h, t := windows(run.Records, nil)
		h.Name, t.Name = names[i], names[i]
		hit = append(hit, h)
		ttftT = append(ttftT, t)
		s := inFlight(run.Records)
		s.Name = names[i]
		inflight = append(inflight, s)
	}
	itlFrac := frac
	itlFrac.Label = "fraction of gaps ≤ x"
	secs := Axis{Label: "arrival time (s, engine time)"}
	pctGroups := []string{"p50", "p90", "p99"}
	msBars := Axis{Label: "engine time (log scale)", Log: true, Format: FormatMs}

	hitRefs := referenceLines(sums)
	if rs := r.References; rs != nil {
		for _, run := range runs {
			if run.Summary.PooledHitRate == nil && run.Summary.InfiniteHitRate == nil {
				continue
			}
			// The first run with references: the curves over its arrivals.
			if rs.Pooled != nil {
				c, _ := windows(run.Records, func(rec *measure.Record) (int, int, bool) { return refHit(rs, rs.Pooled, rec) })
				c.Name, c.Kind, c.Key, c.Color = "pooled cache", SeriesRef, "pooled", RefColor
				hit = append(hit, c)
			}
			if rs.Infinite != nil {
				c, _ := windows(run.Records, func(rec *measure.Record) (int, int, bool) { return refHit(rs, rs.Infinite, rec) })
				c.Name, c.Kind, c.Key, c.Color, c.Dash = "infinite cache", SeriesRef, "infinite", InfiniteColor, "1 3"
				hit = append(hit, c)
			}
			break
		}
	}
	hitVals := make([][]float64, len(runs))
	for i, s := range sums {
		hitVals[i] = []float64{s.HitRate}
	}
	hitTitle, hitNote := refCaption(hitRefs)
	hitBars := BarChart("Prefix-cache hit rate"+hitTitle, "",
		Axis{Label: "hit rate (Σcached / Σprompt)", Format: FormatPercent}, []string{"measured requests"}, names, hitVals, hitRefs...)
	hitBars.Key = "hit-rate"
	hitBars.Note = hitNote
	ttftBars := BarChart("TTFT percentiles", "", msBars, pctGroups, names, ttftPct)
	ttftBars.Key = "ttft-percentiles"
	itlBars := BarChart("ITL percentiles (all gaps of all requests pooled)", "", msBars, pctGroups, names, itlPct)
	itlBars.Key = "itl-percentiles"
	itlBars.Note = "Inter-token latency per read of the stream, split evenly over the chunks it brought (see bench/README.md, \"Inter-token latency\"); read it only for runs that kept up with their time scale."
	ttftCDF := LineChart("TTFT CDF", Axis{Label: "TTFT (log scale)", Log: true, Format: FormatMs}, frac, ttft)
	ttftCDF.Key = "ttft-cdf"
	itlCDF := LineChart("ITL CDF", Axis{Label: "inter-token latency (log scale)", Log: true, Format: FormatMs}, itlFrac, itl)
	itlCDF.Key = "itl-cdf"
	hitT := LineChart(fmt.Sprintf("Prefix-cache hit rate over time (%d arrival windows)", timeWindows), secs,
		Axis{Label: "hit rate (Σcached / Σprompt)", Min: 0, Max: 1, Format: FormatPercent}, hit)
	hitT.Key = "hit-rate-time"
	ttftTC := LineChart(fmt.Sprintf("TTFT p50 over time (%d arrival windows)", timeWindows), secs,
		Axis{Label: "TTFT p50 (log scale)", Log: true, Format: FormatMs}, ttftT)
	ttftTC.Key = "ttft-time"
	inflightC := LineChart("Requests in flight over time", Axis{Label: "time (s, engine time)"}, Axis{Label: "in flight (requests)"}, inflight)
	inflightC.Key = "in-flight"
	inflightC.Note = "Requests sent and not yet finished (from arrival and end-to-end latency): a proxy for queue depth."
	share := endpointChart(runs)
	share.Key = "endpoint-share"

	text := []string{"Latencies are engine time (see bench/README.md, \"Time domain\"). Failed requests are left out of the latency and hit-rate figures.",
		"Lag p99: how far a real-time run fell behind its time scale (the larger of the fleet's step lag and the client's send lag, engine time); BEHIND past the run's margin, when its latencies measure the host, not the modelled hardware. \"-\": not measured (virtual time has no wall clock)."}
	run := Section{Title: "Run", Alerts: RunAlerts(sums)}
	if p := r.Provenance; p != nil {
		run.Facts = append(ProvenanceFacts(p), LagFact(sums))
	} else {
		run.Facts = []Fact{LagFact(sums)}
	}
	cache := Section{Title: "Prefix cache", Charts: []Chart{hitBars, hitT}}
	if tiers, table := tierCharts(sums, names); tiers != nil {
		cache.Charts = append(cache.Charts, tiers...)
		cache.Table = table
	}
	sections := []Section{
		run,
		{Title: "Summary", Text: text, Table: SummaryTable(sums)},
		{Title: "Latency", Charts: []Chart{ttftCDF, itlCDF, ttftBars, itlBars}},
		{Title: "TTFT by prompt length", Text: []string{bucketText}, Table: BucketTable(names, sums)},
		cache,
		{Title: "Load over time and per engine", Charts: []Chart{ttftTC, inflightC, share}},
	}
	if pd := pdSection(runs, names); pd != nil {
		sections = append(sections[:3], append([]Section{*pd}, sections[3:]...)...)
	}
	return Page{Title: r.Title, Subtitle: subtitle(r.Provenance), Sections: sections}
}

// bucketText explains the TTFT-by-prompt-length table.
const bucketText = "Requests and TTFT percentiles per prompt-length bucket (prompt tokens as the engines reported them; k = 1,024 tokens): whether long prompts wait longer than their own prefill takes, which the pooled percentiles hide."

// pdSection shows the P/D hand-offs of the runs on prefill and decode
// engines (Summary.PD): the prefill leg's and the P→D transfer's
// percentiles and the transfer's CDF, and a table of split and whole
// requests; nil when no run has P/D.
func pdSection(runs []HTMLRun, names []string) *Section {
	var pnames []string
	var prefill, transfer [][]float64
	var cdf []Series
	t := &Table{Head: []string{"policy", "split", "whole", "whole by reason", "prefill leg p50/p90/p99 ms", "P→D transfer (D's wait for blocks + read) p50/p90/p99 ms"}}
	for i, run := range runs {
		s := run.Summary.PD
		if s == nil {
			continue
		}
		pnames = append(pnames, names[i])
		prefill = append(prefill, []float64{s.Prefill.P50, s.Prefill.P90, s.Prefill.P99})
		transfer = append(transfer, []float64{s.Transfer.P50, s.Transfer.P90, s.Transfer.P99})
		var xs []float64
		for k := range run.Records {
			if r := &run.Records[k]; r.Error == "" && r.PD != nil && r.PD.Split {
				xs = append(xs, r.PD.TransferMs)
			}
		}
		x, y := CDF(xs)
		cdf = append(cdf, Series{Name: names[i], X: x, Y: y})
		reasons := make([]string, 0, len(s.Reasons))
		for _, k := range slices.Sorted(maps.Keys(s.Reasons)) {
			reasons = append(reasons, fmt.Sprintf("%s %d", k, s.Reasons[k]))
		}
		t.Rows = append(t.Rows, []string{names[i], strconv.Itoa(s.Split), strconv.Itoa(s.Whole), strings.Join(reasons, ", "),
			fmt.Sprintf("%.0f/%.0f/%.0f", s.Prefill.P50, s.Prefill.P90, s.Prefill.P99),
			fmt.Sprintf("%.1f/%.1f/%.1f", s.Transfer.P50, s.Transfer.P90, s.Transfer.P99)})
	}
	if len(pnames) == 0 {
		return nil
	}
	groups := []string{"p50", "p90", "p99"}
	ms := Axis{Label: "engine time (log scale)", Log: true, Format: FormatMs}
	pb := BarChart("Prefill leg: arrival to the prefill engine's answer", "", ms, groups, pnames, prefill)
	pb.Key = "pd-prefill"
	tb := BarChart("P→D transfer: the prefill engine's answer to the end of the decode engine's read", "", ms, groups, pnames, transfer)
	tb.Key = "pd-transfer"
	tb.Note = "Includes the decode engine's admission wait for free KV blocks and its queue on the interconnect link (sim/pd.go)."
	tc := LineChart("P→D transfer CDF", Axis{Label: "transfer (log scale)", Log: true, Format: FormatMs},
		Axis{Label: "fraction of split requests ≤ x", Min: 0, Max: 1, Format: FormatPercent}, cdf)
	tc.Key = "pd-transfer-cdf"
	return &Section{Title: "Prefill/decode hand-offs", Table: t, Charts: []Chart{pb, tb, tc},
		Text: []string{"Requests split across a prefill and a decode engine, and those the decider kept whole on one engine (sched/pd.go)."}}
}

// tierCharts are the hits by KV tier of the runs that report tiers
// (Summary.TierHitRate): the engines' reported hit rate per tier and the
// precise index's prediction per tier, as bar charts grouped by tier, and a
// table with the prediction's mean absolute error; nil when no run reports
// tiers.
func tierCharts(sums []measure.Summary, names []string) ([]Chart, *Table) {
	var rep, pred [][]float64
	var rnames, pnames []string
	t := &Table{Head: []string{"policy", "gpu %", "host %", "disk %", "remote %", "predicted gpu/host/disk/remote %", "MAE gpu/host/disk/remote tokens"}}
	for i, s := range sums {
		if s.TierHitRate == nil {
			continue
		}
		v := s.TierHitRate.Array()
		rep = append(rep, v[:])
		rnames = append(rnames, names[i])
		row := []string{names[i]}
		for _, x := range v {
			row = append(row, fmt.Sprintf("%.1f", x*100))
		}
		pcell, mcell := "-", "-"
		if p := s.TierPredictedHitRate; p != nil {
			pv := p.Array()
			pred = append(pred, pv[:])
			pnames = append(pnames, names[i])
			pcell = fmt.Sprintf("%.1f/%.1f/%.1f/%.1f", pv[0]*100, pv[1]*100, pv[2]*100, pv[3]*100)
		}
		if m := s.TierPredictionMAE; m != nil {
			mv := m.Array()
			mcell = fmt.Sprintf("%.0f/%.0f/%.0f/%.0f", mv[0], mv[1], mv[2], mv[3])
		}
		t.Rows = append(t.Rows, append(row, pcell, mcell))
	}
	if len(rep) == 0 {
		return nil, nil
	}
	groups := measure.TierNames[:]
	axis := Axis{Label: "hit rate (Σcached in the tier / Σprompt)", Format: FormatPercent}
	reported := BarChart("Hits by tier, as the engines served them", "", axis, groups, rnames, rep)
	reported.Key = "tier-hits"
	reported.Note = "Prompt tokens served from each tier: the GPU prefix cache, then blocks loaded from host memory, local disk and the shared remote store (sim/tiers.go)."
	charts := []Chart{reported}
	if len(pred) > 0 {
		p := BarChart("Hits by tier, as the precise index predicted them at routing time", "", axis, groups, pnames, pred)
		p.Key = "tier-predicted"
		p.Note = "The table below gives the mean absolute error per request and tier between prediction and what the engine served."
		charts = append(charts, p)
	}
	return charts, t
}

// subtitle is the page's line under the title: version and start.
func subtitle(p *measure.Provenance) string {
	if p == nil {
		return ""
	}
	return fmt.Sprintf("infergate %s · started %s · %s", p.Version, p.Start, p.ClockText())
}

// refCaption is the hit-rate chart's title suffix and note for the
// reference lines it draws (referenceLines): only those drawn are named. A
// run against another gateway (--target) has none: the references need
// the fleet's KV capacity, which bench does not know there.
func refCaption(refs []Series) (title, note string) {
	var pooled, infinite bool
	for _, l := range refs {
		pooled = pooled || l.Key == "pooled"
		infinite = infinite || l.Key == "infinite"
	}
	const pooledText = "the hit rate one cache with the whole fleet's KV capacity would reach on these requests (pooled cache, what a perfect router could approach without replicating prefixes)"
	const infText = "an infinite cache's (the workload's ceiling)"
	const see = " See bench/README.md, \"References\"."
	switch {
	case pooled && infinite:
		return " vs the pooled and infinite cache", "Dashed lines: " + pooledText + ", and " + infText + "." + see
	case pooled:
		return " vs the pooled cache", "Dashed line: " + pooledText + "." + see
	case infinite:
		return " vs the infinite cache", "Dashed line: " + infText + "." + see
	}
	return "", "No reference lines: they need the fleet's KV capacity (bench's own fleet; not known for --target)." + see
}

// referenceLines are the hit-rate charts' reference lines: the first run's
// pooled and infinite-cache reference hit rates that are set.
func referenceLines(sums []measure.Summary) []Series {
	var out []Series
	for _, s := range sums {
		if s.PooledHitRate != nil {
			out = append(out, PooledCacheLine(*s.PooledHitRate))
			break
		}
	}
	for _, s := range sums {
		if s.InfiniteHitRate != nil {
			out = append(out, InfiniteCacheLine(*s.InfiniteHitRate))
			break
		}
	}
	return out
}

// PooledCacheLine is a hit-rate chart's line at the pooled-cache
// reference hit rate (a fraction; measure.PooledCacheHitRate), dashed, key
// "pooled".
func PooledCacheLine(rate float64) Series {
	return HLine(fmt.Sprintf("pooled cache %.1f%%", rate*100), "pooled", rate, RefColor)
}

// InfiniteCacheLine is a hit-rate chart's line at the infinite-cache
// reference hit rate (a fraction; trace.InfiniteCacheHitRate), dotted, key
// "infinite".
func InfiniteCacheLine(rate float64) Series {
	l := HLine(fmt.Sprintf("infinite cache %.1f%%", rate*100), "infinite", rate, InfiniteColor)
	l.Dash = "2 3"
	return l
}

// refHit is a record's reference hit and prompt tokens from hits (a
// References slice), false when out of range.
func refHit(rs *measure.References, hits []int, r *measure.Record) (int, int, bool) {
	if r.Index < 0 || r.Index >= len(hits) || r.Index >= len(rs.Prompt) {
		return 0, 0, false
	}
	return hits[r.Index], rs.Prompt[r.Index], true
}

// latencies returns the TTFTs and the pooled ITL gaps of recs' successful
// requests (ms).
func latencies(recs []measure.Record) (ttft, itl []float64) {
	for i := range recs {
		if rec := &recs[i]; rec.Error == "" {
			ttft = append(ttft, rec.TTFTMs)
			itl = append(itl, rec.ITLMs...)
		}
	}
	return ttft, itl
}

// percentiles are p50, p90 and p99 of xs (measure.NewLatency; sorts xs in
// place).
func percentiles(xs []float64) []float64 {
	l := measure.NewLatency(xs)
	return []float64{l.P50, l.P90, l.P99}
}

// RunAlerts are the warnings of runs that fell behind their time scale
// (WriteLagWarnings) or had failed requests.
func RunAlerts(sums []measure.Summary) []Alert {
	var out []Alert
	var b bytes.Buffer
	_, _ = Report{Runs: sums}.WriteLagWarnings(&b)
	for line := range strings.Lines(b.String()) {
		out = append(out, Alert{Key: "behind", Text: strings.TrimSpace(line)})
	}
	for _, s := range sums {
		if s.Errors > 0 {
			t := fmt.Sprintf("%s: %d of %d requests failed", RunName(s), s.Errors, s.Requests)
			if s.FirstError != "" {
				t += "; first error: " + s.FirstError
			}
			out = append(out, Alert{Key: "errors", Text: t})
		}
	}
	return out
}

// LagFact says how far the runs fell behind their time scale: the largest
// fleet step lag and client send lag p99 against the margin, and how many
// runs were behind; or that nothing was measured (virtual time).
func LagFact(sums []measure.Summary) Fact {
	f := Fact{Key: "lag", Field: "lag"}
	var fleet, send, margin float64
	var hasFleet, hasSend bool
	behind := 0
	for _, s := range sums {
		if s.FleetLag != nil {
			fleet, hasFleet = max(fleet, s.FleetLag.P99), true
		}
		if s.SendLag != nil {
			send, hasSend = max(send, s.SendLag.P99), true
		}
		margin = max(margin, s.MaxLagMs)
		if s.Behind {
			behind++
		}
	}
	if !hasFleet && !hasSend {
		f.Value = "not measured: virtual time has no wall clock to fall behind (and a closed loop against a target no schedule)"
		return f
	}
	var parts []string
	if hasFleet {
		parts = append(parts, fmt.Sprintf("fleet step lag p99 up to %.1f ms", fleet))
	}
	if hasSend {
		parts = append(parts, fmt.Sprintf("client send lag p99 up to %.1f ms", send))
	}
	f.Value = strings.Join(parts, ", ") + " (engine time)"
	if margin > 0 {
		f.Value += fmt.Sprintf(", margin %.0f ms", margin)
	}
	if behind > 0 {
		f.Value += fmt.Sprintf(": %d of %d runs BEHIND their time scale, their latencies measure this host", behind, len(sums))
	} else if margin > 0 {
		f.Value += ": every run kept up"
	}
	return f
}

// windows buckets successful records by arrival into timeWindows windows and
// returns per window the hit rate (Σcached/Σprompt) and TTFT p50, at the
// window's midpoint (s). hit, if set, gives a record's cached and prompt
// tokens instead of its own (a reference's), false to skip it.
func windows(recs []measure.Record, hit func(*measure.Record) (cached, prompt int, ok bool)) (hitS, ttft Series) {
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
		cached, prompt := r.CachedTokens, r.PromptTokens
		if hit != nil {
			var ok bool
			if cached, prompt, ok = hit(r); !ok {
				continue
			}
		}
		ws[k].cached += int64(cached)
		ws[k].prompt += int64(prompt)
		ws[k].ttft = append(ws[k].ttft, r.TTFTMs)
	}
	for k, w := range ws {
		mid := (float64(k) + 0.5) * width / 1000
		if w.prompt > 0 {
			hitS.X, hitS.Y = append(hitS.X, mid), append(hitS.Y, float64(w.cached)/float64(w.prompt))
		}
		if len(w.ttft) > 0 {
			slices.Sort(w.ttft)
			ttft.X, ttft.Y = append(ttft.X, mid), append(ttft.Y, measure.Percentile(w.ttft, 50))
		}
	}
	return hitS, ttft
}

// inFlight samples the number of requests in [arrival, arrival+e2e) at
// inFlightPoints evenly spaced times (s).
func inFlight(recs []measure.Record) Series {
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
		names[i] = RunName(r.Summary)
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

// MeasuredRun returns run with its warm-up records (and their Engine
// entries) removed, for the HTML report.
func MeasuredRun(run HTMLRun) HTMLRun {
	if !slices.ContainsFunc(run.Records, func(r measure.Record) bool { return r.Warmup }) {
		return run
	}
	recs := make([]measure.Record, 0, len(run.Records))
	var eng []int
	for i, r := range run.Records {
		if r.Warmup {
			continue
		}
		recs = append(recs, r)
		if run.Engine != nil {
			eng = append(eng, run.Engine[i])
		}
	}
	run.Records, run.Engine = recs, eng
	return run
}
