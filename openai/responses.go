package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
)

// Object type of a Responses API response.
const ObjectResponse = "response"

// ResponsesRequest is the body of POST /v1/responses, OpenAI's Responses API
// as vLLM serves it (vllm/entrypoints/openai/protocol.py ResponsesRequest,
// serving_responses.py; commit 00b6063f of vllm-project/vllm): the fields
// the gateway and the simulator read. Everything else (text.format,
// reasoning, include, metadata, …) passes through to the engine untouched.
type ResponsesRequest struct {
	Model string `json:"model"`
	// Input is the new turn: a string (one user message) or an array of
	// input items.
	Input ResponsesInput `json:"input"`
	// Instructions is a system message put before the input (vLLM
	// _construct_input_messages); null reads as "".
	Instructions    string `json:"instructions"`
	Stream          bool   `json:"stream"`
	MaxOutputTokens *int   `json:"max_output_tokens"`
	// PreviousResponseID continues a conversation stored on the engine that
	// produced that response (vLLM keeps responses in its process's memory).
	PreviousResponseID string `json:"previous_response_id"`
	// Store asks the engine to keep the response for a later
	// previous_response_id (OpenAI's and vLLM's default: true; vLLM only
	// stores with VLLM_ENABLE_RESPONSES_API_STORE=1).
	Store       *bool    `json:"store"`
	Background  bool     `json:"background"`
	Temperature *float64 `json:"temperature"`
	TopP        *float64 `json:"top_p"`
	User        string   `json:"user"`
	// CacheSalt and RequestID are vLLM extensions: the prefix-cache salt,
	// and the id the response gets (default "resp_" + 32 hex digits).
	CacheSalt string `json:"cache_salt"`
	RequestID string `json:"request_id"`
	// Tools is kept raw: rendered into the routing prompt like a chat's.
	Tools json.RawMessage `json:"tools"`
}

// Stored reports whether the request asks for its response to be stored
// (store is absent or true).
func (r *ResponsesRequest) Stored() bool { return r.Store == nil || *r.Store }

// ResponsesInput is a Responses API "input": a string (Text, one user
// message) or an array of items (Items). Given records that it was present
// and not null.
type ResponsesInput struct {
	Text  string
	Items []ResponseItem
	// IsText is set for the string form.
	IsText bool
	given  bool
}

// ResponseItem is one input item as the gateway reads it: its type
// ("message" also for the short {"role","content"} form), role, and text:
// a message's text parts joined (input_text, output_text and text parts;
// images and files carry none), a function_call_output's output. Raw is the
// item itself (a copy), which is how items other than messages are
// rendered for routing.
type ResponseItem struct {
	Type string
	Role string
	Text string
	Raw  json.RawMessage
}

// UnmarshalJSON accepts a string or an array of objects (null: absent).
// Items are decoded one by one (eachElement), so an array costs what its
// bytes do.
func (in *ResponsesInput) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	*in = ResponsesInput{}
	switch {
	case len(b) == 0 || string(b) == "null":
		return nil
	case b[0] == '"':
		in.given, in.IsText = true, true
		return json.Unmarshal(b, &in.Text)
	case b[0] != '[':
		return &valueError{param: "input", msg: "input must be a string or an array of input items"}
	}
	n, err := countElements(b)
	if err != nil {
		return err
	}
	in.given = true
	in.Items = make([]ResponseItem, 0, min(n, len(b)/2+1))
	var it struct {
		Type    string          `json:"type"`
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
		Output  json.RawMessage `json:"output"`
	}
	return eachElement(b, func(i int, e []byte) error {
		if e[0] != '{' {
			return &valueError{param: fmt.Sprintf("input[%d]", i), msg: fmt.Sprintf("input[%d] must be an object, not %s", i, jsonValueKind(e))}
		}
		it.Type, it.Role, it.Content, it.Output = "", "", nil, nil
		if err := unmarshalElement(e, &it); err != nil {
			return &valueError{param: fmt.Sprintf("input[%d]", i), msg: fmt.Sprintf("input[%d]: %v", i, err)}
		}
		item := ResponseItem{Type: it.Type, Role: it.Role, Raw: append(json.RawMessage(nil), e...)}
		if item.Type == "" && item.Role != "" {
			item.Type = "message" // the short form (EasyInputMessage)
		}
		var err error
		switch item.Type {
		case "message":
			item.Text, err = responseContentText(it.Content, i)
		case "function_call_output":
			item.Text, err = responseContentText(it.Output, i)
		}
		if err != nil {
			return err
		}
		in.Items = append(in.Items, item)
		return nil
	})
}

