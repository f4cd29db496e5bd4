package gateway

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

func TestRequestRateLimit(t *testing.T) {
	e := newFakeEngine(t, "e0")
	cfg := testConfig(sched.RoundRobin, e)
	if err := cfg.Auth.AddKeys("alice plain:"+keyAlice+" rpm=2; bob plain:"+keyBob, "test"); err != nil {
		t.Fatal(err)
	}
	_, url := startGateway(t, cfg)
	c := testClient(t)
	alice := []string{"Authorization", "Bearer " + keyAlice, "Content-Type", "application/json"}
	for i := range 2 {
		resp, b := send(t, c, http.MethodPost, url+pathChat, chatBody, alice...)
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
		if got := resp.Header.Get("X-Ratelimit-Remaining-Requests"); got != strconv.Itoa(1-i) {
			t.Errorf("request %d: remaining %q", i, got)
		}
		if resp.Header.Get("X-Ratelimit-Limit-Requests") != "2" || resp.Header.Get("X-Ratelimit-Reset-Requests") == "" {
			t.Errorf("request %d: headers %v", i, resp.Header)
		}
	}
	resp, b := send(t, c, http.MethodPost, url+pathChat, chatBody, alice...)
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("third request: %d %s", resp.StatusCode, b)
	}
	oe := decodeError(t, b)
	if codeStr(oe.Code) != codeRateLimitExceeded || oe.Type != "requests" || !strings.Contains(oe.Message, "alice") {
		t.Errorf("error %+v", oe)
	}
	ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	ms, _ := strconv.Atoi(resp.Header.Get("Retry-After-Ms"))
	if ra < 29 || ra > 31 || ms < 29000 || ms > 30000 {
		t.Errorf("Retry-After %q, -Ms %q: want ~30 s", resp.Header.Get("Retry-After"), resp.Header.Get("Retry-After-Ms"))
	}
	if resp.Header.Get("X-Ratelimit-Remaining-Requests") != "0" {
		t.Errorf("remaining %q on the 429", resp.Header.Get("X-Ratelimit-Remaining-Requests"))
	}
	if n := e.requests.Load(); n != 2 {
		t.Errorf("engine saw %d requests, want 2", n)
	}
	// Another key is not affected and, unlimited, gets no rate-limit headers.
	resp, _ = send(t, c, http.MethodPost, url+pathChat, chatBody, "Authorization", "Bearer "+keyBob)
	if resp.StatusCode != 200 || resp.Header.Get("X-Ratelimit-Limit-Requests") != "" {
		t.Errorf("bob: %d %v", resp.StatusCode, resp.Header)
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_rate_limited_total", `key="alice",limit="requests"`); v != 1 {
		t.Errorf("rate_limited_total = %v", v)
	}
	if v := m.value("infergate_requests_total", `code="429"`); v != 1 {
		t.Errorf("requests_total{429} = %v", v)
	}
}

