package gateway

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/disagg"
	"github.com/infergate/infergate/load"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// P/D: a pool whose endpoints have roles (EndpointConfig.Role) is routed by
// sched.PD (routing.pd): D is picked, the decider splits long prompts, P is
// picked. A split request runs its flow (package disagg, pd.connector)
// here: the prefill leg (NIXL: before D, within pd.prefill_timeout; the
// concurrent connectors: beside D), then D through the ordinary attempt
// and relay (attempt.go, relay.go) with the D body. README.md "P/D".

// Defaults of PDConfig.
const (
	DefaultPDPrefillAttempts = 2
	DefaultPDReleaseTimeout  = 5 * time.Second
)

// PDConfig is the gateway's P/D hand-off (YAML pd).
type PDConfig struct {
	// Connector is the hand-off protocol: nixl (default), mooncake,
	// sglang or llm-d (disagg.Connectors).
	Connector string `yaml:"connector"`
	// PrefillTimeout bounds a prefill leg, its whole answer included
	// (default first_event_timeout).
	PrefillTimeout time.Duration `yaml:"prefill_timeout"`
	// PrefillAttempts is how many prefill endpoints a split request tries
	// before it is served whole on D (default 2: one retry).
	PrefillAttempts int `yaml:"prefill_attempts"`
	// Release says the engines serve disagg.ReleasePath (the simulated
	// engine does; vLLM does not): the blocks a prefill holds for a decode
	// that failed or was abandoned are freed at once; otherwise they are
	// counted as stranded (vLLM frees them after
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s).
	Release bool `yaml:"release"`
	// ReleaseTimeout bounds a release call (default 5s).
	ReleaseTimeout time.Duration `yaml:"release_timeout"`
	// ClientParams is what becomes of a client's own P/D members
	// (disagg.ClientParams: kv_transfer_params, bootstrap_host/port/room) in
	// a chat or completion: "strip" (default) removes them before any
	// engine sees them, in every pool — from a client they would make an
	// engine connect where the client says, with the gateway's engine key,
	// or hold its KV until its abort timeout (and a client's
	// x-prefiller-host-port header, from every engine request: llm-d's
	// sidecar would prefill where it says); "pass" forwards them, for a
	// deployment whose own proxy behind the gateway runs the hand-off.
	ClientParams string `yaml:"client_params"`
}

// PDConfig.ClientParams values.
const (
	PDClientParamsStrip = "strip"
	PDClientParamsPass  = "pass"
)

func (c PDConfig) withDefaults(firstEvent time.Duration) PDConfig {
	if c.Connector == "" {
		c.Connector = string(disagg.NIXL)
	}
	if c.PrefillTimeout == 0 {
		c.PrefillTimeout = firstEvent
	}
	if c.PrefillAttempts == 0 {
		c.PrefillAttempts = DefaultPDPrefillAttempts
	}
	if c.ReleaseTimeout == 0 {
		c.ReleaseTimeout = DefaultPDReleaseTimeout
	}
	if c.ClientParams == "" {
		c.ClientParams = PDClientParamsStrip
	}
	return c
}

// connector is the parsed Connector (NIXL when invalid: Validate refused it).
func (c PDConfig) connector() disagg.Connector {
	k, err := disagg.ParseConnector(c.Connector)
	if err != nil {
		return disagg.NIXL
	}
	return k
}

// validatePD checks pd and the endpoints' roles and bootstrap ports.
func (c Config) validatePD() []error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if _, err := disagg.ParseConnector(c.PD.Connector); err != nil {
		bad("pd.connector: %v", err)
	}
	if c.PD.PrefillTimeout <= 0 {
		bad("pd.prefill_timeout %v: must be positive", c.PD.PrefillTimeout)
	}
	if v := c.PD.ClientParams; v != PDClientParamsStrip && v != PDClientParamsPass {
		bad("pd.client_params %q: want %q or %q", v, PDClientParamsStrip, PDClientParamsPass)
	}
	if c.PD.ReleaseTimeout <= 0 {
		bad("pd.release_timeout %v: must be positive", c.PD.ReleaseTimeout)
	}
	if c.PD.PrefillAttempts < 1 || c.PD.PrefillAttempts > 10 {
		bad("pd.prefill_attempts %d: want 1 to 10", c.PD.PrefillAttempts)
	}
	roles := map[string]bool{}   // models with roles
	decodes := map[string]bool{} // models with an endpoint that decodes
	for i, e := range c.Endpoints {
		at := fmt.Sprintf("endpoints[%d]", i)
		r, err := sched.ParseRole(e.Role)
		if err != nil {
			bad("%s.role: %v", at, err)
		}
		if e.Role != "" {
			roles[e.Model] = true
		}
		if r != sched.RolePrefill {
			decodes[e.Model] = true
		}
		if e.BootstrapPort < 0 || e.BootstrapPort > 65535 {
			bad("%s.bootstrap_port %d: want 0 (default %d) to 65535", at, e.BootstrapPort, disagg.DefaultBootstrapPort)
		}
	}
	for m := range roles {
		if !decodes[m] {
			bad("model %q: every endpoint has role prefill; a P/D pool needs a decode (or both) endpoint", m)
		}
	}
	return errs
}

