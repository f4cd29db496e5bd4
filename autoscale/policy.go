// Package autoscale is the scaling policy of a pool of engines: from the
// pool's signals at a time t (queue, requests in flight, saturation, ready,
// starting and stopping engines, arrival rate, TTFT against its target) to the
// number of engines the pool should run, stabilised as Kubernetes' Horizontal
// Pod Autoscaler stabilises its recommendations (scale up at once, scale down
// only to the highest recommendation of the last 5 minutes) and aware of cold
// starts (engines still starting count as capacity; nothing more is added
// for saturation while any is starting).
//
// It is pure: no I/O, no clock, no goroutines; time comes in as a
// time.Duration since an epoch of the caller's (simulated time in package
// virtual, time since the gateway started live), so the same Scaler runs
// live (the gateway's gauges and KEDA external scaler) and in virtual time
// (plan --autoscale). See README.md for the rules, their sources and the
// figures.
package autoscale

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// Defaults of Config's zero fields.
const (
	// DefaultTargetInFlight is the requests in flight per engine the policy
	// aims at when Config.TargetInFlight is 0: vLLM's scheduler runs up to
	// max_num_seqs (256) at once, but TTFT holds only well below it. With
	// the default profile (Llama-3.1-70B on 4×H100) on the Azure
	// conversation trace, 16 kept TTFT p90 at 388 ms with 3.8 engines on
	// average, 28 at 486 ms with 2.65 (virtual time, seed 0;
	// plan/README.md, "Autoscaling"): a conservative default; size it for
	// a workload with plan --autoscale.
	DefaultTargetInFlight = 16
	// DefaultKVThreshold and DefaultQueueThreshold are the saturation
	// thresholds of the Gateway API Inference Extension's saturation
	// detector (gateway-api-inference-extension
	// pkg/epp/saturationdetector/config.go: DefaultKVCacheUtilThreshold
	// 0.8, DefaultQueueDepthThreshold 5 waiting requests per endpoint),
	// which llm-d's workload variant autoscaler also defaults to
	// (docs/saturation-analyzer.md: kvCacheThreshold 0.80,
	// queueLengthThreshold 5).
	DefaultKVThreshold    = 0.8
	DefaultQueueThreshold = 5
	// DefaultDownWindow is the scale-down stabilisation window, and
	// DefaultUpPeriod, DefaultUpPercent, DefaultUpEngines, DefaultDownPeriod
	// and DefaultDownPercent the rate limits, of a HorizontalPodAutoscaler
	// without a behavior section (Kubernetes autoscaling/v2 HPAScalingRules:
	// scaleDown stabilizationWindowSeconds 300 with one policy of 100% per
	// 15 s; scaleUp stabilizationWindowSeconds 0 with policies 100% and
	// 4 pods per 15 s, selectPolicy Max; KEP-853 "configurable HPA scale
	// velocity").
	DefaultDownWindow  = 300 * time.Second
	DefaultUpPeriod    = 15 * time.Second
	DefaultUpPercent   = 100
	DefaultUpEngines   = 4
	DefaultDownPeriod  = 15 * time.Second
	DefaultDownPercent = 100
	// DefaultInterval is how often a live pool or a virtual fleet asks its
	// Scaler for a decision: the HPA controller's sync period
	// (--horizontal-pod-autoscaler-sync-period, 15 s).
	DefaultInterval = 15 * time.Second
	// DefaultRateWindow is the window of the arrival rate (Signals.
	// ArrivalRate): one minute, as Dynamo's planner averages the request
	// rate over its adjustment interval (60 s by default).
	DefaultRateWindow = time.Minute
	// MaxEngines bounds Config.Max.
	MaxEngines = 4096
)

