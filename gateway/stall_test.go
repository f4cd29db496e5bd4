package gateway

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/upstream"
)

// Tests of engines that stall: first_event_timeout, stream_idle_timeout
// and response_header_timeout end every wait, count against the endpoint,
// and retry what never reached the client. The stalled engines below never
// answer, so the timeouts must fire; the healthy ones answer at once, far
// inside the (short) timeouts. Outcomes are asserted, never durations.

// stallTimeout is the timeouts' value in these tests: a healthy loopback
// engine answers well within it on a loaded machine.
const stallTimeout = time.Second

// stallConfig is resilienceConfig with every upstream wait stallTimeout.
func stallConfig(policy string, urls ...string) Config {
	cfg := resilienceConfig(policy, urls...)
	cfg.FirstEventTimeout, cfg.StreamIdleTimeout, cfg.ResponseHeaderTimeout = stallTimeout, stallTimeout, stallTimeout
	return cfg
}

// sseStart sends an SSE response's headers.
func sseStart(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	_ = http.NewResponseController(w).Flush()
}

// sseSend writes and flushes raw SSE bytes.
func sseSend(w http.ResponseWriter, s string) {
	_, _ = io.WriteString(w, s)
	_ = http.NewResponseController(w).Flush()
}

// Chunks as vLLM sends them.
const (
	roleChunk  = `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}` + "\n\n"
	tokenChunk = `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hel"},"logprobs":null,"finish_reason":null}]}` + "\n\n"
	emptyChunk = `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":null}]}` + "\n\n"
)

// until repeats send every few milliseconds until the request ends (an
// engine that keeps a stream alive with bytes that are not output).
func until(r *http.Request, send func()) {
	for {
		select {
		case <-r.Context().Done():
			return
		case <-time.After(5 * time.Millisecond):
			send()
		}
	}
}

// stalls are engines that stop before their first output.
var stalls = []struct {
	name   string
	stream bool
	serve  http.HandlerFunc
}{
	{"stream: no response headers", true, func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
	}},
	{"stream: headers, then nothing", true, func(w http.ResponseWriter, r *http.Request) {
		sseStart(w)
		<-r.Context().Done()
	}},
	{"stream: SSE comments forever", true, func(w http.ResponseWriter, r *http.Request) {
		sseStart(w)
		until(r, func() { sseSend(w, ": keep-alive\n\n") })
	}},
	{"stream: role chunk, then nothing", true, func(w http.ResponseWriter, r *http.Request) {
		sseStart(w)
		sseSend(w, roleChunk)
		<-r.Context().Done()
	}},
	{"stream: role chunk, then empty deltas forever", true, func(w http.ResponseWriter, r *http.Request) {
		sseStart(w)
		sseSend(w, roleChunk)
		until(r, func() { sseSend(w, emptyChunk) })
	}},
	{"non-streaming: no response headers", false, func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
	}},
	{"non-streaming: headers, then part of the body", false, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", "300")
		sseSend(w, `{"id":"x",`)
		<-r.Context().Done()
	}},
}

