package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"reflect"
	"strings"
	"unicode/utf8"
	"unsafe"

	"github.com/infergate/infergate/internal/jsonvalue"
	segjson "github.com/segmentio/encoding/json"
)

// StreamOptions is the "stream_options" object. IncludeUsage asks for an extra
// final chunk carrying usage; ContinuousUsageStats is vLLM's extension that
// puts cumulative usage in every chunk.
type StreamOptions struct {
	IncludeUsage         bool `json:"include_usage"`
	ContinuousUsageStats bool `json:"continuous_usage_stats,omitempty"`
}

// Message is one chat message. Content may arrive as a string, as an array of
// parts (only "text" parts carry text; others are kept out of Content.Text but
// counted in Content.Parts), or null (an assistant turn with tool calls).
type Message struct {
	Role       string          `json:"role"`
	Content    Content         `json:"content"`
	Name       string          `json:"name,omitempty"`
	ToolCalls  json.RawMessage `json:"tool_calls,omitempty"`
	ToolCallID string          `json:"tool_call_id,omitempty"`
}

// Messages is a chat's "messages" array. It is decoded message by message
// into a slice sized from the element count, and a message whose role is
// not one of roles stops it (the error Validate would give), so a body of
// empty or null messages costs nothing per element: a valid message takes
// at least minMessageBytes of body for its 104-byte Message.
type Messages []Message

// minMessageBytes is the shortest valid message, {"role":"assistant"} (an
// assistant turn may have no content; every other role needs one).
const minMessageBytes = len(`{"role":"assistant"}`)

// UnmarshalJSON decodes an array of message objects (null: none).
func (m *Messages) UnmarshalJSON(b []byte) error { return m.unmarshal(b, false) }

// unmarshal is UnmarshalJSON; with borrow, each message is decoded as a
// borrowedMessage (contents as views of b). The slice's capacity is
// reused when it holds the messages (ChatRequest.Reset keeps it).
func (m *Messages) unmarshal(b []byte, borrow bool) error {
	b = bytes.TrimSpace(b)
	if string(b) == "null" {
		*m = nil
		return nil
	}
	if len(b) == 0 || b[0] != '[' {
		// Field is left to the decoder, which names the field it was in.
		return &json.UnmarshalTypeError{Value: jsonValueKind(b), Type: reflect.TypeOf(Messages{})}
	}
	n, err := countElements(b)
	if err != nil {
		return err
	}
	msgs := (*m)[:0]
	if want := min(n, len(b)/minMessageBytes+1); cap(msgs) < want {
		msgs = make([]Message, 0, want)
	}
	err = eachElement(b, func(i int, e []byte) error {
		if e[0] != '{' {
			return &valueError{param: fmt.Sprintf("messages[%d]", i), msg: fmt.Sprintf("messages[%d] must be an object, not %s", i, jsonValueKind(e))}
		}
		msgs = append(msgs, Message{})
		msg := &msgs[len(msgs)-1]
		var v any = msg
		flags := exactKeys
		if borrow {
			// The same layout (TestBorrowedLayout); its strings (role,
			// name, tool_call_id) that need no unescaping are views of
			// b too, as segmentio's DontCopyString leaves them.
			v, flags = (*borrowedMessage)(unsafe.Pointer(msg)), exactKeys|segjson.DontCopyString
		}
		if err := unmarshalElementWith(e, v, flags); err != nil {
			return err
		}
		if !roles[msg.Role] {
			return &valueError{param: fmt.Sprintf("messages[%d].role", i), msg: fmt.Sprintf("invalid role %q", msg.Role)}
		}
		return nil
	})
	if err != nil {
		return err
	}
	*m = msgs
	return nil
}

// jsonValueKind names the kind of the JSON value b, as encoding/json's
// UnmarshalTypeError.Value does.
func jsonValueKind(b []byte) string {
	if len(b) == 0 {
		return "value"
	}
	switch b[0] {
	case '{':
		return "object"
	case '[':
		return "array"
	case '"':
		return "string"
	case 't', 'f':
		return "bool"
	case 'n':
		return "null"
	}
	return "number"
}

