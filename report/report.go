package report

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/infergate/infergate/measure"
)

// Report is the outcome of a benchmark: one Summary per run, in run order.
// Its JSON form is {"runs": [Summary, ...]}.
type Report struct {
	Runs []measure.Summary `json:"runs"`
	// Reference hit rates of every replayed record (warm-up requests
	// included), when computed (see measure.PooledCacheHitRate and
	// trace.InfiniteCacheHitRate): one cache with the whole fleet's KV
	// capacity, and an infinite one. Each run's Summary has its own, over
	// the requests its hit rate counts.
	PooledHitRate   *float64 `json:"pooled_hit_rate,omitempty"`
	InfiniteHitRate *float64 `json:"infinite_hit_rate,omitempty"`
	// Provenance says what produced the report (nil: not recorded).
	Provenance *measure.Provenance `json:"provenance,omitempty"`
}

// WriteJSON writes r as indented JSON.
func (r Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// WriteTable writes r as an aligned text table, one row per run: policy,
// requests, errors, hit rate (%), TTFT p50/p90/p99 (ms), ITL p50/p99 (ms),
// output throughput (tokens/s), prefill tokens computed, mean engine
// utilisation (%, "-" when unknown), the largest and smallest engine share
// (%), and the run's lag p99 (the larger of FleetLag's and SendLag's, ms of
// engine time; "-" when unknown, "BEHIND" past its margin; see
// WriteLagWarnings); a rate column (req/s) follows the policy when any run
// has RateRPS set.
func (r Report) WriteTable(w io.Writer) error {
	// Numbers align right; the policy column is padded to align left.
	pw := len("policy")
	rate := false
	for _, s := range r.Runs {
		pw = max(pw, len(s.Policy))
		rate = rate || s.RateRPS > 0
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%-*s\t", pw, "policy")
	if rate {
		fmt.Fprint(tw, "rate\t")
	}
	fmt.Fprintln(tw, "requests\terrors\thit %\tTTFT p50 ms\tTTFT p90 ms\tTTFT p99 ms\tITL p50 ms\tITL p99 ms\tout tok/s\tprefill tok\tutil %\tshare max/min %\tlag p99 ms\t")
	for _, s := range r.Runs {
		share := "-"
		if s.EndpointShareMax != nil && s.EndpointShareMin != nil {
			share = fmt.Sprintf("%.1f/%.1f", *s.EndpointShareMax*100, *s.EndpointShareMin*100)
		}
		fmt.Fprintf(tw, "%-*s\t", pw, s.Policy)
		if rate {
			fmt.Fprintf(tw, "%g\t", s.RateRPS)
		}
		fmt.Fprintf(tw, "%d\t%d\t%.1f\t%.0f\t%.0f\t%.0f\t%.1f\t%.1f\t%.0f\t%d\t%s\t%s\t%s\t\n",
			s.Requests, s.Errors, s.HitRate*100,
			s.TTFT.P50, s.TTFT.P90, s.TTFT.P99, s.ITL.P50, s.ITL.P99,
			s.OutputTokPerS, s.PrefillTokensComputed, Percent(s.MeanEngineUtilization), share, lagCell(s))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if err := r.writeTierTable(w, pw); err != nil {
		return err
	}
	names := make([]string, len(r.Runs))
	for i, run := range r.Runs {
		names[i] = RunName(run)
	}
	if err := WriteBucketTable(w, names, r.Runs); err != nil {
		return err
	}
	if line := r.referenceLine(); line != "" {
		_, err := fmt.Fprintln(w, line)
		return err
	}
	return nil
}

// writeTierTable writes, when any run reports KV tiers, one row per such
// run: its hit rate by tier (%), and, when tracked, the precise index's
// predicted hit rate by tier (%) and mean absolute prediction error per
// request by tier (tokens).
func (r Report) writeTierTable(w io.Writer, pw int) error {
	any := false
	for _, s := range r.Runs {
		any = any || s.TierHitRate != nil
	}
	if !any {
		return nil
	}
	fmt.Fprintln(w, "\nhits by tier (gpu/host/disk/remote): reported %, predicted by the precise index %, prediction MAE tokens per request")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%-*s\treported %%\tpredicted %%\tMAE tokens\t\n", pw, "policy")
	join := func(t *measure.Tiers, scale float64, format string) string {
		if t == nil {
			return "-"
		}
		v := t.Array()
		parts := make([]string, len(v))
		for i, x := range v {
			parts[i] = fmt.Sprintf(format, x*scale)
		}
		return strings.Join(parts, "/")
	}
	for _, s := range r.Runs {
		if s.TierHitRate == nil {
			continue
		}
		fmt.Fprintf(tw, "%-*s\t%s\t%s\t%s\t\n", pw, s.Policy, join(s.TierHitRate, 100, "%.1f"),
			join(s.TierPredictedHitRate, 100, "%.1f"), join(s.TierPredictionMAE, 1, "%.0f"))
	}
	return tw.Flush()
}

// WriteBucketTable writes, when any run has them, the runs' TTFT by prompt
// length (measure.Summary.TTFTByPromptLength): one row per run, labelled by
// names[i], and per bucket its request count and TTFT p50/p90/p99 (ms);
// "-" for an empty bucket.
func WriteBucketTable(w io.Writer, names []string, runs []measure.Summary) error {
	t := BucketTable(names, runs)
	if t == nil {
		return nil
	}
	fmt.Fprintln(w, "\nTTFT by prompt length (tokens; k = 1,024): requests, p50/p90/p99 ms")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	pw := len(t.Head[0])
	for _, row := range t.Rows {
		pw = max(pw, len(row[0]))
	}
	for _, row := range append([][]string{t.Head}, t.Rows...) {
		fmt.Fprintf(tw, "%-*s	%s	\n", pw, row[0], strings.Join(row[1:], "\t"))
	}
	return tw.Flush()
}

// BucketTable is WriteBucketTable's table (for HTML pages): a policy
// column, then per prompt-length bucket its requests and TTFT p50/p90/p99
// (ms); nil when no run has buckets.
func BucketTable(names []string, runs []measure.Summary) *Table {
	any := false
	for _, s := range runs {
		any = any || len(s.TTFTByPromptLength) > 0
	}
	if !any {
		return nil
	}
	t := &Table{Head: []string{"policy"}}
	for _, b := range measure.PromptBuckets {
		t.Head = append(t.Head, b.Name+" n", b.Name+" TTFT p50/p90/p99 ms")
	}
	for i, s := range runs {
		row := []string{names[i]}
		for k := range measure.PromptBuckets {
			if k >= len(s.TTFTByPromptLength) || s.TTFTByPromptLength[k].Requests == 0 {
				row = append(row, "0", "-")
				continue
			}
			b := s.TTFTByPromptLength[k]
			row = append(row, strconv.Itoa(b.Requests), fmt.Sprintf("%.0f/%.0f/%.0f", b.TTFT.P50, b.TTFT.P90, b.TTFT.P99))
		}
		t.Rows = append(t.Rows, row)
	}
	return t
}

// referenceLine is WriteTable's last line: the runs' reference hit rates
// (Summary.PooledHitRate, InfiniteHitRate), one value when every run has
// the same (to 0.05 points), else one per run; without per-run values the
// report's. "" when there are none.
func (r Report) referenceLine() string {
	one := func(get func(measure.Summary) *float64, all *float64) string {
		var vals []string
		var first *float64
		same := true
		for _, s := range r.Runs {
			v := get(s)
			if v == nil {
				continue
			}
			if first == nil {
				first = v
			}
			same = same && math.Abs(*v-*first) < 0.0005
			vals = append(vals, fmt.Sprintf("%s %.1f", RunName(s), *v*100))
		}
		switch {
		case first == nil && all == nil:
			return ""
		case first == nil:
			return fmt.Sprintf("%.1f", *all*100)
		case same:
			return fmt.Sprintf("%.1f", *first*100)
		}
		return strings.Join(vals, ", ")
	}
	pooled := one(func(s measure.Summary) *float64 { return s.PooledHitRate }, r.PooledHitRate)
	inf := one(func(s measure.Summary) *float64 { return s.InfiniteHitRate }, r.InfiniteHitRate)
	tiered := one(func(s measure.Summary) *float64 { return s.PooledTieredHitRate }, nil)
	if pooled == "" && inf == "" {
		return ""
	}
	var parts []string
	if pooled != "" {
		parts = append(parts, "pooled cache (one engine with the fleet's KV capacity) "+pooled)
	}
	if tiered != "" {
		parts = append(parts, "pooled tiers (one cache with the fleet's GPU, host, disk and remote capacity) "+tiered)
	}
	if inf != "" {
		parts = append(parts, "infinite cache "+inf)
	}
	return "reference hit %: " + strings.Join(parts, ", ")
}

// lagCell is the table's lag column: the larger p99 in ms, "-" when
// unknown, marked BEHIND when the run fell behind its margin.
func lagCell(s measure.Summary) string {
	p99, ok := s.LagP99()
	switch {
	case !ok:
		return "-"
	case s.Behind:
		return fmt.Sprintf("%.0f BEHIND", p99)
	}
	return fmt.Sprintf("%.1f", p99)
}

// WriteLagWarnings writes one warning per run of r that fell behind its
// time scale (Summary.Behind), naming its lags and margin and what to do,
// and returns how many there were.
func (r Report) WriteLagWarnings(w io.Writer) (int, error) {
	n := 0
	for _, s := range r.Runs {
		if !s.Behind {
			continue
		}
		n++
		line := fmt.Sprintf("WARNING: %s fell behind its time scale by more than %.0f ms of engine time (p99):", s.Policy, s.MaxLagMs)
		if l := s.FleetLag; l != nil {
			line += fmt.Sprintf(" fleet step lag p50 %.1f, p99 %.0f, max %.0f ms;", l.P50, l.P99, l.Max)
		}
		if l := s.SendLag; l != nil {
			line += fmt.Sprintf(" client send lag p50 %.1f, p99 %.0f, max %.0f ms;", l.P50, l.P99, l.Max)
		}
		line += " its latencies measure this host's CPU, not the modelled hardware (lower --speedup, free the CPUs, or run --virtual)"
		if _, err := fmt.Fprintln(w, line); err != nil {
			return n, err
		}
	}
	return n, nil
}
