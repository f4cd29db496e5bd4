package gateway

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/infergate/infergate/load"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/upstream"
)

// apiKind is the inference API a request came in on (passthrough.go has
// the kinds besides chat and completions).
type apiKind uint8

const (
	kindChat apiKind = iota
	kindCompletion
	kindResponses    // POST /v1/responses
	kindEmbeddings   // POST /v1/embeddings
	kindTokenize     // POST /tokenize (vLLM)
	kindDetokenize   // POST /detokenize (vLLM)
	kindResponseByID // /v1/responses/{id}[/cancel]: routed by the response id
	kindOther        // POST to another /v1/ path: routed by the body's model
	numKinds
)

// numPathKinds are the kinds with a fixed path (endpoint.urls).
const numPathKinds = int(kindDetokenize) + 1

// exchange is the per-request scratch state, pooled so that the request path
// allocates little beyond what JSON decoding and net/http need.
type exchange struct {
	// hb writes heartbeats to a streaming request held while its pool
	// has no ready endpoint (coldstart.go; zero otherwise).
	hb heartbeat
	// rec records the endpoint picker's refusal of this request
	// (Gateway.Pick), reset with the exchange.
	rec eppRecorder
	// pickReq is the endpoint picker's view of the request as the
	// request path reads it (Gateway.Pick; its URL in pickURL), kept
	// here so that a pick allocates no http.Request; reset with the
	// exchange.
	pickReq http.Request
	pickURL url.URL
	body    []byte // the client's request body
	// bodyHeld is body's bytes reserved in the held-body budget
	// (max_body_bytes_held) from the end of its read to putExchange.
	bodyHeld int64
	upBody   []byte // the body sent upstream when it differs from body
	chat     openai.ChatRequest
	comp     openai.CompletionRequest
	sreq     sched.Request
	hashes   []uint64
	chunk    openai.StreamChunk
	out      []byte // one SSE event being written
	capture  []byte // non-streaming response prefix, for usage
	copyBuf  []byte // relay buffer
	// stripped holds a chunk less the usage member the gateway asked for.
	stripped []byte
	segs     []string // a chat's rendered segments (openai.AppendChatSegments)
	segBuf   []byte   // their bytes (openai.AppendChatSegmentsIn)
	toks     []uint32 // a chat's routing tokens

	// er reads the engine's SSE stream through fr; reset per stream, so its
	// 16 KiB buffer is pooled.
	er *openai.EventReader
	fr flushOnRead

	// upHeader holds the upstream request's headers (upstreamHeader) and
	// reqID the request id as a header value; both live only while the
	// upstream request is written.
	upHeader http.Header
	reqID    [1]string

	// Retries (route.go): an engine's error answer held for relaying, and
	// the endpoints that failed this request.
	errBody  []byte
	excluded []bool
	// wait is the attempt's entry in its endpoint's header waits
	// (upstream/wait.go).
	wait upstream.Wait

	// edge is the key's token reservation and the client write deadline
	// (keylimits.go, relay.go).
	edge exchangeEdge
	// obs is the request's access-log and trace record (nil when not
	// observed), keyUse its API key's usage counters (nil: no key).
	obs    *obsWriter
	keyUse *keyUsage

	// predicted is the prompt tokens the policy predicted the endpoint holds
	// (-1: the policy predicts nothing), from index predictedBy;
	// precisePredicted is the precise index's prediction when it is not the
	// policy's own (-1: none).
	predicted, precisePredicted int
	predictedBy                 int
	// share is what this attempt added to its endpoint's load ledger
	// (in-flight tokens, prefill backlog), released at its end.
	share load.Share

	// Read from the decoded request.
	user         string
	model        string
	salt         string
	stream       bool
	includeUsage bool

	// pass is the state of the other APIs, aliases and response affinity
	// (passthrough.go).
	pass passState
	// pd is a P/D request's hand-off (pd.go).
	pd pdState
}

func (g *Gateway) getExchange() *exchange {
	if x, _ := g.exchanges.Get().(*exchange); x != nil {
		return x
	}
	x := &exchange{copyBuf: make([]byte, 32<<10)}
	x.chat.Reset(0, true)
	x.pd.reset()
	return x
}

