package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/openai"
)

// Scale from zero (README "Scale from zero"): a pool with no ready endpoint
// holds its requests in its admission queue (admission.go) instead of
// answering 503 at once — bounded in count and bytes, each for at most
// hold_ttl, in priority order (X-Priority, FIFO within) — calls a wake-up
// hook once per cold episode, probes its endpoints every probe_interval
// while it holds requests, and dispatches them the moment one is ready.
// After hold_ttl a held request gets 503 no_endpoint_available with
// Retry-After. The semantics are llm-d's flow control with
// noEndpointRequestTTL (a queue-wait budget that replaces the normal one
// while the pool has no endpoints: "the queue acts as a scale-from-zero
// waiting room"; a request shed there is EvictedNoEndpoints and gets 503,
// not 429; llm-d-router flowcontrol Config, default 60 s) and KEDA's HTTP
// add-on interceptor (requests held per route while the backend has no
// ready endpoint, coldStart.maxPendingRequests / KEDA_HTTP_COLD_START_MAX_
// PENDING_REQUESTS, keda.sh/http-add-on/1.0 reference).

// Default scale-from-zero bounds (per pool) when hold_ttl turns it on.
const (
	DefaultMaxHeld          = 1024
	DefaultMaxHeldBytes     = 64 << 20
	DefaultHoldProbe        = 10 * time.Millisecond
	DefaultWakeTimeout      = 10 * time.Second
	maxWebhookResponseBytes = 64 << 10
)

// Wake-up hook kinds (scale_from_zero.wake.kind).
const (
	WakeNone    = ""
	WakeEngine  = "engine"  // POST <endpoint>/wake_up on the pool's endpoints (vLLM sleep mode)
	WakeWebhook = "webhook" // POST wake.url with {"pool","model","held"}
	WakeFunc    = "func"    // an in-process Waker (WakeConfig.Waker; embedding only)
)

// Waker wakes a pool that has no ready endpoint: it starts engines, scales
// a deployment up or wakes sleeping engines. The gateway calls it once per
// cold episode (from the first request held while no endpoint is ready
// until an endpoint is ready or no request is held any more), with a
// context bounded by wake.timeout; it should return once the wake-up was
// asked for, not wait for readiness (the health checks see that).
type Waker interface {
	Wake(ctx context.Context, pool string) error
}

// WakerFunc adapts a function to Waker.
type WakerFunc func(ctx context.Context, pool string) error

// Wake calls f.
func (f WakerFunc) Wake(ctx context.Context, pool string) error { return f(ctx, pool) }

// ScaleFromZeroConfig is one pool's scale_from_zero entry.
type ScaleFromZeroConfig struct {
	// HoldTTL is the longest a request is held while the pool has no
	// ready endpoint (llm-d's noEndpointRequestTTL); then 503
	// no_endpoint_available with Retry-After. 0 (the default): off, the
	// pool answers 503 at once. Size it above the engines' cold start.
	HoldTTL time.Duration `yaml:"hold_ttl"`
	// MaxHeld bounds the requests held at once (default 1024); beyond it
	// 503 no_endpoint_available at once.
	MaxHeld int `yaml:"max_held"`
	// MaxHeldBytes bounds the request bodies held at once (default 64
	// MiB).
	MaxHeldBytes int64 `yaml:"max_held_bytes"`
	// ProbeInterval is the health-check period of the pool's endpoints
	// that are not ready while it holds requests (default 10ms, from each
	// probe's start), so a held request is dispatched within it (plus a
	// probe's round trip) of an endpoint's readiness. Each probe is one
	// GET of the endpoint's health path: 100 a second per unready
	// endpoint of a holding pool at the default, only while it holds.
	ProbeInterval time.Duration `yaml:"probe_interval"`
	// Heartbeat, when set, writes an SSE comment (": keep-alive") to
	// held streaming requests at this period. The first one commits the
	// answer as a 200 event stream: an error after it (the hold expired,
	// the engine failed) is an SSE error event then [DONE].
	Heartbeat time.Duration `yaml:"heartbeat"`
	// Wake is the hook called once per cold episode.
	Wake WakeConfig `yaml:"wake"`
}

// WakeConfig is a pool's wake-up hook.
type WakeConfig struct {
	// Kind is "" (none), "engine", "webhook" or "func" (set by Waker).
	Kind string `yaml:"kind"`
	// URL is the webhook's URL (kind webhook).
	URL string `yaml:"url"`
	// Timeout bounds one call (default 10s).
	Timeout time.Duration `yaml:"timeout"`
	// Waker is the in-process hook (kind func, or set alone): the
	// embedded fleet's, or an autoscaler's. Not YAML.
	Waker Waker `yaml:"-"`
}

