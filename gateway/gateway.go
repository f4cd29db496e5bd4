// Package gateway is infergate's HTTP front door: it serves the
// OpenAI-compatible API, parses and validates each request once, tokenizes
// and hashes the prompt once, asks the model pool's sched.Policy for an
// endpoint, and proxies the request there, streaming Server-Sent Events
// through with an immediate flush per event while measuring time to first
// token, inter-token latency and prefix-cache hits. See README.md for the
// request lifecycle, configuration, metrics and error codes.
package gateway

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/infergate/infergate/fleet"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
)

// Gateway routes and proxies OpenAI-compatible requests to a fleet of
// engines. It is safe for concurrent use; Close stops its health checks.
type Gateway struct {
	cfg        Config
	policyName string
	pools      map[string]*pool
	endpoints  []*endpoint
	// targets are the pools a model name is served by: a model's own, an
	// alias's in fallback order (alias.go); fallbacks counts fallbacks.
	targets   map[string][]*pool
	fallbacks *prometheus.CounterVec
	// affinity maps response ids to the endpoints that stored them
	// (responses.go).
	affinity *responseAffinity

	// transport serves health checks, metric scrapes and https engines;
	// up sends the request path's upstream requests (upstream.go).
	transport *http.Transport
	up        *upstreamClient
	// rt sends upstream requests (up, or a fake in benchmarks).
	rt http.RoundTripper

	tokenizer *prefix.Tokenizer // nil when no policy needs hashes
	segments  *prefix.SegmentCache
	metrics   *metrics
	unknown   *routeMetrics // model "unknown", no endpoint
	res       *resilienceMetrics
	hold      *holdBudget // bytes of non-streaming answers held (hold.go)

	edge // API keys, TLS, trusted proxies (limits.go)

	// engineAuthFailures counts engines' refusals of the gateway's
	// credentials (credentials.go).
	engineAuthFailures *prometheus.CounterVec

	handler        http.Handler
	metricsHandler http.Handler
	modelsBody     []byte
	modelBodies    map[string][]byte // GET /v1/models/{model}: each entry of modelsBody
	retryAfter     string            // seconds, for 503 no_endpoint_available

	reqIDPrefix string
	reqIDSeq    atomic.Uint64

	exchanges sync.Pool // *exchange

	scraper *fleet.Scraper // nil when no endpoint has a metrics page
	kvSubs  []kvSubscription

	dash dashboard // GET /dashboard's recent figures (dashboard.go)

	// obs is the access log and tracer (nil when both are off); servedBy
	// the EndpointHeader value per endpoint (nil unless configured).
	// accesslog.go, tracing.go.
	obs      *observer
	servedBy map[*endpoint][]string

	stop      context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once

	// Shutdown (shutdown.go): draining is set by Drain; base is the
	// requests' base context, canceled by abort (Abort) with
	// errShuttingDown.
	draining atomic.Bool
	base     context.Context
	abort    context.CancelCauseFunc
}

// pool is the endpoints serving one model and the policy that picks among
// them. Entry i of endpoints, routes and every snapshot is the same endpoint.
type pool struct {
	model     string
	policy    sched.Policy
	endpoints []*endpoint
	routes    []*routeMetrics // per endpoint
	none      *routeMetrics   // errors before an endpoint was picked
	blockSize int             // routing block size (tokens)
	seed      uint64          // prefix.Seed(model + "\x00"): no cache salt
	snapshots sync.Pool       // *[]sched.Endpoint
	// precise is the pool's index fed by its endpoints' KV events (nil
	// unless every endpoint publishes them); precisePolicy: the policy
	// scores with it, so its prediction is the policy's.
	precise       *prefix.PreciseIndex
	precisePolicy bool
	scraper       *fleet.Scraper
	// maxModelLen is the longest context of its endpoints (tokens).
	maxModelLen int
	// gate is the pool's admission control; budget bounds its retries
	// (admission.go, retry.go).
	gate   *admission
	budget retryBudget
	// modelJSON is the model name as a JSON string and modelHeader as a
	// header value (alias.go).
	modelJSON   []byte
	modelHeader []string
}