func TestTokenRateLimit(t *testing.T) {
	e := newFakeEngine(t, "e0") // reports usage: 40 prompt + 3 completion = 43 tokens
	cfg := testConfig(sched.RoundRobin, e)
	if err := cfg.Auth.AddKeys("alice plain:"+keyAlice+" tpm=100", "test"); err != nil {
		t.Fatal(err)
	}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	alice := []string{"Authorization", "Bearer " + keyAlice, "Content-Type", "application/json"}
	// 40 token ids + max_tokens 10: charged 50 at admission, settled to the
	// 43 reported.
	ids := strings.TrimSuffix(strings.Repeat("7,", 40), ",")
	body := func(stream bool, maxTokens int) string {
		return fmt.Sprintf(`{"model":"m","prompt":[%s],"max_tokens":%d,"stream":%v}`, ids, maxTokens, stream)
	}
	level := func() float64 {
		_, tok := g.state.Load().keys.principals[0].Limits.Levels()
		return tok
	}
	near := func(got, want float64) bool { return got >= want-0.5 && got <= want+0.5 } // refill over the test's few ms

	resp, b := send(t, c, http.MethodPost, url+pathCompletions, body(false, 10), alice...)
	if resp.StatusCode != 200 || resp.Header.Get("X-Ratelimit-Remaining-Tokens") != "50" {
		t.Fatalf("first: %d remaining %q %s", resp.StatusCode, resp.Header.Get("X-Ratelimit-Remaining-Tokens"), b)
	}
	if l := level(); !near(l, 57) {
		t.Fatalf("level after usage settled: %v, want 57", l)
	}
	// A stream: the gateway asks for usage on the client's behalf and settles.
	resp, b = send(t, c, http.MethodPost, url+pathCompletions, body(true, 10), alice...)
	if resp.StatusCode != 200 || !strings.Contains(string(b), "[DONE]") {
		t.Fatalf("stream: %d %s", resp.StatusCode, b)
	}
	if l := level(); !near(l, 14) {
		t.Fatalf("level after the stream: %v, want 14", l)
	}
	resp, b = send(t, c, http.MethodPost, url+pathCompletions, body(false, 10), alice...)
	if resp.StatusCode != 429 {
		t.Fatalf("over the token limit: %d %s", resp.StatusCode, b)
	}
	if oe := decodeError(t, b); oe.Type != "tokens" || resp.Header.Get("Retry-After") != "22" {
		t.Errorf("token 429: %+v Retry-After %q (want 22: 36 tokens at 100/min)", oe, resp.Header.Get("Retry-After"))
	}
	// A request larger than the whole per-minute budget can never pass.
	resp, b = send(t, c, http.MethodPost, url+pathCompletions, body(false, 1000), alice...)
	if oe := decodeError(t, b); resp.StatusCode != 429 || !strings.Contains(oe.Message, "Request too large") || resp.Header.Get("Retry-After") != "" {
		t.Errorf("too large: %d %+v Retry-After %q", resp.StatusCode, oe, resp.Header.Get("Retry-After"))
	}
	if n := e.requests.Load(); n != 2 {
		t.Errorf("engine saw %d requests, want 2", n)
	}
}

func TestTokenEstimate(t *testing.T) {
	x := &exchange{}
	x.body = []byte(strings.Repeat("x", 400))
	mt, n := 20, 3
	x.chat = openai.ChatRequest{MaxTokens: &mt, N: &n}
	if got, asked := x.tokenEstimate(kindChat, 4096); got != 100+60 || asked != got {
		t.Errorf("chat: %v (asked %v), want 160", got, asked)
	}
	mc := 5
	x.chat.MaxCompletionTokens = &mc
	if got, _ := x.tokenEstimate(kindChat, 4096); got != 100+15 {
		t.Errorf("chat with max_completion_tokens: %v, want 115", got)
	}
	x.comp = openai.CompletionRequest{Prompt: openai.Prompt{Tokens: [][]uint32{{1, 2, 3}, {4, 5}}}, MaxTokens: &mt}
	if got, _ := x.tokenEstimate(kindCompletion, 4096); got != 5+40 {
		t.Errorf("token-id batch: %v, want 45", got)
	}
	// Without max_tokens the engine may fill the context: n × prompts
	// sequences of up to max_model_len tokens each, the prompt included.
	x.chat = openai.ChatRequest{N: &n}
	if got, asked := x.tokenEstimate(kindChat, 4096); got != 3*4096 || asked != 100 {
		t.Errorf("chat without max_tokens: %v (asked %v), want %d (asked 100)", got, asked, 3*4096)
	}
	x.comp.MaxTokens = nil
	if got, asked := x.tokenEstimate(kindCompletion, 4096); got != 2*4096 || asked != 5 {
		t.Errorf("token-id batch without max_tokens: %v (asked %v), want %d", got, asked, 2*4096)
	}
	if got, _ := x.tokenEstimate(kindCompletion, 2); got != 5 {
		t.Errorf("a prompt over the context: %v, want the prompt, 5", got)
	}
}

