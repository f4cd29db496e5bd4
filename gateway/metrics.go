package gateway

import (
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/sched"
)

// unknownModel is the model label of requests whose model is not configured
// (or could not be read), keeping label cardinality bounded.
const unknownModel = "unknown"

// Status codes recorded in infergate_requests_total besides HTTP statuses.
const (
	// codeClientClosed is recorded when the client went away before the
	// response was complete (nginx's 499 "client closed request").
	codeClientClosed = 499
)

// latencyBuckets suit LLM latencies: 1 ms to 10 min, roughly ×2.5 apart
// (seconds).
var latencyBuckets = []float64{
	0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
	1, 2.5, 5, 10, 20, 40, 80, 160, 320, 600,
}

// itlBuckets suit inter-token gaps: 0.5 ms to 10 s (seconds).
var itlBuckets = []float64{
	0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04,
	0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
}

// metrics are the gateway's Prometheus collectors.
type metrics struct {
	requests  *prometheus.CounterVec   // model, endpoint, policy, code
	ttft      *prometheus.HistogramVec // model, endpoint, policy
	itl       *prometheus.HistogramVec
	e2e       *prometheus.HistogramVec
	prompt    *prometheus.CounterVec
	cached    *prometheus.CounterVec
	generated *prometheus.CounterVec
	predicted *prometheus.CounterVec
	// predictedTier splits predicted by KV tier (model, endpoint, policy,
	// tier) in pools with tiers.
	predictedTier *prometheus.CounterVec
	predErr       *prometheus.HistogramVec // model, endpoint, policy, index
	// tokenizer is 1 per model for the tokenizer routing uses (model,
	// tokenizer: the configured path, or cl100k_fallback).
	tokenizer *prometheus.GaugeVec
	// loraPicks counts adapter requests' picks by placement; adapters
	// is the adapters served per base model (adapters.go).
	loraPicks *prometheus.CounterVec // model, placement
	adapters  *prometheus.GaugeVec   // model
	// api counts requests received per API (infergate_api_requests_total;
	// children resolved at start).
	api [numKinds]prometheus.Counter
}

// Prefix index label values of infergate_prefix_prediction_error_tokens.
const (
	indexApproximate = iota
	indexPrecise
)

var indexNames = [...]string{indexApproximate: "approximate", indexPrecise: "precise"}

// predictionBuckets are absolute prediction errors (tokens).
var predictionBuckets = []float64{0, 16, 64, 256, 1024, 4096, 16384, 65536}

