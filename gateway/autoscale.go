package gateway

import (
	"fmt"
	"math"
	"net"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/infergate/infergate/autoscale"
)

// AutoscaleConfig is the `autoscale` section: the scaling policy the
// gateway evaluates per pool (package autoscale, the same code plan
// --autoscale runs in virtual time), whose decisions and signals it
// exports as Prometheus gauges an HPA can use and, with keda_listen, as
// KEDA's external scaler (keda.go). Off when no policy is given. The
// section needs a restart: a reload keeps it as at start (logged).
type AutoscaleConfig struct {
	// Policy is every pool's policy, in autoscale.ParseConfig's spelling
	// ("min=0,max=8,target=16,down_window=5m"); "" leaves pools without an
	// entry in Pools unscaled.
	Policy string `yaml:"policy"`
	// Pools overrides Policy per model (model name → policy).
	Pools map[string]string `yaml:"pools"`
	// Interval is the period of the decisions (default
	// autoscale.DefaultInterval, 15 s, the HPA's sync period).
	Interval time.Duration `yaml:"interval"`
	// KEDAListen is the address of KEDA's external scaler gRPC service
	// (e.g. ":9100"; "" off), served by `infergate serve` and `epp`.
	KEDAListen string `yaml:"keda_listen"`
	// RateWindow is the window of the arrival-rate signal (default
	// autoscale.DefaultRateWindow, 1 minute). A pool with min 0 is active
	// (wants an engine) while a request arrived within it.
	RateWindow time.Duration `yaml:"rate_window"`
	// Target, when set, is an in-process fleet the decisions drive
	// (embedding only: `infergate up --engines MIN..MAX`): after every
	// decision it is told the pool's desired count, and it says how many
	// of the pool's not-ready endpoints are starting (the others are
	// stopped slots, not capacity on its way).
	Target ScaleTarget `yaml:"-"`
}

// ScaleTarget is a fleet that a pool's autoscaling decisions drive in
// process (AutoscaleConfig.Target). Its methods are called from the
// decision loop, ScaleTo outside the gateway's locks; StartingEngines
// must not call back into the gateway.
type ScaleTarget interface {
	// StartingEngines is the number of the pool's engines started and not
	// yet ready (loading): Signals.Starting, in place of the count of
	// not-ready endpoints, which includes slots whose engine is stopped.
	StartingEngines(pool string) int
	// ScaleTo is the pool's decision: run n engines.
	ScaleTo(pool string, n int)
}

// Enabled reports whether some pool has a policy.
func (c AutoscaleConfig) Enabled() bool { return c.Policy != "" || len(c.Pools) > 0 }

// policyFor is model's policy spec ("" none).
func (c AutoscaleConfig) policyFor(model string) string {
	if p, ok := c.Pools[model]; ok {
		return p
	}
	return c.Policy
}

// validate checks every policy and the listen address.
func (c AutoscaleConfig) validate() []error {
	var errs []error
	check := func(what, spec string) {
		if _, rest, err := autoscale.ParseConfig(spec); err != nil {
			errs = append(errs, fmt.Errorf("autoscale.%s: %w", what, err))
		} else if len(rest) > 0 {
			errs = append(errs, fmt.Errorf("autoscale.%s: unknown keys %q", what, rest))
		}
	}
	if c.Policy != "" {
		check("policy", c.Policy)
	}
	for model, spec := range c.Pools {
		check("pools."+model, spec)
	}
	if c.Interval < 0 {
		errs = append(errs, fmt.Errorf("autoscale.interval %v: must not be negative", c.Interval))
	}
	if c.RateWindow < 0 || c.RateWindow > time.Hour {
		errs = append(errs, fmt.Errorf("autoscale.rate_window %v: want 0 (default) to 1h", c.RateWindow))
	}
	if c.Target != nil && !c.Enabled() {
		errs = append(errs, fmt.Errorf("autoscale: a scale target needs autoscale.policy or autoscale.pools"))
	}
	if c.KEDAListen != "" {
		if _, _, err := net.SplitHostPort(c.KEDAListen); err != nil {
			errs = append(errs, fmt.Errorf("autoscale.keda_listen %q: %v", c.KEDAListen, err))
		}
		if !c.Enabled() {
			errs = append(errs, fmt.Errorf("autoscale.keda_listen needs autoscale.policy or autoscale.pools"))
		}
	}
	return errs
}

