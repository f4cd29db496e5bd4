// Package plan sizes a fleet for a trace: it replays the trace in virtual
// time (virtual.Replay: the same engine model and the same sched
// policies as the live gateway, with no network and no sleeping) once per
// fleet size and routing policy, judges every run against a service-level
// objective, and recommends the smallest fleet that meets it, with the best
// policy at that size. See README.md for the method and its caveats.
//
// Latencies are milliseconds and durations seconds of simulated engine time,
// as in package measure; wall times are real seconds.
package plan

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/report"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
	"github.com/infergate/infergate/virtual"
)

// ErrNoFleet is returned by Result.Err when no swept fleet meets the SLO.
var ErrNoFleet = errors.New("no fleet in range meets the SLO")

// Options configures Run.
type Options struct {
	// Records are the trace's requests, in arrival order.
	Records []trace.Record
	// Requests limits every run to the first Requests records (0: all).
	Requests int
	// Engines are the fleet sizes to sweep (see ParseEngines), at least one.
	Engines []int
	// Policies are the routing policies to sweep (sched.Names), at least one;
	// their order breaks ties in the recommendation.
	Policies []string
	// Engine is the engine model of every engine (zero: sim's defaults),
	// its host and disk KV tiers (Engine.Tiers) included.
	Engine sim.Config
	// Remote is the size of the fleet's shared remote KV tier (one store
	// whatever the fleet size; zero: none).
	Remote sim.TierSize
	// Model is the served model name, which seeds routing hashes (default:
	// the engine profile's model).
	Model string
	// Routing tunes the policies (its Policy field is set per run).
	Routing sched.Config
	// Seed seeds the engines and the policies' tie-breaking, as in
	// virtual.ReplayOptions; every run uses the same seed.
	Seed int64
	// Warmup excludes every run's warm-up requests from its Summary and
	// goodput (see measure.Warmup).
	Warmup measure.Warmup
	// SLO is the objective every run is judged against.
	SLO SLO
	// Workers is how many runs proceed at once (0: GOMAXPROCS). Each run is
	// single-goroutine, so more workers than cores only adds memory.
	Workers int
	// Progress, if set, is called once per finished run, from one goroutine
	// at a time, in completion order.
	Progress func(Row)
	// PD are the P/D splits to sweep at every fleet size (nil: aggregated
	// only, as {Prefill: 0}). A variant whose Prefill is not below a fleet
	// size is skipped at that size.
	PD []PDVariant
	// NoReferences skips the reference hit rates (Summary.PooledHitRate,
	// InfiniteHitRate): the pooled cache costs about one prefix-policy run
	// per fleet size.
	NoReferences bool
	// MaxMemory bounds the sweep's estimated peak memory (bytes; 0:
	// DefaultMaxMemory, half the machine's): a sweep estimated over it is
	// refused before any run (memory.go: workers × (engines × each
	// engine's KV block pool + the prefix index's blocks)).
	MaxMemory int64
	// Autoscale, when set, adds one autoscaled run per policy (an
	// aggregated fleet of at most Autoscale.Policy.Max engines; autoscale.go)
	// and compares each with the smallest static size meeting the SLO.
	Autoscale *Autoscale
}

// PDVariant is one P/D configuration of a sweep: Prefill of a fleet's
// engines prefill, the rest decode (virtual.Config.Prefill), decided with
// Threshold and Local (sched.PDConfig; zero values take its defaults).
// Prefill 0 is the aggregated fleet.
type PDVariant struct {
	Prefill   int    `json:"prefill,omitempty"`
	Threshold int    `json:"pd_threshold,omitempty"`
	Local     string `json:"pd_local,omitempty"`
	// Busy is the decider's routing.pd.prefill_busy ("" keeps Routing's).
	Busy string `json:"pd_busy,omitempty"`
	// DecodeBudget is the decode engines' token budget
	// (sim.PDConfig.DecodeMaxNumBatchedTokens; 0 keeps Engine's).
	DecodeBudget int `json:"pd_decode_budget,omitempty"`
}

