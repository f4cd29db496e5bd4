package gateway

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/infergate/infergate/openai"
)

// Paths served.
const (
	pathChat        = "/v1/chat/completions"
	pathCompletions = "/v1/completions"
	pathModels      = "/v1/models"
	pathMetrics     = "/metrics"
	pathHealthz     = "/healthz"
	pathReadyz      = "/readyz"
)

// maxMetricsScrapes bounds the GET /metrics answered at once (promhttp's
// MaxRequestsInFlight); more are answered 503 at once. A scrape gathers and
// encodes every family, about 450 KB of heap each with the fleet of `up`:
// 3,000 concurrent scrapes, from a client that needs no key when /metrics
// is open, took infergate up from 136 MB to 567 MB RSS. Prometheus scrapes a
// target one at a time; a few replicas and a dashboard fit.
const maxMetricsScrapes = 16

// route dispatches on the exact path, answering OpenAI errors for wrong
// methods (405) and unknown paths (404), after the edge checks (header size,
// API key: edge.go).
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
	case pathDashboard + "/":
		// The page's links are relative to /dashboard (state.json, metrics):
		// from /dashboard/ they would miss, so send the browser there,
		// relatively, which keeps a reverse proxy's path prefix.
		if g.allow(w, r, http.MethodGet) {
			w.Header().Set("Location", "../dashboard")
			w.WriteHeader(http.StatusMovedPermanently)
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
	if !ok || (key != nil && !key.Allows(model)) {
		openai.WriteError(w, modelNotAllowed(model))
		observedFor(w).failed(openai.CodeModelNotFound)
		return
	}
	writeJSON(w, http.StatusOK, b)
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
	case g.ReadinessHold() != "":
		status = http.StatusServiceUnavailable
		rd.Status = "not ready"
		rd.Reason = g.ReadinessHold()
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
