package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/simserver"
)

// coldEngine is an engine whose /health answers 503 until it is ready; it
// records the X-Request-Id of each completion it serves, in order, and
// counts its /wake_up calls (which make it ready when wakeReadies).
type coldEngine struct {
	srv         *httptest.Server
	ready       atomic.Bool
	wakeReadies bool
	wakes       atomic.Int64
	served      chan string
}

func newColdEngine(t testing.TB) *coldEngine {
	t.Helper()
	e := &coldEngine{served: make(chan string, 256)}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/health":
			if !e.ready.Load() {
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		case r.URL.Path == "/wake_up" && r.Method == http.MethodPost:
			e.wakes.Add(1)
			if e.wakeReadies {
				e.ready.Store(true)
			}
		case r.Method == http.MethodPost:
			body, _ := io.ReadAll(r.Body)
			e.served <- r.Header.Get("X-Request-Id")
			if strings.Contains(string(body), `"stream":true`) {
				w.Header().Set("Content-Type", "text/event-stream")
				_, _ = io.WriteString(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n"+
					"data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\ndata: [DONE]\n\n")
				return
			}
			okJSON(w, r)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(e.srv.Close)
	return e
}

// coldConfig serves model "m" from e with health checks on (an hour apart:
// only the hold's probes run) and scale from zero as hold says.
func coldConfig(e *coldEngine, hold ScaleFromZeroConfig) Config {
	cfg := resilienceConfig(sched.RoundRobin, e.srv.URL)
	cfg.HealthCheckPath = "/health"
	cfg.ScaleFromZero = map[string]ScaleFromZeroConfig{"*": hold}
	return cfg
}

// countingWaker counts its calls.
type countingWaker struct {
	calls atomic.Int64
	pools sync.Map
	then  func()
}

func (w *countingWaker) Wake(_ context.Context, pool string) error {
	w.calls.Add(1)
	w.pools.Store(pool, true)
	if w.then != nil {
		w.then()
	}
	return nil
}

// TestScaleFromZeroHoldsAndDispatches: N concurrent requests to a pool with
// no ready endpoint are all held (none lost), the wake-up hook is called
// exactly once for the episode, and every held request is served once the
// endpoint turns ready; a second episode calls the hook again.
func TestScaleFromZeroHoldsAndDispatches(t *testing.T) {
	before := settledGoroutines()
	func() {
		e := newColdEngine(t)
		defer e.srv.Close()
		wk := &countingWaker{}
		g, err := New(context.Background(), coldConfig(e, ScaleFromZeroConfig{HoldTTL: time.Minute, Wake: WakeConfig{Waker: wk}}), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer g.Close()
		srv := newServerNoCleanup(g.Handler())
		defer srv.Close()
		tr := &http.Transport{}
		defer tr.CloseIdleConnections()
		c := &http.Client{Transport: tr}
		p := g.state.Load().pools["m"]
		if p.endpoints[0].ready.Load() {
			t.Fatal("the endpoint is ready before its engine is")
		}

		const n = 32
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var chans []<-chan result
		for i := range n {
			chans = append(chans, sendAsync(ctx, c, srv.URL+pathChat, chatBody, "X-Request-Id", fmt.Sprint("r", i)))
		}
		waitFor(t, "every request held", func() bool { return p.gate.heldNow.Load() == n })
		waitFor(t, "the wake-up call", func() bool { return wk.calls.Load() >= 1 })
		if _, ok := wk.pools.Load("m"); !ok {
			t.Error("the waker was not told the pool")
		}
		m := scrape(t, c, srv.URL)
		if v := m.value("infergate_held_requests", `model="m"`); v != n {
			t.Errorf("infergate_held_requests = %v, want %d", v, n)
		}
		e.ready.Store(true)
		for _, ch := range chans {
			if r := await(t, ch); r.status != http.StatusOK {
				t.Errorf("held request: %d %s", r.status, r.body)
			}
		}
		if got := wk.calls.Load(); got != 1 {
			t.Errorf("wake-up calls %d for one episode of %d concurrent requests, want 1", got, n)
		}
		if got := len(e.served); got != n {
			t.Errorf("engine served %d, want %d", got, n)
		}
		m = scrape(t, c, srv.URL)
		for _, c := range []struct {
			name, labels string
			want         float64
		}{
			{"infergate_held_requests_total", `model="m"`, n},
			{"infergate_held_expired_total", `model="m"`, 0},
			{"infergate_wakeups_total", `result="ok"`, 1},
			{"infergate_held_requests", `model="m"`, 0},
			{"infergate_held_seconds_count", `model="m"`, n},
		} {
			if v := m.value(c.name, c.labels); v != c.want {
				t.Errorf("%s{%s} = %v, want %v", c.name, c.labels, v, c.want)
			}
		}

		// A second cold episode calls the hook again.
		e.ready.Store(false)
		p.endpoints[0].setReady(false)
		again := sendAsync(ctx, c, srv.URL+pathChat, chatBody)
		waitFor(t, "held again", func() bool { return p.gate.heldNow.Load() == 1 })
		waitFor(t, "a second wake-up", func() bool { return wk.calls.Load() == 2 })
		e.ready.Store(true)
		if r := await(t, again); r.status != http.StatusOK {
			t.Errorf("second episode: %d %s", r.status, r.body)
		}
	}()
	requireGoroutinesBack(t, before)
}

// TestScaleFromZeroTTL: a request held for hold_ttl with no endpoint ready
// gets 503 no_endpoint_available with Retry-After, counted as expired.
func TestScaleFromZeroTTL(t *testing.T) {
	e := newColdEngine(t)
	g, url := startGateway(t, coldConfig(e, ScaleFromZeroConfig{HoldTTL: 100 * time.Millisecond}))
	c := testClient(t)
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	r := await(t, sendAsync(ctx, c, url+pathChat, chatBody))
	if r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" {
		t.Fatalf("expired hold: %d Retry-After=%q %s", r.status, r.header.Get("Retry-After"), r.body)
	}
	if e := decodeError(t, r.body); codeStr(e.Code) != openai.CodeNoEndpoint || !strings.Contains(e.Message, "within") {
		t.Errorf("expired hold error %+v", e)
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_held_expired_total", `model="m"`); v != 1 {
		t.Errorf("held_expired_total = %v", v)
	}
	if v := m.value("infergate_requests_total", `code="503"`); v != 1 {
		t.Errorf("requests_total{503} = %v", v)
	}
	if g.state.Load().pools["m"].gate.heldNow.Load() != 0 {
		t.Error("the expired request is still counted held")
	}

	// Off (no hold_ttl): 503 at once, as before.
	g2, url2 := startGateway(t, coldConfig(e, ScaleFromZeroConfig{}))
	if r := await(t, sendAsync(ctx, c, url2+pathChat, chatBody)); r.status != http.StatusServiceUnavailable {
		t.Errorf("no hold: %d", r.status)
	}
	if n := g2.state.Load().pools["m"].gate.heldNow.Load(); n != 0 {
		t.Errorf("no hold: %d held", n)
	}
}

// TestScaleFromZeroBounds: the hold's count and byte bounds are exact
// under concurrency (the excess gets 503 at once), and held requests are
// dispatched in priority order, FIFO within one.
func TestScaleFromZeroBounds(t *testing.T) {
	e := newColdEngine(t)
	g, url := startGateway(t, coldConfig(e, ScaleFromZeroConfig{HoldTTL: time.Minute, MaxHeld: 5}))
	c := testClient(t)
	p := g.state.Load().pools["m"]
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	const n = 24
	results := make(chan result, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			results <- await(t, sendAsync(ctx, c, url+pathChat, chatBody, "X-Request-Id", fmt.Sprint("b", i)))
		})
	}
	rejected := 0
	for range n - 5 {
		r := <-results
		if r.status != http.StatusServiceUnavailable || codeStr(decodeError(t, r.body).Code) != openai.CodeNoEndpoint {
			t.Fatalf("over max_held: %d %s", r.status, r.body)
		}
		rejected++
	}
	if held := p.gate.heldNow.Load(); held != 5 {
		t.Errorf("held %d, want exactly max_held 5", held)
	}
	e.ready.Store(true)
	wg.Wait()
	close(results)
	for r := range results {
		if r.status != http.StatusOK {
			t.Errorf("held request: %d", r.status)
		}
	}
	if v := scrape(t, c, url).value("infergate_held_rejected_total", `model="m"`); v != float64(rejected) {
		t.Errorf("held_rejected_total = %v, want %d", v, rejected)
	}

	// Bytes: room for two bodies.
	e2 := newColdEngine(t)
	cfg := coldConfig(e2, ScaleFromZeroConfig{HoldTTL: time.Minute, MaxHeldBytes: int64(2*len(chatBody) + len(chatBody)/2)})
	cfg.CircuitBreaker.MaxRequests = 1 // one at a time: the engine sees them in dispatch order
	g2, url2 := startGateway(t, cfg)
	p2 := g2.state.Load().pools["m"]
	low := sendAsync(ctx, c, url2+pathChat, chatBody, "X-Request-Id", "low", PriorityHeader, "0")
	waitFor(t, "one held", func() bool { return p2.gate.heldNow.Load() == 1 })
	high := sendAsync(ctx, c, url2+pathChat, chatBody, "X-Request-Id", "high", PriorityHeader, "7")
	waitFor(t, "two held", func() bool { return p2.gate.heldNow.Load() == 2 })
	if r := await(t, sendAsync(ctx, c, url2+pathChat, chatBody)); r.status != http.StatusServiceUnavailable {
		t.Errorf("over max_held_bytes: %d", r.status)
	}
	e2.ready.Store(true)
	for _, ch := range []<-chan result{low, high} {
		if r := await(t, ch); r.status != http.StatusOK {
			t.Errorf("held: %d", r.status)
		}
	}
	if a, b := <-e2.served, <-e2.served; a != "high" || b != "low" {
		t.Errorf("dispatch order %s, %s; want high, low (X-Priority)", a, b)
	}
}