// PoolScale is one pool's latest autoscaling decision and the signals it
// was taken on (Gateway.PoolScale).
type PoolScale struct {
	Model string
	// At is when it was taken (wall clock).
	At time.Time
	autoscale.Decision
	Signals autoscale.Signals
	// Saturation is the pool's load against what its ready engines take
	// (≥ 1: saturated): the highest of in flight + queued over
	// TargetInFlight × ready, mean KV usage over the KV threshold, and
	// waiting per ready engine over the queue threshold; +Inf with
	// requests and no ready engine, 0 when idle.
	Saturation float64
	// Policy is the pool's policy, defaults applied.
	Policy autoscale.Config
}

// IsActive is KEDA's activation: the pool has work (queued or in flight),
// requests arrived within the rate window, or the policy wants engines.
func (s *PoolScale) IsActive() bool {
	return s.Signals.Queued > 0 || s.Signals.InFlight > 0 || s.Signals.ArrivalRate > 0 || s.Desired > 0
}

// poolScaler is one model's Scaler, kept across reloads while its policy
// spec stays the same.
type poolScaler struct {
	spec string
	s    *autoscale.Scaler
	rate *autoscale.RateWindow
	ttft ttftWindow
	last atomic.Pointer[PoolScale]
}

// scalers are the gateway's pool scalers (autoscale.go).
type scalers struct {
	mu     sync.Mutex
	byPool map[string]*poolScaler // model → scaler; under mu (the loop writes, readers copy)
	epoch  time.Time              // the scalers' time origin
	// changed is closed and replaced after every round of decisions
	// (StreamIsActive waits on it).
	changed chan struct{}
}

// startAutoscale starts the decision loop (New; a no-op without a
// policy at start: the autoscale section needs a restart).
func (g *Gateway) startAutoscale(reg prometheus.Registerer) error {
	g.scale.byPool = map[string]*poolScaler{}
	g.scale.changed = make(chan struct{})
	g.scale.epoch = time.Now()
	if !g.cfg.Autoscale.Enabled() {
		return nil
	}
	if err := reg.Register(newAutoscaleCollector(g)); err != nil {
		return fmt.Errorf("gateway: register autoscale metrics: %w", err)
	}
	iv := g.cfg.Autoscale.Interval
	if iv <= 0 {
		iv = autoscale.DefaultInterval
	}
	g.decideAll(time.Now()) // the gauges and KEDA have a decision at once
	g.wg.Go(func() {
		t := time.NewTicker(iv)
		defer t.Stop()
		for {
			select {
			case <-g.loops.Done():
				return
			case now := <-t.C:
				g.decideAll(now)
			}
		}
	})
	return nil
}

// decideAll takes one decision per pool with a policy, from its signals
// at now.
func (g *Gateway) decideAll(now time.Time) {
	st := g.state.Load()
	if st == nil {
		return
	}
	ac := st.cfg.Autoscale
	type order struct {
		pool string
		n    int
	}
	var orders []order
	defer func() { // outside the lock: the target may call back
		for _, o := range orders {
			ac.Target.ScaleTo(o.pool, o.n)
		}
	}()
	g.scale.mu.Lock()
	defer g.scale.mu.Unlock()
	t := now.Sub(g.scale.epoch)
	for model, p := range st.pools {
		spec := ac.policyFor(model)
		ps := g.scale.byPool[model]
		if spec == "" {
			delete(g.scale.byPool, model)
			continue
		}
		if ps == nil || ps.spec != spec {
			c, _, err := autoscale.ParseConfig(spec) // validated with the configuration
			if err != nil {
				continue
			}
			s, err := autoscale.New(c)
			if err != nil {
				continue
			}
			ps = &poolScaler{spec: spec, s: s, rate: autoscale.NewRateWindow(ac.RateWindow)}
			g.scale.byPool[model] = ps
		}
		sig := p.scaleSignals()
		if ac.Target != nil {
			// Not ready and not starting: a stopped slot, no capacity.
			sig.Starting = min(sig.Starting, ac.Target.StartingEngines(model))
		}
		sig.ArrivalRate = ps.rate.Observe(t, p.gate.arrivals.Load())
		sig.TTFT = ps.ttft.read(p)
		d := ps.s.Decide(t, sig)
		v := &PoolScale{Model: model, At: now, Decision: d, Signals: sig, Policy: ps.s.Config()}
		v.Saturation = saturation(v.Policy, sig)
		ps.last.Store(v)
		if ac.Target != nil {
			orders = append(orders, order{model, d.Desired})
		}
	}
	for model := range g.scale.byPool {
		if _, ok := st.pools[model]; !ok {
			delete(g.scale.byPool, model)
		}
	}
	close(g.scale.changed)
	g.scale.changed = make(chan struct{})
}

