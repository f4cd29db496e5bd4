package gateway

import (
	"bytes"
	"io"
	"net/http"
	"testing"

	"github.com/infergate/infergate/sched"
)

// Tests of streams that fail before their first output: nothing reached
// the client, so they are failures before the first byte — retried on
// another endpoint, or answered with a real 5xx (TestHostileEngine) —
// never a 200 carrying an error or nothing.

// earlyFailures are engines whose 200 stream fails before any output.
var earlyFailures = []struct {
	name, reason string
	serve        http.HandlerFunc
}{
	{"error event first (vLLM's generator raising)", reasonErrorEvent, func(w http.ResponseWriter, _ *http.Request) {
		sseStart(w)
		sseSend(w, `data: {"error":{"object":"error","message":"CUDA error: an illegal memory access was encountered","type":"BadRequestError","param":null,"code":400}}`+"\n\ndata: [DONE]\n\n")
	}},
	{"older vLLM's flat error event first", reasonBadResponse, func(w http.ResponseWriter, _ *http.Request) {
		sseStart(w)
		sseSend(w, `data: {"object":"error","message":"CUDA error","type":"BadRequestError","param":null,"code":400}`+"\n\ndata: [DONE]\n\n")
	}},
	{"role chunk, then an error event", reasonErrorEvent, func(w http.ResponseWriter, _ *http.Request) {
		sseStart(w)
		sseSend(w, roleChunk+`data: {"error":{"message":"engine died","type":"InternalServerError","param":null,"code":500}}`+"\n\ndata: [DONE]\n\n")
	}},
	{"role chunk, then the connection drops", reasonReset, func(w http.ResponseWriter, _ *http.Request) {
		sseStart(w)
		sseSend(w, roleChunk)
		panic(http.ErrAbortHandler)
	}},
	{"role chunk, then the stream ends without [DONE]", reasonReset, func(w http.ResponseWriter, _ *http.Request) {
		sseStart(w)
		sseSend(w, roleChunk)
	}},
	{"[DONE] alone", reasonBadResponse, func(w http.ResponseWriter, _ *http.Request) {
		sseStart(w)
		sseSend(w, "data: [DONE]\n\n")
	}},
	{"non-SSE garbage, then [DONE]", reasonBadResponse, func(w http.ResponseWriter, _ *http.Request) {
		sseStart(w)
		sseSend(w, "<html><body>upstream connect error</body></html>\n\ndata: [DONE]\n\n")
	}},
	{"200 text/html", reasonBadResponse, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		_, _ = io.WriteString(w, "<html>proxy login</html>")
	}},
}

func TestEarlyStreamFailureRetried(t *testing.T) {
	for _, tc := range earlyFailures {
		t.Run(tc.name, func(t *testing.T) {
			bad := newFuncEngine(t, tc.serve)
			good := newFakeEngine(t, "good")
			g, url := startGateway(t, resilienceConfig(sched.RoundRobin, bad.URL(), good.URL()))
			c := testClient(t)
			for i := range 2 {
				resp, b := post(t, c, url+pathChat, streamBody(false))
				if resp.StatusCode != 200 || resp.Header.Get("X-Engine") != "good" || !bytes.Contains(b, []byte("Hel")) ||
					bytes.Contains(b, []byte(`"error"`)) || !bytes.HasSuffix(b, []byte("data: [DONE]\n\n")) {
					t.Fatalf("request %d: %d from %q: %s", i, resp.StatusCode, resp.Header.Get("X-Engine"), b)
				}
			}
			tried := bad.requests.Load()
			if tried < 1 {
				t.Fatal("the failing engine was never tried")
			}
			m := scrape(t, c, url)
			if v := m.value("infergate_retries_total", `reason="`+tc.reason+`"`); v != float64(tried) {
				t.Errorf("retries_total{%s} = %v, want %d", tc.reason, v, tried)
			}
			if v := m.value("infergate_requests_total", `code="200"`); v != 2 {
				t.Errorf("requests_total{200} = %v, want 2", v)
			}
			if n := g.state.Load().endpoints[0].outlier.consecutive.Load(); n != tried {
				t.Errorf("the failing endpoint's consecutive failures = %d, want %d", n, tried)
			}
		})
	}
}

// An empty generation — a role chunk, a finish chunk with no content,
// usage, [DONE] — is a complete answer, relayed whole with its 200.
func TestStreamWithoutOutputRelayed(t *testing.T) {
	const finish = `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop"}]}` + "\n\n"
	const usage = `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":0,"total_tokens":5}}` + "\n\n"
	e := newFuncEngine(t, func(w http.ResponseWriter, _ *http.Request) {
		sseStart(w)
		sseSend(w, roleChunk+finish+usage+"data: [DONE]\n\n")
	})
	_, url := startGateway(t, resilienceConfig(sched.RoundRobin, e.URL()))
	c := testClient(t)
	resp, b := post(t, c, url+pathChat, streamBody(false)) // usage asked by the gateway: stripped
	if want := roleChunk + finish + "data: [DONE]\n\n"; resp.StatusCode != 200 || string(b) != want {
		t.Fatalf("%d\n%s\nwant\n%s", resp.StatusCode, b, want)
	}
	if v := scrape(t, c, url).value("infergate_generation_tokens_total", ""); v != 0 {
		t.Errorf("generation_tokens_total = %v", v)
	}
}
