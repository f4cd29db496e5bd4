package simserver

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/infergate/infergate/openai"
)

// The Responses API as vLLM serves it for a model without the Harmony
// format (vllm/entrypoints/openai/serving_responses.py and protocol.py,
// vllm-project/vllm commit 00b6063f): POST /v1/responses, streaming or
// not, GET /v1/responses/{id} and POST /v1/responses/{id}/cancel.
//
//   - The prompt is the chat of vLLM's _construct_input_messages: the
//     instructions as a system message; with previous_response_id the
//     stored response's messages and its output as an assistant message;
//     then the input (a string as a user message, items as
//     openai.ResponsesRequest.AppendMessages renders them). It is rendered
//     and tokenized like a chat request, so a continuation on the engine
//     that stored the conversation hits its prefix cache.
//   - Responses are stored only with ServerConfig.ResponsesStore (vLLM's
//     VLLM_ENABLE_RESPONSES_API_STORE=1) and store not false; without it
//     store is silently ignored and background is refused. A
//     previous_response_id this engine did not store answers 404 "Response
//     with id '…' not found." (vLLM's store is per process). Unlike vLLM,
//     whose store grows without bound, the simulator keeps the latest
//     maxStoredResponses.
//   - The id is the request's request_id (vLLM extension), else "resp_" and
//     32 hex digits. Tools answer 400, as vLLM does without Harmony;
//     background mode is not simulated (400).
//   - A stream is "event: TYPE\ndata: JSON\n\n" events, no [DONE]:
//     response.created and response.in_progress at once; at the first
//     token response.output_item.added and response.content_part.added;
//     one response.output_text.delta per token; then
//     response.output_text.done, response.content_part.done,
//     response.output_item.done and response.completed carrying the whole
//     response and its usage. sequence_number counts from 0; content_index
//     advances after every event of the part, as vLLM's does, and the
//     streamed item's id is a bare UUID while the final response's message
//     id is "msg_…" (vLLM's as well). The status is "completed" (vLLM's
//     non-Harmony catch-all), usage input/output tokens with
//     input_tokens_details.cached_tokens.
//   - An engine shutdown mid-stream aborts the connection (vLLM's generator
//     raises: uvicorn drops the response without a terminal event).

// maxStoredResponses bounds the simulator's response store.
const maxStoredResponses = 4096

// responsesCall is the Responses API part of a generation.
type responsesCall struct {
	req     *responsesRequest
	msgs    []openai.Message // the conversation, for the store
	created int64
}

// responsesRequest is the request with the fields vLLM echoes in the
// response object.
type responsesRequest struct {
	openai.ResponsesRequest
	Metadata          json.RawMessage `json:"metadata"`
	ToolChoice        json.RawMessage `json:"tool_choice"`
	ParallelToolCalls *bool           `json:"parallel_tool_calls"`
	ServiceTier       string          `json:"service_tier"`
	Truncation        string          `json:"truncation"`
	Text              json.RawMessage `json:"text"`
	Reasoning         json.RawMessage `json:"reasoning"`
	MaxToolCalls      *int            `json:"max_tool_calls"`
}

// responseObject is vLLM's ResponsesResponse (from_request).
type responseObject struct {
	ID                 string                `json:"id"`
	CreatedAt          int64                 `json:"created_at"`
	IncompleteDetails  any                   `json:"incomplete_details"`
	Instructions       *string               `json:"instructions"`
	Metadata           json.RawMessage       `json:"metadata"`
	Model              string                `json:"model"`
	Object             string                `json:"object"`
	Output             []outputMessage       `json:"output"`
	ParallelToolCalls  bool                  `json:"parallel_tool_calls"`
	Temperature        float64               `json:"temperature"`
	ToolChoice         json.RawMessage       `json:"tool_choice"`
	Tools              []any                 `json:"tools"`
	TopP               float64               `json:"top_p"`
	Background         bool                  `json:"background"`
	MaxOutputTokens    int                   `json:"max_output_tokens"`
	MaxToolCalls       *int                  `json:"max_tool_calls"`
	PreviousResponseID *string               `json:"previous_response_id"`
	Prompt             any                   `json:"prompt"`
	Reasoning          json.RawMessage       `json:"reasoning"`
	ServiceTier        string                `json:"service_tier"`
	Status             string                `json:"status"`
	Text               json.RawMessage       `json:"text"`
	TopLogprobs        *int                  `json:"top_logprobs"`
	Truncation         string                `json:"truncation"`
	Usage              *openai.ResponseUsage `json:"usage"`
	User               *string               `json:"user"`
	InputMessages      any                   `json:"input_messages"`
	OutputMessages     any                   `json:"output_messages"`
}