// Label is "" for the aggregated fleet, else e.g. "3P t2048" (with
// " local=any" when it is set).
func (v PDVariant) Label() string {
	if v.Prefill == 0 {
		return ""
	}
	l := fmt.Sprintf("%dP", v.Prefill)
	if v.Threshold != 0 {
		l += fmt.Sprintf(" t%d", v.Threshold)
	}
	if v.Local != "" {
		l += " local=" + v.Local
	}
	if v.Busy != "" {
		l += " busy=" + v.Busy
	}
	if v.DecodeBudget != 0 {
		l += fmt.Sprintf(" Db%d", v.DecodeBudget)
	}
	return l
}

// combo is one run of a sweep.
type combo struct {
	engines int
	policy  string
	pd      PDVariant
	auto    bool // autoscaled (Options.Autoscale), engines its most
}

// combos lists the runs of opts: by fleet size, then policy, then P/D
// variant, in the given orders.
func combos(opts Options) []combo {
	pds := opts.PD
	if len(pds) == 0 {
		pds = []PDVariant{{}}
	}
	var out []combo
	for _, n := range opts.Engines {
		for _, p := range opts.Policies {
			for _, v := range pds {
				if v.Prefill < n {
					out = append(out, combo{engines: n, policy: p, pd: v})
				}
			}
		}
	}
	if a := opts.Autoscale; a != nil {
		for _, p := range opts.Policies {
			out = append(out, combo{engines: a.Policy.Max, policy: p, auto: true})
		}
	}
	return out
}

// Row is one run of the sweep: one fleet size with one policy (and P/D
// split).
type Row struct {
	// Engines is the fleet size.
	Engines int `json:"engines"`
	// Policy is the routing policy.
	Policy string `json:"policy"`
	// PD is the P/D split (zero: aggregated).
	PD PDVariant `json:"pd"`
	// GoodputPerGPU is the requests meeting the SLO per second per GPU
	// (Goodput.PerS over Engines × the profile's tensor parallelism):
	// DistServe's per-GPU goodput (Zhong et al., OSDI'24, §2.2).
	GoodputPerGPU float64 `json:"goodput_per_gpu"`
	// Summary aggregates the run (latencies in ms, hit rate, output tok/s,
	// utilisation); Summary.Goodput is set.
	Summary measure.Summary `json:"summary"`
	// Checks are the fleet-level verdicts, one per SLO target, in order.
	Checks []Check `json:"checks"`
	// MeetsSLO is true when every check is OK and, if the SLO sets
	// MinGoodput, Summary.Goodput.Share >= MinGoodput.
	MeetsSLO bool `json:"meets_slo"`
	// WallS is the wall time of the run, simulation and evaluation (s).
	WallS float64 `json:"wall_s"`
	// GPUHours is what the run's fleet costs: engine-seconds (Engines ×
	// the run's length, or the autoscaled engines' up time) × the
	// profile's GPUs per engine (tensor parallelism), in hours.
	GPUHours float64 `json:"gpu_hours"`
	// BurstTTFT is the TTFT of the requests that arrived in bursts
	// (BurstMask; ms), BurstRequests their count.
	BurstTTFT     measure.Latency `json:"burst_ttft_ms"`
	BurstRequests int             `json:"burst_requests"`
	// Scale is the autoscaling of an autoscaled run (nil: a static fleet).
	Scale *ScaleRow `json:"autoscale,omitempty"`
}

