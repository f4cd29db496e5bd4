package gateway

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/upstream"
)

// failure is an attempt that failed before any byte of its answer reached
// the client: it may be retried elsewhere, and is answered when it is not.
type failure struct {
	reason string        // reason* constant
	rm     *routeMetrics // the endpoint that failed
	// status and body are an engine's JSON error answer, relayed as is when
	// body is non-nil (it aliases x.errBody); otherwise err is answered.
	status int
	body   []byte
	err    *openai.Error
}

// connectionFailed reports whether f is a failure of the connection itself
// (refused, reset or closed before the answer), not of an answer.
func (f *failure) connectionFailed() bool {
	return f.reason == reasonConnect || f.reason == reasonReset
}

// codeAbort is relayBody's result for a body that broke off after the
// status line was sent (accounted as 502).
const codeAbort = -1

// attempt sends the request to endpoint i of p (whose circuit-breaker slot
// pickExcluding took) and relays the answer. It returns nil when the
// request was answered (successfully or not: it is then accounted), or the
// failure to retry or answer when nothing reached the client.
func (g *Gateway) attempt(w http.ResponseWriter, r *http.Request, x *exchange, kind apiKind, p *pool, i int,
	d sched.Decision, reqID string, start time.Time) *failure {
	ep, rm := p.endpoints[i], p.routes[i]
	defer ep.releaseSlot()
	g.beginAttempt(w, x, p, i, d)
	// The request's share of the endpoint's load: its prompt in flight until
	// it ends, its uncached part in the prefill backlog until its first
	// token (relayStream) or its end (load.Ledger).
	if x.sreq.PromptTokens > 0 { // untokenized (round-robin): nothing to account, no clock read
		matched := d.MatchedBlocks * p.blockSize
		if x.pd.split {
			matched = x.sreq.PromptTokens // D reads the prompt's KV from P: nothing to prefill (virtual.Fleet's hand-off)
		}
		ep.ledger.Send(&x.share, x.sreq.PromptTokens, matched, clock(time.Now()))
	}
	defer x.share.Finish()
	g.predict(x, p, i, d, rm)
	// However the attempt ends, the engine no longer runs the request: the
	// pin the pick took is released and the prompt touched (learning.go).
	defer g.learnFinished(p, i, x)

	body := x.upstreamBody()
	strip := false
	if x.stream && !x.includeUsage {
		b, err := withIncludeUsage(x.upBody[:0], body)
		if err != nil {
			// openai.Decode accepted the body, encoding/json cannot edit it
			// (nesting over its 10000 levels): never forward a stream
			// without usage, which the key's token limit and the metrics
			// need.
			g.fail(w, rm, openai.NewError(http.StatusBadRequest,
				"The request body could not be edited to ask the engine for usage ("+err.Error()+").", "", openai.CodeInvalidJSON))
			return nil
		}
		x.upBody, body, strip = b, b, true
	}
	// The URL was parsed when the endpoint was configured: the request is
	// built with an empty one, which cannot fail to parse.
	req, err := http.NewRequestWithContext(r.Context(), r.Method, "", bytes.NewReader(body))
	if err != nil {
		g.fail(w, rm, openai.NewError(http.StatusBadGateway, "Could not build the upstream request.", "", openai.CodeUpstream))
		return nil
	}
	req.URL = ep.url(kind, r.URL.Path, r.URL.RawQuery)
	req.Host = req.URL.Host
	x.upHeader = upstreamHeader(x.upHeader, r.Header, x.requestIDValue(reqID), r.RemoteAddr)
	spec := ep.spec.Load()
	spec.addHeader(x.upHeader) // the endpoint's credentials and headers (credentials.go)
	if x.pd.prefiller != "" {
		x.upHeader[prefillerKey] = []string{x.pd.prefiller} // llm-d's sidecar runs the flow
	} else {
		g.stripClientPrefiller(x.upHeader)
	}
	req.Header = x.upHeader
	x.obs.inject(req.Header) // this attempt's traceparent (tracing.go)

	// A stream's first output is due within first_event_timeout of the
	// request, its response headers included; a non-streaming answer's
	// headers come when it is done (response_header_timeout).
	var firstBy time.Time
	if x.stream {
		firstBy = time.Now().Add(g.cfg.FirstEventTimeout)
	}
	x.wait.On(&ep.waits)
	resp, err := g.roundTrip(req, firstBy, &x.wait)
	x.wait.On(nil)
	if err != nil {
		switch {
		case r.Context().Err() != nil:
			g.canceled(w, r, rm) // 499, or 503 when ended by Abort
			return nil
		case errors.Is(err, upstream.ErrEndpointDown): // already out of rotation: no outlier failure
			slog.Warn("gateway: request aborted on an endpoint that failed its health checks", "endpoint", ep.name, "request_id", reqID)
			return &failure{reason: reasonEndpointDown, rm: rm, err: openai.NewError(http.StatusBadGateway,
				"The model server stopped answering its health checks while the request waited for its answer.", "", openai.CodeUpstream)}
		case upstream.IsResponseTimeout(err):
			slog.Warn("gateway: upstream response timeout", "endpoint", ep.name, "request_id", reqID, "err", err)
			g.outlierFailure(ep, reasonTimeout, time.Now())
			msg := fmt.Sprintf("The model server did not answer within %s (response_header_timeout).", g.cfg.ResponseHeaderTimeout)
			if x.stream && g.cfg.FirstEventTimeout < g.cfg.ResponseHeaderTimeout {
				msg = fmt.Sprintf("The model server sent no output within %s (first_event_timeout).", g.cfg.FirstEventTimeout)
			}
			return &failure{reason: reasonTimeout, rm: rm, err: openai.NewError(http.StatusGatewayTimeout, msg, "", codeUpstreamTimeout)}
		}
		reason := reasonReset
		if upstream.IsDialError(err) {
			reason = reasonConnect
		}
		slog.Warn("gateway: upstream connection failed", "endpoint", ep.name, "request_id", reqID,
			"reason", reason, "err", err)
		g.outlierFailure(ep, reason, time.Now())
		return &failure{reason: reason, rm: rm, err: openai.NewError(http.StatusBadGateway,
			"The model server could not be reached.", "", openai.CodeUpstream)}
	}
	defer resp.Body.Close()
	if !x.pd.readyAt.IsZero() && x.stream { // D's first byte after P's answer (a whole answer's headers come after its decode)
		g.pdm.handoff.WithLabelValues(p.model).Observe(time.Since(x.pd.readyAt).Seconds())
		x.pd.readyAt = time.Time{}
	}

	if resp.StatusCode >= 500 {
		g.outlierFailure(ep, reason5xx, time.Now())
		return g.serverError(resp, x, rm)
	}
	if isAuthRefusal(resp.StatusCode) { // the gateway's credentials, not the client's
		return g.authRefused(ep, spec, rm, resp, reqID)
	}
	var (
		f    *failure
		code int
	)
	switch {
	case resp.StatusCode/100 == 3:
		// A redirect (never followed) or another 3xx is the endpoint's
		// doing, not an answer to the request (render.go backs off on it
		// too): relayed, the client got a 3xx without its Location
		// (dropDownstream) where it expects an answer or an error.
		f = &failure{reason: reasonBadResponse, rm: rm, err: openai.NewError(http.StatusBadGateway,
			fmt.Sprintf("The model server answered %d, not an answer to the request.", resp.StatusCode), "", openai.CodeUpstream)}
	case resp.StatusCode/100 != 2:
		ep.outlierSuccess() // the engine answered: a client error is not its failure
		g.relayError(w, r, resp, rm)
		return nil
	case x.stream && isEventStream(resp.Header):
		f, code = g.relayStream(w, r, resp, x, rm, reqID, start, strip, firstBy)
	case x.stream && !isJSON(resp.Header):
		// Not an answer to a streaming request (a proxy's login page, a
		// misrouted server): nothing was relayed, so it is retried.
		f = &failure{reason: reasonBadResponse, rm: rm, err: openai.NewError(http.StatusBadGateway,
			fmt.Sprintf("The model server answered a streaming request %d with Content-Type %q, not text/event-stream.",
				resp.StatusCode, truncate(resp.Header.Get("Content-Type"), 64)), "", openai.CodeUpstream)}
	default:
		if f, code = g.relayBody(w, r, resp, x, rm, start); code == codeAbort {
			if r.Context().Err() == nil { // not ended by Abort
				g.outlierFailure(ep, reasonStream, time.Now())
			}
			// The status line is out: abort the connection so the client
			// sees a truncated response, never a silently short one.
			panic(http.ErrAbortHandler)
		}
	}
	x.pd.dCode = code
	if x.pass.respID != "" && f == nil && code/100 == 2 {
		g.affinity.learn(x.pass.respID, p.model, ep, x.pass.key) // the engine stored it (responses.go)
	}
	switch {
	case f != nil:
		g.outlierFailure(ep, f.reason, time.Now())
	case code == http.StatusBadGateway:
		g.outlierFailure(ep, reasonStream, time.Now())
	case code == http.StatusGatewayTimeout: // a started stream stalled
		g.outlierFailure(ep, reasonTimeout, time.Now())
	case code != codeClientClosed:
		ep.outlierSuccess()
	}
	return f
}