// pdWarnings are settings that validate but are likely wrong: with the
// sglang and mooncake connectors, a prefill endpoint without bootstrap_port
// is assumed to serve its bootstrap on 8998; a wrong port is not an error the
// gateway sees (D cannot reach P, recomputes the prompt, and P holds its
// KV until its timeout), so the assumption is said aloud.
func (c Config) pdWarnings() []string {
	conn, err := disagg.ParseConnector(c.PD.Connector)
	if err != nil || !conn.Bootstraps() {
		return nil
	}
	var out []string
	for i, e := range c.Endpoints {
		if r, _ := sched.ParseRole(e.Role); r != sched.RoleDecode && e.Role != "" && e.BootstrapPort == 0 {
			out = append(out, fmt.Sprintf("endpoints[%d] (%s): pd.connector %s and no bootstrap_port: assuming %d; a wrong port makes every decode recompute its prompt",
				i, e.URL, conn, disagg.DefaultBootstrapPort))
		}
	}
	return out
}

// pdPool is what a P/D pool adds to its pool.
type pdPool struct {
	pd        *sched.PD
	roles     []sched.Role // per slot
	bootstrap []int        // per slot: the KV bootstrap port
}

// buildPD gives p its roles and bootstrap ports from cfg's entries of its
// model, and reports whether any endpoint has a role (a P/D pool).
func (p *pool) buildRoles(cfg Config) bool {
	type entry struct {
		role sched.Role
		port int
	}
	by := map[string]entry{}
	any := false
	for _, e := range cfg.Endpoints {
		if e.Model != p.model {
			continue
		}
		base, _ := normalizeURL(e.URL)
		r, _ := sched.ParseRole(e.Role)
		port := e.BootstrapPort
		if port == 0 {
			port = disagg.DefaultBootstrapPort
		}
		by[base] = entry{r, port}
		any = any || e.Role != ""
	}
	if !any {
		return false
	}
	p.roles, p.bootstrap = make([]sched.Role, len(p.endpoints)), make([]int, len(p.endpoints))
	for i, ep := range p.endpoints {
		en, ok := by[ep.name]
		if !ok {
			continue // vacant
		}
		p.roles[i], p.bootstrap[i] = en.role, en.port
	}
	return true
}

// pdState is a split request's hand-off (in its exchange).
type pdState struct {
	on        bool             // the request is routed by P/D (pool and API)
	split     bool             // PD split it and a prefill leg is in force
	connector disagg.Connector // the pool's
	fellBack  bool             // every P failed: served whole on D
	orig      []byte           // the body before the flow (x.upstreamBody)
	origSet   bool
	body      []byte // D's body
	pbody     []byte // P's body
	pEP       *endpoint
	pi        int // P's slot, -1: none
	pre       disagg.Prefill
	held      bool        // P holds blocks for D (NIXL)
	leg       *disagg.Leg // a concurrent P leg in flight
	legRead   bool        // its answer's cached tokens were looked for (pdCached)
	legStart  time.Time
	pshare    load.Share
	pMatched  int // P's expected cached tokens (the prefill profile's decision)
	// A concurrent leg's hold, by its name on P (pName): the Mooncake
	// transfer id, or the SGLang rooms.
	transferID string
	rooms      []uint64
	cached     int       // P's cached tokens, written into D's usage (-1: no rewrite)
	prefiller  string    // llm-d: the x-prefiller-host-port value
	readyAt    time.Time // P's answer: the hand-off's start
	dCode      int       // D's relay result (2xx: D answered)
	header     http.Header
	pName      string // the P that holds the blocks (held)
	reqID      string
}