// TestScaleFromZeroClientLeaves: a held client that disconnects leaves the
// hold at once (499), and the episode ends with it.
func TestScaleFromZeroClientLeaves(t *testing.T) {
	e := newColdEngine(t)
	wk := &countingWaker{}
	g, url := startGateway(t, coldConfig(e, ScaleFromZeroConfig{HoldTTL: time.Hour, Wake: WakeConfig{Waker: wk}}))
	c := testClient(t)
	p := g.state.Load().pools["m"]
	ctx, cancel := context.WithCancel(context.Background())
	gone := sendAsync(ctx, c, url+pathChat, chatBody)
	waitFor(t, "held", func() bool { return p.gate.heldNow.Load() == 1 })
	cancel()
	waitFor(t, "the client left the hold", func() bool { return p.gate.heldNow.Load() == 0 && p.gate.waiting.Load() == 0 })
	if r := await(t, gone); r.err == nil {
		t.Errorf("canceled request answered %d", r.status)
	}
	waitFor(t, "a 499 recorded", func() bool { return scrape(t, c, url).value("infergate_requests_total", `code="499"`) == 1 })
	// Nothing held and the first call over: the next request starts a new
	// episode, with its own call.
	waitFor(t, "the first wake-up call ended", func() bool {
		p.gate.mu.Lock()
		defer p.gate.mu.Unlock()
		return wk.calls.Load() == 1 && !p.gate.waking
	})
	ctx2, cancel2 := contextWithCancel(t)
	defer cancel2()
	next := sendAsync(ctx2, c, url+pathChat, chatBody)
	waitFor(t, "a second wake-up", func() bool { return wk.calls.Load() == 2 })
	e.ready.Store(true)
	if r := await(t, next); r.status != http.StatusOK {
		t.Errorf("after the episode: %d", r.status)
	}
}

