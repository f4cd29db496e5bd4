package simserver

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sim"
)

func renderPost(t *testing.T, url, path, body string) (int, []byte) {
	t.Helper()
	resp := postURL(t, url+path, body)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

func postURL(t *testing.T, url, body string) *http.Response {
	t.Helper()
	c := &http.Client{Timeout: 30 * time.Second}
	resp, err := c.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// TestRenderIDsAreTheKVBlocks: the ids /v1/chat/completions/render returns
// are the ones the chat endpoint hashes: after the same chat is served,
// every full block of the rendered ids is in the engine's prefix cache under
// the hash a KV-event consumer computes (sim.RootHash, prefix.Hashes).
func TestRenderIDsAreTheKVBlocks(t *testing.T) {
	s, ts := newTestServer(t, ServerConfig{})
	chat := fmt.Sprintf(`{"model":%q,"messages":[{"role":"system","content":"You are a terse assistant. %s"},`+
		`{"role":"user","content":"Name three rivers."},{"role":"assistant","content":"Nile, Amazon, Danube."},`+
		`{"role":"user","content":"And three mountains?"}],"max_tokens":2,"cache_salt":"tenant-a"}`, testModel, longText(600))
	code, b := renderPost(t, ts.URL, "/v1/chat/completions/render", chat)
	if code != http.StatusOK {
		t.Fatalf("render: %d %s", code, b)
	}
	var got struct {
		RequestID      string   `json:"request_id"`
		TokenIDs       []uint32 `json:"token_ids"`
		Model          string   `json:"model"`
		CacheSalt      *string  `json:"cache_salt"`
		SamplingParams struct {
			MaxTokens int `json:"max_tokens"`
		} `json:"sampling_params"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if got.Model != testModel || got.SamplingParams.MaxTokens != 2 || got.CacheSalt == nil || *got.CacheSalt != "tenant-a" ||
		len(got.RequestID) < 10 || got.RequestID[:9] != "chatcmpl-" {
		t.Fatalf("render answer %s", b)
	}
	bs := s.EngineConfig().BlockSize
	if len(got.TokenIDs) < 4*bs {
		t.Fatalf("%d ids: want several blocks of %d", len(got.TokenIDs), bs)
	}
	// /tokenize with the same messages agrees (the fallback the gateway
	// uses for engines without render).
	var msgs struct {
		Messages json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal([]byte(chat), &msgs); err != nil {
		t.Fatal(err)
	}
	code, tb := renderPost(t, ts.URL, "/tokenize", fmt.Sprintf(`{"model":%q,"messages":%s}`, testModel, msgs.Messages))
	var tok struct {
		Tokens []uint32 `json:"tokens"`
	}
	if code != http.StatusOK || json.Unmarshal(tb, &tok) != nil || !slices.Equal(tok.Tokens, got.TokenIDs) {
		t.Fatalf("/tokenize: %d, %d ids, render %d", code, len(tok.Tokens), len(got.TokenIDs))
	}

	resp := postURL(t, ts.URL+"/v1/chat/completions", chat)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("chat: %d", resp.StatusCode)
	}
	var cached map[uint64]int
	if !s.withEngine(func(e *sim.Engine, _ time.Duration) { cached = e.CachedHashes() }) {
		t.Fatal("withEngine")
	}
	full := len(got.TokenIDs) / bs * bs
	hashes := prefix.Hashes(nil, got.TokenIDs[:full], bs, sim.RootHash("", prefix.Seed("tenant-a")))
	for i, h := range hashes {
		if cached[h] == 0 {
			t.Fatalf("block %d of %d of the rendered ids is not in the engine's cache", i, len(hashes))
		}
	}
}

func TestCompletionRender(t *testing.T) {
	_, ts := newTestServer(t, ServerConfig{})
	code, b := renderPost(t, ts.URL, "/v1/completions/render", fmt.Sprintf(`{"model":%q,"prompt":["Hello world","Goodbye world"],"max_tokens":5}`, testModel))
	var got []struct {
		RequestID string   `json:"request_id"`
		TokenIDs  []uint32 `json:"token_ids"`
	}
	if code != http.StatusOK || json.Unmarshal(b, &got) != nil || len(got) != 2 {
		t.Fatalf("render: %d %s", code, b)
	}
	for i, want := range []string{"Hello world", "Goodbye world"} {
		code, tb := renderPost(t, ts.URL, "/tokenize", fmt.Sprintf(`{"prompt":%q}`, want))
		var tok struct {
			Tokens []uint32 `json:"tokens"`
		}
		if code != http.StatusOK || json.Unmarshal(tb, &tok) != nil || !slices.Equal(tok.Tokens, got[i].TokenIDs) || got[i].RequestID[:5] != "cmpl-" {
			t.Fatalf("prompt %d: render %v, tokenize %s", i, got[i], tb)
		}
	}
	// Token-id prompts come back as given.
	code, b = renderPost(t, ts.URL, "/v1/completions/render", fmt.Sprintf(`{"model":%q,"prompt":[1,2,3]}`, testModel))
	if code != http.StatusOK || json.Unmarshal(b, &got) != nil || len(got) != 1 || !slices.Equal(got[0].TokenIDs, []uint32{1, 2, 3}) {
		t.Fatalf("token prompt: %d %s", code, b)
	}
}

func TestRenderErrors(t *testing.T) {
	prof := sim.DefaultProfile()
	prof.MaxModelLen = 64
	_, ts := newTestServer(t, ServerConfig{Engine: sim.Config{Profile: prof}})
	for _, tc := range []struct {
		path, body string
		code       int
	}{
		{"/v1/chat/completions/render", `{"model":"nope","messages":[{"role":"user","content":"hi"}]}`, http.StatusNotFound},
		{"/v1/completions/render", `{"model":"nope","prompt":"hi"}`, http.StatusNotFound},
		{"/v1/chat/completions/render", fmt.Sprintf(`{"model":%q,"messages":[]}`, testModel), http.StatusBadRequest},
		{"/v1/chat/completions/render", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}]}`, testModel, longText(400)), http.StatusBadRequest},
		{"/v1/completions/render", fmt.Sprintf(`{"model":%q,"prompt":%q}`, testModel, longText(400)), http.StatusBadRequest},
		{"/v1/completions/render", `{"model":`, http.StatusBadRequest},
	} {
		code, b := renderPost(t, ts.URL, tc.path, tc.body)
		var e struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if code != tc.code || json.Unmarshal(b, &e) != nil || e.Error.Message == "" {
			t.Errorf("%s %.60s: %d %s, want %d and an OpenAI error", tc.path, tc.body, code, b, tc.code)
		}
	}
}

// longText returns n distinct words.
func longText(n int) string {
	b := make([]byte, 0, n*8)
	for i := range n {
		b = fmt.Appendf(b, "w%d ", i)
	}
	return string(b)
}
