package epp

import (
	"context"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/sched"
)

// TestStalledStreamsEnd: a stream that stalls before its request is
// routed — no message at all, headers and no body, part of a body, or
// kept open after an immediate response — is answered 408 (while its body
// is awaited) and ended within body_read_timeout, as serve bounds a
// body's read: its buffered bytes and its goroutine are given back. (The
// attack: 20,000 streams left open after their headers held 20,000
// goroutines and 285 MB RSS; 70 streams sending 15 MB bodies without end
// filled the 1 GiB buffer budget — two refused buffer_full, any body over
// the 4 MB left refused 429 — and held 2.88 GB RSS, for as long as the
// client liked.) A routed request's answer may take longer.
func TestStalledStreamsEnd(t *testing.T) {
	urls := startEngines(t, 1)
	cfg := testConfig(sched.Prefix, urls...)
	cfg.BodyReadTimeout = 200 * time.Millisecond
	cfg.MaxBodyBytes = 4096
	tp := startPicker(t, cfg, Options{})
	warm := tp.open(t)
	warm.headers("GET", "/v1/models", true, nil)
	warm.routed(false)
	warm.cancel()
	waitFor(t, "the warm-up stream ended", func() bool { return tp.gauge(t, "infergate_epp_streams") == 0 })
	before := liveGoroutines()

	// end reads until the stream ends and returns its status (a bound on
	// the wait, not a timing claim).
	end := func(s *stream) error {
		t.Helper()
		done := make(chan error, 1)
		go func() {
			for {
				if _, err := s.s.Recv(); err != nil {
					done <- err
					return
				}
			}
		}()
		select {
		case err := <-done:
			return err
		case <-time.After(time.Minute):
			t.Fatal("the stalled stream was not ended")
			return nil
		}
	}
	timedOut := func(what string, s *stream) {
		t.Helper()
		code, body := s.immediate()
		if code != 408 || !strings.Contains(body, `"code":"request_timeout"`) {
			t.Fatalf("%s: %d %s, want 408 request_timeout", what, code, body)
		}
		if err := end(s); status.Code(err) != codes.OK && err.Error() != "EOF" {
			t.Fatalf("%s: stream ended with %v", what, err)
		}
	}

	s := tp.open(t) // no message at all
	if err := end(s); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a stream without headers ended with %v, want DeadlineExceeded", err)
	}

	s = tp.open(t) // headers, no body
	s.headers("POST", "/v1/chat/completions", false, nil)
	timedOut("headers only", s)

	s = tp.open(t) // part of a body
	s.headers("POST", "/v1/chat/completions", false, nil)
	s.body(chatBody(3000, "stall")[:2000], false)
	waitFor(t, "the part buffered", func() bool { return tp.srv.Buffered() > 0 })
	timedOut("mid-body", s)
	if b := tp.srv.Buffered(); b != 0 {
		t.Fatalf("buffered %d after the timeout", b)
	}

	s = tp.open(t) // refused 413, then kept open
	s.headers("POST", "/v1/chat/completions", false, nil)
	s.body(chatBody(10_000, "big"), false)
	if code, _ := s.immediate(); code != 413 {
		t.Fatalf("got %d, want 413", code)
	}
	if err := end(s); err != nil && status.Code(err) != codes.OK && err.Error() != "EOF" {
		t.Fatalf("a refused stream ended with %v", err)
	}

	// A routed request waits for its answer past body_read_timeout.
	s = tp.open(t)
	s.headers("POST", "/v1/chat/completions", false, nil)
	s.body(chatBody(1000, "slow answer"), true)
	s.routed(true)
	time.Sleep(3 * cfg.BodyReadTimeout)
	s.responseHeaders("200", "application/json", "", false)
	if r := s.recv(); r.GetResponseHeaders() == nil {
		t.Fatalf("want the response-headers answer, got %v", r)
	}
	s.responseBody([]byte(`{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`), true)
	if r := s.recv(); r.GetResponseBody() == nil {
		t.Fatalf("want the response body, got %v", r)
	}
	s.cancel()

	waitFor(t, "every stream released", func() bool {
		return tp.inFlight(t) == 0 && tp.srv.Buffered() == 0 && tp.gauge(t, "infergate_epp_streams") == 0
	})
	requireGoroutinesBack(t, before, 2)
}