// roundTrip sends req upstream with its read deadline by (zero: none; see
// upstream.Client.RoundTripBy) and its header wait w (upstream/wait.go), or through g.rt as is when it is not the
// gateway's own client (a benchmark's in-memory engine).
func (g *Gateway) roundTrip(req *http.Request, by time.Time, w *upstream.Wait) (*http.Response, error) {
	if u, ok := g.rt.(*upstream.Client); ok {
		return u.RoundTripBy(req, by, w)
	}
	return g.rt.RoundTrip(req)
}

// serverError reads an engine's 5xx answer into a failure: relayed as is if
// it is JSON (at most maxErrorBody bytes), else a 502 wrapping it.
func (g *Gateway) serverError(resp *http.Response, x *exchange, rm *routeMetrics) *failure {
	f := &failure{reason: reason5xx, rm: rm}
	buf := bytes.NewBuffer(x.errBody[:0])
	_, err := buf.ReadFrom(io.LimitReader(resp.Body, maxErrorBody+1))
	x.errBody = buf.Bytes()
	body := x.errBody
	if err == nil && len(body) <= maxErrorBody && engineJSON(body) {
		f.status, f.body = resp.StatusCode, body
		return f
	}
	snippet := strings.ToValidUTF8(string(body[:min(len(body), 256)]), "")
	f.err = openai.NewError(http.StatusBadGateway,
		fmt.Sprintf("The model server answered %d: %s", resp.StatusCode, strings.TrimSpace(snippet)), "", openai.CodeUpstream)
	return f
}

