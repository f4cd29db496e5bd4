package simserver

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode"

	"github.com/infergate/infergate/hftokenizer"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
)

// Tokenizer is how the simulated engine turns a request into prompt token
// ids and token ids into text: what vLLM's renderer and tokenizer do
// (vllm/entrypoints/openai/serving_engine.py, _preprocess_chat and
// _tokenize_prompt_input; vllm-project/vllm commit 00b6063f). Everything
// the engine derives from tokens follows from it: prompt_tokens, the KV
// blocks and their hashes (so the KV events), /tokenize and /detokenize,
// and the words output tokens are written as (words.go). Every endpoint of
// the server goes through Server.tok, so a new one (vLLM's render
// endpoints) tokenizes alike without more wiring. Safe for concurrent use.
//
// Two implementations: cl100k_base with the canonical Llama-3 layout
// (openai.RenderChat; the default, NewCL100KTokenizer), and a model's own
// Hugging Face tokenizer.json and chat template (LoadTokenizer; package
// hftokenizer, the same code the gateway's tokenizers: configuration
// runs, so the gateway and the engines agree on every id).
type Tokenizer interface {
	// Name is "cl100k_base" or the path the tokenizer was loaded from.
	Name() string
	// RenderChat renders a chat into the prompt text the engine
	// tokenizes (with EncodeChat's addSpecial false).
	RenderChat(c ChatPrompt) (string, error)
	// Encode appends the ids of text to dst; addSpecial adds the
	// post-processor's special tokens (Llama-3's <|begin_of_text|>), as
	// vLLM's add_special_tokens does. cl100k has none.
	Encode(dst []uint32, text string, addSpecial bool) ([]uint32, error)
	// Decode is the text of ids; ids outside the vocabulary are skipped.
	Decode(ids []uint32) string
	// TokenString is one id's token as /tokenize's token_strs gives it
	// (vLLM: the tokenizer's convert_ids_to_tokens; cl100k: its text).
	TokenString(id uint32) string
	// VocabSize is the number of ids (the largest id + 1); 0 when the
	// profile's vocab_size bounds the ids instead (cl100k).
	VocabSize() int
}

// ChatPrompt is what a chat renders from: vLLM's fields of a chat request
// (ChatCompletionRequest, TokenizeChatRequest in
// vllm/entrypoints/openai/protocol.py, commit 00b6063f).
type ChatPrompt struct {
	// Messages are the decoded messages (the canonical layout's input).
	Messages []openai.Message
	// RawMessages is the request's "messages" as sent (the chat
	// template's input, keys in order); nil: Messages marshalled.
	RawMessages json.RawMessage
	// Tools is the request's "tools" (nil or null: none).
	Tools json.RawMessage
	// AddGenerationPrompt opens the assistant's turn (vLLM's default true).
	AddGenerationPrompt bool
	// ContinueFinalMessage leaves the final message open, as
	// transformers' continue_final_message (chat template only).
	ContinueFinalMessage bool
	// Kwargs are chat_template_kwargs (e.g. enable_thinking).
	Kwargs map[string]any
}

// NewCL100KTokenizer is the default tokenizer: cl100k_base
// (prefix.Tokenizer) over the canonical Llama-3 chat layout
// (openai.RenderChat), the gateway's fallback for a model without
// tokenizers: configuration.
func NewCL100KTokenizer() (Tokenizer, error) {
	t, err := prefix.NewTokenizer()
	if err != nil {
		return nil, err
	}
	return cl100k{t}, nil
}

type cl100k struct{ t *prefix.Tokenizer }

func (cl100k) Name() string { return "cl100k_base" }

func (cl100k) RenderChat(c ChatPrompt) (string, error) {
	return openai.RenderChat(c.Tools, c.Messages), nil
}

func (c cl100k) Encode(dst []uint32, text string, _ bool) ([]uint32, error) {
	return append(dst, c.t.Encode(text)...), nil
}

func (c cl100k) Decode(ids []uint32) string { return c.t.Decode(ids) }

func (c cl100k) TokenString(id uint32) string { return c.t.Decode([]uint32{id}) }

func (cl100k) VocabSize() int { return 0 }

// LoadTokenizer loads a model's own tokenizer: path is a tokenizer.json,
// or a folder holding one and the tokenizer_config.json whose
// chat_template renders chats (hftokenizer.Load); "" is cl100k_base.
// A folder without a chat template renders chats in the canonical
// layout, as the gateway does for such a model.
func LoadTokenizer(path string) (Tokenizer, error) {
	if path == "" {
		return NewCL100KTokenizer()
	}
	t, err := hftokenizer.Load(path)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	return &hfTokenizer{path: path, t: t}, nil
}