// TestScaleFromZeroWakeKinds: kind engine POSTs /wake_up to the pool's
// engines (here that makes the engine ready, so the request is served
// with nothing else done); kind webhook POSTs the pool, model and held
// count.
func TestScaleFromZeroWakeKinds(t *testing.T) {
	e := newColdEngine(t)
	e.wakeReadies = true
	_, url := startGateway(t, coldConfig(e, ScaleFromZeroConfig{HoldTTL: time.Minute, Wake: WakeConfig{Kind: WakeEngine}}))
	c := testClient(t)
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	if r := await(t, sendAsync(ctx, c, url+pathChat, chatBody)); r.status != http.StatusOK {
		t.Fatalf("woken by /wake_up: %d %s", r.status, r.body)
	}
	if n := e.wakes.Load(); n != 1 {
		t.Errorf("/wake_up calls %d, want 1", n)
	}

	e2 := newColdEngine(t)
	got := make(chan map[string]any, 4)
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var v map[string]any
		_ = json.NewDecoder(r.Body).Decode(&v)
		got <- v
		e2.ready.Store(true)
	}))
	defer hook.Close()
	_, url2 := startGateway(t, coldConfig(e2, ScaleFromZeroConfig{HoldTTL: time.Minute, Wake: WakeConfig{Kind: WakeWebhook, URL: hook.URL}}))
	if r := await(t, sendAsync(ctx, c, url2+pathChat, chatBody)); r.status != http.StatusOK {
		t.Fatalf("woken by the webhook: %d %s", r.status, r.body)
	}
	select {
	case v := <-got:
		if v["pool"] != "m" || v["model"] != "m" || v["held"] != float64(1) {
			t.Errorf("webhook body %v", v)
		}
	default:
		t.Fatal("the webhook was not called")
	}
	if len(got) != 0 {
		t.Error("the webhook was called more than once")
	}
}

