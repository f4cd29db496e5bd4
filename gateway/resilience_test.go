package gateway

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// Tests of retries, outlier ejection, circuit breakers and admission
// control. They assert outcomes and counts, never timings, and wait with
// the generous deadlines of waitFor.

// funcEngine is a loopback engine answering completions with a handler;
// it counts the completions it received and the most it held at once.
type funcEngine struct {
	srv      *httptest.Server
	requests atomic.Int64
	cur, max atomic.Int64
}

func newFuncEngine(t testing.TB, h http.HandlerFunc) *funcEngine {
	t.Helper()
	e := &funcEngine{}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			http.NotFound(w, r)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		e.requests.Add(1)
		n := e.cur.Add(1)
		defer e.cur.Add(-1)
		for m := e.max.Load(); n > m && !e.max.CompareAndSwap(m, n); m = e.max.Load() {
		}
		h(w, r)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *funcEngine) URL() string { return e.srv.URL }

// okJSON answers a non-streaming chat completion.
func okJSON(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
}

// blockUntil answers okJSON once release is closed (or the request ends).
func blockUntil(release <-chan struct{}) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
			okJSON(w, r)
		case <-r.Context().Done():
		}
	}
}

// resilienceConfig serves model "m" from urls with health checks and
// scraping off and ejections long enough to outlast a test.
func resilienceConfig(policy string, urls ...string) Config {
	cfg := Config{EjectDuration: time.Minute, HealthCheckInterval: time.Hour, HealthCheckTimeout: time.Second,
		HealthCheckPath: healthCheckOff, ScrapeInterval: -1}
	cfg.Routing.Policy = policy
	for _, u := range urls {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: u, Model: "m", KVBlocks: 1000})
	}
	return cfg
}

// send posts body in the background and returns the channel of its result.
type result struct {
	status int
	header http.Header
	body   []byte
	err    error
}

func sendAsync(ctx context.Context, c *http.Client, url, body string, hdr ...string) <-chan result {
	ch := make(chan result, 1)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1]) // a name given twice is sent twice
	}
	go func() {
		resp, err := c.Do(req)
		if err != nil {
			ch <- result{err: err}
			return
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		ch <- result{status: resp.StatusCode, header: resp.Header, body: b, err: err}
	}()
	return ch
}

func await(t *testing.T, ch <-chan result) result {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("request did not finish in 10s")
	}
	return result{}
}

func TestRetryConnectFailureGoesElsewhere(t *testing.T) {
	good := newFakeEngine(t, "good")
	dead := closedURL(t)
	g, url := startGateway(t, resilienceConfig(sched.RoundRobin, dead, good.URL()))
	c := testClient(t)
	// Round-robin sends one of the first two requests to the dead engine:
	// it is retried on the good one, and the dead one is ejected at once.
	for i := range 4 {
		body := chatBody
		if i%2 == 1 {
			body = streamBody(false)
		}
		resp, b := post(t, c, url+pathChat, body)
		if resp.StatusCode != 200 || !bytes.Contains(b, []byte("Hel")) {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
	}
	if g.state.Load().endpoints[0].ready.Load() {
		t.Error("refused endpoint still in rotation")
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_retries_total", `reason="connect_failure"`); v != 1 {
		t.Errorf("retries_total{connect_failure} = %v, want 1", v)
	}
	if v := m.value("infergate_endpoint_ejections_total", `reason="connect_failure"`); v != 1 {
		t.Errorf("ejections{connect_failure} = %v, want 1", v)
	}
	if v := m.value("infergate_requests_total", `code="200"`); v != 4 {
		t.Errorf("requests_total{200} = %v, want 4 (a retried request counts once)", v)
	}
	if n := good.requests.Load(); n != 4 {
		t.Errorf("good engine served %d, want 4", n)
	}
}

func TestRetry5xxAndStreamFailureBeforeFirstEvent(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		fail       http.HandlerFunc
		reason     string
	}{
		{"engine 503 JSON", chatBody, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, `{"error":{"message":"overloaded","type":"ServiceUnavailable","code":503}}`)
		}, reason5xx},
		{"engine 500 text, streaming", streamBody(true), func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "boom", http.StatusInternalServerError)
		}, reason5xx},
		{"stream headers then drop", streamBody(false), func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			_ = http.NewResponseController(w).Flush()
			panic(http.ErrAbortHandler)
		}, reasonReset},
		{"non-streaming 200 then drop", chatBody, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(http.StatusOK)
			_ = http.NewResponseController(w).Flush()
			panic(http.ErrAbortHandler)
		}, reasonReset},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bad := newFuncEngine(t, tc.fail)
			good := newFakeEngine(t, "good")
			g, url := startGateway(t, resilienceConfig(sched.RoundRobin, bad.URL(), good.URL()))
			c := testClient(t)
			for i := range 4 {
				resp, b := post(t, c, url+pathChat, tc.body)
				if resp.StatusCode != 200 || !bytes.Contains(b, []byte("Hel")) || bytes.Contains(b, []byte("error")) {
					t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
				}
				if resp.Header.Get("X-Engine") != "good" {
					t.Errorf("request %d answered by %q", i, resp.Header.Get("X-Engine"))
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
			if n := good.requests.Load(); n != 4 {
				t.Errorf("good engine served %d, want 4", n)
			}
			if g.state.Load().endpoints[0].ready.Load() != (tried < DefaultOutlierConsecutiveErrors) {
				t.Errorf("bad endpoint ready=%v after %d errors", g.state.Load().endpoints[0].ready.Load(), tried)
			}
		})
	}
}