// snapshot returns the pool's endpoints as the scheduler sees them now
// (readiness and in-flight counts read from atomics) in a pooled slice;
// return it with release.
func (p *pool) snapshot() *[]sched.Endpoint {
	sp, _ := p.snapshots.Get().(*[]sched.Endpoint)
	if sp == nil {
		s := make([]sched.Endpoint, len(p.endpoints))
		sp = &s
	}
	s := *sp
	var now time.Time
	if p.scraper != nil {
		now = time.Now()
	}
	for i, ep := range p.endpoints {
		s[i] = sched.Endpoint{Name: ep.name, Ready: ep.ready.Load(), InFlight: int(ep.inFlight.Load()),
			InFlightTokens: int(ep.inFlightTokens.Load()), PendingPrefillTokens: int(ep.pendingPrefill.Load()),
			PrefillTokensPerSecond: ep.learntPrefillRate()}
		if ep.scrapeIdx >= 0 {
			if l, _, ok := p.scraper.LatestAt(ep.scrapeIdx, now); ok && l.HasQueue {
				e := &s[i]
				e.Metrics, e.Waiting, e.Running = true, l.Waiting, l.Running
				e.KVUtil = max(l.KVUtil, 0)
				if l.LoRA.Known {
					e.Adapters, e.MaxAdapters = loraAdapters(l.LoRA), l.LoRA.Max
				}
			}
		}
	}
	return sp
}

// loraAdapters are the adapters an engine has loaded: those with running or
// waiting requests (vllm:lora_requests_info). It allocates only when both
// lists are non-empty.
func loraAdapters(st fleet.LoRAState) []string {
	switch {
	case len(st.Waiting) == 0:
		return st.Running
	case len(st.Running) == 0:
		return st.Waiting
	}
	return append(append(make([]string, 0, len(st.Running)+len(st.Waiting)), st.Running...), st.Waiting...)
}

func (p *pool) release(sp *[]sched.Endpoint) { p.snapshots.Put(sp) }

