package gguf

import (
	"fmt"
	"path/filepath"
	"strings"
)

// ChatTemplate is a Llama-3-style chat template in Ollama's Go-template
// syntax: each message is "<|start_header_id|>ROLE<|end_header_id|>\n\n
// CONTENT<|eot_id|>", and the prompt ends with an open assistant header. The
// tokenizer adds <|begin_of_text|> itself (add_bos_token). A conversation that
// grows by appending messages renders to a string that extends the previous
// one, so engines can reuse the cached prefix.
const ChatTemplate = `{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- end }}<|start_header_id|>assistant<|end_header_id|>

`

// DefaultNumCtx is the per-sequence context the Modelfile asks for.
const DefaultNumCtx = 4096

// Modelfile returns an Ollama Modelfile for a model written by Generate.
// ggufFile is the GGUF file's path as seen from the Modelfile's directory
// (Ollama resolves FROM relative to it); "" means "model.gguf". The model
// runs on one thread (essential when several instances share a small
// machine), with a 4096-token context per sequence and <|eot_id|> as stop.
func Modelfile(ggufFile string) string {
	if ggufFile == "" {
		ggufFile = "model.gguf"
	}
	if !filepath.IsAbs(ggufFile) && !strings.HasPrefix(ggufFile, "./") && !strings.HasPrefix(ggufFile, "../") {
		ggufFile = "./" + ggufFile
	}
	var b strings.Builder
	fmt.Fprintf(&b, "FROM %s\n", ggufFile)
	fmt.Fprintf(&b, "TEMPLATE \"\"\"%s\"\"\"\n", ChatTemplate)
	fmt.Fprintf(&b, "PARAMETER num_thread 1\n")
	fmt.Fprintf(&b, "PARAMETER num_ctx %d\n", DefaultNumCtx)
	fmt.Fprintf(&b, "PARAMETER stop %q\n", EndOfTurn)
	fmt.Fprintf(&b, "PARAMETER stop %q\n", EndOfText)
	return b.String()
}
