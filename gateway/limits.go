package gateway

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/openai"
)

// Defaults of EdgeConfig.
const (
	// DefaultMaxHeaderBytes bounds a request's header block (64 KiB: Envoy's
	// default is 60 KiB, nginx's 4 × 8 KiB; OpenAI clients send < 2 KiB).
	DefaultMaxHeaderBytes = 64 << 10
	// DefaultReadHeaderTimeout bounds receiving a request's headers (and the
	// TLS handshake).
	DefaultReadHeaderTimeout = 10 * time.Second
	// DefaultIdleTimeout closes idle client keep-alive connections.
	DefaultIdleTimeout = 2 * time.Minute
	// DefaultWriteTimeout is the longest one write to a client may block
	// (a client that stops reading a stream is dropped after it).
	DefaultWriteTimeout = time.Minute
)

// EdgeConfig is the part of Config about the gateway's front: who may call
// it, over what, and how much a client may send or hold (README "Security"
// and "Limits"). Config embeds it, so its keys are top-level YAML keys.
type EdgeConfig struct {
	// Auth configures API keys; without keys the gateway is open.
	Auth AuthConfig `yaml:"auth"`
	// TLS terminates HTTPS on Listen when CertFile and KeyFile are set.
	TLS TLSConfig `yaml:"tls"`
	// TrustedProxies are the peers (CIDRs or addresses) whose
	// X-Forwarded-For / -Proto / -Host, Forwarded and X-Real-Ip headers are
	// passed on (X-Forwarded-For with the peer appended). From any other
	// peer those headers are dropped and the gateway sets X-Forwarded-For
	// to the peer's address and X-Forwarded-Proto to http or https.
	TrustedProxies []string `yaml:"trusted_proxies"`
	// MaxHeaderBytes bounds a request's header block (bytes, default 64
	// KiB): over it the gateway answers an OpenAI-format 431; over twice it
	// net/http stops reading and answers its own plain-text 431.
	MaxHeaderBytes int `yaml:"max_header_bytes"`
	// ReadHeaderTimeout bounds receiving a request's headers, TLS handshake
	// included (default 10s).
	ReadHeaderTimeout time.Duration `yaml:"read_header_timeout"`
	// IdleTimeout closes client keep-alive connections idle this long
	// (default 2m).
	IdleTimeout time.Duration `yaml:"idle_timeout"`
	// WriteTimeout is the longest one write of a response to the client may
	// block (default 1m; negative: no limit). It is a per-write stall limit,
	// not a bound on the whole response, so long streams are unaffected; a
	// client that stops reading is disconnected and its upstream request
	// canceled.
	WriteTimeout time.Duration `yaml:"write_timeout"`
}

