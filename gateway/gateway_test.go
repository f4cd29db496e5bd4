package gateway

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

const chatBody = `{"model":"m","messages":[{"role":"user","content":"Say hello"}]}`

// decodeError parses an OpenAI error body.
func decodeError(t *testing.T, body []byte) *openai.Error {
	t.Helper()
	var er openai.ErrorResponse
	if err := json.Unmarshal(body, &er); err != nil || er.Error == nil {
		t.Fatalf("not an OpenAI error body: %q (%v)", body, err)
	}
	return er.Error
}

func codeStr(c any) string {
	if c == nil {
		return "<nil>"
	}
	return fmt.Sprint(c)
}

func str(p *string) string {
	if p == nil {
		return "<nil>"
	}
	return *p
}

func TestRequestErrors(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := testConfig(sched.RoundRobin, e)
	cfg.MaxBodyBytes = 1024
	_, url := startGateway(t, cfg)
	c := testClient(t)

	tests := []struct {
		name        string
		path, body  string
		status      int
		param, code string
		msg         string
	}{
		{"truncated JSON", pathChat, `{"model":"m","messages":[`, 400, "<nil>", openai.CodeInvalidJSON, ""},
		{"not an object", pathChat, `[1,2]`, 400, "<nil>", openai.CodeInvalidJSON, ""},
		{"empty body", pathCompletions, ``, 400, "<nil>", openai.CodeInvalidJSON, ""},
		{"messages wrong type", pathChat, `{"model":"m","messages":"hi"}`, 400, "messages", openai.CodeInvalidValue, ""},
		{"max_tokens wrong type", pathCompletions, `{"model":"m","prompt":"hi","max_tokens":"5"}`, 400, "max_tokens", openai.CodeInvalidValue, ""},
		{"prompt wrong type", pathCompletions, `{"model":"m","prompt":{"a":1}}`, 400, "prompt", openai.CodeInvalidValue, ""},
		{"invalid value", pathChat, `{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":3}`, 400, "temperature", openai.CodeInvalidValue, ""},
		{"missing model", pathChat, `{"messages":[{"role":"user","content":"x"}]}`, 400, "model", openai.CodeInvalidValue, ""},
		{"unknown model", pathChat, `{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}`, 404, "model", openai.CodeModelNotFound, "The model `gpt-9` does not exist."},
		{"too large", pathChat, `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 2000) + `"}]}`, 413, "<nil>", openai.CodeRequestTooLarge, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := post(t, c, url+tc.path, tc.body)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, body)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type %q", ct)
			}
			oe := decodeError(t, body)
			if str(oe.Param) != tc.param || codeStr(oe.Code) != tc.code {
				t.Errorf("param %s code %s, want %s %s (%s)", str(oe.Param), codeStr(oe.Code), tc.param, tc.code, oe.Message)
			}
			if tc.msg != "" && oe.Message != tc.msg {
				t.Errorf("message %q, want %q", oe.Message, tc.msg)
			}
			if resp.Header.Get("X-Request-Id") == "" {
				t.Error("no X-Request-Id on the error")
			}
		})
	}
	if n := e.requests.Load(); n != 0 {
		t.Errorf("engine saw %d requests, want 0", n)
	}
}

func TestBodyTooLargeChunked(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := testConfig(sched.RoundRobin, e)
	cfg.MaxBodyBytes = 1024
	_, url := startGateway(t, cfg)
	// No Content-Length: the limit must hold while reading.
	pr, pw := io.Pipe()
	go func() {
		_, _ = pw.Write([]byte(`{"model":"m","prompt":"` + strings.Repeat("y", 4000) + `"}`))
		_ = pw.Close()
	}()
	req, _ := http.NewRequest(http.MethodPost, url+pathCompletions, pr)
	resp, err := testClient(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge || codeStr(decodeError(t, body).Code) != openai.CodeRequestTooLarge {
		t.Fatalf("status %d body %s", resp.StatusCode, body)
	}
}

func TestMethodsAndPaths(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := testConfig(sched.RoundRobin, e)
	cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: e.URL(), Model: "alpha", KVBlocks: 1000})
	_, url := startGateway(t, cfg)
	c := testClient(t)

	resp, err := c.Get(url + pathChat)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 405 || resp.Header.Get("Allow") != "POST" {
		t.Errorf("GET chat: %d Allow=%q", resp.StatusCode, resp.Header.Get("Allow"))
	}
	decodeError(t, body)

	resp, body = post(t, c, url+pathModels, "{}")
	if resp.StatusCode != 405 {
		t.Errorf("POST models: %d", resp.StatusCode)
	}
	resp, err = c.Get(url + "/v1/no-such-path")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 404 {
		t.Errorf("unknown path: %d", resp.StatusCode)
	}
	decodeError(t, body)

	resp, err = c.Get(url + pathModels)
	if err != nil {
		t.Fatal(err)
	}
	var list openai.ModelList
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if list.Object != "list" || len(list.Data) != 2 || list.Data[0].ID != "alpha" || list.Data[1].ID != "m" ||
		list.Data[0].OwnedBy != "infergate" || list.Data[0].Object != "model" {
		t.Errorf("models: %+v", list)
	}

	resp, err = c.Get(url + pathHealthz)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("healthz %d", resp.StatusCode)
	}
}