// cells formats r as one table row (the columns of WriteTable and the HTML
// report, in order); minGoodput is SLO.MinGoodput.
func (r Row) cells(minGoodput float64) []string {
	s := r.Summary
	util, good := report.Percent(s.MeanEngineUtilization), "-"
	if s.Goodput != nil {
		good = fmt.Sprintf("%.1f", s.Goodput.Share*100)
	}
	meets := "yes"
	if !r.MeetsSLO {
		meets = "no (" + strings.Join(r.Failed(minGoodput), ", ") + ")"
	}
	pooled := "-"
	switch {
	case s.PooledTieredHitRate != nil: // the fleet has tiers: the reference pools them too
		pooled = fmt.Sprintf("%.1f", *s.PooledTieredHitRate*100)
	case s.PooledHitRate != nil:
		pooled = fmt.Sprintf("%.1f", *s.PooledHitRate*100)
	}
	xfer := "-"
	if s.PD != nil && s.PD.Split > 0 {
		xfer = fmt.Sprintf("%.0f", s.PD.Transfer.P90)
	}
	engines := strconv.Itoa(r.Engines)
	if r.Scale != nil {
		engines = fmt.Sprintf("%d..%d", r.Scale.Min, r.Scale.Max)
	}
	return []string{engines, r.label(), strconv.Itoa(s.Errors),
		fmt.Sprintf("%.1f", s.HitRate*100), pooled, fmt.Sprintf("%.0f", s.TTFT.P50), fmt.Sprintf("%.0f", s.TTFT.P90),
		fmt.Sprintf("%.0f", s.TTFT.P99), fmt.Sprintf("%.1f", s.ITL.P50), fmt.Sprintf("%.1f", s.ITL.P99),
		fmt.Sprintf("%.0f", s.E2E.P90), fmt.Sprintf("%.0f", s.OutputTokPerS), util, good, fmt.Sprintf("%.3f", r.GoodputPerGPU), xfer, meets}
}

// Failed returns the reasons r misses its SLO, e.g. "ttft_p90=3.1s>2s" or
// "goodput=85.0%<90%" (minGoodput is SLO.MinGoodput); empty when it meets it.
func (r Row) Failed(minGoodput float64) []string {
	var out []string
	for _, c := range r.Checks {
		if !c.OK {
			out = append(out, fmt.Sprintf("%s=%s>%s", c.Target, fmtMs(c.ObservedMs), fmtMs(c.LimitMs)))
		}
	}
	if g := r.Summary.Goodput; minGoodput > 0 && g != nil && g.Share < minGoodput {
		out = append(out, fmt.Sprintf("goodput=%.1f%%<%g%%", g.Share*100, minGoodput*100))
	}
	return out
}

// Recommendation is the smallest swept fleet that meets the SLO.
type Recommendation struct {
	// Engines is the fleet size.
	Engines int `json:"engines"`
	// Policy is the best policy at that size: of those meeting the SLO, the
	// highest goodput share, then the lowest TTFT p90, then the first given.
	Policy string `json:"policy"`
	// PD is its P/D split (zero: aggregated).
	PD PDVariant `json:"pd"`
	// Row is the index of its run in Result.Rows.
	Row int `json:"row"`
}

// Result is the outcome of a sweep. Its JSON form is what `infergate plan
// --out` writes.
type Result struct {
	// SLO is the objective, as ParseSLO reads it.
	SLO string `json:"slo"`
	// MinGoodput is SLO.MinGoodput (0: none).
	MinGoodput float64 `json:"min_goodput,omitempty"`
	// Requests is the number of requests replayed per run.
	Requests int `json:"requests"`
	// Engines and Policies are the swept values, in sweep order.
	Engines  []int    `json:"engines"`
	Policies []string `json:"policies"`
	// Rows are the runs, by fleet size, then policy in the given order.
	Rows []Row `json:"rows"`
	// Recommendation is the smallest fleet meeting the SLO; nil when none
	// in the range does.
	Recommendation *Recommendation `json:"recommendation"`
	// WallS is the wall time of the whole sweep (s).
	WallS float64 `json:"wall_s"`
	// Workers is the number of runs that proceeded at once.
	Workers int `json:"workers"`
	// InfiniteHitRate is the replayed requests' infinite-cache hit rate
	// (trace.InfiniteCacheHitRate, warm-up included; each row's Summary has
	// it over its measured requests, and the pooled cache's of its size);
	// nil when not computed or the trace has no hash ids.
	InfiniteHitRate *float64 `json:"infinite_hit_rate,omitempty"`
	// Provenance says what produced the sweep (set by the caller; nil: not
	// recorded).
	Provenance *measure.Provenance `json:"provenance,omitempty"`
	// AutoscaleSpec is Options.Autoscale's policy as given, and Autoscale
	// each autoscaled run against the best static fleet of its policy.
	AutoscaleSpec string       `json:"autoscale_spec,omitempty"`
	Autoscale     []Comparison `json:"autoscale,omitempty"`
}