// outputMessage is a ResponseOutputMessage; Summary is the extra field
// vLLM's stream adds to the done item.
type outputMessage struct {
	ID      string       `json:"id"`
	Content []outputText `json:"content"`
	Role    string       `json:"role"`
	Status  string       `json:"status"`
	Type    string       `json:"type"`
	Summary []any        `json:"summary,omitempty"`
}

// outputText is a ResponseOutputText part; Logprobs is [] in the streamed
// part added, null elsewhere.
type outputText struct {
	Annotations []any  `json:"annotations"`
	Text        string `json:"text"`
	Type        string `json:"type"`
	Logprobs    []any  `json:"logprobs"`
}

// storedResponse is what the store keeps of a response: the conversation
// that produced it, its output text (both for a continuation) and its
// body (for retrieval).
type storedResponse struct {
	msgs   []openai.Message
	output string
	body   []byte
}

// responseStore is the engine's bounded response store.
type responseStore struct {
	mu   sync.Mutex
	m    map[string]*storedResponse
	ids  []string // insertion order, for eviction
	next int
}

func (st *responseStore) get(id string) *storedResponse {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.m[id]
}

func (st *responseStore) put(id string, r *storedResponse) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.m == nil {
		st.m, st.ids = map[string]*storedResponse{}, make([]string, maxStoredResponses)
	}
	if _, ok := st.m[id]; !ok {
		if old := st.ids[st.next]; old != "" {
			delete(st.m, old)
		}
		st.ids[st.next] = id
		st.next = (st.next + 1) % len(st.ids)
	}
	st.m[id] = r
}

// vllmError is an error as vLLM's create_error_response writes it: the
// HTTP status as the integer code.
func vllmError(status int, msg string) *openai.Error {
	return &openai.Error{Message: msg, Type: "invalid_request_error", Code: status, Status: status}
}

func (s *Server) handleResponses(w http.ResponseWriter, r *http.Request) {
	var req responsesRequest
	if e := s.decodeBody(w, r, &req); e != nil {
		openai.WriteError(w, e)
		return
	}
	if req.Model == "" {
		req.Model = s.cfg.Model // vLLM: an absent model is the served one
	}
	if e := req.Validate(); e != nil {
		openai.WriteError(w, e)
		return
	}
	store := s.cfg.ResponsesStore && req.Stored()
	if req.Background {
		msg := "background mode is not simulated"
		if !s.cfg.ResponsesStore {
			msg = "This vLLM engine does not support `store=True` and therefore does not support the background mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server."
		}
		openai.WriteError(w, vllmError(http.StatusBadRequest, msg))
		return
	}
	var prev *storedResponse
	if id := req.PreviousResponseID; id != "" {
		if prev = s.store.get(id); prev == nil {
			openai.WriteError(w, vllmError(http.StatusNotFound, fmt.Sprintf("Response with id '%s' not found.", id)))
			return
		}
	}
	if t := strings.TrimSpace(string(req.Tools)); t != "" && t != "null" && t != "[]" {
		openai.WriteError(w, vllmError(http.StatusBadRequest, "Tool use is not supported in Responses API without Harmony None"))
		return
	}
	// _construct_input_messages: instructions, the stored conversation and
	// its output, the new input.
	var msgs []openai.Message
	if req.Instructions != "" {
		msgs = append(msgs, openai.Message{Role: "system", Content: textContent(req.Instructions)})
	}
	if prev != nil {
		msgs = append(msgs, prev.msgs...)
		msgs = append(msgs, openai.Message{Role: "assistant", Content: textContent(prev.output)})
	}
	in := req.ResponsesRequest
	in.Instructions = ""
	msgs = in.AppendMessages(msgs)

	id := req.RequestID
	if id == "" {
		id = s.newID("resp_")
	}
	rc := &responsesCall{req: &req, created: time.Now().Unix()}
	if store {
		rc.msgs = msgs
	}
	// Rendered as a chat: vLLM's serving_responses.py renders the
	// messages with the model's chat template.
	toks, e := s.promptTokens(ChatPrompt{Messages: msgs, AddGenerationPrompt: true}, false)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	g := genRequest{
		id:             id,
		model:          req.Model,
		tokens:         toks,
		maxTokens:      orDefault(req.MaxOutputTokens, DefaultMaxTokens),
		maxTokensParam: orDefault(req.MaxOutputTokens, 0),
		stream:         req.Stream,
		cacheSalt:      req.CacheSalt,
		resp:           rc,
	}
	if e := s.check(&g, nil); e != nil {
		openai.WriteError(w, e)
		return
	}
	s.serve(w, r, &g)
}