// maxPooledMessages is the most chat messages whose buffer (104 bytes a
// message) an exchange keeps between requests.
const maxPooledMessages = 1024

// requestIDValue returns id as a one-element header value held by x.
func (x *exchange) requestIDValue(id string) []string {
	x.reqID[0] = id
	return x.reqID[:]
}

func (g *Gateway) putExchange(x *exchange) {
	if x.bodyHeld != 0 {
		g.held.release(&x.bodyHeld)
	}
	// The messages' buffer kept; the next chat's contents borrowed from
	// its body (x.body, or the picker's PickRequest.Body), which outlives
	// x.chat: read only while the exchange is in use, never kept.
	x.chat.Reset(maxPooledMessages, true)
	x.comp.Reset(maxPooledBuffer / 4) // its token-id prompt's buffer kept for the next request
	x.sreq = sched.Request{}
	x.model, x.salt, x.user = "", "", ""
	x.share = load.Share{}
	x.chunk.Reset()
	if cap(x.stripped) > maxPooledBuffer {
		x.stripped = nil
	}
	clear(x.segs) // do not keep the request's text alive in the pool
	x.segs = x.segs[:0]
	if cap(x.segBuf) > maxPooledBuffer {
		x.segBuf = nil
	}
	if cap(x.toks) > maxPooledBuffer/4 {
		x.toks = nil
	}
	if cap(x.body) > maxPooledBuffer {
		x.body = nil
	}
	if cap(x.upBody) > maxPooledBuffer {
		x.upBody = nil
	}
	if cap(x.capture) > maxPooledBuffer {
		x.capture = nil
	}
	if cap(x.out) > maxPooledBuffer {
		x.out = nil
	}
	if cap(x.errBody) > maxPooledBuffer {
		x.errBody = nil
	}
	x.edge = exchangeEdge{}
	x.rec = eppRecorder{}                            // a refusal's header and body are the Refusal's
	x.pickReq, x.pickURL = http.Request{}, url.URL{} // the picker's context and header
	x.obs, x.keyUse = nil, nil
	clear(x.upHeader) // the client's header values
	x.reqID[0] = ""
	if x.er != nil {
		x.er.Reset(nil) // drop the finished stream
	}
	x.fr = flushOnRead{}
	if x.er != nil && x.er.Buffered() > maxPooledBuffer {
		x.er = nil // grown by a huge event (a Responses stream's final event echoes the request)
	}
	x.pass.reset()
	x.pd.reset()
	g.exchanges.Put(x)
}