// New builds a gateway for cfg (defaulted and validated here), registering
// its metrics on reg (nil: a new private registry that also carries the Go
// and process collectors; /metrics serves reg when it is a
// prometheus.Gatherer, else the default gatherer). For endpoints with
// kv_blocks 0 it reads the engine's /metrics, and it probes every endpoint
// once before returning, so New takes up to HealthCheckTimeout. Endpoints
// that are down at start join when their health check first succeeds.
func New(cfg Config, reg prometheus.Registerer) (*Gateway, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var gatherer prometheus.Gatherer = prometheus.DefaultGatherer
	if reg == nil {
		r := prometheus.NewRegistry()
		r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		reg, gatherer = r, r
	} else if gt, ok := reg.(prometheus.Gatherer); ok {
		gatherer = gt
	}

	g := &Gateway{cfg: cfg, pools: map[string]*pool{}}
	g.initShutdown()
	g.transport = newTransport(cfg)
	g.up = newUpstreamClient(cfg, g.transport)
	g.rt = g.up
	g.retryAfter = strconv.Itoa(max(1, int(math.Ceil(cfg.HealthCheckInterval.Seconds()))))
	var idb [6]byte
	_, _ = rand.Read(idb[:])
	g.reqIDPrefix = "ig-" + hex.EncodeToString(idb[:]) + "-"

	// One endpoint per URL, shared by the pools of every model it serves.
	byURL := map[string]*endpoint{}
	for _, ec := range cfg.Endpoints {
		base, _ := normalizeURL(ec.URL) // validated
		if byURL[base] == nil {
			hdr, err := endpointHeader(ec, os.LookupEnv) // validated; the environment is read again here
			if err != nil {
				g.transport.CloseIdleConnections()
				return nil, fmt.Errorf("endpoint %s: %w", base, err)
			}
			ep := &endpoint{name: base, base: base, kvBlocks: ec.KVBlocks, blockSize: ec.BlockSize, maxModelLen: ec.MaxModelLen,
				kind: ec.Kind, healthPath: cfg.HealthCheckPath, scrapeIdx: -1, kvEvents: ec.KVEvents, header: hdr}
			if ep.healthPath == "" {
				ep.healthPath = ec.Kind.Info().HealthPath
			}
			if mp := ec.Kind.Info().MetricsPath; ec.MetricsURL != "" {
				ep.metricsURL = ec.MetricsURL
			} else if mp != "" {
				ep.metricsURL = base + mp
			}
			for kind := range apiKind(numPathKinds) {
				u, err := url.Parse(base + kind.path())
				if err != nil {
					g.transport.CloseIdleConnections()
					return nil, fmt.Errorf("endpoint %s: %w", base, err)
				}
				ep.urls[kind] = u
			}
			byURL[base] = ep
			g.endpoints = append(g.endpoints, ep)
		} else {
			byURL[base].maxModelLen = max(byURL[base].maxModelLen, ec.MaxModelLen)
		}
	}
	refused := g.discover()
	if err := g.newScraper(); err != nil {
		g.transport.CloseIdleConnections()
		return nil, err
	}

	fleet := newFleetCollector(g.endpoints)
	m, err := newMetrics(reg, fleet)
	if err != nil {
		g.transport.CloseIdleConnections()
		return nil, err
	}
	g.metrics = m

	routingBlock := cfg.Routing.Prefix.BlockSize
	var models []string
	for _, ec := range cfg.Endpoints {
		base, _ := normalizeURL(ec.URL)
		p := g.pools[ec.Model]
		if p == nil {
			p = &pool{model: ec.Model, blockSize: routingBlock, seed: prefix.Seed(ec.Model + "\x00")}
			g.pools[ec.Model] = p
			models = append(models, ec.Model)
		}
		p.endpoints = append(p.endpoints, byURL[base])
	}
	for _, model := range models {
		p := g.pools[model]
		capacity := make([]int, len(p.endpoints))
		for i, ep := range p.endpoints {
			capacity[i] = max(1, ep.kvBlocks*ep.blockSize/routingBlock)
			p.maxModelLen = max(p.maxModelLen, ep.maxModelLen) // a bound wherever the request goes
		}
		p.scraper = g.scraper
		sp := sched.Pool{Capacity: capacity}
		if allKVEvents(p.endpoints) {
			if p.precise, err = prefix.NewPreciseIndex(len(p.endpoints), routingBlock); err != nil {
				g.transport.CloseIdleConnections()
				return nil, fmt.Errorf("precise prefix index for model %q: %w", model, err)
			}
			for i, ep := range p.endpoints {
				// The engine's blocks in all its tiers bound what the index
				// holds of it (its events may announce more: lost removals,
				// a broken or hostile engine).
				p.precise.SetCapacity(i, capacity[i]+ep.kvEvents.OffloadBlocks)
			}
			sp.Precise = p.precise.On(prefix.MediumGPU)
			p.precisePolicy = sched.UsesPrecise(cfg.Routing)
		}
		if p.policy, err = sched.NewPolicy(cfg.Routing, sp); err != nil {
			g.transport.CloseIdleConnections()
			return nil, fmt.Errorf("routing policy for model %q: %w", model, err)
		}
		if f, ok := p.policy.(sched.Forgetter); ok {
			for i, ep := range p.endpoints {
				ep.onDown = append(ep.onDown, func() { f.Forget(i) })
			}
		}
		g.policyName = p.policy.Name()
		p.none = m.route(model, "", g.policyName)
		for _, ep := range p.endpoints {
			p.routes = append(p.routes, m.route(model, ep.name, g.policyName))
		}
		if (p.policy.NeedsHashes() || p.precise != nil) && g.tokenizer == nil {
			if g.tokenizer, err = prefix.NewTokenizer(); err != nil {
				g.transport.CloseIdleConnections()
				return nil, fmt.Errorf("gateway: %w", err)
			}
			g.segments = prefix.NewSegmentCache(g.tokenizer, 0)
		}
	}
	g.unknown = m.route(unknownModel, "", g.policyName)
	if err := g.initTargets(reg); err != nil {
		g.transport.CloseIdleConnections()
		return nil, err
	}
	g.affinity = newResponseAffinity(cfg.Responses.AffinityMaxEntries)
	if err := g.setupResilience(reg); err != nil {
		g.transport.CloseIdleConnections()
		return nil, err
	}
	if g.engineAuthFailures, err = newAuthFailures(reg); err != nil {
		g.transport.CloseIdleConnections()
		return nil, err
	}
	g.ejectRefused(refused, time.Now())
	if err := g.initHold(reg); err != nil {
		g.transport.CloseIdleConnections()
		return nil, err
	}

	list := openai.ModelList{Object: openai.ObjectList, Data: make([]openai.Model, len(models))}
	created := time.Now().Unix()
	for i, model := range models {
		list.Data[i] = openai.Model{ID: model, Object: openai.ObjectModel, Created: created, OwnedBy: "infergate", Root: model}
	}
	list.Data = append(list.Data, g.aliasModels(created)...)
	slices.SortFunc(list.Data, func(a, b openai.Model) int { return strings.Compare(a.ID, b.ID) })
	g.modelBodies = make(map[string][]byte, len(list.Data))
	for _, m := range list.Data {
		if g.modelBodies[m.ID], err = json.Marshal(m); err != nil {
			g.transport.CloseIdleConnections()
			return nil, fmt.Errorf("gateway: encode model %q: %w", m.ID, err)
		}
	}
	if g.modelsBody, err = json.Marshal(list); err != nil {
		g.transport.CloseIdleConnections()
		return nil, fmt.Errorf("gateway: encode model list: %w", err)
	}
	if err := g.initEdge(reg); err != nil {
		g.transport.CloseIdleConnections()
		return nil, err
	}
	g.metricsHandler = promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{})
	g.dash.init(time.Now())
	g.handler = http.HandlerFunc(g.route)

	if err := g.setupKVEvents(reg); err != nil {
		g.transport.CloseIdleConnections()
		return nil, err
	}
	if err := g.initObservability(reg); err != nil {
		g.transport.CloseIdleConnections()
		return nil, err
	}
	ctx, stop := context.WithCancel(context.Background())
	g.stop = stop
	for _, ep := range g.endpoints {
		g.wg.Add(1)
		go g.healthLoop(ctx, ep)
	}
	if g.scraper != nil {
		g.wg.Go(func() { g.scraper.Run(ctx) })
	}
	g.startKVEvents(ctx)
	return g, nil
}

