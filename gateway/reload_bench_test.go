package gateway

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// BenchmarkReloadAdd1000 is a reload that adds 1,000 engines (each at its
// own loopback address, 127.0.x.y, one listener behind them all) whose KV
// capacity and context length are discovered, each read answered after
// 1 ms (an engine's own time: vLLM renders its /metrics page per read):
// ns/op is the reload's time (its build probes them: GET /health,
// /metrics and /v1/models each), max-reads the most reads in flight at
// once.
func BenchmarkReloadAdd1000(b *testing.B) {
	const n = 1000
	var mu sync.Mutex
	inFlight, most := 0, 0
	l, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		b.Skip("no listener on all addresses:", err)
	}
	srv := &httptest.Server{Listener: l, Config: &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		inFlight++
		most = max(most, inFlight)
		mu.Unlock()
		time.Sleep(time.Millisecond)
		switch {
		case strings.HasSuffix(r.URL.Path, "/metrics"):
			_, _ = io.WriteString(w, "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000\"} 1\n")
		case strings.HasSuffix(r.URL.Path, "/v1/models"):
			_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","max_model_len":4096}]}`)
		}
		mu.Lock()
		inFlight--
		mu.Unlock()
	})}}
	srv.Start()
	defer srv.Close()
	port := l.Addr().(*net.TCPAddr).Port
	base := newFakeEngine(b, "a")
	cfg := func(n int) Config {
		c := testConfig("round-robin", base)
		c.HealthCheckInterval, c.ScrapeInterval, c.ModelsRefreshInterval = time.Hour, -1, -1
		for i := range n {
			c.Endpoints = append(c.Endpoints, EndpointConfig{URL: fmt.Sprintf("http://127.0.%d.%d:%d", 1+i/250, 1+i%250, port), Model: "m"})
		}
		return c
	}
	g, err := New(context.Background(), cfg(0), nil)
	if err != nil {
		b.Fatal(err)
	}
	defer g.Close()
	b.ResetTimer()
	for b.Loop() {
		if err := g.Reload(cfg(n)); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if err := g.Reload(cfg(0)); err != nil {
			b.Fatal(err)
		}
		g.transport.CloseIdleConnections()
		b.StartTimer()
	}
	mu.Lock()
	b.ReportMetric(float64(most), "max-reads")
	mu.Unlock()
}

// BenchmarkReloadBlackholed is a reload that adds one engine that never
// answers (its requests wait for the client to give up), with
// health_check_timeout 200 ms and its KV capacity and context length to
// discover: ns/op is how long it holds the reload.
func BenchmarkReloadBlackholed(b *testing.B) {
	hole := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	defer hole.Close()
	base := newFakeEngine(b, "a")
	cfg := func(with bool) Config {
		c := testConfig("round-robin", base)
		c.HealthCheckInterval, c.HealthCheckTimeout, c.ScrapeInterval, c.ModelsRefreshInterval = time.Hour, 200*time.Millisecond, -1, -1
		if with {
			c.Endpoints = append(c.Endpoints, EndpointConfig{URL: hole.URL, Model: "m"})
		}
		return c
	}
	g, err := New(context.Background(), cfg(false), nil)
	if err != nil {
		b.Fatal(err)
	}
	defer g.Close()
	b.ResetTimer()
	for b.Loop() {
		if err := g.Reload(cfg(true)); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if err := g.Reload(cfg(false)); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}
