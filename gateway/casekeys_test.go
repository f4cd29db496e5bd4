package gateway

import (
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/infergate/infergate/sched"
)

// The engines read JSON keys by exact name (Python's json, pydantic), so the
// gateway must too: with encoding/json's case-insensitive matching, a body
// carrying "model" and "Model" was checked against the key's allow-list by
// one and served by the engine for the other, and "Max_Tokens" slipped
// under a token limit.
func TestCaseVariantKeysCannotBypassLimits(t *testing.T) {
	e, f := newFakeEngine(t, "e0"), newFakeEngine(t, "e1")
	_, url := startGateway(t, authConfig(t, e, f)) // alice: model m only
	c := testClient(t)
	alice := []string{"Authorization", "Bearer " + keyAlice, "Content-Type", "application/json"}

	resp, b := send(t, c, http.MethodPost, url+pathChat,
		`{"model":"other","Model":"m","messages":[{"role":"user","content":"x"}]}`, alice...)
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf(`alice asking for "other" (and "Model":"m"): %d %s, want 404`, resp.StatusCode, b)
	}
	resp, b = send(t, c, http.MethodPost, url+pathChat,
		`{"model":"m","Model":"other","messages":[{"role":"user","content":"x"}]}`, alice...)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf(`alice asking for "m" (and "Model":"other"): %d %s`, resp.StatusCode, b)
	}
	// A repeated key is refused: {"model":"m","model":null} is m to Go's
	// decoder and the base model to vLLM; a repeated include_usage hid the
	// usage from the token limit.
	for _, body := range []string{
		`{"model":"m","model":null,"messages":[{"role":"user","content":"x"}]}`,
		`{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":true,"include_usage":null}}`,
	} {
		resp, b := send(t, c, http.MethodPost, url+pathChat, body, alice...)
		if oe := decodeError(t, b); resp.StatusCode != http.StatusBadRequest || codeStr(oe.Code) != "invalid_value" {
			t.Errorf("%s: %d %s, want 400 invalid_value", body, resp.StatusCode, b)
		}
	}
	if n := f.requests.Load(); n != 0 {
		t.Fatalf("model other's engine served %d of alice's requests", n)
	}

	cfg := testConfig(sched.RoundRobin, e)
	if err := cfg.Auth.AddKeys("carol plain:"+keyAlice+" tpm=100", "test"); err != nil {
		t.Fatal(err)
	}
	_, url = startGateway(t, cfg)
	ids := strings.TrimSuffix(strings.Repeat("7,", 40), ",")
	resp, b = send(t, c, http.MethodPost, url+pathCompletions,
		`{"model":"m","prompt":[`+ids+`],"max_tokens":1000,"Max_Tokens":1}`, alice...)
	if resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(string(b), "Request too large") {
		t.Fatalf(`max_tokens 1000 (and "Max_Tokens":1) under tpm=100: %d %s, want 429 too large`, resp.StatusCode, b)
	}
}

// A stream whose body encoding/json cannot edit to ask for usage (nesting
// over its 10000 levels, which segmentio accepts) is refused, never
// forwarded without usage.
func TestStreamBodyThatCannotAskForUsage(t *testing.T) {
	e := newFakeEngine(t, "e0")
	_, url := startGateway(t, testConfig(sched.RoundRobin, e))
	deep := strings.Repeat("[", 10001) + strings.Repeat("]", 10001)
	body := `{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":false},"x":` + deep + `}`
	resp, b := send(t, testClient(t), http.MethodPost, url+pathCompletions, body, "Content-Type", "application/json")
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("%d %s, want 400", resp.StatusCode, b)
	}
	if n := e.requests.Load(); n != 0 {
		t.Fatalf("the engine got %d requests", n)
	}
}

// A non-streaming answer over maxUsageScan is relayed from there on as it
// arrives; one that breaks after that aborts the client's connection (a
// truncation the client sees), and is not retried.
func TestLargeBodyBrokenAfterRelay(t *testing.T) {
	broken := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(8<<20))
		_, _ = w.Write([]byte(`{"id":"` + strings.Repeat("x", maxUsageScan+(1<<20))))
		panic(http.ErrAbortHandler) // the connection drops 3 MiB short
	}
	e, f := newFuncEngine(t, broken), newFuncEngine(t, broken)
	_, url := startGateway(t, resilienceConfig(sched.RoundRobin, e.URL(), f.URL()))
	c := testClient(t)
	resp, err := c.Post(url+pathChat, "application/json", strings.NewReader(chatBody))
	if err != nil {
		t.Fatal(err)
	}
	n, err := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || err == nil || n < maxUsageScan {
		t.Fatalf("status %d, %d bytes read, error %v; want 200, over 4 MiB, then a truncation", resp.StatusCode, n, err)
	}
	if got := e.requests.Load() + f.requests.Load(); got != 1 {
		t.Errorf("the engine got %d requests, want 1 (no retry after bytes reached the client)", got)
	}
}
