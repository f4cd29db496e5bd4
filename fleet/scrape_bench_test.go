package fleet

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fleetServer serves the vLLM page of testdata to n engines, each at its
// own loopback address (127.0.x.y, one listener on all of them), so that
// each has its own connections as distinct engines do.
func fleetServer(b *testing.B, n int) (*httptest.Server, []Target) {
	b.Helper()
	page := readPage(b, "vllm.txt")
	l, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		b.Skip("no listener on all addresses:", err)
	}
	srv := &httptest.Server{Listener: l, Config: &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write(page)
	})}}
	srv.Start()
	b.Cleanup(srv.Close)
	port := l.Addr().(*net.TCPAddr).Port
	eps := make([]Target, n)
	for i := range eps {
		eps[i] = Target{URL: fmt.Sprintf("http://127.0.%d.%d:%d", 1+i/250, 1+i%250, port), Kind: VLLM}
	}
	return srv, eps
}

// cpuTime is the process's user and system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkScrapeRound1000 is one round of a Scraper of 1,000 engines at
// the default concurrency (16), keep-alive connections warm: ns/op is how
// long the round takes; cpu-ms/round the CPU it costs, the engines' side
// (serving the page, in this process) included.
func BenchmarkScrapeRound1000(b *testing.B) {
	_, eps := fleetServer(b, 1000)
	s, err := NewScraper(eps, ScrapeConfig{Interval: time.Hour, Timeout: 10 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	defer s.cfg.Client.CloseIdleConnections()
	s.ScrapeOnce(context.Background()) // dial every engine once
	for i := range eps {
		if err := s.Err(i); err != nil {
			b.Fatal(err)
		}
	}
	cpu := cpuTime()
	b.ResetTimer()
	for b.Loop() {
		s.ScrapeOnce(context.Background())
	}
	b.ReportMetric(float64(cpuTime()-cpu)/float64(time.Millisecond)/float64(b.N), "cpu-ms/round")
}

// BenchmarkScrapeBurst1000 is the gateway's way before phases: 1,000
// one-engine Scrapers (one per endpoint, gateway/feeds.go) scraping in
// the same instant, warm: ns/op is how long the burst takes to end.
func BenchmarkScrapeBurst1000(b *testing.B) {
	_, eps := fleetServer(b, 1000)
	scrapers := make([]*Scraper, len(eps))
	for i := range eps {
		s, err := NewScraper(eps[i:i+1], ScrapeConfig{Interval: time.Hour, Timeout: 10 * time.Second})
		if err != nil {
			b.Fatal(err)
		}
		defer s.cfg.Client.CloseIdleConnections()
		scrapers[i] = s
	}
	burst := func() {
		var wg sync.WaitGroup
		for _, s := range scrapers {
			wg.Go(func() { s.ScrapeOnce(context.Background()) })
		}
		wg.Wait()
	}
	burst()
	cpu := cpuTime()
	b.ResetTimer()
	for b.Loop() {
		burst()
	}
	b.ReportMetric(float64(cpuTime()-cpu)/float64(time.Millisecond)/float64(b.N), "cpu-ms/round")
}