type hfTokenizer struct {
	path string
	t    *hftokenizer.Tokenizer
}

func (h *hfTokenizer) Name() string { return h.path }

// RenderChat renders c with the chat template as vLLM does for a
// Hugging Face tokenizer (vllm/entrypoints/chat_utils.py,
// apply_hf_chat_template, and the message preprocessing of
// hftokenizer.Chat.VLLMMessages), continue_final_message as transformers'
// apply_chat_template cuts it (transformers/utils/chat_template_utils.py,
// v4.5x). Without a template: the canonical layout.
func (h *hfTokenizer) RenderChat(c ChatPrompt) (string, error) {
	tpl := h.t.Template()
	if tpl == nil {
		if c.ContinueFinalMessage {
			return "", errors.New("continue_final_message needs a chat template")
		}
		return openai.RenderChat(c.Tools, c.Messages), nil
	}
	if c.ContinueFinalMessage && c.AddGenerationPrompt {
		// vLLM's ChatCompletionRequest.check_generation_prompt.
		return "", errors.New("cannot set both `continue_final_message` and `add_generation_prompt` to True")
	}
	msgs := c.RawMessages
	if msgs == nil {
		var err error
		if msgs, err = json.Marshal(c.Messages); err != nil {
			return "", err
		}
	}
	out, err := tpl.Render(hftokenizer.Chat{Messages: msgs, Tools: c.Tools, AddGenerationPrompt: c.AddGenerationPrompt,
		Extra: c.Kwargs, VLLMMessages: true})
	if err != nil || !c.ContinueFinalMessage {
		return out, err
	}
	final, err := finalText(msgs)
	if err != nil {
		return "", err
	}
	return cutAfterFinal(out, final)
}

// finalText is the text transformers' continue_final_message looks for:
// the final message's content, or the text of its last part with text.
func finalText(msgs json.RawMessage) (string, error) {
	var list []struct {
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(msgs, &list); err != nil || len(list) == 0 {
		return "", errors.New("continue_final_message needs a final message")
	}
	c := list[len(list)-1].Content
	var s string
	if json.Unmarshal(c, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Text *string `json:"text"`
	}
	if json.Unmarshal(c, &parts) == nil {
		for i := len(parts) - 1; i >= 0; i-- {
			if parts[i].Text != nil {
				return *parts[i].Text, nil
			}
		}
	}
	return "", errors.New("continue_final_message: the final message has no text")
}

// cutAfterFinal is transformers' continue_final_message: the rendering cut
// right after the final message's text, keeping its trailing whitespace
// only if the template kept it.
func cutAfterFinal(rendered, final string) (string, error) {
	at := strings.LastIndex(rendered, strings.TrimSpace(final))
	if at < 0 {
		return "", errors.New("continue_final_message is set but the final message does not appear in the chat after applying the chat template")
	}
	if l := strings.TrimLeftFunc(final, unicode.IsSpace); strings.HasPrefix(rendered[at:], l) {
		return rendered[:at+len(l)], nil
	}
	return rendered[:at+len(strings.TrimSpace(final))], nil
}

func (h *hfTokenizer) Encode(dst []uint32, text string, addSpecial bool) ([]uint32, error) {
	return h.t.Append(dst, text, addSpecial)
}

func (h *hfTokenizer) Decode(ids []uint32) string { return h.t.Decode(ids, false) }

func (h *hfTokenizer) TokenString(id uint32) string {
	t, _ := h.t.TokenString(id)
	return t
}

func (h *hfTokenizer) VocabSize() int { return h.t.VocabSize() }

// loadTokenizerOnce loads cfg.Tokenizer into cfg.LoadedTokenizer, unless
// already loaded, so that the engines of a fleet share one tokenizer
// (loading Llama-3's 9 MB tokenizer.json takes about a second of CPU and
// 150 MB transiently; hftokenizer/README.md, "Costs").
func loadTokenizerOnce(cfg ServerConfig) (ServerConfig, error) {
	if cfg.LoadedTokenizer != nil {
		return cfg, nil
	}
	t, err := LoadTokenizer(tokenizerPath(cfg))
	if err != nil {
		return cfg, fmt.Errorf("sim: %w", err)
	}
	cfg.LoadedTokenizer = t
	return cfg, nil
}

// tokenizerPath is cfg's tokenizer: Tokenizer, else the profile's.
func tokenizerPath(cfg ServerConfig) string {
	if cfg.Tokenizer != "" {
		return cfg.Tokenizer
	}
	return cfg.Engine.Profile.Tokenizer
}
