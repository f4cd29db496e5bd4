package gateway

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/textproto"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/openai"
)

// Secret is a configuration value that is never shown: it formats as
// "[redacted]" with every fmt verb (%v, %+v and %#v of a struct holding it
// included, so a logged or printed Config carries no key), and encodes so
// in JSON and YAML. An empty Secret formats as "". The value itself is
// string(s).
type Secret string

// redacted is what a non-empty Secret shows.
const redacted = "[redacted]"

func (s Secret) shown() string {
	if s == "" {
		return ""
	}
	return redacted
}

// String implements fmt.Stringer.
func (s Secret) String() string { return s.shown() }

// GoString implements fmt.GoStringer.
func (s Secret) GoString() string { return fmt.Sprintf("%q", s.shown()) }

// Format implements fmt.Formatter: every verb shows the redacted form.
func (s Secret) Format(f fmt.State, verb rune) {
	if verb == 'v' && f.Flag('#') {
		_, _ = io.WriteString(f, s.GoString())
		return
	}
	_, _ = io.WriteString(f, s.shown())
}

// MarshalJSON implements json.Marshaler (a config dump shows no key).
func (s Secret) MarshalJSON() ([]byte, error) { return json.Marshal(s.shown()) }

// MarshalYAML implements yaml.Marshaler.
func (s Secret) MarshalYAML() (any, error) { return s.shown(), nil }

// Bounds of an endpoint's configured request headers (credentials
// included): what an engine's front end accepts beside the client's own
// headers (uvicorn's h11 refuses a request whose header block exceeds
// 16 KiB, h11_max_incomplete_event_size).
const (
	maxEndpointHeaders     = 32
	maxEndpointHeaderBytes = 8 << 10 // names and values together
)

// defaultAPIKeyHeader carries an endpoint's api_key as "Bearer <key>"
// (vLLM's --api-key, OpenAI and the OpenAI-compatible hosted backends).
const defaultAPIKeyHeader = "Authorization"

// refusedEndpointHeader returns why canonical header name k may not be
// configured in an endpoint's headers or api_key_header, "" when it may:
// hop-by-hop headers (RFC 9110 §7.6.1) belong to one connection; the
// framing and content headers (Host, Content-Length, Content-Type,
// Content-Encoding, Accept-Encoding, Expect) are the gateway's, which sends
// the client's JSON body as it is and parses the answer as it streams (a
// Host other than the URL's would also disagree with TLS's server name:
// put the name in the URL); X-Request-Id, the forwarding headers,
// traceparent/tracestate and X-Priority are set or governed by the
// gateway per request; X-Infergate-* is its namespace.
func refusedEndpointHeader(k string) string {
	switch {
	case isHopByHop(k):
		return "a hop-by-hop header"
	case isForwarding(k), strings.HasPrefix(k, "X-Infergate-"):
		return "set by the gateway"
	}
	switch k {
	case "Host", "Content-Length", "Content-Type", "Content-Encoding", "Accept-Encoding", "Expect":
		return "set by the gateway for the request it sends"
	case "X-Request-Id", "Traceparent", "Tracestate", PriorityHeader:
		return "set by the gateway per request"
	}
	return ""
}

// validHeaderName reports whether s is an RFC 9110 field name (a token).
func validHeaderName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// headerValueProblem says what is wrong with a configured header value
// (RFC 9110 §5.5: visible characters, spaces and tabs inside, none at the
// ends), "" when nothing is. It never quotes the value, which may be a
// credential.
func headerValueProblem(v string) string {
	if v == "" {
		return "empty"
	}
	if c := v[len(v)-1]; c == ' ' || c == '\t' || c == '\n' || c == '\r' {
		return "ends with whitespace or a newline (a key read from a file with its trailing newline?)"
	}
	if c := v[0]; c == ' ' || c == '\t' {
		return "begins with whitespace"
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < ' ' && c != '\t') || c == 0x7f {
			return fmt.Sprintf("holds a control character (byte %d)", i)
		}
	}
	return ""
}

// quoteName quotes a configured header name for an error message, cut to
// 64 bytes.
func quoteName(k string) string {
	if len(k) > 64 {
		k = k[:64] + "…"
	}
	return fmt.Sprintf("%q", k)
}