// serveInference is the request path of every API passed to an engine
// (chat and text completions, responses, embeddings, tokenize, detokenize,
// responses by id, unknown /v1/ paths): read, decode, validate, resolve the
// model (an alias: its targets in order; a response id: the engine that
// stored it), admit the key (model access, rate limits; key nil when
// authentication is off), then per target hash, pick, proxy, falling back
// to the next target on the failures that allow it (alias.go). st is the
// configuration in force when the request arrived (its pools, aliases and
// keys).
func (g *Gateway) serveInference(w http.ResponseWriter, r *http.Request, kind apiKind, key *principal, st *state) {
	start := time.Now()
	r, unbind := g.bindShutdown(r)
	if unbind != nil {
		defer unbind()
	}
	x := g.getExchange()
	defer g.putExchange(x)
	reqID := g.requestID(r)
	w.Header()["X-Request-Id"] = []string{reqID}
	x.pass.kind, x.pass.key = kind, key
	g.metrics.api[kind].Inc()
	g.trackRequest(w, x, key)

	if e := x.readBody(w, r, g.cfg.MaxBodyBytes, g.cfg.BodyReadTimeout, g.bodies, g.held); e != nil {
		if e.Status == codeClientClosed {
			g.count(w, g.unknown, codeClientClosed) // no answer to write
			return
		}
		g.fail(w, g.unknown, e)
		return
	}
	verr := x.decode(kind)
	x.obs.decodedRequest(x.model, x.stream)
	targets := st.targets[x.model]
	x.pass.adapterOf = st.adapters[x.model]
	if kind == kindResponseByID {
		targets, verr = g.responseTarget(x, r, key, st)
	}
	rm := g.unknown
	if len(targets) > 0 {
		rm = targets[0].none
	}
	if verr != nil {
		g.fail(w, rm, verr)
		return
	}
	priority, perr := requestPriority(r)
	if perr != nil {
		g.fail(w, rm, perr)
		return
	}
	maxModelLen := 0
	for _, p := range targets {
		maxModelLen = max(maxModelLen, p.maxModelLen)
	}
	if e := g.chargeKey(w, x, kind, key, maxModelLen); e != nil {
		g.fail(w, rm, e)
		return
	}
	if len(targets) == 0 {
		x.refundKey(w.Header())
		g.fail(w, rm, openai.NewError(http.StatusNotFound,
			fmt.Sprintf("The model `%s` does not exist.", x.model), "model", openai.CodeModelNotFound))
		return
	}
	if kind == kindResponses {
		if e := g.claimResponseID(x.pass.resp.RequestID, key, st); e != nil {
			x.refundKey(w.Header())
			g.fail(w, rm, e)
			return
		}
		if id := x.pass.resp.RequestID; id != "" && st.keys != nil {
			defer g.affinity.unreserve(id) // reserved by claimResponseID
		}
	}
	if kind == kindResponses && x.pass.resp.PreviousResponseID != "" {
		t, e := g.continuationTarget(x, targets, key, st)
		if e != nil {
			x.refundKey(w.Header())
			g.fail(w, rm, e)
			return
		}
		if t != nil {
			targets = t
		}
	}

	x.sreq = sched.Request{SessionKey: sessionKey(r, x), Priority: priority}
	for j, p := range targets {
		x.pass.fallback, x.pass.fell = j < len(targets)-1, ""
		if e := g.prepareTarget(w, r, x, kind, p); e != nil {
			x.refundKey(w.Header())
			g.fail(w, p.none, e)
			return
		}
		if !g.serveRouted(w, r, x, kind, p, reqID, start) {
			return
		}
		g.fellBack(x, p)
	}
}

// requestID returns the client's X-Request-Id if it is a sane token, else a
// new process-unique id.
func (g *Gateway) requestID(r *http.Request) string {
	if v := r.Header["X-Request-Id"]; len(v) == 1 && saneRequestID(v[0]) {
		return v[0]
	}
	return g.reqIDPrefix + strconv.FormatUint(g.reqIDSeq.Add(1), 36)
}

