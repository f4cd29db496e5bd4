package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/infergate/infergate/jsonscan"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/upstream"
)

// isEventStream reports whether the media type of h's Content-Type is
// text/event-stream (case-insensitive, parameters ignored).
func isEventStream(h http.Header) bool {
	return strings.EqualFold(mediaType(h), "text/event-stream")
}

// isJSON reports whether the media type of h's Content-Type is
// application/json: a whole OpenAI answer, which an engine may send to a
// streaming request (relayed as it is).
func isJSON(h http.Header) bool {
	return strings.EqualFold(mediaType(h), "application/json")
}

// mediaType is h's Content-Type without parameters or spaces.
func mediaType(h http.Header) string {
	v := h.Get("Content-Type")
	if i := strings.IndexByte(v, ';'); i >= 0 {
		v = v[:i]
	}
	return strings.TrimSpace(v)
}

// relayError relays an engine's non-2xx answer: its status and body when the
// body is JSON (engines speak OpenAI errors), else a 502 wrapping it.
func (g *Gateway) relayError(w http.ResponseWriter, r *http.Request, resp *http.Response, rm *routeMetrics) {
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody+1))
	if err != nil && r.Context().Err() != nil {
		g.canceled(w, r, rm)
		return
	}
	if err == nil && len(body) <= maxErrorBody && engineJSON(body) {
		writeJSON(w, resp.StatusCode, body)
		g.count(w, rm, resp.StatusCode)
		return
	}
	snippet := strings.ToValidUTF8(string(body[:min(len(body), 256)]), "")
	g.fail(w, rm, openai.NewError(http.StatusBadGateway,
		fmt.Sprintf("The model server answered %d: %s", resp.StatusCode, strings.TrimSpace(snippet)), "", openai.CodeUpstream))
}

// engineJSON reports whether an engine's body is JSON the gateway relays as
// such: valid, and nested no deeper than openai.MaxDepth (what the gateway
// accepts from clients; encoding/json's own bound is 10000 levels).
func engineJSON(b []byte) bool { return json.Valid(b) && !openai.TooDeep(b) }