func TestRetryAttemptsHeaderAndLimit(t *testing.T) {
	var engines []string
	var bads []*funcEngine
	for range 4 {
		e := newFuncEngine(t, func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "down", http.StatusBadGateway) })
		bads = append(bads, e)
		engines = append(engines, e.URL())
	}
	cfg := resilienceConfig(sched.RoundRobin, engines...)
	cfg.Retry.MaxAttempts = 3
	_, url := startGateway(t, cfg)
	c := testClient(t)
	resp, b := post(t, c, url+pathChat, chatBody)
	if resp.StatusCode != http.StatusBadGateway || codeStr(decodeError(t, b).Code) != openai.CodeUpstream {
		t.Fatalf("all failing: %d %s", resp.StatusCode, b)
	}
	if got := resp.Header.Get(AttemptsHeader); got != "3" {
		t.Errorf("%s = %q, want 3", AttemptsHeader, got)
	}
	total := int64(0)
	for _, e := range bads {
		if n := e.requests.Load(); n > 1 {
			t.Errorf("an endpoint was tried %d times for one request", n)
		}
		total += e.requests.Load()
	}
	if total != 3 {
		t.Errorf("%d attempts, want max_attempts 3", total)
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_requests_total", `code="502"`); v != 1 {
		t.Errorf("requests_total{502} = %v, want 1", v)
	}
}

// A non-streaming answer is held until its end (relayBody), so one that
// breaks midway has sent the client nothing and is retried elsewhere.
func TestRetryBodyBrokenBeforeItsEnd(t *testing.T) {
	bad, good := newFakeEngine(t, "bad"), newFakeEngine(t, "good")
	bad.mode.Store(int32(modeMidFail)) // part of the body, then the connection drops
	_, url := startGateway(t, resilienceConfig(sched.RoundRobin, bad.URL(), good.URL()))
	c := testClient(t)
	for range 2 {
		resp, b := send(t, c, http.MethodPost, url+pathChat, chatBody, "Content-Type", "application/json")
		if resp.StatusCode != 200 || resp.Header.Get("X-Engine") != "good" || !bytes.Contains(b, []byte(`"choices"`)) {
			t.Fatalf("%d from %q: %s", resp.StatusCode, resp.Header.Get("X-Engine"), b)
		}
	}
	if n := bad.requests.Load(); n < 1 {
		t.Fatalf("the failing engine got %d requests", n)
	}
	if v := scrape(t, c, url).value("infergate_retries_total", ""); v != float64(bad.requests.Load()) {
		t.Errorf("retries_total = %v, want %d (one per broken answer)", v, bad.requests.Load())
	}
}

