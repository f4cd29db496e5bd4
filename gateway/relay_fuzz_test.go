package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// bodyEngine answers every request with status 200, contentType and body:
// an in-memory engine whose answer the fuzzer chooses.
type bodyEngine struct {
	contentType string
	body        []byte
}

func (e *bodyEngine) RoundTrip(req *http.Request) (*http.Response, error) {
	return &http.Response{StatusCode: http.StatusOK, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{"Content-Type": {e.contentType}}, Body: io.NopCloser(bytes.NewReader(e.body)),
		ContentLength: -1, Request: req}, nil
}

// relaySeeds are engine stream bodies: what engines send, and the shapes
// of the attack run against `infergate serve` (issue 12).
var relaySeeds = []string{
	roleChunk + tokenChunk + `data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}` + "\n\ndata: [DONE]\n\n",
	// An error event before any output (vLLM's generator raising), nested
	// and flat (older vLLM), and TGI's string form.
	`data: {"error":{"object":"error","message":"boom","type":"BadRequestError","param":null,"code":400}}` + "\n\ndata: [DONE]\n\n",
	`data: {"object":"error","message":"boom","type":"BadRequestError","param":null,"code":400}` + "\n\ndata: [DONE]\n\n",
	`data: {"error":"Request failed during generation","error_type":"generation"}` + "\n\n",
	// The role chunk, then an error, a break, or the end.
	roleChunk + `data: {"error":{"message":"engine died","code":500}}` + "\n\ndata: [DONE]\n\n",
	roleChunk,
	roleChunk + "data: [DONE]\n\n",
	// [DONE] alone; garbage then [DONE]; comments only; non-JSON events.
	"data: [DONE]\n\n",
	"<html><body>502 Bad Gateway</body></html>\n\ndata: [DONE]\n\n",
	": keep-alive\n\n: keep-alive\n\n",
	"data: \xff\xfe\x00garbage\n\ndata: {\"choices\":\"nope\"}\n\ndata: [DONE]\n\n",
	// Output, then an error event, a break, or comments.
	tokenChunk + `data: {"error":{"message":"engine died","code":500}}` + "\n\ndata: [DONE]\n\n",
	tokenChunk + ":\n\n:\n\n",
	// An empty generation; events without output before the first token.
	roleChunk + emptyChunk + emptyChunk + tokenChunk + "data: [DONE]\n\n",
	roleChunk + `data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}` + "\n\ndata: [DONE]\n\n",
	strings.Repeat(emptyChunk, 500) + "data: [DONE]\n\n",
	strings.Repeat("data: {}\n\n", 8000) + "data: [DONE]\n\n",
	// Lone CRs end lines (WHATWG HTML §9.2.5): events and [DONE] that a
	// client reads, whatever the gateway's reader thinks.
	crStream,
	strings.ReplaceAll(roleChunk+tokenChunk, "\n", "\r") + "data: [DONE]\r\r",
	tokenChunk + "data: {\"choices\":[]}\r\rdata: [DONE]\r\n\r\n",
	"\xEF\xBB\xBF" + tokenChunk + "data: [DONE]\r\r",
	tokenChunk + "data: x\r\r\n" + `data: {"error":{"message":"e"}}` + "\r\rdata: [DONE]\n\r",
}

// FuzzStreamRelay drives relayStream with an engine answer of the
// fuzzer's choosing and checks what the client gets: a 200 stream ends
// with [DONE] after at least one event, each event the gateway wrote is
// the one event a client's parser reads there (internal/ssetest; so the
// client reads [DONE] last and only there), and it never shows an error
// event before an output event (unless more than maxHeldBeforeOutput bytes
// of chunks without output came first, counted as written); anything else is
// an OpenAI error of status 502 or 504. An event nested deeper than
// openai.MaxDepth is one the gateway does not read (jsonscan.ParseChat):
// neither an error nor output to it.
func FuzzStreamRelay(f *testing.F) {
	for _, s := range relaySeeds {
		f.Add([]byte(s), uint8(0), false)
	}
	f.Add([]byte("<html>proxy login</html>"), uint8(2), false)
	f.Add([]byte(`{"id":"x","choices":[{"index":0,"text":"hi"}]}`), uint8(1), true)

	cfg := testConfig(sched.RoundRobin)
	cfg.HealthCheckPath, cfg.ScrapeInterval = healthCheckOff, -1
	cfg.Retry.MaxAttempts = 1
	cfg.Outlier.ConsecutiveErrors = 1 << 30 // the one endpoint stays in rotation
	// Nothing to discover (kv_blocks and max_model_len given): the address is never dialled.
	cfg.Endpoints = []EndpointConfig{{URL: "http://10.0.0.1:8000", Model: "m", KVBlocks: 1000, MaxModelLen: 4096}}
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(g.Close)
	types := []string{"text/event-stream", "application/json", "text/html"}

	f.Fuzz(func(t *testing.T, body []byte, ct uint8, usage bool) {
		g.rt = &bodyEngine{contentType: types[int(ct)%len(types)], body: body}
		req := httptest.NewRequest(http.MethodPost, pathChat, strings.NewReader(streamBody(usage)))
		req.Header.Set("Content-Type", "application/json")
		w := httptest.NewRecorder()
		g.Handler().ServeHTTP(w, req)
		got := w.Body.Bytes()
		if ct%3 == 1 {
			return // a JSON answer is relayed as it is
		}
		if w.Code != http.StatusOK {
			var er openai.ErrorResponse
			if json.Unmarshal(got, &er) != nil || er.Error == nil ||
				(w.Code != http.StatusBadGateway && w.Code != http.StatusGatewayTimeout) {
				t.Fatalf("%d %q for %q", w.Code, got, body)
			}
			return
		}
		if !bytes.HasSuffix(got, []byte("data: [DONE]\n\n")) || len(got) == len("data: [DONE]\n\n") {
			t.Fatalf("200 stream %q for %q", got, body)
		}
		// The client reads [DONE] once, at the end.
		evs := clientEvents(got)
		if i := slices.Index(evs, "[DONE]"); i != len(evs)-1 {
			t.Fatalf("a client reads [DONE] as event %d of %d in %q for %q", i, len(evs), got, body)
		}
		// The gateway writes each event as appendEvent does: it ends at
		// its first blank line ("\n\n"), which is how many bytes it held.
		var chunk openai.StreamChunk
		output, before := false, 0
		for rest := got; len(rest) > 0; {
			n := bytes.Index(rest, sseEnd) + len(sseEnd)
			if n < len(sseEnd) {
				t.Fatalf("200 stream %q ends inside an event for %q", got, body)
			}
			written := rest[:n]
			rest = rest[n:]
			data, err := openai.NewEventReader(bytes.NewReader(written), 0).Next()
			if ce := clientEvents(written); len(ce) != 1 || (err == nil && ce[0] != string(data)) {
				t.Fatalf("the gateway wrote %q (read as %q), a client reads %q, in %q for %q", written, data, ce, got, body)
			}
			if err != nil {
				break // [DONE]
			}
			chunk.Reset()
			if !openai.TooDeep(data) {
				_ = json.Unmarshal(data, &chunk)
			}
			if chunk.IsError() && !output && before <= maxHeldBeforeOutput {
				t.Fatalf("an error event before any output in a 200 stream %q for %q", got, body)
			}
			output = output || chunk.HasOutput()
			before += len(written) // held bytes as the gateway counts them: as written
		}
	})
}
