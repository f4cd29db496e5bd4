package plan

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/infergate/infergate/measure"
)

// Metric is a latency a Target bounds.
type Metric string

// The metrics an SLO can bound. Each has a fleet-level reading (a percentile
// over the run) and a per-request reading (used for goodput); see Target.
const (
	// TTFT is the time to first token of a request.
	TTFT Metric = "ttft"
	// ITL is the inter-token latency: the gaps between consecutive output
	// tokens. Fleet-level, all gaps of all requests are pooled (as vLLM's
	// benchmark_serving pools them); per request, the percentile is taken
	// over the request's own gaps.
	ITL Metric = "itl"
	// TPOT is the time per output token after the first, per request:
	// (E2E − TTFT) / (output tokens − 1), as vLLM defines it; 0 for a
	// request with one output token.
	TPOT Metric = "tpot"
	// E2E is the end-to-end latency of a request, arrival to last token.
	E2E Metric = "e2e"
)

// Metrics lists the metrics an SLO accepts, in the order they are reported.
func Metrics() []Metric { return []Metric{TTFT, ITL, TPOT, E2E} }

// Target is one latency objective, written metric_pXX=duration.
//
// Fleet-level (what Row.MeetsSLO checks): the Percentile-th percentile of
// Metric over the run must be at most Max. For ttft, tpot and e2e the
// percentile is over requests, a failed request counting as infinitely slow;
// for itl it is over the pooled gaps of the successful requests.
//
// Per request (what goodput counts): a successful request meets the target
// when its own value is at most Max. TTFT, TPOT and E2E have one value per
// request, so the percentile plays no part; for ITL the value is the
// Percentile-th percentile of the request's own gaps (p100: its largest gap;
// a request with fewer than two tokens has no gaps and meets it).
type Target struct {
	// Metric is the latency bounded.
	Metric Metric
	// Percentile is in (0, 100]; 100 is the maximum.
	Percentile float64
	// Max is the bound (inclusive), > 0.
	Max time.Duration
}

// Name is the target's key as written, e.g. "ttft_p90" or "itl_p99.9".
func (t Target) Name() string {
	return string(t.Metric) + "_p" + strconv.FormatFloat(t.Percentile, 'f', -1, 64)
}

// String is the target as written, e.g. "ttft_p90=2s".
func (t Target) String() string { return t.Name() + "=" + t.Max.String() }

// SLO is a service-level objective: latency targets, all of which must hold
// at fleet level, and optionally a minimum goodput share.
type SLO struct {
	// Targets are the latency targets, in the order written (at least one).
	Targets []Target
	// MinGoodput, when > 0, additionally requires that at least this share
	// of requests (in (0, 1]) meets every target individually (goodput>=X).
	MinGoodput float64
}

// String is the SLO in the grammar ParseSLO reads, e.g.
// "ttft_p90=2s,itl_p99=100ms,goodput>=0.9".
func (s SLO) String() string {
	parts := make([]string, 0, len(s.Targets)+1)
	for _, t := range s.Targets {
		parts = append(parts, t.String())
	}
	if s.MinGoodput > 0 {
		parts = append(parts, "goodput>="+strconv.FormatFloat(s.MinGoodput, 'f', -1, 64))
	}
	return strings.Join(parts, ",")
}