// discover fills in the KV capacity of endpoints configured with kv_blocks 0
// from their vllm:cache_config_info, and the context length of those with
// max_model_len 0 from their GET /v1/models, and probes every endpoint once,
// all concurrently, within HealthCheckTimeout each. It returns the
// endpoints that refused the gateway's credentials (401/403) on one of
// those reads, with the status (ejectRefused).
func (g *Gateway) discover() map[*endpoint]int {
	ctx := context.Background()
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		refused = map[*endpoint]int{}
	)
	for _, ep := range g.endpoints {
		wg.Go(func() {
			note := func(err error) {
				var st authStatus
				if errors.As(err, &st) {
					mu.Lock()
					refused[ep] = int(st)
					mu.Unlock()
				}
			}
			if ep.kvBlocks == 0 {
				ep.kvBlocks = DefaultKVBlocks
				cc, err := g.fetchCacheConfig(ctx, ep)
				if err == nil {
					ep.kvBlocks, ep.blockSize = cc.numGPUBlocks, cc.blockSize
				}
				note(err)
			}
			if ep.maxModelLen == 0 {
				ep.maxModelLen = DefaultMaxModelLen
				n, err := g.fetchMaxModelLen(ctx, ep)
				if err == nil {
					ep.maxModelLen = n
				}
				note(err)
			}
			g.checkHealth(ctx, ep)
		})
	}
	wg.Wait()
	return refused
}

