package plan

import (
	"math"
	"slices"
	"strings"

	"github.com/infergate/infergate/measure"
)

// Margins: how far each candidate of a table is from the best, metric by
// metric, beside League's count of lost cells.
//
// League counts cells, and a cell lost by 0.1% counts as one lost by a
// factor of three. With near-twin rivals in the table (two profiles of one
// policy) every TTFT cell goes to whichever twin is a hair faster, and a
// policy with the best hit rate and tails three times longer can rank
// first: on the 8-engine table of 2026-12-06 (sched/README.md, "The table
// at the close of issue 19") the `prefix` rule, Mooncake TTFT p90 14.7 s
// against 6.2–6.4 s, loses 67 of 277 cells to `cache-aware`'s 76 once
// `cache-aware-ttft` and `precise-prefix` are rivals too. Margins reads the
// same runs by magnitude:
//
//	for each case c and metric m (hit rate; TTFT p50, p90, p99; the TTFT
//	p90 of each prompt-length bucket the baseline has requests in):
//	  ratio_{p,c,m} = best_c,m / v_p,c,m   (hit rate: higher is better)
//	               = v_p,c,m / best_c,m    (latencies)
//	  rank_{p,c,m}  = 1 + #{candidates strictly better}
//	Excess_p = exp(mean_{c,m} ln ratio_{p,c,m}) − 1   (geometric mean, ≥ 0)
//	MeanRank_p = mean_{c,m} rank_{p,c,m}
//
// so 0.04 is "4% worse than the best of the table, on the geometric
// average of every cell". A value of 0 (a hit rate of 0, a latency of 0)
// is read as 1e-6 of its unit (a fraction of prompt tokens; ms) so that a
// ratio stays finite. A (case, metric) that any candidate lacks, or whose
// value is NaN for any candidate, is left out for all, so every candidate
// is measured on the same cells.

// Margin is one candidate's distance from the best of a table.
type Margin struct {
	Label string
	// Cells is how many (case, metric) pairs were compared.
	Cells int
	// MeanRank is the candidate's mean rank over the cells (1: best).
	MeanRank float64
	// Best is how many cells the candidate is the best (or tied best) in.
	Best int
	// Excess is the geometric mean of the ratio to the best, minus 1, over
	// every cell; ByMetric the same per metric ("hit", "ttft_p50",
	// "ttft_p90", "ttft_p99", "p90 buckets").
	Excess   float64
	ByMetric map[string]float64
}

// marginFloor keeps a ratio finite where a value is 0.
const marginFloor = 1e-6

// Margins measures each candidate of cands against the best of all of them
// (the baseline's bucket populations decide which buckets count, as in
// Judge) and returns the candidates ordered by Excess, smallest first
// (ties by label).
func Margins(cands map[string]Runs, baseline Runs, cases []Case) []Margin {
	if len(cands) == 0 {
		return nil
	}
	labels := slices.Sorted(func(yield func(string) bool) {
		for k := range cands {
			if !yield(k) {
				return
			}
		}
	})
	type acc struct {
		cells, best int
		rank, log   float64
		byMetric    map[string][2]float64 // sum of ln ratio, count
	}
	accs := make(map[string]*acc, len(labels))
	for _, l := range labels {
		accs[l] = &acc{byMetric: map[string][2]float64{}}
	}
	vals := make([]float64, len(labels))
	measureCell := func(metric string, higher bool, of func(measure.Summary) (float64, bool), c Case) {
		for i, l := range labels {
			s, ok := cands[l][c]
			if !ok {
				return
			}
			v, ok := of(s)
			if !ok || math.IsNaN(v) {
				return
			}
			vals[i] = max(v, marginFloor)
		}
		best := vals[0]
		for _, v := range vals[1:] {
			if higher && v > best || !higher && v < best {
				best = v
			}
		}
		for i, l := range labels {
			a := accs[l]
			ratio := vals[i] / best
			if higher {
				ratio = best / vals[i]
			}
			rank := 1
			for _, w := range vals {
				if higher && w > vals[i] || !higher && w < vals[i] {
					rank++
				}
			}
			a.cells++
			a.rank += float64(rank)
			if rank == 1 {
				a.best++
			}
			a.log += math.Log(ratio)
			m := a.byMetric[metric]
			a.byMetric[metric] = [2]float64{m[0] + math.Log(ratio), m[1] + 1}
		}
	}
	for _, c := range cases {
		measureCell("hit", true, func(s measure.Summary) (float64, bool) { return s.HitRate, true }, c)
		measureCell("ttft_p50", false, func(s measure.Summary) (float64, bool) { return s.TTFT.P50, true }, c)
		measureCell("ttft_p90", false, func(s measure.Summary) (float64, bool) { return s.TTFT.P90, true }, c)
		measureCell("ttft_p99", false, func(s measure.Summary) (float64, bool) { return s.TTFT.P99, true }, c)
		base, ok := baseline[c]
		if !ok {
			continue
		}
		for _, b := range base.TTFTByPromptLength {
			if b.Requests == 0 {
				continue
			}
			measureCell("p90 buckets", false, func(s measure.Summary) (float64, bool) {
				i := slices.IndexFunc(s.TTFTByPromptLength, func(x measure.BucketLatency) bool { return x.Name == b.Name })
				if i < 0 || s.TTFTByPromptLength[i].Requests == 0 {
					return 0, false
				}
				return s.TTFTByPromptLength[i].TTFT.P90, true
			}, c)
		}
	}
	out := make([]Margin, 0, len(labels))
	for _, l := range labels {
		a := accs[l]
		m := Margin{Label: l, Cells: a.cells, Best: a.best, ByMetric: map[string]float64{}}
		if a.cells > 0 {
			m.MeanRank = a.rank / float64(a.cells)
			m.Excess = math.Exp(a.log/float64(a.cells)) - 1
		}
		for k, v := range a.byMetric {
			m.ByMetric[k] = math.Exp(v[0]/v[1]) - 1
		}
		out = append(out, m)
	}
	slices.SortStableFunc(out, func(a, b Margin) int {
		if a.Excess != b.Excess {
			if a.Excess < b.Excess {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Label, b.Label)
	})
	return out
}