// Config is a pool's scaling policy. Zero fields take the defaults above;
// Max must be set.
type Config struct {
	// Min and Max bound the desired engine count: 0 ≤ Min ≤ Max ≤
	// MaxEngines, Max ≥ 1. Min 0 lets an idle pool scale to zero (a
	// request then waits for an engine's start-up).
	Min, Max int
	// TargetInFlight is the requests per engine the pool should carry,
	// in flight at the engines or queued at the gateway for them
	// (Signals.InFlight + Signals.Queued): the concurrency at which one
	// engine still meets the TTFT and ITL targets, as Knative's and
	// KServe's concurrency target (default DefaultTargetInFlight;
	// negative: the load rule is off, e.g. for a rate-only policy).
	TargetInFlight float64
	// TargetRate, when positive, is the request rate one engine serves
	// within the targets (requests/s), so the pool needs
	// ⌈ArrivalRate / TargetRate⌉ engines: Dynamo's throughput-based
	// planner, which divides the predicted load by one engine's
	// throughput at the SLA from profiling (docs: planner-design.md,
	// "Scaling Algorithm"). 0: not used.
	TargetRate float64
	// KVThreshold and QueueThreshold mark the ready engines saturated
	// (mean KV-cache usage ≥ KVThreshold, or waiting requests per ready
	// engine ≥ QueueThreshold): the pool then wants one engine more than
	// it runs, unless engines are starting (defaults DefaultKVThreshold,
	// DefaultQueueThreshold; negative: off).
	KVThreshold    float64
	QueueThreshold float64
	// TTFTTarget, when positive, is the pool's TTFT target: an observed
	// TTFT (Signals.TTFT) above it wants one engine more than the pool runs,
	// unless engines are starting (Dynamo's SLA planner corrects its
	// estimate by actual/expected TTFT; this is its one-step form).
	TTFTTarget time.Duration
	// UpWindow and DownWindow are the stabilisation windows: the pool
	// scales up to the lowest recommendation of the last UpWindow (default
	// 0: at once) and down to the highest of the last DownWindow (default
	// DefaultDownWindow), as the HPA does. Negative: 0.
	UpWindow, DownWindow time.Duration
	// UpPeriod, UpPercent and UpEngines limit a scale-up: within any
	// UpPeriod the count rises to at most max(n × (1 + UpPercent/100),
	// n + UpEngines), n the count UpPeriod ago (the HPA's default
	// policies, selectPolicy Max). DownPeriod and DownPercent limit a
	// scale-down to DownPercent of n per DownPeriod.
	UpPeriod    time.Duration
	UpPercent   int
	UpEngines   int
	DownPeriod  time.Duration
	DownPercent int
	// ColdStart is how long an engine takes from start to ready (image
	// pull, weights load, warm-up). The policy itself needs only the
	// starting count; virtual fleets model the start-up with it (plan
	// --autoscale sets it from the profile's start-up model,
	// sim.GPUProfile.StartupPhases, unless cold_start= fixes it), and
	// Scaler uses it to bound how long a start is
	// trusted (an engine starting for over 3 × ColdStart no longer holds
	// back saturation scale-ups). 0: unknown.
	ColdStart time.Duration
}

// withDefaults returns c with its zero fields defaulted.
func (c Config) withDefaults() Config {
	if c.TargetInFlight == 0 {
		c.TargetInFlight = DefaultTargetInFlight
	}
	if c.KVThreshold == 0 {
		c.KVThreshold = DefaultKVThreshold
	}
	if c.QueueThreshold == 0 {
		c.QueueThreshold = DefaultQueueThreshold
	}
	if c.DownWindow == 0 {
		c.DownWindow = DefaultDownWindow
	}
	c.UpWindow, c.DownWindow = max(c.UpWindow, 0), max(c.DownWindow, 0)
	if c.UpPeriod == 0 {
		c.UpPeriod = DefaultUpPeriod
	}
	if c.UpPercent == 0 {
		c.UpPercent = DefaultUpPercent
	}
	if c.UpEngines == 0 {
		c.UpEngines = DefaultUpEngines
	}
	if c.DownPeriod == 0 {
		c.DownPeriod = DefaultDownPeriod
	}
	if c.DownPercent == 0 {
		c.DownPercent = DefaultDownPercent
	}
	return c
}