// Content is a message's content: the concatenated text of its text parts.
type Content struct {
	Text  string
	Parts int // number of parts when sent as an array; 0 for a plain string
	Null  bool
	// given is set when the message had a "content" key at all (decoded by
	// UnmarshalJSON), so a missing content is told from an empty string.
	given bool
}

// UnmarshalJSON accepts a string, null, or an array of {"type","text",...}
// parts.
func (c *Content) UnmarshalJSON(b []byte) error { return c.unmarshal(b, false) }

// unmarshal is UnmarshalJSON; with borrow, a string that needs no
// decoding is a view of b, not a copy.
func (c *Content) unmarshal(b []byte, borrow bool) error {
	b = bytes.TrimSpace(b)
	switch {
	case len(b) == 0 || string(b) == "null":
		*c = Content{Null: true, given: true}
		return nil
	case b[0] == '"':
		*c = Content{given: true}
		if in, ok := plainBytes(b); ok {
			if borrow {
				c.Text = unsafe.String(unsafe.SliceData(in), len(in))
			} else {
				c.Text = string(in)
			}
			return nil
		}
		return json.Unmarshal(b, &c.Text)
	case b[0] == '[':
		// Part by part into one scratch value: a part costs no allocation
		// beyond its text, however many the array holds.
		var sb strings.Builder
		var p struct {
			Type string  `json:"type"`
			Text *string `json:"text"`
		}
		n := 0
		err := eachElement(b, func(i int, e []byte) error {
			p.Type, p.Text = "", nil
			if err := unmarshalElement(e, &p); err != nil {
				var te *json.UnmarshalTypeError
				if errors.As(err, &te) {
					return &valueError{param: "messages.content", msg: "content parts must be objects with a string \"type\" (and \"text\" for text parts)"}
				}
				return err
			}
			if p.Type == "" {
				return &valueError{param: "messages.content", msg: fmt.Sprintf("content part %d has no type", i)}
			}
			if p.Type == "text" {
				if p.Text == nil {
					return &valueError{param: "messages.content", msg: fmt.Sprintf("text content part %d has no text", i)}
				}
				sb.WriteString(*p.Text)
			}
			n++
			return nil
		})
		if err != nil {
			return err
		}
		*c = Content{Text: sb.String(), Parts: n, given: true}
		return nil
	}
	return &valueError{param: "messages.content", msg: "content must be a string, an array of content parts or null"}
}

// plainString returns the text of the JSON string b when it needs no
// decoding — no escape, no control character, valid UTF-8 between its two
// quotes — which is then exactly what encoding/json would give (RFC 8259
// §7); ok is false otherwise, for json.Unmarshal to read (and judge) it.
// A chat's message contents are mostly such strings: this saves the
// standard decoder's validation pass and copy per message (a 2 KB system
// prompt: ~10 µs of the endpoint picker's decision, gateway/README.md
// "Endpoint picker").
func plainString(b []byte) (string, bool) {
	if in, ok := plainBytes(b); ok {
		return string(in), true
	}
	return "", false
}

// plainBytes is plainString's text as the bytes of b between its quotes.
func plainBytes(b []byte) ([]byte, bool) {
	if len(b) < 2 || b[0] != '"' || b[len(b)-1] != '"' {
		return nil, false
	}
	in := b[1 : len(b)-1]
	for _, ch := range in {
		if ch < 0x20 || ch == '"' || ch == '\\' {
			return nil, false
		}
	}
	if !utf8.Valid(in) {
		return nil, false
	}
	return in, true
}

// valueError is a request value that is valid JSON but not allowed (a token
// id out of range, content of the wrong shape): DecodeError answers it as
// 400 invalid_value naming param.
type valueError struct{ param, msg string }

func (e *valueError) Error() string { return e.msg }

// exactKeys makes segmentio/encoding/json match object keys to struct fields
// by exact (case-sensitive) name, as the engines do (vLLM's pydantic models
// and Python's json read "model", never "Model"); encoding/json would match
// any case variant, and a body with both would be read one way by the
// gateway (model access, token limits, streaming) and another by the engine.
const exactKeys = segjson.DontMatchCaseInsensitiveStructFields