// TestHeadersInBufferBudget: request headers count in the buffer budget
// as the body does (held until the stream ends): a stream whose headers
// would take the picked streams' bytes over it is answered 429. (The
// attack: 210 streams sending 3.9 MB of headers each, the bodies' budget
// untouched, held 2.24 GB RSS.)
func TestHeadersInBufferBudget(t *testing.T) {
	urls := startEngines(t, 1)
	cfg := testConfig(sched.Prefix, urls...)
	cfg.BodyReadTimeout = 2 * time.Second // the failure's bound, not a timing claim
	cfg.MaxHeaderBytes = 2 << 20          // the budget's refusal, not max_header_bytes' (TestHeaderLimits)
	tp := startPicker(t, cfg, Options{MaxBufferedBytes: 1 << 20})
	pad := strings.Repeat("p", 600<<10)
	first := tp.open(t)
	first.headers("POST", "/v1/chat/completions", false, nil, "x-pad", pad)
	first.body(chatBody(50, "a"), true)
	first.routed(true)
	if b := tp.srv.Buffered(); b < int64(len(pad)) {
		t.Fatalf("buffered %d with %d bytes of headers held", b, len(pad))
	}
	second := tp.open(t)
	second.headers("POST", "/v1/chat/completions", false, nil, "x-pad", pad)
	if code, body := second.immediate(); code != 429 || !strings.Contains(body, "rate_limit_exceeded") {
		t.Fatalf("second: %d %s, want 429", code, body)
	}
	first.cancel()
	second.cancel()
	waitFor(t, "the budget given back", func() bool {
		return tp.srv.Buffered() == 0 && tp.gauge(t, "infergate_epp_streams") == 0
	})
}

// TestAnswerCutHoldReleased: a whole answer's held prefix is given back to
// the gateway's hold budget (max_held_response_bytes) when the stream ends
// before the answer did (the client or the proxy went away mid-answer).
// Before, each such request kept its reservation — at least 64 KiB — for
// the life of the process: 4,096 cut answers held the default 256 MiB and
// every later answer was passed on unread, its usage not accounted.
func TestAnswerCutHoldReleased(t *testing.T) {
	urls := startEngines(t, 1)
	tp := startPicker(t, testConfig(sched.Prefix, urls...), Options{})
	for i := range 3 {
		s := tp.open(t)
		s.headers("POST", "/v1/chat/completions", false, nil)
		s.body(chatBody(100, "cut"+strings.Repeat("x", i)), true)
		s.routed(true)
		s.responseHeaders("200", "application/json", "", false)
		s.recv()
		s.responseBody([]byte(`{"id":"x","choices":[{"message":{"content":"partial`), false)
		s.recv()
		if h := tp.gauge(t, "infergate_response_held_bytes"); h == 0 {
			t.Fatal("no bytes held for the answer's usage")
		}
		s.cancel()
		waitFor(t, "the stream ended", func() bool { return tp.gauge(t, "infergate_epp_streams") == 0 && tp.inFlight(t) == 0 })
		if h := tp.gauge(t, "infergate_response_held_bytes"); h != 0 {
			t.Fatalf("request %d: %v bytes of the hold budget kept after the stream ended", i, h)
		}
	}
}

// TestClientPrefillerHeaderRemoved: the proxy forwards the client's own
// headers to the endpoint picked; a client's x-prefiller-host-port would
// make llm-d's routing sidecar in front of the decode endpoint prefill at
// the host:port it names. With pd.client_params strip (the default) the
// request-headers answer removes it, as serve does; with pass it is left.
func TestClientPrefillerHeaderRemoved(t *testing.T) {
	for _, mode := range []string{gateway.PDClientParamsStrip, gateway.PDClientParamsPass} {
		urls := startEngines(t, 1)
		cfg := testConfig(sched.Prefix, urls...)
		cfg.PD.ClientParams = mode
		tp := startPicker(t, cfg, Options{})
		s := tp.open(t)
		s.headers("POST", "/v1/chat/completions", false, nil, "x-prefiller-host-port", "attacker.example:6666")
		s.body(chatBody(100, "pf"+mode), true)
		r := s.recv()
		removed := slices.Contains(r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetRemoveHeaders(), "x-prefiller-host-port")
		if removed != (mode == gateway.PDClientParamsStrip) {
			t.Fatalf("%s: x-prefiller-host-port removed %v (answer %v)", mode, removed, r)
		}
	}
}

