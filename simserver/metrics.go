package simserver

import (
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/infergate/infergate/sim"
	"github.com/prometheus/client_golang/prometheus"
)

// Histogram buckets of vLLM v1 (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
var (
	// ttftBuckets: vllm:time_to_first_token_seconds, in seconds.
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
		1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	// itlBuckets: vllm:inter_token_latency_seconds and
	// vllm:request_time_per_output_token_seconds, in seconds.
	itlBuckets = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
		1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}
	// e2eBuckets: request_latency_buckets, shared by vllm:e2e_request_latency_seconds
	// and the request_{queue,prefill,decode,inference}_time_seconds phases, in seconds.
	e2eBuckets = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
		40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
	// iterationTokenBuckets: vllm:iteration_tokens_total, in tokens per step.
	iterationTokenBuckets = []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}
	// stepLagBuckets: infergate_sim_step_lag_seconds (engine seconds): from
	// a tenth of a fast decode step to a lost minute.
	stepLagBuckets = []float64{0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60}
	// paramsNBuckets: vllm:request_params_n.
	paramsNBuckets = []float64{1, 2, 5, 10, 20}
	// pdTransferBuckets: infergate_sim_pd_kv_transfer_seconds (engine
	// seconds), from a small prompt over RDMA to a long wait for blocks.
	pdTransferBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}
)

// pdRecomputeReasons are the label values of
// infergate_sim_pd_recompute_total: why a decode leg computed its prompt
// instead of reading it from its prefill.
var pdRecomputeReasons = [...]string{
	"invalid_params",     // the P/D fields do not name a prefill in full (vLLM warns)
	"no_interconnect",    // the profile has no kv_transfer_bandwidth
	"unreachable",        // P's side channel did not answer in time
	"not_held",           // P does not hold the blocks (released, expired, another engine, never came)
	"engine_mismatch",    // P's engine id is not remote_engine_id
	"side_channel_error", // P answered with another status
}

// buckets125 returns 1, 2, 5, 10, 20, 50, … up to max inclusive (vLLM
// build_1_2_5_buckets(max_model_len), the buckets of the per-request token
// histograms).
func buckets125(max int) []float64 {
	var b []float64
	for e := 1; ; e *= 10 {
		for _, m := range [3]int{1, 2, 5} {
			v := m * e
			if v > max {
				return b
			}
			b = append(b, float64(v))
		}
	}
}

// Help of the per-tier occupancy gauges.
const (
	tierBlocksHelp = "Simulator only (not vLLM): KV blocks held in each tier (gpu: cached blocks in the GPU pool; remote: the shared store's)."
	tierCapHelp    = "Simulator only (not vLLM): KV capacity of each tier, in blocks."
)

// maxLoRAInfoSeries bounds the label sets of vllm:lora_requests_info kept
// for exposition. vLLM keeps every label set it ever set (readers take the
// sample with the largest value); the simulator drops the least recently
// set ones beyond this many, which no such reader can notice.
const maxLoRAInfoSeries = 64

// metrics is the vLLM-named Prometheus surface of a Server (docs/PROTOCOLS.md
// §2.1; names, help, types, labels and buckets from vllm/v1/metrics/loggers.py),
// on a private registry. Engine metrics carry the labels model_name and
// engine="0". Counters are registered with their exposed _total name, since
// client_golang does not append it as prometheus_client does.
//
// Gauges and counters read the engine snapshot the driver publishes after
// each step, so a scrape never waits for the engine. Histograms are observed
// by the driver, all times in simulated seconds.
type metrics struct {
	reg *prometheus.Registry

	// Per-token and per-request latencies (simulated seconds).
	ttft, itl, tpot, e2e             prometheus.Histogram
	queue, prefill, decode, inferenc prometheus.Histogram
	// Per-request and per-step token counts.
	promptTokens, genTokens, maxTokensParam, maxGenTokens, paramsN prometheus.Histogram
	iterationTokens                                                prometheus.Histogram
	// stepLag is the simulator's own step lag (lag.go; engine seconds).
	stepLag prometheus.Histogram

	success *prometheus.CounterVec

	// P/D (pd.go): decode legs' reads, recomputes and failed release
	// notifications, and their reads' times (engine seconds).
	pdTransfers, pdNotifyFailures prometheus.Counter
	pdWaitRejects                 prometheus.Counter
	pdRecomputes                  *prometheus.CounterVec
	pdTransferTime                prometheus.Histogram

	// phase is the start-up phase the engine is in ("" when none);
	// startupFailures counts failed start-up attempts (Weights).
	phase           *atomic.Value
	startupFailures prometheus.Counter

	// LoRA (nil when disabled).
	loraInfo   *prometheus.GaugeVec
	maxLora    string
	loraSeries map[[2]string]int64 // (waiting, running) → sequence of its last Set
	loraSetSeq int64
}