// newTransport returns the one upstream transport: many concurrent streams
// to few hosts, no compression (SSE must be parsed as it arrives), no proxy
// from the environment (engines are reached directly).
func newTransport(cfg Config) *http.Transport {
	dialer := &net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}
	return &http.Transport{
		DialContext:           dialer.DialContext,
		ForceAttemptHTTP2:     true,
		MaxIdleConns:          0, // no global limit; per host below
		MaxIdleConnsPerHost:   cfg.MaxIdleConnsPerHost,
		IdleConnTimeout:       cfg.IdleConnTimeout,
		TLSHandshakeTimeout:   cfg.ConnectTimeout,
		ResponseHeaderTimeout: cfg.ResponseHeaderTimeout,
		ExpectContinueTimeout: 0,
		DisableCompression:    true,
		WriteBufferSize:       32 << 10,
		ReadBufferSize:        32 << 10,
		// An engine's headers are small; a hostile or broken one cannot
		// make the gateway buffer more than this (net/http's default: 10 MB).
		MaxResponseHeaderBytes: maxUpstreamHeaderBytes,
	}
}

// Handler returns the gateway's HTTP handler (all routes).
func (g *Gateway) Handler() http.Handler { return g.handler }

// Server returns an http.Server for the gateway on cfg.Listen with timeouts
// suited to long streams: headers must arrive within read_header_timeout
// and idle keep-alive connections close after idle_timeout, but there is no
// overall write timeout (a generation may stream for minutes; the handler
// bounds each write by write_timeout instead). With TLS configured,
// TLSConfig is set: serve with ServeTLS(ln, "", "") or
// ListenAndServeTLS("", ""). Its BaseContext is the gateway's, so Abort
// reaches every request in flight (see Drain and Abort for shutting down).
func (g *Gateway) Server() *http.Server {
	return &http.Server{
		Addr:              g.cfg.Listen,
		Handler:           g.handler,
		BaseContext:       g.BaseContext,
		ReadHeaderTimeout: g.cfg.ReadHeaderTimeout,
		IdleTimeout:       g.cfg.IdleTimeout,
		MaxHeaderBytes:    serverHeaderBytes(g.cfg.MaxHeaderBytes),
		TLSConfig:         g.tlsConfig,
	}
}

// Config returns the gateway's effective (defaulted) configuration, with
// discovered KV capacities filled in.
func (g *Gateway) Config() Config {
	c := g.cfg
	c.Endpoints = slices.Clone(c.Endpoints)
	for i, ec := range c.Endpoints {
		base, _ := normalizeURL(ec.URL)
		for _, ep := range g.endpoints {
			if ep.name == base {
				c.Endpoints[i].KVBlocks, c.Endpoints[i].BlockSize = ep.kvBlocks, ep.blockSize
				c.Endpoints[i].MaxModelLen = ep.maxModelLen
			}
		}
	}
	return c
}

// Close stops the health checks and closes idle upstream connections. It
// does not wait for requests in flight (shut the http.Server down first).
// Safe to call more than once.
func (g *Gateway) Close() {
	g.closeOnce.Do(func() {
		g.stop()
		g.wg.Wait()
		g.up.CloseIdleConnections() // the transport's too
		g.closeObservability()
	})
}

// Paths served.
const (
	pathChat        = "/v1/chat/completions"
	pathCompletions = "/v1/completions"
	pathModels      = "/v1/models"
	pathMetrics     = "/metrics"
	pathHealthz     = "/healthz"
	pathReadyz      = "/readyz"
)