// endpointHeader resolves and checks an endpoint's credentials and extra
// headers and returns the header set the gateway adds to every request it
// sends the engine (canonical names, one shared value each; nil when
// none): headers as configured, then the API key (api_key, or the
// environment variable api_key_env names, read with lookup) in
// api_key_header, "Authorization: Bearer <key>" by default. Errors name
// the offending key and header, never a value.
func endpointHeader(e EndpointConfig, lookup func(string) (string, bool)) (http.Header, error) {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if len(e.Headers) > maxEndpointHeaders {
		return nil, fmt.Errorf("headers: %d headers, at most %d", len(e.Headers), maxEndpointHeaders)
	}
	var h http.Header
	size := 0
	for name, v := range e.Headers {
		if !validHeaderName(name) {
			bad("headers: %s is not a header name (RFC 9110 token characters)", quoteName(name))
			continue
		}
		k := textproto.CanonicalMIMEHeaderKey(name)
		if why := refusedEndpointHeader(k); why != "" {
			bad("headers: %s may not be configured (%s)", quoteName(name), why)
			continue
		}
		if p := headerValueProblem(string(v)); p != "" {
			bad("headers: the value of %s is %s", quoteName(name), p)
			continue
		}
		if _, dup := h[k]; dup {
			bad("headers: %s is given twice (header names are case-insensitive)", quoteName(k))
			continue
		}
		if h == nil {
			h = make(http.Header, len(e.Headers)+1)
		}
		h[k] = []string{string(v)}
		size += len(k) + len(v)
	}

	key, from := string(e.APIKey), "api_key"
	switch {
	case e.APIKey != "" && e.APIKeyEnv != "":
		bad("api_key and api_key_env are both set: give one (api_key_env, to keep the key out of the file)")
		key = ""
	case e.APIKeyEnv != "":
		from = "api_key_env " + e.APIKeyEnv
		v, ok := lookup(e.APIKeyEnv)
		switch {
		case !validEnvName(e.APIKeyEnv):
			bad("api_key_env %s: not an environment variable name", quoteName(e.APIKeyEnv))
		case !ok:
			bad("api_key_env: the environment variable %s is not set", e.APIKeyEnv)
		case v == "":
			bad("api_key_env: the environment variable %s is empty", e.APIKeyEnv)
		}
		key = v
	}
	hk := defaultAPIKeyHeader
	if e.APIKeyHeader != "" {
		switch {
		case !validHeaderName(e.APIKeyHeader):
			bad("api_key_header %s is not a header name (RFC 9110 token characters)", quoteName(e.APIKeyHeader))
		case refusedEndpointHeader(textproto.CanonicalMIMEHeaderKey(e.APIKeyHeader)) != "":
			bad("api_key_header %s may not carry the key (%s)", quoteName(e.APIKeyHeader),
				refusedEndpointHeader(textproto.CanonicalMIMEHeaderKey(e.APIKeyHeader)))
		case e.APIKey == "" && e.APIKeyEnv == "":
			bad("api_key_header %s is set without api_key or api_key_env", quoteName(e.APIKeyHeader))
		}
		hk = textproto.CanonicalMIMEHeaderKey(e.APIKeyHeader)
	}
	if key != "" {
		if p := headerValueProblem(key); p != "" {
			bad("%s: the key is %s", from, p)
		} else if _, dup := h[hk]; dup {
			bad("headers: %s is also set by %s (api_key_header %s)", quoteName(hk), from, hk)
		} else {
			v := key
			if hk == defaultAPIKeyHeader {
				v = "Bearer " + key
			}
			if h == nil {
				h = make(http.Header, 1)
			}
			h[hk] = []string{v}
			size += len(hk) + len(v)
		}
	}
	if size > maxEndpointHeaderBytes {
		bad("headers and api_key: %d bytes, at most %d", size, maxEndpointHeaderBytes)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return h, nil
}

// validEnvName reports whether s is a portable environment variable name
// (POSIX: letters, digits and underscores, not starting with a digit).
func validEnvName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c == '_' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || i > 0 && '0' <= c && c <= '9') {
			return false
		}
	}
	return true
}

