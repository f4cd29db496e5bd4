package plan

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/infergate/infergate/autoscale"
	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/sim"
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
	// Startup is where a starting engine reads its weights and whether its
	// image is on the node (spec keys startup= and image_cached=; default
	// DefaultStartup, as `up --engines MIN..MAX`): the input of the
	// profile's start-up model (sim.GPUProfile.StartupPhases), which gives
	// the cold start unless cold_start= overrides it.
	Startup sim.StartupInput
	// Phases is the modelled cold start per phase (set by Run from the
	// engine profile; nil: cold_start= was given, or the profile has no
	// start-up model and DefaultColdStart stands in).
	Phases *sim.StartupPhases
	// fixedColdStart: cold_start= was given.
	fixedColdStart bool
	// cache is the nodes' artifact caches' declared state (spec key
	// cache=; nil: none, every start from Startup.Source), with
	// enginesPerNode (engines_per_node=) and peers (peers=).
	cache          *virtual.CacheState
	enginesPerNode int
	peers          bool
}

// DefaultStartup is the start-up model's input when the spec names none:
// weights from the host's page cache, the image on the node (a warm node;
// `up`'s --startup-source and --image-cached defaults).
var DefaultStartup = sim.StartupInput{Source: sim.SourcePageCache, ImageCached: true}

// resolveColdStart sets the cold start from the profile's start-up model
// (prof, defaults applied) unless cold_start= fixed it: Policy.ColdStart
// (what the Scaler and the virtual fleet use) and Phases. A profile
// without a start-up model keeps DefaultColdStart.
func (a *Autoscale) resolveColdStart(prof sim.GPUProfile) error {
	if a.fixedColdStart {
		return nil
	}
	a.ColdStart, a.StartUp, a.Caches = 0, nil, nil
	in := a.Startup
	if a.cache != nil {
		// Each start reads through its node's cache (virtual.NodeCaches);
		// the policy's cold-start estimate is a first start on a node in
		// the declared state.
		a.Caches = &virtual.NodeCaches{Profile: prof, Blobs: virtual.ModelBlobs(prof.Model, int64(prof.WeightBytes())),
			EnginesPerNode: a.enginesPerNode, State: *a.cache, Peers: a.peers, ImageCached: a.Startup.ImageCached}
		in.Source = map[virtual.CacheState]sim.WeightSource{virtual.CacheCold: sim.SourceRemote,
			virtual.CacheDisk: sim.SourceNVMe, virtual.CacheWarm: sim.SourcePageCache}[*a.cache]
	}
	ph, err := prof.StartupPhases(in)
	if errors.Is(err, sim.ErrNoStartupModel) {
		if a.cache != nil {
			return fmt.Errorf("autoscale: cache=%s: profile %s has no start-up model (YAML startup)", a.cache, prof.Name)
		}
		a.Policy.ColdStart, a.Phases = DefaultColdStart, nil
		return nil
	}
	if err != nil {
		return fmt.Errorf("autoscale: startup=%s: %w", a.Startup.Source, err)
	}
	a.Policy.ColdStart, a.Phases = ph.Total(), &ph
	return nil
}