// responseContentText is the text of a message item's content: a string,
// or an array of parts whose input_text, output_text and text parts carry
// a "text" (other parts, images and files, carry none).
func responseContentText(raw json.RawMessage, item int) (string, error) {
	raw = bytes.TrimSpace(raw)
	switch {
	case len(raw) == 0 || string(raw) == "null":
		return "", nil
	case raw[0] == '"':
		var s string
		err := json.Unmarshal(raw, &s)
		return s, err
	case raw[0] != '[':
		return "", &valueError{param: fmt.Sprintf("input[%d].content", item), msg: "content must be a string or an array of content parts"}
	}
	var buf bytes.Buffer
	var p struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	err := eachElement(raw, func(_ int, e []byte) error {
		p.Type, p.Text = "", ""
		if e[0] != '{' || unmarshalElement(e, &p) != nil {
			return &valueError{param: fmt.Sprintf("input[%d].content", item), msg: "content parts must be objects with a string \"type\""}
		}
		switch p.Type {
		case "input_text", "output_text", "text":
			buf.WriteString(p.Text)
		}
		return nil
	})
	return buf.String(), err
}

// AppendMessages appends to dst the request's conversation as chat messages,
// as vLLM builds it for a request without previous_response_id
// (_construct_input_messages): the instructions as a system message, then
// the input (a string as one user message; message items with their role
// and text; any other item — function_call, function_call_output,
// reasoning — as a message whose role is its type and whose text is the
// item's compact JSON). RenderChat of the result is the routing prompt.
func (r *ResponsesRequest) AppendMessages(dst []Message) []Message {
	if r.Instructions != "" {
		dst = append(dst, Message{Role: "system", Content: Content{Text: r.Instructions, given: true}})
	}
	if r.Input.IsText {
		return append(dst, Message{Role: "user", Content: Content{Text: r.Input.Text, given: true}})
	}
	for _, it := range r.Input.Items {
		if it.Type == "message" {
			dst = append(dst, Message{Role: it.Role, Content: Content{Text: it.Text, given: true}})
			continue
		}
		var buf bytes.Buffer
		text := string(it.Raw)
		if json.Compact(&buf, it.Raw) == nil {
			text = buf.String()
		}
		dst = append(dst, Message{Role: it.Type, Content: Content{Text: text, given: true}})
	}
	return dst
}

// Prompt renders the request's tools and conversation as one prompt string
// (RenderChat of AppendMessages).
func (r *ResponsesRequest) Prompt() string { return RenderChat(r.Tools, r.AppendMessages(nil)) }

// Validate checks what the gateway needs and the API constrains, returning a
// 400 naming the field, or nil.
func (r *ResponsesRequest) Validate() *Error {
	if r.Model == "" {
		return Errorf("model", "you must provide a model parameter")
	}
	if !r.Input.given {
		return Errorf("input", "input is required: a string or an array of input items")
	}
	if r.MaxOutputTokens != nil && *r.MaxOutputTokens < 1 {
		return Errorf("max_output_tokens", "max_output_tokens must be at least 1")
	}
	return validateSampling(nil, nil, r.Temperature, r.TopP, r.Stream, nil)
}

// ResponseUsage is a Responses API response's usage (vLLM ResponseUsage:
// the input_tokens_details.cached_tokens are its prefix-cache hits; the
// per-turn lists are vLLM's, for multi-turn tool use).
type ResponseUsage struct {
	InputTokens         int                 `json:"input_tokens"`
	InputTokensDetails  *InputTokensDetails `json:"input_tokens_details"`
	OutputTokens        int                 `json:"output_tokens"`
	OutputTokensDetails *OutputTokensDetail `json:"output_tokens_details,omitempty"`
	TotalTokens         int                 `json:"total_tokens"`
}

// InputTokensDetails breaks a response's input tokens down (tokens).
type InputTokensDetails struct {
	CachedTokens        int   `json:"cached_tokens"`
	InputTokensPerTurn  []int `json:"input_tokens_per_turn"`
	CachedTokensPerTurn []int `json:"cached_tokens_per_turn"`
}

// OutputTokensDetail breaks a response's output tokens down (tokens).
type OutputTokensDetail struct {
	ReasoningTokens         int   `json:"reasoning_tokens"`
	ToolOutputTokens        int   `json:"tool_output_tokens"`
	OutputTokensPerTurn     []int `json:"output_tokens_per_turn"`
	ToolOutputTokensPerTurn []int `json:"tool_output_tokens_per_turn"`
}

// Usage is u in chat terms: input tokens are prompt tokens, output tokens
// completion tokens, cached input tokens cached prompt tokens.
func (u *ResponseUsage) Usage() *Usage {
	if u == nil {
		return nil
	}
	out := &Usage{PromptTokens: u.InputTokens, CompletionTokens: u.OutputTokens, TotalTokens: u.TotalTokens}
	if d := u.InputTokensDetails; d != nil {
		out.PromptTokensDetails = &PromptTokensDetails{CachedTokens: d.CachedTokens}
	}
	return out
}

// ModelRequest is the one field the gateway reads from a request it passes
// through without knowing its API (tokenize, detokenize, an unknown /v1/
// path): the model that routes it.
type ModelRequest struct {
	Model string `json:"model"`
	// Stream asks an unknown API for a stream (relayed event by event).
	Stream bool `json:"stream"`
}

// Validate requires the model.
func (r *ModelRequest) Validate() *Error {
	if r.Model == "" {
		return NewError(http.StatusBadRequest, "you must provide a model parameter: the gateway routes this request by the model in its JSON body",
			"model", CodeInvalidValue)
	}
	return nil
}
