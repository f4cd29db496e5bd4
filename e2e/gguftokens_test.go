package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/infergate/infergate/gguf"
	"github.com/infergate/infergate/hftokenizer"
)

// TestOllamaPromptTokensGGUF: the gateway's tokenizer read from a GGUF's
// embedded vocabulary (hftokenizer.LoadGGUF) counts every prompt as the
// real Ollama does (prompt_eval_count of a raw /api/generate: the runner's
// prompt inputs, BOS included, cached or not), on the generated tiny model
// (pre "default"), with each of Ollama's runners: the llama.cpp runner
// (what Ollama runs for a llama architecture; hftokenizer.DialectOllama →
// llama.cpp's four "default" patterns) and its Go engine
// (OLLAMA_NEW_ENGINE=1; hftokenizer.DialectOllamaEngine → GPT-2's pattern).
// The prompts hold what tells the readings apart: digit runs, punctuation
// runs, control tokens, whitespace runs, non-ASCII.
func TestOllamaPromptTokensGGUF(t *testing.T) {
	bin := RequireOllama(t)
	dir := ModelDirT(t, gguf.Options{})
	path := filepath.Join(dir, "model.gguf")
	prompts := []string{
		"Shall I compare thee to a summer's day? Thou art more lovely and more temperate:",
		"Call 1234567 or 89 now!!! -- ok?? (yes) [no] {maybe} $100 + 5% = ???",
		"<|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
		"  leading spaces,\ttabs,\n\nnewlines   and trailing   ",
		"naïve café — “quotes” 日本語 🙂 x^2 ~ y|z <tag> a==b",
		"func main() { fmt.Println(\"hi\") } // 2026-12-05T10:30:00Z",
	}
	for _, tc := range []struct {
		name    string
		legacy  bool
		dialect string
	}{{"llama.cpp runner", true, hftokenizer.DialectOllama}, {"Go engine", false, hftokenizer.DialectOllamaEngine}} {
		t.Run(tc.name, func(t *testing.T) {
			tok, err := hftokenizer.LoadGGUF(path, hftokenizer.GGUFOptions{Dialect: tc.dialect})
			if err != nil {
				t.Fatal(err)
			}
			inst := StartOllamaT(t, bin, dir, Options{LegacyRunner: tc.legacy, NumParallel: 1})
			client := &http.Client{Timeout: 2 * time.Minute}
			defer client.CloseIdleConnections()
			for _, p := range prompts {
				ids, err := tok.Encode(p, true)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := json.Marshal(map[string]any{"model": inst.Model, "prompt": p, "raw": true, "stream": false,
					"options": map[string]any{"num_predict": 1, "temperature": 0}})
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, inst.URL+"/api/generate", bytes.NewReader(body))
				resp, err := client.Do(req)
				if err != nil {
					cancel()
					t.Fatal(err)
				}
				var out struct {
					PromptEvalCount int `json:"prompt_eval_count"`
				}
				err = json.NewDecoder(resp.Body).Decode(&out)
				resp.Body.Close()
				cancel()
				if err != nil || resp.StatusCode != http.StatusOK {
					t.Fatalf("/api/generate: HTTP %d: %v", resp.StatusCode, err)
				}
				if out.PromptEvalCount != len(ids) {
					t.Errorf("%q: Ollama counted %d prompt tokens, the GGUF tokenizer %d (%v)", p, out.PromptEvalCount, len(ids), ids)
				} else {
					t.Logf("%q: %d tokens, equal", p, len(ids))
				}
			}
		})
	}
}
