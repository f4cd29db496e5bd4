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
	"fmt"
	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/upstream"
	"math"
	"net"
	"net/http"
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
	// cfg is the configuration New was given (defaulted): what a reload
	// cannot change is read from it; what it can is in state.
	cfg Config
	// state is what a reload replaces: the pools, endpoints and keys, an
	// immutable snapshot the request path reads with one atomic load
	// (reload.go).
	state atomic.Pointer[state]
	// reloadMu serialises reloads (and New's first build); reloads
	// counts them.
	reloadMu sync.Mutex
	reloads  *reloadMetrics
	// gatesMu guards retired: the admission gates of models a reload
	// removed, drained at shutdown with the others while requests may
	// still wait in them.
	gatesMu sync.Mutex
	retired []*admission
	// fallbacks counts aliases' fallbacks (alias.go); affinity maps
	// response ids to the endpoints that stored them, across reloads
	// (responses.go).
	fallbacks *prometheus.CounterVec
	affinity  *responseAffinity
	// keyUsage are the per-key usage counters' vectors, whose children
	// follow a key's name across reloads (keyusage.go).
	keyUsage keyUsageVecs

	// transport serves health checks, metric scrapes and https engines;
	// up sends the request path's upstream requests (upstream.go).
	transport *http.Transport
	up        *upstream.Client
	// rt sends upstream requests (up, or a fake in benchmarks).
	rt http.RoundTripper

	// segments is the one segment cache of every pool's tokenizer (made
	// by the first build that needs it, under reloadMu).
	segments *prefix.SegmentCache

	metrics *metrics
	unknown *routeMetrics // model "unknown", no endpoint
	res     *resilienceMetrics
	hold    *holdBudget // bytes of non-streaming answers held (hold.go)

	edge // TLS, trusted proxies, edge metrics (limits.go)

	// engineAuthFailures counts engines' refusals of the gateway's
	// credentials (credentials.go).
	engineAuthFailures *prometheus.CounterVec

	handler        http.Handler
	metricsHandler http.Handler
	retryAfter     string // seconds, for 503 no_endpoint_available

	reqIDPrefix string
	reqIDSeq    atomic.Uint64

	exchanges sync.Pool // *exchange

	dash dashboard // GET /dashboard's recent figures (dashboard.go)

	// obs is the access log and tracer (nil when both are off;
	// accesslog.go, tracing.go).
	obs *observer

	// loops is the parent context of every endpoint's health loop and
	// feeds; stop (Close) ends them all, wg waits for them.
	loops     context.Context
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
// them, as one configuration has them: a reload builds new pools, which
// keep the state of the old ones (policy, indexes, admission gate, retry
// budget) as far as the endpoints remain (reload.go). Entry i of
// endpoints, routes, scrapes and every snapshot is the same endpoint, slot
// i: a slot keeps its endpoint across reloads, a removed endpoint's slot
// holds vacant until a new endpoint takes it, so the per-slot state of the
// policy and the precise index stays the same endpoint's.
type pool struct {
	model     string
	policy    sched.Policy
	endpoints []*endpoint
	routes    []*routeMetrics // per endpoint
	scrapes   []*scrapeFeed   // per endpoint, nil when not scraped
	scraped   bool            // some endpoint is
	capacity  []int           // per endpoint: the policy's bound (routing blocks)
	pcap      []int           // per endpoint: the precise index's bound (0: none)
	// policySlots is the number of slots the policy was built for.
	policySlots int
	live        int           // endpoints that are not vacant
	none        *routeMetrics // errors before an endpoint was picked
	blockSize   int           // routing block size (tokens)
	seed        uint64        // prefix.Seed(model + "\x00"): no cache salt
	snapshots   sync.Pool     // *[]sched.Endpoint
	// precise is the pool's index fed by its endpoints' KV events (nil
	// unless every endpoint publishes them); precisePolicy: the policy
	// scores with it, so its prediction is the policy's.
	precise       *prefix.PreciseIndex
	precisePolicy bool
	// tokenizer and segments tokenize prompts for the policy and the
	// precise index (nil when neither needs hashes).
	tokenizer *prefix.Tokenizer
	segments  *prefix.SegmentCache
	// maxModelLen is the longest context of its endpoints (tokens).
	maxModelLen int
	// maxRequests is the circuit breaker's bound per endpoint.
	maxRequests int
	// gate is the model's admission control; budget bounds its retries
	// (admission.go, retry.go). Both outlive reloads with the model.
	gate   *admission
	budget *retryBudget
	// modelJSON is the model name as a JSON string and modelHeader as a
	// header value (alias.go).
	modelJSON   []byte
	modelHeader []string
	// next is the pool of the same model that a reload published in its
	// place (nil while this one is in force, or after its model was
	// removed).
	next atomic.Pointer[pool]
}

