package simserver

import (
	"net/http"
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
// flight is answered 503 at once, not gathered, and the held ones complete
// (as the gateway's /metrics).
func TestMetricsScrapesBounded(t *testing.T) {
	s, ts := newTestServer(t, ServerConfig{})
	bc := &blockingCollector{
		desc:    prometheus.NewDesc("test_blocking", "held scrapes", nil, nil),
		entered: make(chan struct{}, maxMetricsScrapes),
		release: make(chan struct{}),
	}
	s.metrics.reg.MustRegister(bc)
	var wg sync.WaitGroup
	defer wg.Wait() // after release, below
	released := false
	release := func() {
		if !released {
			released = true
			close(bc.release)
		}
	}
	defer release()
	c := &http.Client{Timeout: time.Minute}
	codes := make(chan int, maxMetricsScrapes)
	for range maxMetricsScrapes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := c.Get(ts.URL + "/metrics")
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
			release()
			t.Fatalf("%d of %d scrapes reached the collector", i, maxMetricsScrapes)
		}
	}
	r, err := c.Get(ts.URL + "/metrics")
	if err != nil {
		release()
		t.Fatal(err)
	}
	r.Body.Close()
	if r.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("scrape %d while %d are in flight: %d, want 503", maxMetricsScrapes+1, maxMetricsScrapes, r.StatusCode)
	}
	release()
	wg.Wait()
	close(codes)
	for c := range codes {
		if c != http.StatusOK {
			t.Errorf("a held scrape ended %d", c)
		}
	}
}