func newMetrics(model string, cfg sim.Config, snap *atomic.Pointer[sim.Stats], sleep *atomic.Int32, startup *atomic.Pointer[sim.StartupPhases]) *metrics {
	reg := prometheus.NewRegistry()
	tiers := cfg.Tiers
	labels := prometheus.Labels{"model_name": model, "engine": "0"}
	with := func(k, v string) prometheus.Labels {
		l := prometheus.Labels{k: v}
		for lk, lv := range labels {
			l[lk] = lv
		}
		return l
	}
	stat := func() *sim.Stats { return snap.Load() }
	gauge := func(name, help string, l prometheus.Labels, f func(*sim.Stats) float64) {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: l},
			func() float64 { return f(stat()) }))
	}
	counter := func(name, help string, f func(*sim.Stats) float64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels},
			func() float64 { return f(stat()) }))
	}

	// Scheduler state.
	gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
		func(s *sim.Stats) float64 { return float64(s.Running) })
	gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
		func(s *sim.Stats) float64 { return float64(s.Waiting) })
	const byReasonHelp = "Number of requests waiting to be processed, by reason (capacity: blocked on KV cache or token budget; deferred: held back by a scheduling constraint, here max_loras)."
	gauge("vllm:num_requests_waiting_by_reason", byReasonHelp, with("reason", "capacity"),
		func(s *sim.Stats) float64 { return float64(s.Waiting - s.WaitingDeferred) })
	gauge("vllm:num_requests_waiting_by_reason", byReasonHelp, with("reason", "deferred"),
		func(s *sim.Stats) float64 { return float64(s.WaitingDeferred) })
	const sleepHelp = "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
	// As vLLM's PrometheusStatLogger.record_sleep_state (vllm/v1/metrics/
	// loggers.py): awake 1 and the others 0 while awake; asleep, awake 0
	// and weights_offloaded (level 1) or discard_all (level 2) 1.
	for i, st := range [...]string{"awake", "weights_offloaded", "discard_all"} {
		gauge("vllm:engine_sleep_state", sleepHelp, with("sleep_state", st), func(*sim.Stats) float64 {
			if int(sleep.Load()) == i {
				return 1
			}
			return 0
		})
	}
	curPhase := new(atomic.Value)
	for i, ph := range startup.Load().Phases() {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "infergate_sim_startup_seconds",
			Help:        "Simulator only: the modelled duration of each phase of the engine's start-up (image_pull, weights_load, warm_up), engine seconds; 0 without a start-up model.",
			ConstLabels: with("phase", string(ph.Phase))}, func() float64 { return startup.Load().Phases()[i].Duration.Seconds() }))
		phase := string(ph.Phase)
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "infergate_sim_startup_phase",
			Help:        "Simulator only: 1 for the start-up phase the engine is in (none once ready).",
			ConstLabels: with("phase", phase)}, func() float64 {
			if p, _ := curPhase.Load().(string); p == phase {
				return 1
			}
			return 0
		}))
	}
	gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
		func(s *sim.Stats) float64 { return s.KVUsage })

	// Counters.
	counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
		func(s *sim.Stats) float64 { return float64(s.PrefixQueries) })
	counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
		func(s *sim.Stats) float64 { return float64(s.PrefixHits) })
	// The KV connector's counters (vllm/v1/metrics/loggers.py,
	// counter_connector_prefix_cache_queries and _hits, from
	// PrefixCacheStats of the connector: the prompt tokens looked up in,
	// and found in, the tiers below the GPU at first admission). 0 when the
	// engine has no tiers, as vLLM without a KV connector.
	counter("vllm:external_prefix_cache_queries_total",
		"External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
		func(s *sim.Stats) float64 { return float64(s.ExternalQueries) })
	counter("vllm:external_prefix_cache_hits_total",
		"External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
		func(s *sim.Stats) float64 { return float64(s.ExternalHits) })
	counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
		func(s *sim.Stats) float64 { return float64(s.PromptTokens) })
	counter("vllm:prompt_tokens_cached_total", "Number of cached prompt tokens (local + external).",
		func(s *sim.Stats) float64 { return float64(s.CachedPromptTokens) })
	counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
		func(s *sim.Stats) float64 { return float64(s.GenerationTokens) })
	counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
		func(s *sim.Stats) float64 { return float64(s.Preemptions) })

	// KV tiers (simulator only, not vLLM: vLLM exports no per-tier
	// occupancy): blocks held and capacity per tier, hit tokens per tier
	// and the requests waiting for their loads (WAITING_FOR_REMOTE_KVS).
	if tiers.Enabled() {
		on := [sim.NumTiers]bool{sim.TierGPU: true, sim.TierHost: !tiers.Host.IsZero(),
			sim.TierDisk: !tiers.Disk.IsZero(), sim.TierRemote: tiers.Remote != nil}
		remote, _ := tiers.Remote.(*RemoteStore)
		for t := sim.TierGPU; t < sim.NumTiers; t++ {
			if !on[t] {
				continue
			}
			l := with("tier", t.String())
			switch {
			case t == sim.TierRemote && remote != nil:
				// The shared store's own occupancy (the same on every
				// engine of a fleet).
				gauge("infergate_sim_kv_tier_blocks", tierBlocksHelp, l, func(*sim.Stats) float64 { return float64(remote.Len()) })
				gauge("infergate_sim_kv_tier_capacity_blocks", tierCapHelp, l, func(*sim.Stats) float64 { return float64(remote.Capacity()) })
			case t != sim.TierRemote:
				gauge("infergate_sim_kv_tier_blocks", tierBlocksHelp, l, func(s *sim.Stats) float64 { return float64(s.TierBlocks[t]) })
				gauge("infergate_sim_kv_tier_capacity_blocks", tierCapHelp, l, func(s *sim.Stats) float64 { return float64(s.TierCapacity[t]) })
			}
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "infergate_sim_kv_tier_hit_tokens_total",
				Help: "Simulator only (not vLLM): prompt tokens served from each KV tier at first scheduling (gpu: the prefix cache; the others loaded).", ConstLabels: l},
				func() float64 { return float64(stat().TierHits[t]) }))
		}
		gauge("infergate_sim_requests_loading", "Simulator only (not vLLM): waiting requests whose KV blocks are being loaded from a lower tier (vLLM WAITING_FOR_REMOTE_KVS).", labels,
			func(s *sim.Stats) float64 { return float64(s.Loading) })
		counter("infergate_sim_kv_loaded_blocks_total", "Simulator only (not vLLM): KV blocks loaded from the tiers below the GPU (re-admissions included).",
			func(s *sim.Stats) float64 { return float64(s.LoadedBlocks) })
	}

	// P/D (simulator only: vLLM's NIXL connector exports its own transfer
	// metrics, whose names and buckets are not copied here).
	gauge("infergate_sim_pd_held_requests", "Simulator only (not vLLM): finished prefill requests whose KV blocks are held for a decode engine (vLLM delay_free_blocks).", labels,
		func(s *sim.Stats) float64 { return float64(s.HeldRequests) })
	gauge("infergate_sim_pd_held_blocks", "Simulator only (not vLLM): KV blocks held for decode engines (counted in vllm:kv_cache_usage_perc).", labels,
		func(s *sim.Stats) float64 { return float64(s.HeldBlocks) })
	counter("infergate_sim_pd_held_released_total", "Simulator only (not vLLM): holds freed by a release (the decode engine read them, or a gateway released them) or an abort.",
		func(s *sim.Stats) float64 { return float64(s.HeldReleased) })
	counter("infergate_sim_pd_held_expired_total", "Simulator only (not vLLM): holds freed by the abort timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT) without a release.",
		func(s *sim.Stats) float64 { return float64(s.HeldExpired) })
	counter("infergate_sim_pd_transferred_blocks_total", "Simulator only (not vLLM): KV blocks read from prefill engines.",
		func(s *sim.Stats) float64 { return float64(s.TransferredBlocks) })

	// Cache config: an info gauge permanently 1 (vLLM log_metrics_info,
	// labels from CacheConfig.metrics_info() plus engine, no model_name).
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

	hist := func(name, help string, buckets []float64) prometheus.Histogram {
		h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, ConstLabels: labels, Buckets: buckets})
		reg.MustRegister(h)
		return h
	}
	maxLen := cfg.Profile.MaxModelLen
	if maxLen <= 0 {
		maxLen = cfg.NumBlocks * cfg.BlockSize
	}
	tokenBuckets := buckets125(maxLen)
	m := &metrics{
		phase: curPhase,
		startupFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "infergate_sim_startup_failures_total",
			Help:        "Simulator only: start-up attempts that failed to locate, fetch or read the weights through the artifact cache (each retried with back-off).",
			ConstLabels: labels}),
		reg: reg,
		ttft: hist("vllm:time_to_first_token_seconds",
			"Histogram of time to first token in seconds.", ttftBuckets),
		itl: hist("vllm:inter_token_latency_seconds",
			"Histogram of inter-token latency in seconds.", itlBuckets),
		tpot: hist("vllm:request_time_per_output_token_seconds",
			"Histogram of time_per_output_token_seconds per request.", itlBuckets),
		e2e: hist("vllm:e2e_request_latency_seconds",
			"Histogram of e2e request latency in seconds.", e2eBuckets),
		queue: hist("vllm:request_queue_time_seconds",
			"Histogram of time spent in WAITING phase for request.", e2eBuckets),
		inferenc: hist("vllm:request_inference_time_seconds",
			"Histogram of time spent in RUNNING phase for request.", e2eBuckets),
		prefill: hist("vllm:request_prefill_time_seconds",
			"Histogram of time spent in PREFILL phase for request.", e2eBuckets),
		decode: hist("vllm:request_decode_time_seconds",
			"Histogram of time spent in DECODE phase for request.", e2eBuckets),
		promptTokens: hist("vllm:request_prompt_tokens",
			"Number of prefill tokens processed.", tokenBuckets),
		genTokens: hist("vllm:request_generation_tokens",
			"Number of generation tokens processed.", tokenBuckets),
		maxTokensParam: hist("vllm:request_params_max_tokens",
			"Histogram of the max_tokens request parameter.", tokenBuckets),
		maxGenTokens: hist("vllm:request_max_num_generation_tokens",
			"Histogram of maximum number of requested generation tokens.", tokenBuckets),
		paramsN: hist("vllm:request_params_n",
			"Histogram of the n request parameter.", paramsNBuckets),
		iterationTokens: hist("vllm:iteration_tokens_total",
			"Histogram of number of tokens per engine_step.", iterationTokenBuckets),
		stepLag: hist("infergate_sim_step_lag_seconds",
			"Simulator only (not vLLM): per engine step, how late its tokens were delivered against the time scale's wall-clock deadline, in engine seconds (wall lateness times the time scale).", stepLagBuckets),
		success: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "vllm:request_success_total",
			Help: "Count of successfully processed requests.", ConstLabels: labels}, []string{"finished_reason"}),
	}
	reg.MustRegister(m.success)
	m.pdTransfers = prometheus.NewCounter(prometheus.CounterOpts{Name: "infergate_sim_pd_kv_transfers_total",
		Help: "Simulator only (not vLLM): decode requests whose prompt KV was read from a prefill engine.", ConstLabels: labels})
	m.pdNotifyFailures = prometheus.NewCounter(prometheus.CounterOpts{Name: "infergate_sim_pd_release_notify_failures_total",
		Help: "Simulator only (not vLLM): release notifications to a prefill engine that failed after a read (its blocks then wait for the abort timeout).", ConstLabels: labels})
	m.pdRecomputes = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "infergate_sim_pd_recompute_total",
		Help: "Simulator only (not vLLM): decode requests that computed their prompt because its KV could not be read from the prefill engine (vLLM kv_load_failure_policy recompute), by reason.", ConstLabels: labels}, []string{"reason"})
	m.pdTransferTime = hist("infergate_sim_pd_kv_transfer_seconds",
		"Simulator only (not vLLM): per decode request reading its prompt from a prefill engine, from its arrival to the end of the read, in engine seconds (waiting for free blocks and the link included).", pdTransferBuckets)
	m.pdWaitRejects = prometheus.NewCounter(prometheus.CounterOpts{Name: "infergate_sim_pd_transfer_waiters_rejected_total",
		Help: "Simulator only (not vLLM): side-channel transfer long polls answered 503 because PDConfig.MaxWaiters waited already.", ConstLabels: labels})
	reg.MustRegister(m.pdTransfers, m.pdNotifyFailures, m.pdWaitRejects, m.pdRecomputes)
	for _, r := range pdRecomputeReasons {
		m.pdRecomputes.WithLabelValues(r)
	}
	// Expose the series before the first request, as vLLM does for every
	// FinishReason; the simulator produces "length" and "abort".
	for _, r := range [...]string{"stop", "length", "abort"} {
		m.success.WithLabelValues(r)
	}

	if cfg.LoRA.Enabled() {
		// vLLM registers it with exactly these three labels (no model_name,
		// no engine) and set_to_current_time() on every stats record.
		m.loraInfo = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "vllm:lora_requests_info",
			Help: "Running stats on lora requests.",
		}, []string{"max_lora", "waiting_lora_adapters", "running_lora_adapters"})
		reg.MustRegister(m.loraInfo)
		m.maxLora = strconv.Itoa(cfg.LoRA.MaxLoras)
		m.loraSeries = make(map[[2]string]int64)
		m.setLoRAInfo(&sim.Stats{}, time.Now())
	}
	reg.MustRegister(m.startupFailures)
	return m
}

