package virtual

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/infergate/infergate/autoscale"
	"github.com/infergate/infergate/sched"
)

// Autoscale makes a Fleet's size follow an autoscale.Scaler in virtual
// time (Config.Autoscale). Config.Engines is then the most engines the
// fleet can run (the policy's Max must not exceed it); an engine is off,
// starting (not routable: as vLLM's /health answers 503 while it loads),
// ready, or stopping (out of rotation, finishing the requests it holds).
type Autoscale struct {
	// Policy is the scaling policy (Max ≤ Config.Engines).
	Policy autoscale.Config
	// Initial is the number of engines ready at time 0 (Policy.Min when 0
	// and Policy.Min > 0; at least 0, at most Policy.Max). A negative value
	// starts from zero engines whatever Min is.
	Initial int
	// Interval is the period of the Scaler's decisions (default
	// autoscale.DefaultInterval, the HPA's sync period).
	Interval time.Duration
	// ColdStart is an engine's start-up time, from the decision that starts
	// it to ready (default: Policy.ColdStart). StartUp, when set, is
	// asked instead, per start (a start-up that varies by engine or time).
	// plan --autoscale sets Policy.ColdStart from the simulator's start-up
	// model (sim.GPUProfile.StartupPhases: a profile and the weights'
	// source tier → image pull, weights read, warm-up).
	ColdStart time.Duration
	StartUp   func(engine int, at time.Duration) time.Duration
	// Caches, when set, makes each start-up read through its node's
	// artifact cache (startup.go): the time comes from the tiers the cache
	// finds, and ColdStart and StartUp are not used.
	Caches *NodeCaches
	// HoldTTL bounds how long a request that arrives while no engine is
	// ready is held at the gateway for one (as the gateway holds requests
	// for a pool scaling from zero); past it the request fails with
	// ErrHoldTimeout (a 503). 0: held until an engine is ready.
	HoldTTL time.Duration
	// RateWindow is the arrival rate's window (Signals.ArrivalRate;
	// default autoscale.DefaultRateWindow).
	RateWindow time.Duration
}

// ErrHoldTimeout is Result.Err of a request held longer than
// Autoscale.HoldTTL with no engine ready.
var ErrHoldTimeout = errors.New("sim: no engine ready within the hold TTL")

// ScalePoint is one decision of the fleet's Scaler.
type ScalePoint struct {
	At       time.Duration `json:"-"`
	AtS      float64       `json:"t_s"`
	Desired  int           `json:"desired"`
	Ready    int           `json:"ready"`
	Starting int           `json:"starting"`
	Stopping int           `json:"stopping"`
	Queued   int           `json:"queued"`
	InFlight int           `json:"in_flight"`
	Reason   string        `json:"reason"`
}

// ScaleStats describe an autoscaled run (Fleet.ScaleStats).
type ScaleStats struct {
	// EngineSeconds is the engines' up time (starting, ready or
	// stopping) over [0, Now], in engine-seconds: what the fleet pays for.
	EngineSeconds float64 `json:"engine_seconds"`
	// Held counts requests that arrived with no engine ready and waited at
	// the gateway; Dropped those of them that waited past HoldTTL.
	Held    int `json:"held"`
	Dropped int `json:"dropped"`
	// MaxHeldWait is the longest hold of a request that was then
	// dispatched.
	MaxHeldWait time.Duration `json:"max_held_wait_ns"`
	// Started and Stopped count engine starts and stops; PeakEngines is
	// the most engines up at once.
	Started     int `json:"started"`
	Stopped     int `json:"stopped"`
	PeakEngines int `json:"peak_engines"`
	// Timeline is every decision, in time order.
	Timeline []ScalePoint `json:"timeline,omitempty"`
	// Starts is every engine start, in time order.
	Starts []EngineStart `json:"-"`
	// StartsBySource counts the start-ups through node caches
	// (Autoscale.Caches) by the source of record of their weights
	// (sim.WeightsPlacement.Source: remote, nvme, page_cache, peer).
	StartsBySource map[string]int `json:"starts_by_source,omitempty"`
}

// EngineStart is one start of an engine: started at At, routable from
// Ready, up until Stop (0: still up at the end).
type EngineStart struct {
	Engine          int
	At, Ready, Stop time.Duration
	// Cancelled: stopped before it was ready.
	Cancelled bool
}

// Engine states of an autoscaled fleet.
const (
	engineReady    uint8 = iota // in rotation (every engine of a fixed fleet)
	engineOff                   // not running: costs nothing
	engineStarting              // started, not yet routable (until readyAt)
	engineStopping              // out of rotation, finishing its requests
)

// scaler is a Fleet's autoscaling state.
type scaler struct {
	cfg      Autoscale
	s        *autoscale.Scaler
	rate     *autoscale.RateWindow
	nextTick time.Duration
	arrived  uint64
	held     []int // request indices waiting for a ready engine, FIFO
	// ttfts are the TTFTs delivered since the last decision (only with a
	// TTFT target): their p90 is Signals.TTFT.
	ttfts []time.Duration
	stats ScaleStats
	// caches are the nodes' artifact caches (Autoscale.Caches; nil
	// without).
	caches *nodeCaches
}

