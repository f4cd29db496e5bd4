package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/infergate/infergate/jsonscan"
	"github.com/infergate/infergate/upstream"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/infergate/infergate/load"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
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

// exchange is the per-request scratch state, pooled so that the request path
// allocates little beyond what JSON decoding and net/http need.
type exchange struct {
	body    []byte // the client's request body
	upBody  []byte // the body sent upstream when it differs from body
	chat    openai.ChatRequest
	comp    openai.CompletionRequest
	sreq    sched.Request
	hashes  []uint64
	chunk   openai.StreamChunk
	out     []byte // one SSE event being written
	capture []byte // non-streaming response prefix, for usage
	copyBuf []byte // relay buffer
	// stripped holds a chunk less the usage member the gateway asked for.
	stripped []byte
	segs     []string // a chat's rendered segments (openai.AppendChatSegments)
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

	// Retries (retry.go): an engine's error answer held for relaying, and
	// the endpoints that failed this request.
	errBody  []byte
	excluded []bool
	// wait is the attempt's entry in its endpoint's header waits
	// (upstream/wait.go).
	wait upstream.Wait

	// edge is the key's token reservation and the client write deadline
	// (limits.go).
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
}

func (g *Gateway) getExchange() *exchange {
	if x, _ := g.exchanges.Get().(*exchange); x != nil {
		return x
	}
	return &exchange{copyBuf: make([]byte, 32<<10)}
}

// requestIDValue returns id as a one-element header value held by x.
func (x *exchange) requestIDValue(id string) []string {
	x.reqID[0] = id
	return x.reqID[:]
}

func (g *Gateway) putExchange(x *exchange) {
	x.chat = openai.ChatRequest{}
	x.comp = openai.CompletionRequest{}
	x.sreq = sched.Request{}
	x.model, x.salt, x.user = "", "", ""
	x.share = load.Share{}
	x.chunk.Reset()
	if cap(x.stripped) > maxPooledBuffer {
		x.stripped = nil
	}
	clear(x.segs) // do not keep the request's text alive in the pool
	x.segs = x.segs[:0]
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
	g.exchanges.Put(x)
}