func (s *pdState) reset() {
	body, pbody := s.body[:0], s.pbody[:0]
	if cap(body) > maxPooledBuffer {
		body = nil
	}
	if cap(pbody) > maxPooledBuffer {
		pbody = nil
	}
	*s = pdState{body: body, pbody: pbody, pi: -1, cached: -1}
}

// pdMetrics are the P/D collectors.
type pdMetrics struct {
	decisions *prometheus.CounterVec   // model, outcome, reason
	prefill   *prometheus.HistogramVec // model, endpoint
	prefillOK *prometheus.CounterVec   // model, endpoint, result
	handoff   *prometheus.HistogramVec // model
	stripped  prometheus.Counter       // client bodies whose P/D members were removed
	fallbacks *prometheus.CounterVec   // model, reason
	retries   *prometheus.CounterVec   // model, leg
	releases  *prometheus.CounterVec   // model, result
	stranded  *prometheus.CounterVec   // model
}

func newPDMetrics(reg prometheus.Registerer) (*pdMetrics, error) {
	cv := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: name, Help: help}, labels)
	}
	m := &pdMetrics{
		decisions: cv("pd_decisions_total", "P/D decisions of requests to P/D pools, by outcome (split: prefill then decode; whole: served by the decode endpoint alone) and reason (long; short, no-prefill, prefill-busy, no-decode).", "model", "outcome", "reason"),
		prefill: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "infergate", Name: "pd_prefill_duration_seconds",
			Help: "Duration of prefill legs, from sending to the end of the prefill endpoint's answer, failures included (seconds).", Buckets: latencyBuckets},
			[]string{"model", "endpoint"}),
		prefillOK: cv("pd_prefill_legs_total", "Prefill legs by endpoint and result (ok, or the failure: connect_failure, 5xx, status, timeout, bad_params, canceled).", "model", "endpoint", "result"),
		handoff: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "infergate", Name: "pd_handoff_seconds",
			Help: "P→D hand-off time: from the prefill endpoint's answer to the decode endpoint's response headers (nixl, streaming requests: a whole answer's headers come after its decode; seconds).", Buckets: latencyBuckets},
			[]string{"model"}),
		fallbacks: cv("pd_fallbacks_total", "Split requests served whole on the decode endpoint because no prefill leg succeeded, by the last failure (or body: the body could not be rewritten).", "model", "reason"),
		retries:   cv("pd_retries_total", "Legs of split requests sent again: prefill (another prefill endpoint after a failed leg) or decode (another decode endpoint, with the same kv_transfer_params for nixl, both legs again for mooncake and sglang).", "model", "leg"),
		releases:  cv("pd_releases_total", "Release calls for blocks a prefill endpoint held for a decode that failed or was abandoned (pd.release), by result: released, not_held (404: read or expired), error.", "model", "result"),
		stranded:  cv("pd_stranded_holds_total", "Blocks a prefill endpoint holds for a decode that failed or was abandoned, left to expire (pd.release off, or no remote_request_id to name them).", "model"),
	}
	m.stripped = prometheus.NewCounter(prometheus.CounterOpts{Namespace: "infergate", Name: "pd_client_params_stripped_total",
		Help: "Chat and completion bodies whose client-supplied kv_transfer_params or bootstrap_host/port/room were removed before routing (pd.client_params strip)."})
	for _, c := range []prometheus.Collector{m.decisions, m.prefill, m.prefillOK, m.handoff, m.fallbacks, m.retries, m.releases, m.stranded, m.stripped} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register gateway P/D metrics: %w", err)
		}
	}
	return m, nil
}

// pdRoutable reports whether x's request to p is routed by P/D: a P/D pool,
// a chat or completion, not pinned.
func (x *exchange) pdRoutable(kind apiKind, p *pool) bool {
	return p.pd != nil && (kind == kindChat || kind == kindCompletion) && x.pass.pinEP == nil
}

