package gateway

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// This file is the gateway's side of `infergate epp` (package epp): the
// decision path of an endpoint picker behind Envoy, where Envoy proxies the
// request and the gateway only picks (Gateway.Pick) and observes the answer
// (Picked). It runs the request path of serveInference up to the upstream
// round trip — decode once, resolve the model's pools, admission, the
// policy's pick through pickExcluding, the load ledger, the predictions —
// and the answer's accounting of attempt/relayStream/relayBody (usage,
// TTFT, ITL, outlier detection, finish), on the same pools, policies,
// scrapes and KV-event feeds. Protocol: Gateway API Inference Extension
// endpoint picker protocol v1.0.0
// (kubernetes-sigs/gateway-api-inference-extension
// docs/proposals/004-endpoint-picker-protocol@84436a96).

// EPPConfig is `infergate epp`'s part of the configuration (key epp);
// `infergate serve` ignores it. Listen is the ext_proc gRPC address
// (envoy.service.ext_proc.v3.ExternalProcessor), HealthListen the gRPC
// health service's (services "", "liveness", "readiness" and the ext_proc
// service name). Fallbacks is how many endpoints besides the pick are
// listed in x-gateway-destination-endpoint for Envoy's retries (the least
// loaded ready ones; 0: none). ConformanceTestHooks turns on the Gateway
// API Inference Extension conformance hooks (request header
// test-epp-endpoint-selection, response header
// x-conformance-test-served-endpoint): test only, as any client could steer
// its requests with them.
type EPPConfig struct {
	Listen               string `yaml:"listen"`
	HealthListen         string `yaml:"health_listen"`
	Fallbacks            int    `yaml:"fallbacks"`
	ConformanceTestHooks bool   `yaml:"conformance_test_hooks"`
}

// Defaults of EPPConfig: GIE's EPP ports (--grpc-port 9002,
// --grpc-health-port 9003).
const (
	DefaultEPPListen       = ":9002"
	DefaultEPPHealthListen = ":9003"
)

// WithDefaults returns c with the defaults filled in.
func (c EPPConfig) WithDefaults() EPPConfig {
	if c.Listen == "" {
		c.Listen = DefaultEPPListen
	}
	if c.HealthListen == "" {
		c.HealthListen = DefaultEPPHealthListen
	}
	return c
}

// Validate reports a bad setting.
func (c EPPConfig) Validate() error {
	if c.Fallbacks < 0 || c.Fallbacks > maxEPPFallbacks {
		return fmt.Errorf("epp.fallbacks %d: must be in [0, %d]", c.Fallbacks, maxEPPFallbacks)
	}
	return nil
}

// maxEPPFallbacks bounds epp.fallbacks.
const maxEPPFallbacks = 16

// PickRequest is what an endpoint picker knows of a request when the proxy
// has its headers and (unless it has none) its whole body.
type PickRequest struct {
	// Method and Path are the request's :method and :path (the query is
	// ignored).
	Method, Path string
	// Header holds the request's headers (canonical keys).
	Header http.Header
	// Body is the whole request body; nil for a request without one (a
	// GET), which is sent to the least loaded ready endpoint of any model.
	// The gateway reads it until the Picked is done and never writes it.
	Body []byte
	// Subset, when HasSubset, is the only endpoints the pick may be among
	// (ip:port, or ip for any port of it): the proxy's subset hint, or the
	// conformance hook's header; empty, nothing may be picked.
	Subset    []string
	HasSubset bool
	// Start is when the request arrived (zero: when Pick is called): the
	// origin of its TTFT and end-to-end latency.
	Start time.Time
}

// Refusal is the answer to a request that is not sent anywhere: an OpenAI
// error (Status, Body as JSON) with its headers (Retry-After …), as the
// gateway would have answered it.
type Refusal struct {
	Status int
	Header http.Header
	Body   []byte
}

