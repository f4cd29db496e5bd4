package gateway

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/sched"
)

// withAccessLog turns the access log on in cfg, to a file in a temporary
// directory, in format; it returns the file's path.
func withAccessLog(t *testing.T, cfg *Config, format string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "access.log")
	on := true
	cfg.AccessLog = AccessLogConfig{Enabled: &on, Path: path}
	cfg.Log.Format = format
	return path
}

// accessLines reads a JSON access log: one object per line, by request id
// (lines without one under "").
func accessLines(t *testing.T, path string) map[string][]map[string]any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]map[string]any{}
	for _, l := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
		if l == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("access line is not one JSON object: %v: %q", err, l)
		}
		if m["level"] != "INFO" || m["msg"] != "request" {
			t.Errorf("line %q: want level INFO, msg request", l)
		}
		if _, err := time.Parse(time.RFC3339Nano, m["time"].(string)); err != nil {
			t.Errorf("line %q: time: %v", l, err)
		}
		id, _ := m["id"].(string)
		out[id] = append(out[id], m)
	}
	return out
}

// postID sends body to the gateway with X-Request-Id id, the API key (if
// any) and extra header pairs.
func postID(t *testing.T, c *http.Client, url, id, key, body string, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	h := append([]string{"X-Request-Id", id}, hdr...)
	if key != "" {
		h = append(h, "Authorization", "Bearer "+key)
	}
	return post(t, c, url, body, h...)
}

