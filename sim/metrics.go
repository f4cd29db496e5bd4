package sim

import (
	"strconv"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Histogram buckets of vLLM v1 (vllm/v1/metrics/loggers.py), in seconds.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
		1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	itlBuckets = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
		1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}
	e2eBuckets = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
		40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
)

// metrics is the vLLM-named Prometheus surface of a Server (PROTOCOLS.md §2.1),
// on a private registry. Gauges and counters read the engine snapshot the
// driver publishes after each step, so a scrape never waits for the engine.
// Histograms are observed by the driver in simulated seconds.
type metrics struct {
	reg     *prometheus.Registry
	ttft    prometheus.Histogram
	itl     prometheus.Histogram
	e2e     prometheus.Histogram
	success *prometheus.CounterVec
}

func newMetrics(model string, cfg Config, snap *atomic.Pointer[Stats]) *metrics {
	reg := prometheus.NewRegistry()
	labels := prometheus.Labels{"model_name": model, "engine": "0"}
	stat := func() *Stats { return snap.Load() }
	gauge := func(name, help string, f func(*Stats) float64) {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return f(stat()) }))
	}
	counter := func(name, help string, f func(*Stats) float64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return f(stat()) }))
	}
	gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
		func(s *Stats) float64 { return float64(s.Running) })
	gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
		func(s *Stats) float64 { return float64(s.Waiting) })
	gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
		func(s *Stats) float64 { return s.KVUsage })
	counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
		func(s *Stats) float64 { return float64(s.PrefixQueries) })
	counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
		func(s *Stats) float64 { return float64(s.PrefixHits) })
	counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
		func(s *Stats) float64 { return float64(s.PromptTokens) })
	counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
		func(s *Stats) float64 { return float64(s.GenerationTokens) })
	counter("vllm:num_preemptions_total", "Cumulative number of preemptions from the engine.",
		func(s *Stats) float64 { return float64(s.Preemptions) })

	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "vllm:cache_config_info",
		Help: "Information of the LLMEngine CacheConfig",
		ConstLabels: prometheus.Labels{
			"engine":                 "0",
			"block_size":             strconv.Itoa(cfg.BlockSize),
			"num_gpu_blocks":         strconv.Itoa(cfg.NumBlocks),
			"enable_prefix_caching":  "True",
			"gpu_memory_utilization": strconv.FormatFloat(cfg.Profile.GPUMemoryUtilization, 'g', -1, 64),
			"cache_dtype":            "auto",
		},
	})
	info.Set(1)
	reg.MustRegister(info)

	m := &metrics{
		reg: reg,
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "vllm:time_to_first_token_seconds",
			Help: "Histogram of time to first token in seconds (simulated time).", ConstLabels: labels, Buckets: ttftBuckets}),
		itl: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "vllm:inter_token_latency_seconds",
			Help: "Histogram of inter-token latency in seconds (simulated time).", ConstLabels: labels, Buckets: itlBuckets}),
		e2e: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "vllm:e2e_request_latency_seconds",
			Help: "Histogram of e2e request latency in seconds (simulated time).", ConstLabels: labels, Buckets: e2eBuckets}),
		success: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "vllm:request_success_total",
			Help: "Count of successfully processed requests.", ConstLabels: labels}, []string{"finished_reason"}),
	}
	reg.MustRegister(m.ttft, m.itl, m.e2e, m.success)
	m.success.WithLabelValues("length") // expose the series before the first request
	return m
}
