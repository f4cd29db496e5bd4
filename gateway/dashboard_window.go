package gateway

import (
	"math"
	"time"
)

// The live dashboard's "recent" figures (README "Dashboards") are
// differences of the gateway's own cumulative Prometheus counters and
// histograms between now and a snapshot about dashboardWindow old, the
// way rate() and histogram_quantile() read them in Prometheus: the request
// path records nothing for the dashboard.
const (
	// dashboardWindow is the span of the recent figures.
	dashboardWindow = time.Minute
	// dashboardStep is the least time between two kept snapshots.
	dashboardStep = 5 * time.Second
	// dashboardMaxSnapshots bounds the kept snapshots (window/step + 1
	// would do; the rest is slack for irregular polling).
	dashboardMaxSnapshots = 32
)

// hist is a histogram's cumulative state: counts[i] observations ≤
// bounds[i] (the bounds are the histogram's, shared, read-only), count in
// all (the +Inf bucket) and their sum.
type hist struct {
	bounds []float64
	counts []uint64
	count  uint64
	sum    float64
}

// add adds o's observations to h (same bounds, or h empty).
func (h *hist) add(o hist) {
	if o.count == 0 && len(o.counts) == 0 {
		return
	}
	if h.bounds == nil {
		h.bounds = o.bounds
		h.counts = make([]uint64, len(o.counts))
	}
	for i := range min(len(h.counts), len(o.counts)) {
		h.counts[i] += o.counts[i]
	}
	h.count += o.count
	h.sum += o.sum
}

// minus returns h − base (the observations since base), clamping at zero.
func (h hist) minus(base hist) hist {
	d := hist{bounds: h.bounds, counts: make([]uint64, len(h.counts)), count: sub(h.count, base.count), sum: max(h.sum-base.sum, 0)}
	for i, c := range h.counts {
		if i < len(base.counts) {
			c = sub(c, base.counts[i])
		}
		d.counts[i] = c
	}
	return d
}

func sub(a, b uint64) uint64 {
	if b > a {
		return 0
	}
	return a - b
}

// quantile returns the q-quantile (0 < q < 1) of h's observations as
// Prometheus's histogram_quantile estimates it: linear interpolation
// within the bucket holding the rank, the first bucket starting at 0, and
// the largest finite bound for a rank in the +Inf bucket. NaN when h is
// empty.
func (h hist) quantile(q float64) float64 {
	if h.count == 0 || len(h.bounds) == 0 {
		return math.NaN()
	}
	rank := q * float64(h.count)
	for i, c := range h.counts {
		if float64(c) < rank {
			continue
		}
		lo, below := 0.0, uint64(0)
		if i > 0 {
			lo, below = h.bounds[i-1], h.counts[i-1]
		}
		hi := h.bounds[i]
		if c == below {
			return hi
		}
		return lo + (hi-lo)*(rank-float64(below))/float64(c-below)
	}
	return h.bounds[len(h.bounds)-1]
}

// routeKey names one (model, endpoint) series of the request metrics;
// endpoint "" holds the requests answered before an endpoint was picked.
type routeKey struct{ model, endpoint string }

// routeCounts are one route's cumulative request metrics.
type routeCounts struct {
	requests float64 // all answers
	// errors are the answers that failed to serve (5xx: the gateway's or
	// an engine's failure), clientErrors the requests refused or abandoned
	// as the client's doing (4xx, 429 and 499 included).
	errors, clientErrors      float64
	prompt, cached, generated float64 // tokens
	retries                   float64 // attempts resent after this endpoint failed
	ttft, itl, e2e            hist    // seconds
}

// add adds o to c.
func (c *routeCounts) add(o *routeCounts) {
	c.requests += o.requests
	c.errors += o.errors
	c.clientErrors += o.clientErrors
	c.prompt += o.prompt
	c.cached += o.cached
	c.generated += o.generated
	c.retries += o.retries
	c.ttft.add(o.ttft)
	c.itl.add(o.itl)
	c.e2e.add(o.e2e)
}

// minus returns c − base.
func (c *routeCounts) minus(base *routeCounts) routeCounts {
	if base == nil {
		base = &routeCounts{}
	}
	return routeCounts{
		requests: max(c.requests-base.requests, 0), errors: max(c.errors-base.errors, 0),
		clientErrors: max(c.clientErrors-base.clientErrors, 0),
		prompt:       max(c.prompt-base.prompt, 0), cached: max(c.cached-base.cached, 0),
		generated: max(c.generated-base.generated, 0), retries: max(c.retries-base.retries, 0),
		ttft: c.ttft.minus(base.ttft), itl: c.itl.minus(base.itl), e2e: c.e2e.minus(base.e2e),
	}
}

// counters are the gateway's cumulative metrics the dashboard reads.
type counters struct {
	routes     map[routeKey]*routeCounts
	queueWait  map[string]hist               // by model
	rejections map[string]map[string]float64 // model → reason → requests
	ejections  map[string]float64            // endpoint → ejections
}

func newCounters() *counters {
	return &counters{routes: map[routeKey]*routeCounts{}, queueWait: map[string]hist{},
		rejections: map[string]map[string]float64{}, ejections: map[string]float64{}}
}

// route returns k's counts, creating them.
func (c *counters) route(k routeKey) *routeCounts {
	r := c.routes[k]
	if r == nil {
		r = &routeCounts{}
		c.routes[k] = r
	}
	return r
}

// snapshot is the counters as they were at a time.
type snapshot struct {
	at time.Time
	c  *counters
}

// window keeps the snapshots the recent figures are measured from. Its
// methods are not safe for concurrent use (the dashboard holds a lock).
type window struct {
	snaps []snapshot // oldest first; never empty once started
}

// start records zero counters at t (the gateway's start: before any
// request).
func (w *window) start(t time.Time) { w.snaps = []snapshot{{at: t, c: newCounters()}} }

// advance records cur at now and returns the snapshot the recent figures
// start from: the newest one at least dashboardWindow before now, else
// the oldest kept (at the start the figures cover less than the window;
// the state says how much). cur is kept when the newest kept snapshot is
// dashboardStep or more older than now; snapshots older than the base are
// dropped.
func (w *window) advance(now time.Time, cur *counters) snapshot {
	base := 0
	for i, s := range w.snaps {
		if now.Sub(s.at) >= dashboardWindow {
			base = i
		}
	}
	w.snaps = w.snaps[base:]
	b := w.snaps[0]
	if last := w.snaps[len(w.snaps)-1]; now.Sub(last.at) >= dashboardStep {
		if len(w.snaps) >= dashboardMaxSnapshots {
			w.snaps = append(w.snaps[:0], w.snaps[1:]...)
		}
		w.snaps = append(w.snaps, snapshot{at: now, c: cur})
	}
	return b
}
