package simserver

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"

	"github.com/infergate/infergate/internal/polltest"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sim"
)

const testModel = "meta-llama/Llama-3.1-70B-Instruct"

func newTestServer(t *testing.T, cfg ServerConfig) (*Server, *httptest.Server) {
	t.Helper()
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 1000
	}
	s, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(func() {
		s.Close()
		ts.Close()
	})
	return s, ts
}

func post(t *testing.T, ts *httptest.Server, path, body string) *http.Response {
	t.Helper()
	resp, err := http.Post(ts.URL+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// readStream returns the JSON payloads of an SSE response and whether it ended with [DONE].
func readStream(t *testing.T, resp *http.Response) (events [][]byte, done bool) {
	t.Helper()
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	er := openai.NewEventReader(resp.Body, 0)
	for {
		data, err := er.Next()
		if errors.Is(err, io.EOF) {
			return events, er.Done()
		}
		if err != nil {
			t.Fatal(err)
		}
		events = append(events, bytes.Clone(data))
	}
}

func decodeJSON[T any](t *testing.T, b []byte) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	return v
}

func TestStreamChat(t *testing.T) {
	_, ts := newTestServer(t, ServerConfig{})
	resp := post(t, ts, "/v1/chat/completions", `{"model":"`+testModel+`","messages":[{"role":"user","content":"Hello there"}],
		"stream":true,"stream_options":{"include_usage":true},"max_tokens":5,"ignore_eos":true}`)
	events, done := readStream(t, resp)
	if !done {
		t.Fatal("stream did not end with [DONE]")
	}
	if len(events) != 1+5+1 {
		t.Fatalf("%d events, want role + 5 tokens + usage", len(events))
	}
	first := decodeJSON[openai.ChatChunk](t, events[0])
	if first.Object != "chat.completion.chunk" || first.Choices[0].Delta.Role != "assistant" || !strings.HasPrefix(first.ID, "chatcmpl-") || first.Model != testModel {
		t.Fatalf("first chunk %s", events[0])
	}
	var text string
	for i, ev := range events[1:6] {
		c := decodeJSON[openai.ChatChunk](t, ev)
		if c.ID != first.ID || len(c.Choices) != 1 || c.Choices[0].Delta.Content == nil || c.Usage != nil {
			t.Fatalf("token chunk %s", ev)
		}
		text += *c.Choices[0].Delta.Content
		if last := i == 4; last != (c.Choices[0].FinishReason != nil && *c.Choices[0].FinishReason == "length") {
			t.Fatalf("finish_reason on chunk %d: %s", i, ev)
		}
	}
	if n := len(strings.Fields(text)); n != 5 {
		t.Fatalf("text %q has %d words, want 5", text, n)
	}
	u := decodeJSON[openai.ChatChunk](t, events[6])
	if u.Choices == nil || len(u.Choices) != 0 || u.Usage == nil || u.Usage.PromptTokensDetails == nil {
		t.Fatalf("usage chunk %s", events[6])
	}
	if u.Usage.CompletionTokens != 5 || u.Usage.PromptTokens == 0 || u.Usage.TotalTokens != u.Usage.PromptTokens+5 {
		t.Fatalf("usage %+v", u.Usage)
	}
	if !bytes.Contains(events[6], []byte(`"choices":[]`)) || !bytes.Contains(events[6], []byte(`"cached_tokens":`)) {
		t.Fatalf("usage chunk must carry an empty choices array and cached_tokens: %s", events[6])
	}
}

func TestStreamCompletionTokenPrompts(t *testing.T) {
	_, ts := newTestServer(t, ServerConfig{})
	for _, prompt := range []string{`[1, 2, 3, 4, 5, 6, 7]`, `[[1, 2, 3, 4, 5, 6, 7]]`, `"seven tokens or so of text"`, `["one string"]`} {
		resp := post(t, ts, "/v1/completions", `{"model":"`+testModel+`","prompt":`+prompt+`,"stream":true,"stream_options":{"include_usage":true},"max_tokens":3}`)
		events, done := readStream(t, resp)
		if !done || len(events) != 4 {
			t.Fatalf("prompt %s: %d events, done=%v", prompt, len(events), done)
		}
		for _, ev := range events[:3] {
			c := decodeJSON[openai.Completion](t, ev)
			if c.Object != "text_completion" || len(c.Choices) != 1 || c.Choices[0].Text == "" {
				t.Fatalf("chunk %s", ev)
			}
		}
		u := decodeJSON[openai.Completion](t, events[3])
		if u.Usage == nil || u.Usage.CompletionTokens != 3 || len(u.Choices) != 0 {
			t.Fatalf("usage chunk %s", events[3])
		}
		if prompt[0] == '[' && prompt[1] != '"' && u.Usage.PromptTokens != 7 {
			t.Fatalf("token prompt %s: prompt_tokens %d", prompt, u.Usage.PromptTokens)
		}
	}
	// Without include_usage there is no usage chunk.
	events, done := readStream(t, post(t, ts, "/v1/completions", `{"model":"`+testModel+`","prompt":[9,9,9],"stream":true,"max_tokens":2}`))
	if !done || len(events) != 2 {
		t.Fatalf("%d events without include_usage", len(events))
	}
}

func TestNonStreaming(t *testing.T) {
	_, ts := newTestServer(t, ServerConfig{})
	resp := post(t, ts, "/v1/chat/completions", `{"model":"`+testModel+`","messages":[{"role":"user","content":"Hi"}],"max_completion_tokens":4}`)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	chat := decodeJSON[openai.ChatCompletion](t, body)
	if resp.StatusCode != 200 || chat.Object != "chat.completion" || len(chat.Choices) != 1 || chat.Usage == nil {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if c := chat.Choices[0]; c.Message.Role != "assistant" || len(strings.Fields(c.Message.Content)) != 4 || *c.FinishReason != "length" {
		t.Fatalf("choice %+v", c)
	}
	if !bytes.Contains(body, []byte(`"prompt_tokens_details":{"cached_tokens":0}`)) {
		t.Fatalf("usage must always report cached_tokens: %s", body)
	}

	resp = post(t, ts, "/v1/completions", `{"model":"`+testModel+`","prompt":"Once upon a time"}`)
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	cmpl := decodeJSON[openai.Completion](t, body)
	if cmpl.Object != "text_completion" || cmpl.Usage.CompletionTokens != DefaultMaxTokens || len(strings.Fields(cmpl.Choices[0].Text)) != DefaultMaxTokens {
		t.Fatalf("completion %s", body)
	}
}

// histogram returns the sample count and sum of a histogram on the server's registry.
func histogram(t *testing.T, s *Server, name string) (uint64, float64) {
	t.Helper()
	mfs, err := s.metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			h := mf.GetMetric()[0].GetHistogram()
			return h.GetSampleCount(), h.GetSampleSum()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0, 0
}

func chatUsage(t *testing.T, ts *httptest.Server, msgs []openai.Message, maxTokens int) (openai.Usage, string) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": testModel, "messages": msgs, "max_tokens": maxTokens})
	resp := post(t, ts, "/v1/chat/completions", string(body))
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	c := decodeJSON[openai.ChatCompletion](t, b)
	return *c.Usage, c.Choices[0].Message.Content
}

func TestPrefixCacheOverHTTP(t *testing.T) {
	s, ts := newTestServer(t, ServerConfig{})
	system := strings.Repeat("You are a careful assistant who answers questions about the sonnets. ", 300)
	msgs := func(q string) []openai.Message {
		return []openai.Message{{Role: "system", Content: openai.Content{Text: system}}, {Role: "user", Content: openai.Content{Text: q}}}
	}
	u1, _ := chatUsage(t, ts, msgs("What is the first sonnet about?"), 2)
	_, ttft1 := histogram(t, s, "vllm:time_to_first_token_seconds")
	u2, _ := chatUsage(t, ts, msgs("And the second one?"), 2)
	n, sum := histogram(t, s, "vllm:time_to_first_token_seconds")
	ttft2 := sum - ttft1
	if u1.Cached() != 0 || u2.Cached() < 3000 || u2.Cached() >= u2.PromptTokens {
		t.Fatalf("cached tokens %d then %d of %d", u1.Cached(), u2.Cached(), u2.PromptTokens)
	}
	if n != 2 || !(ttft2 < ttft1/3) {
		t.Fatalf("simulated TTFT %.4fs then %.4fs: a prefix hit must be much faster", ttft1, ttft2)
	}
	t.Logf("prompt %d tokens: TTFT cold %.1f ms, warm %.1f ms (%d cached)", u2.PromptTokens, ttft1*1e3, ttft2*1e3, u2.Cached())

	// Multi-turn: the next turn re-sends the reply, whose tokens are cached too.
	first := msgs("Tell me a story.")
	u3, reply := chatUsage(t, ts, first, 64)
	next := append(first, openai.Message{Role: "assistant", Content: openai.Content{Text: reply}},
		openai.Message{Role: "user", Content: openai.Content{Text: "Go on."}})
	u4, _ := chatUsage(t, ts, next, 1)
	if min := u3.PromptTokens + 64 - 16; u4.Cached() < min {
		t.Fatalf("second turn cached %d tokens, want >= %d (prompt %d + reply 64, less a block)", u4.Cached(), min, u3.PromptTokens)
	}
	st := s.Stats()
	if st.PrefixHits == 0 || st.PrefixQueries == 0 || st.Running != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestErrors(t *testing.T) {
	_, ts := newTestServer(t, ServerConfig{})
	cases := []struct {
		path, body string
		status     int
		param      string
	}{
		{"/v1/chat/completions", `{"model":`, 400, ""},
		{"/v1/chat/completions", `not json`, 400, ""},
		{"/v1/chat/completions", `{"model":"gpt-4","messages":[{"role":"user","content":"x"}]}`, 404, "model"},
		{"/v1/chat/completions", `{"model":"` + testModel + `","messages":[]}`, 400, "messages"},
		{"/v1/chat/completions", `{"model":"` + testModel + `","messages":[{"role":"user","content":"x"}],"n":2}`, 400, "n"},
		{"/v1/completions", `{"model":"` + testModel + `","prompt":["a","b"]}`, 400, "prompt"},
		{"/v1/completions", `{"model":"` + testModel + `","prompt":[1,2,300000]}`, 400, "prompt"},
		{"/v1/completions", `{"model":"` + testModel + `","prompt":[1,2],"max_tokens":200000}`, 400, ""},
		{"/v1/completions", `{"model":"` + testModel + `","prompt":"x","max_tokens":0}`, 400, "max_tokens"},
		{"/v1/completions", `{"model":"` + testModel + `","prompt":"x","max_tokens":9223372036854775807}`, 400, ""},
		{"/v1/chat/completions", `{"model":"` + testModel + `","messages":[{"role":"user","content":"x"}],"max_completion_tokens":9223372036854775805}`, 400, ""},
		{"/v1/completions", `{"model":"` + testModel + `","prompt":"x","padding":"` + strings.Repeat("x", MaxRequestBytes) + `"}`, 413, ""},
		// The nesting attack (openai.MaxDepth): a 400, not a stack overflow.
		{"/v1/chat/completions", `{"model":"` + testModel + `","messages":[{"role":"user","content":"x"}],"x":` + strings.Repeat("[", 1<<20) + `}`, 400, ""},
		{"/v1/completions", `{"model":"` + testModel + `","prompt":` + strings.Repeat("[", 1<<20) + `}`, 400, ""},
	}
	for _, c := range cases {
		resp := post(t, ts, c.path, c.body)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var er openai.ErrorResponse
		if err := json.Unmarshal(b, &er); err != nil || er.Error == nil || er.Error.Message == "" || er.Error.Type == "" {
			t.Errorf("%.60s: body %s is not an OpenAI error", c.body, b)
			continue
		}
		if resp.StatusCode != c.status {
			t.Errorf("%.60s: status %d, want %d (%s)", c.body, resp.StatusCode, c.status, b)
		}
		if c.param != "" && (er.Error.Param == nil || *er.Error.Param != c.param) {
			t.Errorf("%.60s: param %v, want %q", c.body, er.Error.Param, c.param)
		}
	}
	// A tiny cache rejects a prompt it could never hold.
	_, small := newTestServer(t, ServerConfig{Engine: sim.Config{NumBlocks: 4}})
	resp := post(t, small, "/v1/completions", `{"model":"`+testModel+`","prompt":"`+strings.Repeat("word ", 100)+`","max_tokens":1}`)
	resp.Body.Close()
	if resp.StatusCode != 400 {
		t.Fatalf("prompt over KV capacity: status %d", resp.StatusCode)
	}
}

// waitFor waits until cond holds (polltest.Until: a minute at most).
var waitFor = polltest.Until

func TestClientCancelAborts(t *testing.T) {
	s, ts := newTestServer(t, ServerConfig{TimeScale: 1}) // ~20 ms per token: 1000 tokens outlast the test
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL+"/v1/completions",
		strings.NewReader(`{"model":"`+testModel+`","prompt":"Count to a thousand","stream":true,"max_tokens":1000}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	er := openai.NewEventReader(resp.Body, 0)
	if _, err := er.Next(); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Running != 1 {
		t.Fatalf("running %d, want 1", st.Running)
	}
	cancel()
	resp.Body.Close()
	waitFor(t, "the engine to drop the request", func() bool {
		st := s.Stats()
		return st.Running == 0 && st.Waiting == 0 && st.KVUsage == 0
	})
}

func TestCloseFailsInFlightWithoutLeaks(t *testing.T) {
	before := runtime.NumGoroutine()
	s, err := NewServer(ServerConfig{TimeScale: 1})
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	ts := httptest.NewServer(s.Handler())
	client := ts.Client()

	resp, err := client.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(
		`{"model":"`+testModel+`","messages":[{"role":"user","content":"Go"}],"stream":true,"max_tokens":1000}`))
	if err != nil {
		t.Fatal(err)
	}
	er := openai.NewEventReader(resp.Body, 0)
	if _, err := er.Next(); err != nil { // the role chunk: the request is running
		t.Fatal(err)
	}
	nonStream := make(chan int)
	go func() {
		r, err := client.Post(ts.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"`+testModel+`","prompt":"x","max_tokens":1000}`))
		if err != nil {
			nonStream <- -1
			return
		}
		r.Body.Close()
		nonStream <- r.StatusCode
	}()
	waitFor(t, "two running requests", func() bool { return s.Stats().Running == 2 })

	s.Close()
	var last []byte
	for {
		data, err := er.Next()
		if err != nil {
			break
		}
		last = bytes.Clone(data)
	}
	resp.Body.Close()
	if !er.Done() || !bytes.Contains(last, []byte(`"error"`)) {
		t.Fatalf("stream after Close: last event %s, done=%v", last, er.Done())
	}
	if code := <-nonStream; code != http.StatusServiceUnavailable {
		t.Fatalf("non-streaming request after Close: %d", code)
	}
	if r := post(t, ts, "/v1/completions", `{"model":"`+testModel+`","prompt":"x"}`); r.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("request after Close: %d", r.StatusCode)
	} else {
		r.Body.Close()
	}
	s.Close() // idempotent
	client.CloseIdleConnections()
	http.DefaultClient.CloseIdleConnections()
	ts.Close()
	waitFor(t, fmt.Sprintf("goroutines to return to %d", before), func() bool { return runtime.NumGoroutine() <= before })
}

