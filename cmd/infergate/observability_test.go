package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/gateway"
)

// loggedProc is a running infergate process whose whole output is kept.
type loggedProc struct {
	*proc
	all *syncBuffer
}

// startLogged is start, keeping every line of the process's output (start's
// line channel drops lines once 1024 wait).
func startLogged(t *testing.T, args ...string) *loggedProc {
	t.Helper()
	cmd := infergateCommand(args...)
	cmd.Env = append(os.Environ(), "INFERGATE_TEST_MAIN=1")
	pr, pw := io.Pipe()
	all := &syncBuffer{}
	cmd.Stdout = io.MultiWriter(pw, all)
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, lines: make(chan string, 1024), out: &bytes.Buffer{}}
	go func() {
		buf := make([]byte, 32<<10)
		var pending string
		for {
			n, err := pr.Read(buf)
			pending += string(buf[:n])
			for {
				i := strings.IndexByte(pending, '\n')
				if i < 0 {
					break
				}
				select {
				case p.lines <- pending[:i]:
				default:
				}
				pending = pending[i+1:]
			}
			if err != nil {
				close(p.lines)
				return
			}
		}
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		pw.Close()
	})
	return &loggedProc{proc: p, all: all}
}

// jsonLines returns the process's output lines that are JSON objects with
// msg msg.
func (p *loggedProc) jsonLines(t *testing.T, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, l := range strings.Split(p.all.String(), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

var jsonAddrRe = regexp.MustCompile(`"addr":"(http://[0-9.:]+)"`)

// send posts body to url with X-Request-Id id and extra header pairs; it
// returns the status and the X-Infergate-Attempts header.
// sendClient bounds every request of send: a gateway that never answers
// fails the test instead of hanging the suite.
var sendClient = &http.Client{Timeout: 2 * time.Minute}

func send(t *testing.T, ctx context.Context, url, id, body string, hdr ...string) (int, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := sendClient.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, resp.Header.Get(gateway.AttemptsHeader)
}

// metricValue sums the samples of name in the gateway's /metrics whose
// labels include every one of labels (each `k="v"`).
func metricValue(t *testing.T, base, name string, labels ...string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0.0
next:
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(l, name+"{") {
			continue
		}
		for _, kv := range labels {
			if !strings.Contains(l[:strings.LastIndexByte(l, '}')+1], kv) {
				continue next
			}
		}
		var v float64
		fmt.Sscan(l[strings.LastIndexByte(l, ' ')+1:], &v)
		sum += v
	}
	return sum
}

// closedPortURL is the URL of a loopback port nothing listens on.
func closedPortURL(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return "http://" + l.Addr().String()
}

// TestServeAccessLog runs `infergate serve --log-format json` in front of
// `infergate sim` and an endpoint that refuses connections, and checks the
// access line of each request against what was sent: two 200s of which one
// was retried, a stream with its TTFT, a key's 429, an admission 429 (the
// engine SIGSTOPped with one request in flight: no queue, max_in_flight 1),
// the held request's client going away (499), a 401; and the per-key
// counters.
func TestServeAccessLog(t *testing.T) {
	addrRe := regexp.MustCompile(`addr=(http://[0-9.:]+)`)
	sim := start(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "m")
	simURL := sim.await(t, addrRe)
	defer sim.stop(t)
	dead := closedPortURL(t)
	const keyA, keyB = "sk-access-log-test-a-31415926", "sk-access-log-test-b-27182818"
	conf := filepath.Join(t.TempDir(), "gateway.yaml")
	yaml := fmt.Sprintf(`listen: 127.0.0.1:0
routing: {policy: round-robin}
health_check_path: "-"
eject_duration: 1h
outlier: {max_ejection_time: 1h}
admission: {max_in_flight: 1, max_queue: -1}
auth:
  keys:
    - {name: team-a, hash: %q}
    - {name: team-b, hash: %q, requests_per_minute: 1}
endpoints:
  - {url: %q, model: m, kv_blocks: 1000}
  - {url: %q, model: m}
`, auth.HashKey(keyA), auth.HashKey(keyB), dead, simURL)
	if err := os.WriteFile(conf, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	g := startLogged(t, "serve", "-c", conf, "--log-format", "json")
	base := g.await(t, jsonAddrRe)
	chatURL := base + "/v1/chat/completions"
	ctx := context.Background()
	auth := func(k string) []string {
		return []string{"Authorization", "Bearer " + k, "User-Agent", "access-log-test/1"}
	}
	content := strings.Repeat("Hello there, how are you today? ", 20) // some 160 tokens: whole KV blocks to cache
	chat := `{"model":"m","messages":[{"role":"user","content":"` + content + `"}],"max_tokens":5}`
	stream := `{"model":"m","messages":[{"role":"user","content":"` + content + `"}],"max_tokens":5,"stream":true}`

	attempts := map[string]string{}
	for _, id := range []string{"ok-1", "ok-2"} {
		code, a := send(t, ctx, chatURL, id, chat, auth(keyA)...)
		if code != 200 {
			t.Fatalf("%s: %d %s", id, code, a)
		}
		attempts[id] = a
	}
	if code, _ := send(t, ctx, chatURL, "stream", stream, auth(keyA)...); code != 200 {
		t.Fatalf("stream: %d", code)
	}
	if code, _ := send(t, ctx, chatURL, "rl-1", chat, auth(keyB)...); code != 200 {
		t.Fatalf("rl-1: %d", code)
	}
	if code, _ := send(t, ctx, chatURL, "rl-2", chat, auth(keyB)...); code != 429 {
		t.Fatalf("rl-2: %d, want 429 (team-b's 1 request per minute)", code)
	}
	if code, _ := send(t, ctx, chatURL, "noauth", chat); code != 401 {
		t.Fatalf("noauth: %d", code)
	}

	// The engine stops; one request is admitted and waits for it, the next
	// finds no room (429), then the first one's client gives up (499).
	// The earlier requests' admission slots are released after their
	// clients read the last byte (the gateway finishes its accounting
	// first): wait for them to be free, or on a busy host the gauge's 1
	// below can be rl-1's, the held request then finds no room and the
	// "admission" request is admitted to the stopped engine and waits.
	deadline := time.Now().Add(time.Minute)
	for metricValue(t, base, "infergate_admission_in_flight_requests", `model="m"`) != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the earlier requests still held admission slots after a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := sim.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	hctx, hcancel := context.WithCancel(ctx)
	held := make(chan int, 1)
	go func() {
		code, _ := send(t, hctx, chatURL, "held", chat, auth(keyA)...)
		held <- code
	}()
	deadline = time.Now().Add(time.Minute)
	for metricValue(t, base, "infergate_admission_in_flight_requests", `model="m"`) != 1 {
		if time.Now().After(deadline) {
			_ = sim.cmd.Process.Signal(syscall.SIGCONT)
			t.Fatal("the held request was not admitted within a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
	code, _ := send(t, ctx, chatURL, "admission", chat, auth(keyA)...)
	hcancel()
	<-held
	for metricValue(t, base, "infergate_requests_total", `model="m"`, `endpoint="`+simURL+`"`, `code="499"`) != 1 {
		if time.Now().After(deadline) {
			_ = sim.cmd.Process.Signal(syscall.SIGCONT)
			t.Fatal("the held request was not counted 499 within a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := sim.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if code != 429 {
		t.Fatalf("admission: %d, want 429 (max_in_flight 1, no queue)", code)
	}
	keyRequests := metricValue(t, base, "infergate_key_requests_total", `key="team-a"`)
	keyOutput := metricValue(t, base, "infergate_key_generation_tokens_total", `key="team-a"`)
	g.stop(t) // the last lines are written at exit

	if strings.Contains(g.all.String(), keyA) || strings.Contains(g.all.String(), keyB) {
		t.Fatal("a key reached the log")
	}
	lines := map[string]map[string]any{}
	for _, l := range g.jsonLines(t, "request") {
		id, _ := l["id"].(string)
		if lines[id] != nil {
			t.Errorf("request %s has two access lines", id)
		}
		lines[id] = l
	}
	check := func(id string, want map[string]any) map[string]any {
		t.Helper()
		l := lines[id]
		if l == nil {
			t.Fatalf("no access line for %s in:\n%s", id, g.all.String())
		}
		for k, v := range want {
			if v == nil {
				if _, ok := l[k]; ok {
					t.Errorf("%s: %s = %v, want absent", id, k, l[k])
				}
			} else if l[k] != v {
				t.Errorf("%s: %s = %v, want %v (line %v)", id, k, l[k], v, l)
			}
		}
		return l
	}
	retried := 0
	for _, id := range []string{"ok-1", "ok-2"} {
		want := 1.0
		if attempts[id] == "2" {
			want, retried = 2, retried+1
		}
		l := check(id, map[string]any{"status": 200.0, "key": "team-a", "model": "m", "stream": false, "endpoint": simURL,
			"policy": "round-robin", "attempts": want, "output_tokens": 5.0, "client": "127.0.0.1",
			"user_agent": "access-log-test/1", "method": "POST", "path": "/v1/chat/completions", "level": "INFO"})
		if p, _ := l["prompt_tokens"].(float64); p < 5 {
			t.Errorf("%s: prompt_tokens %v", id, l["prompt_tokens"])
		}
	}
	if retried != 1 {
		t.Errorf("%d of ok-1, ok-2 retried (X-Infergate-Attempts %v), want 1: the first to meet the dead endpoint", retried, attempts)
	}
	l := check("stream", map[string]any{"status": 200.0, "stream": true, "attempts": 1.0, "output_tokens": 5.0, "endpoint": simURL})
	if ttft, _ := l["ttft_seconds"].(float64); ttft <= 0 || ttft > l["duration_seconds"].(float64) {
		t.Errorf("stream: ttft %v, duration %v", l["ttft_seconds"], l["duration_seconds"])
	}
	if c, _ := l["cached_tokens"].(float64); c <= 0 {
		t.Errorf("stream: cached_tokens %v, want the prompt's blocks cached by ok-1 and ok-2", l["cached_tokens"])
	}
	check("rl-1", map[string]any{"status": 200.0, "key": "team-b"})
	check("rl-2", map[string]any{"status": 429.0, "key": "team-b", "error": "rate_limit_exceeded", "endpoint": nil, "attempts": nil})
	check("admission", map[string]any{"status": 429.0, "key": "team-a", "error": "rate_limit_exceeded", "endpoint": nil, "attempts": nil})
	check("held", map[string]any{"status": 499.0, "key": "team-a", "endpoint": simURL, "attempts": 1.0, "output_tokens": nil})
	check("noauth", map[string]any{"status": 401.0, "key": nil, "error": "invalid_api_key"})
	if keyRequests != 5 || keyOutput != 15 {
		t.Errorf("team-a: %v requests, %v generation tokens; want 5 (ok-1, ok-2, stream, held, admission) and 15 (5 each for the three answered)", keyRequests, keyOutput)
	}
}

// otlpReceiver is an OTLP/HTTP trace receiver: it decodes the protobuf
// export requests (go.opentelemetry.io/proto/otlp) and keeps their spans.
type otlpReceiver struct {
	mu    sync.Mutex
	spans []*tracepb.Span
	res   []*commonpb.KeyValue // the resource of the last batch
}

func (o *otlpReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" || r.Header.Get("Content-Type") != "application/x-protobuf" {
		http.Error(w, "want POST /v1/traces application/x-protobuf", http.StatusBadRequest)
		return
	}
	b, err := io.ReadAll(r.Body)
	var req coltracepb.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(b, &req)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	o.mu.Lock()
	for _, rs := range req.GetResourceSpans() {
		o.res = rs.GetResource().GetAttributes()
		for _, ss := range rs.GetScopeSpans() {
			o.spans = append(o.spans, ss.GetSpans()...)
		}
	}
	o.mu.Unlock()
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

// attr returns a span attribute's value as a string ("" when absent).
func attr(kvs []*commonpb.KeyValue, key string) string {
	for _, kv := range kvs {
		if kv.GetKey() == key {
			v := kv.GetValue()
			switch v.GetValue().(type) {
			case *commonpb.AnyValue_IntValue:
				return fmt.Sprint(v.GetIntValue())
			case *commonpb.AnyValue_BoolValue:
				return fmt.Sprint(v.GetBoolValue())
			case *commonpb.AnyValue_DoubleValue:
				return fmt.Sprint(v.GetDoubleValue())
			}
			return v.GetStringValue()
		}
	}
	return ""
}

// TestServeTracing runs `infergate serve` with tracing to an OTLP/HTTP
// receiver in the test, in front of `infergate sim --log-level debug`: a
// request with the client's traceparent is a server span parented on it
// with an attempt span under it, whose context the engine received as its
// traceparent (with the client's tracestate); one without starts a trace;
// the resource carries the configured service name.
func TestServeTracing(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	recv := &otlpReceiver{}
	collector := httptest.NewServer(recv)
	defer collector.Close()
	sim := startLogged(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "m", "--log-level", "debug", "--log-format", "json")
	simURL := sim.await(t, jsonAddrRe)
	conf := filepath.Join(t.TempDir(), "gateway.yaml")
	yaml := fmt.Sprintf("listen: 127.0.0.1:0\ntracing: {otlp_endpoint: %q, service_name: gw-under-test}\nendpoints:\n  - {url: %q, model: m}\n",
		collector.URL, simURL)
	if err := os.WriteFile(conf, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	g := startLogged(t, "serve", "-c", conf, "--access-log=false")
	base := g.await(t, regexp.MustCompile(`addr=(http://[0-9.:]+)`))
	const clientTrace, clientSpan = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	chat := `{"model":"m","messages":[{"role":"user","content":"Hello"}],"max_tokens":4,"stream":true}`
	if code, _ := send(t, context.Background(), base+"/v1/chat/completions", "traced", chat,
		"Traceparent", "00-"+clientTrace+"-"+clientSpan+"-01", "Tracestate", "congo=t61rcWkgMzE"); code != 200 {
		t.Fatalf("traced: %d", code)
	}
	if code, _ := send(t, context.Background(), base+"/v1/completions", "root", `{"model":"m","prompt":"Hello","max_tokens":2}`); code != 200 {
		t.Fatalf("root: %d", code)
	}
	g.stop(t)   // exports the spans still queued
	sim.stop(t) // its log is complete

	engineSaw := map[string][2]string{} // X-Request-Id → traceparent, tracestate
	for _, l := range sim.jsonLines(t, "sim: request received") {
		id, _ := l["x_request_id"].(string)
		tp, _ := l["traceparent"].(string)
		ts, _ := l["tracestate"].(string)
		engineSaw[id] = [2]string{tp, ts}
	}
	recv.mu.Lock()
	defer recv.mu.Unlock()
	if got := attr(recv.res, "service.name"); got != "gw-under-test" {
		t.Errorf("resource service.name %q, want gw-under-test", got)
	}
	hexID := func(b []byte) string { return hex.EncodeToString(b) }
	for _, id := range []string{"traced", "root"} {
		var server, attempt *tracepb.Span
		for _, s := range recv.spans {
			if s.GetKind() == tracepb.Span_SPAN_KIND_SERVER && attr(s.GetAttributes(), "infergate.request_id") == id {
				server = s
			}
		}
		if server == nil {
			t.Fatalf("%s: no server span among %d received", id, len(recv.spans))
		}
		for _, s := range recv.spans {
			if string(s.GetParentSpanId()) == string(server.GetSpanId()) && len(s.GetParentSpanId()) > 0 {
				attempt = s
			}
		}
		if attempt == nil || attempt.GetKind() != tracepb.Span_SPAN_KIND_CLIENT {
			t.Fatalf("%s: no client span under the server span", id)
		}
		sa, aa := server.GetAttributes(), attempt.GetAttributes()
		if attr(sa, "http.response.status_code") != "200" || attr(sa, "gen_ai.request.model") != "m" ||
			attr(aa, "gen_ai.provider.name") != "vllm" || attr(aa, "infergate.endpoint") != simURL ||
			attr(aa, "gen_ai.usage.input_tokens") == "" || attr(aa, "infergate.attempt") != "1" {
			t.Errorf("%s: server %q %v; attempt %q %v", id, server.GetName(), sa, attempt.GetName(), aa)
		}
		wantTrace := hexID(server.GetTraceId())
		if id == "traced" {
			if wantTrace != clientTrace || hexID(server.GetParentSpanId()) != clientSpan {
				t.Errorf("traced: server span in trace %s under %s, want %s under %s", wantTrace, hexID(server.GetParentSpanId()), clientTrace, clientSpan)
			}
			if attr(sa, "gen_ai.usage.output_tokens") != "4" || attempt.GetName() != "chat m" {
				t.Errorf("traced: output tokens %s, attempt %q", attr(sa, "gen_ai.usage.output_tokens"), attempt.GetName())
			}
		} else if wantTrace == clientTrace || len(server.GetParentSpanId()) != 0 || attempt.GetName() != "text_completion m" {
			t.Errorf("root: trace %s parent %x attempt %q: want a new trace", wantTrace, server.GetParentSpanId(), attempt.GetName())
		}
		want := "00-" + wantTrace + "-" + hexID(attempt.GetSpanId()) + "-01"
		if got := engineSaw[id]; got[0] != want {
			t.Errorf("%s: the engine received traceparent %q, want the attempt's %q", id, got[0], want)
		}
		if id == "traced" && engineSaw[id][1] != "congo=t61rcWkgMzE" {
			t.Errorf("traced: the engine received tracestate %q", engineSaw[id][1])
		}
	}
}

// TestLogFlags: --log-format json makes every line JSON, --log-level warn
// hides info lines, and a bad level or format is refused.
func TestLogFlags(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	s := startLogged(t, "sim", "--listen", "127.0.0.1:0", "--log-format", "json", "--time-scale", "100")
	s.await(t, jsonAddrRe)
	s.stop(t)
	for _, l := range strings.Split(strings.TrimSpace(s.all.String()), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil || m["level"] == nil {
			t.Errorf("--log-format json: line %q", l)
		}
	}
	// At warn the engine logs nothing: wait for its port instead.
	addr := strings.TrimPrefix(closedPortURL(t), "http://")
	w := startLogged(t, "sim", "--listen", addr, "--log-level", "warn")
	deadline := time.Now().Add(time.Minute)
	for {
		if resp, err := http.Get("http://" + addr + "/health"); err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sim --log-level warn did not serve within a minute:\n%s", w.all.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	w.stop(t)
	if out := w.all.String(); strings.Contains(out, "level=INFO") {
		t.Errorf("--log-level warn logged info lines:\n%s", out)
	}
	for _, args := range [][]string{{"sim", "--log-level", "loud"}, {"sim", "--log-format", "xml"}, {"serve", "--endpoint", "http://127.0.0.1:9=m", "--log-level", "verbose"}} {
		out, err := runMain(args...)
		if err == nil || !strings.Contains(out, "log ") {
			t.Errorf("%v: err %v, output %q", args, err, out)
		}
	}
}