// TestStallBeforeFirstByteRetried: an engine that stops before any byte of
// its answer could reach the client times out, counts as the endpoint's
// failure, has its request canceled, and the request completes elsewhere.
func TestStallBeforeFirstByteRetried(t *testing.T) {
	for _, tc := range stalls {
		t.Run(tc.name, func(t *testing.T) {
			bad := newFuncEngine(t, tc.serve)
			good := newFakeEngine(t, "good")
			g, url := startGateway(t, stallConfig(sched.RoundRobin, bad.URL(), good.URL()))
			c := testClient(t)
			body := chatBody
			if tc.stream {
				body = streamBody(false)
			}
			for i := range 2 { // round-robin: one of them tries the stalled engine first
				resp, b := post(t, c, url+pathChat, body)
				if resp.StatusCode != 200 || resp.Header.Get("X-Engine") != "good" || !bytes.Contains(b, []byte("Hel")) ||
					bytes.Contains(b, []byte(`"error"`)) {
					t.Fatalf("request %d: %d from %q: %s", i, resp.StatusCode, resp.Header.Get("X-Engine"), b)
				}
			}
			tried := bad.requests.Load()
			if tried < 1 {
				t.Fatal("the stalled engine was never tried")
			}
			waitFor(t, "the stalled requests canceled", func() bool { return bad.cur.Load() == 0 })
			m := scrape(t, c, url)
			if v := m.value("infergate_retries_total", `reason="timeout"`); v != float64(tried) {
				t.Errorf("retries_total{timeout} = %v, want %d", v, tried)
			}
			if v := m.value("infergate_requests_total", `code="200"`); v != 2 {
				t.Errorf("requests_total{200} = %v, want 2", v)
			}
			if n := g.state.Load().endpoints[0].outlier.consecutive.Load(); n != tried {
				t.Errorf("the stalled endpoint's consecutive failures = %d, want %d", n, tried)
			}
		})
	}
}

// TestStallNotRetriedAnswers504: with nowhere to retry, a stall before the
// first byte is a 504 upstream_timeout.
func TestStallNotRetriedAnswers504(t *testing.T) {
	for _, tc := range stalls {
		t.Run(tc.name, func(t *testing.T) {
			bad := newFuncEngine(t, tc.serve)
			_, url := startGateway(t, stallConfig(sched.RoundRobin, bad.URL()))
			body := chatBody
			if tc.stream {
				body = streamBody(false)
			}
			resp, b := post(t, testClient(t), url+pathChat, body)
			if e := decodeError(t, b); resp.StatusCode != http.StatusGatewayTimeout || codeStr(e.Code) != codeUpstreamTimeout {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
		})
	}
}

// TestStallAfterOutputEndsStream: a stream that stops sending output after
// its first token (silent, or sending only comments or events without
// output) ends with an upstream_timeout error event and [DONE], counts as
// a 504 and as the endpoint's failure, and is not retried.
func TestStallAfterOutputEndsStream(t *testing.T) {
	silent := func(w http.ResponseWriter, r *http.Request) {
		sseStart(w)
		sseSend(w, roleChunk+tokenChunk)
		<-r.Context().Done()
	}
	for _, tc := range []struct {
		name  string
		serve http.HandlerFunc
		// writeTimeout, when set, is write_timeout: shorter than the
		// stall, the client's write deadline passes while the engine is
		// silent (the defaults are a minute both), and the error event
		// must still be written (the second attack run's silent cut).
		writeTimeout time.Duration
	}{
		{"silent", silent, 0},
		{"silent past the write deadline", silent, stallTimeout / 2},
		{"comments forever", func(w http.ResponseWriter, r *http.Request) {
			sseStart(w)
			sseSend(w, roleChunk+tokenChunk)
			until(r, func() { sseSend(w, ":\n\n") })
		}, 0},
		{"empty deltas forever", func(w http.ResponseWriter, r *http.Request) {
			sseStart(w)
			sseSend(w, roleChunk+tokenChunk)
			until(r, func() { sseSend(w, emptyChunk) })
		}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bad := newFuncEngine(t, tc.serve)
			good := newFakeEngine(t, "good")
			cfg := stallConfig(sched.RoundRobin, bad.URL(), good.URL())
			if tc.writeTimeout > 0 {
				cfg.WriteTimeout = tc.writeTimeout
			}
			g, url := startGateway(t, cfg)
			c := testClient(t)
			var stalled []byte
			for range 2 {
				resp, b := post(t, c, url+pathChat, streamBody(false))
				if resp.StatusCode != 200 {
					t.Fatalf("%d %s", resp.StatusCode, b)
				}
				if resp.Header.Get("X-Engine") != "good" {
					stalled = b
				}
			}
			if !bytes.HasPrefix(stalled, []byte(roleChunk+tokenChunk)) || !bytes.HasSuffix(stalled, []byte("data: [DONE]\n\n")) ||
				!bytes.Contains(stalled, []byte(`"code":"upstream_timeout"`)) || !bytes.Contains(stalled, []byte("stream_idle_timeout")) {
				t.Fatalf("stalled stream:\n%s", stalled)
			}
			waitFor(t, "the stalled request canceled", func() bool { return bad.cur.Load() == 0 })
			m := scrape(t, c, url)
			if v := m.value("infergate_requests_total", `code="504"`); v != 1 {
				t.Errorf("requests_total{504} = %v, want 1", v)
			}
			if v := m.value("infergate_retries_total", ""); v != 0 {
				t.Errorf("retries_total = %v, want 0 (output had reached the client)", v)
			}
			if n := g.state.Load().endpoints[0].outlier.consecutive.Load(); n != 1 {
				t.Errorf("the stalled endpoint's consecutive failures = %d, want 1", n)
			}
		})
	}
}

