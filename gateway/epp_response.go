package gateway

import (
	"bytes"
	"net/http"
	"time"

	"github.com/infergate/infergate/jsonscan"
	"github.com/infergate/infergate/openai"
)

// eppResponse is the state of a picked request's answer as the proxy
// passes it through the picker (Picked.ResponseHeaders, ResponseBody): a
// stream's events are read as relayStream reads them, a whole answer's
// prefix is held (within the gateway's hold budget, up to maxUsageScan) for
// its usage as relayBody holds it.
type eppResponse struct {
	status  int
	headers bool // ResponseHeaders ran
	sse     bool // the answer is the event stream the request asked for
	// pass: the answer is passed on unread from now on (an SSE event over
	// the event limit, an answer over maxUsageScan or the hold budget).
	pass bool
	held int64 // bytes of x.capture reserved in g.hold

	// An SSE answer: pending holds the bytes of the events not yet
	// complete (from evStart; scanned up to pos), out what ResponseBody
	// returns, br the event being read.
	pending      []byte
	evStart, pos int
	out          []byte
	br           bytes.Reader
	usage        *openai.Usage
	last         time.Time
	streamErr    bool
	chunks       bool
	sawDone      bool // the [DONE] event
	// skipLF: the last line scanned ended at a CR that was the last byte
	// received; a LF that comes next is part of that line end (CRLF).
	skipLF bool
	// midStream: an event was read; the next is read as the rest of the
	// stream (openai.EventReader.Continue), not its start.
	midStream bool
}

// reset empties r for another request, keeping its buffers within bounds.
func (r *eppResponse) reset() {
	pending, out := r.pending[:0], r.out[:0]
	if cap(pending) > maxPooledBuffer {
		pending = nil
	}
	if cap(out) > maxPooledBuffer {
		out = nil
	}
	*r = eppResponse{pending: pending, out: out}
}

// ResponseHeaders observes the answer's status and headers (the proxy's
// response-headers phase). An engine's 5xx counts against it in outlier
// detection, as in attempt.
func (pk *Picked) ResponseHeaders(status int, h http.Header) {
	r := &pk.resp
	if pk.p == nil || pk.finished || r.headers {
		return
	}
	r.headers, r.status = true, status
	pk.x.capture = pk.x.capture[:0] // the pooled exchange's, from its previous request
	r.sse = pk.x.stream && isEventStream(h) && status/100 == 2
	if status >= 500 {
		pk.g.outlierFailure(pk.ep, reason5xx, time.Now())
	}
}

// ResponseBody observes one chunk of the answer's body (eos: the last)
// and returns the bytes to pass on in its place: the chunk itself, or for
// a stream the complete events it finished (an event split across chunks
// leaves with the chunk that completes it), less the usage-only chunk the
// gateway asked for on the client's behalf. The slice returned is valid
// until the next call. At eos the request is accounted as the gateway
// accounts it (finish: usage, end-to-end latency, prediction errors; TTFT
// and ITL as the events arrive).
func (pk *Picked) ResponseBody(chunk []byte, eos bool) []byte {
	if pk.p == nil || pk.finished {
		return chunk
	}
	r := &pk.resp
	if !r.headers {
		pk.ResponseHeaders(http.StatusOK, nil)
	}
	if !r.sse {
		pk.holdBody(chunk)
		if eos {
			pk.finishBody()
		}
		return chunk
	}
	out := pk.streamBody(chunk)
	if eos {
		out = append(out, r.pending[r.evStart:]...) // an unfinished event: passed on as it is
		r.pending, r.evStart, r.pos = r.pending[:0], 0, 0
		r.out = out
		pk.finishStream()
	}
	return out
}

// holdBody keeps chunk in x.capture for the usage, while the answer is a
// 2xx within maxUsageScan and the hold budget grants it.
func (pk *Picked) holdBody(chunk []byte) {
	r, x := &pk.resp, pk.x
	if r.pass || r.status/100 != 2 || !pk.x.pass.kind.generates() {
		return
	}
	if len(x.capture)+len(chunk) > maxUsageScan || !pk.g.holdMore(x, len(chunk), &r.held) {
		if len(x.capture)+len(chunk) <= maxUsageScan {
			pk.g.hold.overflows.Inc()
		}
		r.pass = true
		x.capture = x.capture[:0]
		pk.g.hold.release(&r.held)
		return
	}
	x.capture = append(x.capture, chunk...)
}

// finishBody accounts a whole answer: its usage read from the held body
// as relayBody reads it.
func (pk *Picked) finishBody() {
	r, x := &pk.resp, pk.x
	var usage *openai.Usage
	if !r.pass && r.status/100 == 2 {
		switch k := x.pass.kind; {
		case k.responsesAPI():
			_, usage = responseBody(x.capture)
		case !k.generates():
		default:
			usage = jsonscan.Usage(x.capture)
		}
	}
	pk.g.hold.release(&r.held)
	if r.status < 500 {
		pk.ep.outlierSuccess()
	}
	pk.finished = true
	pk.g.finish(pk.rm, x, r.status, usage, pk.start)
}