func TestNoRetryAfterFirstByte(t *testing.T) {
	// Only streams: a non-streaming answer reaches the client whole or not
	// at all (TestRetryBodyBrokenBeforeItsEnd), unless it is over 4 MiB.
	for _, stream := range []bool{true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			bad, good := newFakeEngine(t, "bad"), newFakeEngine(t, "good")
			bad.mode.Store(int32(modeMidFail)) // output, then the connection drops
			_, url := startGateway(t, resilienceConfig(sched.RoundRobin, bad.URL(), good.URL()))
			c := testClient(t)
			var failed int
			for range 2 { // round-robin: one to each engine
				body := chatBody
				if stream {
					body = streamBody(false)
				}
				resp, err := c.Post(url+pathChat, "application/json", strings.NewReader(body))
				if err != nil && !stream {
					failed++ // aborted before the status line reached the client
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				b, rerr := io.ReadAll(resp.Body)
				resp.Body.Close()
				switch {
				case resp.Header.Get("X-Engine") == "good":
					if rerr != nil || resp.StatusCode != 200 {
						t.Errorf("good engine: %d %v", resp.StatusCode, rerr)
					}
				case stream:
					// Mid-stream failure: an OpenAI error event and [DONE].
					failed++
					if !bytes.Contains(b, []byte(`"code":"upstream_error"`)) || !bytes.HasSuffix(b, []byte("data: [DONE]\n\n")) {
						t.Errorf("mid-stream failure:\n%s", b)
					}
				default:
					// Non-streaming: the client's connection is aborted.
					failed++
					if rerr == nil {
						t.Errorf("truncated body read without error: %s", b)
					}
				}
			}
			if failed != 1 || bad.requests.Load() != 1 || good.requests.Load() != 1 {
				t.Errorf("failed %d, bad %d, good %d requests; want 1 each (no retry)", failed, bad.requests.Load(), good.requests.Load())
			}
			m := scrape(t, c, url)
			if v := m.value("infergate_retries_total", ""); v != 0 {
				t.Errorf("retries_total = %v, want 0", v)
			}
			if v := m.value("infergate_requests_total", `code="502"`); v != 1 {
				t.Errorf("requests_total{502} = %v, want 1", v)
			}
		})
	}
}

func TestNo4xxRetry(t *testing.T) {
	bad, good := newFakeEngine(t, "bad"), newFakeEngine(t, "good")
	bad.mode.Store(int32(modeError400))
	_, url := startGateway(t, resilienceConfig(sched.RoundRobin, bad.URL(), good.URL()))
	c := testClient(t)
	codes := map[int]int{}
	for range 2 {
		resp, _ := post(t, c, url+pathChat, chatBody)
		codes[resp.StatusCode]++
	}
	if codes[400] != 1 || codes[200] != 1 || bad.requests.Load() != 1 || good.requests.Load() != 1 {
		t.Errorf("codes %v, bad %d, good %d: a 4xx must be relayed, not retried", codes, bad.requests.Load(), good.requests.Load())
	}
	if v := scrape(t, c, url).value("infergate_retries_total", ""); v != 0 {
		t.Errorf("retries_total = %v, want 0", v)
	}
}

// TestRetryBudgetLostEndpoint: a connection lost on an endpoint that its
// failure took out of rotation is retried even with the budget spent (an
// engine that dies fails every request waiting on it at once, and the
// survivors can take them); one lost on an endpoint still in rotation is
// charged like any retry.
func TestRetryBudgetLostEndpoint(t *testing.T) {
	for _, tc := range []struct {
		name        string
		consecutive int // outlier.consecutive_errors: 1 ejects at the first lost connection
		want        map[int]int
		denied      float64
	}{
		{"ejected", 1, map[int]int{200: 2}, 0},
		{"in rotation", 100, map[int]int{200: 1, 502: 1}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bad := newFuncEngine(t, func(w http.ResponseWriter, _ *http.Request) {
				conn, _, err := http.NewResponseController(w).Hijack()
				if err == nil {
					_ = conn.Close() // the connection closes before any answer: connection_lost
				}
			})
			good := newFakeEngine(t, "good")
			cfg := resilienceConfig(sched.RoundRobin, bad.URL(), good.URL())
			cfg.Outlier.ConsecutiveErrors = tc.consecutive
			g, url := startGateway(t, cfg)
			c := testClient(t)
			p := g.state.Load().pools["m"]
			p.budget.inFlight.Store(DefaultMinRetryConcurrency) // spent: max(3, 20% of 1 active)
			codes := map[int]int{}
			for range 2 {
				resp, _ := post(t, c, url+pathChat, chatBody)
				codes[resp.StatusCode]++
			}
			if !maps.Equal(codes, tc.want) || bad.requests.Load() != 1 {
				t.Errorf("codes %v (bad engine asked %d times), want %v after one request to the bad engine",
					codes, bad.requests.Load(), tc.want)
			}
			m := scrape(t, c, url)
			if v := m.value("infergate_retries_denied_total", `reason="budget"`); v != tc.denied {
				t.Errorf("retries_denied{budget} = %v, want %v", v, tc.denied)
			}
			if n := p.budget.inFlight.Load(); n != DefaultMinRetryConcurrency {
				t.Errorf("retry budget holds %d after the requests ended, want the %d stored", n, DefaultMinRetryConcurrency)
			}
		})
	}
}