// pickWith is pickExcluding with pick in place of the pool's policy.
func (g *Gateway) pickWith(p *pool, req *sched.Request, excluded []bool,
	pick func(*sched.Request, []sched.Endpoint) sched.Decision) (int, sched.Decision) {
	limit := p.maxRequests
	snap := p.snapshot()
	defer p.release(snap)
	defer g.settleLater(p)
	s := *snap
	for range len(s) {
		p.ruleOut(s, req, excluded, limit)
		d := pick(req, s)
		if d.Endpoint < 0 || d.Endpoint >= len(s) || !s[d.Endpoint].Ready {
			return -1, d
		}
		if p.endpoints[d.Endpoint].tryAcquire(limit) {
			return d.Endpoint, d
		}
		s[d.Endpoint].Ready = false
	}
	return -1, sched.Decision{Endpoint: -1}
}

// pickSplit is a P/D request's first pick: PD decides (D, split, P), D's
// breaker slot is taken, and a split request's flow is run (runFlow). It
// returns D's slot and decision, or -1.
func (g *Gateway) pickSplit(r *http.Request, x *exchange, kind apiKind, p *pool, excluded []bool, reqID string) (int, sched.Decision) {
	x.pd.on, x.pd.connector, x.pd.reqID = true, g.cfg.PD.connector(), reqID
	x.pd.orig, x.pd.origSet = x.pass.sendBody, true
	snap := p.snapshot()
	s := *snap
	p.ruleOut(s, &x.sreq, excluded, p.maxRequests)
	dec := p.pd.Pick(&x.sreq, s)
	p.release(snap)
	g.settleLater(p)
	di, dd := -1, dec.Decode
	if dec.Decode.Endpoint >= 0 && p.endpoints[dec.Decode.Endpoint].tryAcquire(p.maxRequests) {
		di = dec.Decode.Endpoint
	} else if dec.Decode.Endpoint >= 0 { // filled up since the snapshot
		di, dd = g.pickWith(p, &x.sreq, excluded, p.pd.PickDecode)
	}
	if dec.Split && di >= 0 && x.overContext(kind, p.endpoints[di].spec.Load().maxModelLen) {
		// D would refuse it after P computed and held its prompt: served
		// whole, refused without a hold.
		dec.Split, dec.Reason = false, pdReasonOverContext
	}
	outcome, reason := "whole", dec.Reason
	if dec.Split && di >= 0 {
		outcome, reason = "split", "long"
	}
	g.pdm.decisions.WithLabelValues(p.model, outcome, reason).Inc()
	x.obs.pdDecided(outcome, reason)
	g.learntPD(p, x, di, dd.MatchedBlocks*p.blockSize, sched.RoleDecode, dec.Split) // to the other replicas (replicas.go)
	if di < 0 || !dec.Split {
		return di, dd
	}
	x.pd.pMatched = dec.Prefill.MatchedBlocks * p.blockSize
	g.runFlow(r, x, kind, p, di, dec.Prefill.Endpoint, reqID)
	return di, dd
}

// pickDecodeRetry picks another D after a failed D attempt (the same
// kv_transfer_params for NIXL, whose P holds the blocks; a new flow, both
// legs, for the concurrent connectors).
func (g *Gateway) pickDecodeRetry(r *http.Request, x *exchange, kind apiKind, p *pool, excluded []bool, reqID string) (int, sched.Decision) {
	i, d := g.pickWith(p, &x.sreq, excluded, p.pd.PickDecode)
	if i < 0 {
		return i, d
	}
	g.learntPD(p, x, i, d.MatchedBlocks*p.blockSize, sched.RoleDecode, x.pd.split)
	if x.pd.split || x.pd.fellBack {
		g.pdm.retries.WithLabelValues(p.model, "decode").Inc()
	}
	if x.pd.split && x.pd.connector.Concurrent() {
		x.pass.sendBody = x.pd.orig
		g.runFlow(r, x, kind, p, i, -1, reqID)
	}
	return i, d
}