func TestHeaderLimits(t *testing.T) {
	cfg := testConfig(sched.RoundRobin, newFakeEngine(t, "e0"))
	cfg.MaxHeaderBytes = 4096
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	srv := g.Server()
	if srv.ReadHeaderTimeout != DefaultReadHeaderTimeout || srv.IdleTimeout != DefaultIdleTimeout ||
		srv.WriteTimeout != 0 || srv.MaxHeaderBytes != 8192 {
		t.Fatalf("server limits: %+v", srv)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	url := "http://" + ln.Addr().String()
	c := testClient(t)

	// Over the limit: an OpenAI-format 431.
	resp, b := send(t, c, http.MethodPost, url+pathChat, chatBody, "X-Big", strings.Repeat("a", 5000))
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge || codeStr(decodeError(t, b).Code) != codeHeaderTooLarge {
		t.Fatalf("5000-byte header: %d %s", resp.StatusCode, b)
	}
	// Far over it: net/http's own plain-text 431 before the handler.
	resp, b = send(t, c, http.MethodPost, url+pathChat, chatBody, "X-Big", strings.Repeat("a", 20000))
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("20000-byte header: %d %s", resp.StatusCode, b)
	}
	// Under it: served.
	resp, b = send(t, c, http.MethodPost, url+pathChat, chatBody, "X-Big", strings.Repeat("a", 3000))
	if resp.StatusCode != 200 {
		t.Fatalf("3000-byte header: %d %s", resp.StatusCode, b)
	}
}

func TestEdgeConfig(t *testing.T) {
	base := testConfig(sched.RoundRobin, newFakeEngine(t, "e0")).WithDefaults()
	if base.MaxHeaderBytes != DefaultMaxHeaderBytes || base.WriteTimeout != DefaultWriteTimeout {
		t.Fatalf("defaults: %+v", base.EdgeConfig)
	}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"header limit", func(c *Config) { c.MaxHeaderBytes = 10 }, "max_header_bytes"},
		{"trusted proxy", func(c *Config) { c.TrustedProxies = []string{"10.0.0.0/33"} }, "trusted_proxies"},
		{"tls half", func(c *Config) { c.TLS.CertFile = "x.pem" }, "together"},
		{"tls version", func(c *Config) { c.TLS = TLSConfig{CertFile: "a", KeyFile: "b", MinVersion: "1.1"} }, "min_version"},
		{"idle", func(c *Config) { c.IdleTimeout = -1 }, "idle_timeout"},
	} {
		c := base
		tc.mod(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
	c := base
	c.TrustedProxies = []string{"10.0.0.0/8", "192.168.1.7", "::1"}
	if err := c.Validate(); err != nil {
		t.Errorf("valid trusted proxies: %v", err)
	}

	// The edge keys are top-level YAML keys and unknown ones still fail.
	cfgYAML := "listen: 127.0.0.1:0\nmax_header_bytes: 8192\nwrite_timeout: 5s\ntrusted_proxies: [10.0.0.0/8]\n" +
		"auth: {keys_file: /etc/keys, protect_metrics: true}\ntls: {cert_file: c.pem, key_file: k.pem}\n" +
		"endpoints: [{url: 'http://127.0.0.1:1', model: m}]\n"
	path := t.TempDir() + "/c.yaml"
	if err := writeFile(path, cfgYAML); err != nil {
		t.Fatal(err)
	}
	lc, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if lc.MaxHeaderBytes != 8192 || lc.WriteTimeout != 5*time.Second || lc.Auth.KeysFile != "/etc/keys" ||
		!lc.Auth.ProtectMetrics || lc.TLS.KeyFile != "k.pem" || len(lc.TrustedProxies) != 1 {
		t.Errorf("loaded %+v", lc.EdgeConfig)
	}
	if err := writeFile(path, cfgYAML+"auth_typo: 1\n"); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadConfig(path); err == nil {
		t.Error("unknown key accepted")
	}
}

// TestStalledClientDropped: a client that stops reading a stream is
// disconnected after write_timeout and its upstream request canceled, so it
// cannot hold an engine slot.
func TestStalledClientDropped(t *testing.T) {
	canceled := make(chan struct{}, 1)
	event := "data: {\"choices\":[{\"index\":0,\"text\":\"" + strings.Repeat("x", 32<<10) + "\"}]}\n\n"
	eng := newServerNoCleanup(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != pathCompletions {
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for r.Context().Err() == nil {
			if _, err := io.WriteString(w, event); err != nil {
				break
			}
			_ = rc.Flush()
		}
		canceled <- struct{}{}
	}))
	defer eng.Close()
	cfg := testConfig(sched.RoundRobin)
	cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000}}
	cfg.HealthCheckPath = healthCheckOff
	cfg.WriteTimeout = 300 * time.Millisecond
	g, url := startGateway(t, cfg)

	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.(*net.TCPConn).SetReadBuffer(4096)
	body := `{"model":"m","prompt":"x","stream":true}`
	fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", pathCompletions, len(body), body)
	br := bufio.NewReader(conn)
	if _, err := br.ReadString('\n'); err != nil { // the status line, then stop reading
		t.Fatal(err)
	}
	select {
	case <-canceled:
	case <-time.After(20 * time.Second):
		t.Fatal("the upstream stream was not canceled after the client stalled")
	}
	waitFor(t, "in flight back to 0", func() bool { return g.state.Load().endpoints[0].ledger.InFlight() == 0 })
}