// Run sweeps every (fleet size, policy) pair of opts, judges each run against
// opts.SLO and recommends the smallest fleet meeting it. Runs are independent
// and proceed on up to opts.Workers goroutines; the result does not depend on
// their number. ctx is checked between runs (a run itself is not
// interruptible). The error is for invalid options or a failed run; a sweep in
// which no fleet meets the SLO succeeds with a nil Recommendation.
func Run(ctx context.Context, opts Options) (Result, error) {
	if len(opts.Engines) == 0 {
		return Result{}, errors.New("plan: no fleet sizes to sweep")
	}
	if len(opts.Policies) == 0 {
		return Result{}, errors.New("plan: no policies to sweep")
	}
	if len(opts.SLO.Targets) == 0 {
		return Result{}, errors.New("plan: the SLO has no latency target")
	}
	if len(opts.Records) == 0 {
		return Result{}, errors.New("plan: empty trace")
	}
	for _, n := range opts.Engines {
		if n < 1 {
			return Result{}, fmt.Errorf("plan: fleet size %d: must be at least 1", n)
		}
	}
	if opts.MaxMemory < 0 {
		return Result{}, fmt.Errorf("plan: memory limit %d bytes: must be >= 0 (0: the default)", opts.MaxMemory)
	}
	// Build each policy for the largest fleet up front, so that a policy
	// that cannot take that many endpoints fails now, not mid-sweep.
	largest := slices.Max(opts.Engines)
	if opts.Autoscale != nil {
		// The cold start from the engine profile's start-up model, on a
		// copy (the caller's Autoscale is not written).
		a := *opts.Autoscale
		if err := a.resolveColdStart(opts.Engine.WithDefaults().Profile); err != nil {
			return Result{}, fmt.Errorf("plan: %w", err)
		}
		opts.Autoscale = &a
		if err := opts.Autoscale.Policy.Validate(); err != nil {
			return Result{}, fmt.Errorf("plan: %w", err)
		}
		largest = max(largest, opts.Autoscale.Policy.Max)
	}
	for _, p := range opts.Policies {
		cfg := opts.Routing
		cfg.Policy = p
		pool := sched.Pool{Capacity: slices.Repeat([]int{1}, largest)}
		if sched.UsesPrecise(cfg) {
			pool.Precise = noMatch{} // the virtual fleet feeds a real one
		}
		if _, err := sched.NewPolicy(cfg, pool); err != nil {
			return Result{}, fmt.Errorf("plan: policy %s on %d engines: %w", p, largest, err)
		}
		// The virtual fleet's precise index has a slot per engine and
		// one for the remote store (virtual.NewFleet).
		slots := largest
		if !opts.Remote.IsZero() {
			slots++
		}
		if sched.UsesPrecise(cfg) && slots > prefix.MaxIndexEndpoints {
			return Result{}, fmt.Errorf("plan: policy %s on %d engines: the precise prefix index takes at most %d endpoints (%d needed)",
				p, largest, prefix.MaxIndexEndpoints, slots)
		}
	}
	for _, v := range opts.PD {
		if v.Prefill < 0 {
			return Result{}, fmt.Errorf("plan: %d prefill engines", v.Prefill)
		}
		if err := (sched.PDConfig{Threshold: v.Threshold, Local: v.Local}).Validate(); err != nil {
			return Result{}, fmt.Errorf("plan: %w", err)
		}
	}
	runs := combos(opts)
	if len(runs) == 0 {
		return Result{}, errors.New("plan: every P/D split has as many prefill engines as the fleet or more")
	}
	recs := opts.Records
	if opts.Requests > 0 && opts.Requests < len(recs) {
		recs = recs[:opts.Requests]
	}
	res := Result{
		SLO: opts.SLO.String(), MinGoodput: opts.SLO.MinGoodput, Requests: len(recs),
		Engines: opts.Engines, Policies: opts.Policies,
		Rows: make([]Row, len(runs)),
	}
	workers := opts.Workers
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	workers = min(workers, len(res.Rows))
	res.Workers = workers
	limit := opts.MaxMemory
	if limit == 0 {
		limit = DefaultMaxMemory()
	}
	if err := checkMemory(opts, recs, largest, workers, limit); err != nil {
		return Result{}, err
	}

	start := time.Now()
	var refs *refCache
	if !opts.NoReferences {
		refs = newRefCache(recs, opts.Engine, opts.Remote)
	}
	jobs := make(chan int)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex // guards firstErr and Progress calls
		firstErr error
	)
	for range workers {
		wg.Go(func() {
			for k := range jobs {
				row, err := runOne(ctx, opts, recs, runs[k], refs)
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				if err == nil {
					res.Rows[k] = row
					if opts.Progress != nil {
						opts.Progress(row)
					}
				}
				mu.Unlock()
			}
		})
	}
	for _, k := range dispatchOrder(runs, opts.Routing) {
		mu.Lock()
		stop := firstErr != nil
		mu.Unlock()
		if stop || ctx.Err() != nil {
			break
		}
		jobs <- k
	}
	close(jobs)
	wg.Wait()
	if firstErr != nil {
		return Result{}, firstErr
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	res.WallS = time.Since(start).Seconds()
	res.Recommendation = recommend(res.Rows)
	if opts.Autoscale != nil {
		res.AutoscaleSpec = opts.Autoscale.Spec
		res.compare()
	}
	if refs != nil {
		_, res.InfiniteHitRate = refs.get(opts.Engines[0]).All()
	}
	return res, nil
}

