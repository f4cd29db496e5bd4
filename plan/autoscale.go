package plan

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/infergate/infergate/autoscale"
	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/virtual"
)

// Burst detection (BurstMask): a request is in a burst when it arrives in
// a BurstWindow-long window of the trace whose arrival count is at least
// BurstFactor × the run's mean per window.
const (
	BurstWindow = time.Minute
	BurstFactor = 1.25
)

// Autoscale adds one autoscaled run per policy to a sweep (Options.
// Autoscale): an aggregated fleet of at most Policy.Max engines that starts
// and stops engines as the autoscale.Scaler decides, in virtual time, with
// modelled cold starts (virtual.Autoscale), compared with the smallest
// static fleet of the sweep that meets the SLO with the same policy.
type Autoscale struct {
	virtual.Autoscale
	// Spec is the policy as given (--autoscale), for the report.
	Spec string
}

// ParseAutoscale reads plan's --autoscale value: autoscale.ParseConfig's
// keys (min, max, target, rate, kv, queue, ttft, windows, rate limits,
// cold_start) and plan's own: interval (the decisions' period), hold_ttl
// (how long a request waits for an engine when none is ready; 0 or absent:
// until one is) and initial (engines ready at 0; default min, "0" from
// zero). cold_start is the start-up time until the simulator's start-up
// model replaces it (virtual.Autoscale.StartUp is the seam); default 90s.
func ParseAutoscale(spec string) (*Autoscale, error) {
	c, rest, err := autoscale.ParseConfig(spec)
	if err != nil {
		return nil, err
	}
	a := &Autoscale{Spec: spec}
	a.Policy = c
	for _, item := range rest {
		k, v, _ := strings.Cut(item, "=")
		switch k {
		case "interval", "hold_ttl":
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 {
				return nil, fmt.Errorf("autoscale: %s=%s: want a duration ≥ 0", k, v)
			}
			if k == "interval" {
				a.Interval = d
			} else {
				a.HoldTTL = d
			}
		case "initial":
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 || n > c.Max {
				return nil, fmt.Errorf("autoscale: initial=%s: want 0..max (%d)", v, c.Max)
			}
			a.Initial = n
			if n == 0 {
				a.Initial = -1 // from zero, whatever min is
			}
		default:
			return nil, fmt.Errorf("autoscale: unknown key %q (want min, max, target, rate, kv, queue, ttft, up_window, down_window, up_period, down_period, up_percent, up_engines, down_percent, cold_start, interval, hold_ttl, initial)", k)
		}
	}
	if a.Policy.ColdStart == 0 {
		a.Policy.ColdStart = DefaultColdStart
	}
	return a, nil
}

// DefaultColdStart is the start-up time of an autoscaled engine when the
// spec gives none: 90 s, between a warm node (weights in the page cache,
// the image present) and SageMaker's 258 s with container caching for
// Qwen3-8B (issue 20).
const DefaultColdStart = 90 * time.Second

// ScaleRow is what an autoscaled run adds to its Row.
type ScaleRow struct {
	virtual.ScaleStats
	// Min and Max are the policy's bounds.
	Min int `json:"min"`
	Max int `json:"max"`
	// ColdStartS is the modelled start-up time (s).
	ColdStartS float64 `json:"cold_start_s"`
}

// Comparison sets an autoscaled run against the best static fleet of the
// same policy: the smallest swept size meeting the SLO.
type Comparison struct {
	Policy string `json:"policy"`
	// Row is the autoscaled run's index in Result.Rows; Static the static
	// run's (-1: no swept size meets the SLO).
	Row    int `json:"row"`
	Static int `json:"static_row"`
	// GPUHours and StaticGPUHours are the two fleets' GPU-hours; Saving
	// is 1 − GPUHours / StaticGPUHours (0 without a static fleet).
	GPUHours       float64 `json:"gpu_hours"`
	StaticGPUHours float64 `json:"static_gpu_hours,omitempty"`
	Saving         float64 `json:"saving,omitempty"`
	// MeetsSLO is the autoscaled run's verdict.
	MeetsSLO bool `json:"meets_slo"`
}

// BurstMask marks the records that arrive in a burst (BurstWindow,
// BurstFactor), by their ArrivalMs.
func BurstMask(recs []measure.Record) []bool {
	mask := make([]bool, len(recs))
	if len(recs) == 0 {
		return mask
	}
	w := float64(BurstWindow / time.Millisecond)
	last := 0.0
	for i := range recs {
		last = max(last, recs[i].ArrivalMs)
	}
	bins := int(last/w) + 1
	counts := make([]int, bins)
	for i := range recs {
		counts[int(recs[i].ArrivalMs/w)]++
	}
	// The mean over the trace's span (the last, partial window weighed by
	// its length).
	span := max(last/w, 1)
	mean := float64(len(recs)) / span
	for i := range recs {
		mask[i] = float64(counts[int(recs[i].ArrivalMs/w)]) >= BurstFactor*mean
	}
	return mask
}

