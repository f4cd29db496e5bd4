package gateway

import (
	"fmt"
	"net/http"
	"strings"

	"github.com/infergate/infergate/jsonscan"
	"github.com/infergate/infergate/openai"
)

// Paths of the OpenAI/vLLM surface passed through besides chat and
// completions (README "Routes").
const (
	pathResponses  = "/v1/responses"
	pathEmbeddings = "/v1/embeddings"
	pathTokenize   = "/tokenize"
	pathDetokenize = "/detokenize"
)

// path is the fixed path of a kind (kinds below numPathKinds), else "".
func (k apiKind) path() string {
	switch k {
	case kindChat:
		return pathChat
	case kindCompletion:
		return pathCompletions
	case kindResponses:
		return pathResponses
	case kindEmbeddings:
		return pathEmbeddings
	case kindTokenize:
		return pathTokenize
	case kindDetokenize:
		return pathDetokenize
	}
	return ""
}

// apiNames are the api label values of infergate_api_requests_total, one
// per kind: unknown paths share "other", so the label stays bounded.
var apiNames = [numKinds]string{
	kindChat: "chat_completions", kindCompletion: "completions", kindResponses: "responses",
	kindEmbeddings: "embeddings", kindTokenize: "tokenize", kindDetokenize: "detokenize",
	kindResponseByID: "responses_by_id", kindOther: "other",
}

// responsesAPI reports whether the kind's answers are the Responses API's
// (typed SSE events, usage in input/output tokens).
func (k apiKind) responsesAPI() bool { return k == kindResponses || k == kindResponseByID }

// generates reports whether the kind is an inference the gateway times
// end to end and whose usage it accounts (not the tokenizer's utilities).
func (k apiKind) generates() bool { return k != kindTokenize && k != kindDetokenize }

// maxPassPath bounds a passed-through path (bytes).
const maxPassPath = 256

// deniedPaths are engine paths under /v1/ never passed through: vLLM's
// runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING), which would let
// any client with a key load files the engine can read as adapters. The
// model list is the gateway's own.
var deniedPaths = map[string]bool{
	"/v1/load_lora_adapter":   true,
	"/v1/unload_lora_adapter": true,
}

// passablePath reports whether path may be passed through to an engine:
// under /v1/, at most maxPassPath bytes, segments of [A-Za-z0-9._~-] that
// are not "." or "..", no empty segment, no escape (r.URL.Path is decoded:
// a %2F or %2E there would have become a '/' or a '.'), and not a denied
// path. A path that could mean something else to the engine than to the
// gateway (traversal, encoded separators) is never forwarded.
func passablePath(path string) bool {
	rest, ok := strings.CutPrefix(path, "/v1/")
	if !ok || len(path) > maxPassPath || deniedPaths[path] || strings.HasPrefix(path, pathModels+"/") {
		return false
	}
	for seg := range strings.SplitSeq(rest, "/") {
		if seg == "" || seg == "." || seg == ".." {
			return false
		}
		for i := 0; i < len(seg); i++ {
			c := seg[i]
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '~' || c == '-') {
				return false
			}
		}
	}
	return true
}

// proxiedPath reports whether a request for path may reach an engine (is
// counted in infergate_requests_total, gets its forwarding headers
// scrubbed): the inference routes, /tokenize, /detokenize and any /v1/
// path but the model list.
func proxiedPath(path string) bool {
	switch path {
	case pathChat, pathCompletions, pathTokenize, pathDetokenize:
		return true
	case pathModels:
		return false
	}
	return strings.HasPrefix(path, "/v1/") && !strings.HasPrefix(path, pathModels+"/")
}