// dispatchOrder returns the row indices in the order to start them: longest
// runs first, so that the pool does not end on one long run. On the Mooncake
// conversation trace a run's wall time depends mostly on the policy — one that
// hashes prompts (prefix) takes about twice as long as one that does not — and
// little on the fleet size, so hashing policies go first, then larger fleets.
func dispatchOrder(runs []combo, routing sched.Config) []int {
	hashes := map[string]bool{}
	for _, r := range runs {
		if _, ok := hashes[r.policy]; ok {
			continue
		}
		routing.Policy = r.policy
		pol, err := sched.NewPolicy(routing, sched.Pool{Capacity: []int{1}, Precise: noMatch{}})
		hashes[r.policy] = err == nil && pol.NeedsHashes()
	}
	order := make([]int, 0, len(runs))
	for _, first := range []bool{true, false} {
		for k := len(runs) - 1; k >= 0; k-- {
			if hashes[runs[k].policy] == first {
				order = append(order, k)
			}
		}
	}
	return order
}

// runOne replays recs on engines engines with policy and judges the run;
// refs (nil: none) gives its reference hit rates.
func runOne(ctx context.Context, opts Options, recs []trace.Record, c combo, refs *refCache) (Row, error) {
	start := time.Now()
	engines, policy := c.engines, c.policy
	routing := opts.Routing
	if c.pd.Prefill > 0 {
		if c.pd.Threshold != 0 {
			routing.PD.Threshold = c.pd.Threshold
		}
		if c.pd.Local != "" {
			routing.PD.Local = c.pd.Local
		}
		if c.pd.Busy != "" {
			routing.PD.PrefillBusy = c.pd.Busy
		}
	}
	eng := opts.Engine
	if c.pd.Prefill > 0 && c.pd.DecodeBudget != 0 {
		eng.PD.DecodeMaxNumBatchedTokens = c.pd.DecodeBudget
	}
	var as *virtual.Autoscale
	if c.auto {
		a := opts.Autoscale.Autoscale
		as = &a
	}
	run, err := virtual.Replay(ctx, virtual.ReplayOptions{
		Policy: policy, Engines: engines, Engine: eng, Remote: opts.Remote, Records: recs,
		Model: opts.Model, Seed: opts.Seed, Routing: routing, Warmup: opts.Warmup, Prefill: c.pd.Prefill,
		Autoscale: as,
	})
	if err != nil {
		return Row{}, fmt.Errorf("plan: %d engines, %s %s: %w", engines, policy, c.pd.Label(), err)
	}
	checks, good := Evaluate(opts.SLO, measure.Measured(run.Records), run.Summary.DurationS)
	row := Row{Engines: engines, Policy: policy, PD: c.pd, Summary: run.Summary, Checks: checks, MeetsSLO: true}
	row.Summary.Goodput = &good
	tp := opts.Engine.WithDefaults().Profile.TensorParallel
	row.BurstTTFT, row.BurstRequests = burstTTFT(run.Records)
	row.GPUHours = gpuHours(float64(engines)*run.Summary.DurationS, tp)
	if run.Scale != nil {
		a := opts.Autoscale
		row.Scale = &ScaleRow{ScaleStats: *run.Scale, Min: a.Policy.Min, Max: a.Policy.Max, ColdStartS: a.ColdStartOrPolicy().Seconds()}
		if ph := a.Phases; ph != nil {
			row.Scale.Startup, row.Scale.ImageCached = string(ph.Source), a.Startup.ImageCached
			row.Scale.ImagePullS, row.Scale.WeightsS, row.Scale.WarmUpS = ph.ImagePull.Seconds(), ph.WeightsLoad.Seconds(), ph.WarmUp.Seconds()
		}
		if a.cache != nil {
			row.Scale.Cache = a.cache.String()
		}
		row.GPUHours = gpuHours(run.Scale.EngineSeconds, tp)
	}
	if gpus := engines * tp; gpus > 0 {
		row.GoodputPerGPU = good.PerS / float64(gpus)
		if row.Scale != nil && row.GPUHours > 0 {
			// Per GPU up: good requests over the GPU-seconds paid for.
			row.GoodputPerGPU = float64(good.Requests) / (row.GPUHours * 3600)
		}
	}
	if refs != nil {
		refs.get(engines).Apply(&row.Summary, run.Records)
	}
	for _, c := range checks {
		row.MeetsSLO = row.MeetsSLO && c.OK
	}
	if opts.SLO.MinGoodput > 0 && good.Share < opts.SLO.MinGoodput {
		row.MeetsSLO = false
	}
	row.WallS = time.Since(start).Seconds()
	return row, nil
}