func TestRetryBudget(t *testing.T) {
	bad := newFuncEngine(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, `{"error":{"message":"engine failed","type":"InternalServerError","code":500}}`)
	})
	good := newFakeEngine(t, "good")
	cfg := resilienceConfig(sched.RoundRobin, bad.URL(), good.URL())
	cfg.Outlier.ConsecutiveErrors = 100
	g, url := startGateway(t, cfg)
	c := testClient(t)
	p := g.state.Load().pools["m"]

	// The budget is spent: max(3, 20% of 1 active) = 3 retries already in
	// flight. The engine's JSON 500 is relayed instead of retried.
	p.budget.inFlight.Store(DefaultMinRetryConcurrency)
	codes := map[int]int{}
	for range 2 {
		resp, b := post(t, c, url+pathChat, chatBody)
		codes[resp.StatusCode]++
		if resp.StatusCode == 500 && !bytes.Contains(b, []byte("engine failed")) {
			t.Errorf("engine error not relayed: %s", b)
		}
	}
	if codes[500] != 1 || codes[200] != 1 {
		t.Errorf("with the budget spent: codes %v, want one 500 relayed and one 200", codes)
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_retries_denied_total", `reason="budget"`); v != 1 {
		t.Errorf("retries_denied{budget} = %v, want 1", v)
	}
	// Budget back: the failure is retried.
	p.budget.inFlight.Store(0)
	for range 2 {
		if resp, b := post(t, c, url+pathChat, chatBody); resp.StatusCode != 200 {
			t.Errorf("with budget: %d %s", resp.StatusCode, b)
		}
	}
	if n := p.budget.inFlight.Load(); n != 0 {
		t.Errorf("retry budget holds %d after the requests ended", n)
	}

	var b retryBudget
	for i := range 3 {
		if !b.take(0, 20, 3) {
			t.Fatalf("retry %d denied under min_retry_concurrency 3", i+1)
		}
	}
	if b.take(10, 20, 3) {
		t.Error("4th retry allowed with 10 active (20% = 2 < 3)")
	}
	if !b.take(20, 20, 3) {
		t.Error("4th retry denied with 20 active (20% = 4)")
	}
}

func TestOutlierEjectionBackoff(t *testing.T) {
	cfg := resilienceConfig(sched.RoundRobin, "http://127.0.0.1:1", "http://127.0.0.1:2")
	cfg.EjectDuration = time.Hour // no health check restores during the test
	cfg.Outlier = OutlierConfig{ConsecutiveErrors: 3, MaxEjectionTime: 4 * time.Hour}
	g, _ := startGateway(t, cfg)
	ep := g.state.Load().endpoints[0]
	now := time.Now()
	until := func() time.Duration { return time.Duration(ep.ejectedUntil.Load() - now.UnixNano()) }
	restore := func(at time.Time) {
		now = at
		ep.setReady(true)
	}

	// Two errors, a success, two errors: no ejection (the count resets).
	for _, ok := range []bool{false, false, true, false, false} {
		if ok {
			ep.outlierSuccess()
		} else if g.outlierFailure(ep, reason5xx, now) {
			t.Fatal("ejected before 3 consecutive errors")
		}
	}
	if !ep.ready.Load() {
		t.Fatal("not ready")
	}
	// Third in a row: ejected for eject_duration; more failures of the
	// same outage do not extend it.
	if !g.outlierFailure(ep, reasonTimeout, now) || ep.ready.Load() || until() != time.Hour {
		t.Fatalf("third error: ready=%v, ejected for %v, want 1h", ep.ready.Load(), until())
	}
	for range 5 {
		g.outlierFailure(ep, reason5xx, now.Add(time.Minute))
	}
	if until() != time.Hour {
		t.Errorf("ejection extended to %v by failures during it", until())
	}
	// Ejected again soon after each restore: 2h, 4h, then capped at 4h.
	for _, want := range []time.Duration{2 * time.Hour, 4 * time.Hour, 4 * time.Hour} {
		restore(time.Unix(0, ep.ejectedUntil.Load()).Add(time.Second))
		for range 3 {
			g.outlierFailure(ep, reason5xx, now)
		}
		if ep.ready.Load() || until() != want {
			t.Errorf("ejected for %v, want %v", until(), want)
		}
	}
	// In rotation for max_ejection_time: the back-off starts over.
	restore(time.Unix(0, ep.ejectedUntil.Load()).Add(5 * time.Hour))
	for range 3 {
		g.outlierFailure(ep, reason5xx, now)
	}
	if until() != time.Hour {
		t.Errorf("after a long healthy spell ejected for %v, want 1h", until())
	}
	// A refused connection ejects at once.
	ep2 := g.state.Load().endpoints[1]
	if !g.outlierFailure(ep2, reasonConnect, now) || ep2.ready.Load() {
		t.Error("connection refused did not eject")
	}
}