// streamBody appends chunk to the pending events and returns the complete
// ones, read (usage, errors, output timing) and filtered. An event ends at
// its first empty line, lines ending at LF, CRLF or a lone CR as for the
// client's parser (openai.LineEnd), so that each event passed on is the one
// event the gateway read.
func (pk *Picked) streamBody(chunk []byte) []byte {
	r, x, g := &pk.resp, pk.x, pk.g
	out := r.out[:0]
	if r.pass {
		r.out = out
		return chunk
	}
	r.pending = append(r.pending, chunk...)
	now := time.Now()
	for {
		rest := r.pending[r.pos:]
		if r.skipLF && len(rest) > 0 {
			r.skipLF = false
			if rest[0] == '\n' { // the CRLF of the line before
				r.pos++
				continue
			}
		}
		end, next, cr := openai.LineEnd(rest)
		if end < 0 {
			break
		}
		r.pos += next
		r.skipLF = cr
		if end > 0 {
			continue
		}
		block := r.pending[r.evStart:r.pos]
		r.evStart = r.pos
		out = pk.streamEvent(out, block, now)
	}
	// What is left is the start of an event: kept, moved to the front.
	rest := copy(r.pending, r.pending[r.evStart:])
	r.pending, r.pos, r.evStart = r.pending[:rest], r.pos-r.evStart, 0
	if len(r.pending) > x.eventLimit(g)+sseSlack {
		// One event over the limit: the stream is passed on unread from
		// here (relayStream refuses it; here the proxy has the stream).
		out = append(out, r.pending...)
		r.pending, r.pos = r.pending[:0], 0
		r.pass = true
	}
	r.out = out
	return out
}

// sseSlack is what an event's lines may add to its data (field names,
// line ends) over the event limit before it is over it.
const sseSlack = 4 << 10

// streamEvent reads one complete SSE event (block, blank line included)
// as relayStream does and appends what is passed on of it to out.
func (pk *Picked) streamEvent(out, block []byte, now time.Time) []byte {
	r, x := &pk.resp, pk.x
	r.br.Reset(block)
	switch {
	case x.er == nil:
		x.er = openai.NewEventReader(&r.br, 0)
	case r.midStream:
		x.er.Continue(&r.br)
	default:
		x.er.Reset(&r.br)
	}
	r.midStream = true
	er := x.er
	er.SetLimit(x.eventLimit(pk.g))
	data, err := er.Next()
	if err != nil { // [DONE], a comment, an event without data, one too large
		r.sawDone = r.sawDone || er.Done()
		return append(out, block...)
	}
	c, ok := x.viewEvent(data)
	if !ok {
		return append(out, block...)
	}
	r.chunks = r.chunks || c.Choices > 0
	if c.Usage != nil {
		r.usage = c.Usage // freshly allocated: safe to keep
	}
	r.streamErr = r.streamErr || c.IsError
	if c.Output {
		if r.last.IsZero() {
			x.share.FirstToken(clock(now))
			pk.rm.ttft.Observe(now.Sub(pk.start).Seconds())
		} else {
			pk.rm.itl.Observe(now.Sub(r.last).Seconds())
		}
		r.last = now
	}
	if pk.strip && c.Choices == 0 && c.Usage != nil && !c.IsError {
		return out // the usage the gateway asked for, not the client
	}
	if pk.strip && c.Choices > 0 && bytes.Contains(data, usageKey) {
		if from, to, ok := jsonscan.MemberSpan(data, "usage"); ok {
			x.stripped = jsonscan.WithoutMember(x.stripped[:0], data, from, to)
			return appendEvent(out, er.Event(), x.stripped)
		}
	}
	return append(out, block...)
}

// finishStream accounts a stream whose body ended: 200, or 502 when it
// carried an engine's error event or ended incomplete (no [DONE], no
// terminal Responses event), as endStream counts them.
func (pk *Picked) finishStream() {
	r, x := &pk.resp, pk.x
	complete := false
	switch k := x.pass.kind; {
	case r.pass:
		complete = true // unread: no verdict
	case k.responsesAPI():
		complete = x.pass.respDone
	case k == kindOther:
		complete = true
	default:
		complete = r.sawDone
	}
	code := http.StatusOK
	switch {
	case !complete || r.streamErr:
		code = http.StatusBadGateway
		pk.g.outlierFailure(pk.ep, reasonStream, time.Now())
	default:
		pk.ep.outlierSuccess()
	}
	pk.finished = true
	pk.g.finish(pk.rm, x, code, r.usage, pk.start)
}