// Validate reports a configuration Scaler cannot run.
func (c Config) Validate() error {
	switch {
	case c.Max < 1 || c.Max > MaxEngines:
		return fmt.Errorf("autoscale: max %d engines (want 1..%d)", c.Max, MaxEngines)
	case c.Min < 0 || c.Min > c.Max:
		return fmt.Errorf("autoscale: min %d engines with max %d (want 0..max)", c.Min, c.Max)
	case math.IsNaN(c.TargetInFlight) || math.IsInf(c.TargetInFlight, 0):
		return fmt.Errorf("autoscale: target in flight %v (want > 0; negative: off)", c.TargetInFlight)
	case c.TargetRate < 0 || math.IsNaN(c.TargetRate) || math.IsInf(c.TargetRate, 0):
		return fmt.Errorf("autoscale: target rate %v req/s (want ≥ 0)", c.TargetRate)
	case math.IsNaN(c.KVThreshold) || c.KVThreshold > 1:
		return fmt.Errorf("autoscale: kv threshold %v (want ≤ 1; negative: off)", c.KVThreshold)
	case math.IsNaN(c.QueueThreshold):
		return errors.New("autoscale: queue threshold NaN")
	case c.TTFTTarget < 0, c.ColdStart < 0:
		return errors.New("autoscale: negative ttft target or cold start")
	case c.UpPeriod < 0, c.DownPeriod < 0, c.UpPercent < 0, c.UpEngines < 0, c.DownPercent < 0 || c.DownPercent > 100:
		return fmt.Errorf("autoscale: rate limits up %v %d%% %d engines, down %v %d%% (want periods ≥ 0, percents 0..100 down)",
			c.UpPeriod, c.UpPercent, c.UpEngines, c.DownPeriod, c.DownPercent)
	case c.UpWindow > time.Hour || c.DownWindow > time.Hour:
		// The HPA's bound (stabilizationWindowSeconds ≤ 3600).
		return fmt.Errorf("autoscale: stabilisation windows %v, %v (want ≤ 1h)", c.UpWindow, c.DownWindow)
	}
	return nil
}

// Signals are one pool's state at the time of a decision.
type Signals struct {
	// Queued is the requests waiting at the gateway for the pool: its
	// admission queue and the requests held while no engine is ready.
	Queued int
	// InFlight is the requests sent to the pool's engines and not
	// finished (the engines' running and waiting requests).
	InFlight int
	// Waiting is the engines' own waiting queues, summed over the ready
	// engines (vLLM's vllm:num_requests_waiting, scraped); part of
	// InFlight.
	Waiting int
	// KVUtil is the ready engines' mean KV-cache usage, 0..1 (vLLM's
	// vllm:kv_cache_usage_perc).
	KVUtil float64
	// Ready, Starting and Stopping count the pool's engines: in rotation;
	// started but not yet ready (loading: /health answers 503); leaving
	// (draining their requests, routed nothing new).
	Ready, Starting, Stopping int
	// ArrivalRate is the requests per second that arrived over the recent
	// window (RateWindow).
	ArrivalRate float64
	// TTFT is a recent TTFT quantile of the pool (e.g. p90 over the last
	// interval); 0 when unknown.
	TTFT time.Duration
}

// Reason says which rule set a recommendation (Decision.Reason).
type Reason uint8

const (
	ReasonMin        Reason = iota // nothing needs more than Min
	ReasonLoad                     // ⌈(in flight + queued) / TargetInFlight⌉
	ReasonRate                     // ⌈arrival rate / TargetRate⌉
	ReasonSaturated                // KV or queue saturation: one more than running
	ReasonTTFT                     // TTFT over its target: one more than running
	ReasonActivation               // a request waits or arrives: at least one engine
	ReasonMax                      // capped at Max
)

var reasonNames = [...]string{"min", "load", "rate", "saturated", "ttft", "activation", "max"}

// String is the reason's name (e.g. "load").
func (r Reason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return "reason(" + strconv.Itoa(int(r)) + ")"
}

// Recommend is the policy's unstabilised recommendation for s: the most
// engines any rule asks for, within [Min, Max], and the rule that set it.
// Engines still starting count as capacity (Ready + Starting is what the
// pool runs), and while any is starting the saturation and TTFT rules add
// nothing: their engine is on its way (Dynamo's load planner likewise
// blocks adjustment while workers are being added, docs/architecture/
// load_planner.md; llm-d's saturation analyzer counts pending replicas).
func (c Config) Recommend(s Signals) (int, Reason) {
	c = c.withDefaults()
	running := s.Ready + s.Starting
	n, why := c.Min, ReasonMin
	up := func(k int, r Reason) {
		if k > n {
			n, why = k, r
		}
	}
	load := max(s.InFlight, 0) + max(s.Queued, 0)
	if c.TargetInFlight > 0 {
		up(ceilDiv(float64(load), c.TargetInFlight), ReasonLoad)
	}
	if c.TargetRate > 0 && s.ArrivalRate > 0 {
		up(ceilDiv(s.ArrivalRate, c.TargetRate), ReasonRate)
	}
	if s.Starting == 0 && s.Ready > 0 {
		if (c.KVThreshold >= 0 && s.KVUtil >= c.KVThreshold) ||
			(c.QueueThreshold >= 0 && float64(s.Waiting) >= c.QueueThreshold*float64(s.Ready)) {
			up(running+1, ReasonSaturated)
		}
		if c.TTFTTarget > 0 && s.TTFT > c.TTFTTarget && load > 0 {
			up(running+1, ReasonTTFT)
		}
	}
	if load > 0 || s.ArrivalRate > 0 {
		up(1, ReasonActivation)
	}
	if n > c.Max {
		n, why = c.Max, ReasonMax
	}
	return n, why
}