// textContent is a message content of text.
func textContent(text string) openai.Content {
	var c openai.Content
	b, _ := json.Marshal(text)
	_ = c.UnmarshalJSON(b)
	return c
}

// object is the response object for g: status, output text (no output
// items while in progress) and usage (nil while in progress).
func (rc *responsesCall) object(g *genRequest, status, text string, u *openai.Usage, msgID string) responseObject {
	req := rc.req
	o := responseObject{
		ID: g.id, CreatedAt: rc.created, Metadata: nullIfEmpty(req.Metadata), Model: g.model, Object: openai.ObjectResponse,
		Output: []outputMessage{}, ParallelToolCalls: req.ParallelToolCalls == nil || *req.ParallelToolCalls,
		Temperature: 1, ToolChoice: req.ToolChoice, Tools: []any{}, TopP: 1, MaxOutputTokens: g.maxTokens,
		MaxToolCalls: req.MaxToolCalls, Reasoning: nullIfEmpty(req.Reasoning), ServiceTier: req.ServiceTier, Status: status,
		Text: nullIfEmpty(req.Text), Truncation: req.Truncation,
	}
	if req.Temperature != nil {
		o.Temperature = *req.Temperature
	}
	if req.TopP != nil {
		o.TopP = *req.TopP
	}
	if len(o.ToolChoice) == 0 || string(o.ToolChoice) == "null" {
		o.ToolChoice = json.RawMessage(`"auto"`)
	}
	if o.ServiceTier == "" {
		o.ServiceTier = "auto"
	}
	if o.Truncation == "" {
		o.Truncation = "disabled"
	}
	if req.Instructions != "" {
		o.Instructions = &req.Instructions
	}
	if req.PreviousResponseID != "" {
		o.PreviousResponseID = &req.PreviousResponseID
	}
	if req.User != "" {
		o.User = &req.User
	}
	if status == "completed" {
		o.Output = []outputMessage{{ID: msgID, Role: "assistant", Status: "completed", Type: "message",
			Content: []outputText{{Annotations: []any{}, Text: text, Type: "output_text"}}}}
		o.Usage = responseUsage(u)
	}
	return o
}

func nullIfEmpty(raw json.RawMessage) json.RawMessage {
	if len(raw) == 0 {
		return json.RawMessage("null")
	}
	return raw
}

// responseUsage is u in the Responses API's terms (vLLM ResponseUsage; the
// per-turn lists are those of tool-using turns, empty here).
func responseUsage(u *openai.Usage) *openai.ResponseUsage {
	return &openai.ResponseUsage{
		InputTokens: u.PromptTokens, OutputTokens: u.CompletionTokens, TotalTokens: u.TotalTokens,
		InputTokensDetails: &openai.InputTokensDetails{CachedTokens: u.Cached(), InputTokensPerTurn: []int{}, CachedTokensPerTurn: []int{}},
		OutputTokensDetails: &openai.OutputTokensDetail{OutputTokensPerTurn: []int{},
			ToolOutputTokensPerTurn: []int{}},
	}
}

// finish stores the completed response when the request asked for it.
func (s *Server) finishResponse(g *genRequest, text string, body []byte) {
	if rc := g.resp; rc.msgs != nil {
		s.store.put(g.id, &storedResponse{msgs: rc.msgs, output: text, body: body})
	}
}

// responsesFull collects a non-streaming Responses answer.
type responsesFull struct {
	w    http.ResponseWriter
	s    *Server
	g    *genRequest
	text strings.Builder
}

func (f *responsesFull) events(evs []event) bool {
	for _, ev := range evs {
		if ev.err != nil {
			f.fail(ev.err)
			return true
		}
		f.text.WriteString(ev.text)
		if !ev.finished {
			continue
		}
		u := ev.usage
		body, err := json.Marshal(f.g.resp.object(f.g, "completed", f.text.String(), &u, f.s.newID("msg_")))
		if err != nil {
			f.fail(openai.NewError(http.StatusInternalServerError, err.Error(), "", ""))
			return true
		}
		f.s.finishResponse(f.g, f.text.String(), body)
		h := f.w.Header()
		h.Set("Content-Type", "application/json")
		f.w.WriteHeader(http.StatusOK)
		_, _ = f.w.Write(body)
		return true
	}
	return false
}

func (f *responsesFull) fail(e *openai.Error) { openai.WriteError(f.w, e) }

// responsesStream writes a Responses stream (see the file comment).
type responsesStream struct {
	w       http.ResponseWriter
	flusher http.Flusher
	s       *Server
	g       *genRequest
	seq     int
	content int // vLLM's current_content_index
	itemID  string
	text    strings.Builder
	buf     []byte
}

