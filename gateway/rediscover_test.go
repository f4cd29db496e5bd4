package gateway

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// loadingEngine does not answer (each request waits for its client to give
// up) until up, as an engine still loading its model behind a listening
// port; then it answers /health, its KV capacity (unless noMetrics: 404)
// and its context length.
type loadingEngine struct {
	srv                 *httptest.Server
	up                  atomic.Bool
	noMetrics           bool
	health, metrics, ms atomic.Int64 // answered requests by path
}

func newLoadingEngine(t *testing.T, up, noMetrics bool) *loadingEngine {
	t.Helper()
	e := &loadingEngine{noMetrics: noMetrics}
	e.up.Store(up)
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !e.up.Load() {
			<-r.Context().Done()
			return
		}
		switch r.URL.Path {
		case "/health":
			e.health.Add(1)
		case "/metrics":
			e.metrics.Add(1)
			if e.noMetrics {
				http.NotFound(w, r)
				return
			}
			_, _ = io.WriteString(w, "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1234\"} 1\n")
		case "/v1/models":
			e.ms.Add(1)
			_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","max_model_len":4096}]}`)
		}
	}))
	t.Cleanup(e.srv.Close)
	return e
}

// rediscoverConfig: one endpoint at url, probed every 50 ms within timeout
// (the time a black-holed engine holds New: short where the test has one,
// long where an answer slowed by a busy machine must not count as none).
func rediscoverConfig(url string, timeout time.Duration) Config {
	cfg := testConfig("cache-aware")
	cfg.HealthCheckInterval, cfg.HealthCheckTimeout = 50*time.Millisecond, timeout
	cfg.ScrapeInterval, cfg.ModelsRefreshInterval = -1, -1
	cfg.Endpoints = []EndpointConfig{{URL: url, Model: "m"}}
	return cfg
}

// TestRediscoveredWhenAnswering: an engine that did not answer when the
// gateway started (still loading its model) kept the default KV capacity
// and context length for good; its first passed health check now has them
// read, and routing's pool gets its capacity.
func TestRediscoveredWhenAnswering(t *testing.T) {
	e := newLoadingEngine(t, false, false)
	g, err := New(context.Background(), rediscoverConfig(e.srv.URL, time.Second), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ep := endpointOf(g, e.srv.URL)
	if s := ep.spec.Load(); ep.ready.Load() || s.kvBlocks != DefaultKVBlocks || s.maxModelLen != DefaultMaxModelLen || !s.kvUnread || !s.lenUnread {
		t.Fatalf("engine not answering: ready %v, kv_blocks %d, max_model_len %d, unread %v/%v; want the defaults, unread",
			ep.ready.Load(), s.kvBlocks, s.maxModelLen, s.kvUnread, s.lenUnread)
	}
	e.up.Store(true)
	waitFor(t, "the engine's KV capacity and context length read after it answered", func() bool {
		s := endpointOf(g, e.srv.URL).spec.Load()
		return s.kvBlocks == 1234 && s.blockSize == 16 && s.maxModelLen == 4096 && !s.kvUnread && !s.lenUnread
	})
	st := g.state.Load()
	p := st.pools["m"]
	if p == nil || len(p.capacity) != 1 || p.capacity[0] != 1234*16/p.blockSize {
		t.Fatalf("pool capacity %v (block size %d), want the engine's 1,234 blocks of 16 tokens", p.capacity, p.blockSize)
	}
	// Once known they are not read again (a read a busy machine timed out
	// before they were known may have been counted: the count is taken
	// here, not assumed to be 1).
	m0, l0, h0 := e.metrics.Load(), e.ms.Load(), e.health.Load()
	waitFor(t, "three more health checks", func() bool { return e.health.Load() >= h0+3 })
	if m, l := e.metrics.Load(), e.ms.Load(); m != m0 || l != l0 {
		t.Fatalf("KV capacity read %d times, model list %d after they were known (%d, %d before); want no more", m, l, m0, l0)
	}
}

// TestNoRediscoveryOfAnsweredDefaults: an engine that answers but has no
// KV capacity page keeps the default, and its health checks ask no rebuild
// (which would read it again every probe).
func TestNoRediscoveryOfAnsweredDefaults(t *testing.T) {
	e := newLoadingEngine(t, true, true)
	g, err := New(context.Background(), rediscoverConfig(e.srv.URL, time.Minute), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if s := endpointOf(g, e.srv.URL).spec.Load(); s.kvBlocks != DefaultKVBlocks || s.kvUnread || s.lenUnread || s.maxModelLen != 4096 {
		t.Fatalf("kv_blocks %d, max_model_len %d, unread %v/%v; want the default KV capacity, read (404), and the context length",
			s.kvBlocks, s.maxModelLen, s.kvUnread, s.lenUnread)
	}
	waitFor(t, "five health checks", func() bool { return e.health.Load() >= 5 })
	if m := e.metrics.Load(); m != 1 {
		t.Fatalf("KV capacity page read %d times, want once (a 404 is an answer)", m)
	}
}