// streamBody is a streaming chat request; usage asks for include_usage.
func streamBody(usage bool) string {
	if usage {
		return `{"model":"m","messages":[{"role":"user","content":"Say hello"}],"stream":true,"stream_options":{"include_usage":true},"vllm_xargs":{"x":1}}`
	}
	return `{"model":"m","messages":[{"role":"user","content":"Say hello"}],"stream":true,"vllm_xargs":{"x":1}}`
}

func TestStreamingPassthrough(t *testing.T) {
	e := newFakeEngine(t, "e0")
	g, url := startGateway(t, testConfig(sched.Prefix, e))
	c := testClient(t)

	for _, usage := range []bool{true, false} {
		t.Run(fmt.Sprintf("include_usage=%v", usage), func(t *testing.T) {
			_, direct := post(t, c, e.URL()+pathChat, streamBody(usage))
			resp, via := post(t, c, url+pathChat, streamBody(usage))
			if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
				t.Fatalf("status %d Content-Type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
			}
			if !bytes.Equal(direct, via) {
				t.Errorf("stream differs from a direct call\ndirect: %s\nvia:    %s", direct, via)
			}
			if got := bytes.Contains(via, []byte(`"usage"`)); got != usage {
				t.Errorf("usage chunk present=%v, want %v", got, usage)
			}
			_, upstream := e.last()
			var sent map[string]json.RawMessage
			if err := json.Unmarshal(upstream, &sent); err != nil {
				t.Fatal(err)
			}
			if string(sent["stream_options"]) != `{"include_usage":true}` || string(sent["vllm_xargs"]) != `{"x":1}` {
				t.Errorf("upstream body %s", upstream)
			}
			if usage && string(upstream) != streamBody(true) {
				t.Errorf("body with include_usage was rewritten: %s", upstream)
			}
		})
	}
	// Both streams were accounted with the engine's usage.
	m := scrape(t, c, url)
	ep := e.URL()
	for name, want := range map[string]float64{
		"infergate_prompt_tokens_total":        80,
		"infergate_cached_prompt_tokens_total": 64,
		"infergate_generation_tokens_total":    6,
	} {
		if v := m.value(name, `endpoint="`+ep+`"`); v != want {
			t.Errorf("%s = %v, want %v", name, v, want)
		}
	}
	if v := m.value("infergate_time_to_first_token_seconds_count", `endpoint="`+ep+`"`); v != 2 {
		t.Errorf("TTFT count %v, want 2", v)
	}
	if v := m.value("infergate_inter_token_latency_seconds_count", `endpoint="`+ep+`"`); v != 4 {
		t.Errorf("ITL count %v, want 4 (3 tokens per stream)", v)
	}
	if n := g.state.Load().endpoints[0].ledger.InFlight(); n != 0 {
		t.Errorf("in flight %d", n)
	}
}

func TestNonStreamingPassthrough(t *testing.T) {
	e := newFakeEngine(t, "e0")
	_, url := startGateway(t, testConfig(sched.LeastRequest, e))
	c := testClient(t)
	for _, tc := range []struct{ path, body string }{
		{pathChat, chatBody},
		{pathCompletions, `{"model":"m","prompt":"Say hello","max_tokens":5,"vendor_field":[1,2]}`},
	} {
		dresp, direct := post(t, c, e.URL()+tc.path, tc.body)
		resp, via := post(t, c, url+tc.path, tc.body)
		if resp.StatusCode != 200 || !bytes.Equal(direct, via) {
			t.Errorf("%s: status %d body differs:\n%s\n%s", tc.path, resp.StatusCode, direct, via)
		}
		if resp.Header.Get("Content-Type") != dresp.Header.Get("Content-Type") || resp.Header.Get("X-Engine") != "e0" ||
			len(resp.Header["X-Request-Id"]) != 1 {
			t.Errorf("headers not relayed: %v", resp.Header)
		}
		if _, up := e.last(); string(up) != tc.body {
			t.Errorf("upstream body %s, want the original %s", up, tc.body)
		}
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_prompt_tokens_total", `model="m"`); v != 80 {
		t.Errorf("prompt tokens %v", v)
	}
	if v := m.value("infergate_e2e_request_latency_seconds_count", `model="m"`); v != 2 {
		t.Errorf("e2e count %v", v)
	}
	if v := m.value("infergate_requests_total", `code="200"`); v != 2 {
		t.Errorf("requests_total{code=200} %v", v)
	}
}

func TestUpstreamErrors(t *testing.T) {
	e := newFakeEngine(t, "e0")
	_, url := startGateway(t, testConfig(sched.RoundRobin, e))
	c := testClient(t)

	e.mode.Store(int32(modeError400))
	resp, body := post(t, c, url+pathChat, chatBody)
	if resp.StatusCode != 400 || !strings.Contains(string(body), "maximum context length") {
		t.Errorf("JSON error not relayed: %d %s", resp.StatusCode, body)
	}
	e.mode.Store(int32(modeError500))
	resp, body = post(t, c, url+pathChat, chatBody)
	if resp.StatusCode != 502 || codeStr(decodeError(t, body).Code) != openai.CodeUpstream {
		t.Errorf("text error not wrapped: %d %s", resp.StatusCode, body)
	}
}

// routeOf sends body and returns the engine that served it.
func routeOf(t *testing.T, c *http.Client, url, path, body string) string {
	t.Helper()
	resp, b := post(t, c, url+path, body)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	return resp.Header.Get("X-Engine")
}