// answerFailure answers a failure that is not retried, or reports true
// (answering nothing) when the request falls back to its alias's next
// target instead.
func (g *Gateway) answerFailure(w http.ResponseWriter, x *exchange, f *failure) (fell bool) {
	if x.pass.fallback && x.retrySafe(f) {
		x.pass.fell = fallbackFailed
		return true
	}
	if f.body != nil {
		writeJSON(w, f.status, f.body)
		g.count(w, f.rm, f.status)
		return false
	}
	g.fail(w, f.rm, f.err)
	return false
}

// truncate returns s cut to at most n bytes of valid UTF-8.
func truncate(s string, n int) string {
	if len(s) > n {
		s = s[:n]
	}
	return strings.ToValidUTF8(s, "")
}

// predict records what routing expects endpoint i of p to hold of x's
// prompt: the policy's prediction (by tier when the pool has tiers) in rm's
// counters and in x (compared with the engine's cached tokens when the
// request finishes), and the precise index's own when the policy is not
// the precise one; and it tells the index the prompt was routed there.
func (g *Gateway) predict(x *exchange, p *pool, i int, d sched.Decision, rm *routeMetrics) {
	if d.MatchedBlocks > 0 {
		rm.predicted.Add(float64(d.MatchedBlocks * p.blockSize))
	}
	if rm.predictedTier[0] != nil {
		for t, n := range d.TierBlocks {
			if n > 0 {
				rm.predictedTier[t].Add(float64(n * p.blockSize))
			}
		}
	}
	x.predicted, x.precisePredicted = -1, -1
	if p.policy.NeedsHashes() {
		x.predicted, x.predictedBy = d.MatchedBlocks*p.blockSize, indexApproximate
		if p.precisePolicy {
			x.predictedBy = indexPrecise
		}
	}
	if p.precise != nil && !p.precisePolicy {
		x.precisePredicted = p.preciseMatch(x.hashes, i) * p.blockSize
		if p.tiers != nil {
			// What the engine takes from all its tiers, as the index
			// sees them (the engine reports only the total).
			x.precisePredicted = 0
			for _, n := range p.preciseTiers(x.hashes, i, x.sreq.PromptTokens) {
				x.precisePredicted += n * p.blockSize
			}
		}
	}
	if p.precise != nil {
		p.precise.Routed(i, x.hashes) // joins the engine's events for it (prefix/precise_join.go)
	}
}