// ceilDiv is ⌈a / b⌉ for a ≥ 0, b > 0, capped at MaxEngines+1.
func ceilDiv(a, b float64) int {
	q := math.Ceil(a/b - 1e-9)
	if q > MaxEngines+1 || math.IsNaN(q) {
		return MaxEngines + 1
	}
	return int(max(q, 0))
}

// ParseConfig reads a policy from a comma-separated key=value list, the
// spelling of plan's --autoscale flag and of the gateway's
// autoscale.policy, e.g. "min=0,max=8,target=16,cold_start=90s":
//
//	min, max             engines (max required)
//	target               TargetInFlight (requests per engine; "off": no load rule)
//	rate                 TargetRate (requests/s per engine)
//	kv, queue            KVThreshold (0..1), QueueThreshold (waiting per engine); -1 off
//	ttft                 TTFTTarget (a duration)
//	up_window, down_window, up_period, down_period, cold_start   durations
//	up_percent, up_engines, down_percent                          integers
//
// Keys it does not know are returned in rest, in order, for the caller's
// own (plan's interval, hold_ttl).
func ParseConfig(spec string) (c Config, rest []string, err error) {
	if strings.TrimSpace(spec) == "" {
		return c, nil, errors.New("autoscale: empty policy (want e.g. min=0,max=8)")
	}
	seen := map[string]bool{}
	for item := range strings.SplitSeq(spec, ",") {
		item = strings.TrimSpace(item)
		k, v, ok := strings.Cut(item, "=")
		if !ok || k == "" || v == "" {
			return c, nil, fmt.Errorf("autoscale: item %q: want key=value", item)
		}
		if seen[k] {
			return c, nil, fmt.Errorf("autoscale: %s given twice", k)
		}
		seen[k] = true
		var err error
		switch k {
		case "min":
			c.Min, err = strconv.Atoi(v)
		case "max":
			c.Max, err = strconv.Atoi(v)
		case "target":
			if v == "off" {
				c.TargetInFlight = -1
				break
			}
			c.TargetInFlight, err = positive(v)
		case "rate":
			c.TargetRate, err = positive(v)
		case "kv":
			c.KVThreshold, err = strconv.ParseFloat(v, 64)
		case "queue":
			c.QueueThreshold, err = strconv.ParseFloat(v, 64)
		case "ttft":
			c.TTFTTarget, err = time.ParseDuration(v)
		case "up_window":
			c.UpWindow, err = window(v)
		case "down_window":
			c.DownWindow, err = window(v)
		case "up_period":
			c.UpPeriod, err = time.ParseDuration(v)
		case "down_period":
			c.DownPeriod, err = time.ParseDuration(v)
		case "cold_start":
			c.ColdStart, err = time.ParseDuration(v)
		case "up_percent":
			c.UpPercent, err = strconv.Atoi(v)
		case "up_engines":
			c.UpEngines, err = strconv.Atoi(v)
		case "down_percent":
			c.DownPercent, err = strconv.Atoi(v)
		default:
			rest = append(rest, item)
			continue
		}
		if err != nil {
			return c, nil, fmt.Errorf("autoscale: %s=%s: %w", k, v, err)
		}
	}
	if !seen["max"] {
		return c, nil, errors.New("autoscale: max is required (e.g. min=0,max=8)")
	}
	return c, rest, c.Validate()
}

// window parses a stabilisation window; "0" or "0s" is kept as "none"
// (negative), since a zero Config field means the default.
func window(v string) (time.Duration, error) {
	d, err := time.ParseDuration(v)
	if err == nil && d == 0 {
		d = -1
	}
	return d, err
}

func positive(v string) (float64, error) {
	x, err := strconv.ParseFloat(v, 64)
	if err == nil && !(x > 0 && x < math.Inf(1)) {
		err = errors.New("want a positive number")
	}
	return x, err
}
