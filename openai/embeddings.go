package openai

import (
	"encoding/json"
	"errors"
	"strings"
)

// Object types of embeddings.
const ObjectEmbedding = "embedding"

// MaxEmbeddingInputs bounds the inputs of one embeddings request (OpenAI's
// limit: 2048).
const MaxEmbeddingInputs = 2048

// EmbeddingRequest is the body of POST /v1/embeddings (OpenAI's API, vLLM's
// EmbeddingCompletionRequest in vllm/entrypoints/openai/protocol.py).
type EmbeddingRequest struct {
	Model string `json:"model"`
	// Input is a string, an array of strings, an array of token ids or an
	// array of token-id arrays: the shapes of a completion prompt.
	Input EmbeddingInput `json:"input"`
	// EncodingFormat is "float" (default) or "base64" (little-endian
	// float32s).
	EncodingFormat string `json:"encoding_format"`
	Dimensions     *int   `json:"dimensions"`
	User           string `json:"user"`
}

// EmbeddingInput is an embeddings "input", read like a completion Prompt
// with errors naming "input".
type EmbeddingInput Prompt

// UnmarshalJSON decodes the four prompt shapes (Prompt.UnmarshalJSON).
func (in *EmbeddingInput) UnmarshalJSON(b []byte) error {
	err := (*Prompt)(in).UnmarshalJSON(b)
	var ve *valueError
	if errors.As(err, &ve) {
		return &valueError{param: "input", msg: strings.Replace(ve.msg, "prompt", "input", 1)}
	}
	return err
}

// Len returns the number of inputs.
func (in EmbeddingInput) Len() int { return Prompt(in).Len() }

// Validate checks the request, returning a 400 naming the field, or nil.
func (r *EmbeddingRequest) Validate() *Error {
	switch {
	case r.Model == "":
		return Errorf("model", "you must provide a model parameter")
	case r.Input.Len() == 0:
		return Errorf("input", "input is required")
	case r.Input.Len() > MaxEmbeddingInputs:
		return Errorf("input", "input must have at most 2048 elements")
	case r.EncodingFormat != "" && r.EncodingFormat != "float" && r.EncodingFormat != "base64":
		return Errorf("encoding_format", `encoding_format must be "float" or "base64"`)
	case r.Dimensions != nil && *r.Dimensions < 1:
		return Errorf("dimensions", "dimensions must be at least 1")
	}
	return nil
}

// Embedding is one vector of an embeddings response: []float32 for
// encoding_format "float", a base64 string for "base64".
type Embedding struct {
	Index     int    `json:"index"`
	Object    string `json:"object"`
	Embedding any    `json:"embedding"`
}

// EmbeddingResponse is the body of a POST /v1/embeddings answer (vLLM
// EmbeddingResponse: id "embd-…", usage with prompt and total tokens).
type EmbeddingResponse struct {
	ID      string      `json:"id"`
	Object  string      `json:"object"`
	Created int64       `json:"created"`
	Model   string      `json:"model"`
	Data    []Embedding `json:"data"`
	Usage   Usage       `json:"usage"`
}

// TokenizeRequest is the body of vLLM's POST /tokenize: a prompt
// (TokenizeCompletionRequest) or chat messages (TokenizeChatRequest,
// rendered as the chat endpoint renders them).
type TokenizeRequest struct {
	Model    string   `json:"model"`
	Prompt   *string  `json:"prompt"`
	Messages Messages `json:"messages"`
	// Tools is rendered with the messages, as in a chat request.
	Tools           json.RawMessage `json:"tools"`
	ReturnTokenStrs bool            `json:"return_token_strs"`
}

// TokenizeResponse is vLLM's /tokenize answer.
type TokenizeResponse struct {
	Count       int      `json:"count"`
	MaxModelLen int      `json:"max_model_len"`
	Tokens      []uint32 `json:"tokens"`
	TokenStrs   []string `json:"token_strs"`
}

// DetokenizeRequest is the body of vLLM's POST /detokenize.
type DetokenizeRequest struct {
	Model  string  `json:"model"`
	Tokens []int64 `json:"tokens"`
}

// DetokenizeResponse is vLLM's /detokenize answer.
type DetokenizeResponse struct {
	Prompt string `json:"prompt"`
}