func tokenPrompt(shared, own int, tail uint32) string {
	ids := make([]string, 0, shared+own)
	for i := range shared {
		ids = append(ids, strconv.Itoa(1000+i))
	}
	for i := range own {
		ids = append(ids, strconv.Itoa(int(tail)*100000+i))
	}
	return `{"model":"m","max_tokens":4,"prompt":[` + strings.Join(ids, ",") + `]}`
}

func TestRoutingByPrefix(t *testing.T) {
	engines := []*fakeEngine{newFakeEngine(t, "e0"), newFakeEngine(t, "e1"), newFakeEngine(t, "e2"), newFakeEngine(t, "e3")}
	a, b := tokenPrompt(512, 40, 1), tokenPrompt(512, 40, 2)
	longChat := `{"model":"m","messages":[{"role":"system","content":"` + strings.Repeat("You are a careful assistant. ", 60) + `"},{"role":"user","content":"%s"}]}`

	t.Run("prefix", func(t *testing.T) {
		g, url := startGateway(t, testConfig(sched.Prefix, engines...))
		c := testClient(t)
		first := routeOf(t, c, url, pathCompletions, a)
		if second := routeOf(t, c, url, pathCompletions, b); second != first {
			t.Errorf("token prompts with a shared 512-token prefix went to %s and %s", first, second)
		}
		chat1 := routeOf(t, c, url, pathChat, fmt.Sprintf(longChat, "first question"))
		if chat2 := routeOf(t, c, url, pathChat, fmt.Sprintf(longChat, "second question")); chat2 != chat1 {
			t.Errorf("chats with a shared system prompt went to %s and %s", chat1, chat2)
		}
		m := scrape(t, c, url)
		if v := m.value("infergate_prefix_predicted_matched_tokens_total", `model="m"`); v < 512 {
			t.Errorf("predicted matched tokens %v, want >= 512", v)
		}
		_ = g
	})
	t.Run("round-robin", func(t *testing.T) {
		_, url := startGateway(t, testConfig(sched.RoundRobin, engines...))
		c := testClient(t)
		if first, second := routeOf(t, c, url, pathCompletions, a), routeOf(t, c, url, pathCompletions, b); first == second {
			t.Errorf("round-robin sent both to %s", first)
		}
	})
}

func TestHeadersForwarded(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := testConfig(sched.RoundRobin, e)
	cfg.TrustedProxies = []string{"127.0.0.1"} // keep and extend the client's X-Forwarded-For
	_, url := startGateway(t, cfg)
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	raw := "POST /v1/chat/completions HTTP/1.1\r\n" +
		"Host: gateway.example\r\n" +
		"Content-Type: application/json\r\n" +
		"Content-Length: " + strconv.Itoa(len(chatBody)) + "\r\n" +
		"Connection: keep-alive, X-Hop\r\n" +
		"X-Hop: secret\r\n" +
		"Keep-Alive: timeout=5\r\n" +
		"Proxy-Authorization: Basic Zm9vOmJhcg==\r\n" +
		"Proxy-Connection: keep-alive\r\n" +
		"TE: trailers\r\n" +
		"Trailer: X-Checksum\r\n" +
		"Upgrade: foo/2\r\n" +
		"Authorization: Bearer sk-secret\r\n" +
		"Cookie: session=abc\r\n" +
		"Accept-Encoding: gzip\r\n" +
		"X-End-To-End: kept\r\n" +
		"X-Request-Id: client-req-42\r\n" +
		"X-Forwarded-For: 10.1.2.3\r\n" +
		"\r\n" + chatBody
	if _, err := io.WriteString(conn, raw); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("X-Request-Id") != "client-req-42" {
		t.Fatalf("status %d X-Request-Id %q", resp.StatusCode, resp.Header.Get("X-Request-Id"))
	}
	h, _ := e.last()
	for _, k := range []string{"X-Hop", "Keep-Alive", "Proxy-Authorization", "Proxy-Connection", "Te", "Trailer",
		"Upgrade", "Authorization", "Cookie", "Accept-Encoding"} {
		if v, ok := h[k]; ok {
			t.Errorf("%s forwarded: %q", k, v)
		}
	}
	if c := h.Get("Connection"); c != "" {
		t.Errorf("Connection forwarded: %q", c)
	}
	if h.Get("X-End-To-End") != "kept" || h.Get("X-Request-Id") != "client-req-42" ||
		h.Get("X-Forwarded-For") != "10.1.2.3, 127.0.0.1" || h.Get("Content-Type") != "application/json" {
		t.Errorf("end-to-end headers: %v", h)
	}

	// An insane request id is replaced by a generated one.
	c := testClient(t)
	resp2, _ := post(t, c, url+pathChat, chatBody, "X-Request-Id", "bad id with spaces")
	h, _ = e.last()
	if id := h.Get("X-Request-Id"); id == "bad id with spaces" || !saneRequestID(id) || resp2.Header.Get("X-Request-Id") != id {
		t.Errorf("generated request id %q (response %q)", id, resp2.Header.Get("X-Request-Id"))
	}
}

