package openai

import "strings"

// RenderChat renders messages canonically as one prompt string, in the
// Llama-3 chat template's layout (meta-llama/llama-models, "prompt format"):
//
//	<|begin_of_text|><|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>...
//	<|start_header_id|>assistant<|end_header_id|>\n\n
//
// The rendering of a conversation is a prefix of the rendering of any longer
// conversation that extends it with the assistant's reply and a new user
// turn, which is what makes multi-turn chats hit the prefix cache.
func RenderChat(msgs []Message) string {
	n := len("<|begin_of_text|>") + 64
	for _, m := range msgs {
		n += len(m.Content.Text) + len(m.Role) + 48
	}
	var b strings.Builder
	b.Grow(n)
	b.WriteString("<|begin_of_text|>")
	for _, m := range msgs {
		b.WriteString("<|start_header_id|>")
		b.WriteString(m.Role)
		b.WriteString("<|end_header_id|>\n\n")
		b.WriteString(m.Content.Text)
		b.WriteString("<|eot_id|>")
	}
	b.WriteString("<|start_header_id|>assistant<|end_header_id|>\n\n")
	return b.String()
}