// ParseSLO parses a comma-separated SLO. Each item is either a latency target
//
//	metric_pXX=duration   metric one of ttft, itl, tpot, e2e; XX a percentile in
//	                      (0, 100], decimals allowed (p99.9); metric_max means p100;
//	                      duration a Go duration with a unit (2s, 150ms, 1m30s), > 0
//
// or a fleet-level goodput requirement
//
//	goodput>=X            X a share in (0, 1], or a percentage (90%)
//
// At least one latency target is required; a metric_pXX may appear once, and
// goodput once. Spaces around items are ignored. Examples: "ttft_p90=2s",
// "ttft_p99=5s,itl_p99=100ms,goodput>=0.9".
func ParseSLO(s string) (SLO, error) {
	var slo SLO
	if strings.TrimSpace(s) == "" {
		return slo, errors.New("empty SLO: want e.g. ttft_p90=2s,itl_p99=100ms")
	}
	seen := map[string]bool{}
	for item := range strings.SplitSeq(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			return SLO{}, fmt.Errorf("SLO %q: empty item", s)
		}
		if rest, ok := strings.CutPrefix(item, "goodput"); ok {
			v, ok := strings.CutPrefix(strings.TrimSpace(rest), ">=")
			if !ok {
				return SLO{}, fmt.Errorf("SLO item %q: want goodput>=X with X in (0, 1] or a percentage", item)
			}
			if slo.MinGoodput > 0 {
				return SLO{}, fmt.Errorf("SLO item %q: goodput given twice", item)
			}
			g, err := parseShare(strings.TrimSpace(v))
			if err != nil {
				return SLO{}, fmt.Errorf("SLO item %q: %w", item, err)
			}
			slo.MinGoodput = g
			continue
		}
		t, err := parseTarget(item)
		if err != nil {
			return SLO{}, fmt.Errorf("SLO item %q: %w", item, err)
		}
		if seen[t.Name()] {
			return SLO{}, fmt.Errorf("SLO item %q: %s given twice", item, t.Name())
		}
		seen[t.Name()] = true
		slo.Targets = append(slo.Targets, t)
	}
	if len(slo.Targets) == 0 {
		return SLO{}, fmt.Errorf("SLO %q: no latency target (want e.g. ttft_p90=2s)", s)
	}
	return slo, nil
}

func parseTarget(item string) (Target, error) {
	key, val, ok := strings.Cut(item, "=")
	if !ok {
		return Target{}, errors.New("want metric_pXX=duration (e.g. ttft_p90=2s) or goodput>=X")
	}
	key, val = strings.TrimSpace(key), strings.TrimSpace(val)
	name, pct, ok := strings.Cut(key, "_")
	if !ok {
		return Target{}, fmt.Errorf("key %q: want metric_pXX, e.g. ttft_p90", key)
	}
	t := Target{Metric: Metric(name)}
	if !slices.Contains(Metrics(), t.Metric) {
		return Target{}, fmt.Errorf("unknown metric %q (want one of ttft, itl, tpot, e2e)", name)
	}
	if pct == "max" {
		t.Percentile = 100
	} else {
		num, ok := strings.CutPrefix(pct, "p")
		p, err := strconv.ParseFloat(num, 64)
		if !ok || err != nil || num == "" || strings.ContainsAny(num, "+-eExXnNiI_") {
			return Target{}, fmt.Errorf("percentile %q: want pXX with XX in (0, 100], e.g. p90, p99.9, or max", pct)
		}
		if !(p > 0 && p <= 100) {
			return Target{}, fmt.Errorf("percentile %q: must be in (0, 100]", pct)
		}
		t.Percentile = p
	}
	if val == "" {
		return Target{}, errors.New("missing duration (e.g. 2s, 100ms)")
	}
	if _, err := strconv.ParseFloat(val, 64); err == nil {
		return Target{}, fmt.Errorf("duration %q has no unit (e.g. %ss or %sms)", val, val, val)
	}
	d, err := time.ParseDuration(val)
	if err != nil {
		return Target{}, fmt.Errorf("bad duration %q (want e.g. 2s, 100ms)", val)
	}
	if d <= 0 {
		return Target{}, fmt.Errorf("duration %q: must be positive", val)
	}
	t.Max = d
	return t, nil
}

// parseShare reads a share in (0, 1], or a percentage in (0, 100] ending in %.
func parseShare(v string) (float64, error) {
	pct := strings.HasSuffix(v, "%")
	num := strings.TrimSuffix(v, "%")
	g, err := strconv.ParseFloat(num, 64)
	if err != nil || num == "" || math.IsNaN(g) || math.IsInf(g, 0) {
		return 0, fmt.Errorf("goodput %q: want a share in (0, 1] or a percentage such as 90%%", v)
	}
	if pct {
		g /= 100
	}
	if !(g > 0 && g <= 1) {
		return 0, fmt.Errorf("goodput %q: must be in (0, 1] (or (0%%, 100%%])", v)
	}
	return g, nil
}

// Check is the fleet-level verdict on one Target for one run.
type Check struct {
	// Target is the target's name, e.g. "ttft_p90".
	Target string `json:"target"`
	// LimitMs is the target's bound (ms).
	LimitMs float64 `json:"limit_ms"`
	// ObservedMs is the run's value (ms); math.MaxFloat64 when the
	// percentile falls on failed requests (infinitely slow; JSON has no +Inf).
	ObservedMs float64 `json:"observed_ms"`
	// OK is ObservedMs <= LimitMs.
	OK bool `json:"ok"`
}