// routePassthrough serves the routes of the rest of the surface (README
// "Routes"); it reports false when path is none of them.
func (g *Gateway) routePassthrough(w http.ResponseWriter, r *http.Request, key *principal, st *state) bool {
	switch p := r.URL.Path; {
	case p == pathResponses:
		if g.allow(w, r, http.MethodPost) {
			g.serveInference(w, r, kindResponses, key, st)
		}
	case p == pathEmbeddings:
		if g.allow(w, r, http.MethodPost) {
			g.serveInference(w, r, kindEmbeddings, key, st)
		}
	case p == pathTokenize:
		if g.allow(w, r, http.MethodPost) {
			g.serveInference(w, r, kindTokenize, key, st)
		}
	case p == pathDetokenize:
		if g.allow(w, r, http.MethodPost) {
			g.serveInference(w, r, kindDetokenize, key, st)
		}
	case strings.HasPrefix(p, pathResponses+"/") && passablePath(p):
		// GET /v1/responses/{id} (retrieve), DELETE, POST …/cancel: to the
		// engine that stored the response.
		switch r.Method {
		case http.MethodGet, http.MethodDelete, http.MethodPost:
			g.serveInference(w, r, kindResponseByID, key, st)
		default:
			w.Header().Set("Allow", "GET, POST, DELETE")
			g.fail(w, g.unknown, openai.NewError(http.StatusMethodNotAllowed,
				fmt.Sprintf("Method %s is not allowed for %s.", r.Method, p), "", "method_not_allowed"))
		}
	case r.Method == http.MethodPost && passablePath(p):
		g.serveInference(w, r, kindOther, key, st)
	default:
		return false
	}
	return true
}

// responseIDOf is the response id of a /v1/responses/{id}[/…] path.
func responseIDOf(path string) string {
	id, _, _ := strings.Cut(strings.TrimPrefix(path, pathResponses+"/"), "/")
	return id
}

// passState is the per-request state of the passed-through APIs, aliases
// and response affinity, kept in the pooled exchange.
type passState struct {
	kind apiKind
	key  *principal // the request's key (nil: authentication off)

	// Decoded bodies of the kinds besides chat and completions.
	resp openai.ResponsesRequest
	emb  openai.EmbeddingRequest
	mreq openai.ModelRequest
	// msgs is a responses request's conversation (routing prompt).
	msgs []openai.Message

	// Model targets (alias.go): fallback is set while a later target can
	// still take the request, so that refusals fall back instead of being
	// answered; fell is why a target declined (the fallback reason).
	fallback bool
	fell     string
	// adapterOf is the base model of the LoRA adapter the client asked
	// for ("" when its model is none; adapters.go).
	adapterOf string
	// sendBody is the body sent upstream when it differs from the client's
	// (an alias target's model spliced in; in aliasBody's buffer).
	sendBody, aliasBody []byte
	// tries counts the attempts over all targets (X-Infergate-Attempts).
	tries int
	// routeToks are the routing tokens, computed once for all targets
	// (toks: 0 none yet, 1 per-message segments, 2 exact).
	routeToks []uint32
	toks      uint8

	// Response affinity (responses.go): pinEP is the endpoint the request
	// must go to (nil: any), pinID the response id that pins it;
	// respID the id of the response to learn (set by the relay once the
	// engine's answer is complete), respDone that a stream's terminal event
	// arrived; seq counts the events read from a Responses stream.
	pinEP    *endpoint
	pinID    string
	respID   string
	respDone bool
	seq      int
}

// reset empties s for the pool, keeping its buffers.
func (s *passState) reset() {
	clear(s.msgs) // do not keep the request's text alive in the pool
	aliasBody, msgs := s.aliasBody[:0], s.msgs[:0]
	if cap(aliasBody) > maxPooledBuffer {
		aliasBody = nil
	}
	*s = passState{aliasBody: aliasBody, msgs: msgs} // routeToks aliases other buffers: dropped
}

// decodePass decodes the body of the kinds besides chat and completions
// (see decode). A response-by-id request has no body to read: its model is
// the stored response's (responseTarget).
func (x *exchange) decodePass(kind apiKind) *openai.Error {
	s := &x.pass
	x.includeUsage = true // never edited: only chat and completion streams get include_usage
	switch kind {
	case kindResponses:
		if e := openai.Decode(x.body, &s.resp); e != nil {
			return e
		}
		x.model, x.salt, x.stream, x.user = s.resp.Model, s.resp.CacheSalt, s.resp.Stream, s.resp.User
		return s.resp.Validate()
	case kindEmbeddings:
		if e := openai.Decode(x.body, &s.emb); e != nil {
			return e
		}
		x.model, x.user = s.emb.Model, s.emb.User
		return s.emb.Validate()
	case kindResponseByID:
		return nil
	}
	if e := openai.Decode(x.body, &s.mreq); e != nil {
		return e
	}
	x.model = s.mreq.Model
	x.stream = kind == kindOther && s.mreq.Stream
	return s.mreq.Validate()
}