// unmarshalExact decodes b (one JSON value) into v with segmentio's
// flags (exactKeys at least: exact key matching).
func unmarshalExact(b []byte, v any, flags segjson.ParseFlags) error {
	rest, err := segjson.Parse(b, v, flags)
	if err == nil && len(bytes.TrimLeft(rest, " \t\r\n")) > 0 {
		err = errTrailing
	}
	return err
}

// unmarshalElement decodes one array element b into v with exact key
// matching; on failure the error is encoding/json's (segmentio's name less,
// and quote raw input), as Decode's.
func unmarshalElement(b []byte, v any) error { return unmarshalElementWith(b, v, exactKeys) }

// unmarshalElementWith is unmarshalElement with segmentio's flags.
func unmarshalElementWith(b []byte, v any, flags segjson.ParseFlags) error {
	err := unmarshalExact(b, v, flags)
	if err != nil {
		if serr := json.Unmarshal(b, v); serr != nil {
			err = serr
		}
	}
	return err
}

// MarshalJSON writes the text as a string (null if it was null).
func (c Content) MarshalJSON() ([]byte, error) {
	if c.Null {
		return []byte("null"), nil
	}
	return json.Marshal(c.Text)
}

// ChatRequest is the body of POST /v1/chat/completions (the fields the gateway
// and the simulator read).
type ChatRequest struct {
	Model               string         `json:"model"`
	Messages            Messages       `json:"messages"`
	Stream              bool           `json:"stream,omitempty"`
	StreamOptions       *StreamOptions `json:"stream_options,omitempty"`
	MaxTokens           *int           `json:"max_tokens,omitempty"`
	MaxCompletionTokens *int           `json:"max_completion_tokens,omitempty"`
	N                   *int           `json:"n,omitempty"`
	Temperature         *float64       `json:"temperature,omitempty"`
	TopP                *float64       `json:"top_p,omitempty"`
	User                string         `json:"user,omitempty"`
	IgnoreEOS           bool           `json:"ignore_eos,omitempty"`
	CacheSalt           string         `json:"cache_salt,omitempty"`
	// Tools is the "tools" array, kept raw: it is rendered into the prompt
	// (see RenderChat) and passed through to the engine untouched.
	Tools json.RawMessage `json:"tools,omitempty"`

	// borrow: the next Decode into r leaves the messages' plain string
	// contents as views of the body (Reset).
	borrow bool
}

// Reset zeroes r for the next decode into it, keeping the buffer of its
// messages when it holds at most maxMessages (their contents cleared).
// With borrow, that decode (Decode) leaves each message's content, role,
// name and tool_call_id that is a JSON string needing no unescaping
// (plainString) as a view of the body, not a copy: the body must then
// stay unchanged, and nothing may keep such a string, while r is in use. The gateway's pooled request state uses it
// (a chat's contents were copied per request only to be tokenized and
// hashed: 2 KB and two allocations of the endpoint picker's decision for
// a 400-token system prompt, and a tiny one per role, gateway/README.md
// "Endpoint picker"). The request's other strings (model, user, ...)
// are copies.
func (r *ChatRequest) Reset(maxMessages int, borrow bool) {
	msgs := r.Messages[:0]
	if cap(msgs) > maxMessages {
		msgs = nil
	}
	clear(msgs[:cap(msgs)])
	*r = ChatRequest{Messages: msgs, borrow: borrow}
}