func newMetrics(reg prometheus.Registerer, fleet *fleetCollector) (*metrics, error) {
	base := []string{"model", "endpoint", "policy"}
	hist := func(name, help string, buckets []float64) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "infergate", Name: name, Help: help, Buckets: buckets,
		}, base)
	}
	counter := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: name, Help: help}, base)
	}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "infergate", Name: "requests_total",
			Help: "Inference requests by model, endpoint, policy and HTTP status code (499: client closed the request).",
		}, []string{"model", "endpoint", "policy", "code"}),
		ttft: hist("time_to_first_token_seconds",
			"Time from receiving a streaming request to relaying its first output token (seconds).", latencyBuckets),
		itl: hist("inter_token_latency_seconds",
			"Gap between consecutive output events of a stream (seconds).", itlBuckets),
		e2e: hist("e2e_request_latency_seconds",
			"Time from receiving a request to the end of its response, successful requests only (seconds).", latencyBuckets),
		prompt:    counter("prompt_tokens_total", "Prompt tokens reported by the engines' usage (tokens)."),
		cached:    counter("cached_prompt_tokens_total", "Prompt tokens the engines served from their prefix cache (usage.prompt_tokens_details.cached_tokens; tokens)."),
		generated: counter("generation_tokens_total", "Completion tokens reported by the engines' usage (tokens)."),
		predicted: counter("prefix_predicted_matched_tokens_total", "Prompt tokens the routing policy predicted the chosen endpoint holds (matched blocks × routing block size; tokens)."),
		predictedTier: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "prefix_predicted_tier_tokens_total",
			Help: "Prompt tokens the routing policy predicted the chosen endpoint takes from each KV tier (tier: gpu, cpu, disk, remote; the split of prefix_predicted_matched_tokens_total in pools whose endpoints have kv_events.tiers or a kv_store; engines report only the total, cached_prompt_tokens_total; tokens)."},
			[]string{"model", "endpoint", "policy", "tier"}),
		predErr: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "infergate", Name: "prefix_prediction_error_tokens",
			Help:    "Absolute difference between the prompt tokens a prefix index predicted the chosen endpoint holds and the cached tokens it reported, per request (index: approximate = learnt from routing, precise = fed by KV events; tokens).",
			Buckets: predictionBuckets,
		}, []string{"model", "endpoint", "policy", "index"}),
	}
	m.tokenizer = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "infergate", Name: "pool_tokenizer",
		Help: "1 for the tokenizer a model's routing tokenizes prompts with (tokenizer: the configured tokenizers path, engine_render for render: engine, or cl100k_fallback when none is configured); absent when the model's routing does not tokenize."},
		[]string{"model", "tokenizer"})
	m.loraPicks = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "lora_picks_total",
		Help: "Picks of requests for a LoRA adapter, by base model and where the adapter stood on the endpoint picked (vllm:lora_requests_info as last scraped): resident (running or waiting there), free_slot (fewer adapters active than max_lora), full (loading it competes for max_lora slots), unknown (no LoRA metric)."},
		[]string{"model", "placement"})
	m.adapters = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: "infergate", Name: "lora_adapters",
		Help: "LoRA adapters served on a base model: configured (adapters) and listed by its endpoints' GET /v1/models with it as parent."},
		[]string{"model"})
	apis := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "api_requests_total",
		Help: "Requests received per API (chat_completions, completions, responses, embeddings, tokenize, detokenize, responses_by_id, other: every other /v1/ path passed through)."},
		[]string{"api"})
	for k, name := range apiNames {
		m.api[k] = apis.WithLabelValues(name)
	}
	for _, c := range []prometheus.Collector{m.requests, m.ttft, m.itl, m.e2e, m.prompt, m.cached, m.generated, m.predicted, m.predictedTier, m.predErr, m.tokenizer, m.loraPicks, m.adapters, apis, fleet} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register gateway metrics: %w", err)
		}
	}
	return m, nil
}

// TokenizerFallback is infergate_pool_tokenizer's label for a model
// tokenized with cl100k_base because no tokenizer is configured for it.
const TokenizerFallback = "cl100k_fallback"

// TokenizerEngine is infergate_pool_tokenizer's label for a model whose
// routing asks its engines for the ids (render: engine); its fallbacks are
// counted in infergate_render_fallbacks_total.
const TokenizerEngine = "engine_render"

// poolTokenizer sets model's infergate_pool_tokenizer: path when the pool
// tokenizes with it (own), else the cl100k fallback when it tokenizes at
// all (tokenizes); its previous series go.
func (m *metrics) poolTokenizer(model, path string, own, tokenizes bool) {
	m.tokenizer.DeletePartialMatch(prometheus.Labels{"model": model})
	switch {
	case own:
		m.tokenizer.WithLabelValues(model, path).Set(1)
	case tokenizes:
		m.tokenizer.WithLabelValues(model, TokenizerFallback).Set(1)
	}
}

// routeMetrics are the children of the per-(model, endpoint) metrics,
// resolved once at start so the request path does no label lookups.
type routeMetrics struct {
	ok                       prometheus.Counter // requests_total{code="200"}
	ttft, itl, e2e           prometheus.Observer
	prompt, cached, generate prometheus.Counter
	predicted                prometheus.Counter
	predictedTier            [sched.NumTiers]prometheus.Counter // nil unless the pool has tiers (tiered)
	predErr                  [2]prometheus.Observer             // by index
	labels                   [3]string                          // model, endpoint, policy
}