// forPool returns the scale_from_zero entry of model: its own, else "*",
// with defaults; the zero value (off) when neither is set.
func scaleFromZeroFor(m map[string]ScaleFromZeroConfig, model string) ScaleFromZeroConfig {
	c, ok := m[model]
	if !ok {
		c = m["*"]
	}
	return c.withDefaults()
}

func (c ScaleFromZeroConfig) withDefaults() ScaleFromZeroConfig {
	if c.HoldTTL <= 0 {
		return ScaleFromZeroConfig{}
	}
	if c.MaxHeld == 0 {
		c.MaxHeld = DefaultMaxHeld
	}
	if c.MaxHeldBytes == 0 {
		c.MaxHeldBytes = DefaultMaxHeldBytes
	}
	if c.ProbeInterval == 0 {
		c.ProbeInterval = DefaultHoldProbe
	}
	if c.Wake.Waker != nil && c.Wake.Kind == WakeNone {
		c.Wake.Kind = WakeFunc
	}
	if c.Wake.Timeout == 0 {
		c.Wake.Timeout = DefaultWakeTimeout
	}
	return c
}

// validateScaleFromZero checks the scale_from_zero section.
func (c Config) validateScaleFromZero() []error {
	var errs []error
	for model, s := range c.ScaleFromZero {
		bad := func(format string, args ...any) {
			errs = append(errs, fmt.Errorf("scale_from_zero[%q]: "+format, append([]any{model}, args...)...))
		}
		switch {
		case s.HoldTTL < 0:
			bad("hold_ttl %v: must be >= 0 (0: off)", s.HoldTTL)
		case s.MaxHeld < 0:
			bad("max_held %d: must be >= 0", s.MaxHeld)
		case s.MaxHeldBytes < 0:
			bad("max_held_bytes %d: must be >= 0", s.MaxHeldBytes)
		case s.ProbeInterval < 0 || (s.ProbeInterval > 0 && s.ProbeInterval < time.Millisecond):
			bad("probe_interval %v: must be at least 1ms", s.ProbeInterval)
		case s.Heartbeat < 0 || (s.Heartbeat > 0 && s.Heartbeat < 100*time.Millisecond):
			bad("heartbeat %v: must be at least 100ms (0: none)", s.Heartbeat)
		case s.Wake.Timeout < 0:
			bad("wake.timeout %v: must be >= 0", s.Wake.Timeout)
		}
		switch s.Wake.Kind {
		case WakeNone, WakeEngine:
			if s.Wake.URL != "" {
				bad("wake.url is for kind webhook")
			}
		case WakeWebhook:
			if u, err := url.Parse(s.Wake.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
				bad("wake.url %q: want an http or https URL", s.Wake.URL)
			}
		case WakeFunc:
			if s.Wake.Waker == nil {
				bad("wake.kind func needs an in-process Waker (embedding only)")
			}
		default:
			bad("wake.kind %q: want engine, webhook or func", s.Wake.Kind)
		}
	}
	return errs
}

// holdMetrics are the scale-from-zero metrics, by model.
type holdMetrics struct {
	held     *prometheus.CounterVec   // model: requests held
	expired  *prometheus.CounterVec   // model: held requests answered 503 after hold_ttl
	rejected *prometheus.CounterVec   // model: refused at once, the hold full
	wakeups  *prometheus.CounterVec   // model, result
	heldTime *prometheus.HistogramVec // model: time held, dispatched or not
}

func newHoldMetrics(reg prometheus.Registerer) (*holdMetrics, error) {
	m := &holdMetrics{
		held: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "held_requests_total",
			Help: "Requests held because their model's pool had no ready endpoint (scale_from_zero)."}, []string{"model"}),
		expired: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "held_expired_total",
			Help: "Held requests answered 503 no_endpoint_available after scale_from_zero.hold_ttl."}, []string{"model"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "held_rejected_total",
			Help: "Requests answered 503 at once because the pool's hold was full (max_held or max_held_bytes)."}, []string{"model"}),
		wakeups: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "wakeups_total",
			Help: "Wake-up hook calls, one per cold episode, by model and result (ok, error)."}, []string{"model", "result"}),
		heldTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "infergate", Name: "held_seconds",
			Help:    "Time requests were held while their pool had no ready endpoint, dispatched or not (seconds).",
			Buckets: []float64{0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}}, []string{"model"}),
	}
	for _, c := range []prometheus.Collector{m.held, m.expired, m.rejected, m.wakeups, m.heldTime} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register gateway metrics: %w", err)
		}
	}
	return m, nil
}