// chatRequestBorrowing is ChatRequest as Decode reads it with borrow: the
// same fields, names, tags and layout (TestBorrowedLayout), its messages
// decoded as borrowedMessages.
type chatRequestBorrowing struct {
	Model               string           `json:"model"`
	Messages            borrowedMessages `json:"messages"`
	Stream              bool             `json:"stream,omitempty"`
	StreamOptions       *StreamOptions   `json:"stream_options,omitempty"`
	MaxTokens           *int             `json:"max_tokens,omitempty"`
	MaxCompletionTokens *int             `json:"max_completion_tokens,omitempty"`
	N                   *int             `json:"n,omitempty"`
	Temperature         *float64         `json:"temperature,omitempty"`
	TopP                *float64         `json:"top_p,omitempty"`
	User                string           `json:"user,omitempty"`
	IgnoreEOS           bool             `json:"ignore_eos,omitempty"`
	CacheSalt           string           `json:"cache_salt,omitempty"`
	Tools               json.RawMessage  `json:"tools,omitempty"`
	borrow              bool
}

// borrowedMessages is Messages decoded with borrowed contents.
type borrowedMessages []Message

func (m *borrowedMessages) UnmarshalJSON(b []byte) error { return (*Messages)(m).unmarshal(b, true) }

// borrowedMessage is Message (the same layout) with a borrowedContent.
type borrowedMessage struct {
	Role       string          `json:"role"`
	Content    borrowedContent `json:"content"`
	Name       string          `json:"name,omitempty"`
	ToolCalls  json.RawMessage `json:"tool_calls,omitempty"`
	ToolCallID string          `json:"tool_call_id,omitempty"`
}

// borrowedContent is Content decoded as a view of the body when it can be.
type borrowedContent Content

func (c *borrowedContent) UnmarshalJSON(b []byte) error { return (*Content)(c).unmarshal(b, true) }

// Prompt renders the request's tools and messages as one prompt string
// (RenderChat).
func (r *ChatRequest) Prompt() string { return RenderChat(r.Tools, r.Messages) }

// CompletionRequest is the body of POST /v1/completions.
type CompletionRequest struct {
	Model         string         `json:"model"`
	Prompt        Prompt         `json:"prompt"`
	Stream        bool           `json:"stream,omitempty"`
	StreamOptions *StreamOptions `json:"stream_options,omitempty"`
	MaxTokens     *int           `json:"max_tokens,omitempty"`
	N             *int           `json:"n,omitempty"`
	Temperature   *float64       `json:"temperature,omitempty"`
	TopP          *float64       `json:"top_p,omitempty"`
	Echo          bool           `json:"echo,omitempty"`
	User          string         `json:"user,omitempty"`
	IgnoreEOS     bool           `json:"ignore_eos,omitempty"`
	CacheSalt     string         `json:"cache_salt,omitempty"`
}

// Prompt is a completion prompt: a string, a list of strings, a list of token
// ids, or a list of token-id lists. Exactly one of Texts and Tokens is set.
type Prompt struct {
	Texts  []string
	Tokens [][]uint32
	// spare is a token-id buffer (and a one-element list for it) handed
	// over by CompletionRequest.Reset for the next UnmarshalJSON into this
	// Prompt to fill instead of allocating; used once.
	spare     []uint32
	spareList [][]uint32
}

// Len returns the number of prompts.
func (p Prompt) Len() int { return len(p.Texts) + len(p.Tokens) }