// readBody reads the request body into x.body, at most limit bytes, within
// timeout (the connection's read deadline is set for the body and cleared
// after, so a stalled body answers 408 and long streaming responses are not
// affected). A client that abandons the request before its body arrived
// (its context ends: an HTTP/2 stream reset; or the connection ends before
// the declared length) gets an error of status codeClientClosed, which is
// accounted, not written. The bytes read are charged to budget as they
// arrive and given back when readBody returns (bodybudget.go); one that
// does not fit gets 503 overloaded with Retry-After.
func (x *exchange) readBody(w http.ResponseWriter, r *http.Request, limit int64, timeout time.Duration, budget, held *byteBudget) *openai.Error {
	if ce := encodedAs(r.Header); ce != "" {
		closeConnection(w, r) // the body is not read
		return openai.NewError(http.StatusUnsupportedMediaType,
			fmt.Sprintf("Content-Encoding %q is not supported; send the JSON body uncompressed.", truncate(ce, 64)), "", openai.CodeInvalidJSON)
	}
	// route set the read deadline (timeout) when the request arrived with
	// a body declared.
	deadline := r.ContentLength != 0
	tooLarge := func() *openai.Error {
		return openai.NewError(http.StatusRequestEntityTooLarge,
			fmt.Sprintf("Request body is larger than the limit of %d bytes.", limit), "", openai.CodeRequestTooLarge)
	}
	if r.ContentLength > limit {
		return tooLarge()
	}
	buf := x.body[:0]
	rd := http.MaxBytesReader(w, r.Body, limit)
	var charged int64 // in budget, given back when the read ends however it ends
	defer budget.release(&charged)
	for {
		if len(buf) == cap(buf) {
			buf = growBodyBuffer(buf, r.ContentLength)
		}
		n, err := rd.Read(buf[len(buf):cap(buf)])
		if n > 0 {
			if !budget.reserve(int64(n)) {
				budget.overflows.Inc()
				x.body = buf
				closeConnection(w, r) // the rest of the body is not read
				w.Header().Set("Retry-After", "1")
				return openai.NewError(http.StatusServiceUnavailable,
					"The gateway is reading too many request bodies at once (max_body_bytes_in_flight); retry later.", "", codeBodyBudget)
			}
			charged += int64(n)
		}
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			break
		}
		if err != nil {
			x.body = buf
			var mbe *http.MaxBytesError
			if errors.As(err, &mbe) {
				return tooLarge()
			}
			// The rest of the body will not be read: close the connection
			// after the reply rather than have the server drain it.
			closeConnection(w, r)
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return openai.NewError(http.StatusRequestTimeout,
					fmt.Sprintf("The request body was not received within %s.", timeout), "", "request_timeout")
			}
			if r.Context().Err() != nil || errors.Is(err, io.ErrUnexpectedEOF) {
				// The client abandoned the request (an HTTP/2 stream reset,
				// a connection closed before the declared body): nobody is
				// there to read an answer.
				return openai.NewError(codeClientClosed, "The client closed the request before its body arrived.", "", "")
			}
			return openai.NewError(http.StatusBadRequest, "Could not read the request body: "+err.Error(), "", openai.CodeInvalidJSON)
		}
	}
	x.body = buf
	if n := int64(len(buf)); n > 0 {
		// Held from here to the request's end (putExchange): the body,
		// and what is decoded from it, live as long as the request.
		if !held.reserve(n) {
			held.overflows.Inc()
			w.Header().Set("Retry-After", "1")
			return openai.NewError(http.StatusServiceUnavailable,
				"The gateway holds too many request bodies in progress (max_body_bytes_held); retry later.", "", codeBodyBudget)
		}
		x.bodyHeld = n
	}
	if deadline {
		_ = http.NewResponseController(w).SetReadDeadline(time.Time{}) // the response may stream for long
	}
	return nil
}

// bodyGrowMin is the least a request body's buffer grows by (bytes): a
// body of up to 64 KiB, most chat requests, is read into one allocation.
const bodyGrowMin = 64 << 10

// growBodyBuffer returns buf with room for more of a body whose client declared
// declared bytes (Content-Length; -1 when chunked): its capacity doubled, at
// least bodyGrowMin, never past the declared length plus the one byte a
// read needs to see the end. Growing with what arrived, not with what the
// header promises, bounds a body's buffer to twice the bytes the client has
// sent (or 64 KiB): a buffer of the declared size at once let a client hold
// 16 MiB (max_body_bytes) with a 100-byte header block and no body for
// body_read_timeout, and 400 such connections took infergate up from 240 MB
// to 3 GB RSS, 15 GB of heap, with the CPU spent zeroing it
// (TestBodyBufferGrowsWithBody).
func growBodyBuffer(buf []byte, declared int64) []byte {
	n := max(2*cap(buf), bodyGrowMin)
	if declared >= 0 && declared < int64(n) {
		n = int(declared) + 1 // declared < n: no overflow
	}
	if n <= cap(buf) {
		n = cap(buf) + bodyGrowMin // more than declared arrived (not from net/http)
	}
	grown := make([]byte, len(buf), n)
	copy(grown, buf)
	return grown
}

// encodedAs returns the first coding other than identity that the
// request's Content-Encoding lists, over every field line and every
// comma-separated member (RFC 9110 §8.4: codings are listed in the order
// applied; "identity, br" is br), or "" when the body is not encoded.
func encodedAs(h http.Header) string {
	for _, v := range h.Values("Content-Encoding") {
		for c := range strings.SplitSeq(v, ",") {
			if c = strings.TrimSpace(c); c != "" && !strings.EqualFold(c, "identity") {
				return c
			}
		}
	}
	return ""
}