// withDefaults fills zero fields.
func (e EdgeConfig) withDefaults() EdgeConfig {
	if e.MaxHeaderBytes == 0 {
		e.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	if e.ReadHeaderTimeout == 0 {
		e.ReadHeaderTimeout = DefaultReadHeaderTimeout
	}
	if e.IdleTimeout == 0 {
		e.IdleTimeout = DefaultIdleTimeout
	}
	if e.WriteTimeout == 0 {
		e.WriteTimeout = DefaultWriteTimeout
	}
	return e
}

// maxHeaderLimit bounds max_header_bytes (64 MiB).
const maxHeaderLimit = 64 << 20

// validate reports the edge settings' errors (keys are checked when New
// loads them).
func (e EdgeConfig) validate() []error {
	var errs []error
	if e.MaxHeaderBytes < 1024 || e.MaxHeaderBytes > maxHeaderLimit {
		errs = append(errs, fmt.Errorf("max_header_bytes %d: want 1024 to %d", e.MaxHeaderBytes, maxHeaderLimit))
	}
	if e.ReadHeaderTimeout < 0 {
		errs = append(errs, fmt.Errorf("read_header_timeout %v: must be positive", e.ReadHeaderTimeout))
	}
	if e.IdleTimeout < 0 {
		errs = append(errs, fmt.Errorf("idle_timeout %v: must be positive", e.IdleTimeout))
	}
	if _, err := parseTrusted(e.TrustedProxies); err != nil {
		errs = append(errs, err)
	}
	if err := e.TLS.validate(); err != nil {
		errs = append(errs, err)
	}
	return errs
}

// parseTrusted parses trusted_proxies entries: CIDRs or single addresses.
func parseTrusted(list []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range list {
		if p, err := netip.ParsePrefix(s); err == nil {
			out = append(out, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("trusted_proxies %q: want a CIDR (10.0.0.0/8) or an address", s)
		}
		out = append(out, netip.PrefixFrom(a, a.BitLen()))
	}
	return out, nil
}

// edge is the gateway's front-door state (embedded in Gateway).
type edge struct {
	trusted   []netip.Prefix // peers whose forwarding headers are kept
	tlsConfig *tls.Config    // nil: plain HTTP

	authFailures *prometheus.CounterVec // reason
	rateLimited  *prometheus.CounterVec // key, limit

	// clock is the rate limits' time (time.Now; tests stop it, so that
	// no refill depends on how fast the machine runs them).
	clock func() time.Time
}

// initEdge loads the TLS certificate and registers the edge's metrics. It
// runs in New; the API keys are part of what a reload replaces (state).
func (g *Gateway) initEdge(reg prometheus.Registerer) error {
	g.clock = time.Now
	var err error
	if g.trusted, err = parseTrusted(g.cfg.TrustedProxies); err != nil {
		return err
	}
	if g.cfg.TLS.Enabled() {
		if g.tlsConfig, err = newTLSConfig(g.cfg.TLS); err != nil {
			return err
		}
	}
	g.authFailures = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "auth_failures_total",
		Help: "API requests refused with 401, by reason (missing, invalid)."}, []string{"reason"})
	g.rateLimited = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "rate_limited_total",
		Help: "Requests refused with 429 by a key's rate limit, by key name and limit (requests, tokens)."}, []string{"key", "limit"})
	for _, c := range []prometheus.Collector{g.authFailures, g.rateLimited} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("gateway: register metrics: %w", err)
		}
	}
	return nil
}

// buildKeys loads cfg's API keys for a new state (nil keyring when
// authentication is off), prev's buckets kept by key name, each key given
// its usage counters (by name, from usage), and warns of what looks like a
// mistake (a model allowed that targets, the models and aliases served, do
// not have).
func buildKeys(cfg Config, prev *state, targets map[string][]*pool, modelsBody []byte, usage *keyUsageVecs) (*keyring, []limitChange, error) {
	if !cfg.Auth.Enabled() {
		return nil, nil, nil
	}
	var old *keyring
	if prev != nil {
		old = prev.keys
	}
	kr, changes, err := loadKeys(cfg.Auth, old)
	if err != nil {
		return nil, nil, err
	}
	if err := kr.initModelLists(modelsBody); err != nil {
		return nil, nil, fmt.Errorf("gateway: model lists: %w", err)
	}
	if len(kr.principals) == 0 {
		slog.Warn("gateway: authentication is on but no API key is configured: every API request will be refused")
	}
	for _, p := range kr.principals {
		p.usage = usage.of(p.name)
		for m := range p.models {
			if targets[m] == nil {
				slog.Warn("gateway: API key allows a model no endpoint serves", "key", p.name, "model", m)
			}
		}
	}
	return kr, changes, nil
}

// AuthEnabled reports whether API keys are required.
func (g *Gateway) AuthEnabled() bool { return g.state.Load().keys != nil }

// TLSEnabled reports whether Server terminates TLS (serve it with
// ServeTLS(ln, "", "") or ListenAndServeTLS("", "")).
func (g *Gateway) TLSEnabled() bool { return g.tlsConfig != nil }

// serverHeaderBytes is http.Server.MaxHeaderBytes for a max_header_bytes
// limit: twice it, so that headers between the limit and twice it reach the
// handler and get the OpenAI-format 431 (net/http answers plain text beyond).
func serverHeaderBytes(limit int) int { return 2 * limit }