// scaleSignals reads the pool's autoscaling signals now: its admission
// queue, its endpoints' in-flight requests (gateway-side), their scraped
// waiting queues and KV usage, and how many are ready. An endpoint that is
// configured (or discovered) but not ready counts as starting: vLLM
// answers /health 503 while it loads, so a new engine is not ready until
// its start-up ends (an endpoint ejected for failures counts so too).
// Signals.TTFT is set by the caller (ttftWindow). Requests held for a pool
// with no ready endpoint (scale from zero, coldstart.go) wait in the same
// admission queue, so Queued counts them: a pool at zero with held
// requests wants at least one engine and is active for KEDA
// (TestExternalScalerHeldRequests).
func (p *pool) scaleSignals() autoscale.Signals {
	sp := p.snapshot()
	defer p.release(sp)
	var sig autoscale.Signals
	var kv float64
	kvN := 0
	for i, e := range *sp {
		if p.endpoints[i] == vacant {
			continue
		}
		if !e.Ready {
			sig.Starting++
			continue
		}
		sig.Ready++
		sig.InFlight += e.InFlight
		if e.Metrics {
			sig.Waiting += e.Waiting
			if e.KVUtil >= 0 {
				kv += e.KVUtil
				kvN++
			}
		}
	}
	if kvN > 0 {
		sig.KVUtil = kv / float64(kvN)
	}
	sig.Queued = int(p.gate.waiting.Load())
	return sig
}

// saturation is PoolScale.Saturation.
func saturation(c autoscale.Config, s autoscale.Signals) float64 {
	load := float64(s.InFlight + s.Queued)
	if s.Ready == 0 {
		if load > 0 {
			return math.Inf(1)
		}
		return 0
	}
	sat := 0.0
	if c.TargetInFlight > 0 {
		sat = load / (c.TargetInFlight * float64(s.Ready))
	}
	if c.KVThreshold > 0 {
		sat = max(sat, s.KVUtil/c.KVThreshold)
	}
	if c.QueueThreshold > 0 {
		sat = max(sat, float64(s.Waiting)/float64(s.Ready)/c.QueueThreshold)
	}
	return sat
}

// PoolScale returns model's latest autoscaling decision; false when the
// model has no policy (or no decision yet).
func (g *Gateway) PoolScale(model string) (PoolScale, bool) {
	g.scale.mu.Lock()
	ps := g.scale.byPool[model]
	g.scale.mu.Unlock()
	if ps == nil {
		return PoolScale{}, false
	}
	v := ps.last.Load()
	if v == nil {
		return PoolScale{}, false
	}
	return *v, true
}

// scaleChanged returns a channel closed after the next round of
// decisions.
func (g *Gateway) scaleChanged() <-chan struct{} {
	g.scale.mu.Lock()
	defer g.scale.mu.Unlock()
	return g.scale.changed
}

// autoscaleCollector exposes every scaled pool's latest decision.
type autoscaleCollector struct {
	g                                        *Gateway
	desired, recommended, queued, inFlight   *prometheus.Desc
	saturation, engines, arrivalRate, kvUtil *prometheus.Desc
}

func newAutoscaleCollector(g *Gateway) *autoscaleCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("infergate_autoscale_"+name, help, append([]string{"model"}, labels...), nil)
	}
	return &autoscaleCollector{g: g,
		desired:     d("desired_replicas", "Engines the pool's autoscaling policy wants now, stabilised and rate-limited (autoscale.policy; an HPA's external metric with target averageValue 1 scales to it)."),
		recommended: d("recommended_replicas", "The policy's unstabilised recommendation, by the rule that set it.", "reason"),
		queued:      d("queue_length", "Requests waiting at the gateway for the pool (admission queue) at the last decision."),
		inFlight:    d("in_flight_requests", "Requests in flight at the pool's ready engines at the last decision."),
		saturation:  d("saturation", "The pool's load against what its ready engines take (1 = saturated): max of (in flight + queued) / (target × ready), KV usage / kv threshold, waiting per engine / queue threshold; +Inf with requests and no ready engine."),
		engines:     d("engines", "The pool's engines at the last decision, by state (ready: in rotation; starting: configured, not ready).", "state"),
		arrivalRate: d("arrival_rate", "Requests per second that arrived for the pool over the last minute."),
		kvUtil:      d("kv_utilization", "Mean scraped KV-cache usage of the pool's ready engines (0..1)."),
	}
}