// runFlow runs the hand-off of a request split to D in slot di, with P
// first tried in slot pi (-1: picked here): up to pd.prefill_attempts
// prefill endpoints, then, when none succeeded, the request is served whole
// on D. It leaves D's body in x.pass.sendBody.
func (g *Gateway) runFlow(r *http.Request, x *exchange, kind apiKind, p *pool, di, pi int, reqID string) {
	x.pd.split = false
	if x.pd.connector == disagg.LLMD {
		// D's sidecar runs the flow: only P's address is the gateway's.
		if pi < 0 || pi == di {
			pi = g.pickPrefill(p, x, di, nil)
		} else {
			pi = g.takePrefill(p, x, di, pi)
		}
		if pi < 0 {
			return
		}
		p.endpoints[pi].releaseSlot() // no leg of the gateway's
		u := p.endpoints[pi].urls[kindChat]
		x.pd.prefiller, x.pd.split = disagg.HostPort(u.Hostname(), u.Port(), u.Scheme), true
		x.obs.prefilled(p.endpoints[pi].name, 0)
		return
	}
	orig := x.upstreamBody()
	pex := make([]bool, len(p.endpoints))
	var last string
	for a := 1; a <= g.cfg.PD.PrefillAttempts; a++ {
		if a > 1 || pi < 0 || pi == di {
			pi = g.pickPrefill(p, x, di, pex)
		} else {
			pi = g.takePrefill(p, x, di, pi)
		}
		if pi < 0 {
			break
		}
		if a > 1 {
			g.pdm.retries.WithLabelValues(p.model, "prefill").Inc()
		}
		le, bodyErr := g.prefillLeg(r, x, kind, p, pi, orig, reqID)
		if bodyErr != nil {
			slog.Warn("gateway: P/D body could not be rewritten; served whole", "request_id", reqID, "err", bodyErr)
			last = "body"
			break
		}
		if le == nil {
			x.pd.split = true
			return
		}
		last = le.Reason
		if r.Context().Err() != nil {
			return // the client is gone: D's attempt answers 499
		}
		pex[pi] = true
	}
	if last == "" {
		last = "no_prefill"
	}
	x.pd.fellBack = true
	x.pass.sendBody = x.pd.orig
	g.pdm.fallbacks.WithLabelValues(p.model, last).Inc()
	x.obs.pdDecided("fallback", last)
}

// takePrefill takes P's breaker slot in slot pi, else picks another.
func (g *Gateway) takePrefill(p *pool, x *exchange, di, pi int) int {
	if p.endpoints[pi].tryAcquire(p.maxRequests) {
		g.learntPD(p, x, pi, x.pd.pMatched, sched.RolePrefill, true)
		return pi
	}
	return g.pickPrefill(p, x, di, nil)
}

// pickPrefill picks P (not D's slot di, nor those in ex) and takes its
// breaker slot; -1 when none can take the leg.
func (g *Gateway) pickPrefill(p *pool, x *exchange, di int, ex []bool) int {
	excl := make([]bool, len(p.endpoints))
	copy(excl, ex)
	excl[di] = true
	i, d := g.pickWith(p, &x.sreq, excl, p.pd.PickPrefill)
	x.pd.pMatched = d.MatchedBlocks * p.blockSize
	g.learntPD(p, x, i, x.pd.pMatched, sched.RolePrefill, true)
	return i
}