func TestMidStreamFailure(t *testing.T) {
	e := newFakeEngine(t, "e0")
	_, url := startGateway(t, testConfig(sched.RoundRobin, e))
	e.mode.Store(int32(modeMidFail))
	c := testClient(t)
	resp, body := post(t, c, url+pathChat, streamBody(false))
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	events := strings.Split(strings.TrimSuffix(string(body), "\n\n"), "\n\n")
	if len(events) != 5 {
		t.Fatalf("want role, 2 tokens, error, [DONE]; got %d events:\n%s", len(events), body)
	}
	var ev struct{ Error *openai.Error }
	if err := json.Unmarshal([]byte(strings.TrimPrefix(events[3], "data: ")), &ev); err != nil || ev.Error == nil {
		t.Fatalf("event 3 is not an error: %q", events[3])
	}
	if codeStr(ev.Error.Code) != openai.CodeUpstream || events[4] != "data: [DONE]" {
		t.Errorf("error event %+v, last %q", ev.Error, events[4])
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_requests_total", `code="502"`); v != 1 {
		t.Errorf("requests_total{code=502} = %v", v)
	}
}

func TestStreamEventKinds(t *testing.T) {
	e := newFakeEngine(t, "e0")
	_, url := startGateway(t, testConfig(sched.RoundRobin, e))
	c := testClient(t)

	// vLLM's mid-stream error event (integer code) is relayed and counted.
	e.mode.Store(int32(modeErrorEvent))
	_, direct := post(t, c, e.URL()+pathChat, streamBody(true))
	_, via := post(t, c, url+pathChat, streamBody(true))
	if !bytes.Equal(direct, via) || !bytes.Contains(via, []byte(`"code":500`)) {
		t.Errorf("error event not relayed as is:\n%s\n%s", direct, via)
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_requests_total", `code="502"`); v != 1 {
		t.Errorf("requests_total{code=502} = %v", v)
	}

	// Reasoning deltas are output: TTFT is taken at the first of them.
	e.mode.Store(int32(modeReasoning))
	post(t, c, url+pathChat, streamBody(false))
	m = scrape(t, c, url)
	if ttft, itl := m.value("infergate_time_to_first_token_seconds_count", ""), m.value("infergate_inter_token_latency_seconds_count", ""); ttft != 2 || itl != 4 {
		t.Errorf("TTFT count %v (want 2), ITL count %v (want 4)", ttft, itl)
	}
}

func TestTruncatedUpstream(t *testing.T) {
	e := newFakeEngine(t, "e0")
	_, url := startGateway(t, testConfig(sched.RoundRobin, e))
	c := testClient(t)

	// A stream that ends without [DONE] is reported, not passed off as whole.
	e.mode.Store(int32(modeNoDone))
	_, body := post(t, c, url+pathCompletions, `{"model":"m","prompt":"x","stream":true}`)
	if !bytes.Contains(body, []byte(`"code":"upstream_error"`)) || !bytes.HasSuffix(body, []byte("data: [DONE]\n\n")) {
		t.Errorf("stream without [DONE]:\n%s", body)
	}

	// A non-streaming body cut short has sent the client nothing (it is
	// held to its end): with no other endpoint to retry on, 502.
	e.mode.Store(int32(modeMidFail))
	resp, b := post(t, c, url+pathChat, chatBody)
	if oe := decodeError(t, b); resp.StatusCode != http.StatusBadGateway || codeStr(oe.Code) != openai.CodeUpstream {
		t.Errorf("truncated non-streaming body: %d %s, want 502 upstream_error", resp.StatusCode, b)
	}
	if v := scrape(t, c, url).value("infergate_requests_total", `code="502"`); v != 2 {
		t.Errorf("requests_total{code=502} = %v, want 2", v)
	}
}

func TestClientCancelCancelsUpstream(t *testing.T) {
	e := newFakeEngine(t, "e0")
	g, url := startGateway(t, testConfig(sched.RoundRobin, e))
	e.mode.Store(int32(modeHang))
	c := testClient(t)

	ctx, cancel := contextWithCancel(t)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+pathChat, strings.NewReader(streamBody(true)))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n') // the first event arrives before the engine hangs
	if err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first line %q: %v", line, err)
	}
	waitFor(t, "one request in flight", func() bool { return g.state.Load().endpoints[0].ledger.InFlight() == 1 })
	cancel()
	resp.Body.Close()
	select {
	case <-e.canceled:
	case <-time.After(5 * time.Second):
		t.Fatal("the engine never saw its request canceled")
	}
	waitFor(t, "in flight back to 0", func() bool { return g.state.Load().endpoints[0].ledger.InFlight() == 0 })
	waitFor(t, "a 499 recorded", func() bool {
		return scrape(t, c, url).value("infergate_requests_total", `code="499"`) == 1
	})
}