// readBody reads the request body into x.body, at most limit bytes, within
// timeout (the connection's read deadline is set for the body and cleared
// after, so a stalled body answers 408 and long streaming responses are not
// affected). A client that abandons the request before its body arrived
// (its context ends: an HTTP/2 stream reset; or the connection ends before
// the declared length) gets an error of status codeClientClosed, which is
// accounted, not written.
func (x *exchange) readBody(w http.ResponseWriter, r *http.Request, limit int64, timeout time.Duration) *openai.Error {
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
	if n := int(r.ContentLength); n > 0 && cap(buf) < n {
		buf = make([]byte, 0, n)
	} else if cap(buf) == 0 {
		buf = make([]byte, 0, 4<<10)
	}
	rd := http.MaxBytesReader(w, r.Body, limit)
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := rd.Read(buf[len(buf):cap(buf)])
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
	if deadline {
		_ = http.NewResponseController(w).SetReadDeadline(time.Time{}) // the response may stream for long
	}
	return nil
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
// own tokens); otherwise a chat is tokenized message by message through the
// segment cache, whose ids differ at message boundaries but are the same for
// the same messages, which is all the approximate index needs.
func (x *exchange) promptTokens(kind apiKind, p *pool, exact bool) []uint32 {
	switch {
	case kind == kindChat && exact:
		ids, _ := p.tokenizer.EncodePrefix(x.chat.Prompt(), maxRoutingTextBytes)
		return ids
	case kind == kindChat:
		// Message by message, through the segment cache: a conversation's
		// system prompt and earlier turns are tokenized once, not per turn.
		x.segs = openai.AppendChatSegments(x.segs[:0], x.chat.Tools, x.chat.Messages)
		x.toks, _ = p.segments.AppendTokens(x.toks[:0], x.segs, maxRoutingTextBytes)
		return x.toks
	case kind == kindResponses:
		// Rendered as a chat of its instructions and input items.
		x.pass.msgs = x.pass.resp.AppendMessages(x.pass.msgs[:0])
		if exact {
			ids, _ := p.tokenizer.EncodePrefix(openai.RenderChat(x.pass.resp.Tools, x.pass.msgs), maxRoutingTextBytes)
			return ids
		}
		x.segs = openai.AppendChatSegments(x.segs[:0], x.pass.resp.Tools, x.pass.msgs)
		x.toks, _ = p.segments.AppendTokens(x.toks[:0], x.segs, maxRoutingTextBytes)
		return x.toks
	case kind != kindCompletion:
		return nil
	case len(x.comp.Prompt.Tokens) > 0:
		return x.comp.Prompt.Tokens[0]
	case len(x.comp.Prompt.Texts) > 0:
		ids, _ := p.tokenizer.EncodePrefix(x.comp.Prompt.Texts[0], maxRoutingTextBytes)
		return ids
	}
	return nil
}

// requestID returns the client's X-Request-Id if it is a sane token, else a
// new process-unique id.
func (g *Gateway) requestID(r *http.Request) string {
	if v := r.Header["X-Request-Id"]; len(v) == 1 && saneRequestID(v[0]) {
		return v[0]
	}
	return g.reqIDPrefix + strconv.FormatUint(g.reqIDSeq.Add(1), 36)
}

// fail answers e and counts it.
func (g *Gateway) fail(w http.ResponseWriter, rm *routeMetrics, e *openai.Error) {
	openai.WriteError(w, e)
	if c, ok := e.Code.(string); ok {
		observedFor(w).failed(c)
	}
	g.count(w, rm, e.Status)
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

	if e := x.readBody(w, r, g.cfg.MaxBodyBytes, g.cfg.BodyReadTimeout); e != nil {
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
	if e := g.admit(w, x, kind, key, maxModelLen); e != nil {
		g.fail(w, rm, e)
		return
	}
	if len(targets) == 0 {
		x.refundAdmission(w.Header())
		g.fail(w, rm, openai.NewError(http.StatusNotFound,
			fmt.Sprintf("The model `%s` does not exist.", x.model), "model", openai.CodeModelNotFound))
		return
	}
	if kind == kindResponses {
		if e := g.claimResponseID(x.pass.resp.RequestID, key, st); e != nil {
			x.refundAdmission(w.Header())
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
			x.refundAdmission(w.Header())
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
		if e := g.prepareTarget(w, x, kind, p); e != nil {
			x.refundAdmission(w.Header())
			g.fail(w, p.none, e)
			return
		}
		if !g.serveRouted(w, r, x, kind, p, reqID, start) {
			return
		}
		g.fellBack(x, p)
	}
}

// prepareTarget readies x to be sent to pool p: the model sent (an alias
// target's name spliced into the body), and the routing hashes under p's
// seed when its policy needs them.
func (g *Gateway) prepareTarget(w http.ResponseWriter, x *exchange, kind apiKind, p *pool) *openai.Error {
	x.sreq.Model = p.model
	x.sreq.Hashes, x.sreq.PromptTokens = nil, 0
	if p.model != x.model && kind != kindResponseByID {
		if e := g.aliasTarget(w, x, p); e != nil {
			return e
		}
	}
	if (p.policy.NeedsHashes() || p.precise != nil) && x.routable(kind) {
		want := uint8(1)
		if p.precise != nil {
			want = 2
		}
		if x.pass.toks != want { // once for all targets
			x.pass.routeToks, x.pass.toks = x.promptTokens(kind, p, want == 2), want
		}
		tokens := x.pass.routeToks
		seed := p.seed
		if x.salt != "" {
			seed = prefix.Seed(p.model + "\x00" + x.salt)
		}
		x.hashes = prefix.Hashes(x.hashes[:0], tokens, p.blockSize, seed)
		x.sreq.Hashes, x.sreq.PromptTokens = x.hashes, len(tokens)
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
	idle := idleDeadline{idle: g.cfg.StreamIdleTimeout, by: time.Now().Add(g.cfg.ResponseHeaderTimeout)}
	idle.dl, _ = resp.Body.(upstream.ReadDeadliner)
	send := func(b []byte) bool {
		if !sent {
			copyResponseHeader(w.Header(), resp.Header, true)
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
		case !openai.TooDeep(x.capture):
			_ = json.Unmarshal(x.capture, &u)
		}
	}
	g.finish(rm, x, resp.StatusCode, u.Usage, start)
	return nil, resp.StatusCode
}

// finish accounts a request answered with code, its usage (nil if not
// reported) and, for a 2xx, its end-to-end latency.
func (g *Gateway) finish(rm *routeMetrics, x *exchange, code int, u *openai.Usage, start time.Time) {
	x.settleTokens(u)
	if code/100 == 2 && x.pass.kind.generates() {
		rm.e2e.Observe(time.Since(start).Seconds())
	}
	if u != nil {
		rm.prompt.Add(float64(max(u.PromptTokens, 0)))
		rm.generate.Add(float64(max(u.CompletionTokens, 0)))
		cached := max(u.Cached(), 0)
		rm.cached.Add(float64(cached))
		// Prediction error: what the indexes said the endpoint held vs what
		// it reported, at most prompt − 1 tokens (an engine recomputes at
		// least the last prompt token).
		limit := max(u.PromptTokens-1, 0)
		if x.predicted >= 0 && u.PromptTokens > 0 {
			rm.predErr[x.predictedBy].Observe(math.Abs(float64(min(x.predicted, limit) - cached)))
		}
		if x.precisePredicted >= 0 && u.PromptTokens > 0 {
			rm.predErr[indexPrecise].Observe(math.Abs(float64(min(x.precisePredicted, limit) - cached)))
		}
	}
	x.obs.used(u)
	x.keyUse.used(u)
	x.obs.counted(rm, code)
	g.metrics.count(rm, code)
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
			// What is written next (the tail, an error event) is written
			// now: the client's write deadline, set at the last write, may
			// have passed while the engine was silent (write_timeout and
			// stream_idle_timeout are both a minute by default), which cut
			// a stalled stream silently, without its error event.
			g.extendWriteDeadline(w, x, time.Now())
			// Ended by Abort (the client still there): unless the stream was
			// complete, the client is told, as for an engine failure
			// mid-stream.
			shutdown := fr.err == nil && r.Context().Err() != nil && shuttingDown(r)
			switch {
			case shutdown && !complete:
				x.out = x.out[:0]
				writeStreamError(w, rc, x, shutdownError())
				x.obs.failed(codeShuttingDown)
				g.finish(rm, x, http.StatusServiceUnavailable, usage, start)
				return nil, codeClientClosed // no verdict on the engine
			case !shutdown && (r.Context().Err() != nil || fr.err != nil):
				g.count(w, rm, codeClientClosed)
				return nil, codeClientClosed
			}
			code := http.StatusOK
			if complete {
				// The held events of a stream that ended without output
				// leave with [DONE] (a Responses stream ends at its
				// terminal event).
				if _, werr := w.Write(append(x.out, x.streamTail(er)...)); werr != nil {
					g.count(w, rm, codeClientClosed)
					return nil, codeClientClosed
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
			return nil, code
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
				usage = c.Usage // freshly allocated: safe to keep
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