func TestOutlierEjectsAfterConsecutive5xx(t *testing.T) {
	bad := newFuncEngine(t, func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "x", http.StatusInternalServerError) })
	good := newFakeEngine(t, "good")
	cfg := resilienceConfig(sched.LeastRequest, bad.URL(), good.URL())
	cfg.Outlier.ConsecutiveErrors = 2
	g, url := startGateway(t, cfg)
	c := testClient(t)
	for i := 0; g.state.Load().endpoints[0].ready.Load(); i++ {
		if i > 50 {
			t.Fatal("the failing endpoint was never ejected")
		}
		if resp, b := post(t, c, url+pathChat, chatBody); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	if n := bad.requests.Load(); n != 2 {
		t.Errorf("ejected after %d errors, want 2", n)
	}
	if v := scrape(t, c, url).value("infergate_endpoint_ejections_total", `reason="5xx"`); v != 1 {
		t.Errorf("ejections{5xx} = %v", v)
	}
}

func TestCircuitBreakerLimit(t *testing.T) {
	release := make(chan struct{})
	e1, e2 := newFuncEngine(t, blockUntil(release)), newFuncEngine(t, blockUntil(release))
	cfg := resilienceConfig(sched.Prefix, e1.URL(), e2.URL())
	cfg.CircuitBreaker.MaxRequests = 2
	g, url := startGateway(t, cfg)
	c := testClient(t)
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	// The same prompt: the prefix policy would pile them on one engine.
	body := tokenPrompt(64, 0, 0)
	var chans []<-chan result
	for range 6 {
		chans = append(chans, sendAsync(ctx, c, url+pathCompletions, body))
	}
	p := g.state.Load().pools["m"]
	waitFor(t, "4 in flight and 2 queued", func() bool {
		return e1.cur.Load()+e2.cur.Load() == 4 && p.gate.waiting.Load() == 2
	})
	if e1.cur.Load() != 2 || e2.cur.Load() != 2 {
		t.Errorf("in flight %d and %d, want 2 and 2", e1.cur.Load(), e2.cur.Load())
	}
	if v := scrape(t, c, url).value("infergate_admission_queue_length", `model="m"`); v != 2 {
		t.Errorf("queue length gauge %v, want 2", v)
	}
	close(release)
	for _, ch := range chans {
		if r := await(t, ch); r.status != 200 {
			t.Errorf("status %d %s %v", r.status, r.body, r.err)
		}
	}
	if e1.max.Load() > 2 || e2.max.Load() > 2 {
		t.Errorf("max in flight %d and %d, limit 2", e1.max.Load(), e2.max.Load())
	}
	if v := scrape(t, c, url).value("infergate_admission_queue_wait_seconds_count", `model="m"`); v != 2 {
		t.Errorf("queue wait observations %v, want 2", v)
	}
}

// queued is queueSetup's scene: a gateway over one engine with one slot,
// held by a blocked request until release is closed.
type queued struct {
	g       *Gateway
	url     string
	c       *http.Client
	e       *funcEngine
	release chan struct{}
	blocker <-chan result
	order   chan string // X-Request-Id of each request the engine received
}

// queueSetup builds the scene with admission tuned by adm.
func queueSetup(t *testing.T, adm AdmissionConfig) *queued {
	t.Helper()
	return queueSetupWith(t, adm, nil)
}

// queueSetupWith is queueSetup with the config edited by edit (when not nil)
// and the blocked request sent with the extra headers hdr (name, value
// pairs).
func queueSetupWith(t *testing.T, adm AdmissionConfig, edit func(*Config), hdr ...string) *queued {
	t.Helper()
	release := make(chan struct{})
	order := make(chan string, 64)
	e := newFuncEngine(t, func(w http.ResponseWriter, r *http.Request) {
		order <- r.Header.Get("X-Request-Id")
		if r.Header.Get("X-Request-Id") == "blocker" {
			blockUntil(release)(w, r)
			return
		}
		okJSON(w, r)
	})
	cfg := resilienceConfig(sched.RoundRobin, e.URL())
	cfg.CircuitBreaker.MaxRequests = 1
	cfg.Admission = adm
	if edit != nil {
		edit(&cfg)
	}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	ctx, cancel := contextWithCancel(t)
	t.Cleanup(cancel)
	blocker := sendAsync(ctx, c, url+pathChat, chatBody, append([]string{"X-Request-Id", "blocker"}, hdr...)...)
	if id := <-order; id != "blocker" {
		t.Fatalf("first at the engine: %q", id)
	}
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	return &queued{g: g, url: url, c: c, e: e, release: release, blocker: blocker, order: order}
}