// errHoldExpired: a held request reached hold_ttl with no endpoint ready;
// errHoldFull: the hold was full.
var (
	errHoldExpired = errors.New("held without a ready endpoint for hold_ttl")
	errHoldFull    = errors.New("scale-from-zero hold full")
)

// startWakeLocked starts the cold episode's wake-up call unless one was
// made already this episode or one is still in flight (a.mu held).
func (a *admission) startWakeLocked() {
	if a.woken || a.hold.Wake.Kind == WakeNone {
		return
	}
	a.woken = true
	call := a.wakeCall
	if call == nil || a.waking {
		return // the call in flight (a stalled hook, up to wake.timeout) wakes this episode too
	}
	a.waking = true
	held := len(a.queue)
	eps := append([]*endpoint(nil), a.endpoints...)
	hold := a.hold
	a.wakes.Go(func() {
		call(hold, eps, held)
		a.mu.Lock()
		a.waking = false
		a.mu.Unlock()
	})
}

// wakeCall makes p's wake-up call of kind hold.Wake.Kind, bounded by its
// timeout and by the gateway's life, and counts it.
func (g *Gateway) wakeCall(model string) func(hold ScaleFromZeroConfig, eps []*endpoint, held int) {
	return func(hold ScaleFromZeroConfig, eps []*endpoint, held int) {
		ctx, cancel := context.WithTimeout(g.loops, hold.Wake.Timeout)
		defer cancel()
		var err error
		switch hold.Wake.Kind {
		case WakeFunc:
			err = hold.Wake.Waker.Wake(ctx, model)
		case WakeWebhook:
			body, _ := json.Marshal(struct {
				Pool  string `json:"pool"`
				Model string `json:"model"`
				Held  int    `json:"held"`
			}{model, model, held})
			err = g.wakePost(ctx, hold.Wake.URL, "application/json", body, nil)
		case WakeEngine:
			var errs []error
			for _, ep := range eps {
				if ep == vacant || ep.ready.Load() {
					continue
				}
				errs = append(errs, g.wakePost(ctx, ep.base+"/wake_up", "", nil, ep.spec.Load().header))
			}
			err = errors.Join(errs...)
		}
		result := "ok"
		if err != nil {
			result = "error"
			slog.Warn("gateway: scale from zero: the wake-up call failed", "model", model, "kind", hold.Wake.Kind, "err", err)
		} else {
			slog.Info("gateway: scale from zero: wake-up called", "model", model, "kind", hold.Wake.Kind, "held", held)
		}
		g.cold.wakeups.WithLabelValues(model, result).Inc()
	}
}

// wakePost POSTs body to u and wants a 2xx.
func (g *Gateway) wakePost(ctx context.Context, u, contentType string, body []byte, header http.Header) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
	if err != nil {
		return err
	}
	for k, v := range header {
		req.Header[k] = v
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	// Redirects are not followed (a 3xx fails the call): header carries
	// the endpoint's credentials (api_key in api_key_header, headers), and
	// a client following a redirect forwards such headers — any name but
	// Authorization and Cookie even to another host — so an engine or
	// hook that redirected got them sent wherever it pointed.
	client := &http.Client{Transport: g.transport, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxWebhookResponseBytes))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("POST %s: status %d", u, resp.StatusCode)
	}
	return nil
}

// holding reports whether ep serves a pool that holds requests now, and
// the shortest probe interval among those pools.
func (ep *endpoint) holding() (time.Duration, bool) {
	gates := ep.gates.Load()
	if gates == nil {
		return 0, false
	}
	var d time.Duration
	for _, a := range *gates {
		if a.heldNow.Load() > 0 {
			if p := time.Duration(a.probe.Load()); d == 0 || p < d {
				d = p
			}
		}
	}
	return d, d > 0
}

