package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
)

// TestPassthroughRealProcesses runs `infergate serve` in front of three
// `infergate sim` processes (two serving model m with the Responses
// store on, as vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1, one serving
// model big) and drives it with the official OpenAI Go client: the
// Responses API streaming and not, a chain of previous_response_id
// continuations under round-robin (each must reach the engine that stored
// the previous response), retrieval by id, embeddings, tokenize and
// detokenize, an unknown /v1/ path relayed from the engine, and the alias
// fast = [big, m] falling back to m once big's engine is killed.
func TestPassthroughRealProcesses(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	addrRe := regexp.MustCompile(`addr=(http://[0-9.:]+)`)
	args := []string{"serve", "--listen", "127.0.0.1:0", "--policy", "round-robin"}
	for range 2 {
		s := start(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "m", "--responses-store")
		args = append(args, "--endpoint", s.await(t, addrRe)+"=m")
	}
	big := start(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "big")
	args = append(args, "--endpoint", big.await(t, addrRe)+"=big")

	dir := t.TempDir()
	const key = "sk-test-passthrough-key-0123456789"
	keys := filepath.Join(dir, "keys")
	cfg := filepath.Join(dir, "gw.yaml")
	if err := os.WriteFile(keys, []byte("alice plain:"+key+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfg, []byte("auth: {keys_file: "+keys+"}\nretry: {budget_percent: 100}\n"+
		"aliases: {fast: [big, m]}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	g := start(t, append(args, "-c", cfg)...)
	base := g.await(t, addrRe)
	defer g.stop(t)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	client := openai.NewClient(option.WithBaseURL(base+"/v1/"), option.WithAPIKey(key), option.WithMaxRetries(0))

	// Responses, not streaming, then continuations.
	r, err := client.Responses.New(ctx, responses.ResponseNewParams{
		Model: "m", Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Tell me about caches.")},
		Instructions: openai.String("Answer briefly."), MaxOutputTokens: openai.Int(8),
	})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(r.ID, "resp_") || r.OutputText() == "" || r.Usage.OutputTokens != 8 || r.Usage.InputTokens == 0 {
		t.Fatalf("response %s %q usage %+v", r.ID, r.OutputText(), r.Usage)
	}
	prev, input := r.ID, r.Usage.InputTokens
	for turn := range 4 {
		r, err := client.Responses.New(ctx, responses.ResponseNewParams{
			Model: "m", Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("And then? " + strconv.Itoa(turn))},
			PreviousResponseID: openai.String(prev), MaxOutputTokens: openai.Int(4),
		})
		if err != nil {
			t.Fatalf("continuation %d of %s: %v", turn, prev, err)
		}
		if r.Usage.InputTokens <= input || r.Usage.InputTokensDetails.CachedTokens == 0 {
			t.Errorf("continuation %d: usage %+v, want the stored turns (> %d input tokens) from the cache", turn, r.Usage, input)
		}
		prev, input = r.ID, r.Usage.InputTokens
	}

	// Streaming, continuing the conversation.
	stream := client.Responses.NewStreaming(ctx, responses.ResponseNewParams{
		Model: "m", Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Stream the rest.")},
		PreviousResponseID: openai.String(prev), MaxOutputTokens: openai.Int(5),
	})
	var types []string
	var text strings.Builder
	var final responses.Response
	for stream.Next() {
		ev := stream.Current()
		types = append(types, ev.Type)
		switch ev.Type {
		case "response.output_text.delta":
			text.WriteString(ev.Delta)
		case "response.completed":
			final = ev.Response
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("stream: %v (events %v)", err, types)
	}
	if len(types) < 4 || types[0] != "response.created" || types[len(types)-1] != "response.completed" ||
		final.OutputText() != text.String() || final.Usage.OutputTokens != 5 || final.Usage.InputTokens <= input {
		t.Fatalf("stream events %v, text %q, final %q usage %+v", types, text.String(), final.OutputText(), final.Usage)
	}
	got, err := client.Responses.Get(ctx, final.ID, responses.ResponseGetParams{})
	if err != nil || got.ID != final.ID || got.OutputText() != final.OutputText() {
		t.Fatalf("retrieve %s: %v %+v", final.ID, err, got)
	}

	// Embeddings.
	emb, err := client.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: "m",
		Input:          openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"first", "second"}},
		EncodingFormat: openai.EmbeddingNewParamsEncodingFormatFloat})
	if err != nil {
		t.Fatal(err)
	}
	if len(emb.Data) != 2 || len(emb.Data[0].Embedding) == 0 || emb.Usage.PromptTokens == 0 || emb.Model != "m" {
		t.Fatalf("embeddings: %d vectors, usage %+v, model %q", len(emb.Data), emb.Usage, emb.Model)
	}

	// The tokenizer and an unknown path, over plain HTTP.
	hc := &http.Client{Timeout: 30 * time.Second}
	call := func(path, body string) (int, string) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, b := call("/tokenize", `{"model":"m","prompt":"Hello there"}`)
	var tok struct {
		Count  int             `json:"count"`
		Tokens json.RawMessage `json:"tokens"`
	}
	if err := json.Unmarshal([]byte(b), &tok); code != 200 || err != nil || tok.Count == 0 {
		t.Fatalf("tokenize: %d %s", code, b)
	}
	if code, b := call("/detokenize", `{"model":"m","tokens":`+string(tok.Tokens)+`}`); code != 200 || b != `{"prompt":"Hello there"}` {
		t.Errorf("detokenize: %d %s", code, b)
	}
	if code, b := call("/v1/rerank", `{"model":"m","query":"q","documents":["a"]}`); code != 404 || b != `{"detail":"Not Found"}` {
		t.Errorf("unknown path: %d %s (want the engine's own 404)", code, b)
	}

	// The alias: big's engine killed, fast falls back to m.
	if err := big.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = big.cmd.Wait()
	for i := range 3 {
		cc, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "fast", MaxTokens: openai.Int(3),
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello " + strconv.Itoa(i))}})
		if err != nil {
			t.Fatalf("alias request %d: %v", i, err)
		}
		if cc.Model != "m" || cc.Usage.CompletionTokens != 3 {
			t.Fatalf("alias request %d: model %q usage %+v", i, cc.Model, cc.Usage)
		}
	}
	ar, err := client.Responses.New(ctx, responses.ResponseNewParams{Model: "fast",
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("via the alias")}, MaxOutputTokens: openai.Int(2)})
	if err != nil || ar.Model != "m" {
		t.Fatalf("responses via the alias: %v %+v", err, ar)
	}
	models, err := client.Models.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range models.Data {
		ids = append(ids, m.ID)
	}
	if strings.Join(ids, ",") != "big,fast,m" {
		t.Errorf("models: %v", ids)
	}

	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	counts := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		for _, name := range []string{"infergate_model_fallbacks_total{", "infergate_api_requests_total{"} {
			if strings.HasPrefix(l, name) {
				v, _ := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
				counts[l[:strings.LastIndexByte(l, ' ')]] += v
			}
		}
	}
	fallbacks := 0.0
	for k, v := range counts {
		if strings.HasPrefix(k, `infergate_model_fallbacks_total{alias="fast",model="big"`) {
			fallbacks += v
		}
	}
	if fallbacks != 4 {
		t.Errorf("fallbacks from big: %v, want 4 (%v)", fallbacks, counts)
	}
	for api, want := range map[string]float64{"responses": 7, "responses_by_id": 1, "embeddings": 1, "tokenize": 1, "detokenize": 1, "other": 1} {
		if got := counts[`infergate_api_requests_total{api="`+api+`"}`]; got != want {
			t.Errorf("api_requests_total{%s} = %v, want %v", api, got, want)
		}
	}
}