// TestUnreadSendEnds: a proxy that stops reading the picker's responses
// (its HTTP/2 flow-control window full) blocked the stream's Send for
// good, with its admission slot, its load share and its buffered body
// (the attack: 50 streams sending 3 MB bodies and never reading held 50
// requests in flight and 976 MB RSS for as long as the client liked).
// Now the stream ends with DeadlineExceeded once one send has waited
// write_timeout, and releases all it held.
func TestUnreadSendEnds(t *testing.T) {
	urls := startEngines(t, 1)
	cfg := testConfig(sched.Prefix, urls...)
	cfg.WriteTimeout = 100 * time.Millisecond
	tp := startPicker(t, cfg, Options{})
	before := liveGoroutines()
	// A client whose windows never grow (no BDP estimation): 64 KiB unread
	// fill them.
	conn, err := grpc.NewClient(tp.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(64<<10), grpc.WithInitialConnWindowSize(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ps, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	s := &stream{t: t, s: ps, cancel: cancel}
	s.headers("POST", "/v1/chat/completions", false, nil)
	s.body(chatBody(1<<20, "unread"), true, 60000, 120000, 500000)
	waitFor(t, "the stalled send given up", func() bool {
		return tp.gauge(t, "infergate_epp_stream_timeouts_total", "wait", "send") == 1
	})
	waitFor(t, "the stream released", func() bool {
		return tp.inFlight(t) == 0 && tp.srv.Buffered() == 0 && tp.gauge(t, "infergate_epp_streams") == 0
	})
	// What the client had buffered, then the end of the stream.
	var rerr error
	for rerr == nil {
		_, rerr = ps.Recv()
	}
	if status.Code(rerr) != codes.DeadlineExceeded && status.Code(rerr) != codes.Internal {
		t.Fatalf("the stream ended with %v", rerr) // Internal: RST_STREAM before the status got through
	}
	cancel()
	conn.Close()
	requireGoroutinesBack(t, before, 2)
}

// TestRoutedStreamWaitsBounded: once its request is routed, a stream's
// wait for the proxy's next message is bounded as serve bounds the
// engine's answer: response_header_timeout for the response headers,
// stream_idle_timeout between the answer's messages and for the stream's
// end after the answer. Before, a routed stream the proxy left silent was
// held forever with its admission slot, its load share and its body (the
// attack: 200 routed streams left open).
func TestRoutedStreamWaitsBounded(t *testing.T) {
	urls := startEngines(t, 1)
	cfg := testConfig(sched.Prefix, urls...)
	cfg.ResponseHeaderTimeout = 150 * time.Millisecond
	cfg.StreamIdleTimeout = 150 * time.Millisecond
	tp := startPicker(t, cfg, Options{})
	warm := tp.open(t) // the connection's own goroutines, before the count
	warm.headers("GET", "/v1/models", true, nil)
	warm.routed(false)
	warm.cancel()
	waitFor(t, "the warm-up stream ended", func() bool { return tp.gauge(t, "infergate_epp_streams") == 0 })
	before := liveGoroutines()
	endsWith := func(what string, s *stream, want codes.Code) {
		t.Helper()
		var err error
		for err == nil {
			_, err = s.s.Recv()
		}
		if got := status.Code(err); got != want && !(want == codes.OK && err == io.EOF) {
			t.Fatalf("%s: the stream ended with %v, want %v", what, err, want)
		}
	}
	routed := func(seed string) *stream {
		s := tp.open(t)
		s.headers("POST", "/v1/chat/completions", false, nil)
		s.body(chatBody(100, seed), true)
		s.routed(true)
		return s
	}

	s := routed("no answer")
	endsWith("no response headers", s, codes.DeadlineExceeded)

	s = routed("answer stops")
	s.responseHeaders("200", "application/json", "", false)
	s.recv()
	s.responseBody([]byte(`{"id":"x","choices":[`), false)
	s.recv()
	endsWith("answer stalled", s, codes.DeadlineExceeded)
	if n := tp.gauge(t, "infergate_requests_total", "code", "504"); n != 2 {
		t.Fatalf("%v requests counted 504, want 2", n)
	}
	if n := tp.gauge(t, "infergate_epp_stream_timeouts_total", "wait", "answer"); n != 2 {
		t.Fatalf("%v answer timeouts, want 2", n)
	}

	s = routed("answered, kept open")
	s.responseHeaders("200", "application/json", "", false)
	s.recv()
	s.responseBody([]byte(`{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`), true)
	s.recv()
	endsWith("answered", s, codes.OK)
	if n := tp.gauge(t, "infergate_epp_stream_timeouts_total", "wait", "end"); n != 1 {
		t.Fatalf("%v end timeouts, want 1", n)
	}
	if n := tp.gauge(t, "infergate_requests_total", "code", "200"); n != 1 {
		t.Fatalf("%v requests counted 200, want 1", n)
	}
	waitFor(t, "every stream released", func() bool {
		return tp.inFlight(t) == 0 && tp.srv.Buffered() == 0 && tp.gauge(t, "infergate_epp_streams") == 0
	})
	requireGoroutinesBack(t, before, 2)
}

// TestHeaderLimits: a request's headers are refused as serve refuses them,
// at the request-headers phase, before any of them or its body is held:
// 431 request_header_too_large over max_header_bytes (counted as an
// HTTP/1.1 header block: name, value and 4 bytes a field), 415 for a
// Content-Encoding. (The attack: 20 streams each sending 400,000 one-byte
// headers in a 3.95 MB message were charged 1.6 MB each in the buffer
// budget and took the picker from 110 MB to 2.19 GB RSS; a gzip body was
// answered 400 "not valid UTF-8" after being buffered whole.)
func TestHeaderLimits(t *testing.T) {
	urls := startEngines(t, 1)
	cfg := testConfig(sched.Prefix, urls...)
	cfg.MaxHeaderBytes = 4096
	tp := startPicker(t, cfg, Options{})
	var kv []string
	for range 700 { // 700 × (1 + 1 + 4) = 4,200 bytes with the pseudo-headers
		kv = append(kv, "a", "b")
	}
	s := tp.open(t)
	s.headers("POST", "/v1/chat/completions", false, nil, kv...)
	if code, body := s.immediate(); code != 431 || !strings.Contains(body, `"code":"request_header_too_large"`) {
		t.Fatalf("700 headers: %d %s, want 431 request_header_too_large", code, body)
	}
	if b := tp.srv.Buffered(); b != 0 {
		t.Fatalf("%d bytes buffered for refused headers", b)
	}
	s.cancel()

	s = tp.open(t) // within the limit
	s.headers("POST", "/v1/chat/completions", false, nil, kv[:1000]...)
	s.body(chatBody(100, "within"), true)
	s.routed(true)
	s.cancel()

	for _, ce := range []string{"gzip", "identity, br"} {
		s = tp.open(t)
		s.headers("POST", "/v1/chat/completions", false, nil, "content-encoding", ce)
		if code, body := s.immediate(); code != 415 || !strings.Contains(body, "Content-Encoding") {
			t.Fatalf("content-encoding %s: %d %s, want 415", ce, code, body)
		}
		s.cancel()
	}
	s = tp.open(t) // identity is no encoding
	s.headers("POST", "/v1/chat/completions", false, nil, "content-encoding", "identity")
	s.body(chatBody(100, "identity"), true)
	s.routed(true)
	s.cancel()
	if n := tp.gauge(t, "infergate_epp_decisions_total", "result", "431"); n != 1 {
		t.Fatalf("%v decisions 431, want 1", n)
	}
	if n := tp.gauge(t, "infergate_epp_decisions_total", "result", "415"); n != 2 {
		t.Fatalf("%v decisions 415, want 2", n)
	}
	waitFor(t, "every stream released", func() bool {
		return tp.inFlight(t) == 0 && tp.srv.Buffered() == 0 && tp.gauge(t, "infergate_epp_streams") == 0
	})
}
