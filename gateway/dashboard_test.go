package gateway

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"math"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/simserver"
)

// TestHistQuantile checks the bucket estimate against histogram_quantile's
// rule, worked by hand.
func TestHistQuantile(t *testing.T) {
	// 10 observations: 4 ≤ 1, 4 in (1, 2], 1 in (2, 4], 1 above 4.
	h := hist{bounds: []float64{1, 2, 4}, counts: []uint64{4, 8, 9}, count: 10, sum: 20}
	for _, tc := range []struct{ q, want float64 }{
		{0.2, 0.5},    // rank 2 of the first bucket's 4: half of [0, 1]
		{0.5, 1.25},   // rank 5: the first of (1, 2]'s 4
		{0.8, 2},      // rank 8: the top of (1, 2]
		{0.85, 3},     // rank 8.5: half of (2, 4]
		{0.99, 4},     // rank 9.9: the +Inf bucket gives the largest finite bound
		{0.4, 1},      // rank 4 exactly: the top of the first bucket
		{0.0001, 0.0}, // rank ~0
	} {
		if got := h.quantile(tc.q); math.Abs(got-tc.want) > 1e-3 {
			t.Errorf("quantile(%v) = %v, want %v", tc.q, got, tc.want)
		}
	}
	if !math.IsNaN((hist{}).quantile(0.5)) {
		t.Error("empty histogram: want NaN")
	}
	d := h.minus(hist{bounds: h.bounds, counts: []uint64{4, 4, 4}, count: 4, sum: 2})
	if d.count != 6 || d.counts[0] != 0 || d.counts[1] != 4 || d.counts[2] != 5 || d.sum != 18 {
		t.Errorf("minus: %+v", d)
	}
	if got := d.quantile(0.5); math.Abs(got-1.75) > 1e-9 { // rank 3 of (1, 2]'s 4
		t.Errorf("delta quantile(0.5) = %v, want 1.75", got)
	}
	if q := quantiles(hist{}); q != nil {
		t.Errorf("quantiles of nothing: %+v, want nil", q)
	}
}

// TestWindowAdvance drives the snapshot window through time: the base is
// the newest snapshot at least a window old (else the oldest), snapshots
// are kept at most one per step, and old ones are dropped.
func TestWindowAdvance(t *testing.T) {
	t0 := time.Unix(1000, 0)
	var w window
	w.start(t0)
	c := func(n float64) *counters {
		x := newCounters()
		x.route(routeKey{"m", "e"}).requests = n
		return x
	}
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	steps := []struct {
		now      float64 // seconds after t0
		baseAt   float64
		keptSnap int // snapshots kept after the call
	}{
		{1, 0, 1},    // within a step of the start: not kept
		{5, 0, 2},    // a step later: kept
		{7, 0, 2},    // within a step of the last kept
		{30, 0, 3},   //
		{59, 0, 4},   //
		{65, 5, 4},   // t0 is 65 s old, 5 is 60 s old: the base; t0 dropped
		{200, 65, 2}, // everything older than the newest 60-s-old one (65) dropped
	}
	for _, s := range steps {
		b := w.advance(at(s.now), c(s.now))
		if !b.at.Equal(at(s.baseAt)) {
			t.Fatalf("at %vs: base at %v, want %vs", s.now, b.at.Sub(t0), s.baseAt)
		}
		if len(w.snaps) != s.keptSnap {
			t.Fatalf("at %vs: %d snapshots kept, want %d", s.now, len(w.snaps), s.keptSnap)
		}
	}
	// Polled every step for a long time: memory stays bounded.
	for i := range 1000 {
		w.advance(at(300+float64(i)*5), c(1))
	}
	if len(w.snaps) > dashboardMaxSnapshots || len(w.snaps) < int(dashboardWindow/dashboardStep) {
		t.Errorf("%d snapshots kept", len(w.snaps))
	}
}