// pdRecompute counts a decode request that recomputes its prompt.
func (m *metrics) pdRecompute(reason string) { m.pdRecomputes.WithLabelValues(reason).Inc() }

// firstToken records what vLLM records when a request's first token comes
// out: its TTFT (simulated seconds), n (always 1) and the maximum number of
// tokens it may generate.
func (m *metrics) firstToken(ttft time.Duration, maxTokens int) {
	m.ttft.Observe(ttft.Seconds())
	m.paramsN.Observe(1)
	m.maxGenTokens.Observe(float64(maxTokens))
}

// finished records the per-request histograms of a finished request, from
// its simulated arrival, first scheduling, first-token and last-token times
// (vllm/v1/metrics/stats.py, IterationStats.update_from_finished_request):
// queue = scheduled − arrival, prefill = first − scheduled,
// decode = end − first, inference = end − scheduled, e2e = end − arrival,
// time per output token = decode / (generated − 1) (0 for one token).
// maxTokensParam is the request's max_tokens, 0 when the client did not set
// it (vLLM then records nothing).
func (m *metrics) finished(arrival, scheduled, first, end time.Duration, prompt, generated, maxTokensParam int) {
	m.success.WithLabelValues("length").Inc()
	m.e2e.Observe((end - arrival).Seconds())
	m.queue.Observe((scheduled - arrival).Seconds())
	m.prefill.Observe((first - scheduled).Seconds())
	m.decode.Observe((end - first).Seconds())
	m.inferenc.Observe((end - scheduled).Seconds())
	tpot := 0.0
	if generated > 1 {
		tpot = (end - first).Seconds() / float64(generated-1)
	}
	m.tpot.Observe(tpot)
	m.promptTokens.Observe(float64(prompt))
	m.genTokens.Observe(float64(generated))
	if maxTokensParam > 0 {
		m.maxTokensParam.Observe(float64(maxTokensParam))
	}
}