// prefillLeg runs one prefill leg to P in slot pi (whose breaker slot is
// taken): NIXL's serially, a concurrent connector's started (its end is
// settled by decodeDone). It returns the leg's failure, or bodyErr when the
// body could not be rewritten (a request the gateway cannot split).
func (g *Gateway) prefillLeg(r *http.Request, x *exchange, kind apiKind, p *pool, pi int, orig []byte, reqID string) (le *disagg.LegError, bodyErr error) {
	ep := p.endpoints[pi]
	u := ep.urls[kindChat]
	var pbody []byte
	tid := ""
	port := p.bootstrap[pi]
	switch x.pd.connector {
	case disagg.NIXL:
		pbody, bodyErr = disagg.NIXLPrefillBody(x.pd.pbody[:0], orig)
	case disagg.Mooncake:
		tid = disagg.NewTransferID()
		x.pd.transferID = tid
		pbody, bodyErr = disagg.MooncakePrefillBody(x.pd.pbody[:0], orig, tid)
	case disagg.SGLang:
		var n int
		if n, bodyErr = disagg.BatchSize(orig, kind == kindChat); bodyErr == nil {
			rooms := make([]uint64, max(n, 1))
			for i := range rooms {
				rooms[i] = disagg.NewRoom()
			}
			pbody, bodyErr = disagg.SGLangBody(x.pd.pbody[:0], orig, u.Hostname(), port, rooms)
			x.pd.rooms = rooms
		}
	}
	if bodyErr != nil {
		ep.releaseSlot()
		return nil, bodyErr
	}
	x.pd.pbody = pbody
	x.pd.header = upstreamHeader(x.pd.header, r.Header, []string{reqID}, r.RemoteAddr)
	g.stripClientPrefiller(x.pd.header)
	ep.spec.Load().addHeader(x.pd.header)
	if x.pd.connector == disagg.Mooncake {
		x.pd.header.Set(disagg.DataParallelRankHeader, "0")
	}
	header := x.pd.header.Clone() // the leg's own: D's attempt builds its own
	send := g.legSender(r.Method, ep.url(kind, r.URL.Path, r.URL.RawQuery), header)
	if x.sreq.PromptTokens > 0 {
		// As virtual.Fleet accounts a prefill leg: its uncached part in
		// P's prefill backlog.
		ep.ledger.Send(&x.pd.pshare, x.sreq.PromptTokens, x.pd.pMatched, clock(time.Now()))
	}
	x.pd.pEP, x.pd.pi = ep, pi
	if x.pd.connector.Concurrent() {
		x.pd.pName = ep.name // the hold's engine, for a release
	}
	start := time.Now()
	switch x.pd.connector {
	case disagg.NIXL:
		pre, le := disagg.RunPrefill(r.Context(), g.cfg.PD.PrefillTimeout, send, pbody)
		g.legEnded(x, p, le, start)
		if le != nil {
			return le, nil
		}
		x.pd.pre, x.pd.held, x.pd.pName = pre, pre.Holds(), ep.name
		if pre.HasUsage {
			x.pd.cached = pre.Cached
		}
		x.pd.readyAt = time.Now()
		x.pd.body, bodyErr = disagg.NIXLDecodeBody(x.pd.body[:0], orig, pre.Params)
	case disagg.Mooncake:
		hb := *u
		hb.Host, hb.Path, hb.RawQuery = disagg.HostPort(u.Hostname(), strconv.Itoa(port), "http"), disagg.BootstrapQueryPath, ""
		hb.Scheme = "http"
		engineID, qe := disagg.QueryBootstrap(r.Context(), g.cfg.PD.PrefillTimeout, g.legSender(http.MethodGet, &hb, nil), 0)
		if qe != nil {
			g.legEnded(x, p, qe, start)
			return qe, nil
		}
		x.pd.body, bodyErr = disagg.MooncakeDecodeBody(x.pd.body[:0], orig, tid, disagg.BootstrapAddr(u.Hostname(), port), engineID)
		if bodyErr == nil {
			x.pd.leg, x.pd.legStart = disagg.StartLeg(r.Context(), g.cfg.PD.PrefillTimeout, send, pbody), start
		}
	case disagg.SGLang:
		x.pd.body = append(x.pd.body[:0], pbody...)
		x.pd.leg, x.pd.legStart = disagg.StartLeg(r.Context(), g.cfg.PD.PrefillTimeout, send, pbody), start
	}
	if x.pd.leg != nil { // a new flow's P: its own cached tokens (pdCached)
		x.pd.cached, x.pd.legRead = -1, false
	}
	if bodyErr != nil {
		g.legEnded(x, p, nil, start)
		return nil, bodyErr
	}
	x.pass.sendBody = x.pd.body
	x.obs.prefilled(ep.name, time.Since(start))
	return nil, nil
}

// stripClientParams removes a client's P/D members from x's body
// (PDConfig.ClientParams) before it is routed; a body that cannot be read
// as an object is left to the engine, which refuses it as it would have.
func (g *Gateway) stripClientParams(x *exchange, kind apiKind) {
	if (kind != kindChat && kind != kindCompletion) || g.cfg.PD.ClientParams == PDClientParamsPass {
		return
	}
	b, ok, err := disagg.StripClientParams(nil, x.upstreamBody())
	if err != nil || !ok {
		return
	}
	x.pass.sendBody = b
	g.pdm.stripped.Inc()
}

// prefillerKey is disagg.PrefillerHeader's canonical key.
var prefillerKey = http.CanonicalHeaderKey(disagg.PrefillerHeader)

// stripClientPrefiller removes a client's own x-prefiller-host-port from
// an engine request's header h (PDConfig.ClientParams strip): llm-d's
// routing sidecar in front of an engine would run a prefill at the
// host:port it names, with the request's headers and the engine's key.
func (g *Gateway) stripClientPrefiller(h http.Header) {
	if g.cfg.PD.ClientParams != PDClientParamsPass {
		delete(h, prefillerKey)
	}
}

// pdReasonOverContext is the decision reason of a request the gateway does
// not split because its prompt and max tokens exceed D's context length.
const pdReasonOverContext = "over-context"

