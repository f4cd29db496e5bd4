package gateway

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// gatedEngines serves many engines behind one listener, each under its own
// path prefix (/e0, /e1, …): /health 200, /metrics a cache config of 1000
// blocks of 16, /v1/models a max_model_len of 4096. Every request waits
// until open is closed; the engines in dead never answer (a black hole:
// the request waits for the client to give up). It counts the live
// engines' requests in flight, the most at once, and closes full when in
// flight first reaches fullAt, served when doneAt were answered.
type gatedEngines struct {
	srv            *httptest.Server
	open           chan struct{}
	full, served   chan struct{}
	fullAt, doneAt int
	dead           map[string]bool

	mu                   sync.Mutex
	inFlight, most, done int // requests of live engines
	deadAsked            int // requests to dead engines
}

func newGatedEngines(t *testing.T, fullAt, doneAt int, dead ...string) *gatedEngines {
	t.Helper()
	e := &gatedEngines{open: make(chan struct{}), full: make(chan struct{}), served: make(chan struct{}),
		fullAt: fullAt, doneAt: doneAt, dead: map[string]bool{}}
	for _, d := range dead {
		e.dead[d] = true
	}
	e.srv = httptest.NewServer(http.HandlerFunc(e.serve))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *gatedEngines) serve(w http.ResponseWriter, r *http.Request) {
	prefix, rest, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
	if e.dead[prefix] {
		e.mu.Lock()
		e.deadAsked++
		e.mu.Unlock()
		<-r.Context().Done()
		return
	}
	e.mu.Lock()
	e.inFlight++
	e.most = max(e.most, e.inFlight)
	if e.inFlight == e.fullAt {
		select {
		case <-e.full:
		default:
			close(e.full)
		}
	}
	e.mu.Unlock()
	select {
	case <-e.open:
	case <-r.Context().Done():
	}
	switch rest {
	case "metrics":
		_, _ = io.WriteString(w, "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000\"} 1\n")
	case "v1/models":
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","max_model_len":4096}]}`)
	}
	e.mu.Lock()
	e.inFlight--
	e.done++
	if e.done == e.doneAt {
		close(e.served)
	}
	e.mu.Unlock()
}

// discoveryConfig is a gateway of base (a ready engine) and the engines
// /e0 … /e<n-1> of ge, with their KV capacity and context length to
// discover, each read bounded by timeout; no periodic probe, scrape or
// model-list read within a test.
func discoveryConfig(base string, ge *gatedEngines, n int, timeout time.Duration) Config {
	cfg := testConfig("round-robin")
	cfg.HealthCheckInterval, cfg.HealthCheckTimeout = time.Hour, timeout
	cfg.ScrapeInterval, cfg.ModelsRefreshInterval = -1, -1
	cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: base, Model: "m", KVBlocks: 1000})
	for i := range n {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: fmt.Sprintf("%s/e%d", ge.srv.URL, i), Model: "m"})
	}
	return cfg
}

// TestReloadDiscoveryBounded: a reload that adds 150 engines probes
// maxDiscoveryProbes of them at once, one read in flight each (health,
// then KV capacity, then the model list, on one connection): 64 requests
// in flight at most, and reached, where it started 150 goroutines and
// requests at once. Every engine is discovered and ready after it.
func TestReloadDiscoveryBounded(t *testing.T) {
	const n = 150
	base := newFakeEngine(t, "a")
	ge := newGatedEngines(t, maxDiscoveryProbes, 3*n)
	g, err := New(context.Background(), discoveryConfig(base.URL(), ge, 0, time.Minute), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	reloaded := make(chan error, 1)
	go func() { reloaded <- g.Reload(discoveryConfig(base.URL(), ge, n, time.Minute)) }()
	select {
	case <-ge.full:
	case err := <-reloaded:
		t.Fatalf("the reload ended (%v) before %d reads were in flight at once", err, maxDiscoveryProbes)
	case <-time.After(time.Minute): // a guard against a hang, not a timing
		ge.mu.Lock()
		defer ge.mu.Unlock()
		t.Fatalf("%d reads in flight at most, never %d", ge.most, maxDiscoveryProbes)
	}
	close(ge.open)
	if err := <-reloaded; err != nil {
		t.Fatal(err)
	}
	ge.mu.Lock()
	most, done := ge.most, ge.done
	ge.mu.Unlock()
	if most > maxDiscoveryProbes {
		t.Fatalf("%d reads in flight at once, want at most %d", most, maxDiscoveryProbes)
	}
	if done != 3*n {
		t.Fatalf("%d reads served, want %d (health, KV capacity, model list of each)", done, 3*n)
	}
	for i := range n {
		ep := endpointOf(g, fmt.Sprintf("%s/e%d", ge.srv.URL, i))
		if s := ep.spec.Load(); !ep.ready.Load() || s.kvBlocks != 1000 || s.maxModelLen != 4096 {
			t.Fatalf("%s: ready %v, kv_blocks %d, max_model_len %d; want ready, 1000, 4096", ep.name, ep.ready.Load(), s.kvBlocks, s.maxModelLen)
		}
	}
}

// TestReloadBlackholedEngine: an engine that never answers, first of 100
// added, costs the reload one health_check_timeout: its health probe is
// its only read (the discovery reads after an unanswered one are not
// sent), and the others are all discovered while it hangs. It is added out
// of rotation with the default capacity and context length.
func TestReloadBlackholedEngine(t *testing.T) {
	const n = 100
	base := newFakeEngine(t, "a")
	ge := newGatedEngines(t, 0, 3*(n-1), "e0")
	close(ge.open) // the live engines answer at once
	// Long enough that no live engine's read times out on a busy machine
	// (which would skip its other reads); the black-holed one costs it once.
	const timeout = 5 * time.Second
	g, err := New(context.Background(), discoveryConfig(base.URL(), ge, 0, timeout), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := g.Reload(discoveryConfig(base.URL(), ge, n, timeout)); err != nil {
		t.Fatal(err)
	}
	ge.mu.Lock()
	asked, done := ge.deadAsked, ge.done
	ge.mu.Unlock()
	if asked != 1 {
		t.Fatalf("the black-holed engine was sent %d reads, want 1 (one timeout, not one per read)", asked)
	}
	if done != 3*(n-1) {
		t.Fatalf("%d live reads served, want %d", done, 3*(n-1))
	}
	ep := endpointOf(g, ge.srv.URL+"/e0")
	if s := ep.spec.Load(); ep.ready.Load() || s.kvBlocks != DefaultKVBlocks || s.maxModelLen != DefaultMaxModelLen {
		t.Fatalf("black-holed engine: ready %v, kv_blocks %d, max_model_len %d; want out of rotation with the defaults", ep.ready.Load(), s.kvBlocks, s.maxModelLen)
	}
	if ep := endpointOf(g, ge.srv.URL+"/e1"); !ep.ready.Load() || ep.spec.Load().kvBlocks != 1000 {
		t.Fatalf("live engine: ready %v, kv_blocks %d", ep.ready.Load(), ep.spec.Load().kvBlocks)
	}
}