func TestModelsHealthMetrics(t *testing.T) {
	s, ts := newTestServer(t, ServerConfig{})
	get := func(path string) (int, string) {
		resp, err := http.Get(ts.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := get("/health"); code != 200 {
		t.Fatalf("/health %d", code)
	}
	code, body := get("/v1/models")
	ml := decodeJSON[openai.ModelList](t, []byte(body))
	if code != 200 || ml.Object != "list" || len(ml.Data) != 1 || ml.Data[0].ID != testModel || ml.Data[0].OwnedBy != "vllm" || ml.Data[0].MaxModelLen != 131072 {
		t.Fatalf("/v1/models %d %s", code, body)
	}
	// One request so histograms have samples.
	events, _ := readStream(t, post(t, ts, "/v1/completions", `{"model":"`+testModel+`","prompt":[1,2,3],"stream":true,"max_tokens":3}`))
	if len(events) != 3 {
		t.Fatalf("%d events", len(events))
	}
	_, body = get("/metrics")
	for _, name := range []string{
		"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
		"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
		"vllm:generation_tokens_total", "vllm:num_preemptions_total",
		"vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
		"vllm:e2e_request_latency_seconds_bucket", "vllm:cache_config_info",
	} {
		if !strings.Contains(body, "\n"+name+"{") {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	cfg := s.EngineConfig()
	for _, want := range []string{
		`model_name="` + testModel + `"`, `engine="0"`, `block_size="16"`,
		fmt.Sprintf(`num_gpu_blocks="%d"`, cfg.NumBlocks), `enable_prefix_caching="True"`, `gpu_memory_utilization="0.9"`,
		`vllm:generation_tokens_total{engine="0",model_name="` + testModel + `"} 3`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	mf := gatherOne(t, s, "vllm:inter_token_latency_seconds")
	if h := mf.GetMetric()[0].GetHistogram(); h.GetSampleCount() != 2 || h.GetSampleSum() <= 0 {
		t.Errorf("ITL histogram: %d samples, sum %v", h.GetSampleCount(), h.GetSampleSum())
	}
}

func gatherOne(t *testing.T, s *Server, name string) *dto.MetricFamily {
	t.Helper()
	mfs, err := s.metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf
		}
	}
	t.Fatalf("no metric %s", name)
	return nil
}

func TestServerConfigErrors(t *testing.T) {
	if _, err := NewServer(ServerConfig{TimeScale: -1}); err == nil {
		t.Error("negative time scale accepted")
	}
	p := sim.DefaultProfile()
	p.TensorParallel = 1
	if _, err := NewServer(ServerConfig{Engine: sim.Config{Profile: p}}); err == nil {
		t.Error("a model that does not fit was accepted")
	}
	s, err := NewServer(ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if s.Model() != testModel {
		t.Errorf("default model %q", s.Model())
	}
	rec := httptest.NewRecorder()
	s.Handler().ServeHTTP(rec, httptest.NewRequest("POST", "/v1/completions", strings.NewReader(`{"model":"`+testModel+`","prompt":"x"}`)))
	if rec.Code != http.StatusServiceUnavailable {
		t.Errorf("request before Start: %d", rec.Code)
	}
	s.Close() // before Start: must not hang
	s.Start() // after Close: does nothing
}

func TestFleet(t *testing.T) {
	before := runtime.NumGoroutine()
	f, err := StartFleet(3, ServerConfig{TimeScale: 1000, Engine: sim.Config{NumBlocks: 500}})
	if err != nil {
		t.Fatal(err)
	}
	if len(f.URLs) != 3 || f.KVBlocks() != 500 || f.BlockSize() != 16 {
		t.Fatalf("fleet %v, %d blocks of %d", f.URLs, f.KVBlocks(), f.BlockSize())
	}
	client := &http.Client{}
	var texts, ids []string
	for _, u := range f.URLs {
		resp, err := client.Post(u+"/v1/completions", "application/json", strings.NewReader(`{"model":"`+testModel+`","prompt":"Same prompt","max_tokens":8}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		c := decodeJSON[openai.Completion](t, b)
		texts = append(texts, c.Choices[0].Text)
		ids = append(ids, c.ID)
	}
	if texts[0] != texts[1] || texts[1] != texts[2] || ids[0] == ids[1] || ids[1] == ids[2] {
		t.Fatalf("replicas: texts %q, ids %q", texts, ids)
	}
	f.Close()
	f.Close()
	client.CloseIdleConnections()
	waitFor(t, "fleet goroutines to exit", func() bool { return runtime.NumGoroutine() <= before })
	if _, err := StartFleet(0, ServerConfig{}); err == nil {
		t.Fatal("empty fleet accepted")
	}
}