// Picked is a request that Pick sent to an endpoint: its destinations, the
// body to send, and the response phase's accounting. It is used by one
// goroutine at a time (an ext_proc stream's). Done must be called once the
// request has ended (answered, or its stream gone): it accounts the
// request if its answer did not end, and releases what the pick took
// (admission, the circuit-breaker slot, the load ledger's share).
type Picked struct {
	g     *Gateway
	x     *exchange
	p     *pool // nil: a request without body (no accounting)
	i     int   // the slot accounted
	ep    *endpoint
	rm    *routeMetrics
	start time.Time
	// dests are the destinations: the pick first, then the fallbacks
	// (ip:port); in dest when there are none.
	dests []string
	dest  [1]string
	body  []byte
	// changed: body differs from the request's.
	changed bool
	// strip: the gateway asked the engine for stream usage on the
	// client's behalf; the usage-only chunk is dropped from the answer.
	strip bool
	resp  eppResponse
	// finished: the request was accounted; done: Done ran.
	finished, done bool
}

// Destinations returns the endpoints the request is to go to, the pick
// first and then its fallbacks, as ip:port (IPv6 in brackets). The slice
// is the Picked's: do not modify it.
func (pk *Picked) Destinations() []string { return pk.dests }

// Body returns the body to send upstream: the request's, or the gateway's
// edit of it (an alias target's model, stream_options.include_usage, the
// client's P/D members removed); valid until Done.
func (pk *Picked) Body() []byte { return pk.body }

// BodyChanged reports whether Body differs from the request's body (the
// proxy then needs a new Content-Length).
func (pk *Picked) BodyChanged() bool { return pk.changed }

// eppRecorder records the gateway's answer to a request it refuses (the
// request path's own errors: g.fail, failNoEndpoint, admitQueued), so that
// the picker answers them as they are. Its zero value is ready; the header
// is made on first use (a pick that is not refused makes none).
type eppRecorder struct {
	h      http.Header
	status int
	body   []byte
}

func (w *eppRecorder) Header() http.Header {
	if w.h == nil {
		w.h = http.Header{}
	}
	return w.h
}
func (w *eppRecorder) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
}
func (w *eppRecorder) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	w.body = append(w.body, b...)
	return len(b), nil
}

// refusal returns what w recorded; a request the gateway counted as gone
// (its context ended) and did not answer is a 499 with no body.
func (w *eppRecorder) refusal() *Refusal {
	if w.status == 0 {
		return &Refusal{Status: codeClientClosed, Header: w.Header()}
	}
	return &Refusal{Status: w.status, Header: w.Header(), Body: w.body}
}

// Refuse returns the OpenAI error e as a Refusal, counted in the gateway's
// metrics under model "unknown" (the picker's own refusals: a body over
// max_body_bytes).
func (g *Gateway) Refuse(e *openai.Error) *Refusal {
	w := &eppRecorder{}
	g.fail(w, g.unknown, e)
	return w.refusal()
}

// MaxBodyBytes is the largest request body the gateway accepts
// (max_body_bytes).
func (g *Gateway) MaxBodyBytes() int64 { return g.cfg.MaxBodyBytes }

// MaxHeaderBytes is the largest request header block the gateway accepts
// (max_header_bytes; Gateway.RefuseHeaders counts it).
func (g *Gateway) MaxHeaderBytes() int { return g.cfg.MaxHeaderBytes }

// StripsClientPDParams reports whether a client's own P/D hand-off fields
// are removed before an engine sees them (pd.client_params strip): the
// endpoint picker then has the proxy remove the client's
// x-prefiller-host-port (disagg.PrefillerHeader).
func (g *Gateway) StripsClientPDParams() bool { return g.cfg.PD.ClientParams != PDClientParamsPass }

// BodyReadTimeout bounds the wait for a request's body
// (body_read_timeout); the endpoint picker bounds with it a stream's wait
// for its request to be routed.
func (g *Gateway) BodyReadTimeout() time.Duration { return g.cfg.BodyReadTimeout }

// WriteTimeout bounds one write of an answer to a client (write_timeout;
// negative: none); the endpoint picker bounds with it a send to the proxy
// that the proxy does not read.
func (g *Gateway) WriteTimeout() time.Duration { return g.cfg.WriteTimeout }

