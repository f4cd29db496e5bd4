package gateway

import (
	"bytes"
	"encoding/json"

	"github.com/infergate/infergate/hftokenizer"
	"github.com/infergate/infergate/jsonscan"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
)

// hfPromptTokens returns the token ids routing hashes for a pool with its
// model's own tokenizer (config tokenizers), as a vLLM engine with the same
// files computes them:
//
//   - chat: the messages and tools rendered with the tokenizer folder's
//     chat_template (add_generation_prompt and chat_template_kwargs from the
//     body; add_generation_prompt defaults to true, as vLLM's; the messages
//     preprocessed as vLLM does, hftokenizer.Chat.VLLMMessages), tokenized
//     without added special tokens (vllm/entrypoints/openai/serving_engine.py
//     tokenizes a rendered chat with add_special_tokens=False). Without a
//     template, or when it fails on the request, the gateway's canonical
//     rendering (openai.RenderChat) stands in: still the model's tokens,
//     not the engine's prompt;
//   - completion: a text prompt with the post-processor's special tokens
//     (vLLM's default add_special_tokens=True for completions); token ids
//     as given;
//   - responses: the canonical rendering of its messages.
//
// Text past maxRoutingTextBytes is cut as prefix.CutText cuts it; a chat
// is rendered only that far (hftokenizer.ChatTemplate.RenderPrefix).
func (x *exchange) hfPromptTokens(kind apiKind, p *pool) []uint32 {
	switch kind {
	case kindChat:
		text, ok := "", false
		if tpl := p.hf.Template(); tpl != nil {
			text, ok = renderChatBody(tpl, x.body)
		}
		if !ok {
			text = x.chat.Prompt()
		}
		return x.hfEncode(p.hf, text, false)
	case kindResponses:
		x.pass.msgs = x.pass.resp.AppendMessages(x.pass.msgs[:0])
		return x.hfEncode(p.hf, openai.RenderChat(x.pass.resp.Tools, x.pass.msgs), false)
	case kindCompletion:
		switch {
		case len(x.comp.Prompt.Tokens) > 0:
			return x.comp.Prompt.Tokens[0]
		case len(x.comp.Prompt.Texts) > 0:
			return x.hfEncode(p.hf, x.comp.Prompt.Texts[0], true)
		}
	}
	return nil
}

// hfEncode tokenizes at most maxRoutingTextBytes of text into x.toks. On a
// pre-tokenizer's match budget running out (hftokenizer.ErrRegexTimeout)
// the ids before it are kept: a shorter prefix to route on, never an error
// to the client.
func (x *exchange) hfEncode(t *hftokenizer.Tokenizer, text string, addSpecial bool) []uint32 {
	text, _ = prefix.CutText(text, maxRoutingTextBytes)
	x.toks, _ = t.Append(x.toks[:0], text, addSpecial)
	return x.toks
}

// renderChatBody renders the chat request body's messages and tools with
// tpl; ok is false if the body lacks messages or the template fails.
func renderChatBody(tpl *hftokenizer.ChatTemplate, body []byte) (string, bool) {
	msgs := memberValue(body, "messages")
	if msgs == nil {
		return "", false
	}
	c := hftokenizer.Chat{Messages: msgs, Tools: memberValue(body, "tools"), AddGenerationPrompt: true, VLLMMessages: true}
	if v := memberValue(body, "add_generation_prompt"); v != nil {
		c.AddGenerationPrompt = !bytes.Equal(v, []byte("false"))
	}
	if v := memberValue(body, "chat_template_kwargs"); v != nil {
		// Bounded: the body is, and its depth was checked when it was
		// decoded (request.go).
		if json.Unmarshal(v, &c.Extra) != nil {
			return "", false
		}
	}
	// One byte past what routing tokenizes, so a cut rendering is cut
	// again at a word boundary (prefix.CutText) like any long prompt; a
	// hostile chat costs no more rendering than that.
	out, _, err := tpl.RenderPrefix(c, maxRoutingTextBytes+1)
	return out, err == nil
}

// memberValue returns the raw value of the top-level member name of the
// JSON object body, nil if absent or null.
func memberValue(body []byte, name string) []byte {
	from, to, ok := jsonscan.MemberSpan(body, name)
	if !ok {
		return nil
	}
	v := body[from:to]
	i := bytes.IndexByte(v[1:], '"') // the key's closing quote (name has none to escape)
	if i < 0 {
		return nil
	}
	v = v[i+2:]
	v = bytes.TrimLeft(v, " \t\r\n")
	if len(v) == 0 || v[0] != ':' {
		return nil
	}
	v = bytes.TrimLeft(v[1:], " \t\r\n")
	if len(v) == 0 || bytes.Equal(v, []byte("null")) {
		return nil
	}
	return v
}