func TestAdmissionPriorityOrder(t *testing.T) {
	q := queueSetup(t, AdmissionConfig{})
	g, url, c, release, blocker := q.g, q.url, q.c, q.release, q.blocker
	p := g.state.Load().pools["m"]
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	var chans []<-chan result
	for i, prio := range []string{"0", "5", "", "5", "-3", "9"} {
		chans = append(chans, sendAsync(ctx, c, url+pathChat, chatBody, "X-Request-Id", fmt.Sprintf("r%d", i), PriorityHeader, prio))
		waitFor(t, "queued", func() bool { return p.gate.waiting.Load() == int64(i+1) })
	}
	close(release)
	if r := await(t, blocker); r.status != 200 {
		t.Fatalf("blocker: %d", r.status)
	}
	for _, ch := range chans {
		if r := await(t, ch); r.status != 200 {
			t.Errorf("status %d", r.status)
		}
	}
	var got []string
	for range chans {
		got = append(got, <-q.order)
	}
	// Priority 9, then 5 (FIFO), then 0 and absent (FIFO), then -3.
	if want := "r5 r1 r3 r0 r2 r4"; strings.Join(got, " ") != want {
		t.Errorf("admission order %v, want %s", got, want)
	}
}

func TestAdmissionQueueTimeout(t *testing.T) {
	q := queueSetup(t, AdmissionConfig{QueueTimeout: 200 * time.Millisecond})
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	r := await(t, sendAsync(ctx, q.c, q.url+pathChat, chatBody))
	if r.status != http.StatusTooManyRequests || r.header.Get("Retry-After") != admissionRetryAfter {
		t.Fatalf("queue timeout: %d Retry-After=%q %s", r.status, r.header.Get("Retry-After"), r.body)
	}
	if e := decodeError(t, r.body); codeStr(e.Code) != codeOverloaded || e.Type != "rate_limit_error" {
		t.Errorf("queue timeout error %+v", e)
	}
	if q.g.state.Load().pools["m"].gate.waiting.Load() != 0 {
		t.Error("timed-out request still queued")
	}
	close(q.release)
	if r := await(t, q.blocker); r.status != 200 {
		t.Errorf("blocker %d", r.status)
	}
	m := scrape(t, q.c, q.url)
	if v := m.value("infergate_admission_rejections_total", `reason="queue_timeout"`); v != 1 {
		t.Errorf("rejections{queue_timeout} = %v, want 1", v)
	}
	if v := m.value("infergate_requests_total", `code="429"`); v != 1 {
		t.Errorf("requests_total{429} = %v, want 1", v)
	}
}

func TestAdmissionQueueCapacity(t *testing.T) {
	q := queueSetup(t, AdmissionConfig{MaxQueue: 1})
	p := q.g.state.Load().pools["m"]
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	// One waits, the next is refused at once.
	waiting := sendAsync(ctx, q.c, q.url+pathChat, chatBody)
	waitFor(t, "one queued", func() bool { return p.gate.waiting.Load() == 1 })
	r := await(t, sendAsync(ctx, q.c, q.url+pathChat, chatBody))
	if r.status != http.StatusTooManyRequests || r.header.Get("Retry-After") != admissionRetryAfter {
		t.Fatalf("queue full: %d Retry-After=%q %s", r.status, r.header.Get("Retry-After"), r.body)
	}
	if e := decodeError(t, r.body); codeStr(e.Code) != codeOverloaded {
		t.Errorf("queue full error %+v", e)
	}
	close(q.release)
	for _, ch := range []<-chan result{q.blocker, waiting} {
		if r := await(t, ch); r.status != 200 {
			t.Errorf("status %d %s", r.status, r.body)
		}
	}
	if v := scrape(t, q.c, q.url).value("infergate_admission_rejections_total", `reason="queue_full"`); v != 1 {
		t.Errorf("rejections{queue_full} = %v, want 1", v)
	}

	// No queue at all: refused at once while the slot is taken.
	q2 := queueSetup(t, AdmissionConfig{MaxQueue: -1})
	if r := await(t, sendAsync(ctx, q2.c, q2.url+pathChat, chatBody)); r.status != http.StatusTooManyRequests {
		t.Errorf("max_queue -1: %d", r.status)
	}
}