// RefuseHeaders returns serve's answer to a request refused for its
// headers alone, or nil: 431 when they are n bytes (counted as headerBytes
// counts an HTTP/1.1 header block: each field's name, value and 4 bytes of
// ": " and CRLF) over max_header_bytes, 415 when h names a Content-Encoding
// (the body is not decoded; readBody's check). Counted under model
// "unknown".
func (g *Gateway) RefuseHeaders(n int, h http.Header) *Refusal {
	var e *openai.Error
	if n > g.cfg.MaxHeaderBytes {
		e = openai.NewError(http.StatusRequestHeaderFieldsTooLarge,
			fmt.Sprintf("Request headers are %d bytes, over the limit of %d bytes.", n, g.cfg.MaxHeaderBytes), "", codeHeaderTooLarge)
	} else if ce := encodedAs(h); ce != "" {
		e = openai.NewError(http.StatusUnsupportedMediaType,
			fmt.Sprintf("Content-Encoding %q is not supported; send the JSON body uncompressed.", truncate(ce, 64)), "", openai.CodeInvalidJSON)
	}
	if e == nil {
		return nil
	}
	return g.Refuse(e)
}

// eppKind is the API of a request to path: the routes the gateway serves
// (route, routePassthrough) that are sent to an engine with a body.
func eppKind(method, path string) (apiKind, bool) {
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	if method != http.MethodPost {
		return 0, false
	}
	switch path {
	case pathChat:
		return kindChat, true
	case pathCompletions:
		return kindCompletion, true
	case pathResponses:
		return kindResponses, true
	case pathEmbeddings:
		return kindEmbeddings, true
	case pathTokenize:
		return kindTokenize, true
	case pathDetokenize:
		return kindDetokenize, true
	}
	if passablePath(path) && !strings.HasPrefix(path, pathResponses+"/") {
		return kindOther, true
	}
	return 0, false
}

// Pick picks the endpoint of a request as serveInference does, without
// sending it: decode and validate the body once, the model's pools (an
// alias's in fallback order), admission (queueing while the pool is full,
// within ctx), the policy's pick among the ready endpoints (within
// req.Subset), the request's share of the endpoint's load and the
// indexes' predictions. A request refused is answered as the gateway
// answers it: 400 invalid body, 404 unknown model, 413, 429 shed by
// admission (queue full, displaced, timed out), 503 no endpoint ready (or
// none of the subset), 503 shutting down; ctx ended while queued: 499. A
// request without body (req.Body nil) goes to the least loaded ready
// endpoint.
func (g *Gateway) Pick(ctx context.Context, req *PickRequest) (*Picked, *Refusal) {
	start := req.Start
	if start.IsZero() {
		start = time.Now()
	}
	st := g.state.Load()
	if req.Body == nil {
		return g.pickBodiless(st, req, &eppRecorder{}, start)
	}
	kind, ok := eppKind(req.Method, req.Path)
	if !ok {
		w := &eppRecorder{}
		g.fail(w, g.unknown, openai.NewError(http.StatusNotFound,
			fmt.Sprintf("Invalid URL (%s %s)", req.Method, truncate(req.Path, maxPassPath)), "", "not_found"))
		return nil, w.refusal()
	}
	if int64(len(req.Body)) > g.cfg.MaxBodyBytes {
		w := &eppRecorder{}
		g.fail(w, g.unknown, openai.NewError(http.StatusRequestEntityTooLarge,
			fmt.Sprintf("Request body is larger than the limit of %d bytes.", g.cfg.MaxBodyBytes), "", openai.CodeRequestTooLarge))
		return nil, w.refusal()
	}
	x := g.getExchange()
	// The request as the request path reads it, in the exchange: the
	// literal and WithContext's copy (inlined) stay on the stack.
	x.pickURL = url.URL{Path: req.Path}
	x.pickReq = *(&http.Request{Method: req.Method, URL: &x.pickURL, Header: req.Header}).WithContext(ctx)
	r := &x.pickReq
	if r.Header == nil {
		r.Header = http.Header{}
	}
	x.pass.kind = kind
	x.body = req.Body
	g.metrics.api[kind].Inc()
	pk := &Picked{g: g, x: x, start: start}
	w := &x.rec // no allocation for a pick that is not refused
	refuse := func(rm *routeMetrics, e *openai.Error) (*Picked, *Refusal) {
		if e != nil {
			g.fail(w, rm, e)
		}
		ref := w.refusal() // before x, which holds w, goes back to the pool
		pk.release()
		return nil, ref
	}
	verr := x.decode(kind)
	targets := st.targets[x.model]
	x.pass.adapterOf = st.adapters[x.model]
	rm := g.unknown
	if len(targets) > 0 {
		rm = targets[0].none
	}
	if verr != nil {
		return refuse(rm, verr)
	}
	priority, perr := requestPriority(r)
	if perr != nil {
		return refuse(rm, perr)
	}
	if len(targets) == 0 {
		return refuse(rm, openai.NewError(http.StatusNotFound,
			fmt.Sprintf("The model `%s` does not exist.", x.model), "model", openai.CodeModelNotFound))
	}
	x.sreq = sched.Request{SessionKey: sessionKey(r, x), Priority: priority}
	for j, p := range targets {
		x.pass.fallback, x.pass.fell = j < len(targets)-1, ""
		if e := g.prepareTarget(w, r, x, kind, p); e != nil {
			return refuse(p.none, e)
		}
		if g.pickRouted(w, r, x, kind, p, req, pk) {
			if pk.p != nil {
				return pk, nil
			}
			return refuse(nil, nil) // answered in w
		}
		g.fellBack(x, p)
	}
	return refuse(nil, nil)
}