// route dispatches on the exact path, answering OpenAI errors for wrong
// methods (405) and unknown paths (404), after the edge checks (header size,
// API key: limits.go).
func (g *Gateway) route(w http.ResponseWriter, r *http.Request) {
	key, ok := g.checkEdge(w, r)
	if !ok {
		return
	}
	switch r.URL.Path {
	case pathChat:
		if g.allow(w, r, http.MethodPost) {
			g.serveInference(w, r, kindChat, key)
		}
	case pathCompletions:
		if g.allow(w, r, http.MethodPost) {
			g.serveInference(w, r, kindCompletion, key)
		}
	case pathModels:
		if g.allow(w, r, http.MethodGet) {
			writeJSON(w, http.StatusOK, g.modelsBodyFor(key))
		}
	case pathMetrics:
		if g.allow(w, r, http.MethodGet) {
			g.metricsHandler.ServeHTTP(w, r)
		}
	case pathDashboard:
		if g.allow(w, r, http.MethodGet) {
			g.serveDashboard(w)
		}
	case pathDashboardState:
		if g.allow(w, r, http.MethodGet) {
			g.serveDashboardState(w)
		}
	case pathHealthz:
		if g.allow(w, r, http.MethodGet) {
			writeJSON(w, http.StatusOK, []byte(`{"status":"ok"}`))
		}
	case pathReadyz:
		if g.allow(w, r, http.MethodGet) {
			g.serveReadyz(w)
		}
	default:
		if model, ok := strings.CutPrefix(r.URL.Path, pathModels+"/"); ok && model != "" {
			if g.allow(w, r, http.MethodGet) {
				g.serveModel(w, model, key)
			}
			return
		}
		if g.routePassthrough(w, r, key) {
			return
		}
		openai.WriteError(w, openai.NewError(http.StatusNotFound,
			fmt.Sprintf("Invalid URL (%s %s)", r.Method, r.URL.Path), "", "not_found"))
	}
}

// serveModel answers GET /v1/models/{model} (OpenAI's "retrieve model"; a
// model name may contain '/'): the model's entry of GET /v1/models, or 404
// model_not_found, the same for a model the key may not use.
func (g *Gateway) serveModel(w http.ResponseWriter, model string, key *principal) {
	b, ok := g.modelBodies[model]
	if !ok || (key != nil && !key.allows(model)) {
		openai.WriteError(w, modelNotAllowed(model))
		return
	}
	writeJSON(w, http.StatusOK, b)
}

// allow answers 405 unless r's method is method (GET also admits HEAD).
func (g *Gateway) allow(w http.ResponseWriter, r *http.Request, method string) bool {
	if r.Method == method || (method == http.MethodGet && r.Method == http.MethodHead) {
		return true
	}
	allowed := method
	if method == http.MethodGet {
		allowed = "GET, HEAD"
	}
	w.Header().Set("Allow", allowed)
	openai.WriteError(w, openai.NewError(http.StatusMethodNotAllowed,
		fmt.Sprintf("Method %s is not allowed for %s (use %s).", r.Method, r.URL.Path, method), "", "method_not_allowed"))
	if proxiedPath(r.URL.Path) {
		g.count(w, g.unknown, http.StatusMethodNotAllowed)
	}
	return false
}

// readiness is the body of GET /readyz.
type readiness struct {
	Status    string `json:"status"`
	Ready     int    `json:"ready_endpoints"`
	Endpoints int    `json:"endpoints"`
	Reason    string `json:"reason,omitempty"`
}

// serveReadyz answers 200 while at least one endpoint is in rotation and
// the gateway is not shutting down, else 503 with the reason.
func (g *Gateway) serveReadyz(w http.ResponseWriter) {
	rd := readiness{Status: "ready", Endpoints: len(g.endpoints)}
	for _, ep := range g.endpoints {
		if ep.ready.Load() {
			rd.Ready++
		}
	}
	status := http.StatusOK
	switch {
	case g.draining.Load():
		status = http.StatusServiceUnavailable
		rd.Status = "not ready"
		rd.Reason = "shutting down"
	case rd.Ready == 0:
		status = http.StatusServiceUnavailable
		rd.Status = "not ready"
		rd.Reason = fmt.Sprintf("no endpoint is ready (0 of %d healthy and not ejected)", rd.Endpoints)
	}
	body, _ := json.Marshal(rd)
	writeJSON(w, status, body)
}

// writeJSON writes a JSON body with status.
func writeJSON(w http.ResponseWriter, status int, body []byte) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