// loneSurrogate reports whether b, JSON text, has a \uXXXX escape of a
// UTF-16 surrogate that is not a high one (D800-DBFF) followed at once by
// the escape of a low one (DC00-DFFF). Every backslash is an escape's
// start: outside strings JSON has none (a body with one fails to decode
// anyway). One pass, no allocation; bodies without a backslash cost one
// IndexByte.
func loneSurrogate(b []byte) bool {
	for {
		i := bytes.IndexByte(b, '\\')
		if i < 0 || i+1 >= len(b) {
			return false
		}
		if b[i+1] != 'u' {
			b = b[i+2:] // \" \\ \/ \b …: two bytes
			continue
		}
		cp, ok := hex4(b[i+2:])
		switch {
		case !ok:
			return false // not JSON: the decoder says so
		case cp >= 0xDC00 && cp <= 0xDFFF:
			return true // a low surrogate first
		case cp >= 0xD800 && cp <= 0xDBFF:
			rest := b[i+6:]
			if len(rest) < 6 || rest[0] != '\\' || rest[1] != 'u' {
				return true
			}
			if lo, ok := hex4(rest[2:]); !ok || lo < 0xDC00 || lo > 0xDFFF {
				return true
			}
			b = rest[6:]
		default:
			b = b[i+6:]
		}
	}
}

// hex4 reads 4 hex digits.
func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	var r rune
	for _, c := range b[:4] {
		switch {
		case '0' <= c && c <= '9':
			r = r<<4 | rune(c-'0')
		case 'a' <= c && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case 'A' <= c && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}

// decode parses and validates the body once into the typed request. It
// sets x.model (even when validation fails, if the JSON was readable), and
// returns the 400 error to answer, or nil.
func (x *exchange) decode(kind apiKind) *openai.Error {
	if !utf8.Valid(x.body) {
		// RFC 8259 §8.1: JSON exchanged between systems is UTF-8. Go's
		// decoder would replace the bytes with U+FFFD while the engine is
		// sent the body as is: the gateway would route and count one
		// prompt and the engine serve another (or refuse it).
		return openai.NewError(http.StatusBadRequest, "The request body is not valid UTF-8.", "", openai.CodeInvalidJSON)
	}
	if loneSurrogate(x.body) {
		// The same through an escape (RFC 8259 §8.2: a string with an
		// unpaired surrogate escape is not Unicode text): Go reads
		// U+FFFD, a Python engine a lone surrogate its tokenizer cannot
		// encode.
		return openai.NewError(http.StatusBadRequest, "The request body has an unpaired UTF-16 surrogate escape (\\ud800-\\udfff).", "", openai.CodeInvalidJSON)
	}
	if kind > kindCompletion {
		return x.decodePass(kind)
	}
	var so *openai.StreamOptions
	if kind == kindChat {
		if e := openai.Decode(x.body, &x.chat); e != nil {
			return e
		}
		x.model, x.salt, x.stream, so = x.chat.Model, x.chat.CacheSalt, x.chat.Stream, x.chat.StreamOptions
		x.user = x.chat.User
	} else {
		if e := openai.Decode(x.body, &x.comp); e != nil {
			return e
		}
		x.model, x.salt, x.stream, so = x.comp.Model, x.comp.CacheSalt, x.comp.Stream, x.comp.StreamOptions
		x.user = x.comp.User
	}
	x.includeUsage = so != nil && so.IncludeUsage
	if kind == kindChat {
		return x.chat.Validate()
	}
	return x.comp.Validate()
}

// PriorityHeader is the request header that orders admission: an integer,
// higher first (default 0); requests of equal priority are admitted in
// arrival order.
const PriorityHeader = "X-Priority"

// requestPriority reads PriorityHeader: 0 when absent (or empty), else a
// decimal integer (an optional sign, digits, within int); anything else —
// not an integer, out of range, or the header repeated with different
// values — is a 400 naming the header.
func requestPriority(r *http.Request) (int, *openai.Error) {
	vs := r.Header[PriorityHeader]
	if len(vs) == 0 {
		return 0, nil
	}
	for _, v := range vs[1:] {
		if v != vs[0] {
			return 0, openai.NewError(http.StatusBadRequest,
				fmt.Sprintf("The %s header is given %d times with different values; send it once, as an integer (higher is admitted first).",
					PriorityHeader, len(vs)), PriorityHeader, openai.CodeInvalidValue)
		}
	}
	v := strings.TrimSpace(vs[0])
	if v == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		v := vs[0]
		if len(v) > 64 {
			v = v[:64] + "…"
		}
		return 0, openai.NewError(http.StatusBadRequest,
			fmt.Sprintf("Invalid %s header %q: want an integer (higher is admitted first; default 0).", PriorityHeader, v),
			PriorityHeader, openai.CodeInvalidValue)
	}
	return n, nil
}