func (m *metrics) route(model, endpoint, policy string) *routeMetrics {
	rm := &routeMetrics{
		ok:        m.requests.WithLabelValues(model, endpoint, policy, "200"),
		ttft:      m.ttft.WithLabelValues(model, endpoint, policy),
		itl:       m.itl.WithLabelValues(model, endpoint, policy),
		e2e:       m.e2e.WithLabelValues(model, endpoint, policy),
		prompt:    m.prompt.WithLabelValues(model, endpoint, policy),
		cached:    m.cached.WithLabelValues(model, endpoint, policy),
		generate:  m.generated.WithLabelValues(model, endpoint, policy),
		predicted: m.predicted.WithLabelValues(model, endpoint, policy),
		labels:    [3]string{model, endpoint, policy},
	}
	if endpoint != "" { // no prediction without an endpoint
		for i, name := range indexNames {
			rm.predErr[i] = m.predErr.WithLabelValues(model, endpoint, policy, name)
		}
	}
	return rm
}

// tierNames label infergate_prefix_predicted_tier_tokens_total, by
// medium (prefix.Medium names, lower case).
var tierNames = [sched.NumTiers]string{"gpu", "cpu", "disk", "remote"}

// tiered resolves rm's per-tier prediction counters (a pool with tiers).
func (m *metrics) tiered(rm *routeMetrics) {
	for t, name := range tierNames {
		rm.predictedTier[t] = m.predictedTier.WithLabelValues(rm.labels[0], rm.labels[1], rm.labels[2], name)
	}
}

// count records one finished request with status code.
func (m *metrics) count(rm *routeMetrics, code int) {
	if code == 200 {
		rm.ok.Inc()
		return
	}
	m.requests.WithLabelValues(rm.labels[0], rm.labels[1], rm.labels[2], strconv.Itoa(code)).Inc()
}

// fleetCollector exposes the endpoints' in-flight counts and readiness at
// scrape time, straight from the atomics the request path maintains, so the
// request path pays nothing for these gauges; the endpoints are those of
// the configuration in force.
type fleetCollector struct {
	g        *Gateway
	inFlight *prometheus.Desc
	ready    *prometheus.Desc
}

func newFleetCollector(g *Gateway) *fleetCollector {
	return &fleetCollector{
		g: g,
		inFlight: prometheus.NewDesc("infergate_endpoint_in_flight_requests",
			"Requests the gateway has sent to the endpoint that have not finished (requests).", []string{"endpoint"}, nil),
		ready: prometheus.NewDesc("infergate_endpoint_ready",
			"1 if the endpoint is in rotation (healthy and not ejected), else 0.", []string{"endpoint"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *fleetCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.inFlight
	ch <- c.ready
}

// Collect implements prometheus.Collector.
func (c *fleetCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.g.state.Load()
	if st == nil {
		return
	}
	for _, ep := range st.endpoints {
		ready := 0.0
		if ep.ready.Load() {
			ready = 1
		}
		ch <- prometheus.MustNewConstMetric(c.inFlight, prometheus.GaugeValue, float64(ep.ledger.InFlight()), ep.name)
		ch <- prometheus.MustNewConstMetric(c.ready, prometheus.GaugeValue, ready, ep.name)
	}
}

// resilienceMetrics are the collectors of retries, ejections and admission.
type resilienceMetrics struct {
	retries       *prometheus.CounterVec   // model, endpoint (failed), reason
	retriesDenied *prometheus.CounterVec   // model, reason
	ejections     *prometheus.CounterVec   // endpoint, reason
	rejections    *prometheus.CounterVec   // model, reason
	queueWait     *prometheus.HistogramVec // model
	gauges        *admissionCollector
}

func newResilienceMetrics(reg prometheus.Registerer, g *Gateway) (*resilienceMetrics, error) {
	m := &resilienceMetrics{
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "retries_total",
			Help: "Requests resent to another endpoint, by model, the endpoint that failed and the failure (connect_failure, connection_lost, 5xx, timeout, error_event, bad_response, auth)."},
			[]string{"model", "endpoint", "reason"}),
		retriesDenied: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "retries_denied_total",
			Help: "Retryable failures answered without a retry: the retry budget was spent (budget) or no other endpoint could take the request (no_endpoint)."},
			[]string{"model", "reason"}),
		ejections: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "endpoint_ejections_total",
			Help: "Passive ejections of an endpoint by the failure that triggered them (connect_failure and auth at once; others after outlier.consecutive_errors in a row)."},
			[]string{"endpoint", "reason"}),
		rejections: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "admission_rejections_total",
			Help: "Requests refused by admission control, by model and reason: 429 queue_full, queue_timeout, displaced (a queued request that made room for one of higher priority); 503 shutdown (queued, or arriving, when the gateway began shutting down)."},
			[]string{"model", "reason"}),
		queueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "infergate", Name: "admission_queue_wait_seconds",
			Help: "Time requests spent in the admission queue, admitted or not (only requests that queued; seconds).", Buckets: latencyBuckets},
			[]string{"model"}),
		gauges: &admissionCollector{g: g,
			queue: prometheus.NewDesc("infergate_admission_queue_length",
				"Requests waiting in the model's admission queue.", []string{"model"}, nil),
			active: prometheus.NewDesc("infergate_admission_in_flight_requests",
				"Requests of the model admitted and not finished.", []string{"model"}, nil),
			held: prometheus.NewDesc("infergate_held_requests",
				"Requests of the model held now because its pool has no ready endpoint (scale_from_zero; they count in infergate_admission_queue_length too).", []string{"model"}, nil),
		},
	}
	for _, c := range []prometheus.Collector{m.retries, m.retriesDenied, m.ejections, m.rejections, m.queueWait, m.gauges} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register gateway metrics: %w", err)
		}
	}
	return m, nil
}