// Probe asks the health loop of the endpoint at url (as configured) for a
// probe now, when it is out of rotation and a pool it serves holds
// requests: an event from whoever knows an engine turned ready (an
// embedded fleet, discovery), so held requests are dispatched without
// waiting for the next probe_interval. It reports whether the gateway has
// an endpoint at url.
func (g *Gateway) Probe(url string) bool {
	base, err := normalizeURL(url)
	if err != nil {
		return false
	}
	for _, ep := range g.state.Load().endpoints {
		if ep.name == base {
			ep.probeSoon()
			return true
		}
	}
	return false
}

// probeSoon asks ep's health loop to probe now (a request was just held,
// or Probe).
func (ep *endpoint) probeSoon() {
	select {
	case ep.probeNow <- struct{}{}:
	default:
	}
}

// heartbeat writes SSE comment heartbeats to a held streaming request
// (scale_from_zero.heartbeat). The first one commits the answer as a 200
// event stream; stream then returns the writer the rest of the request
// must use, which turns an error answer into an SSE error event.
type heartbeat struct {
	g  *Gateway
	w  http.ResponseWriter
	x  *exchange
	cs *committedStream // nil until the first heartbeat
}

// sseKeepAlive is one heartbeat: an SSE comment line, which clients ignore
// (WHATWG HTML "Server-sent events", §9.2.6: lines starting with a colon).
const sseKeepAlive = ": keep-alive\n\n"

// beat writes one heartbeat and flushes it; false when the client is gone.
func (h *heartbeat) beat() bool {
	if h.cs == nil {
		hd := h.w.Header()
		hd.Set("Content-Type", "text/event-stream")
		hd.Set("Cache-Control", "no-cache")
		h.w.WriteHeader(http.StatusOK)
		h.cs = &committedStream{ResponseWriter: h.w}
	}
	h.g.extendWriteDeadline(h.w, h.x, time.Now())
	if _, err := io.WriteString(h.w, sseKeepAlive); err != nil {
		return false
	}
	return http.NewResponseController(h.w).Flush() == nil
}

// stream returns the writer of the request's answer and the function that
// ends it: w itself and a no-op until a heartbeat was written, then the
// committed stream and its end.
func (h *heartbeat) stream(w http.ResponseWriter) (http.ResponseWriter, func()) {
	if h.cs == nil {
		return w, func() {}
	}
	return h.cs, h.cs.end
}

// committedStream is the client's writer once a heartbeat committed the
// answer as a 200 event stream: the status line is out, so a later status
// is only recorded, a successful answer (the engine's event stream) passes
// through, and an error answer's body (at most 1 MiB) is written by end as
// an SSE error event then [DONE] — what vLLM and the relay do for errors
// after a stream began.
type committedStream struct {
	http.ResponseWriter
	status int
	buf    []byte
}

const maxCommittedErrorBytes = 1 << 20

func (c *committedStream) WriteHeader(code int) {
	if c.status == 0 {
		c.status = code
	}
}

func (c *committedStream) Write(b []byte) (int, error) {
	if c.status == 0 {
		c.status = http.StatusOK
	}
	if c.status < 300 {
		return c.ResponseWriter.Write(b)
	}
	if n := min(len(b), maxCommittedErrorBytes-len(c.buf)); n > 0 {
		c.buf = append(c.buf, b[:n]...)
	}
	return len(b), nil
}

// Unwrap lets http.ResponseController reach the connection.
func (c *committedStream) Unwrap() http.ResponseWriter { return c.ResponseWriter }

// end writes a buffered error answer as an SSE error event and [DONE].
func (c *committedStream) end() {
	if c.status < 300 {
		return
	}
	body := bytes.TrimSpace(c.buf)
	// A map, not a struct: encoding/json matches a struct's field names
	// case-insensitively, and a body of {"erroR":{}} was relayed as if it
	// held the "error" member clients look for.
	var probe map[string]json.RawMessage
	var compact bytes.Buffer
	if json.Unmarshal(body, &probe) != nil || len(probe["error"]) == 0 || json.Compact(&compact, body) != nil {
		e := openai.NewError(http.StatusBadGateway, "the engine answered status "+strconv.Itoa(c.status)+": "+string(body), "", openai.CodeUpstream)
		body, _ = json.Marshal(openai.ErrorResponse{Error: e})
	} else {
		body = compact.Bytes() // one line: an SSE data line ends at a newline
	}
	_, _ = io.WriteString(c.ResponseWriter, "data: ")
	_, _ = c.ResponseWriter.Write(body)
	_, _ = io.WriteString(c.ResponseWriter, "\n\ndata: [DONE]\n\n")
	_ = http.NewResponseController(c.ResponseWriter).Flush()
}
