package e2e

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/infergate/infergate/gguf"
)

// TestOllamaSmoke runs one real Ollama instance on the generated tiny model:
// streaming and non-streaming chat completions, then the time to first token
// of a ~2,000-token prompt, cold and as a follow-up that shares it (prefix
// cache hit). Skips when no Ollama binary is available unless
// INFERGATE_E2E_REQUIRE=1.
func TestOllamaSmoke(t *testing.T) {
	if testing.Short() && os.Getenv(EnvRequire) != "1" {
		t.Skip("skipping Ollama end-to-end test in -short mode")
	}
	bin := RequireOllama(t)
	t.Logf("ollama binary: %s", bin)

	dir := t.TempDir()
	genStart := time.Now()
	model, err := WriteModelDir(dir, gguf.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("model: %d params, %d tokens, generated in %v", model.Params(), len(model.Vocab.Tokens), time.Since(genStart).Round(time.Millisecond))

	inst := StartOllamaT(t, bin, dir, Options{})
	t.Logf("instance %s pid %d: ready in %v, create %v, load+1 token %v",
		inst.Addr, inst.Pid(), inst.StartupTime.Round(time.Millisecond), inst.CreateTime.Round(time.Millisecond), inst.LoadTime.Round(time.Millisecond))
	if procs := GroupAlive(inst.Pid()); len(procs) < 2 {
		t.Errorf("expected server and runner in process group %d, found %v", inst.Pid(), procs)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	// Plain endpoints.
	if body := get(t, inst.URL+"/"); !strings.Contains(body, "Ollama is running") {
		t.Errorf("GET / = %q", body)
	}
	if body := get(t, inst.URL+"/v1/models"); !strings.Contains(body, `"tiny`) {
		t.Errorf("/v1/models lacks the model: %s", body)
	}

	short := []Message{{Role: "user", Content: "What is the capital of France?"}}
	res, err := inst.Chat(ctx, ChatRequest{Messages: short, MaxTokens: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("non-streaming: %v, prompt %d tokens, completion %d, finish %q, text %q",
		res.Total.Round(time.Millisecond), res.PromptTokens, res.CompletionTokens, res.FinishReason, res.Text)
	if res.PromptTokens < 5 || res.CompletionTokens < 1 || res.CompletionTokens > 8 || res.FinishReason == "" {
		t.Errorf("non-streaming usage/finish: %+v", res)
	}
	if want := len(model.Vocab.Tokenize(RenderPrompt(short), true)); res.PromptTokens != want {
		t.Errorf("engine counted %d prompt tokens, gguf.Vocab.Tokenize %d", res.PromptTokens, want)
	}

	res, err = inst.Chat(ctx, ChatRequest{Messages: short, MaxTokens: 8, Stream: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("streaming: ttft %v total %v, %d events, prompt %d tokens, completion %d, finish %q, text %q",
		res.TTFT.Round(time.Millisecond), res.Total.Round(time.Millisecond), res.Chunks, res.PromptTokens, res.CompletionTokens, res.FinishReason, res.Text)
	if res.Chunks < 1 || res.PromptTokens < 5 || res.CompletionTokens < 1 || res.CompletionTokens > 8 || res.FinishReason == "" {
		t.Errorf("streaming usage/finish: %+v", res)
	}

	// Prefix caching: TTFT of a long prompt cold, then of a follow-up turn
	// that starts with the same tokens. Two rounds with different prompts.
	var coldSum, warmSum time.Duration
	for round := 0; round < 2; round++ {
		prompt := longPrompt(model.Vocab, 2000, round)
		first := []Message{{Role: "user", Content: prompt}}
		cold, err := inst.Chat(ctx, ChatRequest{Messages: first, MaxTokens: 4, Stream: true})
		if err != nil {
			t.Fatal(err)
		}
		follow := append(first, Message{Role: "assistant", Content: cold.Text}, Message{Role: "user", Content: "Please go on."})
		warm, err := inst.Chat(ctx, ChatRequest{Messages: follow, MaxTokens: 4, Stream: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("round %d: prompt %d tokens: cold TTFT %v; follow-up (%d tokens, shares the prompt) TTFT %v; ratio %.1fx",
			round, cold.PromptTokens, cold.TTFT.Round(time.Millisecond), warm.PromptTokens, warm.TTFT.Round(time.Millisecond),
			float64(cold.TTFT)/float64(max(warm.TTFT, time.Microsecond)))
		// The engine tokenizes exactly like gguf.Vocab (same merges and
		// pre-tokenizer), so prompt token counts are predictable.
		if want := len(model.Vocab.Tokenize(RenderPrompt(first), true)); cold.PromptTokens != want {
			t.Errorf("engine counted %d prompt tokens, gguf.Vocab.Tokenize %d", cold.PromptTokens, want)
		}
		if want := len(model.Vocab.Tokenize(RenderPrompt(follow), true)); warm.PromptTokens != want {
			t.Errorf("engine counted %d follow-up tokens, gguf.Vocab.Tokenize %d", warm.PromptTokens, want)
		}
		if cold.PromptTokens < 1500 || cold.PromptTokens > 3000 {
			t.Errorf("long prompt is %d tokens, want ~2000", cold.PromptTokens)
		}
		if warm.PromptTokens <= cold.PromptTokens {
			t.Errorf("follow-up has %d prompt tokens, not more than %d", warm.PromptTokens, cold.PromptTokens)
		}
		coldSum += cold.TTFT
		warmSum += warm.TTFT
	}
	if warmSum >= coldSum/3 {
		t.Errorf("prefix cache not effective: warm TTFT total %v >= cold total %v / 3", warmSum, coldSum)
	}

	// Stop leaves nothing running.
	pid := inst.Pid()
	if err := inst.Stop(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-inst.Exited():
	default:
		t.Fatal("server still running after Stop")
	}
	if procs := GroupAlive(pid); len(procs) != 0 {
		t.Fatalf("processes left in group %d: %v", pid, procs)
	}
	if _, err := os.Stat(inst.Dir); !os.IsNotExist(err) {
		t.Errorf("instance dir %s not removed", inst.Dir)
	}
}

// longPrompt builds a prompt of about n tokens (by the model's own
// tokenizer) from the tokenizer's training text, starting at a different
// place for each variant so prompts do not share a prefix.
func longPrompt(v *gguf.Vocab, n, variant int) string {
	words := strings.Fields(string(gguf.DefaultCorpus()))
	off := (variant * 397) % len(words)
	var b strings.Builder
	for k := 0; ; k++ {
		if k%200 == 0 && len(v.Encode(b.String())) >= n {
			break
		}
		if k > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(words[(off+k)%len(words)])
	}
	return b.String()
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d %s", url, resp.StatusCode, b)
	}
	return string(b)
}

// TestGroupAliveAndBinaryLookup checks the helpers that need no Ollama.
func TestGroupAliveAndBinaryLookup(t *testing.T) {
	if pids := GroupAlive(syscall.Getpgrp()); !slices.Contains(pids, os.Getpid()) {
		t.Errorf("GroupAlive(own group) = %v, lacks pid %d", pids, os.Getpid())
	}
	if got := GroupAlive(1 << 30); len(got) != 0 {
		t.Errorf("GroupAlive(bogus) = %v", got)
	}
	t.Setenv(EnvOllama, filepath.Join(t.TempDir(), "missing"))
	if _, err := OllamaBinary(); err == nil {
		t.Error("missing INFERGATE_OLLAMA accepted")
	}
	if !strings.HasSuffix(CachedOllamaPath(), filepath.Join("ollama", OllamaVersion+"-"+OllamaMarch, "ollama")) {
		t.Errorf("CachedOllamaPath() = %s", CachedOllamaPath())
	}
}