// burstTTFT is the TTFT distribution of the successful measured records in
// bursts (ms) and their count.
func burstTTFT(recs []measure.Record) (measure.Latency, int) {
	mask := BurstMask(recs)
	var xs []float64
	for i := range recs {
		r := &recs[i]
		if mask[i] && !r.Warmup && r.Status == 200 && r.Error == "" {
			xs = append(xs, r.TTFTMs)
		}
	}
	return measure.NewLatency(xs), len(xs)
}

// compare fills res.Autoscale from its rows.
func (res *Result) compare() {
	res.Autoscale = nil
	for k := range res.Rows {
		a := &res.Rows[k]
		if a.Scale == nil {
			continue
		}
		c := Comparison{Policy: a.Policy, Row: k, Static: -1, GPUHours: a.GPUHours, MeetsSLO: a.MeetsSLO}
		for j := range res.Rows {
			s := &res.Rows[j]
			if s.Scale != nil || s.Policy != a.Policy || s.PD.Prefill != 0 || !s.MeetsSLO {
				continue
			}
			if c.Static < 0 || s.Engines < res.Rows[c.Static].Engines {
				c.Static = j
			}
		}
		if c.Static >= 0 {
			c.StaticGPUHours = res.Rows[c.Static].GPUHours
			if c.StaticGPUHours > 0 {
				c.Saving = 1 - c.GPUHours/c.StaticGPUHours
			}
		}
		res.Autoscale = append(res.Autoscale, c)
	}
}

// writeAutoscale writes the comparison lines of WriteTable.
func (res *Result) writeAutoscale(w io.Writer) error {
	for _, c := range res.Autoscale {
		a := &res.Rows[c.Row]
		s := a.Scale
		verdict := "meets the SLO"
		if !a.MeetsSLO {
			verdict = "misses the SLO"
		}
		if _, err := fmt.Fprintf(w, "\nautoscaled %s (%s; cold start %s): %s; GPU-hours %.2f (engines %d..%d, peak %d, %d started, %d stopped, utilisation %s)\n",
			a.Policy, res.AutoscaleSpec, time.Duration(s.ColdStartS*float64(time.Second)), verdict, c.GPUHours,
			s.Min, s.Max, s.PeakEngines, s.Started, s.Stopped, fmtUtil(a.Summary.MeanEngineUtilization)); err != nil {
			return err
		}
		if _, err := fmt.Fprintf(w, "  TTFT p50/p90/p99 %s/%s/%s, in bursts (%d requests) %s/%s/%s; held %d (longest %s), dropped %d\n",
			fmtMs(a.Summary.TTFT.P50), fmtMs(a.Summary.TTFT.P90), fmtMs(a.Summary.TTFT.P99), a.BurstRequests,
			fmtMs(a.BurstTTFT.P50), fmtMs(a.BurstTTFT.P90), fmtMs(a.BurstTTFT.P99),
			s.Held, s.MaxHeldWait.Round(time.Millisecond), s.Dropped); err != nil {
			return err
		}
		if c.Static < 0 {
			if _, err := fmt.Fprintf(w, "  no static %s fleet in the sweep meets the SLO: nothing to compare with (sweep larger sizes)\n", a.Policy); err != nil {
				return err
			}
			continue
		}
		st := &res.Rows[c.Static]
		if _, err := fmt.Fprintf(w, "  best static fleet: %d engines, GPU-hours %.2f, TTFT p90 %s, in bursts %s; autoscaled saves %.1f%% of GPU-hours\n",
			st.Engines, c.StaticGPUHours, fmtMs(st.Summary.TTFT.P90), fmtMs(st.BurstTTFT.P90), c.Saving*100); err != nil {
			return err
		}
	}
	return nil
}

// gpuHours is engine-seconds × GPUs per engine in hours.
func gpuHours(engineSeconds float64, tp int) float64 {
	return engineSeconds * float64(max(tp, 1)) / 3600
}

// ColdStartOrPolicy is the modelled start-up time: ColdStart, else the
// policy's.
func (a *Autoscale) ColdStartOrPolicy() time.Duration {
	if a.ColdStart > 0 {
		return a.ColdStart
	}
	return a.Policy.ColdStart
}