// TestDashboardState sends requests through the gateway to fake engines and
// checks the state's figures: totals, cache hit rate, TTFT, per endpoint,
// the recent window, an ejection and JSON shape.
func TestDashboardState(t *testing.T) {
	e0, e1 := newFakeEngine(t, "e0"), newFakeEngine(t, "e1")
	cfg := resilienceConfig(sched.RoundRobin, e0.URL(), e1.URL())
	g, url := startGateway(t, cfg)
	c := testClient(t)
	for i := range 4 {
		body := chatBody
		if i >= 2 {
			body = streamBody(false)
		}
		if resp, b := post(t, c, url+pathChat, body); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
	}
	if resp, _ := post(t, c, url+pathChat, `{"model":"nope","messages":[{"role":"user","content":"x"}]}`); resp.StatusCode != 404 {
		t.Fatalf("unknown model: %d", resp.StatusCode)
	}
	start := g.dash.started
	st := g.DashboardState(start.Add(10 * time.Second))

	f := st.Fleet
	if f.Endpoints != 2 || f.Ready != 2 || f.Ejected != 0 || f.InFlight != 0 || f.QueueLength != 0 {
		t.Errorf("fleet: %+v", f)
	}
	// The unknown model's 404 counts in the fleet, not in a pool.
	if f.Total.Requests != 5 || f.Total.Errors != 0 || f.Total.ClientErrors != 1 || f.Total.PromptTokens != 160 || f.Total.CachedTokens != 128 {
		t.Errorf("fleet total: %+v", f.Total)
	}
	if r := f.Total.CacheHitRate; r == nil || *r != 0.8 { // the fake engine: 32 of 40 cached
		t.Errorf("fleet hit rate %v, want 0.8", r)
	}
	if q := f.Total.TTFT; q == nil || q.Count != 2 || !(q.P50 > 0 && q.P50 <= q.P90 && q.P90 <= q.P99) {
		t.Errorf("fleet TTFT (2 streams): %+v", q)
	}
	if q := f.Total.ITL; q == nil || q.Count != 4 { // 3 output events per stream: 2 gaps
		t.Errorf("fleet ITL: %+v", q)
	}
	if q := f.Total.E2E; q == nil || q.Count != 4 {
		t.Errorf("fleet e2e: %+v", q)
	}
	if st.WindowSeconds != 10 || f.Recent.Requests != 5 || math.Abs(f.Recent.RequestsPerSecond-0.5) > 1e-9 {
		t.Errorf("recent at the start covers since start: window %v, %+v", st.WindowSeconds, f.Recent)
	}
	if st.Policy != sched.RoundRobin || st.Draining {
		t.Errorf("policy %q draining %v", st.Policy, st.Draining)
	}
	if len(st.Pools) != 1 {
		t.Fatalf("pools: %+v", st.Pools)
	}
	p := st.Pools[0]
	if p.Model != "m" || p.Total.Requests != 4 || p.Total.Errors != 0 || p.MaxQueue != DefaultAdmissionMaxQueue ||
		p.MaxInFlight != 2*DefaultCircuitBreakerMaxRequests || p.QueueWait != nil || len(p.Endpoints) != 2 {
		t.Errorf("pool: %+v", p)
	}
	for i, e := range p.Endpoints {
		want := []string{e0.URL(), e1.URL()}[i]
		if e.Endpoint != want || e.State != "ready" || e.Kind != "vllm" || e.Total.Requests != 2 ||
			e.Total.CacheHitRate == nil || *e.Total.CacheHitRate != 0.8 || e.Total.TTFT == nil || e.Total.TTFT.Count != 1 ||
			e.Engine != nil || e.KVBlocks != 1000 || e.EjectedUntil != nil {
			t.Errorf("endpoint %d: %+v", i, e)
		}
	}

	// Two more requests after a snapshot: a minute later, recent counts
	// only them.
	for range 2 {
		if resp, b := post(t, c, url+pathChat, chatBody); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	st = g.DashboardState(start.Add(75 * time.Second))
	if st.WindowSeconds != 65 || st.Fleet.Recent.Requests != 2 || st.Fleet.Total.Requests != 7 ||
		st.Fleet.Recent.TTFT != nil || st.Pools[0].Recent.Requests != 2 {
		t.Errorf("window %v: recent %+v total %+v", st.WindowSeconds, st.Fleet.Recent, st.Fleet.Total)
	}

	// Shape: the JSON keys the page reads, nulls where nothing happened.
	body, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"time", "started", "policy", "draining", "window_seconds", "fleet", "pools"} {
		if _, ok := m[k]; !ok {
			t.Errorf("state has no %q: %s", k, body)
		}
	}
	ep := m["pools"].([]any)[0].(map[string]any)["endpoints"].([]any)[0].(map[string]any)
	for _, k := range []string{"endpoint", "kind", "state", "in_flight", "in_flight_tokens", "prefill_backlog_tokens",
		"prefill_tokens_per_second", "engine", "ejections", "total", "recent"} {
		if _, ok := ep[k]; !ok {
			t.Errorf("endpoint has no %q: %v", k, ep)
		}
	}
	if rec := ep["recent"].(map[string]any); rec["ttft_seconds"] != nil || rec["cache_hit_rate"] == nil {
		t.Errorf("endpoint recent: %v (no stream in the window: ttft null; hit rate set)", rec)
	}
}