// admissionCollector exposes the admission queues' lengths and admitted
// counts at scrape time.
type admissionCollector struct {
	g                   *Gateway
	queue, active, held *prometheus.Desc
}

// Describe implements prometheus.Collector.
func (c *admissionCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.queue
	ch <- c.active
	ch <- c.held
}

// Collect implements prometheus.Collector.
func (c *admissionCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.g.state.Load()
	if st == nil {
		return
	}
	for model, p := range st.pools {
		ch <- prometheus.MustNewConstMetric(c.queue, prometheus.GaugeValue, float64(p.gate.waiting.Load()), model)
		ch <- prometheus.MustNewConstMetric(c.active, prometheus.GaugeValue, float64(p.gate.active.Load()), model)
		ch <- prometheus.MustNewConstMetric(c.held, prometheus.GaugeValue, float64(p.gate.heldNow.Load()), model)
	}
}

// setupResilience registers the resilience metrics (called by New; the
// pools get their admission gates from newGate as they are built).
func (g *Gateway) setupResilience(reg prometheus.Registerer) error {
	m, err := newResilienceMetrics(reg, g)
	if err != nil {
		return err
	}
	g.res = m
	return nil
}

// reloadMetrics count reloads, as Prometheus and Alertmanager name theirs.
type reloadMetrics struct {
	success, failure prometheus.Counter
	lastSuccess      prometheus.Gauge // unix seconds
	lastOK           prometheus.Gauge // 1 or 0
}

func newReloadMetrics(reg prometheus.Registerer) (*reloadMetrics, error) {
	total := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "config_reloads_total",
		Help: "Configuration reloads (SIGHUP) by result: success, or failure (the new configuration was refused; the one in force stays)."},
		[]string{"result"})
	m := &reloadMetrics{
		success: total.WithLabelValues("success"),
		failure: total.WithLabelValues("failure"),
		lastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "infergate", Name: "config_last_reload_success_timestamp_seconds",
			Help: "When the configuration in force was loaded: at start or by the last successful reload (unix seconds)."}),
		lastOK: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "infergate", Name: "config_last_reload_successful",
			Help: "1 if the last configuration load (start or reload) succeeded, 0 if the last reload was refused."}),
	}
	for _, c := range []prometheus.Collector{total, m.lastSuccess, m.lastOK} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("gateway: register reload metrics: %w", err)
		}
	}
	return m, nil
}

// succeeded records a successful load at now (start or reload). A start is
// not counted in config_reloads_total.
func (m *reloadMetrics) succeeded(now time.Time) {
	m.lastSuccess.Set(float64(now.UnixNano()) / 1e9)
	m.lastOK.Set(1)
}

func (m *reloadMetrics) failed() {
	m.failure.Inc()
	m.lastOK.Set(0)
}