// overContext reports whether x's prompt (the gateway's token count) and
// its explicit max tokens exceed maxModelLen (0: unknown, never): a split
// would make P compute and hold the prompt for a D that refuses it.
func (x *exchange) overContext(kind apiKind, maxModelLen int) bool {
	var mt *int
	switch kind {
	case kindChat:
		mt = x.chat.MaxTokens
		if x.chat.MaxCompletionTokens != nil {
			mt = x.chat.MaxCompletionTokens
		}
	case kindCompletion:
		mt = x.comp.MaxTokens
	}
	// prompt > maxModelLen − max tokens: the sum overflows for a max tokens
	// near the int range, which the API accepts.
	return maxModelLen > 0 && mt != nil && x.sreq.PromptTokens > maxModelLen-*mt
}

// legSender sends a leg's body to u with header (nil: none) through the
// gateway's upstream client.
func (g *Gateway) legSender(method string, u *url.URL, header http.Header) disagg.Send {
	return func(ctx context.Context, body []byte) (*http.Response, error) {
		var (
			req *http.Request
			err error
		)
		if body != nil {
			req, err = http.NewRequestWithContext(ctx, method, "", bytes.NewReader(body))
		} else {
			req, err = http.NewRequestWithContext(ctx, method, "", nil)
		}
		if err != nil {
			return nil, err
		}
		req.URL, req.Host = u, u.Host
		if header != nil {
			req.Header = header
		} else {
			req.Header = http.Header{}
		}
		return g.roundTrip(req, time.Time{}, nil)
	}
}

// legEnded settles P's leg that ended with le (nil: succeeded) after
// start: its breaker slot and ledger share given back, its outlier state,
// the metrics.
func (g *Gateway) legEnded(x *exchange, p *pool, le *disagg.LegError, start time.Time) {
	ep := x.pd.pEP
	if ep == nil {
		return
	}
	now := time.Now()
	x.pd.pshare.FirstToken(clock(now))
	x.pd.pshare.Finish()
	x.pd.pshare = load.Share{}
	ep.releaseSlot()
	x.pd.pEP = nil
	g.pdm.prefill.WithLabelValues(p.model, ep.name).Observe(now.Sub(start).Seconds())
	if le == nil {
		x.obs.prefilled(ep.name, now.Sub(start)) // a concurrent leg ends after D's is sent: its whole duration
	}
	result := "ok"
	if le != nil {
		result = le.Reason
		switch le.Reason {
		case disagg.ReasonConnect:
			g.outlierFailure(ep, reasonConnect, now)
		case disagg.Reason5xx:
			g.outlierFailure(ep, reason5xx, now)
		case disagg.ReasonTimeout:
			g.outlierFailure(ep, reasonTimeout, now)
		case disagg.ReasonBadParams:
			g.outlierFailure(ep, reasonBadResponse, now)
		case disagg.ReasonStatus:
			ep.outlierSuccess() // the engine answered: the request's fault
		}
		if le.Reason != disagg.ReasonCanceled {
			slog.Warn("gateway: P/D prefill leg failed", "endpoint", ep.name, "request_id", x.pd.reqID,
				"reason", le.Reason, "err", le.Err)
		}
	} else {
		ep.outlierSuccess()
	}
	g.pdm.prefillOK.WithLabelValues(p.model, ep.name, result).Inc()
}

// decodeDone settles the concurrent P leg after D's attempt, f its failure
// (nil: answered): canceled when D failed (both run again on a retry),
// else waited for (bounded by pd.prefill_timeout).
//
// Known gap: a concurrent P leg that fails while D's attempt is still
// waiting for its KV does not cancel D: D's engine fails or recomputes the
// transfer (vLLM's kv_load_failure_policy; the simulator at once when P is
// unreachable, after PDConfig.Wait when P lives but holds nothing), or D's
// timeouts apply. Canceling D from here needs D's attempt under a context
// of its own (leg.Done() before D's response headers), a failure kind the
// retry loop (route.go) neither charges to D's outlier state nor excludes D
// for, and the whole request resent to the same D (or the flow run again
// with another P) without spending a retry attempt: not small enough for
// this path.
func (g *Gateway) decodeDone(x *exchange, p *pool, f *failure) {
	if x.pd.leg == nil {
		return
	}
	var le *disagg.LegError
	if f != nil {
		le = x.pd.leg.Cancel()
	} else {
		le = x.pd.leg.Wait()
	}
	g.legEnded(x, p, le, x.pd.legStart)
	x.pd.leg = nil
}