// pickRouted is serveRouted's decision for pool p, into pk: admission, the
// pick within req's subset, and the attempt's accounting (attempt's
// beginning). It reports true when the request was picked (pk.p set) or
// answered in w, false when it falls back to the alias's next target.
func (g *Gateway) pickRouted(w http.ResponseWriter, r *http.Request, x *exchange, kind apiKind, p *pool,
	req *PickRequest, pk *Picked) bool {
	if !g.admitQueued(w, r, p, x) {
		return x.pass.fell == ""
	}
	g.stripClientParams(x, kind)
	p = p.latest()
	gate := p.gate
	excluded := x.excludedFor(len(p.endpoints))
	if req.HasSubset {
		set := newSubsetSet(req.Subset)
		for j, ep := range p.endpoints {
			excluded[j] = !set.has(ep.addr)
		}
	}
	var (
		i int
		d sched.Decision
	)
	g.replicas.stagger(r.Context(), p) // this replica's turn in a burst (replicas.go)
	if p.pd != nil {
		// A P/D pool: the picker sends the request whole to a decode (or
		// both-role) endpoint, as serve does when it does not split; the
		// prefill hand-off is not the picker's (no x-prefiller-host-port).
		i, d = g.pickWith(p, &x.sreq, excluded, p.pd.PickDecode)
		g.learntPD(p, x, i, d.MatchedBlocks*p.blockSize, sched.RoleDecode, false)
	} else {
		i, d = g.pickExcluding(p, &x.sreq, excluded)
	}
	gate.picked()
	if i < 0 {
		gate.release()
		if x.pass.fallback {
			x.pass.fell = fallbackNoEndpoint
			return false
		}
		if req.HasSubset {
			w.Header().Set("Retry-After", g.retryAfter)
			g.fail(w, p.none, openai.NewError(http.StatusServiceUnavailable,
				fmt.Sprintf("No endpoint of the proxy's subset hint (%d listed) serving model `%s` is available; retry later.",
					len(req.Subset), p.model), "", openai.CodeNoEndpoint))
			return true
		}
		g.failNoEndpoint(w, p, x)
		return true
	}
	ep := p.endpoints[i]
	pk.p, pk.i, pk.ep, pk.rm = p, i, ep, p.routes[i]
	if x.sreq.PromptTokens > 0 {
		ep.ledger.Send(&x.share, x.sreq.PromptTokens, d.MatchedBlocks*p.blockSize, clock(time.Now()))
	}
	g.predict(x, p, i, d, pk.rm)
	body := x.upstreamBody()
	if x.stream && !x.includeUsage {
		if b, err := withIncludeUsage(x.upBody[:0], body); err == nil {
			x.upBody, body, pk.strip = b, b, true
		}
	}
	pk.body, pk.changed = body, pk.strip || x.pass.sendBody != nil
	pk.dests = append(pk.dest[:0], ep.addr)
	pk.dests = g.appendFallbacks(pk.dests, p, excluded, i)
	return true
}

