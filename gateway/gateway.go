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
	"fmt"
	"math"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/hftokenizer"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/upstream"
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
	// slotsHook, set by tests before a reload (nil otherwise), is called
	// by commit while slots change hands: the KV feeds' new appliers set,
	// the slots they take not yet forgotten, the feeds held (commit.go).
	slotsHook func()
	// probeWaitHook, set by tests (nil otherwise), is called by every
	// health loop with each wait it schedules (health.go probeWait).
	probeWaitHook atomic.Pointer[func(ep *endpoint, now time.Time, wait time.Duration)]
	// readinessHold, when set, is why the gateway reports not ready
	// (HoldReadiness: discovery not synced yet).
	readinessHold readinessHoldPtr
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
	// up sends the request path's upstream requests (package upstream).
	transport *http.Transport
	// prober makes the health checks and the discovery reads (fleet.Prober,
	// on transport).
	prober fleet.Prober
	// phaseSeed spreads the endpoints' periodic reads over their periods
	// (fleet.PhaseOffset; fleet.HostSeed, set in New): health probes,
	// metrics scrapes, model-list reads.
	phaseSeed uint64
	up        *upstream.Client
	// rt sends upstream requests (up, or a fake in benchmarks).
	rt http.RoundTripper

	// segments is the one segment cache of every pool's tokenizer (made
	// by the first build that needs it, under reloadMu).
	segments *prefix.SegmentCache
	// hfTokenizers are the models' own tokenizers loaded so far, by path
	// (under reloadMu): a reload that keeps a pool's tokenizer path does
	// not read the file again.
	hfTokenizers map[string]*hftokenizer.Tokenizer

	metrics *metrics
	unknown *routeMetrics // model "unknown", no endpoint
	res     *resilienceMetrics
	pdm     *pdMetrics   // P/D (pd.go)
	hold    *byteBudget  // bytes of non-streaming answers held (hold.go)
	bodies  *byteBudget  // bytes of request bodies being read (bodybudget.go)
	held    *byteBudget  // bytes of request bodies held by requests in progress (bodybudget.go)
	cold    *holdMetrics // scale from zero: requests held while no endpoint is ready (coldstart.go)
	// render is the engine render client of render: engine pools (render.go).
	render *engineRender
	// replicas is the exchange with the other gateway replicas
	// (replicas.go; its node nil when off).
	replicas *replicas
	// scale is the pools' autoscaling decisions (autoscale.go).
	scale scalers

	edge // TLS, trusted proxies, edge metrics (edge.go)

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

	// settles are the pools whose policies' queued learning the settler
	// applies, each at most once (learning.go).
	settles chan *pool
	// settleNow ends the settler's wait early (capacity 1; learning.go).
	settleNow chan struct{}
	// rebuildReq asks for a rebuild of the state from the configuration
	// in force (reload.go rebuildSoon; capacity 1).
	rebuildReq chan struct{}

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

// New builds a gateway for cfg (defaulted and validated here), registering
// its metrics on reg (nil: a new private registry that also carries the Go
// and process collectors; /metrics serves reg when it is a
// prometheus.Gatherer, else the default gatherer). For endpoints with
// kv_blocks 0 it reads the engine's /metrics, and it probes every endpoint
// once before returning, maxDiscoveryProbes at a time (build.go): an engine
// that does not answer holds New for one HealthCheckTimeout, its first
// unanswered read ending its reads; ctx bounds those start-up reads and
// probes (canceled, New returns its error).
// Endpoints that are down at start join when their health check first
// succeeds. A failed New has released everything it started (Close is its
// one cleanup path). Reload applies a new configuration to the running
// gateway; Close stops it.
func New(ctx context.Context, cfg Config, reg prometheus.Registerer) (*Gateway, error) {
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
	g.prober = fleet.Prober{Transport: g.transport, Timeout: cfg.HealthCheckTimeout}
	g.phaseSeed = fleet.HostSeed()
	g.rt = g.up
	g.retryAfter = strconv.Itoa(max(1, int(math.Ceil(cfg.HealthCheckInterval.Seconds()))))
	var idb [6]byte
	_, _ = rand.Read(idb[:])
	g.reqIDPrefix = "ig-" + hex.EncodeToString(idb[:]) + "-"
	g.loops, g.stop = context.WithCancel(context.Background())
	g.startSettler()
	g.rebuildReq = make(chan struct{}, 1)
	fail := func(err error) (*Gateway, error) {
		g.Close() // the one cleanup path, whatever was started
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
	if g.render, err = newEngineRender(reg, g.transport); err != nil {
		return fail(err)
	}
	if g.cold, err = newHoldMetrics(reg); err != nil {
		return fail(err)
	}
	if g.pdm, err = newPDMetrics(reg); err != nil {
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
	if err := g.initBodyBudget(reg); err != nil {
		return fail(err)
	}
	if err := g.initEdge(reg); err != nil {
		return fail(err)
	}
	if g.reloads, err = newReloadMetrics(reg); err != nil {
		return fail(err)
	}
	if err := g.initReplicas(reg); err != nil {
		return fail(err)
	}
	if err := reg.Register(newKVCollector(g)); err != nil {
		return fail(fmt.Errorf("gateway: register KV-event metrics: %w", err))
	}
	g.metricsHandler = promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{MaxRequestsInFlight: maxMetricsScrapes})
	g.dash.init(time.Now())
	g.handler = http.HandlerFunc(g.route)
	if err := g.initObservability(reg); err != nil {
		return fail(err)
	}

	// The start-up reads and probes end with ctx or with Close.
	bctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(g.loops, cancel)()
	g.reloadMu.Lock()
	st, plan, err := g.build(bctx, cfg, nil)
	if err == nil {
		err = ctx.Err() // canceled while probing: not started
	}
	if err != nil {
		g.reloadMu.Unlock()
		return fail(err)
	}
	g.commit(st, plan, nil)
	g.reloadMu.Unlock()
	g.runRebuilds()
	if err := g.startReplicas(); err != nil {
		return fail(err)
	}
	if err := g.startAutoscale(reg); err != nil {
		return fail(err)
	}
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