// refCache computes the reference hits of a sweep's records once per fleet
// size (the pooled cache holds the size's whole KV capacity), on first use,
// from any worker.
type refCache struct {
	recs   []trace.Record
	engine sim.Config // defaults applied
	remote sim.TierSize
	mu     sync.Mutex
	bySize map[int]*refOnce
}

type refOnce struct {
	once sync.Once
	refs *measure.References
}

func newRefCache(recs []trace.Record, engine sim.Config, remote sim.TierSize) *refCache {
	return &refCache{recs: recs, engine: engine.WithDefaults(), remote: remote, bySize: map[int]*refOnce{}}
}

// get returns the references for a fleet of engines engines, computing
// them (once; other callers for the same size wait) if needed.
func (c *refCache) get(engines int) *measure.References {
	c.mu.Lock()
	o := c.bySize[engines]
	if o == nil {
		o = &refOnce{}
		c.bySize[engines] = o
	}
	c.mu.Unlock()
	o.once.Do(func() {
		e := c.engine
		o.refs = measure.NewReferences(c.recs, engines*e.NumBlocks, e.BlockSize)
		if e.Tiers.Enabled() || !c.remote.IsZero() {
			tiered := engines*(e.NumBlocks+e.TierBlocks(e.Tiers.Host)+e.TierBlocks(e.Tiers.Disk)) + e.TierBlocks(c.remote)
			o.refs.AddTiered(c.recs, tiered, e.BlockSize)
		}
	})
	return o.refs
}

// recommend picks, at the smallest fleet size with a run meeting the SLO,
// the best such run (see Recommendation.Policy); nil if no run meets it.
// rows are grouped by size (combos' order).
func recommend(rows []Row) *Recommendation {
	for base := 0; base < len(rows); {
		end := base
		for end < len(rows) && rows[end].Engines == rows[base].Engines {
			end++
		}
		best := -1
		for k := base; k < end; k++ {
			if !rows[k].MeetsSLO || rows[k].Scale != nil {
				continue
			}
			if best < 0 || better(&rows[k], &rows[best]) {
				best = k
			}
		}
		if best >= 0 {
			return &Recommendation{Engines: rows[best].Engines, Policy: rows[best].Policy, PD: rows[best].PD, Row: best}
		}
		base = end
	}
	return nil
}

// better reports whether a beats b at the same size: higher goodput share,
// then lower TTFT p90.
func better(a, b *Row) bool {
	ga, gb := a.Summary.Goodput.Share, b.Summary.Goodput.Share
	if ga != gb {
		return ga > gb
	}
	return a.Summary.TTFT.P90 < b.Summary.TTFT.P90
}