// UnmarshalJSON accepts the four OpenAI prompt shapes and rejects mixed lists,
// empty lists, and token ids that are negative, fractional or above 2^32-1.
func (p *Prompt) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	spare, spareList := p.spare[:0], p.spareList[:0]
	*p = Prompt{}
	if len(b) == 0 || string(b) == "null" {
		return &valueError{param: "prompt", msg: "prompt is required"}
	}
	if b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		p.Texts = []string{s}
		return nil
	}
	if b[0] != '[' {
		return &valueError{param: "prompt", msg: "prompt must be a string, an array of strings, an array of token ids or an array of token-id arrays"}
	}
	if first := bytes.TrimSpace(b[1:]); len(first) > 0 && (first[0] == '-' || (first[0] >= '0' && first[0] <= '9')) {
		ids, err := appendTokenIDs(spare, b) // the common flat case, without a RawMessage per id
		if err != nil {
			return &valueError{param: "prompt", msg: "prompt: " + err.Error()}
		}
		p.Tokens = append(spareList, ids)
		return nil
	}
	// Element by element into slices sized from the count: no RawMessage
	// per element, no growth.
	n, err := countElements(b)
	if err != nil {
		return err
	}
	if n == 0 {
		return &valueError{param: "prompt", msg: "prompt must not be an empty array"}
	}
	var first []byte
	_ = eachElement(b, func(_ int, e []byte) error { first = e; return errStop })
	switch {
	case first[0] == '"':
		p.Texts = make([]string, n)
		return eachElement(b, func(i int, it []byte) error {
			if err := unmarshalElement(it, &p.Texts[i]); err != nil {
				return &valueError{param: "prompt", msg: fmt.Sprintf("prompt[%d]: all elements must be strings", i)}
			}
			return nil
		})
	case first[0] == '[':
		p.Tokens = make([][]uint32, n)
		return eachElement(b, func(i int, it []byte) error {
			ids, err := parseTokenIDs(it)
			if err != nil {
				return &valueError{param: "prompt", msg: fmt.Sprintf("prompt[%d]: %v", i, err)}
			}
			p.Tokens[i] = ids
			return nil
		})
	default:
		ids, err := parseTokenIDs(b)
		if err != nil {
			return &valueError{param: "prompt", msg: "prompt: " + err.Error()}
		}
		p.Tokens = [][]uint32{ids}
	}
	return nil
}

// errStop ends an eachElement walk early.
var errStop = errors.New("stop")

// MarshalJSON writes the prompt back in its most compact shape.
func (p Prompt) MarshalJSON() ([]byte, error) {
	switch {
	case len(p.Texts) == 1:
		return json.Marshal(p.Texts[0])
	case len(p.Texts) > 1:
		return json.Marshal(p.Texts)
	case len(p.Tokens) == 1:
		return json.Marshal(p.Tokens[0])
	default:
		return json.Marshal(p.Tokens)
	}
}

// parseTokenIDs parses a JSON array of token ids with a hand-written
// scanner: json.Number per id costs two allocations per token, which
// dominated the request path for 10k-token prompts. Ids must be integers in
// [0, 2^32); "1.0", "1e3", "-0" and anything else are rejected.
func parseTokenIDs(b []byte) ([]uint32, error) { return appendTokenIDs(nil, b) }

// appendTokenIDs is parseTokenIDs appending the ids to dst[:0] (its
// capacity reused; grown to about one id per 6 bytes of b at once when
// short). One pass over b, no call per byte: 1,024 ids of 7 digits (8 KB)
// in 7.6–13 µs on the shared 2-core host at load ~10, against 34–39 µs for
// the scanner it replaced (a closure call per byte; a fifth of the endpoint
// picker's decision for such a prompt: BenchmarkParseTokenIDs,
// gateway/README.md "Endpoint picker"), which holds it to the same ids and
// error messages (FuzzAppendTokenIDs).
func appendTokenIDs(dst []uint32, b []byte) ([]uint32, error) {
	b = bytes.TrimSpace(b)
	if len(b) < 2 || b[0] != '[' || b[len(b)-1] != ']' {
		return nil, errors.New("token ids must be an array of integers")
	}
	body := b[1 : len(b)-1]
	ids := dst[:0]
	if want := len(body)/6 + 1; cap(ids) < want {
		ids = make([]uint32, 0, want)
	}
	i := jsonvalue.SkipSpace(body, 0)
	if i == len(body) {
		return nil, errors.New("token-id array must not be empty")
	}
	for {
		start := i
		var v uint64
		for ; i < len(body); i++ {
			d := body[i] - '0'
			if d > 9 {
				break
			}
			if v = v*10 + uint64(d); v > math.MaxUint32 {
				end := i
				for end < len(body) && body[end] >= '0' && body[end] <= '9' && end-start < 24 {
					end++
				}
				return nil, fmt.Errorf("token id %s at %d is not an integer in [0, 2^32)", body[start:end], len(ids))
			}
		}
		if i == start || (body[start] == '0' && i-start > 1) {
			end := i
			for end < len(body) && body[end] != ',' && end-start < 24 {
				end++
			}
			return nil, fmt.Errorf("token id %s at %d is not an integer in [0, 2^32)", bytes.TrimSpace(body[start:end]), len(ids))
		}
		ids = append(ids, uint32(v))
		if i < len(body) && body[i] == ',' { // the common case: no space
			i++
		} else {
			if i = jsonvalue.SkipSpace(body, i); i == len(body) {
				return ids, nil
			}
			if body[i] != ',' {
				return nil, fmt.Errorf("token id at %d is not an integer in [0, 2^32)", len(ids)-1)
			}
			i++
		}
		i = jsonvalue.SkipSpace(body, i)
	}
}