// endSplit ends a P/D request's routing to p: a concurrent leg still running is canceled,
// and blocks P still holds for a D that did not answer (failed, refused,
// abandoned by the client) are released (pd.release) or counted stranded.
// The body sent is given back to what it was.
func (g *Gateway) endSplit(x *exchange, p *pool) {
	if !x.pd.on {
		return
	}
	defer x.pd.reset() // an alias's next target starts afresh
	if x.pd.leg != nil {
		g.decodeDone(x, p, &failure{})
	}
	if x.pd.origSet {
		x.pass.sendBody = x.pd.orig
	}
	if x.pd.dCode/100 == 2 {
		return // D answered: it read the KV (or recomputed: P's hold then ends at its timeout)
	}
	var bodies [][]byte // the holds D did not read
	switch {
	case x.pd.held && x.pd.pre.RequestID != "":
		bodies = append(bodies, disagg.ReleaseBody(&x.pd.pre))
	case x.pd.held:
		g.pdm.stranded.WithLabelValues(p.model).Inc() // no remote_request_id to name it
	case x.pd.split && x.pd.transferID != "":
		bodies = append(bodies, disagg.ReleaseTransferBody(x.pd.transferID))
	case x.pd.split:
		for _, room := range x.pd.rooms {
			bodies = append(bodies, disagg.ReleaseRoomBody(room))
		}
	}
	for _, b := range bodies {
		if !g.cfg.PD.Release {
			g.pdm.stranded.WithLabelValues(p.model).Inc()
			continue
		}
		g.release(p, x.pd.pName, b)
	}
}

// release asks P (the endpoint named name, if a reload kept it) to free the
// blocks body names (disagg.ReleaseBody and its peers).
func (g *Gateway) release(p *pool, name string, body []byte) {
	var ep *endpoint
	for _, e := range p.latest().endpoints {
		if e != vacant && e.name == name {
			ep = e
			break
		}
	}
	result := "error"
	if ep != nil {
		u := *ep.urls[kindChat]
		u.Path = trimChatPath(u.Path) + disagg.ReleasePath
		u.RawQuery = ""
		h := http.Header{"Content-Type": {"application/json"}}
		ep.spec.Load().addHeader(h)
		ok, err := disagg.ReleaseWith(context.Background(), g.cfg.PD.ReleaseTimeout, g.legSender(http.MethodPost, &u, h), body)
		switch {
		case err != nil:
			slog.Warn("gateway: P/D release failed", "endpoint", ep.name, "hold", string(body), "err", err)
		case ok:
			result = "released"
		default:
			result = "not_held"
		}
	}
	g.pdm.releases.WithLabelValues(p.model, result).Inc()
}

// trimChatPath is a chat URL's path without /v1/chat/completions: the
// endpoint's base path.
func trimChatPath(path string) string {
	if n := len(path) - len(pathChat); n >= 0 && path[n:] == pathChat {
		return path[:n]
	}
	return path
}

// pdCached reports whether D's usage is to be rewritten with P's cached
// tokens (x.pd.cached): NIXL's P answered before D was sent; a concurrent
// leg's answer is waited for here, at D's usage, once (P answers when it
// holds the prompt's KV, before D can have read it; a P that fails or
// stalls ends within pd.prefill_timeout, and D's own count is kept).
func (x *exchange) pdCached() bool {
	if x.pd.cached < 0 && x.pd.leg != nil && !x.pd.legRead {
		x.pd.legRead = true
		if c, ok := x.pd.leg.Cached(); ok {
			x.pd.cached = c
		}
	}
	return x.pd.cached >= 0
}

// pdRewrite returns data (D's usage chunk or whole answer) with its
// cached_tokens set to P's, u's too when given.
func (x *exchange) pdRewrite(data []byte, u *openai.Usage) []byte {
	b, ok := disagg.RewriteCached(x.pd.pbody[:0], data, x.pd.cached)
	if !ok {
		return data
	}
	x.pd.pbody = b
	if u != nil {
		if u.PromptTokensDetails == nil {
			u.PromptTokensDetails = &openai.PromptTokensDetails{}
		}
		u.PromptTokensDetails.CachedTokens = x.pd.cached
	}
	return b
}