// pickBodiless picks for a request without body (a GET: llm-d and GIE send
// it to any endpoint): the least loaded ready endpoint of the configuration
// within req's subset, ties to the next after the previous pick. Nothing
// is accounted to it.
func (g *Gateway) pickBodiless(st *state, req *PickRequest, w *eppRecorder, start time.Time) (*Picked, *Refusal) {
	eps := st.endpoints
	n := len(eps)
	best, bestLoad := -1, int64(0)
	var set subsetSet
	if req.HasSubset {
		set = newSubsetSet(req.Subset)
	}
	off := int(eppRotate.Add(1))
	for k := range n {
		j := (off + k) % n
		ep := eps[j]
		if !ep.ready.Load() || (req.HasSubset && !set.has(ep.addr)) {
			continue
		}
		if l := ep.ledger.InFlight(); best < 0 || l < bestLoad {
			best, bestLoad = j, l
		}
	}
	if best < 0 {
		w.Header().Set("Retry-After", g.retryAfter)
		g.fail(w, g.unknown, openai.NewError(http.StatusServiceUnavailable,
			"No endpoint is available; retry later.", "", openai.CodeNoEndpoint))
		return nil, w.refusal()
	}
	return &Picked{g: g, ep: eps[best], start: start, dests: []string{eps[best].addr}, finished: true}, nil
}

// eppRotate spreads pickBodiless's ties.
var eppRotate atomic.Uint32

// appendFallbacks appends to dst the addresses of up to epp.fallbacks
// ready endpoints of p besides slot i and those excluded, least in flight
// first (ties in slot order): where the proxy retries a request whose pick
// failed. O(fallbacks × endpoints), no allocation beyond dst.
func (g *Gateway) appendFallbacks(dst []string, p *pool, excluded []bool, i int) []string {
	n := g.cfg.EPP.Fallbacks
	if n == 0 {
		return dst
	}
	first := len(dst)
	for range n {
		best, bestLoad := -1, int64(0)
		for j, ep := range p.endpoints {
			if j == i || excluded[j] || !ep.ready.Load() || ep.addr == "" || listed(dst[first:], ep.addr) {
				continue
			}
			if l := ep.ledger.InFlight(); best < 0 || l < bestLoad {
				best, bestLoad = j, l
			}
		}
		if best < 0 {
			break
		}
		dst = append(dst, p.endpoints[best].addr)
	}
	return dst
}

func listed(s []string, v string) bool {
	for _, e := range s {
		if e == v {
			return true
		}
	}
	return false
}

// subsetSet is a subset hint as sets, built once per pick: a hint of k
// entries over n endpoints costs O(k + n), not O(k × n) (a hostile
// proxy's 4,096 entries over 1,000 endpoints took 97 ms a pick).
type subsetSet struct {
	// exact holds the entries trimmed (ip:port, or ip); bare the same
	// without the brackets of an IPv6 host.
	exact, bare map[string]struct{}
}

func newSubsetSet(subset []string) subsetSet {
	s := subsetSet{exact: make(map[string]struct{}, len(subset)), bare: make(map[string]struct{}, len(subset))}
	for _, e := range subset {
		e = strings.TrimSpace(e)
		s.exact[e] = struct{}{}
		s.bare[strings.Trim(e, "[]")] = struct{}{}
	}
	return s
}

// has reports whether addr (ip:port) is in the subset, whose entries are
// ip:port, or ip for any port of it.
func (s subsetSet) has(addr string) bool {
	if addr == "" {
		return false
	}
	host := addr
	if h, _, err := net.SplitHostPort(addr); err == nil {
		host = h
	}
	_, a := s.exact[addr]
	_, h := s.exact[host]
	_, b := s.bare[host]
	return a || h || b
}

// endpointAddr is the ip:port (host:port) a base URL's requests go to:
// its host, and its port or the scheme's (http 80, https 443); IPv6 in
// brackets. "" when the URL has no host.
func endpointAddr(u *url.URL) string {
	host := u.Hostname()
	if host == "" {
		return ""
	}
	port := u.Port()
	if port == "" {
		port = "80"
		if u.Scheme == "https" {
			port = "443"
		}
	}
	return net.JoinHostPort(host, port)
}