// upstreamBody is the body sent to the engine before any include_usage
// edit: the client's, or an alias target's copy of it.
func (x *exchange) upstreamBody() []byte {
	if x.pass.sendBody != nil {
		return x.pass.sendBody
	}
	return x.body
}

// routable reports whether the request's prompt is hashed for routing:
// chats, completions, and responses that start a conversation (one with
// previous_response_id continues a prompt only its engine holds: it is
// pinned there, or routed by load when the gateway does not know it).
// Embeddings, the tokenizer's utilities and unknown paths are routed by
// load alone.
func (x *exchange) routable(kind apiKind) bool {
	switch kind {
	case kindChat, kindCompletion:
		return true
	case kindResponses:
		return x.pass.resp.PreviousResponseID == ""
	}
	return false
}

// retrySafe reports whether failure f of this request may be sent again
// (to another endpoint, or the next model of an alias): always for the
// inference APIs, whose requests are stateless; for an unknown path, whose
// effect the gateway cannot know, only when the request never reached the
// engine (a refused connection).
func (x *exchange) retrySafe(f *failure) bool {
	return x.pass.kind != kindOther || f.reason == reasonConnect
}

// Stream semantics per kind (relayStream): chat and completion streams are
// read as OpenAI chunks and end with [DONE]; Responses streams as typed
// events ending with a terminal event (responses.go); an unknown path's
// stream is relayed event by event, each event counting as output, and
// ends at EOF (or [DONE]).

// maxResponsesEventBytes bounds one Responses stream event beyond
// openai.MaxEventBytes: the terminal event echoes the request's
// instructions and tools (up to max_body_bytes) with the whole output.
const maxResponsesEventBytes = 64 << 20

// eventLimit is the largest stream event the relay reads for x (bytes).
func (x *exchange) eventLimit(g *Gateway) int {
	if x.pass.kind.responsesAPI() {
		return int(min(maxResponsesEventBytes, int64(openai.MaxEventBytes)+g.cfg.MaxBodyBytes))
	}
	return openai.MaxEventBytes
}

// viewEvent reads one stream event's data as x's kind has it.
func (x *exchange) viewEvent(data []byte) (jsonscan.View, bool) {
	switch k := x.pass.kind; {
	case k <= kindCompletion:
		return jsonscan.Chat(data, &x.chunk)
	case k == kindOther:
		return jsonscan.View{Choices: 1, Output: true}, true
	}
	x.pass.seq++
	v, ok := jsonscan.Response(data)
	if !ok {
		return jsonscan.View{}, false
	}
	if v.Terminal {
		x.pass.respDone = true
		if !v.Failed && x.pass.kind == kindResponses && x.pass.resp.Stored() {
			x.pass.respID = v.ID // learnt by attempt once the stream ended well
		}
	}
	return jsonscan.View{Choices: 1, Output: v.Output, IsError: v.Failed, Usage: v.Usage}, true
}

// streamComplete reports whether a stream that reached EOF was complete.
func (x *exchange) streamComplete(er *openai.EventReader) bool {
	switch k := x.pass.kind; {
	case k.responsesAPI():
		return x.pass.respDone
	case k == kindOther:
		return true
	}
	return er.Done()
}

// streamTail is what follows a complete stream's last event: [DONE] for
// chat and completions (and an unknown path's stream that sent it),
// nothing for a Responses stream.
func (x *exchange) streamTail(er *openai.EventReader) []byte {
	if x.pass.kind.responsesAPI() || (x.pass.kind == kindOther && !er.Done()) {
		return nil
	}
	return sseDone
}

// errorMessage is the message of an engine's error event.
func (x *exchange) errorMessage(data []byte) string {
	if x.pass.kind.responsesAPI() {
		return responsesErrorMessage(data)
	}
	return engineErrorMessage(data)
}
