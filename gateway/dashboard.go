package gateway

import (
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"encoding/json"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// The live dashboard (README "Dashboards"): GET /dashboard is a
// self-contained page (HTML, CSS and JS inline, nothing fetched from
// elsewhere) that polls GET /dashboard/state.json. The page holds no data;
// the state follows /metrics' access rule (a key with
// auth.protect_metrics), because it shows what /metrics shows: endpoint
// URLs, model names and the request metrics.
const (
	pathDashboard      = "/dashboard"
	pathDashboardState = "/dashboard/state.json"
)

//go:embed dashboard/index.html dashboard/dashboard.css dashboard/dashboard.js
var dashboardFiles embed.FS

// dashboardPage is the page with its style and script inlined, and the
// Content-Security-Policy that allows exactly those (by hash) and fetches
// from the gateway itself.
var dashboardPage, dashboardCSP = func() ([]byte, string) {
	read := func(name string) string {
		b, err := dashboardFiles.ReadFile("dashboard/" + name)
		if err != nil {
			panic(err) // embedded: cannot fail
		}
		return string(b)
	}
	css, js := read("dashboard.css"), read("dashboard.js")
	page := strings.NewReplacer("/*STYLE*/", css, "/*SCRIPT*/", js).Replace(read("index.html"))
	hash := func(s string) string {
		h := sha256.Sum256([]byte(s))
		return "'sha256-" + base64.StdEncoding.EncodeToString(h[:]) + "'"
	}
	csp := "default-src 'none'; script-src " + hash(js) + "; style-src " + hash(css) +
		"; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
	return []byte(page), csp
}()

// dashboard is the gateway's dashboard state: the snapshots of its
// counters the recent figures are measured from.
type dashboard struct {
	started time.Time
	mu      sync.Mutex
	win     window
}

func (d *dashboard) init(now time.Time) {
	d.started = now
	d.win.start(now)
}

// serveDashboard answers GET /dashboard.
func (g *Gateway) serveDashboard(w http.ResponseWriter) {
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Security-Policy", dashboardCSP)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-cache")
	h.Set("Content-Length", strconv.Itoa(len(dashboardPage)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(dashboardPage)
}

// serveDashboardState answers GET /dashboard/state.json.
func (g *Gateway) serveDashboardState(w http.ResponseWriter) {
	body, err := json.Marshal(g.DashboardState(time.Now()))
	if err != nil { // no NaN or Inf reaches the state: cannot fail
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	writeJSON(w, http.StatusOK, body)
}

// DashboardState is the body of GET /dashboard/state.json: the fleet as the
// gateway sees it at Time. Totals count since the gateway started, Recent
// over the last WindowSeconds (up to a minute).
type DashboardState struct {
	Time          time.Time  `json:"time"`
	Started       time.Time  `json:"started"`
	Policy        string     `json:"policy"`
	Draining      bool       `json:"draining"`
	WindowSeconds float64    `json:"window_seconds"`
	Fleet         DashFleet  `json:"fleet"`
	Pools         []DashPool `json:"pools"` // by model name
	// Keys is each API key's usage since start, in the keys file's order
	// (absent without keys; keyusage.go).
	Keys []DashKey `json:"keys,omitempty"`
}

// DashKey is one API key's usage (totals since start).
type DashKey struct {
	Key             string  `json:"key"` // the configured name
	Requests        float64 `json:"requests"`
	PromptTokens    float64 `json:"prompt_tokens"`
	CachedTokens    float64 `json:"cached_tokens"`
	GeneratedTokens float64 `json:"generated_tokens"`
}

// DashFleet sums the fleet.
type DashFleet struct {
	Endpoints   int         `json:"endpoints"`
	Ready       int         `json:"ready"`
	Ejected     int         `json:"ejected"`
	InFlight    int64       `json:"in_flight"`    // requests
	QueueLength int64       `json:"queue_length"` // requests waiting for admission, all models
	Ejections   float64     `json:"ejections"`    // since start
	Total       DashTraffic `json:"total"`
	Recent      DashTraffic `json:"recent"`
}

// DashTraffic is what requests did over a span (all answers, unknown models
// and requests refused before routing included in the fleet's).
type DashTraffic struct {
	Requests float64 `json:"requests"`
	// Errors are answers that failed to serve (5xx: the gateway's or an
	// engine's failure); ClientErrors requests refused or abandoned as the
	// client's doing (4xx: bad requests, unknown models, keys, rate limits,
	// 499 client gone). Not mixed: a client's typos are no fleet alarm.
	Errors            float64 `json:"errors"`
	ClientErrors      float64 `json:"client_errors"`
	RequestsPerSecond float64 `json:"requests_per_second"`
	PromptTokens      float64 `json:"prompt_tokens"`
	CachedTokens      float64 `json:"cached_tokens"`
	GeneratedTokens   float64 `json:"generated_tokens"`
	// CacheHitRate is CachedTokens / PromptTokens (null without prompt
	// tokens).
	CacheHitRate *float64 `json:"cache_hit_rate"`
	// Retries are attempts resent after an endpoint failed.
	Retries float64        `json:"retries"`
	TTFT    *DashQuantiles `json:"ttft_seconds"`
	ITL     *DashQuantiles `json:"itl_seconds"`
	E2E     *DashQuantiles `json:"e2e_seconds"`
}

// DashQuantiles summarise a histogram's observations (seconds); null when
// there were none. Quantiles are estimated from the buckets as
// histogram_quantile does.
type DashQuantiles struct {
	Count uint64  `json:"count"`
	Mean  float64 `json:"mean"`
	P50   float64 `json:"p50"`
	P90   float64 `json:"p90"`
	P99   float64 `json:"p99"`
}

// DashPool is one model's pool.
type DashPool struct {
	Model       string `json:"model"`
	QueueLength int64  `json:"queue_length"` // waiting for admission
	Admitted    int64  `json:"admitted"`     // admitted, not finished
	MaxInFlight int    `json:"max_in_flight"`
	MaxQueue    int    `json:"max_queue"` // < 0: no queue
	// QueueWait is the recent admission queue wait (requests that queued).
	QueueWait *DashQuantiles `json:"queue_wait_seconds"`
	// Rejections are admission refusals since start, by reason.
	Rejections map[string]float64 `json:"rejections"`
	Total      DashTraffic        `json:"total"`
	Recent     DashTraffic        `json:"recent"`
	Endpoints  []DashEndpoint     `json:"endpoints"`
}

// DashEndpoint is one endpoint of a pool: its live state (shared by the
// pools it serves) and the pool's traffic to it.
type DashEndpoint struct {
	Endpoint string `json:"endpoint"`
	Kind     string `json:"kind"`
	// State is "ready" (in rotation), "ejected" (by outlier detection,
	// until EjectedUntil) or "unhealthy" (failed its health check).
	State        string     `json:"state"`
	EjectedUntil *time.Time `json:"ejected_until,omitempty"`
	InFlight     int64      `json:"in_flight"`        // requests, all models
	InFlightTok  int64      `json:"in_flight_tokens"` // prompt tokens of those (tokenizing policies)
	// PrefillBacklog is the prompt tokens not predicted cached of requests
	// sent that have not produced their first token.
	PrefillBacklog int64   `json:"prefill_backlog_tokens"`
	PrefillRate    float64 `json:"prefill_tokens_per_second"` // learnt from TTFTs; 0 until observed
	KVBlocks       int     `json:"kv_blocks"`
	BlockSize      int     `json:"block_size"`
	// Engine is the engine's own state from its last metrics scrape (null
	// when not scraped, or the scrape is stale).
	Engine    *DashEngine `json:"engine"`
	Ejections float64     `json:"ejections"` // since start, every reason
	Total     DashTraffic `json:"total"`
	Recent    DashTraffic `json:"recent"`
}

// DashEngine is what the engine's metrics page said.
type DashEngine struct {
	ScrapedAt time.Time `json:"scraped_at"`
	Waiting   int       `json:"waiting"` // requests queued in the engine
	Running   int       `json:"running"` // requests in its running batch
	// KVUtilization is the fraction of KV cache in use (null if unknown).
	KVUtilization *float64 `json:"kv_utilization"`
}

// DashboardState returns the dashboard's view of the gateway at now, and
// records a snapshot of the counters for later recent figures. For the
// dashboard and tests; safe for concurrent use.
func (g *Gateway) DashboardState(now time.Time) DashboardState {
	g.dash.mu.Lock()
	cur := g.collectCounters()
	base := g.dash.win.advance(now, cur)
	g.dash.mu.Unlock()
	span := now.Sub(base.at).Seconds()

	cfg := g.state.Load() // the configuration in force
	st := DashboardState{Time: now, Started: g.dash.started, Policy: cfg.cfg.Routing.Policy, Draining: g.draining.Load(),
		WindowSeconds: span, Pools: []DashPool{}}
	total, recent := &routeCounts{}, &routeCounts{}
	for k, rc := range cur.routes {
		total.add(rc)
		d := rc.minus(base.c.routes[k])
		recent.add(&d)
	}
	uptime := now.Sub(g.dash.started).Seconds()
	st.Fleet.Total, st.Fleet.Recent = traffic(total, uptime), traffic(recent, span)
	st.Fleet.Endpoints = len(cfg.endpoints)
	for _, ep := range cfg.endpoints {
		switch endpointState(ep, now) {
		case "ready":
			st.Fleet.Ready++
		case "ejected":
			st.Fleet.Ejected++
		}
		st.Fleet.InFlight += ep.ledger.InFlight()
		st.Fleet.Ejections += cur.ejections[ep.name]
	}

	models := make([]string, 0, len(cfg.pools))
	for m := range cfg.pools {
		models = append(models, m)
	}
	slices.Sort(models)
	for _, model := range models {
		p := cfg.pools[model]
		maxInFlight, maxQueue, _ := p.gate.settings()
		dp := DashPool{Model: model, QueueLength: p.gate.waiting.Load(), Admitted: p.gate.active.Load(),
			MaxInFlight: maxInFlight, MaxQueue: maxQueue, Rejections: map[string]float64{}}
		for r, v := range cur.rejections[model] {
			dp.Rejections[r] = v
		}
		qw := cur.queueWait[model].minus(base.c.queueWait[model])
		dp.QueueWait = quantiles(qw)
		st.Fleet.QueueLength += dp.QueueLength
		ptotal, precent := &routeCounts{}, &routeCounts{}
		for _, name := range append([]string{""}, endpointNames(p.endpoints)...) {
			k := routeKey{model, name}
			if rc := cur.routes[k]; rc != nil {
				ptotal.add(rc)
				d := rc.minus(base.c.routes[k])
				precent.add(&d)
			}
		}
		dp.Total, dp.Recent = traffic(ptotal, uptime), traffic(precent, span)
		for _, ep := range p.endpoints {
			if ep == vacant {
				continue
			}
			spec := ep.spec.Load()
			de := DashEndpoint{Endpoint: ep.name, Kind: string(spec.kind), State: endpointState(ep, now),
				InFlight: ep.ledger.InFlight(), InFlightTok: ep.ledger.InFlightTokens(), PrefillBacklog: ep.ledger.PendingPrefill(),
				PrefillRate: finite(ep.ledger.PrefillRate()), KVBlocks: spec.kvBlocks, BlockSize: spec.blockSize,
				Ejections: cur.ejections[ep.name]}
			if de.State == "ejected" {
				t := time.Unix(0, ep.ejectedUntil.Load()).UTC()
				de.EjectedUntil = &t
			}
			if f := cfg.feeds[ep].scrape; f != nil {
				if l, at, ok := f.latest(now); ok && l.HasQueue {
					de.Engine = &DashEngine{ScrapedAt: at, Waiting: l.Waiting, Running: l.Running}
					if l.HasKVUtil {
						de.Engine.KVUtilization = ptrFloat(l.KVUtil)
					}
				}
			}
			k := routeKey{model, ep.name}
			rc := cur.routes[k]
			if rc == nil {
				rc = &routeCounts{}
			}
			d := rc.minus(base.c.routes[k])
			de.Total, de.Recent = traffic(rc, uptime), traffic(&d, span)
			dp.Endpoints = append(dp.Endpoints, de)
		}
		st.Pools = append(st.Pools, dp)
	}
	if cfg.keys != nil {
		for _, p := range cfg.keys.principals {
			u := p.usage
			if u == nil {
				continue
			}
			st.Keys = append(st.Keys, DashKey{Key: p.Name, Requests: counterValue(u.requests), PromptTokens: counterValue(u.prompt),
				CachedTokens: counterValue(u.cached), GeneratedTokens: counterValue(u.generated)})
		}
	}
	return st
}

// counterValue reads a counter.
func counterValue(c prometheus.Counter) float64 {
	var v dto.Metric
	if c.Write(&v) != nil {
		return 0
	}
	return v.GetCounter().GetValue()
}

// endpointState is "ready", "ejected" or "unhealthy".
func endpointState(ep *endpoint, now time.Time) string {
	switch {
	case ep.ready.Load():
		return "ready"
	case now.UnixNano() < ep.ejectedUntil.Load():
		return "ejected"
	}
	return "unhealthy"
}

func endpointNames(eps []*endpoint) []string {
	out := make([]string, 0, len(eps))
	for _, ep := range eps {
		if ep != vacant {
			out = append(out, ep.name)
		}
	}
	return out
}

// traffic turns counts over seconds into the state's figures.
func traffic(c *routeCounts, seconds float64) DashTraffic {
	t := DashTraffic{Requests: c.requests, Errors: c.errors, ClientErrors: c.clientErrors, PromptTokens: c.prompt, CachedTokens: c.cached,
		GeneratedTokens: c.generated, Retries: c.retries,
		TTFT: quantiles(c.ttft), ITL: quantiles(c.itl), E2E: quantiles(c.e2e)}
	if seconds > 0 {
		t.RequestsPerSecond = c.requests / seconds
	}
	if c.prompt > 0 {
		t.CacheHitRate = ptrFloat(min(c.cached/c.prompt, 1))
	}
	return t
}

// quantiles summarises h (nil when empty).
func quantiles(h hist) *DashQuantiles {
	if h.count == 0 {
		return nil
	}
	return &DashQuantiles{Count: h.count, Mean: finite(h.sum / float64(h.count)),
		P50: finite(h.quantile(0.5)), P90: finite(h.quantile(0.9)), P99: finite(h.quantile(0.99))}
}

// finite maps NaN and ±Inf (not valid JSON) to 0.
func finite(v float64) float64 {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0
	}
	return v
}

func ptrFloat(v float64) *float64 {
	v = finite(v)
	return &v
}

// collectCounters reads the request, admission and resilience metrics
// from their collectors (what a scrape reads; nothing on the request path).
func (g *Gateway) collectCounters() *counters {
	c := newCounters()
	m := g.metrics
	collect(m.requests, func(l labels, v *dto.Metric) {
		r := c.route(routeKey{l["model"], l["endpoint"]})
		n := v.GetCounter().GetValue()
		r.requests += n
		switch code, err := strconv.Atoi(l["code"]); {
		case err == nil && code/100 == 4:
			r.clientErrors += n
		case err != nil || code/100 != 2:
			r.errors += n
		}
	})
	for _, f := range []struct {
		vec *prometheus.CounterVec
		get func(*routeCounts) *float64
	}{
		{m.prompt, func(r *routeCounts) *float64 { return &r.prompt }},
		{m.cached, func(r *routeCounts) *float64 { return &r.cached }},
		{m.generated, func(r *routeCounts) *float64 { return &r.generated }},
		{g.res.retries, func(r *routeCounts) *float64 { return &r.retries }},
	} {
		collect(f.vec, func(l labels, v *dto.Metric) {
			*f.get(c.route(routeKey{l["model"], l["endpoint"]})) += v.GetCounter().GetValue()
		})
	}
	for _, f := range []struct {
		vec *prometheus.HistogramVec
		get func(*routeCounts) *hist
	}{
		{m.ttft, func(r *routeCounts) *hist { return &r.ttft }},
		{m.itl, func(r *routeCounts) *hist { return &r.itl }},
		{m.e2e, func(r *routeCounts) *hist { return &r.e2e }},
	} {
		collect(f.vec, func(l labels, v *dto.Metric) {
			f.get(c.route(routeKey{l["model"], l["endpoint"]})).add(histOf(v))
		})
	}
	collect(g.res.queueWait, func(l labels, v *dto.Metric) {
		h := c.queueWait[l["model"]]
		h.add(histOf(v))
		c.queueWait[l["model"]] = h
	})
	collect(g.res.rejections, func(l labels, v *dto.Metric) {
		r := c.rejections[l["model"]]
		if r == nil {
			r = map[string]float64{}
			c.rejections[l["model"]] = r
		}
		r[l["reason"]] += v.GetCounter().GetValue()
	})
	collect(g.res.ejections, func(l labels, v *dto.Metric) {
		c.ejections[l["endpoint"]] += v.GetCounter().GetValue()
	})
	return c
}

// labels are a metric's label values by name.
type labels map[string]string

// collect calls f with every metric c collects.
func collect(c prometheus.Collector, f func(labels, *dto.Metric)) {
	ch := make(chan prometheus.Metric, 16)
	go func() {
		c.Collect(ch)
		close(ch)
	}()
	for pm := range ch {
		var v dto.Metric
		if pm.Write(&v) != nil {
			continue
		}
		l := make(labels, len(v.Label))
		for _, lp := range v.Label {
			l[lp.GetName()] = lp.GetValue()
		}
		f(l, &v)
	}
}

// histOf converts a written histogram (its buckets share the bounds of
// every histogram with the same layout; they are copied here).
func histOf(v *dto.Metric) hist {
	hv := v.GetHistogram()
	h := hist{count: hv.GetSampleCount(), sum: hv.GetSampleSum()}
	for _, b := range hv.GetBucket() {
		if math.IsInf(b.GetUpperBound(), 1) {
			continue
		}
		h.bounds = append(h.bounds, b.GetUpperBound())
		h.counts = append(h.counts, b.GetCumulativeCount())
	}
	return h
}
