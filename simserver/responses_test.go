package simserver

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"strings"
	"testing"

	"github.com/infergate/infergate/openai"
)

// respBody is the part of a Responses answer the tests read.
type respBody struct {
	ID                 string                `json:"id"`
	Object             string                `json:"object"`
	Model              string                `json:"model"`
	Status             string                `json:"status"`
	PreviousResponseID *string               `json:"previous_response_id"`
	MaxOutputTokens    int                   `json:"max_output_tokens"`
	Output             []outputMessage       `json:"output"`
	Usage              *openai.ResponseUsage `json:"usage"`
}

func readJSON[T any](t *testing.T, resp *http.Response, status int) T {
	t.Helper()
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != status {
		t.Fatalf("status %d, want %d: %s", resp.StatusCode, status, b)
	}
	return decodeJSON[T](t, b)
}

func TestResponsesNonStreaming(t *testing.T) {
	_, ts := newTestServer(t, ServerConfig{ResponsesStore: true})
	r := readJSON[respBody](t, post(t, ts, "/v1/responses",
		`{"model":"`+testModel+`","input":"Tell me a story","instructions":"Be brief.","max_output_tokens":5}`), 200)
	if !strings.HasPrefix(r.ID, "resp_") || len(r.ID) != len("resp_")+32 || r.Object != "response" || r.Status != "completed" ||
		r.Model != testModel || r.MaxOutputTokens != 5 || r.PreviousResponseID != nil {
		t.Fatalf("response %+v", r)
	}
	if len(r.Output) != 1 || r.Output[0].Type != "message" || r.Output[0].Role != "assistant" || !strings.HasPrefix(r.Output[0].ID, "msg_") ||
		len(r.Output[0].Content) != 1 || r.Output[0].Content[0].Type != "output_text" || r.Output[0].Content[0].Text == "" {
		t.Fatalf("output %+v", r.Output)
	}
	u := r.Usage
	if u == nil || u.OutputTokens != 5 || u.InputTokens <= 0 || u.TotalTokens != u.InputTokens+5 || u.InputTokensDetails == nil {
		t.Fatalf("usage %+v", u)
	}

	// The continuation's prompt is the stored conversation, its output and
	// the new input: longer, and its prefix is in the cache.
	next := readJSON[respBody](t, post(t, ts, "/v1/responses",
		`{"model":"`+testModel+`","input":"And then?","previous_response_id":"`+r.ID+`","max_output_tokens":3}`), 200)
	if next.PreviousResponseID == nil || *next.PreviousResponseID != r.ID || next.Usage.InputTokens <= u.InputTokens+u.OutputTokens {
		t.Fatalf("continuation %+v usage %+v (first %+v)", next, next.Usage, u)
	}
	if c := next.Usage.InputTokensDetails.CachedTokens; c < 16 {
		t.Errorf("continuation cached %d tokens, want the stored conversation's blocks", c)
	}

	// Retrieval, cancel, unknown ids.
	got := readJSON[respBody](t, mustGet(t, ts.URL+"/v1/responses/"+r.ID), 200)
	if got.ID != r.ID || got.Output[0].Content[0].Text != r.Output[0].Content[0].Text {
		t.Errorf("retrieved %+v", got)
	}
	if e := readJSON[openai.ErrorResponse](t, post(t, ts, "/v1/responses/"+r.ID+"/cancel", ``), 400); e.Error.Message != "Cannot cancel a synchronous response." {
		t.Errorf("cancel: %+v", e.Error)
	}
	for _, resp := range []*http.Response{
		post(t, ts, "/v1/responses", `{"model":"`+testModel+`","input":"x","previous_response_id":"resp_nope"}`),
		mustGet(t, ts.URL+"/v1/responses/resp_nope"),
	} {
		e := readJSON[openai.ErrorResponse](t, resp, 404)
		if e.Error.Message != "Response with id 'resp_nope' not found." || e.Error.Code != float64(404) || e.Error.Type != "invalid_request_error" {
			t.Errorf("unknown id: %+v", e.Error)
		}
	}
	// store: false is not stored.
	ns := readJSON[respBody](t, post(t, ts, "/v1/responses", `{"input":"hi","store":false,"max_output_tokens":2}`), 200)
	readJSON[openai.ErrorResponse](t, mustGet(t, ts.URL+"/v1/responses/"+ns.ID), 404)
	if ns.Model != testModel {
		t.Errorf("an absent model is the served one: %q", ns.Model)
	}
	// The client's request_id names the response.
	if c := readJSON[respBody](t, post(t, ts, "/v1/responses", `{"input":"hi","request_id":"resp_mine","max_output_tokens":2}`), 200); c.ID != "resp_mine" {
		t.Errorf("request_id: %q", c.ID)
	}
	readJSON[openai.ErrorResponse](t, post(t, ts, "/v1/responses", `{"input":"hi","tools":[{"type":"function","name":"f"}]}`), 400)
}