// A request that finds the queue full takes the place of a lower-priority
// waiter (the latest among the lowest), which is answered 429 at once; one
// of equal or lower priority is refused.
func TestAdmissionDisplacesLowerPriority(t *testing.T) {
	q := queueSetup(t, AdmissionConfig{MaxQueue: 3})
	p := q.g.state.Load().pools["m"]
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	var queued []<-chan result
	for i, prio := range []string{"1", "0", "0"} {
		queued = append(queued, sendAsync(ctx, q.c, q.url+pathChat, chatBody, "X-Request-Id", fmt.Sprintf("q%d", i), PriorityHeader, prio))
		waitFor(t, "queued", func() bool { return p.gate.waiting.Load() == int64(i+1) })
	}
	// Priority 0 on a full queue of priorities 1, 0, 0: refused.
	if r := await(t, sendAsync(ctx, q.c, q.url+pathChat, chatBody, PriorityHeader, "0")); r.status != http.StatusTooManyRequests {
		t.Fatalf("equal priority on a full queue: %d", r.status)
	}
	// Priority 5: q2 (priority 0, the later of the two) makes room.
	high := sendAsync(ctx, q.c, q.url+pathChat, chatBody, "X-Request-Id", "high", PriorityHeader, "5")
	r := await(t, queued[2])
	if r.status != http.StatusTooManyRequests || r.header.Get("Retry-After") != admissionRetryAfter {
		t.Fatalf("displaced waiter: %d Retry-After=%q %s", r.status, r.header.Get("Retry-After"), r.body)
	}
	if e := decodeError(t, r.body); codeStr(e.Code) != codeOverloaded || !strings.Contains(e.Message, "higher priority") {
		t.Errorf("displaced error %+v", e)
	}
	if n := p.gate.waiting.Load(); n != 3 {
		t.Fatalf("queue length %d after displacement, want 3", n)
	}
	close(q.release)
	for _, ch := range []<-chan result{q.blocker, high, queued[0], queued[1]} {
		if r := await(t, ch); r.status != 200 {
			t.Errorf("status %d %s", r.status, r.body)
		}
	}
	var got []string // the blocker's arrival was read by queueSetup
	for range 3 {
		got = append(got, <-q.order)
	}
	if want := "high q0 q1"; strings.Join(got, " ") != want {
		t.Errorf("admission order %v, want %s", got, want)
	}
	m := scrape(t, q.c, q.url)
	if v := m.value("infergate_admission_rejections_total", `reason="displaced"`); v != 1 {
		t.Errorf("rejections{displaced} = %v, want 1", v)
	}
	if v := m.value("infergate_admission_rejections_total", `reason="queue_full"`); v != 1 {
		t.Errorf("rejections{queue_full} = %v, want 1", v)
	}
}

// A key's max_priority caps the X-Priority its requests queue with: capped
// at 1, a request asking for 9 queues behind one of priority 2.
func TestAdmissionKeyMaxPriority(t *testing.T) {
	auth := func(key string) string { return "Bearer " + key }
	q := queueSetupWith(t, AdmissionConfig{}, func(cfg *Config) {
		if err := cfg.Auth.AddKeys("low plain:"+keyAlice+" max_priority=1; ops plain:"+keyBob, "test"); err != nil {
			t.Fatal(err)
		}
	}, "Authorization", auth(keyBob))
	p := q.g.state.Load().pools["m"]
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	capped := sendAsync(ctx, q.c, q.url+pathChat, chatBody, "X-Request-Id", "capped", "Authorization", auth(keyAlice), PriorityHeader, "9")
	waitFor(t, "queued", func() bool { return p.gate.waiting.Load() == 1 })
	ops := sendAsync(ctx, q.c, q.url+pathChat, chatBody, "X-Request-Id", "ops", "Authorization", auth(keyBob), PriorityHeader, "2")
	waitFor(t, "queued", func() bool { return p.gate.waiting.Load() == 2 })
	close(q.release)
	for _, ch := range []<-chan result{q.blocker, capped, ops} {
		if r := await(t, ch); r.status != 200 {
			t.Fatalf("status %d %s", r.status, r.body)
		}
	}
	if got := []string{<-q.order, <-q.order}; got[0] != "ops" || got[1] != "capped" {
		t.Errorf("admission order %v, want [ops capped] (capped's 9 lowered to its key's 1)", got)
	}
}

func TestAdmissionCancelLeavesQueue(t *testing.T) {
	q := queueSetup(t, AdmissionConfig{})
	g, url, c, e, release, blocker := q.g, q.url, q.c, q.e, q.release, q.blocker
	p := g.state.Load().pools["m"]
	ctx, cancel := context.WithCancel(context.Background())
	queued := sendAsync(ctx, c, url+pathChat, chatBody)
	waitFor(t, "queued", func() bool { return p.gate.waiting.Load() == 1 })
	cancel()
	waitFor(t, "the canceled request left the queue", func() bool { return p.gate.waiting.Load() == 0 })
	if r := await(t, queued); r.err == nil {
		t.Errorf("canceled request answered %d", r.status)
	}
	waitFor(t, "a 499 recorded", func() bool {
		return scrape(t, c, url).value("infergate_requests_total", `code="499"`) == 1
	})
	close(release)
	await(t, blocker)
	if n := e.requests.Load(); n != 1 {
		t.Errorf("engine saw %d requests, want only the blocker", n)
	}
	if a := p.gate; a.active.Load() != 0 || a.pending.Load() != 0 {
		t.Errorf("admission holds %d in flight, %d pending", a.active.Load(), a.pending.Load())
	}
}