// newScaler validates a and returns its state for a fleet of n engines.
func newScaler(a Autoscale, cfg *Config) (*scaler, error) {
	if a.Policy.Max > cfg.Engines {
		return nil, fmt.Errorf("sim: autoscale max %d above the fleet's %d engines", a.Policy.Max, cfg.Engines)
	}
	if cfg.Replicas > 1 || cfg.Prefill > 0 {
		return nil, errors.New("sim: autoscaling needs one gateway replica and an aggregated fleet")
	}
	s, err := autoscale.New(a.Policy)
	if err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	if a.Interval <= 0 {
		a.Interval = autoscale.DefaultInterval
	}
	if a.ColdStart <= 0 {
		a.ColdStart = a.Policy.ColdStart
	}
	if a.HoldTTL < 0 || a.ColdStart < 0 {
		return nil, errors.New("sim: negative hold TTL or cold start")
	}
	switch {
	case a.Initial == 0:
		a.Initial = a.Policy.Min
	case a.Initial < 0:
		a.Initial = 0
	}
	a.Initial = min(a.Initial, a.Policy.Max)
	sc := &scaler{cfg: a, s: s, rate: autoscale.NewRateWindow(a.RateWindow), nextTick: 0}
	if a.Caches != nil {
		if sc.caches, err = newNodeCaches(*a.Caches, cfg.Engines); err != nil {
			return nil, err
		}
	}
	return sc, nil
}

// startFleet puts the initial engines in rotation and the others off.
func (f *Fleet) startFleet() {
	for i := range f.engines {
		if i >= f.as.cfg.Initial {
			f.engines[i].state = engineOff
			f.setReady(i, false)
		} else if f.as.caches != nil {
			_, _ = f.as.caches.start(i) // loaded before time 0: its node holds and pins the model
		}
	}
	f.as.stats.PeakEngines = f.as.cfg.Initial
}

// setReady sets engine i's readiness in every replica's routing snapshot.
func (f *Fleet) setReady(i int, ready bool) {
	for _, r := range f.reps {
		r.snap[i].Ready = ready
	}
}

// nextScaleEvent is the earliest autoscaling event: a decision, an engine
// becoming ready, a held request's TTL.
func (f *Fleet) nextScaleEvent() time.Duration {
	t := f.as.nextTick
	for i := range f.engines {
		if ve := &f.engines[i]; ve.state == engineStarting {
			t = min(t, ve.readyAt)
		}
	}
	if ttl := f.as.cfg.HoldTTL; ttl > 0 && len(f.as.held) > 0 {
		t = min(t, f.res[f.as.held[0]].Arrival+ttl)
	}
	return t
}

// scale runs the autoscaling events due at t: engines whose start-up ends
// become ready, held requests past their TTL fail, a decision due is taken
// and acted on, and held requests go to the engines now ready (before the
// arrivals of t, in arrival order).
func (f *Fleet) scale(t time.Duration) {
	as := f.as
	for i := range f.engines {
		if ve := &f.engines[i]; ve.state == engineStarting && ve.readyAt <= t {
			ve.state = engineReady
			f.setReady(i, true)
		}
	}
	if ttl := as.cfg.HoldTTL; ttl > 0 {
		n := 0
		for n < len(as.held) && f.res[as.held[n]].Arrival+ttl <= t {
			k := as.held[n]
			f.res[k].Engine, f.res[k].Err = -1, ErrHoldTimeout
			as.stats.Dropped++
			n++
		}
		as.held = as.held[:copy(as.held, as.held[n:])]
	}
	if as.nextTick <= t {
		f.decide(t)
		as.nextTick = t + as.cfg.Interval
	}
	if len(as.held) > 0 && f.readyCount() > 0 {
		held := as.held
		as.held = nil
		for _, k := range held {
			f.res[k].Arrival = f.reqs[k].Arrival
			f.as.stats.MaxHeldWait = max(f.as.stats.MaxHeldWait, t-f.reqs[k].Arrival)
			f.arrive(k, &f.reqs[k], t)
		}
		as.held = held[:0]
	}
}

// readyCount is the number of engines in rotation.
func (f *Fleet) readyCount() int {
	n := 0
	for i := range f.engines {
		if f.engines[i].state == engineReady {
			n++
		}
	}
	return n
}

// hold keeps request k at the gateway until an engine is ready (arrive,
// when none is).
func (f *Fleet) hold(k int, t time.Duration) {
	f.res[k].Arrival, f.res[k].Engine = t, -1
	f.as.held = append(f.as.held, k)
	f.as.stats.Held++
}

