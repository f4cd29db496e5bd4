package gateway

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// EndpointHeader names, with response_headers.endpoint, the endpoint an
// answer came from (the last one tried): its name, the normalized base
// URL the configuration gives (never credentials: URLs with credentials
// are refused).
const EndpointHeader = "X-Infergate-Endpoint"

// Bounds of the access log.
const (
	// accessLogBuffer bounds the lines waiting for the writer (bytes): a
	// sink that stalls (a full pipe nobody reads) costs at most this much
	// memory, and the lines beyond it are dropped and counted, never
	// waited for on the request path.
	accessLogBuffer = 1 << 20
	// accessLogCloseWait bounds Close's wait for the last lines to be
	// written.
	accessLogCloseWait = 5 * time.Second
	// accessLogFlushBytes and accessLogFlushInterval: the writer writes
	// what has gathered every interval (100 ms: a line is out within it,
	// Envoy's default is 1 s), or as soon as this much is waiting; the
	// request path never wakes it for less (a goroutine wake-up per line
	// costs more than the line).
	accessLogFlushBytes    = 64 << 10
	accessLogFlushInterval = 100 * time.Millisecond
	// maxLoggedValue bounds a client-supplied value in a line (model,
	// path, user agent, client address; bytes).
	maxLoggedValue = 256
)

// obsWriter is the client's ResponseWriter for an API request (a /v1/
// path) while the access log or tracing is on: it records what the
// request did — the status and bytes written, what the metrics counted,
// usage, TTFT, attempts — for the access line and the spans written at
// its end (serveObserved). Pooled; nothing on it allocates. With both
// off, requests are served with the plain ResponseWriter and the record
// calls below are nil-receiver no-ops.
type obsWriter struct {
	http.ResponseWriter
	start time.Time

	status int   // the first status written (0: none yet)
	bytes  int64 // body bytes written

	code    int           // what infergate_requests_total counted (0: nothing)
	rm      *routeMetrics // its labels: model, endpoint, policy
	errCode string        // the OpenAI error code answered, or of a stream's error event

	key      *principal
	model    string // the request's model as sent (decoded)
	decoded  bool
	stream   bool
	attempts int
	ttft     time.Duration // 0: no output event relayed
	usage    bool          // prompt, cached, output hold the engine's usage
	prompt   int
	cached   int
	output   int

	// pd and pdReason are a P/D request's decision (split, whole,
	// fallback) and why; prefill the prefill endpoint of its split and
	// prefillTime its leg's duration (pd.go).
	pd, pdReason string
	prefill      string
	prefillTime  time.Duration

	trace requestTrace // tracing.go; zero when tracing is off
	line  []byte       // the encoded access line (reused)
}

func (w *obsWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *obsWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	n, err := w.ResponseWriter.Write(b)
	w.bytes += int64(n)
	return n, err
}