// Err is nil when a fleet meets the SLO, else ErrNoFleet.
func (r *Result) Err() error {
	if r.Recommendation == nil {
		return ErrNoFleet
	}
	return nil
}

// WriteJSON writes r as indented JSON.
func (r *Result) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// WriteTable writes the sweep as an aligned table, one row per run: fleet
// size, policy, failed requests, hit rate (%), the pooled-cache reference hit
// rate of that size (%, "-" when not computed), TTFT p50/p90/p99 (ms), ITL
// p50/p99 (ms, pooled), E2E p90 (ms), output throughput (tokens per engine
// second), mean engine utilisation (%), goodput (% of requests meeting every
// target), and whether the run meets the SLO (with the missed targets), then
// the recommendation line (see Verdict).
func (r *Result) WriteTable(w io.Writer) error {
	pw := len("policy")
	for k := range r.Rows {
		pw = max(pw, len(r.Rows[k].label()))
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "engines\t%-*s\t", pw, "policy")
	fmt.Fprintln(tw, "errors\thit %\tpooled hit %\tTTFT p50 ms\tTTFT p90 ms\tTTFT p99 ms\tITL p50 ms\tITL p99 ms\tE2E p90 ms\tout tok/s\tutil %\tgoodput %\tgood/GPU/s\tP→D ms p90\t  meets SLO")
	for _, row := range r.Rows {
		c := row.cells(r.MinGoodput)
		c[1] = fmt.Sprintf("%-*s", pw, c[1])
		c[len(c)-1] = "  " + c[len(c)-1]
		fmt.Fprintln(tw, strings.Join(c, "\t"))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	names, sums := r.bucketRuns()
	if err := report.WriteBucketTable(w, names, sums); err != nil {
		return err
	}
	if r.InfiniteHitRate != nil {
		if _, err := fmt.Fprintf(w, "reference hit %%: pooled cache (one engine with the fleet's KV capacity) per row, infinite cache %.1f\n", *r.InfiniteHitRate*100); err != nil {
			return err
		}
	}
	if _, err := fmt.Fprintf(w, "\n%s\n", r.Verdict()); err != nil {
		return err
	}
	return r.writeAutoscale(w)
}

// Verdict is the recommendation line: "recommendation: 8 engines, policy
// prefix (goodput 97.1%, TTFT p90 1.42s, ...)", or ErrNoFleet's text with the
// swept range.
func (r *Result) Verdict() string {
	if r.Recommendation == nil {
		return fmt.Sprintf("%s (SLO %s; swept %s engines × %s)", ErrNoFleet, r.SLO, joinInts(r.Engines), strings.Join(r.Policies, ","))
	}
	row := r.Rows[r.Recommendation.Row]
	s := row.Summary
	return fmt.Sprintf("recommendation: %d engines, policy %s (SLO %s: goodput %.1f%%, TTFT p90 %s, ITL p99 %s, hit rate %.1f%%, utilisation %s)",
		row.Engines, row.label(), r.SLO, s.Goodput.Share*100, fmtMs(s.TTFT.P90), fmtMs(s.ITL.P99), s.HitRate*100, fmtUtil(s.MeanEngineUtilization))
}

// fmtMs formats a latency in ms as a rounded duration ("1.42s", "87.3ms");
// "inf" for the infinitely slow.
func fmtMs(v float64) string {
	if v >= math.MaxFloat64 {
		return "inf"
	}
	d := time.Duration(v * float64(time.Millisecond))
	switch {
	case d >= 10*time.Second:
		return d.Round(100 * time.Millisecond).String()
	case d >= time.Second:
		return d.Round(10 * time.Millisecond).String()
	case d >= time.Millisecond:
		return d.Round(100 * time.Microsecond).String()
	}
	return d.Round(time.Microsecond).String()
}

func fmtUtil(u *float64) string {
	if u == nil {
		return "unknown"
	}
	return fmt.Sprintf("%.1f%%", *u*100)
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}

// noMatch stands in for a precise index when only checking a policy's
// configuration.
type noMatch struct{}

func (noMatch) Match([]uint64, []int) {}