// latest returns the model's pool in force: p, or the one reloads put in
// its place.
func (p *pool) latest() *pool {
	for n := p.next.Load(); n != nil; n = p.next.Load() {
		p = n
	}
	return p
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
	if p.scraped {
		now = time.Now()
	}
	for i, ep := range p.endpoints {
		s[i] = sched.Endpoint{Name: ep.name, Ready: ep.ready.Load()}
		ep.ledger.Fill(&s[i])
		if f := p.scrapes[i]; f != nil {
			if l, _, ok := f.latest(now); ok && l.HasQueue {
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
// Reload applies a new configuration to the running gateway.
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

	g := &Gateway{cfg: cfg}
	g.initShutdown()
	g.transport = newTransport(cfg)
	g.up = upstream.New(upstreamOptions(cfg), g.transport)
	g.rt = g.up
	g.retryAfter = strconv.Itoa(max(1, int(math.Ceil(cfg.HealthCheckInterval.Seconds()))))
	var idb [6]byte
	_, _ = rand.Read(idb[:])
	g.reqIDPrefix = "ig-" + hex.EncodeToString(idb[:]) + "-"
	g.loops, g.stop = context.WithCancel(context.Background())
	fail := func(err error) (*Gateway, error) {
		g.stop()
		g.transport.CloseIdleConnections()
		g.closeObservability()
		return nil, err
	}

	m, err := newMetrics(reg, newFleetCollector(g))
	if err != nil {
		return fail(err)
	}
	g.metrics = m
	g.unknown = m.route(unknownModel, "", cfg.Routing.Policy)
	if err := g.setupResilience(reg); err != nil {
		return fail(err)
	}
	if g.engineAuthFailures, err = newAuthFailures(reg); err != nil {
		return fail(err)
	}
	if err := g.initAliases(reg); err != nil {
		return fail(err)
	}
	g.affinity = newResponseAffinity(cfg.Responses.AffinityMaxEntries)
	if err := g.initHold(reg); err != nil {
		return fail(err)
	}
	if err := g.initEdge(reg); err != nil {
		return fail(err)
	}
	if g.reloads, err = newReloadMetrics(reg); err != nil {
		return fail(err)
	}
	if err := reg.Register(newKVCollector(g)); err != nil {
		return fail(fmt.Errorf("gateway: register KV-event metrics: %w", err))
	}
	g.metricsHandler = promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{})
	g.dash.init(time.Now())
	g.handler = http.HandlerFunc(g.route)
	if err := g.initObservability(reg); err != nil {
		return fail(err)
	}

	g.reloadMu.Lock()
	defer g.reloadMu.Unlock()
	st, plan, err := g.build(cfg, nil)
	if err != nil {
		return fail(err)
	}
	g.commit(st, plan, nil)
	g.reloads.succeeded(time.Now())
	warnOpenUsage(st)
	return g, nil
}

// upstreamOptions is the upstream client's part of cfg.
func upstreamOptions(cfg Config) upstream.Options {
	return upstream.Options{ConnectTimeout: cfg.ConnectTimeout, ResponseHeaderTimeout: cfg.ResponseHeaderTimeout,
		IdleConnTimeout: cfg.IdleConnTimeout, MaxIdleConnsPerHost: cfg.MaxIdleConnsPerHost, AllFallback: stdTransport}
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
		MaxResponseHeaderBytes: upstream.MaxHeaderBytes,
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

// Config returns the gateway's effective (defaulted) configuration, the
// latest reload's, with discovered KV capacities and context lengths
// filled in.
func (g *Gateway) Config() Config {
	st := g.state.Load()
	c := st.cfg
	c.Endpoints = slices.Clone(c.Endpoints)
	byURL := make(map[string]*endpoint, len(st.endpoints))
	for _, ep := range st.endpoints {
		byURL[ep.name] = ep
	}
	for i, ec := range c.Endpoints {
		base, _ := normalizeURL(ec.URL)
		if ep := byURL[base]; ep != nil {
			spec := ep.spec.Load()
			c.Endpoints[i].KVBlocks, c.Endpoints[i].BlockSize = spec.kvBlocks, spec.blockSize
			c.Endpoints[i].MaxModelLen = spec.maxModelLen
		}
	}
	return c
}

// Close stops the health checks, the feeds and the drains of removed
// endpoints, and closes idle upstream connections. It does not wait for
// requests in flight (shut the http.Server down first). Safe to call more
// than once; a reload after it is refused.
func (g *Gateway) Close() {
	g.closeOnce.Do(func() {
		g.reloadMu.Lock() // no reload starts anything after this
		g.stop()
		g.reloadMu.Unlock()
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
	st := g.state.Load() // the configuration this request is served by
	if r.ContentLength != 0 {
		// A body is declared (or chunked): its read is bounded whoever
		// answers, an early refusal included, after which net/http drains
		// up to 256 KiB of it before it writes the answer (a client that
		// declared a body and sent none held its connection for ever).
		// readBody sets it again for the requests that read their body.
		_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(g.cfg.BodyReadTimeout))
	}
	key, ok := g.checkEdge(w, r, st)
	if !ok {
		return
	}
	switch r.URL.Path {
	case pathChat:
		if g.allow(w, r, http.MethodPost) {
			g.serveInference(w, r, kindChat, key, st)
		}
	case pathCompletions:
		if g.allow(w, r, http.MethodPost) {
			g.serveInference(w, r, kindCompletion, key, st)
		}
	case pathModels:
		if g.allow(w, r, http.MethodGet) {
			writeJSON(w, http.StatusOK, st.modelsBodyFor(key))
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
			g.serveReadyz(w, st)
		}
	default:
		if model, ok := strings.CutPrefix(r.URL.Path, pathModels+"/"); ok && model != "" {
			if g.allow(w, r, http.MethodGet) {
				st.serveModel(w, model, key)
			}
			return
		}
		if g.routePassthrough(w, r, key, st) {
			return
		}
		closeUnread(w, r)
		openai.WriteError(w, openai.NewError(http.StatusNotFound,
			fmt.Sprintf("Invalid URL (%s %s)", r.Method, r.URL.Path), "", "not_found"))
		observedFor(w).failed("not_found")
	}
}

// closeUnread marks the answer to a request refused before its body was
// read to close the connection after it, when a body was declared: else
// net/http first drains the body (up to 256 KiB, bounded by route's read
// deadline), and a client that declared one and sent nothing would get
// its answer only at that deadline, then keep the connection as long
// again while the closing request body drains. The read deadline is moved
// to the past, so that drain ends at once. Closing is what net/http itself
// does with a larger unread body.
func closeUnread(w http.ResponseWriter, r *http.Request) {
	if r.ContentLength != 0 {
		closeConnection(w, r)
		_ = http.NewResponseController(w).SetReadDeadline(time.Unix(1, 0)) // long past
	}
}

// closeConnection asks for an HTTP/1.x connection to be closed after the
// answer (Connection: close), where what remains of the request body
// would otherwise be read and parsed as the next request. An HTTP/2
// request's body is its own stream's, ended with the stream; there
// net/http takes Connection: close as a request to close the whole shared
// connection (GOAWAY), which one client's bad request must not cost the
// other streams on it (the second attack run: 200 refused POSTs, 200 new
// TLS connections).
func closeConnection(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor == 1 {
		w.Header().Set("Connection", "close")
	}
}

// serveModel answers GET /v1/models/{model} (OpenAI's "retrieve model"; a
// model name may contain '/'): the model's entry of GET /v1/models, or 404
// model_not_found, the same for a model the key may not use.
func (st *state) serveModel(w http.ResponseWriter, model string, key *principal) {
	b, ok := st.modelBodies[model]
	if !ok || (key != nil && !key.allows(model)) {
		openai.WriteError(w, modelNotAllowed(model))
		observedFor(w).failed(openai.CodeModelNotFound)
		return
	}
	writeJSON(w, http.StatusOK, b)
}

// allow answers 405 unless r's method is method (GET also admits HEAD).
func (g *Gateway) allow(w http.ResponseWriter, r *http.Request, method string) bool {
	if method == http.MethodGet {
		closeUnread(w, r) // a GET path reads no body: one declared is never drained
	}
	if r.Method == method || (method == http.MethodGet && r.Method == http.MethodHead) {
		return true
	}
	allowed := method
	if method == http.MethodGet {
		allowed = "GET, HEAD"
	}
	w.Header().Set("Allow", allowed)
	closeUnread(w, r)
	openai.WriteError(w, openai.NewError(http.StatusMethodNotAllowed,
		fmt.Sprintf("Method %s is not allowed for %s (use %s).", r.Method, r.URL.Path, method), "", "method_not_allowed"))
	observedFor(w).failed("method_not_allowed")
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
func (g *Gateway) serveReadyz(w http.ResponseWriter, st *state) {
	rd := readiness{Status: "ready", Endpoints: len(st.endpoints)}
	for _, ep := range st.endpoints {
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