// Describe implements prometheus.Collector.
func (c *autoscaleCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.desired, c.recommended, c.queued, c.inFlight, c.saturation, c.engines, c.arrivalRate, c.kvUtil} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *autoscaleCollector) Collect(ch chan<- prometheus.Metric) {
	c.g.scale.mu.Lock()
	views := make([]*PoolScale, 0, len(c.g.scale.byPool))
	for _, ps := range c.g.scale.byPool {
		if v := ps.last.Load(); v != nil {
			views = append(views, v)
		}
	}
	c.g.scale.mu.Unlock()
	sort.Slice(views, func(i, j int) bool { return views[i].Model < views[j].Model })
	g := prometheus.GaugeValue
	for _, v := range views {
		m := v.Model
		ch <- prometheus.MustNewConstMetric(c.desired, g, float64(v.Desired), m)
		ch <- prometheus.MustNewConstMetric(c.recommended, g, float64(v.Recommended), m, v.Reason.String())
		ch <- prometheus.MustNewConstMetric(c.queued, g, float64(v.Signals.Queued), m)
		ch <- prometheus.MustNewConstMetric(c.inFlight, g, float64(v.Signals.InFlight), m)
		ch <- prometheus.MustNewConstMetric(c.saturation, g, v.Saturation, m)
		ch <- prometheus.MustNewConstMetric(c.engines, g, float64(v.Signals.Ready), m, "ready")
		ch <- prometheus.MustNewConstMetric(c.engines, g, float64(v.Signals.Starting), m, "starting")
		ch <- prometheus.MustNewConstMetric(c.arrivalRate, g, v.Signals.ArrivalRate, m)
		ch <- prometheus.MustNewConstMetric(c.kvUtil, g, v.Signals.KVUtil, m)
	}
}

// ttftWindow turns the cumulative TTFT histograms of a pool's endpoints
// (infergate_time_to_first_token_seconds) into the TTFT p90 of the
// requests that got their first token since the previous read: the
// quantile Dynamo's SLA planner reads from Prometheus each adjustment
// interval (histogram_quantile over the interval's increase, linear within
// a bucket).
type ttftWindow struct {
	prev, cur []uint64 // cumulative bucket counts, summed over the pool's endpoints
	bounds    []float64
	prevN     uint64
	primed    bool
}

// read returns the p90 TTFT of the requests observed since the previous
// read (0 when none, or when an endpoint left the pool and the counts
// went backwards).
func (w *ttftWindow) read(p *pool) time.Duration {
	var n uint64
	clear(w.cur)
	var m dto.Metric
	for i, rm := range p.routes {
		if p.endpoints[i] == vacant || rm == nil || rm == p.none {
			continue
		}
		pm, ok := rm.ttft.(prometheus.Metric)
		if !ok {
			continue
		}
		m.Reset()
		if pm.Write(&m) != nil || m.GetHistogram() == nil {
			continue
		}
		h := m.GetHistogram()
		if len(w.bounds) != len(h.GetBucket()) {
			w.bounds = make([]float64, len(h.GetBucket()))
			w.cur, w.prev, w.primed = make([]uint64, len(h.GetBucket())), make([]uint64, len(h.GetBucket())), false
		}
		for k, b := range h.GetBucket() {
			w.bounds[k] = b.GetUpperBound()
			w.cur[k] += b.GetCumulativeCount()
		}
		n += h.GetSampleCount()
	}
	defer func() {
		w.prev, w.cur = w.cur, w.prev
		w.prevN, w.primed = n, true
	}()
	if !w.primed || n <= w.prevN {
		return 0
	}
	for k := range w.cur {
		if w.cur[k] < w.prev[k] {
			return 0
		}
	}
	return quantileOfIncrease(0.9, w.bounds, w.cur, w.prev, n-w.prevN)
}

// quantileOfIncrease is Prometheus' histogram_quantile over the increase
// cur − prev of cumulative buckets with upper bounds bounds (seconds; the
// +Inf bucket implied, total observations in all): linear interpolation
// within the bucket holding the rank, the highest finite bound when the
// rank is beyond it.
func quantileOfIncrease(q float64, bounds []float64, cur, prev []uint64, total uint64) time.Duration {
	rank := q * float64(total)
	lower, below := 0.0, 0.0
	for k, ub := range bounds {
		c := float64(cur[k] - prev[k])
		if c >= rank {
			in := c - below
			x := ub
			if in > 0 {
				x = lower + (ub-lower)*(rank-below)/in
			}
			return time.Duration(x * float64(time.Second))
		}
		lower, below = ub, c
	}
	if len(bounds) == 0 {
		return 0
	}
	return time.Duration(bounds[len(bounds)-1] * float64(time.Second))
}
