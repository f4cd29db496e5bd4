package gateway

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/sched"
)

// unboundedBodies is a body budget no test body reaches.
func unboundedBodies() *byteBudget {
	return &byteBudget{limit: 1 << 62, overflows: prometheus.NewCounter(prometheus.CounterOpts{Name: "unused"})}
}

// sendPartialBody opens a connection to the gateway at addr and sends a
// chat request's header block declaring declared body bytes, then sent of
// them (a prefix of a valid body, padded with spaces), and stops.
func sendPartialBody(t *testing.T, addr string, declared, sent int) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	head := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", pathChat, declared)
	body := head + strings.Repeat(" ", max(0, sent-len(head)))
	if _, err := conn.Write([]byte(body[:sent])); err != nil {
		t.Fatal(err)
	}
	return conn
}

// TestBodyBudget: the request bodies being read share
// max_body_bytes_in_flight, charged as their bytes arrive. Clients that
// send part of a body and stall hold what they sent, up to the budget;
// the next one's read past it is refused at once with 503 overloaded and
// Retry-After, counted; when clients vanish mid-body the budget returns to
// 0. Before, there was no such budget: N stalled clients held N × what
// they sent until body_read_timeout (here an hour).
func TestBodyBudget(t *testing.T) {
	const (
		limit = 1 << 20
		part  = 200 << 10 // sent by each stalled client: 5 fit the limit, not 6
	)
	e := newFakeEngine(t, "e0")
	cfg := testConfig(sched.RoundRobin, e)
	cfg.HealthCheckPath = healthCheckOff
	cfg.MaxBodyBytes = limit / 2
	cfg.MaxBodyBytesInFlight = limit
	cfg.BodyReadTimeout = time.Hour
	g, url := startGateway(t, cfg)
	addr := strings.TrimPrefix(url, "http://")

	var stalled []net.Conn
	for i := 1; i <= 5; i++ {
		stalled = append(stalled, sendPartialBody(t, addr, limit/2, part))
		waitFor(t, fmt.Sprintf("%d bodies charged", i), func() bool { return g.bodies.held.Load() == int64(i*part) })
	}
	over := sendPartialBody(t, addr, limit/2, part)
	defer over.Close()
	resp, err := http.ReadResponse(bufio.NewReader(over), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "1" || !resp.Close {
		t.Errorf("over the budget: %d, Retry-After %q, close %v", resp.StatusCode, resp.Header.Get("Retry-After"), resp.Close)
	}
	waitFor(t, "the refused body given back", func() bool { return g.bodies.held.Load() == 5*part })
	c := testClient(t)
	m := scrape(t, c, url)
	if v := m.value("infergate_request_body_budget_refusals_total", ""); v != 1 {
		t.Errorf("refusals_total %v, want 1", v)
	}
	if v := m.value("infergate_request_body_bytes_in_flight", ""); v != 5*part {
		t.Errorf("request_body_bytes_in_flight %v, want %d", v, 5*part)
	}
	// A whole request still fits next to the stalled ones.
	if r, b := post(t, c, url+pathChat, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`); r.StatusCode != http.StatusOK {
		t.Errorf("a small request beside the stalled ones: %d %s", r.StatusCode, b)
	}
	for _, conn := range stalled {
		conn.Close()
	}
	waitFor(t, "the budget back to 0 after the clients left", func() bool { return g.bodies.held.Load() == 0 })

	// Many clients at once, each vanishing after a random part of its
	// body (some refused): every byte charged is given back.
	var wg sync.WaitGroup
	for i := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 7))
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				t.Error(err)
				return
			}
			defer conn.Close()
			fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", pathChat, limit/2)
			_, _ = conn.Write([]byte(strings.Repeat(" ", 1+rng.IntN(limit/2-1))))
		}()
	}
	wg.Wait()
	waitFor(t, "the budget back to 0 after 32 clients vanished mid-body", func() bool { return g.bodies.held.Load() == 0 })
}

// TestBodyBudgetConfig: max_body_bytes is bounded (MaxMaxBodyBytes) and
// max_body_bytes_in_flight must hold one largest body. Before, any
// positive max_body_bytes was accepted.
func TestBodyBudgetConfig(t *testing.T) {
	for _, tc := range []struct {
		body, inFlight int64
		ok             bool
	}{
		{0, 0, true}, // the defaults
		{MaxMaxBodyBytes, 0, true},
		{MaxMaxBodyBytes + 1, 0, false},
		{16_000_000_000, 32_000_000_000, false},
		{1 << 20, 1 << 20, true},
		{1 << 20, 1<<20 - 1, false},
	} {
		cfg := testConfig(sched.RoundRobin)
		cfg.Endpoints = []EndpointConfig{{URL: "http://10.0.0.1:8000", Model: "m", KVBlocks: 1000}}
		cfg.MaxBodyBytes, cfg.MaxBodyBytesInFlight = tc.body, tc.inFlight
		cfg = cfg.WithDefaults()
		if err := cfg.Validate(); (err == nil) != tc.ok {
			t.Errorf("max_body_bytes %d, max_body_bytes_in_flight %d: %v, want ok %v", tc.body, tc.inFlight, err, tc.ok)
		}
	}
	if c := (Config{}).WithDefaults(); c.MaxBodyBytesInFlight != DefaultMaxBodyBytesInFlight || c.MaxBodyBytesInFlight < MaxMaxBodyBytes {
		t.Errorf("default max_body_bytes_in_flight %d", c.MaxBodyBytesInFlight)
	}
	// max_body_bytes_held must hold one largest body too.
	for held, ok := range map[int64]bool{0: true, 1 << 20: true, 1<<20 - 1: false} {
		cfg := testConfig(sched.RoundRobin)
		cfg.Endpoints = []EndpointConfig{{URL: "http://10.0.0.1:8000", Model: "m", KVBlocks: 1000}}
		cfg.MaxBodyBytes, cfg.MaxBodyBytesHeld = 1<<20, held
		cfg = cfg.WithDefaults()
		if err := cfg.Validate(); (err == nil) != ok {
			t.Errorf("max_body_bytes_held %d: %v, want ok %v", held, err, ok)
		}
	}
	if c := (Config{}).WithDefaults(); c.MaxBodyBytesHeld != DefaultMaxBodyBytesHeld || c.MaxBodyBytesHeld < MaxMaxBodyBytes {
		t.Errorf("default max_body_bytes_held %d", c.MaxBodyBytesHeld)
	}
}

// TestBodyHeldBudget: the bodies of requests in progress (read whole, not
// yet answered) share max_body_bytes_held. Requests parked at a stalled
// engine hold their bodies; the next body past the budget is refused once
// read, with 503 overloaded and Retry-After, counted; the bodies are given
// back when the requests end, and a body fits again. Before, admission
// counted requests only: 16 bodies of 15 MB parked at a stalled engine
// held 2.5 GB.
func TestBodyHeldBudget(t *testing.T) {
	const (
		size  = 60 << 10 // each request's body
		limit = 200 << 10
	)
	e := &heldEngine{maxModelLen: 4096, arrived: make(chan struct{}, 8), release: make(chan struct{})}
	eng := httptest.NewServer(e)
	defer eng.Close()
	cfg := testConfig(sched.RoundRobin)
	cfg.HealthCheckPath = healthCheckOff
	cfg.Endpoints = []EndpointConfig{{URL: eng.URL, Model: "m", KVBlocks: 1000, MaxModelLen: 4096}}
	cfg.MaxBodyBytes = 64 << 10
	cfg.MaxBodyBytesHeld = limit
	g, url := startGateway(t, cfg)
	c := testClient(t)
	body := func() string {
		head := `{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10],"stream":true,"user":"`
		return head + strings.Repeat("u", size-len(head)-2) + `"}`
	}()
	if len(body) != size {
		t.Fatalf("body of %d bytes", len(body))
	}
	var wg sync.WaitGroup
	for range 3 { // 180 KiB held: fits 200
		wg.Go(func() {
			if r, b := post(t, c, url+pathCompletions, body); r.StatusCode != http.StatusOK {
				t.Errorf("a parked request: %d %s", r.StatusCode, b)
			}
		})
	}
	for i := range 3 {
		select {
		case <-e.arrived:
		case <-time.After(30 * time.Second): // a request refused never arrives
			t.Fatalf("%d of 3 requests reached the engine", i)
		}
	}
	if v := g.held.held.Load(); v != 3*size {
		t.Fatalf("held %d bytes with three requests parked, want %d", v, 3*size)
	}
	r, b := post(t, c, url+pathCompletions, body)
	if r.StatusCode != http.StatusServiceUnavailable || r.Header.Get("Retry-After") != "1" || !strings.Contains(string(b), codeBodyBudget) {
		t.Errorf("over the held budget: %d, Retry-After %q, %s", r.StatusCode, r.Header.Get("Retry-After"), b)
	}
	m := scrape(t, c, url)
	if v := m.value("infergate_request_body_held_refusals_total", ""); v != 1 {
		t.Errorf("held refusals_total %v, want 1", v)
	}
	if v := m.value("infergate_request_body_bytes_held", ""); v != 3*size {
		t.Errorf("request_body_bytes_held %v, want %d", v, 3*size)
	}
	close(e.release)
	wg.Wait()
	waitFor(t, "the held bodies given back", func() bool { return g.held.held.Load() == 0 })
	go func() { <-e.arrived }()
	if r, b := post(t, c, url+pathCompletions, body); r.StatusCode != http.StatusOK {
		t.Errorf("after the parked requests ended: %d %s", r.StatusCode, b)
	}
	waitFor(t, "the budget back to 0", func() bool { return g.held.held.Load() == 0 })
}
