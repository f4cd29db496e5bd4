package openai

import "encoding/json"

// Object type strings.
const (
	ObjectChatCompletion      = "chat.completion"
	ObjectChatCompletionChunk = "chat.completion.chunk"
	ObjectTextCompletion      = "text_completion"
	ObjectModel               = "model"
	ObjectList                = "list"
)

// Usage is token accounting for one request (tokens). PromptTokensDetails
// carries cached_tokens, the prompt tokens served from the engine's prefix
// cache (vLLM fills it with --enable-prompt-tokens-details).
type Usage struct {
	PromptTokens        int                  `json:"prompt_tokens"`
	CompletionTokens    int                  `json:"completion_tokens"`
	TotalTokens         int                  `json:"total_tokens"`
	PromptTokensDetails *PromptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

// PromptTokensDetails breaks prompt tokens down; CachedTokens are prefix-cache
// hits (tokens).
type PromptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

// Cached returns the cached prompt tokens, 0 when not reported.
func (u *Usage) Cached() int {
	if u == nil || u.PromptTokensDetails == nil {
		return 0
	}
	return u.PromptTokensDetails.CachedTokens
}

// ChatMessage is an assistant message in a non-streaming chat response.
type ChatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// ChatChoice is one choice of a chat.completion.
type ChatChoice struct {
	Index        int         `json:"index"`
	Message      ChatMessage `json:"message"`
	Logprobs     any         `json:"logprobs"`
	FinishReason *string     `json:"finish_reason"`
}

// ChatCompletion is a non-streaming chat response.
type ChatCompletion struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"` // unix seconds
	Model   string       `json:"model"`
	Choices []ChatChoice `json:"choices"`
	Usage   *Usage       `json:"usage"`
}

// Delta is the incremental message of a streamed chat chunk.
type Delta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

// ChatChunkChoice is one choice of a chat.completion.chunk.
type ChatChunkChoice struct {
	Index        int     `json:"index"`
	Delta        Delta   `json:"delta"`
	Logprobs     any     `json:"logprobs"`
	FinishReason *string `json:"finish_reason"`
}

// ChatChunk is one SSE event of a streamed chat response. The usage-only
// chunk sent with stream_options.include_usage has empty Choices.
type ChatChunk struct {
	ID      string            `json:"id"`
	Object  string            `json:"object"`
	Created int64             `json:"created"`
	Model   string            `json:"model"`
	Choices []ChatChunkChoice `json:"choices"`
	Usage   *Usage            `json:"usage,omitempty"`
}

// CompletionChoice is one choice of a text_completion (also used in chunks).
type CompletionChoice struct {
	Index        int     `json:"index"`
	Text         string  `json:"text"`
	Logprobs     any     `json:"logprobs"`
	FinishReason *string `json:"finish_reason"`
}

// Completion is a text_completion response or stream chunk.
type Completion struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []CompletionChoice `json:"choices"`
	Usage   *Usage             `json:"usage,omitempty"`
}

// Model is one entry of GET /v1/models (vLLM's ModelCard fields).
type Model struct {
	ID          string  `json:"id"`
	Object      string  `json:"object"`
	Created     int64   `json:"created"`
	OwnedBy     string  `json:"owned_by"`
	Root        string  `json:"root,omitempty"`
	Parent      *string `json:"parent"`
	MaxModelLen int     `json:"max_model_len,omitempty"`
}

// ModelList is the body of GET /v1/models.
type ModelList struct {
	Object string  `json:"object"`
	Data   []Model `json:"data"`
}

// StreamChunk is the lenient view of any streamed chunk (chat or text
// completion) that the gateway and the benchmark read: whether it carries
// generated tokens, the usage it reports, and whether it is an error event.
// Unknown fields are ignored; choices may be null; the error object is kept
// raw because engines disagree on the type of its "code" (vLLM sends the
// integer status). Decode with json.Unmarshal after Reset; an
// *json.UnmarshalTypeError leaves the other fields usable.
type StreamChunk struct {
	Choices []struct {
		Text  string `json:"text"`
		Delta *struct {
			Content          *string         `json:"content"`
			Reasoning        *string         `json:"reasoning"`
			ReasoningContent *string         `json:"reasoning_content"`
			ToolCalls        json.RawMessage `json:"tool_calls"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *Usage          `json:"usage"`
	Error json.RawMessage `json:"error"`
}

// Reset empties c for reuse, zeroing the choices' backing array (the JSON
// decoder reuses elements without clearing fields absent from the input).
func (c *StreamChunk) Reset() {
	clear(c.Choices[:cap(c.Choices)])
	*c = StreamChunk{Choices: c.Choices[:0]}
}

// IsError reports whether the chunk is an error event ({"error": {...}}).
func (c *StreamChunk) IsError() bool {
	return len(c.Error) > 0 && string(c.Error) != "null"
}

// HasOutput reports whether the chunk carries generated tokens: text,
// content, reasoning (vLLM "reasoning", SGLang/DeepSeek "reasoning_content")
// or tool-call deltas.
func (c *StreamChunk) HasOutput() bool {
	for _, ch := range c.Choices {
		if ch.Text != "" {
			return true
		}
		if d := ch.Delta; d != nil && ((d.Content != nil && *d.Content != "") ||
			(d.Reasoning != nil && *d.Reasoning != "") || (d.ReasoningContent != nil && *d.ReasoningContent != "") ||
			(len(d.ToolCalls) > 0 && string(d.ToolCalls) != "null" && string(d.ToolCalls) != "[]")) {
			return true
		}
	}
	return false
}