// Evaluate judges recs, one run's records (measure.Record: ms of engine time),
// against slo. It returns the fleet-level checks, in target order, and the
// run's goodput; duration is the run's length (s) used for Goodput.PerS.
// A check's ObservedMs is math.MaxFloat64 when its percentile falls on failed
// requests (infinitely slow), so that it encodes as JSON.
func Evaluate(slo SLO, recs []measure.Record, durationS float64) ([]Check, measure.Goodput) {
	checks := make([]Check, len(slo.Targets))
	for i, t := range slo.Targets {
		v := fleetValue(t, recs)
		checks[i] = Check{Target: t.Name(), LimitMs: ms(t.Max), ObservedMs: min(v, math.MaxFloat64), OK: v <= ms(t.Max)}
	}
	g := measure.Goodput{SLO: slo.String()}
	var gaps []float64
	for i := range recs {
		var ok bool
		if ok, gaps = meets(slo.Targets, &recs[i], gaps); ok {
			g.Requests++
		}
	}
	if len(recs) > 0 {
		g.Share = float64(g.Requests) / float64(len(recs))
	}
	if durationS > 0 {
		g.PerS = float64(g.Requests) / durationS
	}
	return checks, g
}

// Meets reports whether the request r met every target individually (see
// Target for the per-request reading). A failed request meets none.
func Meets(targets []Target, r *measure.Record) bool {
	ok, _ := meets(targets, r, nil)
	return ok
}

// meets is Meets with a scratch slice for sorting ITL gaps, returned for reuse.
func meets(targets []Target, r *measure.Record, scratch []float64) (bool, []float64) {
	if r.Error != "" {
		return false, scratch
	}
	for _, t := range targets {
		var v float64
		switch t.Metric {
		case TTFT:
			v = r.TTFTMs
		case E2E:
			v = r.E2EMs
		case TPOT:
			v = tpot(r)
		case ITL:
			if len(r.ITLMs) == 0 {
				continue
			}
			if t.Percentile == 100 {
				v = slices.Max(r.ITLMs)
			} else {
				scratch = append(scratch[:0], r.ITLMs...)
				slices.Sort(scratch)
				v = measure.Percentile(scratch, t.Percentile)
			}
		}
		if v > ms(t.Max) {
			return false, scratch
		}
	}
	return true, scratch
}

// tpot is vLLM's time per output token of r (ms): (E2E − TTFT) / (output
// tokens − 1), 0 with fewer than two output tokens.
func tpot(r *measure.Record) float64 {
	if r.OutputTokens < 2 {
		return 0
	}
	return (r.E2EMs - r.TTFTMs) / float64(r.OutputTokens-1)
}

// fleetValue is the run's value of t at fleet level (ms): see Target.
func fleetValue(t Target, recs []measure.Record) float64 {
	var xs []float64
	if t.Metric == ITL {
		for i := range recs {
			if recs[i].Error == "" {
				xs = append(xs, recs[i].ITLMs...)
			}
		}
	} else {
		xs = make([]float64, len(recs))
		for i := range recs {
			r := &recs[i]
			switch {
			case r.Error != "":
				xs[i] = math.Inf(1)
			case t.Metric == TTFT:
				xs[i] = r.TTFTMs
			case t.Metric == E2E:
				xs[i] = r.E2EMs
			case t.Metric == TPOT:
				xs[i] = tpot(r)
			}
		}
	}
	slices.Sort(xs)
	return percentile(xs, t.Percentile)
}

// percentile is measure.Percentile over an ascending slice that may end in
// +Inf (failed requests): a percentile that needs an infinite sample is +Inf.
func percentile(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	h := float64(n-1) * p / 100
	lo := int(math.Floor(h))
	if lo >= n-1 {
		return sorted[n-1]
	}
	if math.IsInf(sorted[lo+1], 1) {
		if h == float64(lo) {
			return sorted[lo]
		}
		return math.Inf(1)
	}
	return measure.Percentile(sorted, p)
}

// ms converts d to milliseconds.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
