package gateway

import (
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/netip"
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
		closeConnection(w, r) // HTTP/1.x only: over HTTP/2 it would GOAWAY the shared connection
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