// sameCredentials reports whether two entries of one engine (one URL listed
// under several models) configure the same credentials and headers.
func sameCredentials(a, b EndpointConfig) bool {
	if a.APIKey != b.APIKey || a.APIKeyEnv != b.APIKeyEnv || a.APIKeyHeader != b.APIKeyHeader || len(a.Headers) != len(b.Headers) {
		return false
	}
	for k, v := range a.Headers {
		if w, ok := b.Headers[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// addHeader sets the spec's configured headers on h (an upstream
// request's), replacing any the client sent under the same names. The
// values are shared, never modified: no allocation, nothing at all when the
// endpoint has none.
func (s *endpointSpec) addHeader(h http.Header) { addHeader(h, s.header) }

// addHeader sets every header of add on h, sharing the values.
func addHeader(h, add http.Header) {
	for k, vs := range add {
		h[k] = vs
	}
}

// codeUpstreamAuth is the error code of an engine refusing the gateway's
// credentials (a 502: the operator's configuration, not the client's key).
const codeUpstreamAuth = "upstream_auth"

// reasonAuth: the engine answered 401 or 403, refusing the gateway's
// credentials (outlier ejection at once, retried elsewhere).
const reasonAuth = "auth"

// Where an endpoint's auth refusal was seen (the source label of
// infergate_endpoint_auth_failures_total).
const (
	authSourceRequest  = "request"  // an inference request
	authSourceHealth   = "health"   // a health probe
	authSourceDiscover = "discover" // the start-up GET /v1/models or /metrics read
)

// authStatus is the error of an engine call answered 401 or 403 (the
// status; fleet.AuthRefused, which the prober's reads return too).
type authStatus = fleet.AuthRefused

// isAuthRefusal reports whether an engine's status refuses the gateway's
// credentials (fleet.IsAuthRefusal).
func isAuthRefusal(status int) bool { return fleet.IsAuthRefusal(status) }

// newAuthFailures registers infergate_endpoint_auth_failures_total.
func newAuthFailures(reg prometheus.Registerer) (*prometheus.CounterVec, error) {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "endpoint_auth_failures_total",
		Help: "Engine answers 401/403 refusing the gateway's credentials, by endpoint and source: request (an inference " +
			"request, answered 502 upstream_auth unless retried), health (a health probe), discover (a start-up read)."},
		[]string{"endpoint", "source"})
	if err := reg.Register(c); err != nil {
		return nil, fmt.Errorf("gateway: register auth failure metric: %w", err)
	}
	return c, nil
}

// authRefused handles an engine's 401 or 403 to a request sent with spec's
// credentials: the engine refused the gateway's own credentials, which the
// client can do nothing about, so the client never sees the engine's 401
// (an OpenAI SDK reads it as "your API key is wrong"). The endpoint is
// ejected at once (every request with these credentials fails alike) —
// unless a reload has changed its credentials since the request was sent
// (the refusal is of the old ones) — the refusal logged once per run of
// refusals and counted, and the failure returned: retried on another
// endpoint, else answered 502 upstream_auth.
func (g *Gateway) authRefused(ep *endpoint, spec *endpointSpec, rm *routeMetrics, resp *http.Response, reqID string) *failure {
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // keep the connection reusable
	g.noteAuthFailure(ep, authSourceRequest, resp.StatusCode, reqID)
	if now := ep.spec.Load(); now == spec || sameHeader(now.header, spec.header) {
		g.outlierFailure(ep, reasonAuth, time.Now())
	}
	return &failure{reason: reasonAuth, rm: rm, err: openai.NewError(http.StatusBadGateway,
		fmt.Sprintf("The model server refused the gateway's credentials (HTTP %d). This is the gateway's configuration "+
			"(the endpoint's api_key), not your API key.", resp.StatusCode), "", codeUpstreamAuth)}
}

// sameHeader reports whether two endpoint header sets (endpointHeader's:
// one value per name) are the same.
func sameHeader(a, b http.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for k, vs := range a {
		ws, ok := b[k]
		if !ok || !slices.Equal(vs, ws) {
			return false
		}
	}
	return true
}

// noteAuthFailure counts an auth refusal from source and logs it when it
// begins a run of refusals (the first since a request to the endpoint last
// succeeded), so a wrong key logs once, not once per request. A health
// probe's refusal is logged by checkHealth, once per outage.
func (g *Gateway) noteAuthFailure(ep *endpoint, source string, status int, reqID string) {
	if g.engineAuthFailures != nil {
		g.engineAuthFailures.WithLabelValues(ep.name, source).Inc()
	}
	if source != authSourceHealth && !ep.authFailing.Swap(true) { // a probe's refusal: checkHealth logs it
		args := []any{"endpoint", ep.name, "status", status, "source", source}
		if reqID != "" {
			args = append(args, "request_id", reqID)
		}
		slog.Error("gateway: the engine refused the gateway's credentials; check the endpoint's api_key, api_key_env or headers", args...)
	}
}

// credentialsCheck is what a reload learnt of an endpoint's credentials
// before publishing them (reload.go): refused is the status (401, 403) of an
// engine that refused them on a read (0: none did), accepted that a read
// guarded by them (GET /v1/models) succeeded.
type credentialsCheck struct {
	refused  int
	accepted bool
}

// note records the outcome of a read sent with the credentials checked.
func (c *credentialsCheck) note(err error) {
	var st authStatus
	if errors.As(err, &st) {
		c.refused = int(st)
	}
}

// applyCredentials acts at a reload's commit, in configuration order, on
// what build learnt of the endpoints' credentials: an endpoint that refused
// the credentials it is given is taken out of rotation, as a request's
// refusal would (so that no client request is sent to it first; at start,
// every endpoint). One whose changed credentials were accepted has its
// authentication refusals forgotten: an ejection they caused (the old
// credentials') ends, and it is back in rotation at once.
func (g *Gateway) applyCredentials(eps []*endpoint, checks map[*endpoint]credentialsCheck, now time.Time) {
	for _, ep := range eps {
		c, ok := checks[ep]
		switch {
		case !ok:
		case c.refused != 0:
			g.noteAuthFailure(ep, authSourceDiscover, c.refused, "")
			g.ejectOutlier(ep, reasonAuth, now)
		case c.accepted:
			ep.authFailing.Store(false)
			if ep.endAuthEjection(now) {
				slog.Info("gateway: endpoint accepts its new credentials; back in rotation", "endpoint", ep.name)
			}
		}
	}
}