// TestResponsesStoreOff: as vLLM without VLLM_ENABLE_RESPONSES_API_STORE,
// nothing is stored and a continuation is not found.
func TestResponsesStoreOff(t *testing.T) {
	_, ts := newTestServer(t, ServerConfig{})
	r := readJSON[respBody](t, post(t, ts, "/v1/responses", `{"input":"hi","max_output_tokens":2}`), 200)
	readJSON[openai.ErrorResponse](t, post(t, ts, "/v1/responses", `{"input":"x","previous_response_id":"`+r.ID+`"}`), 404)
	readJSON[openai.ErrorResponse](t, post(t, ts, "/v1/responses", `{"input":"x","background":true}`), 400)
}

// TestIDsUniqueAcrossServers: two servers of the same seed (two `sim`
// processes) hand out different ids, as vLLM's random ones: with ids derived
// from the seed, a response id of one engine named another conversation on
// the other.
func TestIDsUniqueAcrossServers(t *testing.T) {
	_, a := newTestServer(t, ServerConfig{})
	_, b := newTestServer(t, ServerConfig{})
	seen := map[string]bool{}
	for range 3 {
		for _, ts := range []string{a.URL, b.URL} {
			resp, err := http.Post(ts+"/v1/responses", "application/json", strings.NewReader(`{"input":"hi","max_output_tokens":1}`))
			if err != nil {
				t.Fatal(err)
			}
			r := readJSON[respBody](t, resp, 200)
			if seen[r.ID] {
				t.Fatalf("id %s handed out twice", r.ID)
			}
			// Unpredictable: no part is shared with an earlier id (the
			// per-process half of the ids before let a client compute
			// another client's ids from its own).
			hexOf := strings.TrimPrefix(r.ID, "resp_")
			for id := range seen {
				if o := strings.TrimPrefix(id, "resp_"); o[:16] == hexOf[:16] || o[16:] == hexOf[16:] {
					t.Fatalf("ids %s and %s share half their digits", id, r.ID)
				}
			}
			seen[r.ID] = true
		}
	}
}