// TestDashboardEjection: a refused endpoint shows as ejected, with its
// ejection and the retry it caused.
func TestDashboardEjection(t *testing.T) {
	good := newFakeEngine(t, "good")
	dead := closedURL(t)
	g, url := startGateway(t, resilienceConfig(sched.RoundRobin, dead, good.URL()))
	c := testClient(t)
	for range 2 {
		if resp, b := post(t, c, url+pathChat, chatBody); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	st := g.DashboardState(time.Now())
	d := st.Pools[0].Endpoints[0]
	if d.Endpoint != dead || d.State != "ejected" || d.EjectedUntil == nil || d.Ejections != 1 || d.Total.Retries != 1 {
		t.Errorf("dead endpoint: %+v", d)
	}
	if st.Fleet.Ready != 1 || st.Fleet.Ejected != 1 || st.Fleet.Ejections != 1 || st.Fleet.Total.Retries != 1 {
		t.Errorf("fleet: %+v", st.Fleet)
	}
	if st.Pools[0].Endpoints[1].State != "ready" || st.Pools[0].Endpoints[1].Total.Requests != 2 {
		t.Errorf("good endpoint: %+v", st.Pools[0].Endpoints[1])
	}
}

// TestDashboardEngineState: behind simulated engines, the state carries
// their scraped queue and KV utilisation.
func TestDashboardEngineState(t *testing.T) {
	f, err := simserver.StartFleet(2, simserver.ServerConfig{Model: "m", TimeScale: 100})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// A scrape's timeout is its interval: 20 ms timed every scrape out
	// on a loaded machine under -race (the stress run of issue 13), and
	// the state never showed an engine.
	cfg := Config{HealthCheckInterval: time.Second, ScrapeInterval: 250 * time.Millisecond}
	for _, u := range f.URLs {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: u, Model: "m", Kind: fleet.Sim})
	}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	if resp, b := post(t, c, url+pathChat, `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hello there"}]}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	// One snapshot is judged whole: a scrape may land between two calls,
	// and one taken while the request was still queued in the engine says
	// waiting 1 until the next.
	var st DashboardState
	waitFor(t, "both engines scraped idle", func() bool {
		st = g.DashboardState(time.Now())
		for _, e := range st.Pools[0].Endpoints {
			if e.Engine == nil || e.Engine.KVUtilization == nil || e.Engine.Waiting != 0 {
				return false
			}
		}
		return true
	})
	for _, e := range st.Pools[0].Endpoints {
		if e.Kind != "sim" || e.KVBlocks <= 0 || e.Engine.Running < 0 ||
			*e.Engine.KVUtilization < 0 || *e.Engine.KVUtilization > 1 || e.Engine.ScrapedAt.IsZero() {
			t.Errorf("endpoint %+v engine %+v", e, e.Engine)
		}
	}
}

// TestDashboardRoutes checks the page and its state over HTTP: methods,
// content types, the Content-Security-Policy matching the inline script and
// style, no data in the page itself, and /metrics' access rule for the state.
func TestDashboardRoutes(t *testing.T) {
	e := newFakeEngine(t, "e0")
	_, url := startGateway(t, testConfig(sched.RoundRobin, e))
	c := testClient(t)

	resp, page := send(t, c, http.MethodGet, url+pathDashboard, "")
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
		t.Fatalf("GET /dashboard: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if bytes.Contains(page, []byte(e.URL())) || bytes.Contains(page, []byte("/*SCRIPT*/")) {
		t.Error("the page itself carries data (or its script was not inlined)")
	}
	// Nothing from another origin (the SVG namespace is a name, not a fetch).
	if rest := bytes.ReplaceAll(page, []byte("http://www.w3.org/2000/svg"), nil); bytes.Contains(rest, []byte("http://")) || bytes.Contains(rest, []byte("https://")) || bytes.Contains(rest, []byte("//cdn")) {
		t.Error("the page refers to another origin")
	}
	csp := resp.Header.Get("Content-Security-Policy")
	for _, tag := range []string{"script", "style"} {
		m := regexp.MustCompile(`(?s)<` + tag + `>(.*?)</` + tag + `>`).FindSubmatch(page)
		if m == nil {
			t.Fatalf("no inline <%s>", tag)
		}
		h := sha256.Sum256(m[1])
		want := tag + "-src 'sha256-" + base64.StdEncoding.EncodeToString(h[:]) + "'"
		if !strings.Contains(csp, want) {
			t.Errorf("CSP %q lacks %q", csp, want)
		}
	}
	if !strings.Contains(csp, "default-src 'none'") || !strings.Contains(csp, "connect-src 'self'") {
		t.Errorf("CSP %q", csp)
	}
	if resp, _ := send(t, c, http.MethodHead, url+pathDashboard, ""); resp.StatusCode != 200 {
		t.Errorf("HEAD /dashboard: %d", resp.StatusCode)
	}
	// /dashboard/ (a trailing slash typed or pasted) redirects to the page.
	noFollow := &http.Client{Transport: c.Transport, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	if resp, _ := send(t, noFollow, http.MethodGet, url+pathDashboard+"/", ""); resp.StatusCode != http.StatusMovedPermanently || resp.Header.Get("Location") != "../dashboard" {
		t.Errorf("GET /dashboard/: %d Location %q, want 301 to ../dashboard", resp.StatusCode, resp.Header.Get("Location"))
	}
	if resp, _ := send(t, c, http.MethodGet, url+pathDashboard+"/", ""); resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
		t.Errorf("GET /dashboard/ followed: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if resp, _ := send(t, c, http.MethodPost, url+pathDashboardState, "{}"); resp.StatusCode != 405 || resp.Header.Get("Allow") != "GET, HEAD" {
		t.Errorf("POST state: %d %q", resp.StatusCode, resp.Header.Get("Allow"))
	}
	resp, b := send(t, c, http.MethodGet, url+pathDashboardState, "")
	var st DashboardState
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" || resp.Header.Get("Cache-Control") != "no-store" ||
		json.Unmarshal(b, &st) != nil || len(st.Pools) != 1 || st.Pools[0].Endpoints[0].Endpoint != e.URL() {
		t.Errorf("GET state: %d %v %s", resp.StatusCode, resp.Header, b)
	}

	// Keys without protect_metrics: the state is as open as /metrics.
	cfg := testConfig(sched.RoundRobin, e)
	cfg.Auth.Keys = []auth.Key{{Name: "ops", Hash: auth.HashKey(keyAlice)}}
	_, url = startGateway(t, cfg)
	if resp, _ := send(t, c, http.MethodGet, url+pathDashboardState, ""); resp.StatusCode != 200 {
		t.Errorf("keys, no protect_metrics: state %d, want 200 (as /metrics)", resp.StatusCode)
	}
	// With protect_metrics the state needs a key; the page (no data) does not.
	cfg.Auth.ProtectMetrics = true
	_, url = startGateway(t, cfg)
	if resp, _ := send(t, c, http.MethodGet, url+pathDashboardState, ""); resp.StatusCode != 401 {
		t.Errorf("protect_metrics: state without a key %d, want 401", resp.StatusCode)
	}
	if resp, _ := send(t, c, http.MethodGet, url+pathDashboardState, "", "Authorization", "Bearer "+keyAlice); resp.StatusCode != 200 {
		t.Errorf("protect_metrics: state with a key %d, want 200", resp.StatusCode)
	}
	if resp, _ := send(t, c, http.MethodGet, url+pathDashboard, ""); resp.StatusCode != 200 {
		t.Errorf("protect_metrics: page %d, want 200", resp.StatusCode)
	}
}

// TestDashboardNoGoroutineLeak: reading the state (its collectors run on a
// goroutine each) leaves nothing behind.
func TestDashboardNoGoroutineLeak(t *testing.T) {
	e := newFakeEngine(t, "e0")
	g, _ := startGateway(t, testConfig(sched.RoundRobin, e))
	before := settledGoroutines()
	for range 20 {
		g.DashboardState(time.Now())
	}
	requireGoroutinesBack(t, before)
}

// BenchmarkDashboardState is the cost of one poll of the state (off the
// request path): collecting the counters and histograms of a 4-endpoint
// pool that has served requests.
func BenchmarkDashboardState(b *testing.B) {
	var engines []*fakeEngine
	for i := range 4 {
		engines = append(engines, newFakeEngine(b, "e"+strconv.Itoa(i)))
	}
	g, url := startGateway(b, testConfig(sched.RoundRobin, engines...))
	c := testClient(b)
	for range 8 {
		post(b, c, url+pathChat, streamBody(false))
	}
	now := time.Now()
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		g.DashboardState(now.Add(time.Duration(i) * time.Second))
	}
}
