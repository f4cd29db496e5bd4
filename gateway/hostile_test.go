package gateway

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// deepJSON is a JSON array nested one level past openai.MaxDepth.
var deepJSON = strings.Repeat("[", openai.MaxDepth+1) + strings.Repeat("]", openai.MaxDepth+1)

// TestEngineJSONDepthBounded: an engine's JSON is held to the nesting bound
// of a client's (openai.MaxDepth). A deeper error body is not relayed as
// JSON (502 upstream_error with an excerpt), and usage in a deeper answer
// or stream chunk is not decoded (the answer is relayed untouched,
// unaccounted). encoding/json alone would have read them, to 10000 levels.
func TestEngineJSONDepthBounded(t *testing.T) {
	usage := `"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8}`
	for _, tc := range []struct {
		name   string
		stream bool
		serve  func(w http.ResponseWriter)
		status int
	}{
		{"error body", false, func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"no","type":"BadRequestError","code":400},"x":`+deepJSON+`}`)
		}, http.StatusBadGateway},
		{"answer", false, func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"choices":[{"index":0,"text":"a"}],`+usage+`,"x":`+deepJSON+`}`)
		}, http.StatusOK},
		{"stream chunk", true, func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, `data: {"choices":[{"index":0,"text":"a"}]}`+"\n\n"+
				`data: {"choices":[],`+usage+`,"x":`+deepJSON+`}`+"\n\ndata: [DONE]\n\n")
		}, http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eng := newServerNoCleanup(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == pathCompletions {
					_, _ = io.Copy(io.Discard, r.Body)
					tc.serve(w)
				}
			}))
			defer eng.Close()
			cfg := testConfig(sched.RoundRobin)
			cfg.HealthCheckPath = healthCheckOff
			cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000}}
			_, url := startGateway(t, cfg)
			c := testClient(t)
			body := `{"model":"m","prompt":"x","stream":` + map[bool]string{true: "true", false: "false"}[tc.stream] + `}`
			resp, b := post(t, c, url+pathCompletions, body)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %.200s", resp.StatusCode, tc.status, b)
			}
			if tc.status == http.StatusBadGateway && !strings.Contains(string(b), openai.CodeUpstream) {
				t.Errorf("body %.200s, want %s", b, openai.CodeUpstream)
			}
			if tc.status == http.StatusOK && !strings.Contains(string(b), deepJSON) {
				t.Errorf("the deep answer was not relayed whole: %.200s", b)
			}
			if n := scrape(t, c, url).value("infergate_prompt_tokens_total", `model="m"`); n != 0 {
				t.Errorf("prompt tokens %v accounted from JSON nested past the bound", n)
			}
		})
	}
}

// TestNestingAttackRefused: 2 MB of "[" in a field the gateway does not
// type, sent to an open gateway, is a 400 invalid_json, and the gateway
// still serves (before the bound: fatal error: stack overflow, the process
// and every request in flight gone).
func TestNestingAttackRefused(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := testConfig(sched.RoundRobin, e)
	cfg.HealthCheckPath = healthCheckOff
	_, url := startGateway(t, cfg)
	c := testClient(t)
	attack := strings.Repeat("[", 2<<20)
	for _, tc := range []struct{ path, body string }{
		{pathChat, `{"model":"m","messages":[{"role":"user","content":"hi"}],"x":` + attack + `}`},
		{pathChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a","y":` + attack + `}]}]}`},
		{pathChat, `{"model":"m","tools":` + attack + `}`},
		{pathCompletions, `{"model":"m","prompt":` + attack + `}`},
	} {
		resp, b := post(t, c, url+tc.path, tc.body)
		if e := decodeError(t, b); resp.StatusCode != http.StatusBadRequest || codeStr(e.Code) != openai.CodeInvalidJSON {
			t.Errorf("%s: %d %.200s, want 400 invalid_json", tc.path, resp.StatusCode, b)
		}
	}
	if resp, b := post(t, c, url+pathChat, chatBody); resp.StatusCode != http.StatusOK {
		t.Fatalf("after the attack: %d %.200s", resp.StatusCode, b)
	}
}