func newResponsesStream(w http.ResponseWriter, s *Server, g *genRequest) *responsesStream {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	f, _ := w.(http.Flusher)
	rs := &responsesStream{w: w, flusher: f, s: s, g: g}
	initial := g.resp.object(g, "in_progress", "", nil, "")
	rs.send("response.created", map[string]any{"response": initial})
	rs.send("response.in_progress", map[string]any{"response": initial})
	rs.flush()
	return rs
}

func (rs *responsesStream) flush() {
	if rs.flusher != nil {
		rs.flusher.Flush()
	}
}

// send writes one event of type typ: fields plus type and sequence_number.
func (rs *responsesStream) send(typ string, fields map[string]any) {
	fields["type"], fields["sequence_number"] = typ, rs.seq
	rs.seq++
	b, err := json.Marshal(fields)
	if err != nil {
		return
	}
	rs.buf = append(append(append(rs.buf[:0], "event: "...), typ...), "\ndata: "...)
	rs.buf = append(append(rs.buf, b...), "\n\n"...)
	_, _ = rs.w.Write(rs.buf)
}

func (rs *responsesStream) events(evs []event) bool {
	g := rs.g
	for _, ev := range evs {
		if ev.err != nil {
			rs.fail(ev.err)
			return true
		}
		if ev.first {
			rs.itemID = uuidString(rs.s.newID(""))
			rs.send("response.output_item.added", map[string]any{"output_index": 0,
				"item": outputMessage{ID: rs.itemID, Content: []outputText{}, Role: "assistant", Status: "in_progress", Type: "message"}})
			rs.send("response.content_part.added", map[string]any{"output_index": 0, "item_id": rs.itemID, "content_index": rs.content,
				"part": outputText{Annotations: []any{}, Type: "output_text", Logprobs: []any{}}})
			rs.content++
		}
		rs.text.WriteString(ev.text)
		rs.send("response.output_text.delta", map[string]any{"content_index": rs.content, "output_index": 0,
			"item_id": rs.itemID, "delta": ev.text, "logprobs": []any{}})
		rs.content++
		if !ev.finished {
			continue
		}
		text := rs.text.String()
		rs.send("response.output_text.done", map[string]any{"output_index": 0, "content_index": rs.content,
			"text": text, "logprobs": []any{}, "item_id": rs.itemID})
		rs.content++
		part := outputText{Annotations: []any{}, Text: text, Type: "output_text"}
		rs.send("response.content_part.done", map[string]any{"item_id": rs.itemID, "output_index": 0,
			"content_index": rs.content, "part": part})
		rs.content++
		rs.send("response.output_item.done", map[string]any{"output_index": 0, "item": outputMessage{
			ID: rs.itemID, Content: []outputText{part}, Role: "assistant", Status: "completed", Type: "message", Summary: []any{}}})
		u := ev.usage
		final := g.resp.object(g, "completed", text, &u, rs.s.newID("msg_"))
		body, _ := json.Marshal(final)
		rs.s.finishResponse(g, text, body)
		rs.send("response.completed", map[string]any{"response": json.RawMessage(body)})
		rs.flush()
		return true
	}
	rs.flush()
	return false
}

// fail aborts the stream: vLLM's responses generator raising mid-stream
// ends the response without a terminal event.
func (rs *responsesStream) fail(*openai.Error) {
	rs.flush()
	panic(http.ErrAbortHandler)
}

// uuidString formats the last 32 hex digits of id as a UUID (8-4-4-4-12),
// as Python's str(uuid.uuid4()).
func uuidString(id string) string {
	h := id[len(id)-32:]
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// handleRetrieveResponse answers GET /v1/responses/{id}: the stored
// response, or 404 (vLLM retrieve_responses).
func (s *Server) handleRetrieveResponse(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	st := s.store.get(id)
	if st == nil {
		openai.WriteError(w, vllmError(http.StatusNotFound, fmt.Sprintf("Response with id '%s' not found.", id)))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(st.body)
}

// handleCancelResponse answers POST /v1/responses/{id}/cancel: stored
// responses are all finished (no background mode), which vLLM refuses.
func (s *Server) handleCancelResponse(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if s.store.get(id) == nil {
		openai.WriteError(w, vllmError(http.StatusNotFound, fmt.Sprintf("Response with id '%s' not found.", id)))
		return
	}
	openai.WriteError(w, vllmError(http.StatusBadRequest, "Cannot cancel a synchronous response."))
}

// handleNotFound is FastAPI's answer for a path no route serves.
func handleNotFound(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusNotFound)
	_, _ = w.Write([]byte(`{"detail":"Not Found"}`))
}