// TestAccessLogOutcomes drives requests of every outcome through a gateway
// with the access log on and checks each one's line: 200s (one retried
// from an endpoint that refuses connections to the one that answers),
// a stream with its TTFT and usage, 401, 400, 404, a key's 429, a client
// that goes away mid-stream (499), an engine 5xx answered as a 502 (no
// endpoint left to retry on), a stream that fails midway (502), GET
// /v1/models; the keys themselves never appear; per-key counters (metrics
// and dashboard state).
func TestAccessLogOutcomes(t *testing.T) {
	e := newFakeEngine(t, "e1")
	cfg := testConfig(sched.RoundRobin, e)
	cfg.HealthCheckPath = healthCheckOff                                  // the dead endpoint stays in rotation until it refuses…
	cfg.EjectDuration, cfg.Outlier.MaxEjectionTime = time.Hour, time.Hour // …and is out for the rest of the test
	cfg.Endpoints = append([]EndpointConfig{{URL: closedURL(t), Model: "m", KVBlocks: 1000}}, cfg.Endpoints...)
	const keyA, keyB = "sk-team-a-0123456789abcdef", "sk-team-b-fedcba9876543210"
	cfg.Auth.Keys = []auth.Key{{Name: "team-a", Hash: auth.HashKey(keyA)}, {Name: "team-b", Hash: auth.HashKey(keyB), RequestsPerMinute: 1}}
	path := withAccessLog(t, &cfg, LogFormatJSON)
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	g.clock = func() time.Time { return time.Unix(1e9, 0) } // no refill: team-b's second request is over its limit
	srv := httptest.NewServer(g.Handler())
	defer srv.Close()
	c := testClient(t)
	chatURL := srv.URL + pathChat
	chat := `{"model":"m","messages":[{"role":"user","content":"Hi"}],"max_tokens":3}`
	stream := `{"model":"m","messages":[{"role":"user","content":"Hi"}],"max_tokens":3,"stream":true}`

	for _, id := range []string{"ok-1", "ok-2"} {
		if resp, b := postID(t, c, chatURL, id, keyA, chat, "User-Agent", "test-agent/1.0"); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", id, resp.StatusCode, b)
		}
	}
	if resp, b := postID(t, c, chatURL, "stream", keyA, stream); resp.StatusCode != 200 || !bytes.Contains(b, []byte("[DONE]")) {
		t.Fatalf("stream: %d %s", resp.StatusCode, b)
	}
	for _, r := range []struct{ id, key, body string }{
		{"noauth", "", chat}, {"badjson", keyA, "{"}, {"unknown-model", keyA, `{"model":"nope","messages":[{"role":"user","content":"x"}]}`},
		{"rl-1", keyB, chat}, {"rl-2", keyB, chat},
	} {
		postID(t, c, chatURL, r.id, r.key, r.body)
	}
	e.mode.Store(int32(modeError500)) // no endpoint left to retry on: the failure is answered
	if resp, b := postID(t, c, chatURL, "fail-500", keyA, chat); resp.StatusCode != 502 {
		t.Fatalf("fail-500: %d %s", resp.StatusCode, b)
	}
	e.mode.Store(int32(modeMidFail))
	if resp, b := postID(t, c, chatURL, "midfail", keyA, stream); resp.StatusCode != 200 || !bytes.Contains(b, []byte("upstream_error")) {
		t.Fatalf("midfail: %d %s", resp.StatusCode, b)
	}
	e.mode.Store(int32(modeHang))
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, chatURL, strings.NewReader(stream))
	req.Header.Set("X-Request-Id", "gone")
	req.Header.Set("Authorization", "Bearer "+keyA)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil { // the first output is out
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	<-e.canceled // the gateway saw the client go
	e.mode.Store(int32(modeNormal))
	mreq, _ := http.NewRequest(http.MethodGet, srv.URL+pathModels, nil)
	mreq.Header.Set("Authorization", "Bearer "+keyA)
	mreq.Header.Set("X-Request-Id", "models")
	if resp, err := c.Do(mreq); err != nil || resp.StatusCode != 200 {
		t.Fatalf("models: %v", err)
	} else {
		resp.Body.Close()
	}
	// Refusals on the gateway's own paths name their error too.
	for _, m := range []struct{ id, path, key string }{{"models-noauth", pathModels, ""}, {"models-nope", pathModels + "/nope", keyA}} {
		req, _ := http.NewRequest(http.MethodGet, srv.URL+m.path, nil)
		if m.key != "" {
			req.Header.Set("Authorization", "Bearer "+m.key)
		}
		req.Header.Set("X-Request-Id", m.id)
		if resp, err := c.Do(req); err != nil {
			t.Fatalf("%s: %v", m.id, err)
		} else {
			resp.Body.Close()
		}
	}
	waitFor(t, "the 499 to be counted", func() bool {
		return scrape(t, c, srv.URL).value("infergate_requests_total", `code="499"`) == 1
	})
	s := scrape(t, c, srv.URL)
	st := g.DashboardState(time.Now())
	if want := []DashKey{{"team-a", 8, 120, 96, 9}, {"team-b", 2, 40, 32, 3}}; !slices.Equal(st.Keys, want) {
		t.Errorf("dashboard state keys %+v, want %+v", st.Keys, want)
	}
	srv.Close()
	g.Close() // writes the last lines

	raw, _ := os.ReadFile(path)
	for _, k := range []string{keyA, keyB, auth.HashKey(keyA)} {
		if bytes.Contains(raw, []byte(k)) {
			t.Fatalf("the access log holds a key or its hash:\n%s", raw)
		}
	}
	lines := accessLines(t, path)
	one := func(id string) map[string]any {
		t.Helper()
		if len(lines[id]) != 1 {
			t.Fatalf("request %s: %d access lines, want 1: %v", id, len(lines[id]), lines[id])
		}
		return lines[id][0]
	}
	expect := func(id string, want map[string]any) map[string]any {
		t.Helper()
		l := one(id)
		for k, v := range want {
			if v == nil {
				if _, ok := l[k]; ok {
					t.Errorf("%s: %s = %v, want absent", id, k, l[k])
				}
				continue
			}
			if got := l[k]; got != v {
				t.Errorf("%s: %s = %v (%T), want %v (%T); line %v", id, k, got, got, v, v, l)
			}
		}
		return l
	}
	ep := e.URL()
	retried := 0
	for _, id := range []string{"ok-1", "ok-2"} {
		l := expect(id, map[string]any{"status": 200.0, "method": "POST", "path": pathChat, "key": "team-a", "model": "m",
			"stream": false, "endpoint": ep, "policy": sched.RoundRobin, "prompt_tokens": 40.0, "cached_tokens": 32.0,
			"output_tokens": 3.0, "client": "127.0.0.1", "user_agent": "test-agent/1.0", "ttft_seconds": nil, "error": nil})
		if l["attempts"] == 2.0 {
			retried++
		} else if l["attempts"] != 1.0 {
			t.Errorf("%s: attempts %v", id, l["attempts"])
		}
		if d, _ := l["duration_seconds"].(float64); d <= 0 {
			t.Errorf("%s: duration_seconds %v", id, l["duration_seconds"])
		}
		if b, _ := l["bytes"].(float64); b < 100 {
			t.Errorf("%s: bytes %v", id, l["bytes"])
		}
	}
	if retried != 1 {
		t.Errorf("%d of ok-1, ok-2 retried, want 1 (one was sent to the endpoint that refuses)", retried)
	}
	l := expect("stream", map[string]any{"status": 200.0, "stream": true, "attempts": 1.0, "prompt_tokens": 40.0,
		"cached_tokens": 32.0, "output_tokens": 3.0, "endpoint": ep})
	if ttft, _ := l["ttft_seconds"].(float64); ttft <= 0 || ttft > l["duration_seconds"].(float64) {
		t.Errorf("stream: ttft_seconds %v, duration %v", l["ttft_seconds"], l["duration_seconds"])
	}
	expect("noauth", map[string]any{"status": 401.0, "error": "invalid_api_key", "key": nil, "model": nil, "attempts": nil})
	expect("badjson", map[string]any{"status": 400.0, "error": "invalid_json", "key": "team-a", "model": nil, "endpoint": nil})
	expect("unknown-model", map[string]any{"status": 404.0, "error": "model_not_found", "model": "nope", "endpoint": nil, "attempts": nil})
	expect("rl-1", map[string]any{"status": 200.0, "key": "team-b", "endpoint": ep})
	expect("rl-2", map[string]any{"status": 429.0, "key": "team-b", "error": "rate_limit_exceeded", "attempts": nil, "endpoint": nil})
	expect("midfail", map[string]any{"status": 502.0, "error": "upstream_error", "endpoint": ep, "attempts": 1.0})
	expect("fail-500", map[string]any{"status": 502.0, "error": "upstream_error", "endpoint": ep, "attempts": 1.0, "prompt_tokens": nil})
	expect("gone", map[string]any{"status": 499.0, "endpoint": ep, "key": "team-a"})
	expect("models", map[string]any{"status": 200.0, "method": "GET", "path": pathModels, "key": "team-a", "model": nil})
	expect("models-noauth", map[string]any{"status": 401.0, "path": pathModels, "error": "invalid_api_key", "key": nil})
	expect("models-nope", map[string]any{"status": 404.0, "path": pathModels + "/nope", "error": "model_not_found", "key": "team-a"})
	if n := len(lines); n != 14 {
		t.Errorf("%d request ids in the log, want 14: %v", n, lines)
	}

	// Per-key usage: every inference request with the key, tokens of those
	// that reported usage (ok-1, ok-2, stream; rl-1).
	for _, c := range []struct {
		name, key string
		want      float64
	}{
		{"infergate_key_requests_total", "team-a", 8}, {"infergate_key_requests_total", "team-b", 2},
		{"infergate_key_prompt_tokens_total", "team-a", 120}, {"infergate_key_cached_prompt_tokens_total", "team-a", 96},
		{"infergate_key_generation_tokens_total", "team-a", 9}, {"infergate_key_prompt_tokens_total", "team-b", 40},
	} {
		if got := s.value(c.name, `key="`+c.key+`"`); got != c.want {
			t.Errorf("%s{key=%q} = %v, want %v", c.name, c.key, got, c.want)
		}
	}
}