// headerBytes is the size of r's header block as sent on HTTP/1.1: request
// line, Host and every header line with its ": " and CRLF.
func headerBytes(r *http.Request) int {
	n := len(r.Method) + len(r.RequestURI) + len(r.Proto) + 4 + len("Host: \r\n") + len(r.Host)
	for k, vs := range r.Header {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
}

// codeHeaderTooLarge is the code of a 431.
const codeHeaderTooLarge = "request_header_too_large"

// checkEdge runs first for every request: header size (431), then the API
// key (401, against st's keys) on protected paths. It returns the principal
// (nil when authentication is off or the path is open) and false once it
// has answered.
func (g *Gateway) checkEdge(w http.ResponseWriter, r *http.Request, st *state) (*principal, bool) {
	if n := headerBytes(r); n > g.cfg.MaxHeaderBytes {
		w.Header().Set("Connection", "close")
		openai.WriteError(w, openai.NewError(http.StatusRequestHeaderFieldsTooLarge,
			fmt.Sprintf("Request headers are %d bytes, over the limit of %d bytes.", n, g.cfg.MaxHeaderBytes), "", codeHeaderTooLarge))
		if proxiedPath(r.URL.Path) {
			g.count(w, g.unknown, http.StatusRequestHeaderFieldsTooLarge)
		}
		return nil, false
	}
	if proxiedPath(r.URL.Path) {
		scrubForwarding(r.Header, g.peerTrusted(r.RemoteAddr), r.TLS != nil)
	}
	return g.authenticate(w, r, st)
}

// peerTrusted reports whether the connection's peer is a trusted proxy.
func (g *Gateway) peerTrusted(remoteAddr string) bool {
	if len(g.trusted) == 0 {
		return false
	}
	ap, err := netip.ParseAddrPort(remoteAddr)
	if err != nil {
		return false
	}
	a := ap.Addr().Unmap()
	for _, p := range g.trusted {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// extendWriteDeadline makes sure the next write to the client has at least
// half of WriteTimeout to complete, moving the connection's write deadline
// at most once per half timeout (a write that blocks longer than that means
// the client stopped reading). Call it right before writing response bytes;
// the server clears the deadline after the handler.
func (g *Gateway) extendWriteDeadline(w http.ResponseWriter, x *exchange, now time.Time) {
	d := g.cfg.WriteTimeout
	if d <= 0 || now.Add(d/2).Before(x.edge.writeDeadline) {
		return
	}
	x.edge.writeDeadline = now.Add(d)
	_ = http.NewResponseController(w).SetWriteDeadline(x.edge.writeDeadline)
}

// exchangeEdge is the per-request edge state kept in the exchange.
type exchangeEdge struct {
	// limits are the key's limits while the request holds a charge on them
	// (nil when none): charged at admit, given back by refundAdmission when
	// the gateway refuses the request before sending it, settled against
	// usage by settleTokens at its end.
	limits *keyLimits
	// capPriority: the key caps the request's priority at maxPriority.
	capPriority   bool
	maxPriority   int
	reserved      float64   // tokens charged at admission, to settle against usage
	writeDeadline time.Time // the client connection's current write deadline
}

// admit checks, after the body is decoded, that the key may use the model
// (404 model_not_found otherwise, as OpenAI answers) and takes the request
// and its estimated tokens from the key's rate limits (429 otherwise);
// maxModelLen is the context length of the model's pool (0: no pool). It
// sets the x-ratelimit-* headers.
func (g *Gateway) admit(w http.ResponseWriter, x *exchange, kind apiKind, p *principal, maxModelLen int) *openai.Error {
	if p == nil {
		return nil
	}
	x.edge.capPriority, x.edge.maxPriority = p.capPriority, p.maxPriority
	if !p.allows(x.model) {
		return modelNotAllowed(x.model)
	}
	kl := p.limits
	if kl == nil {
		return nil
	}
	est, asked := x.tokenEstimate(kind, maxModelLen)
	now := g.clock()
	kl.mu.Lock() // a reload may change the limits (setLimits)
	reqLimit, tokLimit := kl.req.limit, kl.tok.limit
	// A bound from the context length (max_tokens omitted) over the whole
	// minute is held to it: the request waits for a full bucket instead of
	// never passing. What the client asked for itself is not.
	tooLarge := tokLimit > 0 && asked > tokLimit
	if tokLimit > 0 && !tooLarge {
		est = min(est, tokLimit)
	}
	okReq, waitReq := kl.req.check(now, 1)
	okTok, waitTok := true, time.Duration(0)
	if est > 0 { // tokenize and the like use no tokens: an overdrawn minute does not stop them
		okTok, waitTok = kl.tok.check(now, est)
	}
	if okReq && okTok && !tooLarge {
		kl.req.take(1)
		kl.tok.take(est)
	}
	h := w.Header()
	kl.req.setHeaders(h, &requestHeaderNames)
	kl.tok.setHeaders(h, &tokenHeaderNames)
	kl.mu.Unlock()

	switch {
	case tooLarge:
		g.rateLimited.WithLabelValues(p.name, "tokens").Inc()
		return &openai.Error{Message: fmt.Sprintf("Request too large for key %s on tokens per min (TPM): Limit %.0f, Requested %.0f (prompt estimate plus max_tokens). Send a smaller request.",
			p.name, tokLimit, est), Type: "tokens", Code: codeRateLimitExceeded, Status: http.StatusTooManyRequests}
	case !okReq || !okTok:
		limit, lim, wait := "requests", reqLimit, waitReq
		if okReq {
			limit, lim, wait = "tokens", tokLimit, waitTok
		}
		g.rateLimited.WithLabelValues(p.name, limit).Inc()
		secs := max(1, int(math.Ceil(wait.Seconds())))
		h.Set("Retry-After", strconv.Itoa(secs))
		h.Set("Retry-After-Ms", strconv.FormatInt(max(1, wait.Milliseconds()), 10))
		unit := "RPM"
		if limit == "tokens" {
			unit = "TPM"
		}
		return &openai.Error{Message: fmt.Sprintf("Rate limit reached for key %s on %s per min (%s): Limit %.0f. Please try again in %s.",
			p.name, limit, unit, lim, wait.Round(time.Millisecond)), Type: limit, Code: codeRateLimitExceeded, Status: http.StatusTooManyRequests}
	}
	x.edge.limits, x.edge.reserved = kl, est
	if tokLimit <= 0 {
		x.edge.reserved = 0
	}
	return nil
}

// refundAdmission gives the request's charge (1 request, its reserved
// tokens) back to the key's limits: the gateway refused it before sending
// it anywhere (model without endpoints, admission queue full or timed out,
// displaced, shutdown, no endpoint, client gone while queued), so it was
// never admitted. h, when not nil, gets the x-ratelimit-* headers again.
// Idempotent; a no-op after settleTokens.
func (x *exchange) refundAdmission(h http.Header) {
	kl := x.edge.limits
	if kl == nil {
		return
	}
	kl.mu.Lock()
	kl.req.adjust(-1)
	kl.tok.adjust(-x.edge.reserved)
	if h != nil {
		kl.req.setHeaders(h, &requestHeaderNames)
		kl.tok.setHeaders(h, &tokenHeaderNames)
	}
	kl.mu.Unlock()
	x.edge.limits, x.edge.reserved = nil, 0
}

// tokenEstimate is what a request is charged against tokens_per_minute at
// admission, a bound on the tokens it can use: the prompt (token ids
// counted exactly; text as body bytes / 4) plus max_tokens × n × prompts
// when max_tokens is given; without max_tokens an engine generates until
// the context is full, so each of the n × prompts sequences is bounded by
// maxModelLen tokens, prompt included (and never less than the prompt).
// asked is the part the client fixed (the prompt, and max_tokens when
// given): a request whose asked part exceeds the key's minute is too
// large. The charge is settled against the engine's reported usage when
// the response ends.
//
// The other APIs: a response like a chat (max_output_tokens its
// max_tokens; a continuation's stored turns are not in its body, so its
// charge is settled up from usage); embeddings their input alone (no
// output); an unknown path its body / 4; tokenize, detokenize and
// responses by id no tokens (they count against requests_per_minute only).
func (x *exchange) tokenEstimate(kind apiKind, maxModelLen int) (est, asked float64) {
	var prompt, maxTok, n, prompts float64 = 0, 0, 1, 1
	var mt, nc *int
	switch kind {
	case kindTokenize, kindDetokenize, kindResponseByID:
		return 0, 0
	case kindEmbeddings:
		prompt = float64(len(x.body) / 4)
		if ids := x.pass.emb.Input.Tokens; len(ids) > 0 {
			prompt = 0
			for _, p := range ids {
				prompt += float64(len(p))
			}
		}
		return max(1, prompt), max(1, prompt)
	case kindOther:
		return max(1, float64(len(x.body)/4)), max(1, float64(len(x.body)/4))
	case kindResponses:
		mt, prompt = x.pass.resp.MaxOutputTokens, float64(len(x.body)/4)
	}
	if kind == kindChat {
		mt, nc = x.chat.MaxTokens, x.chat.N
		if x.chat.MaxCompletionTokens != nil {
			mt = x.chat.MaxCompletionTokens
		}
		prompt = float64(len(x.body) / 4)
	} else if kind == kindCompletion {
		mt, nc = x.comp.MaxTokens, x.comp.N
		if ids := x.comp.Prompt.Tokens; len(ids) > 0 {
			for _, p := range ids {
				prompt += float64(len(p))
			}
		} else {
			prompt = float64(len(x.body) / 4)
		}
		prompts = float64(max(1, x.comp.Prompt.Len()))
	}
	if nc != nil && *nc > 1 {
		n = float64(*nc)
	}
	if mt == nil || *mt <= 0 {
		// Usage counts the prompt once per prompt and every choice's
		// completion: prompts × (p + n × (L − p)) ≤ prompts × n × L.
		return max(1, prompt, prompts*n*float64(maxModelLen)), max(1, prompt)
	}
	maxTok = float64(*mt)
	est = max(1, prompt+maxTok*n*prompts)
	return est, est
}

// settleTokens charges the difference between a request's reported usage
// and what admission charged (a refund when it used less). Without usage
// (a failed or canceled request) the admission charge stands. Idempotent.
func (x *exchange) settleTokens(u *openai.Usage) {
	kl := x.edge.limits
	if kl == nil || u == nil {
		return
	}
	used := u.TotalTokens
	if used <= 0 {
		used = u.PromptTokens + u.CompletionTokens
	}
	kl.mu.Lock()
	kl.tok.adjust(float64(max(used, 0)) - x.edge.reserved) // a no-op without a token limit
	kl.mu.Unlock()
	x.edge.limits, x.edge.reserved = nil, 0
}

// keyLimits are one key's token buckets (one per key name: memory is
// bounded by the keys configured). A reload keeps them for a key it keeps
// (loadKeys), its limits changed in place (setLimits).
type keyLimits struct {
	mu  sync.Mutex
	req bucket // requests
	tok bucket // tokens
}

// setLimits changes the per-minute limits (0: none) at now, keeping what
// the key has used of them (bucket.setLimit).
func (kl *keyLimits) setLimits(rpm, tpm int, now time.Time) {
	kl.mu.Lock()
	kl.req.setLimit(rpm, now)
	kl.tok.setLimit(tpm, now)
	kl.mu.Unlock()
}

// newKeyLimits returns the buckets for the per-minute limits (0: none), or
// nil when the key has no limit.
func newKeyLimits(rpm, tpm int) *keyLimits {
	if rpm <= 0 && tpm <= 0 {
		return nil
	}
	return &keyLimits{req: newBucket(rpm), tok: newBucket(tpm)}
}

// bucket is a token bucket holding up to limit units and refilled at limit
// per minute; starting full. Its level may go negative (to −limit at most)
// when usage reported after a response exceeds what admission charged, so
// the excess delays the key's next requests. limit 0: unlimited.
type bucket struct {
	limit float64
	level float64
	last  time.Time
}

func newBucket(perMinute int) bucket {
	return bucket{limit: float64(max(perMinute, 0)), level: float64(max(perMinute, 0))}
}

// refill adds what accrued since the last refill.
func (b *bucket) refill(now time.Time) {
	if !b.last.IsZero() {
		if dt := now.Sub(b.last); dt > 0 {
			b.level = min(b.limit, b.level+dt.Minutes()*b.limit)
		}
	}
	b.last = now
}

// check refills and reports whether n units are available now, else how
// long until they are.
func (b *bucket) check(now time.Time, n float64) (bool, time.Duration) {
	if b.limit <= 0 {
		return true, 0
	}
	b.refill(now)
	if b.level >= n {
		return true, 0
	}
	need := min(n, b.limit) - b.level
	return false, time.Duration(need / b.limit * float64(time.Minute))
}

// setLimit changes the bucket's limit at now to perMinute (0: unlimited),
// keeping what was used of the minute: a bucket limit − level short of full
// stays as short of full under the new limit (within [−limit, limit]), so
// a raised limit is available at once and a lowered one holds what was
// already spent against it. A bucket that had no limit starts full.
func (b *bucket) setLimit(perMinute int, now time.Time) {
	n := float64(max(perMinute, 0))
	if b.limit <= 0 || n <= 0 {
		*b = newBucket(perMinute)
		return
	}
	b.refill(now)
	used := b.limit - b.level
	b.limit = n
	b.level = max(-n, min(n, n-used))
}

// take removes n units (after a successful check).
func (b *bucket) take(n float64) {
	if b.limit > 0 {
		b.level -= n
	}
}

// adjust removes delta units (negative: returns them), keeping the level
// within [−limit, limit].
func (b *bucket) adjust(delta float64) {
	if b.limit > 0 {
		b.level = max(-b.limit, min(b.limit, b.level-delta))
	}
}

// Header names of OpenAI's rate-limit headers, per limit kind.
var (
	requestHeaderNames = [3]string{"X-Ratelimit-Limit-Requests", "X-Ratelimit-Remaining-Requests", "X-Ratelimit-Reset-Requests"}
	tokenHeaderNames   = [3]string{"X-Ratelimit-Limit-Tokens", "X-Ratelimit-Remaining-Tokens", "X-Ratelimit-Reset-Tokens"}
)

// setHeaders sets OpenAI's x-ratelimit-limit-, -remaining- and -reset-
// headers named by names (reset: the time until the bucket is full again,
// as a Go duration like OpenAI's "6m0s" or "20ms").
func (b *bucket) setHeaders(h http.Header, names *[3]string) {
	if b.limit <= 0 {
		return
	}
	remaining := max(0, math.Floor(b.level))
	reset := time.Duration((b.limit - b.level) / b.limit * float64(time.Minute)).Round(time.Millisecond)
	h[names[0]] = []string{strconv.FormatFloat(b.limit, 'f', 0, 64)}
	h[names[1]] = []string{strconv.FormatFloat(remaining, 'f', 0, 64)}
	h[names[2]] = []string{reset.String()}
}

// CheckLoopback reports an error unless addr ("host:port") is on loopback:
// a loopback IP or "localhost".
func CheckLoopback(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if host == "localhost" {
		return nil
	}
	if a, err := netip.ParseAddr(host); err != nil || !a.IsLoopback() {
		return fmt.Errorf("%q is not a loopback address", addr)
	}
	return nil
}

// IsLoopbackListen reports whether a listen address only accepts loopback
// connections (an empty host, "0.0.0.0" or "::" listen everywhere).
func IsLoopbackListen(addr string) bool { return CheckLoopback(addr) == nil }