// ParseAutoscale reads plan's --autoscale value: autoscale.ParseConfig's
// keys (min, max, target, rate, kv, queue, ttft, windows, rate limits,
// cold_start) and plan's own: interval (the decisions' period), hold_ttl
// (how long a request waits for an engine when none is ready; 0 or absent:
// until one is), initial (engines ready at 0; default min, "0" from
// zero), startup (the weights' source: remote, nvme, page_cache or peer;
// default page_cache) and image_cached (true or false; default true). The
// cold start is the engine profile's modelled start-up from that source
// (sim/startup.go; Run resolves it); cold_start= fixes it instead. cache=
// (cold, disk or warm) reads every start through its node's artifact cache
// instead of startup= (virtual.NodeCaches: the nodes start in that state,
// a node holds the model after its first start and its page cache what its
// engines read), with engines_per_node= (default 1) and peers= (true: a
// node fetches from another node's cache before the origin; default
// false).
func ParseAutoscale(spec string) (*Autoscale, error) {
	c, rest, err := autoscale.ParseConfig(spec)
	if err != nil {
		return nil, err
	}
	a := &Autoscale{Spec: spec, Startup: DefaultStartup, fixedColdStart: c.ColdStart > 0}
	a.Policy = c
	for _, item := range rest {
		k, v, _ := strings.Cut(item, "=")
		switch k {
		case "startup":
			src, err := sim.ParseWeightSource(v)
			if err != nil {
				return nil, fmt.Errorf("autoscale: startup=%s: %w", v, err)
			}
			a.Startup.Source = src
		case "image_cached":
			b, err := strconv.ParseBool(v)
			if err != nil {
				return nil, fmt.Errorf("autoscale: image_cached=%s: want true or false", v)
			}
			a.Startup.ImageCached = b
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
		case "cache":
			st, err := virtual.ParseCacheState(v)
			if err != nil {
				return nil, fmt.Errorf("autoscale: cache=%s: %w", v, err)
			}
			a.cache = &st
		case "engines_per_node":
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				return nil, fmt.Errorf("autoscale: engines_per_node=%s: want an integer ≥ 1", v)
			}
			a.enginesPerNode = n
		case "peers":
			b, err := strconv.ParseBool(v)
			if err != nil {
				return nil, fmt.Errorf("autoscale: peers=%s: want true or false", v)
			}
			a.peers = b
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
			return nil, fmt.Errorf("autoscale: unknown key %q (want min, max, target, rate, kv, queue, ttft, up_window, down_window, up_period, down_period, up_percent, up_engines, down_percent, cold_start, interval, hold_ttl, initial, startup, image_cached, cache, engines_per_node, peers)", k)
		}
	}
	if a.fixedColdStart && (strings.Contains(","+spec, ",startup=") || strings.Contains(","+spec, ",image_cached=")) {
		return nil, errors.New("autoscale: cold_start= fixes the start-up time; startup= and image_cached= choose the modelled one: give one")
	}
	if a.cache != nil && (a.fixedColdStart || strings.Contains(","+spec, ",startup=")) {
		return nil, errors.New("autoscale: cache= reads each start through the node caches; cold_start= and startup= fix one source: give one")
	}
	if a.cache == nil && (strings.Contains(","+spec, ",engines_per_node=") || strings.Contains(","+spec, ",peers=")) {
		return nil, errors.New("autoscale: engines_per_node= and peers= need cache=")
	}
	if a.Policy.ColdStart == 0 {
		a.Policy.ColdStart = DefaultColdStart // until Run resolves the profile's model
	}
	return a, nil
}

// DefaultColdStart is the start-up time of an autoscaled engine whose
// profile has no start-up model (YAML startup) and whose spec gives no
// cold_start: 90 s, between a warm node (weights in the page cache, the
// image present) and SageMaker's 258 s with container caching for
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
	// Startup is the weights' source of the start-up model and
	// ImageCached its image input, with the phases (s) it gave: image
	// pull, weights read, warm-up. Empty when cold_start= fixed it.
	Startup string `json:"startup,omitempty"`
	// Cache is the nodes' artifact caches' declared state (cache=; empty
	// without): Startup is then a first start's on such a node, and
	// ScaleStats.StartsBySource says where every start read from.
	Cache       string  `json:"cache,omitempty"`
	ImageCached bool    `json:"image_cached,omitempty"`
	ImagePullS  float64 `json:"image_pull_s,omitempty"`
	WeightsS    float64 `json:"weights_load_s,omitempty"`
	WarmUpS     float64 `json:"warm_up_s,omitempty"`
}

// coldStartLabel is the report's description of a cold start: the
// phases of the modelled one, or "fixed".
func (s *ScaleRow) coldStartLabel() string {
	cs := time.Duration(s.ColdStartS * float64(time.Second)).Round(100 * time.Millisecond)
	if s.Startup == "" {
		return fmt.Sprintf("cold start %s, fixed", cs)
	}
	img := "image pulled"
	if s.ImageCached {
		img = "image cached"
	}
	label := fmt.Sprintf("cold start %s modelled: weights from %s, %s: image pull %.1fs + weights %.1fs + warm-up %.1fs",
		cs, s.Startup, img, s.ImagePullS, s.WeightsS, s.WarmUpS)
	if s.Cache != "" {
		srcs := make([]string, 0, len(s.StartsBySource))
		for _, src := range sim.WeightSources() {
			if n := s.StartsBySource[string(src)]; n > 0 {
				srcs = append(srcs, fmt.Sprintf("%s %d", src, n))
			}
		}
		label = fmt.Sprintf("through node caches, %s at start (first start: %s); starts by source: %s", s.Cache, label, strings.Join(srcs, ", "))
	}
	return label
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
		if _, err := fmt.Fprintf(w, "\nautoscaled %s (%s; %s): %s; GPU-hours %.2f (engines %d..%d, peak %d, %d started, %d stopped, utilisation %s)\n",
			a.Policy, res.AutoscaleSpec, s.coldStartLabel(), verdict, c.GPUHours,
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