// TestAccessLogText checks the text format: slog's key=value layout, values
// quoted when they hold spaces, quotes or control bytes, one line per
// request whatever the client sent.
func TestAccessLogText(t *testing.T) {
	e := newFakeEngine(t, "e1")
	cfg := testConfig(sched.RoundRobin, e)
	path := withAccessLog(t, &cfg, LogFormatText)
	g, url := startGateway(t, cfg)
	c := testClient(t)
	evil := "ev\"il level=ERROR msg=forged \xff" // net/http refuses control bytes in a header
	postID(t, c, url+pathChat, "t-1", "", `{"model":"m","messages":[{"role":"user","content":"x"}]}`, "User-Agent", evil)
	postID(t, c, url+pathChat, "t-2", "", `{"model":"`+strings.Repeat("é", 300)+`","messages":[{"role":"user","content":"x"}]}`)
	g.Close()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
	if len(lines) != 2 {
		t.Fatalf("%d lines, want 2:\n%s", len(lines), b)
	}
	for i, l := range lines {
		if !strings.HasPrefix(l, "time=") || !strings.Contains(l, " level=INFO msg=request id=t-"+strconv.Itoa(i+1)+" method=POST path=/v1/chat/completions status=") {
			t.Errorf("line %d: %q", i, l)
		}
	}
	if want := `user_agent=` + strconv.Quote(evil); !strings.HasSuffix(lines[0], want) {
		t.Errorf("line 0 %q: want it to end with %s", lines[0], want)
	}
	if !strings.Contains(lines[1], ` status=404 `) || !strings.Contains(lines[1], `model="`+strings.Repeat("é", 128)+`"`) {
		t.Errorf("line 1 %q: want status=404 and the model cut to 256 bytes", lines[1])
	}
}