// Served records the endpoint that served the request as the proxy reports
// it (ip:port: the envoy.lb x-gateway-destination-endpoint-served
// metadata). When it is not the one picked (the proxy went to a fallback)
// the request's accounting moves there: its circuit-breaker slot, its load
// share, its metrics, the precise index's routing record. An address of no
// endpoint of the pool is ignored.
func (pk *Picked) Served(addr string) {
	if pk.p == nil || pk.finished || addr == "" || addr == pk.ep.addr {
		return
	}
	p, x := pk.p, pk.x
	for j, ep := range p.endpoints {
		if ep.addr != addr || ep == vacant {
			continue
		}
		x.share.Finish()
		pk.ep.releaseSlot()
		// The pick pinned the prompt on slot pk.i (learn_on_finish): the
		// request will not run there, so the pin goes now, and Done calls
		// Finished on slot j with no pin of it (Request.Pinned cleared: an
		// end without a pin changes nothing, so slot j's approximate index
		// does not learn a fallback's prompt; its peers' do, by the shared
		// finish). Left, the pin stayed for good: every request the proxy
		// sent to a fallback pinned its prompt on the endpoint it did not
		// use.
		pk.g.learnFinished(p, pk.i, x)
		x.sreq.Pinned = false
		ep.ledger.TryAcquire(int(^uint(0) >> 1)) // the engine has it, whatever its limit
		if x.sreq.PromptTokens > 0 {
			ep.ledger.Send(&x.share, x.sreq.PromptTokens, 0, clock(time.Now()))
		}
		pk.i, pk.ep, pk.rm = j, ep, p.routes[j]
		x.predicted, x.precisePredicted = -1, -1 // the predictions were the pick's
		if p.precise != nil {
			p.precise.Routed(j, x.hashes)
		}
		return
	}
}

// AnswerTimeout bounds the wait for the proxy's next message about the
// answer, as serve bounds the same wait on the engine: before the response
// headers response_header_timeout (a non-streaming completion's headers
// come when it is done), an event stream before its first output event
// first_event_timeout (queueing and prefill), otherwise, and once the
// answer has ended (only the stream's end is awaited),
// stream_idle_timeout.
func (pk *Picked) AnswerTimeout() time.Duration {
	c := &pk.g.cfg
	switch r := &pk.resp; {
	case pk.finished || pk.p == nil:
		return c.StreamIdleTimeout
	case !r.headers:
		return c.ResponseHeaderTimeout
	case r.sse && !r.pass && r.last.IsZero():
		return c.FirstEventTimeout
	}
	return c.StreamIdleTimeout
}

// Expire ends a request whose answer stopped arriving (AnswerTimeout
// passed): counted 504, as serve counts an engine's silence, and released
// as Done releases it.
func (pk *Picked) Expire() {
	if !pk.done && !pk.finished && pk.p != nil {
		pk.finished = true
		pk.g.count(nil, pk.rm, http.StatusGatewayTimeout)
	}
	pk.Done()
}

// Done ends the request: one whose answer did not end (the stream went
// away, the proxy gave up) is counted 499, and what the pick took is
// released. Safe to call more than once.
func (pk *Picked) Done() {
	if pk.done {
		return
	}
	pk.done = true
	if !pk.finished && pk.p != nil {
		pk.finished = true
		pk.g.count(nil, pk.rm, codeClientClosed)
	}
	if pk.p != nil {
		pk.g.learnFinished(pk.p, pk.i, pk.x) // the pick's pin released (learning.go)
		pk.x.share.Finish()
		pk.ep.releaseSlot()
		pk.p.gate.release()
	}
	pk.release()
}

// release returns the exchange to the pool.
func (pk *Picked) release() {
	if pk.x == nil {
		return
	}
	x := pk.x
	pk.x, pk.body = nil, nil
	x.body = nil // the caller's buffer: not the pool's
	// An answer cut before its end gives back its held prefix.
	pk.g.hold.release(&pk.resp.held)
	pk.resp.reset()
	pk.g.putExchange(x)
}

// ReadyEndpoints returns how many endpoints of the configuration in force
// are in rotation, of how many, and whether the gateway is draining.
func (g *Gateway) ReadyEndpoints() (ready, total int, draining bool) {
	st := g.state.Load()
	for _, ep := range st.endpoints {
		if ep.ready.Load() {
			ready++
		}
	}
	return ready, len(st.endpoints), g.draining.Load()
}
