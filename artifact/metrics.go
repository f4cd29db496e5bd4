package artifact

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the cache's Prometheus collectors (README.md, "Metrics").
type metrics struct {
	lookups    *prometheus.CounterVec // result: hit, miss, shared
	fetched    *prometheus.CounterVec // source: http, peer, path
	fetches    *prometheus.CounterVec // source, outcome: ok, error
	retries    *prometheus.CounterVec // source
	fetchTime  *prometheus.HistogramVec
	evictions  prometheus.Counter
	evicted    prometheus.Counter
	integrity  *prometheus.CounterVec // stage: fetch, read, scrub
	prefetches *prometheus.CounterVec // outcome: ok, error
}

// fetchBuckets are blob fetch durations (seconds): 10 ms to ~1.5 h.
var fetchBuckets = prometheus.ExponentialBuckets(0.01, 4, 10)

func newMetrics(reg prometheus.Registerer, c *Cache) (*metrics, error) {
	ns, sub := "infergate", "artifact"
	m := &metrics{
		lookups: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "lookups_total",
			Help: "Blob lookups by acquires and prefetches: hit (in the cache), miss (fetched), shared (joined a fetch in flight)."}, []string{"result"}),
		fetched: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "fetched_bytes_total",
			Help: "Bytes received from sources, by source kind (http, peer, path), including bytes of attempts that failed."}, []string{"source"}),
		fetches: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "fetches_total",
			Help: "Blob fetches finished, by the last source tried and outcome (ok, error)."}, []string{"source", "outcome"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "fetch_retries_total",
			Help: "Blob fetch attempts after the first, by source kind."}, []string{"source"}),
		fetchTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub, Name: "fetch_duration_seconds",
			Help: "Time to fetch and verify one blob, by the source that completed it.", Buckets: fetchBuckets}, []string{"source"}),
		evictions: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "evictions_total",
			Help: "Blobs evicted to stay within the byte budget."}),
		evicted: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "evicted_bytes_total",
			Help: "Bytes of the blobs evicted."}),
		integrity: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "integrity_failures_total",
			Help: "Blobs whose digest or size was wrong, by stage (fetch: bytes from a source; read: a verified open; scrub); the bytes are deleted, never served."}, []string{"stage"}),
		prefetches: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: "acquires_total",
			Help: "Model acquires and prefetches finished, by outcome (ok, error)."}, []string{"outcome"}),
	}
	gauge := func(name, help string, f func(IndexStats) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: name, Help: help},
			func() float64 { return f(c.Stats()) })
	}
	cs := []prometheus.Collector{m.lookups, m.fetched, m.fetches, m.retries, m.fetchTime, m.evictions, m.evicted, m.integrity, m.prefetches,
		gauge("used_bytes", "Bytes of blobs held and being fetched.", func(s IndexStats) float64 { return float64(s.Used) }),
		gauge("pinned_bytes", "Bytes of blobs pinned by engines or fetches in progress (never evicted).", func(s IndexStats) float64 { return float64(s.Pinned) }),
		gauge("budget_bytes", "The byte budget (0: unbounded).", func(s IndexStats) float64 { return float64(max(s.Budget, 0)) }),
		gauge("blobs", "Blobs held.", func(s IndexStats) float64 { return float64(s.Blobs) }),
	}
	for _, col := range cs {
		if err := reg.Register(col); err != nil {
			return nil, err
		}
	}
	for _, r := range []string{"hit", "miss", "shared"} {
		m.lookups.WithLabelValues(r)
	}
	for _, s := range []string{"fetch", "read", "scrub"} {
		m.integrity.WithLabelValues(s)
	}
	return m, nil
}