// TestSlowStreamNotTimedOut: output events further apart in total than the
// timeouts, each gap well inside stream_idle_timeout, and comments between
// them, complete normally.
func TestSlowStreamNotTimedOut(t *testing.T) {
	e := newFuncEngine(t, func(w http.ResponseWriter, r *http.Request) {
		sseStart(w)
		sseSend(w, roleChunk)
		for range 30 { // 30 × 50 ms: past both timeouts in total
			time.Sleep(50 * time.Millisecond)
			sseSend(w, ": keep-alive\n\n"+tokenChunk)
		}
		sseSend(w, "data: [DONE]\n\n")
	})
	cfg := stallConfig(sched.RoundRobin, e.URL())
	_, url := startGateway(t, cfg)
	resp, b := post(t, testClient(t), url+pathChat, streamBody(false))
	if resp.StatusCode != 200 || bytes.Count(b, []byte(`"Hel"`)) != 30 || bytes.Contains(b, []byte(`"error"`)) {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
}

// TestStalledEndpointEjected: under the default policy, an endpoint that
// accepts requests and never answers them is timed out, ejected, and
// stops absorbing requests, while every request completes on the others
// (before first_event_timeout it held every request it was given until
// the client gave up: 16 in flight there, 0 on the healthy ones).
func TestStalledEndpointEjected(t *testing.T) {
	stalled := newFuncEngine(t, func(w http.ResponseWriter, r *http.Request) {
		sseStart(w)
		until(r, func() { sseSend(w, ": keep-alive\n\n") })
	})
	// The stalled engine sits where the default policy's tie-break sends a
	// prefix first (four idle endpoints tie): the first decision of a fresh
	// policy, as the gateway's is.
	first, err := sched.NewPolicy(sched.Config{Policy: DefaultPolicy}, sched.Pool{Capacity: make([]int, 4)})
	if err != nil {
		t.Fatal(err)
	}
	idle := make([]sched.Endpoint, 4)
	for i := range idle {
		idle[i].Ready = true
	}
	stalledIdx := first.Pick(&sched.Request{}, idle).Endpoint
	var urls []string
	var good []*fakeEngine
	for i := range 3 {
		if i == stalledIdx {
			urls = append(urls, stalled.URL())
		}
		e := newFakeEngine(t, fmt.Sprintf("good%d", i))
		good = append(good, e)
		urls = append(urls, e.URL())
	}
	if stalledIdx == 3 {
		urls = append(urls, stalled.URL())
	}
	cfg := stallConfig(DefaultPolicy, urls...)
	// Two failures eject it: how many of the first concurrent requests
	// land there before the prefix's later ones go elsewhere depends on
	// timing (2 of them at load 6 once, when this asked for 3).
	cfg.Outlier.ConsecutiveErrors = 2
	// Every request held there fails at once: let all of them retry (the
	// default budget, 20% of those in flight, answers the rest 504).
	cfg.Retry.BudgetPercent = 100
	// The stalled engine answers its headers at once and is caught by
	// first_event_timeout; the healthy ones' headers get a minute, not
	// stallTimeout, which a loaded host (load 20) once exceeded (a 504).
	cfg.ResponseHeaderTimeout = time.Minute
	g, url := startGateway(t, cfg)
	c := testClient(t)
	ctx, cancel := contextWithCancel(t)
	defer cancel()

	const requests, clients = 48, 16
	body := `{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"system","content":"` +
		strings.Repeat("You are a helpful assistant that answers briefly. ", 40) + `"},{"role":"user","content":"Hello"}]}`
	var next atomic.Int64
	errs := make(chan error, clients)
	for range clients {
		go func() {
			var err error
			for n := next.Add(1); n <= requests && err == nil; n = next.Add(1) {
				// One conversation's prefix: affinity keeps it where it
				// went first.
				r := <-sendAsync(ctx, c, url+pathChat, body)
				switch {
				case r.err != nil:
					err = r.err
				case r.status != 200 || !bytes.Contains(r.body, []byte("Hel")) || bytes.Contains(r.body, []byte(`"error"`)):
					err = fmt.Errorf("%d %s", r.status, r.body)
				}
			}
			errs <- err
		}()
	}
	spread := func() string {
		var served []int64
		for _, e := range good {
			served = append(served, e.requests.Load())
		}
		var inFlight int64
		for i, ep := range g.state.Load().endpoints {
			if i != stalledIdx {
				inFlight += ep.ledger.InFlight()
			}
		}
		return fmt.Sprintf("stalled endpoint: %d requests, %d held now, at most %d at once; healthy endpoints served %v, %d in flight",
			stalled.requests.Load(), stalled.cur.Load(), stalled.max.Load(), served, inFlight)
	}
	for range clients {
		select {
		case err := <-errs:
			if err != nil {
				t.Fatalf("%v\n%s", err, spread())
			}
		case <-time.After(60 * time.Second):
			t.Fatalf("requests still held after 60 s\n%s", spread())
		}
	}
	tried := stalled.requests.Load()
	t.Log(spread())
	if tried < int64(cfg.Outlier.ConsecutiveErrors) {
		t.Fatalf("the stalled endpoint got %d requests, fewer than the %d that eject it", tried, cfg.Outlier.ConsecutiveErrors)
	}
	if g.state.Load().endpoints[stalledIdx].ready.Load() {
		t.Error("the stalled endpoint is still in rotation")
	}
	waitFor(t, "nothing in flight", func() bool {
		for _, ep := range g.state.Load().endpoints {
			if ep.ledger.InFlight() != 0 {
				return false
			}
		}
		return stalled.cur.Load() == 0
	})
	m := scrape(t, c, url)
	if v := m.value("infergate_endpoint_ejections_total", `reason="timeout"`); v < 1 {
		t.Errorf("ejections_total{timeout} = %v, want ≥ 1", v)
	}
	if v := m.value("infergate_requests_total", `code="200"`); v != requests {
		t.Errorf("requests_total{200} = %v, want %d", v, requests)
	}
}

// TestStallOverTLS: an https engine goes through the fallback transport,
// whose deadlines are timers (watchedBody): the same stalls time out there.
func TestStallOverTLS(t *testing.T) {
	for _, tc := range []struct {
		name   string
		stream bool
		serve  http.HandlerFunc
		want   int
	}{
		{"stream: no response headers", true, stalls[0].serve, http.StatusGatewayTimeout},
		{"stream: comments forever", true, stalls[2].serve, http.StatusGatewayTimeout},
		{"non-streaming: headers, then part of the body", false, stalls[6].serve, http.StatusGatewayTimeout},
		{"stream: one token, then comments", true, func(w http.ResponseWriter, r *http.Request) {
			sseStart(w)
			sseSend(w, tokenChunk)
			until(r, func() { sseSend(w, ":\n\n") })
		}, http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var cur atomic.Int64
			eng := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Method != http.MethodPost {
					return
				}
				cur.Add(1)
				defer cur.Add(-1)
				_, _ = io.Copy(io.Discard, r.Body)
				tc.serve(w, r)
			}))
			t.Cleanup(eng.Close)
			g, err := New(context.Background(), stallConfig(sched.RoundRobin, eng.URL), nil)
			if err != nil {
				t.Fatal(err)
			}
			g.up = upstream.New(upstreamOptions(g.cfg), eng.Client().Transport) // trusts the test certificate
			g.rt = g.up
			srv := httptest.NewServer(g.Handler())
			t.Cleanup(func() { srv.Close(); g.Close() })
			body := chatBody
			if tc.stream {
				body = streamBody(false)
			}
			resp, b := post(t, testClient(t), srv.URL+pathChat, body)
			switch tc.want {
			case http.StatusOK:
				if resp.StatusCode != 200 || !bytes.Contains(b, []byte(`"code":"upstream_timeout"`)) || !bytes.HasSuffix(b, []byte("data: [DONE]\n\n")) {
					t.Fatalf("%d %s", resp.StatusCode, b)
				}
			default:
				if e := decodeError(t, b); resp.StatusCode != tc.want || codeStr(e.Code) != codeUpstreamTimeout {
					t.Fatalf("%d %s", resp.StatusCode, b)
				}
			}
			waitFor(t, "the stalled request canceled", func() bool { return cur.Load() == 0 })
		})
	}
}