// relayBody relays a non-streaming answer. The body is held in x.capture
// until it ends and then written with its status line at once, so an answer
// that breaks before its end has sent the client nothing: it is returned as
// a failure to retry elsewhere, and a request ended by Abort meanwhile is
// answered 503. Usage is read from the held body (unless it nests deeper
// than openai.MaxDepth). A body over maxUsageScan (4 MiB), or one that finds
// the gateway-wide hold budget (max_held_response_bytes, hold.go) spent, is
// relayed from there on as it arrives (the status line and the held part
// first); when it breaks after that, relayBody returns codeAbort (the caller
// aborts the client's connection, so the client sees a truncated answer,
// never a silently short one). A request canceled (client gone) returns
// codeClientClosed: no verdict on the engine. Each read may wait
// stream_idle_timeout for the engine (time spent writing to the client not
// counted); a stall is a timeout failure, retried while nothing was sent.
func (g *Gateway) relayBody(w http.ResponseWriter, r *http.Request, resp *http.Response, x *exchange,
	rm *routeMetrics, start time.Time) (*failure, int) {
	x.capture = x.capture[:0]
	var held int64 // bytes of x.capture reserved in g.hold
	defer g.hold.release(&held)
	sent := false // the status line and the held body have been written
	length := ""  // the held body's Content-Length when it was rewritten (P/D)
	idle := idleDeadline{idle: g.cfg.StreamIdleTimeout, by: time.Now().Add(g.cfg.ResponseHeaderTimeout)}
	idle.dl, _ = resp.Body.(upstream.ReadDeadliner)
	send := func(b []byte) bool {
		if !sent {
			copyResponseHeader(w.Header(), resp.Header, true)
			if length != "" {
				w.Header()["Content-Length"] = []string{length}
			}
			w.WriteHeader(resp.StatusCode)
			sent = true
		}
		g.extendWriteDeadline(w, x, time.Now())
		_, err := w.Write(b)
		return err == nil
	}
	for {
		if idle.dl != nil {
			idle.extend(time.Now()) // after any write to the client
		}
		n, rerr := resp.Body.Read(x.copyBuf)
		if n > 0 {
			fits := !sent && len(x.capture)+n <= maxUsageScan
			if fits && g.holdMore(x, n, &held) {
				x.capture = append(x.capture, x.copyBuf[:n]...)
			} else {
				if fits {
					g.hold.overflows.Inc() // the gateway holds all it may
				}
				ok := sent || send(x.capture) // the held part first
				g.hold.release(&held)
				if !ok || !send(x.copyBuf[:n]) {
					g.count(w, rm, codeClientClosed)
					return nil, codeClientClosed
				}
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			switch {
			case !sent && r.Context().Err() != nil:
				g.canceled(w, r, rm) // 499, or 503 when ended by Abort
				return nil, codeClientClosed
			case !sent && upstream.IsTimeout(rerr):
				msg := fmt.Sprintf("The model server's answer stalled: no byte within %s (stream_idle_timeout).", g.cfg.StreamIdleTimeout)
				if idle.overdue(time.Now()) {
					msg = fmt.Sprintf("The model server's answer did not end within %s of its headers (response_header_timeout).", g.cfg.ResponseHeaderTimeout)
				}
				return &failure{reason: reasonTimeout, rm: rm, err: openai.NewError(http.StatusGatewayTimeout, msg, "", codeUpstreamTimeout)}, 0
			case !sent:
				return &failure{reason: reasonReset, rm: rm, err: openai.NewError(http.StatusBadGateway,
					"The model server's answer broke off before its end: "+rerr.Error(), "", openai.CodeUpstream)}, 0
			case shuttingDown(r):
				g.count(w, rm, http.StatusServiceUnavailable)
				return nil, codeAbort
			case r.Context().Err() != nil:
				g.count(w, rm, codeClientClosed)
				return nil, codeClientClosed
			}
			g.count(w, rm, http.StatusBadGateway)
			return nil, codeAbort
		}
	}
	var u struct {
		Usage *openai.Usage `json:"usage"`
	}
	if !sent {
		if resp.StatusCode/100 == 2 && x.pdCached() {
			n := len(x.capture)
			if x.capture = x.pdRewrite(x.capture, nil); len(x.capture) != n {
				length = strconv.Itoa(len(x.capture)) // D's counted the body before the rewrite
			}
		}
		if !send(x.capture) {
			g.count(w, rm, codeClientClosed)
			return nil, codeClientClosed
		}
		switch k := x.pass.kind; {
		case k.responsesAPI():
			var id string
			id, u.Usage = responseBody(x.capture)
			if k == kindResponses && resp.StatusCode/100 == 2 && x.pass.resp.Stored() {
				x.pass.respID = id // learnt by attempt
			}
		case !k.generates(): // the tokenizer's answers carry no usage
		default:
			u.Usage = jsonscan.Usage(x.capture)
		}
	}
	g.finish(rm, x, resp.StatusCode, u.Usage, start)
	return nil, resp.StatusCode
}

// Shared header values: never modified.
var (
	noCache          = []string{"no-cache"}
	accelBufferingNo = []string{"no"}
)

var (
	usageKey = []byte(`"usage"`)
	sseData  = []byte("data: ")
	sseEvent = []byte("event: ")
	sseEnd   = []byte("\n\n")
	sseDone  = []byte("data: [DONE]\n\n")
)

// maxHeldBeforeOutput bounds the events relayStream holds while it waits
// for the first output event (bytes as they will be written): a role chunk
// is a few hundred bytes; past the bound a stream of valid chunks is
// started anyway, and one without any is a bad response.
const maxHeldBeforeOutput = 64 << 10

// Bounds of what the gateway buffers per request (bytes).
const (
	// maxUsageScan bounds the non-streaming response prefix kept to read
	// "usage" from; a larger response is relayed whole but not accounted.
	maxUsageScan = 4 << 20
	// maxErrorBody bounds an engine's error body read for relaying.
	maxErrorBody = 1 << 20
	// maxPooledBuffer is the largest buffer returned to the exchange pool.
	maxPooledBuffer = 1 << 20
)

// Gateway-specific error codes besides openai's.
const (
	codeUpstreamTimeout = "upstream_timeout"
)

// relayStream relays an SSE answer event by event with a flush after each,
// measuring time to first token and inter-token gaps and reading usage.
// With strip, the usage-only chunk the gateway asked for on the client's
// behalf is dropped. An upstream failure mid-stream ends the stream with an
// error event, never a silent truncation.
//
// The status line waits for the first event that carries output (events
// before it, a role chunk, are held and sent with it): a stream that fails
// before it — breaks, stalls past first_event_timeout, sends an error event,
// or ends with no completion chunk at all (garbage, or [DONE] alone) — is
// returned as a failure to retry, nothing having reached the client. A
// stream that ends cleanly without output (an empty generation) is relayed
// whole. Once started, a stream with no output event for
// stream_idle_timeout ends with an upstream_timeout error event.
//
// It returns the status accounted (502 for a stream that failed or carried
// an engine's error event, 504 for one that stalled), or codeClientClosed
// for a request canceled (client gone, or ended by Abort: then the stream
// ends with a shutting_down error event and [DONE]).
func (g *Gateway) relayStream(w http.ResponseWriter, r *http.Request, resp *http.Response, x *exchange,
	rm *routeMetrics, reqID string, start time.Time, strip bool, firstBy time.Time) (*failure, int) {
	x.fr = flushOnRead{r: resp.Body} // in the pooled exchange: no allocation per stream
	fr := &x.fr
	if dl, ok := resp.Body.(upstream.ReadDeadliner); ok {
		// roundTripBy left the first-event deadline on the body.
		fr.idle = idleDeadline{dl: dl, idle: g.cfg.StreamIdleTimeout, armed: firstBy}
	}
	if x.er == nil {
		x.er = openai.NewEventReader(fr, 0)
	} else {
		x.er.Reset(fr) // pooled: no 16 KiB buffer per stream
	}
	er := x.er
	er.SetLimit(x.eventLimit(g))

	var (
		usage     *openai.Usage // the latest reported (cumulative) usage
		last      time.Time     // when the previous output event was relayed
		streamErr bool          // the engine sent an error event
		started   bool          // the status line is out
		chunks    bool          // an event was a completion chunk (with choices)
		rc        *http.ResponseController
	)
	x.out = x.out[:0]
	begin := func() {
		h := w.Header()
		copyResponseHeader(h, resp.Header, false)
		if _, ok := h["Cache-Control"]; !ok {
			h["Cache-Control"] = noCache
		}
		h["X-Accel-Buffering"] = accelBufferingNo
		w.WriteHeader(resp.StatusCode)
		rc = http.NewResponseController(w)
		fr.rc = rc
		started = true
	}
	for {
		data, err := er.Next()
		complete := err == io.EOF && x.streamComplete(er)
		if err != nil && !started {
			done := complete
			switch {
			case r.Context().Err() != nil:
				g.canceled(w, r, rm)
				return nil, codeClientClosed
			case done && chunks: // complete without output: relayed whole
				begin()
			default:
				return g.streamFailure(rm, err, done, firstBy), 0
			}
		}
		if err != nil {
			return nil, g.endStream(w, r, x, rm, rc, err, complete, streamErr, usage, last, reqID, start)
		}

		now := fr.at // when this event's bytes arrived
		output := false
		if c, ok := x.viewEvent(data); ok {
			if c.IsError && !started {
				// An engine error before any output (vLLM's stream
				// generator raising): nothing reached the client.
				return &failure{reason: reasonErrorEvent, rm: rm, err: openai.NewError(http.StatusBadGateway,
					"The model server reported an error before its first token: "+x.errorMessage(data), "", openai.CodeUpstream)}, 0
			}
			chunks = chunks || c.Choices > 0
			if c.Usage != nil {
				usage = c.Usage   // freshly allocated: safe to keep
				if x.pdCached() { // P's hits, not the prompt D received (pd.go)
					data = x.pdRewrite(data, usage)
				}
			}
			streamErr = streamErr || c.IsError
			if strip && c.Choices == 0 && c.Usage != nil && !c.IsError {
				continue
			}
			if strip && c.Choices > 0 && bytes.Contains(data, usageKey) {
				// Some engines (Ollama) add a usage member to every chunk
				// once include_usage is on; the client did not ask for it.
				if from, to, ok := jsonscan.MemberSpan(data, "usage"); ok {
					x.stripped = jsonscan.WithoutMember(x.stripped[:0], data, from, to)
					data = x.stripped
				}
			}
			if output = c.Output; output {
				if last.IsZero() {
					x.share.FirstToken(clock(now)) // the learnt prefill rate (load.Ledger)
					rm.ttft.Observe(now.Sub(start).Seconds())
					x.obs.firstOutput(now.Sub(start))
				} else {
					rm.itl.Observe(now.Sub(last).Seconds())
				}
				last = now
			}
		}
		if !started {
			x.out = appendEvent(x.out, er.Event(), data) // held until the first output
			switch {
			case output:
			case len(x.out) <= maxHeldBeforeOutput:
				continue
			case !chunks:
				return &failure{reason: reasonBadResponse, rm: rm, err: openai.NewError(http.StatusBadGateway,
					fmt.Sprintf("The model server's stream sent %d bytes of events without a completion chunk.", len(x.out)),
					"", openai.CodeUpstream)}, 0
			}
			begin()
		} else {
			x.out = appendEvent(x.out[:0], er.Event(), data)
		}
		g.extendWriteDeadline(w, x, now)
		if _, err := w.Write(x.out); err != nil {
			g.count(w, rm, codeClientClosed)
			return nil, codeClientClosed
		}
		x.out = x.out[:0]
		fr.pending = true  // flushed before the next read that may wait
		fr.extend = output // and the engine given stream_idle_timeout for the next output
	}
}

// endStream ends a started (or complete) stream that stopped with err
// (io.EOF: the engine's body ended; complete: at its end marker): the held
// events and [DONE] when complete, else an error event saying why; then the
// request's accounting. It returns the status accounted, as relayStream.
func (g *Gateway) endStream(w http.ResponseWriter, r *http.Request, x *exchange, rm *routeMetrics, rc *http.ResponseController,
	err error, complete, streamErr bool, usage *openai.Usage, last time.Time, reqID string, start time.Time) int {
	// What is written next (the tail, an error event) is written
	// now: the client's write deadline, set at the last write, may
	// have passed while the engine was silent (write_timeout and
	// stream_idle_timeout are both a minute by default), which cut
	// a stalled stream silently, without its error event.
	g.extendWriteDeadline(w, x, time.Now())
	// Ended by Abort (the client still there): unless the stream was
	// complete, the client is told, as for an engine failure
	// mid-stream.
	shutdown := x.fr.err == nil && r.Context().Err() != nil && shuttingDown(r)
	switch {
	case shutdown && !complete:
		x.out = x.out[:0]
		writeStreamError(w, rc, x, shutdownError())
		x.obs.failed(codeShuttingDown)
		g.finish(rm, x, http.StatusServiceUnavailable, usage, start)
		return codeClientClosed // no verdict on the engine
	case !shutdown && (r.Context().Err() != nil || x.fr.err != nil):
		g.count(w, rm, codeClientClosed)
		return codeClientClosed
	}
	code := http.StatusOK
	if complete {
		// The held events of a stream that ended without output
		// leave with [DONE] (a Responses stream ends at its
		// terminal event).
		if _, werr := w.Write(append(x.out, x.streamTail(x.er)...)); werr != nil {
			g.count(w, rm, codeClientClosed)
			return codeClientClosed
		}
		// Not flushed here: the handler returns at once and net/http
		// writes [DONE] with the final chunk in one syscall.
		if streamErr {
			code = http.StatusBadGateway
		}
	} else {
		msg := "The model server's stream ended without [DONE]."
		if x.pass.kind.responsesAPI() {
			msg = "The model server's stream ended before its response.completed event."
		}
		code = http.StatusBadGateway
		errCode := openai.CodeUpstream
		switch {
		case upstream.IsTimeout(err):
			wait, key := g.cfg.StreamIdleTimeout, "stream_idle_timeout"
			if last.IsZero() {
				wait, key = g.cfg.FirstEventTimeout, "first_event_timeout"
			}
			msg = fmt.Sprintf("The model server's stream stalled: no output within %s (%s).", wait, key)
			code, errCode = http.StatusGatewayTimeout, codeUpstreamTimeout
		case err != io.EOF:
			msg = "The model server's stream failed: " + err.Error()
		}
		slog.Warn("gateway: upstream stream failed", "endpoint", rm.labels[1],
			"request_id", reqID, "err", err)
		writeStreamError(w, rc, x, openai.NewError(code, msg, "", errCode))
		x.obs.failed(errCode)
	}
	g.finish(rm, x, code, usage, start)
	return code
}

// streamFailure is the failure of a stream that ended (err; done: at
// [DONE]) before its first output event, with its first event due by
// firstBy.
func (g *Gateway) streamFailure(rm *routeMetrics, err error, done bool, firstBy time.Time) *failure {
	f := &failure{reason: reasonReset, rm: rm}
	msg := "The model server's stream ended before its first token."
	status, code := http.StatusBadGateway, openai.CodeUpstream
	switch {
	case done:
		f.reason = reasonBadResponse
		msg = "The model server's stream ended ([DONE]) without a completion chunk."
	case upstream.IsTimeout(err):
		f.reason, status, code = reasonTimeout, http.StatusGatewayTimeout, codeUpstreamTimeout
		msg = fmt.Sprintf("The model server sent no output within %s (first_event_timeout).", g.cfg.FirstEventTimeout)
		if firstBy.IsZero() {
			msg = "The model server's stream timed out before its first token."
		}
	case errors.Is(err, openai.ErrEventTooLarge):
		f.reason = reasonBadResponse
		msg = "The model server's stream failed before its first token: " + err.Error()
	case err != io.EOF:
		msg = "The model server's stream failed before its first token: " + err.Error()
	}
	f.err = openai.NewError(status, msg, "", code)
	return f
}

// engineErrorMessage returns the message of an engine's error event
// ({"error": {"message": …}} as vLLM and SGLang send it, or {"error": "…"}
// as TGI does), at most 256 bytes of valid UTF-8.
func engineErrorMessage(data []byte) string {
	var ev struct {
		Error json.RawMessage `json:"error"`
	}
	_ = json.Unmarshal(data, &ev)
	msg := string(ev.Error)
	var obj struct {
		Message string `json:"message"`
	}
	var s string
	switch {
	case json.Unmarshal(ev.Error, &obj) == nil && obj.Message != "":
		msg = obj.Message
	case json.Unmarshal(ev.Error, &s) == nil:
		msg = s
	}
	if len(msg) > 256 {
		msg = msg[:256]
	}
	return strings.TrimSpace(strings.ToValidUTF8(msg, ""))
}

// idleDeadline keeps an upstream body's read deadline between idle and 9/8
// idle ahead of each read it is extended for, moving it at most once per
// idle/8 while reads come: one clock read and two comparisons per
// extension, a deadline set (a runtime timer moved) every few seconds of a
// stream. A deadline further ahead (a stream's first-event deadline, at its
// first output) is brought in.
type idleDeadline struct {
	dl    upstream.ReadDeadliner // nil: the body has no deadline (nothing to do)
	idle  time.Duration
	armed time.Time // the deadline in force (zero: none)
	// by is the latest deadline extend sets (zero: none): a non-streaming
	// answer's whole body is due within response_header_timeout of its
	// headers, however steadily an engine trickles it.
	by time.Time
}

func (d *idleDeadline) extend(now time.Time) {
	if d.dl == nil {
		return
	}
	if left := d.armed.Sub(now); !d.armed.IsZero() && left >= d.idle && left <= d.idle+d.idle/8 {
		return
	}
	t := now.Add(d.idle + d.idle/8)
	if !d.by.IsZero() && t.After(d.by) {
		if d.armed.Equal(d.by) {
			return
		}
		t = d.by
	}
	d.armed = t
	_ = d.dl.SetReadDeadline(t)
}

// overdue reports whether a read timed out at the body's end bound by
// rather than for idleness.
func (d *idleDeadline) overdue(now time.Time) bool {
	return !d.by.IsZero() && d.armed.Equal(d.by) && !now.Before(d.by)
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

// flushOnRead wraps an engine's stream so that the relay flushes the client's
// response only when it is about to read from the engine: events that
// arrived together leave in one write (one syscall, not one per event), and
// no event is ever held while the gateway waits for the engine. err is the
// flush's error (the client went away).
//
// at is when the latest read from the engine returned bytes: the arrival
// time of the events they held (one clock read per read, not per event;
// events that arrive together are a few hundred nanoseconds apart).
//
// extend asks the next read to move the body's read deadline to
// stream_idle_timeout from then (an output event was relayed): after the
// flush, so that time spent writing to a slow client is not the engine's.
type flushOnRead struct {
	r       io.Reader
	rc      *http.ResponseController
	pending bool
	extend  bool
	idle    idleDeadline
	err     error
	at      time.Time
}

func (f *flushOnRead) Read(p []byte) (int, error) {
	if f.pending {
		f.pending = false
		if err := f.rc.Flush(); err != nil {
			f.err = err
			return 0, err
		}
	}
	if f.extend {
		f.extend = false
		f.idle.extend(time.Now())
	}
	n, err := f.r.Read(p)
	if n > 0 {
		f.at = time.Now()
	}
	return n, err
}

// appendEvent appends data as one SSE event: its "event:" field when it
// has one (a Responses stream's event type), "data: " before every line (a
// multi-line payload stays one event) and a blank line after.
func appendEvent(dst, event, data []byte) []byte {
	if len(event) > 0 {
		dst = append(append(append(dst, sseEvent...), event...), '\n')
	}
	dst = append(dst, sseData...)
	for {
		i := bytes.IndexByte(data, '\n')
		if i < 0 {
			break
		}
		dst = append(append(dst, data[:i+1]...), sseData...)
		data = data[i+1:]
	}
	return append(append(dst, data...), sseEnd...)
}

// writeStreamError ends a stream with an OpenAI error event for e and
// [DONE], as vLLM does when generation fails mid-stream; a Responses
// stream with an "error" event (responsesErrorEvent).
func writeStreamError(w io.Writer, rc *http.ResponseController, x *exchange, e *openai.Error) {
	if x.pass.kind.responsesAPI() {
		_, _ = w.Write(responsesErrorEvent(e, x.pass.seq))
		_ = rc.Flush()
		return
	}
	b, _ := json.Marshal(openai.ErrorResponse{Error: e})
	ev := make([]byte, 0, len(b)+len(sseData)+len(sseEnd)+len(sseDone))
	ev = append(append(append(append(ev, sseData...), b...), sseEnd...), sseDone...)
	_, _ = w.Write(ev)
	_ = rc.Flush()
}

// withIncludeUsage appends to dst the JSON object body with
// stream_options.include_usage set to true, every other key (top-level and
// inside stream_options) kept as sent. body must be one valid JSON object
// (openai.Decode checked it). Without a stream_options key the body is kept
// byte for byte and the key is spliced in before the closing brace;
// otherwise stream_options is edited through a map of raw values.
func withIncludeUsage(dst, body []byte) ([]byte, error) {
	if !bytes.Contains(body, []byte(`"stream_options"`)) {
		end := bytes.LastIndexByte(body, '}')
		if end < 0 {
			return nil, errors.New("inject include_usage: body is not a JSON object")
		}
		inner := bytes.TrimSpace(body[:end])
		dst = append(dst, body[:end]...)
		if len(inner) > 0 && inner[len(inner)-1] != '{' {
			dst = append(dst, ',')
		}
		dst = append(dst, `"stream_options":{"include_usage":true}`...)
		return append(dst, body[end:]...), nil
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil {
		return nil, fmt.Errorf("inject include_usage: %w", err)
	}
	so := map[string]json.RawMessage{}
	if raw, ok := top["stream_options"]; ok && !bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		if err := json.Unmarshal(raw, &so); err != nil {
			return nil, fmt.Errorf("inject include_usage: stream_options: %w", err)
		}
	}
	so["include_usage"] = json.RawMessage("true")
	b, err := marshalRaw(so)
	if err != nil {
		return nil, fmt.Errorf("inject include_usage: %w", err)
	}
	top["stream_options"] = b
	out, err := marshalRaw(top)
	if err != nil {
		return nil, fmt.Errorf("inject include_usage: %w", err)
	}
	return append(dst, out...), nil
}

// marshalRaw encodes m without HTML escaping (so raw values keep their
// bytes) and without the encoder's trailing newline.
func marshalRaw(m map[string]json.RawMessage) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(m); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}