// TestScaleFromZeroConfig checks validation and defaults.
func TestScaleFromZeroConfig(t *testing.T) {
	base := Config{Endpoints: []EndpointConfig{{URL: "http://10.0.0.1:8000", Model: "m"}}}.WithDefaults()
	c := scaleFromZeroFor(map[string]ScaleFromZeroConfig{"*": {HoldTTL: time.Minute}, "x": {HoldTTL: time.Second, MaxHeld: 3}}, "m")
	if c.HoldTTL != time.Minute || c.MaxHeld != DefaultMaxHeld || c.MaxHeldBytes != DefaultMaxHeldBytes || c.ProbeInterval != DefaultHoldProbe || c.Wake.Timeout != DefaultWakeTimeout {
		t.Errorf("defaults %+v", c)
	}
	if c := scaleFromZeroFor(map[string]ScaleFromZeroConfig{"*": {HoldTTL: time.Minute}, "x": {HoldTTL: time.Second, MaxHeld: 3}}, "x"); c.MaxHeld != 3 || c.HoldTTL != time.Second {
		t.Errorf("the model's own entry: %+v", c)
	}
	if c := scaleFromZeroFor(nil, "m"); c.HoldTTL != 0 {
		t.Errorf("unset: %+v", c)
	}
	for name, s := range map[string]ScaleFromZeroConfig{
		"ttl":       {HoldTTL: -time.Second},
		"max held":  {HoldTTL: time.Second, MaxHeld: -1},
		"bytes":     {HoldTTL: time.Second, MaxHeldBytes: -1},
		"probe":     {HoldTTL: time.Second, ProbeInterval: time.Microsecond},
		"heartbeat": {HoldTTL: time.Second, Heartbeat: time.Millisecond},
		"kind":      {HoldTTL: time.Second, Wake: WakeConfig{Kind: "pager"}},
		"url":       {HoldTTL: time.Second, Wake: WakeConfig{Kind: WakeWebhook, URL: "ftp://x"}},
		"url kind":  {HoldTTL: time.Second, Wake: WakeConfig{Kind: WakeEngine, URL: "http://x"}},
		"func":      {HoldTTL: time.Second, Wake: WakeConfig{Kind: WakeFunc}},
	} {
		cfg := base
		cfg.ScaleFromZero = map[string]ScaleFromZeroConfig{"m": s}
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "scale_from_zero") {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// readUntil reads r until its output contains want (or fails the test).
func readUntil(t *testing.T, r io.Reader, got *strings.Builder, want string) {
	t.Helper()
	buf := make([]byte, 512)
	for !strings.Contains(got.String(), want) {
		n, err := r.Read(buf)
		got.Write(buf[:n])
		if err != nil {
			if !strings.Contains(got.String(), want) {
				t.Fatalf("no %q in the answer: %v\n%s", want, err, got.String())
			}
			return
		}
	}
}

// TestScaleFromZeroHeartbeats: a held streaming request gets ": keep-alive"
// comments (status 200, an event stream from the first one), then the
// engine's events once it is ready; one whose hold expires ends with an
// SSE error event and [DONE], counted 503. Non-streaming requests get none.
func TestScaleFromZeroHeartbeats(t *testing.T) {
	e := newColdEngine(t)
	g, url := startGateway(t, coldConfig(e, ScaleFromZeroConfig{HoldTTL: time.Minute, Heartbeat: 100 * time.Millisecond}))
	c := testClient(t)
	p := g.state.Load().pools["m"]
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+pathChat, strings.NewReader(streamBody(true)))
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("held stream: %d %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	var got strings.Builder
	readUntil(t, resp.Body, &got, ": keep-alive\n\n")
	if p.gate.heldNow.Load() != 1 {
		t.Fatal("the stream is not held")
	}
	e.ready.Store(true)
	readUntil(t, resp.Body, &got, "data: [DONE]")
	if s := got.String(); !strings.Contains(s, `"content":"hi"`) || strings.Contains(s, `"error"`) {
		t.Errorf("stream after the heartbeats:\n%s", s)
	}

	// A non-streaming request held alongside gets no heartbeat. The TTL is
	// 20 heartbeats long, so a heartbeat precedes the expiry even on a
	// loaded host.
	e2 := newColdEngine(t)
	_, url2 := startGateway(t, coldConfig(e2, ScaleFromZeroConfig{HoldTTL: 2 * time.Second, Heartbeat: 100 * time.Millisecond}))
	plain := sendAsync(ctx, c, url2+pathChat, chatBody)
	r := await(t, sendAsync(ctx, c, url2+pathChat, streamBody(true)))
	if r.status != http.StatusOK || !strings.HasPrefix(string(r.body), ": keep-alive\n\n") {
		t.Fatalf("expired held stream: %d\n%s", r.status, r.body)
	}
	body := string(r.body)
	if !strings.Contains(body, `"code":"no_endpoint_available"`) || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Errorf("expired held stream does not end with an error event and [DONE]:\n%s", body)
	}
	if pr := await(t, plain); pr.status != http.StatusServiceUnavailable || strings.Contains(string(pr.body), "keep-alive") {
		t.Errorf("non-streaming held request: %d %s", pr.status, pr.body)
	}
	if v := scrape(t, c, url2).value("infergate_requests_total", `code="503"`); v != 2 {
		t.Errorf("requests_total{503} = %v, want 2 (the stream's status line said 200)", v)
	}
}

// BenchmarkHeldDispatch measures the dispatch latency of a held request:
// from its endpoint turning ready (the engine's /health answering 200) to
// the engine receiving the request, with readiness learnt from the hold's
// probes (probe) or from an event (Gateway.Probe, as the embedded elastic
// fleet sends). Reported as dispatch-ms (mean) and max-dispatch-ms; the
// time of one iteration also includes the hold's set-up.
//
//	go test -run '^$' -bench HeldDispatch -benchtime 50x ./gateway
func BenchmarkHeldDispatch(b *testing.B) {
	for _, event := range []bool{false, true} {
		name := "probe"
		if event {
			name = "event"
		}
		b.Run(name, func(b *testing.B) {
			e := newColdEngine(b)
			g, url := startGateway(b, coldConfig(e, ScaleFromZeroConfig{HoldTTL: time.Minute}))
			c := testClient(b)
			p := g.state.Load().pools["m"]
			ep := p.endpoints[0]
			ctx, cancel := contextWithCancel(b)
			defer cancel()
			var sum, worst time.Duration
			b.ResetTimer()
			for range b.N {
				e.ready.Store(false)
				ep.setReady(false)
				ch := sendAsync(ctx, c, url+pathChat, chatBody)
				for p.gate.heldNow.Load() != 1 {
					time.Sleep(50 * time.Microsecond)
				}
				t0 := time.Now()
				e.ready.Store(true)
				if event {
					g.Probe(e.srv.URL)
				}
				select {
				case <-e.served:
				case <-time.After(10 * time.Second):
					b.Fatal("the held request was not dispatched")
				}
				d := time.Since(t0)
				sum += d
				worst = max(worst, d)
				if r := <-ch; r.status != http.StatusOK {
					b.Fatalf("held request: %d", r.status)
				}
			}
			b.ReportMetric(float64(sum.Microseconds())/1e3/float64(b.N), "dispatch-ms")
			b.ReportMetric(float64(worst.Microseconds())/1e3, "max-dispatch-ms")
		})
	}
}

// TestScaleFromZeroWakesSleepingEngine: a simulated engine put to sleep
// (vLLM sleep mode: /health still 200) leaves rotation once its metrics
// say so; a request is then held, the wake-up hook (kind engine) POSTs
// its /wake_up, and the request is served once /is_sleeping says it woke.
func TestScaleFromZeroWakesSleepingEngine(t *testing.T) {
	s, err := simserver.NewServer(simserver.ServerConfig{TimeScale: 1000, EnableSleepMode: true, Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	defer s.Close()
	es := httptest.NewServer(s.Handler())
	defer es.Close()
	cfg := Config{HealthCheckInterval: 100 * time.Millisecond, HealthCheckTimeout: 2 * time.Second, ScrapeInterval: 500 * time.Millisecond,
		Endpoints:     []EndpointConfig{{URL: es.URL, Model: "m", Kind: "sim"}},
		ScaleFromZero: map[string]ScaleFromZeroConfig{"m": {HoldTTL: time.Minute, Wake: WakeConfig{Kind: WakeEngine}}}}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	ep := g.state.Load().pools["m"].endpoints[0]
	waitFor(t, "the engine in rotation", ep.ready.Load)
	if !s.Sleep(sim.SleepWeight) {
		t.Fatal("Sleep")
	}
	waitFor(t, "the sleeping engine out of rotation", func() bool { return !ep.ready.Load() })
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	r := await(t, sendAsync(ctx, c, url+pathChat, `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`))
	if r.status != http.StatusOK {
		t.Fatalf("request to a sleeping pool: %d %s", r.status, r.body)
	}
	if st := s.State(); st != simserver.StateReady {
		t.Errorf("engine state %q after the wake-up", st)
	}
	m := scrape(t, c, url)
	if m.value("infergate_wakeups_total", `result="ok"`) != 1 || m.value("infergate_held_requests_total", `model="m"`) != 1 {
		t.Errorf("wakeups %v, held %v; want 1 and 1", m.value("infergate_wakeups_total", `result="ok"`), m.value("infergate_held_requests_total", `model="m"`))
	}
}

// FuzzCommittedStreamError: whatever error answer an engine or the gateway
// writes after a heartbeat committed a held stream (any status, any body,
// over the 1 MiB bound or not, CRs included), the client gets exactly one
// SSE data event holding a JSON object with an "error" member, then [DONE],
// as a client's parser reads them (internal/ssetest).
func FuzzCommittedStreamError(f *testing.F) {
	f.Add(503, []byte(`{"error":{"message":"x","type":"t","param":null,"code":"no_endpoint_available"}}`))
	f.Add(400, []byte(`{"object":"error","message":"bad","type":"BadRequestError","code":400}`))
	f.Add(502, []byte("<html>bad gateway</html>"))
	f.Add(500, []byte(""))
	f.Add(404, []byte(`{"error":`))
	f.Add(503, []byte("{\"error\":\n\n{\"message\":\"a\\nb\"}}\n"))
	f.Add(503, []byte("{\"error\":\r\r{\"message\":\"a\\rb\"}\r}\r\rdata: [DONE]\r\r"))
	f.Add(500, []byte("bad\rdata: [DONE]\r\r"))
	f.Fuzz(func(t *testing.T, status int, body []byte) {
		if status < 300 || status > 599 {
			return
		}
		rec := httptest.NewRecorder()
		cs := &committedStream{ResponseWriter: rec}
		cs.WriteHeader(status)
		_, _ = cs.Write(body)
		cs.end()
		out := rec.Body.String()
		data, rest, ok := strings.Cut(out, "\n\n")
		if !ok || !strings.HasPrefix(data, "data: ") || rest != "data: [DONE]\n\n" {
			t.Fatalf("not one event then [DONE]: %q", out)
		}
		var v map[string]json.RawMessage
		if err := json.Unmarshal([]byte(strings.TrimPrefix(data, "data: ")), &v); err != nil || v["error"] == nil {
			t.Fatalf("event is not a JSON object with an error: %q (%v)", data, err)
		}
		// A client's parser (lone CRs end lines) reads the same.
		if ce := clientEvents([]byte(out)); len(ce) != 2 || ce[0] != strings.TrimPrefix(data, "data: ") || ce[1] != "[DONE]" {
			t.Fatalf("a client reads %q in %q", ce, out)
		}
	})
}

// stallingWaker never answers: each call waits for its context.
type stallingWaker struct{ calls, inFlight atomic.Int64 }

func (w *stallingWaker) Wake(ctx context.Context, _ string) error {
	w.calls.Add(1)
	w.inFlight.Add(1)
	defer w.inFlight.Add(-1)
	<-ctx.Done()
	return ctx.Err()
}

// TestScaleFromZeroWakeStormBounded: a client that sends a request to a
// pool at zero and leaves, again and again, ends a cold episode each time;
// while the wake-up hook stalls (up to wake.timeout), a new episode must
// not start another call — one call at a time per pool, or the loop piles
// up goroutines and connections to the hook (one per request).
func TestScaleFromZeroWakeStormBounded(t *testing.T) {
	e := newColdEngine(t)
	wk := &stallingWaker{}
	g, url := startGateway(t, coldConfig(e, ScaleFromZeroConfig{HoldTTL: time.Hour, Wake: WakeConfig{Waker: wk, Timeout: time.Hour}}))
	c := testClient(t)
	p := g.state.Load().pools["m"]
	const n = 20
	for i := range n {
		ctx, cancel := context.WithCancel(context.Background())
		gone := sendAsync(ctx, c, url+pathChat, chatBody)
		waitFor(t, fmt.Sprintf("held %d", i), func() bool { return p.gate.heldNow.Load() == 1 })
		cancel()
		<-gone
		waitFor(t, "left", func() bool { return p.gate.heldNow.Load() == 0 })
	}
	waitFor(t, "the first call", func() bool { return wk.calls.Load() >= 1 })
	if got := wk.calls.Load(); got != 1 {
		t.Errorf("%d wake-up calls for %d episodes while the first stalled (%d in flight), want 1", got, n, wk.inFlight.Load())
	}
}

// TestScaleFromZeroModelRemoved: a reload that removes a model answers its
// held requests at once (503 no_endpoint_available): nothing probes or
// wakes its endpoints any more. Before, they waited out hold_ttl (3 s
// measured with hold_ttl 3s; here an hour) and were then told no endpoint
// became ready.
func TestScaleFromZeroModelRemoved(t *testing.T) {
	e, other := newColdEngine(t), newColdEngine(t)
	other.ready.Store(true)
	cfg := coldConfig(e, ScaleFromZeroConfig{HoldTTL: time.Hour})
	cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: other.srv.URL, Model: "other", KVBlocks: 1000})
	g, url := startGateway(t, cfg)
	c := testClient(t)
	p := g.state.Load().pools["m"]
	ctx, cancel := contextWithCancel(t)
	defer cancel()
	held := sendAsync(ctx, c, url+pathChat, chatBody)
	waitFor(t, "held", func() bool { return p.gate.heldNow.Load() == 1 })
	cfg.Endpoints = cfg.Endpoints[1:]
	if err := g.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	r := await(t, held)
	if r.status != http.StatusServiceUnavailable || !strings.Contains(string(r.body), `"no_endpoint_available"`) {
		t.Errorf("held request of a removed model: %d %s", r.status, r.body)
	}
	if n := p.gate.heldNow.Load(); n != 0 {
		t.Errorf("%d still held", n)
	}
}

// TestScaleFromZeroWakeNoRedirect: the engine wake-up call sends the
// endpoint's credentials (here api_key in x-api-key); an engine whose
// /wake_up redirects must not get them sent where it points. Before, the
// client followed the 307 and the other server got the key.
func TestScaleFromZeroWakeNoRedirect(t *testing.T) {
	var leaked atomic.Value
	elsewhere := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		leaked.Store(r.Header.Get("X-Api-Key"))
	}))
	defer elsewhere.Close()
	redirected := make(chan struct{}, 1)
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			w.WriteHeader(http.StatusServiceUnavailable)
		case "/wake_up":
			http.Redirect(w, r, elsewhere.URL+"/steal", http.StatusTemporaryRedirect)
			select {
			case redirected <- struct{}{}:
			default:
			}
		default:
			http.NotFound(w, r)
		}
	}))
	defer eng.Close()
	cfg := resilienceConfig(sched.RoundRobin, eng.URL)
	cfg.HealthCheckPath = "/health"
	cfg.Endpoints[0].APIKey = "sekret"
	cfg.Endpoints[0].APIKeyHeader = "x-api-key"
	cfg.ScaleFromZero = map[string]ScaleFromZeroConfig{"*": {HoldTTL: time.Hour, Wake: WakeConfig{Kind: WakeEngine}}}
	_, url := startGateway(t, cfg)
	c := testClient(t)
	ctx, cancel := contextWithCancel(t)
	held := sendAsync(ctx, c, url+pathChat, chatBody)
	<-redirected
	var m scraped
	waitFor(t, "the wake-up call counted", func() bool {
		m = scrape(t, c, url)
		return m.value("infergate_wakeups_total", `result="error"`)+m.value("infergate_wakeups_total", `result="ok"`) == 1
	})
	cancel()
	<-held
	if v, ok := leaked.Load().(string); ok {
		t.Errorf("the redirect was followed: the other server got x-api-key %q", v)
	}
	if m.value("infergate_wakeups_total", `result="error"`) != 1 {
		t.Error("a redirect answering the wake-up call: want the call counted as an error")
	}
}