// TestConfigStreamTimeouts: the defaults, and non-positive values refused.
func TestConfigStreamTimeouts(t *testing.T) {
	cfg := testConfig(sched.RoundRobin)
	cfg.Endpoints = []EndpointConfig{{URL: "http://127.0.0.1:1", Model: "m"}}
	d := cfg.WithDefaults()
	if d.FirstEventTimeout != DefaultFirstEventTimeout || d.StreamIdleTimeout != DefaultStreamIdleTimeout {
		t.Fatalf("defaults %v %v", d.FirstEventTimeout, d.StreamIdleTimeout)
	}
	for _, key := range []string{"first_event_timeout", "stream_idle_timeout"} {
		bad := d
		if key == "first_event_timeout" {
			bad.FirstEventTimeout = -time.Second
		} else {
			bad.StreamIdleTimeout = -time.Second
		}
		if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), key) {
			t.Errorf("%s -1s: %v", key, err)
		}
	}
}

// TestTrickledBodyBounded: an engine that sends a non-streaming answer's
// headers and then one byte at a time, each well within
// stream_idle_timeout, is cut at response_header_timeout after the
// headers (the whole body is due by then), and the request completes on
// the other engine; before, only the per-read idle bound applied and the
// client was held as long as the engine kept dripping.
func TestTrickledBodyBounded(t *testing.T) {
	trickle := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != pathChat {
			return
		}
		_, _ = io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		sseSend(w, `{"id":"x",`)
		until(r, func() { sseSend(w, " ") })
	}))
	defer trickle.Close()
	good := newFakeEngine(t, "good")
	cfg := stallConfig(sched.RoundRobin, trickle.URL, good.URL())
	cfg.ResponseHeaderTimeout = 2 * time.Second // the healthy engine answers within it on a loaded machine
	cfg.Retry.BudgetPercent = 100
	_, url := startGateway(t, cfg)
	c := testClient(t)
	retried := 0
	for i := range 2 { // round-robin: one of them at least reaches the trickle
		r := await(t, sendAsync(context.Background(), c, url+pathChat, chatBody))
		if r.err != nil || r.status != 200 || !strings.Contains(string(r.body), "Hel") {
			t.Fatalf("request %d: %d %v %s", i, r.status, r.err, r.body)
		}
		if r.header.Get(AttemptsHeader) == "2" {
			retried++
		}
	}
	if v := scrape(t, c, url).value("infergate_retries_total", `reason="timeout"`); retried == 0 || v != float64(retried) {
		t.Errorf(`%d requests retried, retries_total{reason="timeout"} = %v`, retried, v)
	}
}