// TestAccessLogOff: without access_log.enabled (and without tracing) the
// handler is the plain router and nothing is written.
func TestAccessLogOff(t *testing.T) {
	e := newFakeEngine(t, "e1")
	cfg := testConfig(sched.RoundRobin, e)
	g, url := startGateway(t, cfg)
	if g.obs != nil {
		t.Fatal("observer built with the access log and tracing off")
	}
	resp, _ := post(t, testClient(t), url+pathChat, `{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	if resp.StatusCode != 200 || resp.Header.Get(EndpointHeader) != "" {
		t.Fatalf("status %d, %s %q", resp.StatusCode, EndpointHeader, resp.Header.Get(EndpointHeader))
	}
}

// TestServedByHeader: with response_headers.endpoint the answer names the
// endpoint that served it — after a retry the one that answered; an
// engine cannot set it (X-Infergate-* from engines is dropped).
func TestServedByHeader(t *testing.T) {
	e := newFakeEngine(t, "e1")
	forger := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(EndpointHeader, "http://forged")
		e.ServeHTTP(w, r)
	}))
	defer forger.Close()
	for _, on := range []bool{true, false} {
		cfg := testConfig(sched.RoundRobin)
		cfg.HealthCheckPath = healthCheckOff
		cfg.EjectDuration, cfg.Outlier.MaxEjectionTime = time.Hour, time.Hour
		cfg.Endpoints = []EndpointConfig{{URL: closedURL(t), Model: "m", KVBlocks: 1000}, {URL: forger.URL, Model: "m", KVBlocks: 1000}}
		cfg.ResponseHeaders.Endpoint = on
		_, url := startGateway(t, cfg)
		c := testClient(t)
		want := []string{forger.URL}
		if !on {
			want = nil
		}
		for i, r := range []struct{ path, body string }{
			{pathChat, `{"model":"m","messages":[{"role":"user","content":"x"}]}`},
			{pathChat, `{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}`},
			{pathCompletions, `{"model":"m","prompt":"x"}`},
		} {
			resp, b := post(t, c, url+r.path, r.body)
			if got := resp.Header.Values(EndpointHeader); resp.StatusCode != 200 || !slices.Equal(got, want) {
				t.Errorf("on=%v request %d: %d, %s = %q, want %q: %s", on, i, resp.StatusCode, EndpointHeader, got, want, b)
			}
		}
		resp, _ := post(t, c, url+pathChat, `{"model":"nope","messages":[{"role":"user","content":"x"}]}`)
		if v := resp.Header.Values(EndpointHeader); resp.StatusCode != 404 || v != nil {
			t.Errorf("on=%v, refused before any endpoint: %d %s = %q", on, resp.StatusCode, EndpointHeader, v)
		}
	}
}

func TestClientAddr(t *testing.T) {
	trusted, err := parseTrusted([]string{"10.0.0.0/8", "::1"})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		remote string
		xff    []string
		want   string
	}{
		{"192.0.2.7:5555", nil, "192.0.2.7"},
		{"192.0.2.7:5555", []string{"198.51.100.1"}, "192.0.2.7"}, // untrusted peer: its XFF is the client's word
		{"10.1.2.3:80", []string{"198.51.100.1"}, "198.51.100.1"},
		{"10.1.2.3:80", []string{"203.0.113.9, 198.51.100.1, 10.9.9.9"}, "198.51.100.1"}, // right-most untrusted
		{"10.1.2.3:80", []string{"203.0.113.9", "10.9.9.9, 10.8.8.8"}, "203.0.113.9"},    // across header lines
		{"10.1.2.3:80", []string{"10.9.9.9"}, "10.9.9.9"},                                // all trusted: the left-most
		{"10.1.2.3:80", nil, "10.1.2.3"},
		{"10.1.2.3:80", []string{"198.51.100.1:4711"}, "198.51.100.1"},
		{"10.1.2.3:80", []string{"[2001:db8::1]:4711"}, "2001:db8::1"},
		{"10.1.2.3:80", []string{"unknown"}, "unknown"},
		{"[::1]:80", []string{"2001:db8::2"}, "2001:db8::2"},
		{"[::ffff:10.0.0.1]:80", []string{"192.0.2.1"}, "192.0.2.1"},
		{"[2001:db8::5]:80", nil, "2001:db8::5"},
		{"@", nil, "@"}, // a unix socket's peer
	} {
		r := httptest.NewRequest(http.MethodGet, "/v1/models", nil)
		r.RemoteAddr = c.remote
		for _, v := range c.xff {
			r.Header.Add("X-Forwarded-For", v)
		}
		if got := clientAddr(r, trusted); got != c.want {
			t.Errorf("clientAddr(%s, XFF %q) = %q, want %q", c.remote, c.xff, got, c.want)
		}
	}
}

// blockingWriter blocks every Write until released.
type blockingWriter struct {
	release chan struct{}
	mu      sync.Mutex
	buf     bytes.Buffer
}

func (w *blockingWriter) Write(p []byte) (int, error) {
	<-w.release
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.Write(p)
}

// TestAccessSinkBounded: a sink that blocks never blocks the lines' writers;
// what does not fit the buffer is dropped and counted, the rest is written
// once the sink moves again, in order, each line whole.
func TestAccessSinkBounded(t *testing.T) {
	bw := &blockingWriter{release: make(chan struct{})}
	s, err := startAccessSink(bw, nil, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	line := []byte(strings.Repeat("x", 1023) + "\n")
	n := 2*accessLogBuffer/len(line) + 10
	for range n { // with the writer stuck in its first write, at most two buffers' worth is held
		s.write(line)
	}
	close(bw.release)
	s.close()
	dropped := testutil.ToFloat64(s.droppedFull)
	written := bw.buf.Len() / len(line)
	if dropped == 0 || int(dropped)+written != n || bw.buf.Len()%len(line) != 0 {
		t.Fatalf("%d lines: %v dropped, %d written (%d bytes)", n, dropped, written, bw.buf.Len())
	}
	if written < accessLogBuffer/len(line) {
		t.Errorf("%d written, want at least a buffer's worth (%d)", written, accessLogBuffer/len(line))
	}
}

// TestAccessSinkWriteError counts the lines of a failed write.
func TestAccessSinkWriteError(t *testing.T) {
	reg := prometheus.NewRegistry()
	s, err := newAccessSink(filepath.Join(t.TempDir(), "a.log"), reg)
	if err != nil {
		t.Fatal(err)
	}
	_ = s.file.Close() // every write fails
	for range 3 {
		s.write([]byte("line\n"))
	}
	s.close()
	if got := testutil.ToFloat64(s.droppedWrite); got != 3 {
		t.Fatalf("write errors: %v lines dropped, want 3", got)
	}
}

// BenchmarkAccessLine measures one access line's cost on the request path:
// encoding it and handing it to the sink (the writer's syscall is not on
// the request path).
func BenchmarkAccessLine(b *testing.B) {
	for _, format := range []string{LogFormatJSON, LogFormatText} {
		b.Run(format, func(b *testing.B) {
			s, err := newAccessSink(os.DevNull, prometheus.NewRegistry())
			if err != nil {
				b.Fatal(err)
			}
			defer s.close()
			r := httptest.NewRequest(http.MethodPost, pathChat, nil)
			r.Header.Set("User-Agent", "OpenAI/Python 1.54.3")
			rm := &routeMetrics{labels: [3]string{"meta-llama/Llama-3.1-70B-Instruct", "http://10.0.0.7:8000", "cache-aware"}}
			ow := &obsWriter{ResponseWriter: &discardWriter{h: http.Header{"X-Request-Id": {"ig-1a2b3c4d5e6f-2x"}}},
				start: time.Now(), code: 200, rm: rm, model: rm.labels[0], decoded: true, stream: true, attempts: 1,
				ttft: 180 * time.Millisecond, usage: true, prompt: 2048, cached: 1536, output: 128, bytes: 9000}
			var trusted []netip.Prefix
			b.ReportAllocs()
			for b.Loop() {
				ow.line = ow.appendLine(ow.line[:0], r, 200, time.Now(), format == LogFormatJSON, trusted)
				s.write(ow.line)
			}
			b.SetBytes(int64(len(ow.line)))
		})
	}
}

// FuzzClientAddr: for any peer address and X-Forwarded-For, clientAddr
// answers one hop of what it was given — the peer's host, or one trimmed
// entry of the header (no comma, no surrounding space) — and the peer's
// own host whenever the peer is not trusted.
func FuzzClientAddr(f *testing.F) {
	for _, s := range [][2]string{
		{"10.1.2.3:80", "203.0.113.9, 198.51.100.1, 10.9.9.9"}, {"192.0.2.7:1", "198.51.100.1"}, {"10.0.0.1:1", ", ,,"},
		{"[::1]:80", "[2001:db8::1]:4711, unknown"}, {"10.0.0.1:1", "10.0.0.2,10.0.0.3"}, {"@", ""}, {"", "1.2.3.4"},
		{"10.0.0.1:1", strings.Repeat("10.0.0.9, ", 1000)}, {"[::ffff:10.0.0.1]:1", "\xff\x00, 1.1.1.1"},
	} {
		f.Add(s[0], s[1])
	}
	trusted, _ := parseTrusted([]string{"10.0.0.0/8", "::1/128"})
	f.Fuzz(func(t *testing.T, remote, xff string) {
		r := &http.Request{RemoteAddr: remote, Header: http.Header{"X-Forwarded-For": {xff}}}
		got := clientAddr(r, trusted)
		peer := hostOf(remote)
		a, err := netip.ParseAddr(peer)
		if err != nil || !isTrusted(a.Unmap(), trusted) {
			if got != peer {
				t.Fatalf("untrusted peer %q: clientAddr = %q, want %q", remote, got, peer)
			}
			return
		}
		if got == peer {
			return
		}
		if strings.Contains(got, ",") || got != strings.TrimSpace(got) || !strings.Contains(xff, got) && !strings.Contains(xff, "["+got+"]") {
			t.Fatalf("clientAddr(%q, XFF %q) = %q: not one hop of the header", remote, xff, got)
		}
	})
}