// decide asks the Scaler for the desired count at t from the fleet's
// signals and starts or stops engines to reach it.
func (f *Fleet) decide(t time.Duration) {
	as := f.as
	var sig autoscale.Signals
	var kv float64
	for i := range f.engines {
		ve := &f.engines[i]
		switch ve.state {
		case engineReady:
			sig.Ready++
			st := ve.e.Stats()
			sig.Waiting += st.Waiting
			kv += max(st.KVUsage, 0)
			sig.InFlight += f.InFlight(i)
		case engineStarting:
			sig.Starting++
		case engineStopping:
			sig.Stopping++ // its requests finish there: not load for the others
		}
	}
	if sig.Ready > 0 {
		sig.KVUtil = kv / float64(sig.Ready)
	}
	sig.Queued = len(as.held)
	if n := len(as.ttfts); n > 0 {
		slices.Sort(as.ttfts)
		sig.TTFT = as.ttfts[min(n-1, (n*9+9)/10-1)] // the nearest-rank p90
		as.ttfts = as.ttfts[:0]
	}
	sig.ArrivalRate = as.rate.Observe(t, as.arrived)
	d := as.s.Decide(t, sig)
	as.stats.Timeline = append(as.stats.Timeline, ScalePoint{At: t, AtS: t.Seconds(), Desired: d.Desired,
		Ready: sig.Ready, Starting: sig.Starting, Stopping: sig.Stopping, Queued: sig.Queued,
		InFlight: sig.InFlight, Reason: d.Reason.String()})
	for up := sig.Ready + sig.Starting; up < d.Desired; up++ {
		f.startEngine(t)
	}
	for up := sig.Ready + sig.Starting; up > d.Desired; up-- {
		f.stopEngine(t)
	}
}

// startEngine starts the lowest-numbered engine that is off: it is
// routable after its start-up time, with an empty cache.
func (f *Fleet) startEngine(t time.Duration) {
	i := slices.IndexFunc(f.engines, func(ve engine) bool { return ve.state == engineOff })
	if i < 0 {
		return
	}
	ve := &f.engines[i]
	up := f.startUpTime(i, t)
	ve.state, ve.upSince, ve.readyAt = engineStarting, t, t+up
	f.as.stats.Started++
	f.as.stats.Starts = append(f.as.stats.Starts, EngineStart{Engine: i, At: t, Ready: t + up})
	f.as.stats.PeakEngines = max(f.as.stats.PeakEngines, f.upCount())
	if up == 0 {
		ve.state = engineReady
		f.setReady(i, true)
	}
}

// stopEngine takes one engine down: a starting one first (the latest
// started: it has done the least), else the ready engine with the fewest
// requests in flight (the highest-numbered among equals), which leaves
// rotation and stops when its requests finish.
func (f *Fleet) stopEngine(t time.Duration) {
	best, bestLoad := -1, 0
	for i := len(f.engines) - 1; i >= 0; i-- {
		ve := &f.engines[i]
		if ve.state == engineStarting && (best < 0 || f.engines[best].state != engineStarting || ve.upSince > f.engines[best].upSince) {
			best = i
		}
	}
	if best < 0 {
		for i := len(f.engines) - 1; i >= 0; i-- {
			if f.engines[i].state != engineReady {
				continue
			}
			if n := f.InFlight(i); best < 0 || n < bestLoad {
				best, bestLoad = i, n
			}
		}
	}
	if best < 0 {
		return
	}
	ve := &f.engines[best]
	f.setReady(best, false)
	f.as.stats.Stopped++
	if ve.state == engineStarting {
		f.off(best, t)
		return
	}
	ve.state = engineStopping
	f.maybeOff(best, t)
}

// maybeOff turns a stopping engine off once it holds no request.
func (f *Fleet) maybeOff(i int, t time.Duration) {
	ve := &f.engines[i]
	if ve.state == engineStopping && !ve.busy && !ve.pending && !ve.e.HasWork() && f.InFlight(i) == 0 {
		f.off(i, t)
	}
}

// off stops engine i at t: its up time is paid for, and its KV cache and
// the policy's view of it are gone (a restart loads the weights into an
// empty cache).
func (f *Fleet) off(i int, t time.Duration) {
	ve := &f.engines[i]
	f.as.stats.EngineSeconds += (t - ve.upSince).Seconds()
	for k := len(f.as.stats.Starts) - 1; k >= 0; k-- {
		if st := &f.as.stats.Starts[k]; st.Engine == i {
			st.Stop, st.Cancelled = t, ve.state == engineStarting
			break
		}
	}
	ve.state = engineOff
	if f.as.caches != nil {
		f.as.caches.stop(i)
	}
	ve.e.ResetPrefixCache()
	if f.precise != nil {
		ve.e.TakeKVEvents() // AllBlocksCleared: applied now, not after its next step
		f.precise.Cleared(i)
	}
	for _, r := range f.reps {
		if fg, ok := r.policy.(sched.Forgetter); ok {
			fg.Forget(i)
		}
	}
}

// upCount is the number of engines not off.
func (f *Fleet) upCount() int {
	n := 0
	for i := range f.engines {
		if f.engines[i].state != engineOff {
			n++
		}
	}
	return n
}

// ScaleStats returns the autoscaling figures of the runs so far, the up
// time of engines still up counted to Now; zero without Config.Autoscale.
func (f *Fleet) ScaleStats() ScaleStats {
	if f.as == nil {
		return ScaleStats{}
	}
	st := f.as.stats
	for i := range f.engines {
		if ve := &f.engines[i]; ve.state != engineOff {
			st.EngineSeconds += (f.now - ve.upSince).Seconds()
		}
	}
	return st
}
