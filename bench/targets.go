package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"sort"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/infergate/infergate/measure"
)

// TargetOutcome is how one target's requests of a replay dealt over
// several targets (ReplayOptions.Targets) ended.
type TargetOutcome struct {
	// Target is the base URL (redacted), as in measure.Record.Target.
	Target string `json:"target"`
	// Sent and OK count its requests and those that succeeded.
	Sent int `json:"sent"`
	OK   int `json:"ok"`
	// NoResponse: failed before any HTTP status arrived (connection
	// refused or reset: an explicit transport error at the client).
	NoResponse int `json:"no_response"`
	// Broken: answered 200, then the stream ended without [DONE] or with
	// an error event (a connection cut mid-stream).
	Broken int `json:"broken"`
	// Status: answered with a non-200 status (an OpenAI error body).
	Status int `json:"status"`
	// Cancelled: still unanswered when the replay's context ended (a
	// request that hung); counted apart from the three explicit kinds.
	Cancelled int `json:"cancelled"`
	// Stalled: no response header, or a stream silent, past Replay's
	// bounds (ReplayOptions.HeaderTimeout, IdleTimeout): a target that
	// hung while the replay went on.
	Stalled int `json:"stalled"`
	// FirstError is the first failure's message, "" when none failed.
	FirstError string `json:"first_error,omitempty"`
}

// Failed is the number of its requests that failed, of any kind.
func (o TargetOutcome) Failed() int { return o.Sent - o.OK }

// TargetOutcomes groups recs by measure.Record.Target, in the order of
// targets (redacted as Replay records them), and classifies each failure.
// Records with a target not in targets are counted under a trailing entry
// of that name.
func TargetOutcomes(targets []string, recs []measure.Record) []TargetOutcome {
	out := make([]TargetOutcome, len(targets))
	at := make(map[string]int, len(targets))
	for k, t := range targets {
		out[k].Target = measure.RedactText(t)
		at[out[k].Target] = k
	}
	for i := range recs {
		r := &recs[i]
		k, ok := at[r.Target]
		if !ok {
			k = len(out)
			at[r.Target] = k
			out = append(out, TargetOutcome{Target: r.Target})
		}
		o := &out[k]
		o.Sent++
		switch {
		case r.Error == "":
			o.OK++
			continue
		case strings.HasPrefix(r.Error, errStalled.Error()):
			o.Stalled++
		case strings.Contains(r.Error, context.Canceled.Error()) || strings.Contains(r.Error, context.DeadlineExceeded.Error()):
			o.Cancelled++
		case r.Status == 0:
			o.NoResponse++
		case r.Status == http.StatusOK:
			o.Broken++
		default:
			o.Status++
		}
		if o.FirstError == "" {
			o.FirstError = r.Error
		}
	}
	return out
}

// WriteTargetOutcomes prints outcomes as a table, one line per target.
func WriteTargetOutcomes(w io.Writer, outcomes []TargetOutcome) error {
	if _, err := fmt.Fprintf(w, "%-28s %6s %6s %8s %6s %6s %9s %7s\n", "target", "sent", "ok", "no-resp", "broken", "status", "cancelled", "stalled"); err != nil {
		return err
	}
	for _, o := range outcomes {
		if _, err := fmt.Fprintf(w, "%-28s %6d %6d %8d %6d %6d %9d %7d\n", o.Target, o.Sent, o.OK, o.NoResponse, o.Broken, o.Status, o.Cancelled, o.Stalled); err != nil {
			return err
		}
	}
	return nil
}

// stepLagMetric is the simulated engine's step-lag histogram
// (simserver/metrics.go), in engine seconds.
const stepLagMetric = "infergate_sim_step_lag_seconds"

// maxMetricsPage bounds one engine's metrics page (bytes).
const maxMetricsPage = 8 << 20

// ScrapeStepLag reads infergate_sim_step_lag_seconds from the /metrics
// page of each engine (base URLs of `infergate sim` processes), adds up
// their histograms and returns the fleet's step lag (ms of engine time):
// the number of steps, and the p50, p99 and maximum read from the merged
// buckets as the upper bound of the bucket the quantile falls in (the
// buckets run from 0.1 ms to 60 s, so a figure is "at most"; a quantile
// past the last bound reads as that bound). It is the live-process
// counterpart of simserver.Fleet.Lag, which an in-process fleet measures
// exactly; nil, with no error, when no step ran.
func ScrapeStepLag(ctx context.Context, client *http.Client, engines []string) (*measure.Lag, error) {
	merged := map[float64]uint64{} // upper bound → cumulative count
	var total uint64
	for _, e := range engines {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(e, "/")+"/metrics", nil)
		if err != nil {
			return nil, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, fmt.Errorf("bench: step lag of %s: %w", measure.RedactText(e), err)
		}
		p := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := p.TextToMetricFamilies(io.LimitReader(resp.Body, maxMetricsPage))
		resp.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("bench: step lag of %s: %w", measure.RedactText(e), err)
		}
		fam, ok := fams[stepLagMetric]
		if !ok || fam.GetType() != dto.MetricType_HISTOGRAM {
			return nil, fmt.Errorf("bench: %s has no %s histogram (not an infergate sim?)", measure.RedactText(e), stepLagMetric)
		}
		for _, m := range fam.GetMetric() {
			h := m.GetHistogram()
			total += h.GetSampleCount()
			for _, b := range h.GetBucket() {
				merged[b.GetUpperBound()] += b.GetCumulativeCount()
			}
		}
	}
	if total == 0 {
		return nil, nil
	}
	bounds := make([]float64, 0, len(merged))
	for b := range merged {
		bounds = append(bounds, b)
	}
	sort.Float64s(bounds)
	quantile := func(q float64) float64 {
		rank := uint64(math.Ceil(q * float64(total)))
		for _, b := range bounds {
			if merged[b] >= rank && !math.IsInf(b, 1) {
				return b * 1000
			}
		}
		// Past the last finite bound.
		for k := len(bounds) - 1; k >= 0; k-- {
			if !math.IsInf(bounds[k], 1) {
				return bounds[k] * 1000
			}
		}
		return math.Inf(1)
	}
	return &measure.Lag{Samples: int64(total), P50: quantile(0.5), P99: quantile(0.99), Max: quantile(1)}, nil
}
