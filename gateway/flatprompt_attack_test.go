package gateway

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/infergate/infergate/openai"
)

// TestServeHostileFlatPrompts drives completion bodies aimed at the
// one-pass reading of a flat token-id prompt (openai/flatprompt.go)
// through the served HTTP path: a body openai.Decode refuses gets a 400
// with its OpenAI-format error; one it accepts reaches the engine as sent.
// Good and hostile bodies alternate, so each good one decodes into an
// exchange whose pooled token-id buffer a hostile one filled.
func TestServeHostileFlatPrompts(t *testing.T) {
	e := newFakeEngine(t, "a")
	_, url := startGateway(t, testConfig("cache-aware", e))
	c := &http.Client{}
	big := `[` + strings.Repeat("4294967295,", 200000) + `7]`
	hostile := []string{
		`{"model":"m","prompt":[4294967296]}`, `{"model":"m","prompt":[01]}`, `{"model":"m","prompt":[1e3]}`,
		`{"model":"m","prompt":[1,-0]}`, `{"model":"m","prompt":[1]]}`, `{"model":"m","prompt":[1]} x`,
		`{"model":"m","prompt":[1],"prompt":[2]}`, `{"model":"m","prompt":[1],"\u0070rompt":[2]}`,
		`{"model":"m","a":"\u0022,\"prompt\":[9]","prompt":[1,]}`, `{"model":"m","prompt":[1`,
		"\xef\xbb\xbf{\"model\":\"m\",\"prompt\":[1]}", `{"model":"m","prompt":[1],"x":` + strings.Repeat("[", 200) + `}`,
		`{"model":"m","prompt":` + big + `,"max_tokens":"1"}`, `{"model":"m","prompt":[1,"]"]}`,
		`{"model":"m","prompt":[1],"max_tokens":-1}`,
	}
	good := []string{
		`{"model":"m","prompt":[2147483648,4294967295,0],"max_tokens":1}`,
		`{ "prompt" : [ 5 , 6 ] , "a":{"prompt":[9]}, "model" : "m" }`,
		`{"model":"m","prompt":` + big + `,"max_tokens":1}`,
	}
	for i, bad := range hostile {
		var r openai.CompletionRequest
		want := openai.Decode([]byte(bad), &r)
		if want == nil {
			want = r.Validate()
		}
		resp, body := post(t, c, url+"/v1/completions", bad)
		name := bad
		if len(name) > 80 {
			name = name[:80] + "…"
		}
		var got struct {
			Error *struct {
				Message string  `json:"message"`
				Type    string  `json:"type"`
				Param   *string `json:"param"`
				Code    any     `json:"code"`
			} `json:"error"`
		}
		if resp.StatusCode != http.StatusBadRequest || json.Unmarshal(body, &got) != nil || got.Error == nil ||
			got.Error.Message == "" || got.Error.Type != "invalid_request_error" {
			t.Errorf("%q: %d %s, want a 400 with an OpenAI-format error", name, resp.StatusCode, body)
		} else if want != nil && want.Status == http.StatusBadRequest && got.Error.Message != want.Message {
			t.Errorf("%q: message %q, openai.Decode's %q", name, got.Error.Message, want.Message)
		}
		g := good[i%len(good)]
		resp, _ = post(t, c, url+"/v1/completions", g)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%q after %q: %d", g[:min(len(g), 80)], name, resp.StatusCode)
		}
		if _, sent := e.last(); !bytes.Equal(sent, []byte(g)) {
			t.Errorf("engine got %.80q, want %.80q", sent, g)
		}
	}
}