// Reset zeroes r for the next decode into it, but keeps the buffer of its
// flat token-id prompt (when it holds at most maxIDs ids) for that
// decode's ids: the ids decoded before are overwritten, so nothing may
// hold them past Reset. The gateway's pooled request state uses it (a
// 1,024-token-id prompt's 5 KB buffer was allocated per request).
func (r *CompletionRequest) Reset(maxIDs int) {
	var spare []uint32
	var spareList [][]uint32
	switch p := &r.Prompt; {
	case len(p.Tokens) == 1 && cap(p.Tokens[0]) <= maxIDs:
		spare, spareList = p.Tokens[0][:0], p.Tokens[:0]
	case len(p.Tokens) == 0 && len(p.Texts) == 0:
		spare, spareList = p.spare, p.spareList // not used by a decode since
	}
	clear(spareList[:cap(spareList)])
	*r = CompletionRequest{Prompt: Prompt{spare: spare, spareList: spareList}}
}

// roles accepted in chat messages.
var roles = map[string]bool{"system": true, "developer": true, "user": true, "assistant": true, "tool": true, "function": true}

// Validate checks the fields the OpenAI API constrains and returns a 400
// error naming the first offending field, or nil.
func (r *ChatRequest) Validate() *Error {
	if r.Model == "" {
		return Errorf("model", "you must provide a model parameter")
	}
	if len(r.Messages) == 0 {
		return Errorf("messages", "messages must be a non-empty array")
	}
	for i, m := range r.Messages {
		if !roles[m.Role] {
			return Errorf(fmt.Sprintf("messages[%d].role", i), fmt.Sprintf("invalid role %q", m.Role))
		}
		if (m.Content.Null || !m.Content.given) && m.Role != "assistant" {
			return Errorf(fmt.Sprintf("messages[%d].content", i), "content is required for role "+m.Role)
		}
	}
	if err := validateSampling(r.MaxTokens, r.N, r.Temperature, r.TopP, r.Stream, r.StreamOptions); err != nil {
		return err
	}
	if r.MaxCompletionTokens != nil && *r.MaxCompletionTokens < 1 {
		return Errorf("max_completion_tokens", "max_completion_tokens must be at least 1")
	}
	return nil
}

// Validate checks the completion request; see ChatRequest.Validate.
func (r *CompletionRequest) Validate() *Error {
	if r.Model == "" {
		return Errorf("model", "you must provide a model parameter")
	}
	if r.Prompt.Len() == 0 {
		return Errorf("prompt", "prompt is required")
	}
	return validateSampling(r.MaxTokens, r.N, r.Temperature, r.TopP, r.Stream, r.StreamOptions)
}

func validateSampling(maxTokens, n *int, temperature, topP *float64, stream bool, so *StreamOptions) *Error {
	if maxTokens != nil && *maxTokens < 1 {
		return Errorf("max_tokens", "max_tokens must be at least 1")
	}
	if n != nil && (*n < 1 || *n > 128) {
		return Errorf("n", "n must be between 1 and 128")
	}
	if temperature != nil && (*temperature < 0 || *temperature > 2 || math.IsNaN(*temperature)) {
		return Errorf("temperature", "temperature must be between 0 and 2")
	}
	if topP != nil && (*topP <= 0 || *topP > 1 || math.IsNaN(*topP)) {
		return Errorf("top_p", "top_p must be in (0, 1]")
	}
	if so != nil && !stream {
		return Errorf("stream_options", "stream_options is only allowed when stream is true")
	}
	return nil
}

