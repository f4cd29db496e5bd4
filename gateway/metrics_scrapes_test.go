package gateway

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// blockingCollector holds every Collect until release is closed, counting
// the Collects entered.
type blockingCollector struct {
	desc    *prometheus.Desc
	entered chan struct{}
	release chan struct{}
}

func (b *blockingCollector) Describe(ch chan<- *prometheus.Desc) { ch <- b.desc }

func (b *blockingCollector) Collect(ch chan<- prometheus.Metric) {
	b.entered <- struct{}{}
	<-b.release
	ch <- prometheus.MustNewConstMetric(b.desc, prometheus.GaugeValue, 1)
}

// TestMetricsScrapesBounded: GET /metrics beyond maxMetricsScrapes in
// flight is answered 503 at once, not gathered (the attack: 3,000
// concurrent scrapes took infergate up from 136 MB to 567 MB RSS), and the
// held ones complete.
func TestMetricsScrapesBounded(t *testing.T) {
	e := newFakeEngine(t, "a")
	reg := prometheus.NewRegistry()
	bc := &blockingCollector{
		desc:    prometheus.NewDesc("test_blocking", "held scrapes", nil, nil),
		entered: make(chan struct{}, maxMetricsScrapes),
		release: make(chan struct{}),
	}
	reg.MustRegister(bc)
	g, err := New(context.Background(), testConfig("round-robin", e), reg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(g.Handler())
	defer func() {
		srv.Close()
		g.Close()
	}()
	c := testClient(t)
	var wg sync.WaitGroup
	codes := make(chan int, maxMetricsScrapes)
	for range maxMetricsScrapes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := c.Get(srv.URL + "/metrics")
			if err != nil {
				codes <- -1
				return
			}
			r.Body.Close()
			codes <- r.StatusCode
		}()
	}
	timeout := time.After(time.Minute)
	for i := range maxMetricsScrapes {
		select {
		case <-bc.entered:
		case <-timeout:
			close(bc.release)
			t.Fatalf("%d of %d scrapes reached the collector", i, maxMetricsScrapes)
		}
	}
	r, err := c.Get(srv.URL + "/metrics")
	if err != nil {
		close(bc.release)
		t.Fatal(err)
	}
	r.Body.Close()
	close(bc.release)
	wg.Wait()
	if r.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("scrape %d with %d in flight: %d, want 503", maxMetricsScrapes+1, maxMetricsScrapes, r.StatusCode)
	}
	for range maxMetricsScrapes {
		if code := <-codes; code != http.StatusOK {
			t.Errorf("a held scrape: %d, want 200", code)
		}
	}
}