func mustGet(t *testing.T, url string) *http.Response {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// sseEvent is one event of a Responses stream.
type sseEvent struct {
	name string
	data map[string]any
}

// readTypedStream reads a Responses stream: its events' names and data.
func readTypedStream(t *testing.T, resp *http.Response) []sseEvent {
	t.Helper()
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	er := openai.NewEventReader(resp.Body, 0)
	var evs []sseEvent
	for {
		data, err := er.Next()
		if errors.Is(err, io.EOF) {
			if er.Done() {
				t.Error("a Responses stream sent [DONE]")
			}
			return evs
		}
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(data, &m); err != nil {
			t.Fatalf("event %s: %v", data, err)
		}
		evs = append(evs, sseEvent{name: string(er.Event()), data: m})
	}
}

func TestResponsesStreaming(t *testing.T) {
	_, ts := newTestServer(t, ServerConfig{ResponsesStore: true})
	evs := readTypedStream(t, post(t, ts, "/v1/responses", `{"model":"`+testModel+`","input":"hello","stream":true,"max_output_tokens":3}`))
	want := []string{"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
		"response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
		"response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"}
	if len(evs) != len(want) {
		t.Fatalf("%d events, want %d: %+v", len(evs), len(want), evs)
	}
	var text strings.Builder
	for i, ev := range evs {
		if ev.name != want[i] || ev.data["type"] != want[i] || ev.data["sequence_number"] != float64(i) {
			t.Errorf("event %d: %s %v, want %s", i, ev.name, ev.data, want[i])
		}
		if ev.name == "response.output_text.delta" {
			text.WriteString(ev.data["delta"].(string))
		}
	}
	created := evs[0].data["response"].(map[string]any)
	final := evs[len(evs)-1].data["response"].(map[string]any)
	if created["status"] != "in_progress" || created["usage"] != nil || final["status"] != "completed" || final["id"] != created["id"] {
		t.Errorf("created %v final %v", created, final)
	}
	if done := evs[7].data["text"]; done != text.String() {
		t.Errorf("done text %q, deltas %q", done, text.String())
	}
	u := final["usage"].(map[string]any)
	if u["output_tokens"] != float64(3) || u["input_tokens"].(float64) <= 0 {
		t.Errorf("usage %v", u)
	}
	// The streamed response is stored too.
	readJSON[respBody](t, mustGet(t, ts.URL+"/v1/responses/"+final["id"].(string)), 200)
}

func TestEmbeddings(t *testing.T) {
	s, ts := newTestServer(t, ServerConfig{})
	type embResp struct {
		ID     string `json:"id"`
		Object string `json:"object"`
		Model  string `json:"model"`
		Data   []struct {
			Index     int             `json:"index"`
			Object    string          `json:"object"`
			Embedding json.RawMessage `json:"embedding"`
		} `json:"data"`
		Usage openai.Usage `json:"usage"`
	}
	r := readJSON[embResp](t, post(t, ts, "/v1/embeddings", `{"model":"`+testModel+`","input":["hello world","hello world","hello"]}`), 200)
	if !strings.HasPrefix(r.ID, "embd-") || r.Object != "list" || r.Model != testModel || len(r.Data) != 3 {
		t.Fatalf("%+v", r)
	}
	hw, _ := s.tok.Encode(nil, "hello world", true)
	h, _ := s.tok.Encode(nil, "hello", true)
	want := len(hw)*2 + len(h)
	if r.Usage.PromptTokens != want || r.Usage.TotalTokens != want {
		t.Errorf("usage %+v, want %d prompt tokens", r.Usage, want)
	}
	var v0, v2 []float32
	_ = json.Unmarshal(r.Data[0].Embedding, &v0)
	_ = json.Unmarshal(r.Data[2].Embedding, &v2)
	if len(v0) != s.eng.Profile.HiddenSize || !bytes.Equal(r.Data[0].Embedding, r.Data[1].Embedding) || bytes.Equal(r.Data[0].Embedding, r.Data[2].Embedding) {
		t.Errorf("vectors: %d components (hidden %d), equal inputs equal: %v", len(v0), s.eng.Profile.HiddenSize,
			bytes.Equal(r.Data[0].Embedding, r.Data[1].Embedding))
	}
	var norm float64
	for _, x := range v0 {
		norm += float64(x) * float64(x)
	}
	if math.Abs(norm-1) > 1e-3 || r.Data[2].Index != 2 || r.Data[2].Object != "embedding" {
		t.Errorf("norm² %v, data[2] %+v", norm, r.Data[2])
	}
	// base64 and dimensions.
	b := readJSON[embResp](t, post(t, ts, "/v1/embeddings", `{"input":"hello world","encoding_format":"base64","dimensions":8}`), 200)
	var s64 string
	_ = json.Unmarshal(b.Data[0].Embedding, &s64)
	if raw, err := base64.StdEncoding.DecodeString(s64); err != nil || len(raw) != 8*4 {
		t.Errorf("base64 %q: %d bytes, %v", s64, len(raw), err)
	}
	ids := readJSON[embResp](t, post(t, ts, "/v1/embeddings", `{"input":[[1,2,3],[4,5]]}`), 200)
	if len(ids.Data) != 2 || ids.Usage.PromptTokens != 5 {
		t.Errorf("token-id inputs: %+v", ids)
	}
	readJSON[openai.ErrorResponse](t, post(t, ts, "/v1/embeddings", `{"input":[]}`), 400)
	readJSON[openai.ErrorResponse](t, post(t, ts, "/v1/embeddings", `{"model":"other","input":"x"}`), 404)
}

func TestTokenizeDetokenize(t *testing.T) {
	_, ts := newTestServer(t, ServerConfig{})
	type tok struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []int64  `json:"tokens"`
		TokenStrs   []string `json:"token_strs"`
	}
	p := readJSON[tok](t, post(t, ts, "/tokenize", `{"model":"`+testModel+`","prompt":"Hello there, world","return_token_strs":true}`), 200)
	if p.Count != len(p.Tokens) || p.Count == 0 || p.MaxModelLen <= 0 || len(p.TokenStrs) != p.Count || strings.Join(p.TokenStrs, "") != "Hello there, world" {
		t.Fatalf("tokenize: %+v", p)
	}
	ids, _ := json.Marshal(p.Tokens)
	d := readJSON[openai.DetokenizeResponse](t, post(t, ts, "/detokenize", `{"model":"`+testModel+`","tokens":`+string(ids)+`}`), 200)
	if d.Prompt != "Hello there, world" {
		t.Errorf("detokenize: %q", d.Prompt)
	}
	// messages count as a chat's prompt tokens.
	msgs := `[{"role":"user","content":"Say hello"}]`
	m := readJSON[tok](t, post(t, ts, "/tokenize", `{"messages":`+msgs+`}`), 200)
	c := readJSON[openai.ChatCompletion](t, post(t, ts, "/v1/chat/completions", `{"model":"`+testModel+`","max_tokens":1,"messages":`+msgs+`}`), 200)
	if m.Count != c.Usage.PromptTokens {
		t.Errorf("tokenize messages: %d tokens, the chat's prompt %d", m.Count, c.Usage.PromptTokens)
	}
	readJSON[openai.ErrorResponse](t, post(t, ts, "/detokenize", `{"tokens":[-1]}`), 400)
	readJSON[openai.ErrorResponse](t, post(t, ts, "/tokenize", `{"model":"nope","prompt":"x"}`), 404)
	// Any other path: FastAPI's 404.
	resp := post(t, ts, "/v1/rerank", `{"model":"`+testModel+`"}`)
	if b, _ := io.ReadAll(resp.Body); resp.StatusCode != 404 || string(b) != `{"detail":"Not Found"}` {
		t.Errorf("unknown path: %d %s", resp.StatusCode, b)
	}
	resp.Body.Close()
}