// DecodeError turns a json decoding error into a 400 error naming the field
// when the decoder knows it.
func DecodeError(err error) *Error {
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	var valErr *valueError
	switch {
	case errors.As(err, &valErr):
		return NewError(http.StatusBadRequest, valErr.msg, valErr.param, CodeInvalidValue)
	case errors.As(err, &typeErr):
		field := typeErr.Field
		return NewError(http.StatusBadRequest, fmt.Sprintf("invalid type for %q: expected %s, got %s", field, jsonKind(typeErr.Type), typeErr.Value), field, CodeInvalidValue)
	case errors.As(err, &syntaxErr):
		return NewError(http.StatusBadRequest, fmt.Sprintf("request body is not valid JSON (offset %d): %v", syntaxErr.Offset, err), "", CodeInvalidJSON)
	case errors.Is(err, errTrailing):
		return NewError(http.StatusBadRequest, "request body has data after the JSON object", "", CodeInvalidJSON)
	}
	msg := err.Error()
	param := ""
	if i := strings.Index(msg, "prompt"); i >= 0 {
		param = "prompt"
	}
	return NewError(http.StatusBadRequest, "invalid request body: "+strings.TrimPrefix(msg, "json: "), param, CodeInvalidJSON)
}

var errTrailing = errors.New("trailing data")

// jsonKind names the JSON kind a Go type decodes from, for error messages
// that should not expose Go type names.
func jsonKind(t reflect.Type) string {
	if t == nil {
		return "a value"
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "an integer"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "a non-negative integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Struct, reflect.Map:
		return "an object"
	}
	return "a value"
}

// Decode parses body (one JSON object, nothing after it) into v and returns a
// 400 error describing the problem, or nil. It decodes with
// github.com/segmentio/encoding/json, a drop-in for encoding/json that reads
// requests in about two thirds of the time (the request path's largest cost
// after sockets), and accepts exactly what encoding/json accepts (fuzzed),
// with one deliberate difference: object keys match fields by exact name
// (exactKeys), as the engines read them, so {"model":"a","Model":"b"} is
// model "a" for the gateway and the engine alike. A body nested deeper
// than MaxDepth is refused before any decoder sees it (TooDeep).
func Decode(body []byte, v any) *Error { return decode(body, v, true) }

// decode is Decode; fast false leaves out parse's one-pass reading of a
// completion's token ids (its test's reference).
func decode(body []byte, v any, fast bool) *Error {
	if len(bytes.TrimSpace(body)) == 0 {
		return NewError(http.StatusBadRequest, "request body is empty", "", CodeInvalidJSON)
	}
	if b := bytes.TrimSpace(body); b[0] != '{' {
		return NewError(http.StatusBadRequest, "request body must be a JSON object", "", CodeInvalidJSON)
	}
	if TooDeep(body) {
		return NewError(http.StatusBadRequest, fmt.Sprintf("The request body nests arrays and objects more than %d levels deep.", MaxDepth), "", CodeInvalidJSON)
	}
	rest, err := parse(body, v, fast)
	if err != nil {
		// segmentio's errors say less than encoding/json's (no offset, raw
		// input for the type): on this cold path, decode again with
		// encoding/json for the message. FuzzDecodeAgreesWithStdlib holds
		// both to the same verdict (on bodies without case-variant keys,
		// which encoding/json would also match: there its message may name
		// such a key's field).
		// A valueError is the gateway's own, message included: no second
		// decode (which would double what a hostile body costs).
		var ve *valueError
		if !errors.As(err, &ve) {
			if serr := json.Unmarshal(body, v); serr != nil {
				err = serr
			}
		}
		return DecodeError(err)
	}
	if len(bytes.TrimLeft(rest, " \t\r\n")) > 0 { // JSON's whitespace only
		return DecodeError(errTrailing)
	}
	if k := duplicateKey(body); k != "" {
		return NewError(http.StatusBadRequest, fmt.Sprintf("The request body has the key %q more than once; send each key once.", k), k, CodeInvalidValue)
	}
	return nil
}