func writeFile(path, s string) error { return os.WriteFile(path, []byte(s), 0o600) }

// TestBodyBufferGrowsWithBody: a request body's buffer grows with the bytes
// that arrived, not with the Content-Length the client declared. Before, a
// header block declaring 16 MiB (max_body_bytes) and a one-byte body had
// readBody allocate 16 MiB for the connection's body_read_timeout (400 such
// connections, 100 bytes sent each: 3 GB RSS, 15 GB of heap).
func TestBodyBufferGrowsWithBody(t *testing.T) {
	const limit = 16 << 20
	read := func(body []byte, declared int64) (*exchange, *openai.Error) {
		x := &exchange{}
		r := httptest.NewRequest(http.MethodPost, pathChat, bytes.NewReader(body))
		r.ContentLength = declared
		return x, x.readBody(httptest.NewRecorder(), r, limit, time.Minute, unboundedBodies(), unboundedBodies())
	}
	// Declared near the limit, one byte sent (the reader ends early, as a
	// client that stops sending does until the deadline).
	x, e := read([]byte("{"), limit-1)
	if e != nil {
		t.Fatalf("one byte: %v", e)
	}
	if cap(x.body) > bodyGrowMin {
		t.Errorf("one byte of a declared %d: buffer of %d bytes, want at most %d", limit-1, cap(x.body), bodyGrowMin)
	}
	// Whole bodies, declared and chunked (-1), read intact, the buffer
	// within twice the body (declared: within the body and the end's byte).
	for _, tc := range []struct {
		n        int
		declared bool
	}{{0, true}, {1, true}, {bodyGrowMin, true}, {bodyGrowMin + 1, false}, {3 << 20, true}, {3 << 20, false}, {limit, true}} {
		body := bytes.Repeat([]byte("a"), tc.n)
		declared := int64(-1)
		if tc.declared {
			declared = int64(tc.n)
		}
		x, e := read(body, declared)
		if e != nil {
			t.Fatalf("%d bytes (declared %d): %v", tc.n, declared, e)
		}
		if !bytes.Equal(x.body, body) {
			t.Fatalf("%d bytes (declared %d): read %d bytes, not the body", tc.n, declared, len(x.body))
		}
		bound := max(2*tc.n, bodyGrowMin)
		if tc.declared {
			bound = tc.n + 1
		}
		if cap(x.body) > bound {
			t.Errorf("%d bytes (declared %d): buffer of %d bytes, want at most %d", tc.n, declared, cap(x.body), bound)
		}
	}
	// A limit near MaxInt64 (validation now refuses it as max_body_bytes, but
	// readBody must not trust it) and a client declaring as much: the buffer stays small
	// (before, make of the declared length panicked or, at 1 TiB, the
	// runtime died out of memory: not recoverable).
	for _, declared := range []int64{math.MaxInt64, 1 << 40} {
		x := &exchange{}
		r := httptest.NewRequest(http.MethodPost, pathChat, strings.NewReader("{"))
		r.ContentLength = declared
		if e := x.readBody(httptest.NewRecorder(), r, math.MaxInt64, time.Minute, unboundedBodies(), unboundedBodies()); e != nil || string(x.body) != "{" || cap(x.body) > bodyGrowMin {
			t.Errorf("declared %d under an unbounded limit: %v, %q in a buffer of %d bytes", declared, e, x.body, cap(x.body))
		}
	}
	// Over the limit, chunked: still 413.
	if _, e := read(bytes.Repeat([]byte(" "), limit+1), -1); e == nil || e.Status != http.StatusRequestEntityTooLarge {
		t.Fatalf("over the limit: %v, want 413", e)
	}
}