// Unwrap lets http.ResponseController reach the connection (flushes,
// deadlines).
func (w *obsWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// counted records what the metrics counted for the request.
func (w *obsWriter) counted(rm *routeMetrics, code int) {
	if w != nil {
		w.rm, w.code = rm, code
	}
}

// failed records the OpenAI error code the request was answered with.
func (w *obsWriter) failed(code string) {
	if w != nil {
		w.errCode = code
	}
}

// decodedRequest records the request's model and whether it streams.
func (w *obsWriter) decodedRequest(model string, stream bool) {
	if w != nil && model != "" { // "": the body was not a request
		w.model, w.stream, w.decoded = model, stream, true
	}
}

// firstOutput records the time to first token.
func (w *obsWriter) firstOutput(ttft time.Duration) {
	if w != nil {
		w.ttft = ttft
	}
}

// used records the engine's usage (nil: none reported).
func (w *obsWriter) used(u *openai.Usage) {
	if w != nil && u != nil {
		w.usage = true
		w.prompt, w.cached, w.output = u.PromptTokens, u.Cached(), u.CompletionTokens
	}
}

// pdDecided records a P/D request's decision and its reason.
func (w *obsWriter) pdDecided(outcome, reason string) {
	if w != nil {
		w.pd, w.pdReason = outcome, reason
	}
}

// prefilled records the prefill leg of a split request.
func (w *obsWriter) prefilled(endpoint string, d time.Duration) {
	if w != nil {
		w.prefill, w.prefillTime = endpoint, d
	}
}

// attemptFailed ends the current attempt's span with its failure (nil: the
// attempt answered; its span ends with the request).
func (w *obsWriter) attemptFailed(f *failure) {
	if w != nil && f != nil {
		w.trace.attemptFailed(f)
	}
}

// observer is the gateway's access log and tracer (nil when both are off).
type observer struct {
	log     *accessSink // nil: no access log
	json    bool        // the access log's format
	tracing *tracing    // nil: no traces
	writers sync.Pool   // *obsWriter
}

// observedFor returns w as the request's obsWriter, nil when w is not one
// (the request is not observed).
func observedFor(w http.ResponseWriter) *obsWriter {
	if c, ok := w.(*committedStream); ok { // a held stream's heartbeats committed it (coldstart.go)
		w = c.ResponseWriter
	}
	ow, _ := w.(*obsWriter)
	return ow
}

// count records one finished request with status code: in the metrics and,
// when the request is observed, in its record.
func (g *Gateway) count(w http.ResponseWriter, rm *routeMetrics, code int) {
	observedFor(w).counted(rm, code)
	g.metrics.count(rm, code)
}

// trackRequest links an inference request's exchange to its record (when
// observed) and counts it for its API key.
func (g *Gateway) trackRequest(w http.ResponseWriter, x *exchange, key *principal) {
	x.obs = observedFor(w)
	if key != nil && key.usage != nil {
		x.keyUse = key.usage
		key.usage.requests.Inc()
	}
}

// beginAttempt runs as endpoint i of p is tried: the served-by header (when
// configured), the attempt count, the attempt's span, a debug line.
func (g *Gateway) beginAttempt(w http.ResponseWriter, x *exchange, p *pool, i int, d sched.Decision) {
	ep := p.endpoints[i]
	h := w.Header()
	if g.cfg.ResponseHeaders.Endpoint {
		h[EndpointHeader] = ep.servedBy
	}
	n := 0
	if ow := x.obs; ow != nil {
		ow.attempts++
		n = ow.attempts
		if ow.trace.on() {
			g.obs.tracing.startAttempt(&ow.trace, ep, p, x, ow.attempts, d)
		}
	}
	if slog.Default().Enabled(context.Background(), slog.LevelDebug) {
		var id string
		if v := h["X-Request-Id"]; len(v) > 0 {
			id = v[0]
		}
		args := []any{"request_id", id, "endpoint", ep.name, "policy", p.policy.Name(), "matched_blocks", d.MatchedBlocks}
		if n > 0 {
			args = append(args, "attempt", n)
		}
		slog.Debug("gateway: attempt", args...)
	}
}

// initObservability sets up what ObservabilityConfig asks for: the access
// log's writer, the tracer, the per-key usage counters. It runs in New
// before the first state is built (whose keys get their usage counters);
// a New that fails after it closes what it opened (closeObservability).
// These settings keep their start value across reloads (README "Reload").
func (g *Gateway) initObservability(reg prometheus.Registerer) error {
	if err := g.initKeyUsage(reg); err != nil {
		return err
	}
	if !g.cfg.AccessLog.On() && g.cfg.Tracing.OTLPEndpoint == "" {
		return nil
	}
	o := &observer{json: g.cfg.Log.Format == LogFormatJSON}
	if g.cfg.AccessLog.On() {
		s, err := newAccessSink(g.cfg.AccessLog.Path, reg)
		if err != nil {
			return err
		}
		o.log = s
	}
	if g.cfg.Tracing.OTLPEndpoint != "" {
		t, err := newTracing(g.cfg.Tracing, nil)
		if err != nil {
			o.log.close()
			return err
		}
		o.tracing = t
	}
	g.obs = o
	g.handler = http.HandlerFunc(g.serveObserved)
	return nil
}

// closeObservability writes the last access lines and exports the last
// spans (each within a bound).
func (g *Gateway) closeObservability() {
	if g.obs == nil {
		return
	}
	g.obs.tracing.shutdown()
	g.obs.log.close()
}

// serveObserved serves a request with an obsWriter when it is an API
// request (a /v1/ path, /tokenize or /detokenize; the operational routes —
// metrics, health, the dashboard — are polled every few seconds and are
// neither logged nor traced), and writes its access line and ends its spans
// when it is done.
func (g *Gateway) serveObserved(w http.ResponseWriter, r *http.Request) {
	if !strings.HasPrefix(r.URL.Path, "/v1/") && !proxiedPath(r.URL.Path) {
		g.route(w, r)
		return
	}
	ow, _ := g.obs.writers.Get().(*obsWriter)
	if ow == nil {
		ow = &obsWriter{}
	}
	*ow = obsWriter{ResponseWriter: w, start: time.Now(), line: ow.line[:0]}
	if g.obs.tracing != nil && (r.URL.Path == pathChat || r.URL.Path == pathCompletions) {
		g.obs.tracing.startRequest(&ow.trace, r, ow.start)
	}
	defer g.observed(ow, r) // also when the handler aborts (http.ErrAbortHandler)
	g.route(ow, r)
}

// observed ends a request's spans, writes its access line and returns its
// obsWriter to the pool.
func (g *Gateway) observed(ow *obsWriter, r *http.Request) {
	end := time.Now()
	code := ow.finalStatus(r)
	if ow.trace.on() {
		g.obs.tracing.endRequest(ow, r, code, end, g.trusted)
	}
	if g.obs.log != nil {
		ow.line = ow.appendLine(ow.line[:0], r, code, end, g.obs.json, g.trusted)
		g.obs.log.write(ow.line)
	}
	line := ow.line
	if cap(line) > 64<<10 {
		line = nil
	}
	*ow = obsWriter{line: line}
	g.obs.writers.Put(ow)
}

// finalStatus is the request's status as the metrics counted it (499 for a
// client that went away, 502 for a stream that failed midway), else as
// written, else 499 when the client is gone and 200 (net/http's answer to
// a handler that wrote nothing) when not.
func (w *obsWriter) finalStatus(r *http.Request) int {
	switch {
	case w.code != 0:
		return w.code
	case w.status != 0:
		return w.status
	case r.Context().Err() != nil && !shuttingDown(r):
		return codeClientClosed
	}
	return http.StatusOK
}

// appendLine appends the request's access line to dst: slog's JSON or text
// layout (time, level, msg, then the fields), one line.
func (w *obsWriter) appendLine(dst []byte, r *http.Request, code int, end time.Time, json bool, trusted []netip.Prefix) []byte {
	e := lineEncoder{buf: dst, json: json}
	e.begin(end, "request")
	if id := requestIDOf(w, r); id != "" {
		e.str("id", id)
	}
	e.str("method", r.Method)
	e.str("path", r.URL.Path)
	e.int("status", int64(code))
	e.seconds("duration_seconds", end.Sub(w.start))
	if w.ttft > 0 {
		e.seconds("ttft_seconds", w.ttft)
	}
	if w.key != nil {
		e.str("key", w.key.Name)
	}
	if w.decoded {
		e.str("model", w.model)
		e.bool("stream", w.stream)
	}
	if w.rm != nil {
		if ep := w.rm.labels[1]; ep != "" {
			e.str("endpoint", ep)
		}
		e.str("policy", w.rm.labels[2])
	}
	if w.attempts > 0 {
		e.int("attempts", int64(w.attempts))
	}
	if w.pd != "" {
		e.str("pd", w.pd)
		if w.pdReason != "" {
			e.str("pd_reason", w.pdReason)
		}
		if w.prefill != "" {
			e.str("prefill_endpoint", w.prefill)
		}
		if w.prefillTime > 0 {
			e.seconds("prefill_seconds", w.prefillTime)
		}
	}
	if w.usage {
		e.int("prompt_tokens", int64(w.prompt))
		e.int("cached_tokens", int64(w.cached))
		e.int("output_tokens", int64(w.output))
	}
	if w.errCode != "" {
		e.str("error", w.errCode)
	}
	e.int("bytes", w.bytes)
	e.str("client", clientAddr(r, trusted))
	if ua := r.Header["User-Agent"]; len(ua) > 0 && ua[0] != "" {
		e.str("user_agent", ua[0])
	}
	return e.end()
}

// requestIDOf is the request's id: the X-Request-Id the gateway answered
// with (inference requests, 401s), else the client's when it is sane (GET
// /v1/models answers none), else "".
func requestIDOf(w http.ResponseWriter, r *http.Request) string {
	if id := w.Header()["X-Request-Id"]; len(id) > 0 {
		return id[0]
	}
	if id := r.Header["X-Request-Id"]; len(id) == 1 && saneRequestID(id[0]) {
		return id[0]
	}
	return ""
}

// clientAddr is the client's address as the trusted-proxy rule resolves
// it: the peer's IP, or, when the peer is in trusted_proxies, the
// right-most X-Forwarded-For entry that is not itself a trusted proxy (all
// trusted: the left-most), as nginx's real_ip_recursive. It returns a
// substring of the request's own strings (no allocation).
func clientAddr(r *http.Request, trusted []netip.Prefix) string {
	peer := hostOf(r.RemoteAddr)
	if a, err := netip.ParseAddr(peer); err != nil || !isTrusted(a.Unmap(), trusted) {
		return peer
	}
	xff := r.Header["X-Forwarded-For"]
	client := peer
	for i := len(xff) - 1; i >= 0; i-- {
		v := xff[i]
		for v != "" {
			entry := v
			if j := strings.LastIndexByte(v, ','); j >= 0 {
				entry, v = v[j+1:], v[:j]
			} else {
				v = ""
			}
			if entry = strings.TrimSpace(entry); entry == "" {
				continue
			}
			client = strings.TrimSpace(hostOf(entry)) // "0 :" is host "0 "
			a, err := netip.ParseAddr(client)
			if err != nil || !isTrusted(a.Unmap(), trusted) {
				return client // an untrusted hop, or not an address: what the proxy says
			}
		}
	}
	return client
}

// hostOf is the host of "host:port" or "[v6]:port" (s itself when it has
// no port), without brackets.
func hostOf(s string) string {
	if strings.HasPrefix(s, "[") {
		if i := strings.IndexByte(s, ']'); i > 0 {
			return s[1:i]
		}
		return s
	}
	if i := strings.LastIndexByte(s, ':'); i >= 0 && strings.IndexByte(s, ':') == i {
		return s[:i] // one colon: host:port (more: a bare IPv6 address)
	}
	return s
}

// isTrusted reports whether a is in one of the trusted prefixes.
func isTrusted(a netip.Addr, trusted []netip.Prefix) bool {
	for _, p := range trusted {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// accessSink writes access lines off the request path: a request appends
// its line to a bounded buffer under a mutex; the writer goroutine writes
// whatever has gathered in one write every accessLogFlushInterval, or when
// accessLogFlushBytes are waiting (under load, many lines per syscall). A
// sink that blocks or fails costs requests nothing: lines beyond
// accessLogBuffer, and those of a failed write, are dropped and counted in
// infergate_access_log_dropped_lines_total.
type accessSink struct {
	mu      sync.Mutex
	pending []byte
	lines   int

	out    io.Writer
	file   *os.File // nil for stderr / stdout
	wake   chan struct{}
	stop   chan struct{}
	done   chan struct{}
	closed sync.Once

	droppedFull, droppedWrite prometheus.Counter
	lastWarn                  atomic.Int64 // unix ns of the last write-error warning
}

// newAccessSink opens path ("" or "stderr", "stdout", or a file appended
// to) and starts its writer.
func newAccessSink(path string, reg prometheus.Registerer) (*accessSink, error) {
	switch path {
	case "", "stderr":
		return startAccessSink(os.Stderr, nil, reg)
	case "stdout":
		return startAccessSink(os.Stdout, nil, reg)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
	if err != nil {
		return nil, fmt.Errorf("access_log.path: %w", err)
	}
	return startAccessSink(f, f, reg)
}

// startAccessSink starts a sink writing to out (file, when not nil, is
// closed at close).
func startAccessSink(out io.Writer, file *os.File, reg prometheus.Registerer) (*accessSink, error) {
	s := &accessSink{out: out, file: file, wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	dropped := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "access_log_dropped_lines_total",
		Help: "Access log lines not written, by reason (buffer_full: the sink fell 1 MiB behind; write_error: the write failed)."},
		[]string{"reason"})
	if err := reg.Register(dropped); err != nil {
		if s.file != nil {
			_ = s.file.Close()
		}
		return nil, fmt.Errorf("register access log metrics: %w", err)
	}
	s.droppedFull, s.droppedWrite = dropped.WithLabelValues("buffer_full"), dropped.WithLabelValues("write_error")
	go s.run()
	return s, nil
}

// write queues one line (copied), or drops it when the buffer is full.
func (s *accessSink) write(line []byte) {
	s.mu.Lock()
	if len(s.pending)+len(line) > accessLogBuffer {
		s.mu.Unlock()
		s.droppedFull.Inc()
		return
	}
	s.pending = append(s.pending, line...)
	s.lines++
	full := len(s.pending) >= accessLogFlushBytes
	s.mu.Unlock()
	if full {
		select {
		case s.wake <- struct{}{}:
		default: // the writer is awake already
		}
	}
}

// run is the writer: it writes what has gathered at each tick or wake-up,
// and the rest at stop.
func (s *accessSink) run() {
	defer close(s.done)
	tick := time.NewTicker(accessLogFlushInterval)
	defer tick.Stop()
	var spare []byte
	for {
		select {
		case <-tick.C:
			spare = s.flush(spare)
		case <-s.wake:
			spare = s.flush(spare)
		case <-s.stop:
			s.flush(spare)
			return
		}
	}
}

// flush writes the pending lines, swapping buffers with spare so requests
// append to the other one meanwhile; it returns the buffer to reuse.
func (s *accessSink) flush(spare []byte) []byte {
	s.mu.Lock()
	buf, n := s.pending, s.lines
	s.pending, s.lines = spare[:0], 0
	s.mu.Unlock()
	if len(buf) == 0 {
		return buf
	}
	if _, err := s.out.Write(buf); err != nil {
		s.droppedWrite.Add(float64(n))
		if now := time.Now().UnixNano(); now-s.lastWarn.Load() > int64(time.Minute) {
			s.lastWarn.Store(now)
			slog.Warn("gateway: access log write failed; lines dropped", "lines", n, "err", err)
		}
	}
	return buf
}

// close writes the last lines (waiting at most accessLogCloseWait for a
// sink that blocks) and closes the file. Safe on nil and more than once.
func (s *accessSink) close() {
	if s == nil {
		return
	}
	s.closed.Do(func() {
		close(s.stop)
		select {
		case <-s.done:
		case <-time.After(accessLogCloseWait):
			slog.Warn("gateway: access log writer blocked at close; its last lines are lost", "wait", accessLogCloseWait)
			return // the file stays open under the blocked write
		}
		if s.file != nil {
			_ = s.file.Close()
		}
	})
}
