package openai

import (
	"bytes"
	"encoding/json"
	"strings"
	"unsafe"
)

// RenderChat renders a chat request canonically as one prompt string, in the
// Llama-3 chat template's layout (meta-llama/llama-models, "prompt format"):
//
//	<|begin_of_text|>[<|start_header_id|>tools<|end_header_id|>\n\nTOOLS<|eot_id|>]
//	<|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT[TOOL_CALLS]<|eot_id|>...
//	<|start_header_id|>assistant<|end_header_id|>\n\n
//
// TOOLS is the request's "tools" array and TOOL_CALLS an assistant message's
// "tool_calls", both as compact JSON, so an agent's tool definitions and call
// history count as prompt tokens and as shared prefix. The rendering of a
// conversation is a prefix of the rendering of any longer conversation that
// extends it with the assistant's reply and a new turn, which is what makes
// multi-turn chats hit the prefix cache. It is not the served model's own
// template: engines render with theirs; the gateway only needs a stable,
// prefix-preserving rendering to hash.
func RenderChat(tools json.RawMessage, msgs []Message) string {
	n := len("<|begin_of_text|>") + 64 + len(tools)
	for _, m := range msgs {
		n += len(m.Content.Text) + len(m.Role) + len(m.ToolCalls) + 48
	}
	var b strings.Builder
	b.Grow(n)
	b.WriteString("<|begin_of_text|>")
	if present(tools) {
		b.WriteString("<|start_header_id|>tools<|end_header_id|>\n\n")
		writeCompact(&b, tools)
		b.WriteString("<|eot_id|>")
	}
	for _, m := range msgs {
		b.WriteString("<|start_header_id|>")
		b.WriteString(m.Role)
		b.WriteString("<|end_header_id|>\n\n")
		b.WriteString(m.Content.Text)
		if present(m.ToolCalls) {
			writeCompact(&b, m.ToolCalls)
		}
		b.WriteString("<|eot_id|>")
	}
	b.WriteString("<|start_header_id|>assistant<|end_header_id|>\n\n")
	return b.String()
}

func present(raw json.RawMessage) bool {
	return len(raw) > 0 && string(raw) != "null"
}

// writeCompact writes raw JSON without insignificant whitespace, so the same
// tools sent with different formatting render (and hash) the same.
func writeCompact(b *strings.Builder, raw json.RawMessage) {
	var buf bytes.Buffer
	if json.Compact(&buf, raw) != nil {
		b.Write(raw)
		return
	}
	b.Write(buf.Bytes())
}

// AppendChatSegments renders the same text as RenderChat, cut into
// segments — the prefix with the tools block, one per message, and the
// closing assistant header — appended to dst in order; their concatenation
// is RenderChat's result. Segments let a caller tokenize (and cache) each
// message on its own: an earlier turn or a system prompt repeated by every
// request renders to the same segment every time.
func AppendChatSegments(dst []string, tools json.RawMessage, msgs []Message) []string {
	return appendChatSegments(dst, tools, msgs)
}

// chatOpen and chatClose are the segments every chat starts and ends
// with when it has no tools.
const (
	chatOpen  = "<|begin_of_text|>"
	chatClose = "<|start_header_id|>assistant<|end_header_id|>\n\n"
)

// AppendChatSegmentsIn is AppendChatSegments with the messages' segments
// rendered into buf (its capacity reused) instead of a string each: the
// strings appended to dst share buf's bytes, so they are valid only until
// buf is written again, and whoever keeps one must copy it
// (prefix.SegmentCache keeps none: it keys long segments by hash and
// copies the short ones it stores). It returns buf as grown. A chat with
// tools or tool calls is rendered by AppendChatSegments (buf unused). The
// segments are AppendChatSegments' (TestAppendChatSegmentsIn). A 400-token
// chat's two messages cost the endpoint picker 2.3 KB of strings a
// request before (gateway/README.md "Endpoint picker").
func AppendChatSegmentsIn(buf []byte, dst []string, tools json.RawMessage, msgs []Message) ([]byte, []string) {
	if present(tools) {
		return buf, appendChatSegments(dst, tools, msgs)
	}
	n := 0
	for _, m := range msgs {
		if present(m.ToolCalls) {
			return buf, appendChatSegments(dst, tools, msgs)
		}
		n += len(m.Content.Text) + len(m.Role) + len(chatHeaderOpen+chatHeaderClose+chatEOT)
	}
	if cap(buf) < n {
		buf = make([]byte, 0, n)
	}
	buf = buf[:0]
	dst = append(dst, chatOpen)
	for _, m := range msgs {
		from := len(buf)
		buf = append(buf, chatHeaderOpen...)
		buf = append(buf, m.Role...)
		buf = append(buf, chatHeaderClose...)
		buf = append(buf, m.Content.Text...)
		buf = append(buf, chatEOT...)
		// buf never grows past n: the strings stay on its bytes.
		dst = append(dst, unsafe.String(&buf[from], len(buf)-from))
	}
	return buf, append(dst, chatClose)
}

// The pieces of a message's segment.
const (
	chatHeaderOpen  = "<|start_header_id|>"
	chatHeaderClose = "<|end_header_id|>\n\n"
	chatEOT         = "<|eot_id|>"
)

func appendChatSegments(dst []string, tools json.RawMessage, msgs []Message) []string {
	var b strings.Builder
	b.WriteString("<|begin_of_text|>")
	if present(tools) {
		b.WriteString("<|start_header_id|>tools<|end_header_id|>\n\n")
		writeCompact(&b, tools)
		b.WriteString("<|eot_id|>")
	}
	dst = append(dst, b.String())
	for _, m := range msgs {
		var b strings.Builder
		b.Grow(len(m.Content.Text) + len(m.Role) + len(m.ToolCalls) + 48)
		b.WriteString("<|start_header_id|>")
		b.WriteString(m.Role)
		b.WriteString("<|end_header_id|>\n\n")
		b.WriteString(m.Content.Text)
		if present(m.ToolCalls) {
			writeCompact(&b, m.ToolCalls)
		}
		b.WriteString("<|eot_id|>")
		dst = append(dst, b.String())
	}
	return append(dst, "<|start_header_id|>assistant<|end_header_id|>\n\n")
}