// maxRoutingTextBytes bounds the prompt text tokenized for routing (512 KiB,
// about 128k tokens of English): BPE tokenization needs memory many times
// its input, and blocks past a model's context length are never reused.
const maxRoutingTextBytes = 512 << 10

// promptTokens returns the token ids routing hashes: the ids as given for a
// token-id prompt, else the tokenized text (chat: the canonical rendering of
// the messages). For a batch of prompts, the first one stands for the batch.
//
// exact asks for the tokens of the whole rendered prompt, as an engine with
// the same tokenizer computes them (the precise index matches the engines'
// own tokens): through the segment cache in chunks cut where the
// tokenizer's pre-tokens split anyway, which gives the same ids
// (prefix.SegmentCache.AppendExact); otherwise a chat is tokenized message
// by message through the segment cache, whose ids differ at message
// boundaries but are the same for the same messages, which is all the
// approximate index needs.
func (x *exchange) promptTokens(kind apiKind, p *pool, exact bool) []uint32 {
	if p.hf != nil {
		return x.hfPromptTokens(kind, p)
	}
	switch {
	case kind == kindChat && exact:
		x.toks, _ = p.segments.AppendExact(x.toks[:0], x.chat.Prompt(), maxRoutingTextBytes)
		return x.toks
	case kind == kindChat:
		// Message by message, through the segment cache: a conversation's
		// system prompt and earlier turns are tokenized once, not per turn.
		// The segments share x.segBuf (no string per message), which
		// nothing keeps past this call.
		x.segBuf, x.segs = openai.AppendChatSegmentsIn(x.segBuf, x.segs[:0], x.chat.Tools, x.chat.Messages)
		x.toks, _ = p.segments.AppendTokens(x.toks[:0], x.segs, maxRoutingTextBytes)
		return x.toks
	case kind == kindResponses:
		// Rendered as a chat of its instructions and input items.
		x.pass.msgs = x.pass.resp.AppendMessages(x.pass.msgs[:0])
		if exact {
			x.toks, _ = p.segments.AppendExact(x.toks[:0], openai.RenderChat(x.pass.resp.Tools, x.pass.msgs), maxRoutingTextBytes)
			return x.toks
		}
		x.segs = openai.AppendChatSegments(x.segs[:0], x.pass.resp.Tools, x.pass.msgs)
		x.toks, _ = p.segments.AppendTokens(x.toks[:0], x.segs, maxRoutingTextBytes)
		return x.toks
	case kind != kindCompletion:
		return nil
	case len(x.comp.Prompt.Tokens) > 0:
		return x.comp.Prompt.Tokens[0]
	case len(x.comp.Prompt.Texts) > 0:
		x.toks, _ = p.segments.AppendExact(x.toks[:0], x.comp.Prompt.Texts[0], maxRoutingTextBytes)
		return x.toks
	}
	return nil
}

// SessionHeader is the request header that names a conversation for the
// session-affinity scorer; without it the OpenAI "user" field is used.
const SessionHeader = "X-Session-Id"

// sessionKey is the request's session for routing: the X-Session-Id header,
// else the "user" field, else "".
func sessionKey(r *http.Request, x *exchange) string {
	if v := r.Header.Get(SessionHeader); v != "" {
		return v
	}
	return x.user
}

// fail answers e and counts it.
func (g *Gateway) fail(w http.ResponseWriter, rm *routeMetrics, e *openai.Error) {
	openai.WriteError(w, e)
	if c, ok := e.Code.(string); ok {
		observedFor(w).failed(c)
	}
	g.count(w, rm, e.Status)
}