func TestAdmissionNoEndpointFailsWaiters(t *testing.T) {
	q := queueSetup(t, AdmissionConfig{})
	g, url, c := q.g, q.url, q.c
	p := g.state.Load().pools["m"]
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	queued := sendAsync(ctx, c, url+pathChat, chatBody)
	waitFor(t, "queued", func() bool { return p.gate.waiting.Load() == 1 })
	g.state.Load().endpoints[0].setReady(false) // e.g. a failed health check
	if r := await(t, queued); r.status != http.StatusServiceUnavailable {
		t.Errorf("waiter with no endpoint left: %d %s", r.status, r.body)
	}
}

func TestConfigResilience(t *testing.T) {
	cfg := Config{Endpoints: []EndpointConfig{{URL: "http://10.0.0.1:8000", Model: "m"}}}.WithDefaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if cfg.Retry.MaxAttempts != 3 || cfg.Retry.BudgetPercent != 20 || cfg.Retry.MinRetryConcurrency != 3 ||
		cfg.Outlier.ConsecutiveErrors != 5 || cfg.Outlier.MaxEjectionTime != 5*time.Minute ||
		cfg.CircuitBreaker.MaxRequests != 1024 || cfg.Admission.MaxInFlight != 0 ||
		cfg.Admission.MaxQueue != 1024 || cfg.Admission.QueueTimeout != 30*time.Second {
		t.Errorf("defaults %+v %+v %+v %+v", cfg.Retry, cfg.Outlier, cfg.CircuitBreaker, cfg.Admission)
	}
	for name, mutate := range map[string]func(*Config){
		"attempts":    func(c *Config) { c.Retry.MaxAttempts = -1 },
		"budget":      func(c *Config) { c.Retry.BudgetPercent = 120 },
		"min retries": func(c *Config) { c.Retry.MinRetryConcurrency = -1 },
		"errors":      func(c *Config) { c.Outlier.ConsecutiveErrors = -2 },
		"max eject":   func(c *Config) { c.Outlier.MaxEjectionTime = time.Second },
		"breaker":     func(c *Config) { c.CircuitBreaker.MaxRequests = -1 },
		"in flight":   func(c *Config) { c.Admission.MaxInFlight = -1 },
		"queue ttl":   func(c *Config) { c.Admission.QueueTimeout = -time.Second },
	} {
		c := cfg
		mutate(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestResilienceNoGoroutineLeak(t *testing.T) {
	before := settledGoroutines()
	func() {
		release := make(chan struct{})
		blocked := newEngineNoCleanup(t, "e0")
		defer blocked.srv.Close()
		bad := newServerNoCleanup(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("X-Request-Id") == "blocker" {
				select {
				case <-release:
				case <-r.Context().Done():
				}
			}
			http.Error(w, "x", http.StatusBadGateway)
		}))
		defer bad.Close()
		cfg := resilienceConfig(sched.RoundRobin, bad.URL, blocked.URL())
		cfg.CircuitBreaker.MaxRequests = 1
		cfg.Admission = AdmissionConfig{MaxInFlight: 1, QueueTimeout: 100 * time.Millisecond}
		g, err := New(context.Background(), cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer g.Close()
		srv := newServerNoCleanup(g.Handler())
		defer srv.Close()
		tr := &http.Transport{}
		defer tr.CloseIdleConnections()
		c := &http.Client{Transport: tr}
		// Retries, then a held slot with a waiter timing out, one canceled.
		post(t, c, srv.URL+pathChat, chatBody)
		post(t, c, srv.URL+pathChat, streamBody(true))
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		held := sendAsync(ctx, c, srv.URL+pathChat, chatBody, "X-Request-Id", "blocker")
		waitFor(t, "slot held", func() bool { return g.state.Load().pools["m"].gate.active.Load() == 1 })
		if r := await(t, sendAsync(context.Background(), c, srv.URL+pathChat, chatBody)); r.status != 429 {
			t.Errorf("status %d, want 429", r.status)
		}
		cctx, ccancel := context.WithCancel(context.Background())
		gone := sendAsync(cctx, c, srv.URL+pathChat, chatBody)
		waitFor(t, "queued", func() bool { return g.state.Load().pools["m"].gate.waiting.Load() == 1 })
		ccancel()
		await(t, gone)
		close(release)
		await(t, held)
	}()
	requireGoroutinesBack(t, before)
}