func TestReadinessAndEjection(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := testConfig(sched.Prefix, e)
	cfg.Outlier.ConsecutiveErrors = 1 // eject at the first lost connection
	g, url := startGateway(t, cfg)
	c := testClient(t)
	ready := func() int {
		resp, err := c.Get(url + pathReadyz)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	if s := ready(); s != 200 {
		t.Fatalf("readyz %d at start", s)
	}

	// Active health: a failing /health takes the endpoint out.
	e.down.Store(true)
	waitFor(t, "readyz 503 after failed health checks", func() bool { return ready() == 503 })
	resp, body := post(t, c, url+pathChat, chatBody)
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" || codeStr(decodeError(t, body).Code) != openai.CodeNoEndpoint {
		t.Errorf("no endpoint: %d Retry-After=%q %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	if v := scrape(t, c, url).value("infergate_endpoint_ready", ""); v != 0 {
		t.Errorf("endpoint_ready %v", v)
	}
	e.down.Store(false)
	waitFor(t, "readyz 200 after recovery", func() bool { return ready() == 200 })

	// Passive health: a lost connection answers 502 and (one error in a
	// row being the threshold here) ejects it.
	e.mode.Store(int32(modeDrop))
	resp, body = post(t, c, url+pathChat, chatBody)
	if resp.StatusCode != 502 || codeStr(decodeError(t, body).Code) != openai.CodeUpstream {
		t.Fatalf("dropped connection: %d %s", resp.StatusCode, body)
	}
	if g.state.Load().endpoints[0].ready.Load() || ready() != 503 {
		t.Error("endpoint not ejected after a connection failure")
	}
	if n := g.state.Load().endpoints[0].ledger.InFlight(); n != 0 {
		t.Errorf("in flight %d after failure", n)
	}
	e.mode.Store(int32(modeNormal))
	waitFor(t, "restored after the ejection period", func() bool { return ready() == 200 })
	if resp, _ := post(t, c, url+pathChat, chatBody); resp.StatusCode != 200 {
		t.Errorf("after restore: %d", resp.StatusCode)
	}
}

func TestEndpointDownAtStart(t *testing.T) {
	cfg := testConfig(sched.RoundRobin)
	cfg.Endpoints = []EndpointConfig{{URL: closedURL(t), Model: "m"}}
	g, url := startGateway(t, cfg)
	if g.state.Load().endpoints[0].ready.Load() {
		t.Error("unreachable endpoint is ready")
	}
	if got := g.Config().Endpoints[0]; got.KVBlocks != DefaultKVBlocks || got.BlockSize != 16 {
		t.Errorf("fallback capacity %+v", got)
	}
	resp, _ := post(t, testClient(t), url+pathChat, chatBody)
	if resp.StatusCode != 503 {
		t.Errorf("status %d, want 503", resp.StatusCode)
	}
}

func TestKVDiscovery(t *testing.T) {
	e := newFakeEngine(t, "e0")
	e.kvBlocks = 1234
	cfg := testConfig(sched.Prefix, e)
	cfg.Endpoints[0].KVBlocks = 0
	g, _ := startGateway(t, cfg)
	if got := g.Config().Endpoints[0]; got.KVBlocks != 1234 || got.BlockSize != 32 {
		t.Errorf("discovered %+v, want 1234 blocks of 32", got)
	}
}

func TestMetricsExposed(t *testing.T) {
	e := newFakeEngine(t, "e0")
	_, url := startGateway(t, testConfig(sched.Prefix, e))
	c := testClient(t)
	prompt := tokenPrompt(64, 0, 0)
	post(t, c, url+pathCompletions, prompt)
	post(t, c, url+pathCompletions, strings.Replace(prompt, `"prompt"`, `"stream":true,"prompt"`, 1))
	post(t, c, url+pathChat, `{"model":"nope","messages":[{"role":"user","content":"x"}]}`)
	m := scrape(t, c, url)
	for _, name := range []string{
		"infergate_requests_total",
		"infergate_time_to_first_token_seconds_bucket",
		"infergate_inter_token_latency_seconds_bucket",
		"infergate_e2e_request_latency_seconds_bucket",
		"infergate_prompt_tokens_total",
		"infergate_cached_prompt_tokens_total",
		"infergate_generation_tokens_total",
		"infergate_endpoint_in_flight_requests",
		"infergate_endpoint_ready",
		"infergate_prefix_predicted_matched_tokens_total",
	} {
		if !m.has(name) {
			t.Errorf("metric %s missing", name)
		}
	}
	if v := m.value("infergate_requests_total", `model="unknown"`); v != 1 {
		t.Errorf("unknown-model requests %v", v)
	}
	if v := m.value("infergate_prefix_predicted_matched_tokens_total", `policy="prefix"`); v != 64 {
		t.Errorf("predicted matched tokens %v, want 64", v)
	}
	if v := m.value("infergate_endpoint_ready", `endpoint="`+e.URL()+`"`); v != 1 {
		t.Errorf("endpoint_ready %v", v)
	}
}

func TestConcurrentRequests(t *testing.T) {
	engines := []*fakeEngine{newFakeEngine(t, "e0"), newFakeEngine(t, "e1"), newFakeEngine(t, "e2")}
	cfg := testConfig(sched.Prefix, engines...)
	// No active health checks: testConfig's probes (every 20 ms, 1 s
	// timeout) time out on a saturated host and eject healthy engines,
	// failing requests this test does not expect to fail (109 of 128
	// answered 200 at load average 10-17). Health is tested elsewhere.
	cfg.HealthCheckPath = "-"
	g, url := startGateway(t, cfg)
	c := testClient(t)
	var wg sync.WaitGroup
	errs := make(chan string, 256)
	for w := range 32 {
		wg.Go(func() {
			for i := range 4 {
				body := tokenPrompt(64+16*(w%4), 8, uint32(w*10+i))
				stream := (w+i)%2 == 0
				if stream {
					body = strings.Replace(body, `"prompt"`, `"stream":true,"prompt"`, 1)
				}
				resp, err := c.Post(url+pathCompletions, "application/json", strings.NewReader(body))
				if err != nil {
					errs <- err.Error()
					return
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				switch {
				case err != nil || resp.StatusCode != 200:
					errs <- fmt.Sprintf("status %d: %v %s", resp.StatusCode, err, b)
				case stream && (!bytes.HasSuffix(b, []byte("data: [DONE]\n\n")) || bytes.Contains(b, []byte(`"usage"`))):
					errs <- fmt.Sprintf("bad stream %s", b)
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	for _, ep := range g.state.Load().endpoints {
		if n := ep.ledger.InFlight(); n != 0 {
			t.Errorf("%s: %d in flight", ep.name, n)
		}
	}
	if v := scrape(t, c, url).value("infergate_requests_total", `code="200"`); v != 128 {
		t.Errorf("requests_total{code=200} = %v, want 128", v)
	}
}

// settledGoroutines is the goroutine count after a GC.
func settledGoroutines() int {
	runtime.GC()
	return runtime.NumGoroutine()
}

// requireGoroutinesBack fails the test, with every goroutine's stack,
// unless the goroutine count is back to before within 5 s.
func requireGoroutinesBack(t *testing.T, before int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	n := settledGoroutines()
	for n > before && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		n = settledGoroutines()
	}
	if n > before {
		buf := make([]byte, 1<<20)
		t.Fatalf("goroutines: %d before, %d after\n%s", before, n, buf[:runtime.Stack(buf, true)])
	}
}

func TestNoGoroutineLeak(t *testing.T) {
	before := settledGoroutines()
	func() {
		e := newEngineNoCleanup(t, "e0")
		defer e.srv.Close()
		g, err := New(context.Background(), testConfig(sched.Prefix, e), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer g.Close()
		srv := newServerNoCleanup(g.Handler())
		defer srv.Close()
		tr := &http.Transport{}
		defer tr.CloseIdleConnections()
		c := &http.Client{Transport: tr}
		post(t, c, srv.URL+pathChat, chatBody)
		post(t, c, srv.URL+pathChat, streamBody(false))
		e.mode.Store(int32(modeMidFail))
		post(t, c, srv.URL+pathChat, streamBody(true))
		e.mode.Store(int32(modeHang))
		ctx, cancel := contextWithCancel(t)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+pathChat, strings.NewReader(streamBody(true)))
		if resp, err := c.Do(req); err == nil {
			_, _ = bufio.NewReader(resp.Body).ReadString('\n')
			cancel()
			resp.Body.Close()
			<-e.canceled
		}
		cancel()
	}()
	requireGoroutinesBack(t, before)
}

func TestConfig(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	if err := os.WriteFile(good, []byte(`
listen: "0.0.0.0:9000"
routing:
  policy: prefix
  seed: 7
  prefix:
    block_size: 32
max_body_bytes: 1048576
connect_timeout: 2s
response_header_timeout: 5m
eject_duration: 30s
health_check_interval: 1s
health_check_path: /ping
endpoints:
  - url: http://10.0.0.1:8000/
    model: llama
    kv_blocks: 5000
  - url: https://10.0.0.2:8000
    model: llama
    block_size: 32
`), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(good)
	if err != nil {
		t.Fatal(err)
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if cfg.Listen != "0.0.0.0:9000" || cfg.Routing.Prefix.BlockSize != 32 || cfg.EjectDuration != 30*time.Second ||
		cfg.HealthCheckTimeout != DefaultHealthCheckTimeout || cfg.Endpoints[0].BlockSize != 16 || cfg.MaxBodyBytes != 1<<20 ||
		cfg.HealthCheckPath != "/ping" {
		t.Errorf("loaded %+v", cfg)
	}

	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("listen: x:1\nendpointz: []\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadConfig(bad); err == nil || !strings.Contains(err.Error(), "endpointz") {
		t.Errorf("unknown key: %v", err)
	}

	for name, mutate := range map[string]func(*Config){
		"no endpoints":     func(c *Config) { c.Endpoints = nil },
		"bad scheme":       func(c *Config) { c.Endpoints[0].URL = "ftp://x:1" },
		"no host":          func(c *Config) { c.Endpoints[0].URL = "http://" },
		"no model":         func(c *Config) { c.Endpoints[0].Model = "" },
		"duplicate":        func(c *Config) { c.Endpoints[1].URL = "http://10.0.0.1:8000" },
		"unknown policy":   func(c *Config) { c.Routing.Policy = "best" },
		"negative blocks":  func(c *Config) { c.Endpoints[0].KVBlocks = -1 },
		"bad listen":       func(c *Config) { c.Listen = "nope" },
		"bad health path":  func(c *Config) { c.HealthCheckPath = "health" },
		"negative timeout": func(c *Config) { c.ConnectTimeout = -time.Second },
	} {
		c := cfg
		c.Endpoints = append([]EndpointConfig(nil), cfg.Endpoints...)
		mutate(&c)
		if err := c.WithDefaults().Validate(); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestWithIncludeUsage(t *testing.T) {
	for in, want := range map[string]string{
		`{"model":"m","stream":true}`:       `{"model":"m","stream":true,"stream_options":{"include_usage":true}}`,
		"{\"model\":\"m\" , \"x\":[1]\n}\n": "{\"model\":\"m\" , \"x\":[1]\n,\"stream_options\":{\"include_usage\":true}}\n",
		`{ }`:                               `{ "stream_options":{"include_usage":true}}`,
		`{"stream_options":{"continuous_usage_stats":true,"include_usage":false},"a":"<b>"}`: `{"a":"<b>","stream_options":{"continuous_usage_stats":true,"include_usage":true}}`,
		`{"stream_options":null}`: `{"stream_options":{"include_usage":true}}`,
	} {
		got, err := withIncludeUsage(nil, []byte(in))
		if err != nil || string(got) != want {
			t.Errorf("withIncludeUsage(%s) = %s, %v; want %s", in, got, err, want)
		}
		if !json.Valid(got) {
			t.Errorf("withIncludeUsage(%s) is not valid JSON", in)
		}
	}
}

func TestAppendEvent(t *testing.T) {
	if got := string(appendEvent(nil, nil, []byte("a\nb"))); got != "data: a\ndata: b\n\n" {
		t.Errorf("got %q", got)
	}
}

// scraped is a parsed /metrics exposition.
type scraped []string

func scrape(t testing.TB, c *http.Client, url string) scraped {
	t.Helper()
	resp, err := c.Get(url + pathMetrics)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return strings.Split(string(b), "\n")
}

func (s scraped) has(name string) bool {
	for _, l := range s {
		if strings.HasPrefix(l, name+"{") || strings.HasPrefix(l, name+" ") {
			return true
		}
	}
	return false
}

// value sums the samples of name whose labels contain sel.
func (s scraped) value(name, sel string) float64 {
	sum := 0.0
	for _, l := range s {
		if !strings.HasPrefix(l, name+"{") && !strings.HasPrefix(l, name+" ") {
			continue
		}
		if !strings.Contains(l, sel) {
			continue
		}
		v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

func TestEjectionForgetsPrefixIndex(t *testing.T) {
	var downs atomic.Int32
	ep := &endpoint{}
	ep.onDown.Store(&[]func(){func() { downs.Add(1) }})
	ep.setReady(false) // never ready: no transition
	ep.setReady(true)
	ep.eject(time.Now(), time.Second)
	ep.eject(time.Now(), time.Second) // already out: no second call
	ep.setReady(true)
	ep.setReady(false)
	if n := downs.Load(); n != 2 {
		t.Fatalf("onDown ran %d times, want 2 (one per ready→unready transition)", n)
	}

	cfg := testConfig(sched.Prefix)
	cfg.Endpoints = []EndpointConfig{{URL: closedURL(t), Model: "m"}, {URL: closedURL(t), Model: "m"}}
	g, _ := startGateway(t, cfg)
	for i, e := range g.state.Load().endpoints {
		if n := len(*e.onDown.Load()); n != 1 {
			t.Errorf("endpoint %d has %d onDown hooks, want 1 (prefix policy forgets)", i, n)
		}
	}
}

func TestContentEncodingRejected(t *testing.T) {
	_, url := startGateway(t, testConfig(sched.RoundRobin, newFakeEngine(t, "e0")))
	req, _ := http.NewRequest(http.MethodPost, url+pathChat, strings.NewReader(chatBody))
	req.Header.Set("Content-Encoding", "gzip")
	resp, err := testClient(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnsupportedMediaType || !strings.Contains(string(body), `"error"`) {
		t.Fatalf("status %d body %s, want 415 OpenAI error", resp.StatusCode, body)
	}
}

func TestStalledBodyTimesOut(t *testing.T) {
	cfg := testConfig(sched.RoundRobin, newFakeEngine(t, "e0"))
	cfg.BodyReadTimeout = 200 * time.Millisecond
	_, url := startGateway(t, cfg)
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Promise 100 bytes, send 10, then stall.
	fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":", pathChat)
	_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no response to a stalled body: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(body), "request_timeout") {
		t.Fatalf("status %d body %s, want 408 request_timeout", resp.StatusCode, body)
	}
}

// TestRefusalWithUnsentBodyAnswered: a request that declares a body and
// sends none, refused before its body is read (no API key, wrong method,
// unknown path; a GET path, which reads no body), is answered at once and
// its connection closed; before,
// net/http waited to drain the body first and the client got no byte for
// as long as it kept the connection open (the attack run's 200 s). A
// refusal that does not close is still bounded by body_read_timeout.
func TestRefusalWithUnsentBodyAnswered(t *testing.T) {
	e, f := newFakeEngine(t, "e0"), newFakeEngine(t, "e1")
	_, url := startGateway(t, authConfig(t, e, f))
	for _, tc := range []struct{ name, head, want string }{
		{"no key", "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n", " 401 "},
		{"no key, chunked", "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", " 401 "},
		{"wrong method", "PUT /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + keyAlice + "\r\nContent-Length: 100000\r\n\r\n", " 405 "},
		{"unknown path", "POST /nowhere HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + keyAlice + "\r\nContent-Length: 100000\r\n\r\n", " 404 "},
		{"open GET path", "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n", " 200 "},
		{"metrics", "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n", " 200 "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := io.WriteString(conn, tc.head); err != nil {
				t.Fatal(err)
			}
			// Far below body_read_timeout (30 s): the answer must not wait for it.
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			b, err := io.ReadAll(conn) // to the close
			if err != nil {
				t.Fatalf("no answer and no close: %v (read %q)", err, b)
			}
			if !strings.HasPrefix(string(b), "HTTP/1.1"+tc.want) || (tc.want != " 200 " && !strings.Contains(string(b), `"error"`)) {
				t.Fatalf("answer %q, want%s with an OpenAI error", b, tc.want)
			}
		})
	}
}

// TestContentEncodingListsRejected: every field line and every member of
// Content-Encoding counts ("identity" then "br" is br).
func TestContentEncodingListsRejected(t *testing.T) {
	_, url := startGateway(t, testConfig(sched.RoundRobin, newFakeEngine(t, "e0")))
	for _, ce := range [][]string{{"identity", "br"}, {"identity, gzip"}, {"IDENTITY,  zstd "}} {
		req, _ := http.NewRequest(http.MethodPost, url+pathChat, strings.NewReader(chatBody))
		req.Header["Content-Encoding"] = ce
		resp, err := testClient(t).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnsupportedMediaType || !strings.Contains(string(body), `"error"`) {
			t.Errorf("Content-Encoding %q: status %d body %s, want 415", ce, resp.StatusCode, body)
		}
	}
	req, _ := http.NewRequest(http.MethodPost, url+pathChat, strings.NewReader(chatBody))
	req.Header["Content-Encoding"] = []string{"identity", " identity "}
	if resp, b := do(t, req); resp.StatusCode != 200 {
		t.Errorf("identity twice: %d %s", resp.StatusCode, b)
	}
}

func do(t *testing.T, req *http.Request) (*http.Response, []byte) {
	t.Helper()
	resp, err := testClient(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// TestInvalidUTF8Refused: a body that is not UTF-8 (here inside a message's
// content, and a lone surrogate's bytes) is refused 400, not sent on.
func TestInvalidUTF8Refused(t *testing.T) {
	e := newFakeEngine(t, "e0")
	_, url := startGateway(t, testConfig(sched.RoundRobin, e))
	c := testClient(t)
	for _, bad := range []string{"\xff\xfe", "\xed\xa0\x80", "caf\xc3"} {
		body := `{"model":"m","messages":[{"role":"user","content":"` + bad + `"}]}`
		resp, b := post(t, c, url+pathChat, body)
		if resp.StatusCode != 400 || !strings.Contains(string(b), "UTF-8") {
			t.Errorf("%q: %d %s", bad, resp.StatusCode, b)
		}
	}
	if n := e.requests.Load(); n != 0 {
		t.Errorf("engine got %d requests", n)
	}
}

func TestLoneSurrogate(t *testing.T) {
	for in, want := range map[string]bool{
		`{"a":"x"}`:                   false,
		`{"a":"\ud83d\ude00"}`:        false, // a pair: 😀
		`{"a":"\uD83D\uDE00 \u00e9"}`: false,
		`{"a":"\\ud800"}`:             false, // an escaped backslash, then text
		`{"a":"\"\u0041"}`:            false,
		`{"a":"\ud800"}`:              true,
		`{"a":"\ud800x"}`:             true,
		`{"a":"\ud800\u0041"}`:        true,
		`{"a":"\udc00\ud800"}`:        true,
		`{"a":"\ude00"}`:              true,
		`{"a":"\ud83d\ude00\udfff"}`:  true,
		`{"a":"\u12"}`:                false, // not JSON: the decoder refuses it
		`\`:                           false,
	} {
		if got := loneSurrogate([]byte(in)); got != want {
			t.Errorf("loneSurrogate(%s) = %v, want %v", in, got, want)
		}
	}
	e := newFakeEngine(t, "e0")
	_, url := startGateway(t, testConfig(sched.RoundRobin, e))
	resp, b := post(t, testClient(t), url+pathChat, `{"model":"m","messages":[{"role":"user","content":"\ud800"}]}`)
	if resp.StatusCode != 400 || !strings.Contains(string(b), "surrogate") || e.requests.Load() != 0 {
		t.Errorf("lone surrogate: %d %s, engine requests %d", resp.StatusCode, b, e.requests.Load())
	}
}

// FuzzLoneSurrogate: never panics, and what encoding/json writes for any
// valid UTF-8 string (escaping as it may) has no lone surrogate.
func FuzzLoneSurrogate(f *testing.F) {
	for _, s := range []string{`"\ud800"`, `"\ud83d\ude00"`, `\`, `\u`, `"\\\u"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		_ = loneSurrogate(b)
		if utf8.Valid(b) {
			enc, _ := json.Marshal(string(b))
			if loneSurrogate(enc) {
				t.Fatalf("%q encodes to %s, read as a lone surrogate", b, enc)
			}
		}
	})
}

// TestNewCanceled: New's context bounds its start-up reads and probes. An
// engine that never answers them held New for the whole health-check
// timeout (here a minute); canceled, New returns the context's error and
// leaves nothing running.
func TestNewCanceled(t *testing.T) {
	hold := make(chan struct{})
	var asked atomic.Int64
	silent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		<-hold
	}))
	t.Cleanup(silent.Close)
	t.Cleanup(func() { close(hold) })
	cfg := Config{Endpoints: []EndpointConfig{{URL: silent.URL, Model: "m"}}, HealthCheckTimeout: time.Minute}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		// Cancel once the start-up probe is waiting on the engine (or New
		// returned without probing: then the test fails below).
		for asked.Load() == 0 {
			select {
			case <-done:
				return
			case <-time.After(time.Millisecond):
			}
		}
		cancel()
	}()
	g, err := New(ctx, cfg, nil)
	close(done)
	if g != nil || !errors.Is(err, context.Canceled) {
		t.Fatalf("New with a canceled context: %v, %v; want nil and context.Canceled", g, err)
	}
	ctx, cancel = context.WithCancel(context.Background())
	cancel()
	if _, err := New(ctx, cfg, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("New with a context canceled before: %v", err)
	}
}