// setLoRAInfo sets vllm:lora_requests_info for the adapters in st to the
// wall-clock time now in Unix seconds (vLLM Gauge.set_to_current_time), and
// drops the oldest label sets beyond maxLoRAInfoSeries. Only the driver calls it.
func (m *metrics) setLoRAInfo(st *sim.Stats, now time.Time) {
	if m.loraInfo == nil {
		return
	}
	key := [2]string{strings.Join(st.WaitingLoRAs, ","), strings.Join(st.RunningLoRAs, ",")}
	m.loraSetSeq++
	if _, ok := m.loraSeries[key]; !ok && len(m.loraSeries) >= maxLoRAInfoSeries {
		var oldest [2]string
		first := true
		for k, seq := range m.loraSeries {
			if first || seq < m.loraSeries[oldest] {
				oldest, first = k, false
			}
		}
		delete(m.loraSeries, oldest)
		m.loraInfo.DeleteLabelValues(m.maxLora, oldest[0], oldest[1])
	}
	m.loraSeries[key] = m.loraSetSeq
	m.loraInfo.WithLabelValues(m.maxLora, key[0], key[1]).Set(float64(now.UnixNano()) / 1e9)
}

// startupFailed counts a failed start-up attempt.
func (m *metrics) startupFailed() { m.startupFailures.Inc() }

// setPhase records the start-up phase the engine is in ("" once ready).
func (m *metrics) setPhase(p string) { m.phase.Store(p) }
