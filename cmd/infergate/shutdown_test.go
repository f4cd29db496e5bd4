package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/internal/childproc"
	"github.com/infergate/infergate/sched"
)

// holdingEngine is an engine on loopback that answers /health and holds
// every completion until the gateway cancels it: "stream" requests get an
// SSE header and one event first. arrived and canceled receive each
// request's X-Request-Id.
func holdingEngine(t *testing.T) (url string, arrived, canceled chan string) {
	t.Helper()
	arrived, canceled = make(chan string, 16), make(chan string, 16)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			return // /health and /metrics: 200, empty
		}
		_, _ = io.Copy(io.Discard, r.Body)
		id := r.Header.Get("X-Request-Id")
		if id == "stream" {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}`+"\n\n")
			_ = http.NewResponseController(w).Flush()
		}
		arrived <- id
		<-r.Context().Done()
		canceled <- id
	}))
	t.Cleanup(srv.Close)
	return srv.URL, arrived, canceled
}

// syncBuffer is a log sink safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type answer struct {
	status int
	body   string
	err    error
}

func postAsync(c *http.Client, url, id, body string) <-chan answer {
	ch := make(chan answer, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Request-Id", id)
		resp, err := c.Do(req)
		if err != nil {
			ch <- answer{err: err}
			return
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		ch <- answer{status: resp.StatusCode, body: string(b), err: err}
	}()
	return ch
}

func within(t *testing.T, what string, d time.Duration, ch <-chan answer) answer {
	t.Helper()
	select {
	case a := <-ch:
		return a
	case <-time.After(d):
		t.Fatalf("%s: no answer in %v", what, d)
	}
	return answer{}
}

// errorCode returns the code of an OpenAI error body or event.
func errorCode(s string) string {
	var e struct {
		Error struct {
			Code any `json:"code"`
		} `json:"error"`
	}
	_ = json.Unmarshal([]byte(strings.TrimPrefix(s, "data: ")), &e)
	c, _ := e.Error.Code.(string)
	return c
}

// TestShutdownSequence drives serveGateway as `infergate serve` runs it, the
// context standing for SIGTERM: a request waiting in the admission queue is
// answered 503 at the signal, while the stream and the request waiting for
// its engine's headers run on; when shutdown_grace (from the config) has
// passed they are ended explicitly — an error event and [DONE], a 503 —
// their engine requests canceled, and then the server returns.
func TestShutdownSequence(t *testing.T) {
	engine, arrived, canceled := holdingEngine(t)
	const grace = 3 * time.Second
	cfg := gateway.Config{Listen: "127.0.0.1:0", Routing: sched.Config{Policy: sched.RoundRobin},
		Endpoints:       []gateway.EndpointConfig{{URL: engine, Model: "m", KVBlocks: 1000}},
		HealthCheckPath: "-", ScrapeInterval: -1, ShutdownGrace: grace,
		Admission: gateway.AdmissionConfig{MaxInFlight: 2}}
	g, err := gateway.New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	ctx, sigterm := context.WithCancel(context.Background())
	defer sigterm()
	addr := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- serveGateway(ctx, log, cfg.Listen, g, func(a net.Addr) { addr <- a.String() })
	}()
	base := "http://" + <-addr
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}

	// A stream that has started, a request waiting for its engine's
	// headers, and one waiting in the admission queue (max_in_flight 2).
	streamBody := `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`
	chatBody := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", strings.NewReader(streamBody))
	req.Header.Set("X-Request-Id", "stream")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if l, err := br.ReadString('\n'); err != nil || !strings.Contains(l, "Hel") {
		t.Fatalf("first event %q: %v", l, err)
	}
	streamEnd := make(chan answer, 1)
	go func() {
		rest, err := io.ReadAll(br)
		streamEnd <- answer{body: string(rest), err: err}
	}()
	pending := postAsync(c, base+"/v1/chat/completions", "pending", chatBody)
	for range 2 {
		<-arrived
	}
	queued := postAsync(c, base+"/v1/chat/completions", "queued", chatBody)
	deadline := time.Now().Add(10 * time.Second)
	for {
		mresp, err := c.Get(base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		m, _ := io.ReadAll(mresp.Body)
		mresp.Body.Close()
		if bytes.Contains(m, []byte(`infergate_admission_queue_length{model="m"} 1`)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the third request never queued")
		}
		time.Sleep(5 * time.Millisecond)
	}

	sigterm()
	// At the signal: the queued request is answered, the others run on.
	q := within(t, "queued request", 10*time.Second, queued)
	if q.err != nil || q.status != http.StatusServiceUnavailable || errorCode(q.body) != "shutting_down" {
		t.Fatalf("queued request at SIGTERM: %d %s %v", q.status, q.body, q.err)
	}
	select {
	case a := <-streamEnd:
		t.Fatalf("the stream ended at SIGTERM, before the %v grace: %q", grace, a.body)
	case a := <-pending:
		t.Fatalf("the pending request was answered at SIGTERM, before the %v grace: %d %s", grace, a.status, a.body)
	default:
	}

	// At the end of the grace: ended explicitly.
	s := within(t, "stream", 20*time.Second, streamEnd)
	events := strings.Split(strings.TrimSuffix(strings.TrimPrefix(s.body, "\n"), "\n\n"), "\n\n")
	if s.err != nil || len(events) != 2 || errorCode(events[0]) != "shutting_down" || events[1] != "data: [DONE]" {
		t.Errorf("the stream's end %q (%v): want an error event (shutting_down) and [DONE]", s.body, s.err)
	}
	p := within(t, "pending request", 10*time.Second, pending)
	if p.err != nil || p.status != http.StatusServiceUnavailable || errorCode(p.body) != "shutting_down" {
		t.Errorf("pending request at the end of the grace: %d %s %v", p.status, p.body, p.err)
	}
	for range 2 {
		select {
		case <-canceled:
		case <-time.After(10 * time.Second):
			t.Fatal("an engine request was not canceled")
		}
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the server did not return after the aborted requests ended")
	}
	out := logs.String()
	if !strings.Contains(out, "grace="+grace.String()) || !strings.Contains(out, "shutdown grace expired") {
		t.Errorf("logs:\n%s", out)
	}
}

// stopLogging sends SIGTERM and returns the first submatch of re in the
// output that follows, requiring a clean exit. (One signal only: once the
// command returns, main stops catching them.)
func (p *proc) stopLogging(t *testing.T, re *regexp.Regexp) string {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	m := p.await(t, re)
	p.exited(t)
	return m
}

// graceRe finds the grace in the log line of a shutdown.
var graceRe = regexp.MustCompile(`shutting down.* grace=(\S+)`)

// TestShutdownGraceFlags: shutdown_grace comes from the config file unless
// --shutdown-grace overrides it, and defaults to 25s (serve; up takes the
// flag: TestUpEndToEnd).
func TestShutdownGraceFlags(t *testing.T) {
	engine, _, _ := holdingEngine(t)
	dir := t.TempDir()
	conf := filepath.Join(dir, "gateway.yaml")
	if err := os.WriteFile(conf, []byte("shutdown_grace: 7s\nhealth_check_path: \"-\"\nendpoints:\n  - {url: "+engine+", model: m, kv_blocks: 1000}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	addrRe := regexp.MustCompile(`addr=(http://[0-9.:]+)`)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", "-c", conf}, "7s"},
		{[]string{"serve", "-c", conf, "--shutdown-grace", "1m30s"}, "1m30s"},
		{[]string{"serve", "--endpoint", engine + "=m"}, "25s"},
	} {
		p := start(t, append(tc.args, "--listen", "127.0.0.1:0")...)
		p.await(t, addrRe)
		if got := p.stopLogging(t, graceRe); got != tc.want {
			t.Errorf("%v: grace %s, want %s", tc.args, got, tc.want)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // were the flag ignored, it would serve
	defer cancel()
	c := exec.CommandContext(ctx, os.Args[0], "serve", "--endpoint", engine+"=m", "--listen", "127.0.0.1:0", "--shutdown-grace", "-1s")
	c.SysProcAttr = childproc.Attr()
	c.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	if msg, err := c.CombinedOutput(); err == nil || !strings.Contains(string(msg), "shutdown_grace") {
		t.Errorf("a negative grace: %v %s", err, msg)
	}
}

// TestSecondSignalStopsAtOnce: a second SIGTERM during the shutdown grace
// ends the process at once (the first one's handler is gone).
func TestSecondSignalStopsAtOnce(t *testing.T) {
	engine, arrived, _ := holdingEngine(t)
	p := start(t, "serve", "--endpoint", engine+"=m", "--listen", "127.0.0.1:0", "--shutdown-grace", "5m")
	addr := p.await(t, regexp.MustCompile(`addr=(http://[0-9.:]+)`))
	go func() { // held by the engine: keeps the shutdown waiting for the grace
		req, _ := http.NewRequest(http.MethodPost, addr+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"x"}`))
		req.Header.Set("X-Request-Id", "held")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	<-arrived
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	p.await(t, graceRe)
	go func() {
		for range p.lines {
		}
	}()
	done := make(chan error, 1)
	go func() { done <- p.cmd.Wait() }()
	tick := time.NewTicker(100 * time.Millisecond) // until the first handler is gone
	defer tick.Stop()
	deadline := time.After(20 * time.Second)
	for {
		select {
		case err := <-done:
			if err == nil {
				t.Fatal("exited cleanly: the second signal was taken as the first")
			}
			return
		case <-tick.C:
			_ = p.cmd.Process.Signal(syscall.SIGTERM)
		case <-deadline:
			t.Fatal("still running 20 s after a second SIGTERM (grace 5m)")
		}
	}
}
