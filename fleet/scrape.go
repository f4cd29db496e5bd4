package fleet

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Load is what one metrics page says about an engine's load and KV cache.
// Unknown values are marked: the Has flags, -1 for fractions and counters,
// 0 for block sizes and counts. Where an endpoint fronts several engines
// (vLLM data parallelism: one series per `engine` label value; SGLang DP
// ranks), counts are summed and fractions averaged.
type Load struct {
	// Waiting and Running are requests queued and in the running batch,
	// summed over engines; meaningful when HasQueue.
	Waiting, Running int
	// KVUtil is the fraction of KV-cache capacity in use, 0..1, averaged
	// over engines; -1 when unknown (then HasKVUtil is false).
	KVUtil float64
	// BlockSize is the KV block (SGLang: page) size in tokens; 0 unknown.
	BlockSize int
	// NumBlocks is the endpoint's KV capacity in blocks; 0 unknown. vLLM
	// reports it already summed over its DP engines (see pageSpec.blocks).
	NumBlocks int
	// PrefixQueries and PrefixHits are cumulative counters of prompt tokens
	// looked up in the engine's own (device) prefix cache and found there;
	// -1 when unknown. A hit rate needs two pages: ΔHits/ΔQueries.
	PrefixQueries, PrefixHits float64
	// LoRA is the adapter state (vLLM and sim only).
	LoRA LoRAState
	// Engines is the number of series summed into Running (DP engines or
	// ranks); 0 when the page has no running count.
	Engines int
	// HasQueue is true when the page had both a waiting and a running count.
	HasQueue bool
	// HasKVUtil is true when KVUtil is known.
	HasKVUtil bool
	// Asleep is true when the engine reports itself asleep: vLLM's sleep
	// mode, vllm:engine_sleep_state{sleep_state="awake"} 0 (any of its
	// engines; vllm/v1/metrics/loggers.py record_sleep_state). A sleeping
	// vLLM still answers /health 200; false when unknown.
	Asleep bool
}

// LoRAState is vLLM's vllm:lora_requests_info: the most recent sample
// (largest value, a wall-clock timestamp) of the adapters with running and
// waiting requests. Only present when the engine serves LoRA adapters.
type LoRAState struct {
	// Known is true when the page had the metric.
	Known bool
	// Running and Waiting are adapter names with requests running and
	// waiting (nil when none).
	Running, Waiting []string
	// Max is max_lora, how many adapters fit in one batch; 0 unknown.
	Max int
	// Updated is when the engine last set the sample (its value).
	Updated time.Time
}

// UnknownLoad returns a Load in which nothing is known.
func UnknownLoad() Load { return Load{KVUtil: -1, PrefixQueries: -1, PrefixHits: -1} }

// ErrNoMetrics is returned for kinds without a metrics page (Ollama).
var ErrNoMetrics = errors.New("engine kind has no metrics endpoint")

// maxLine bounds one line of a metrics page that ParseMetrics reads; longer
// lines of metrics it does not read are skipped.
const maxLine = 1 << 20

// maxCount bounds request counts (so a float from the page always fits an int).
const maxCount = math.MaxInt32

// pageSpec names the metrics one kind's page is read from. In lists, the
// first name present on the page wins (newest name first).
type pageSpec struct {
	waiting, running []string // summed over samples
	kvUtil           []string // averaged over samples
	// cacheInfo is an info gauge whose labels blockLabel and blocksLabel
	// hold the block size and count; blockGauge and blocksGauge are plain
	// gauges preferred over it when present.
	cacheInfo, blockLabel, blocksLabel string
	blockGauge, blocksGauge            string
	// queries[i] and hits[i] are prefix-cache counters (tokens) of one
	// engine generation; the first pair with both present wins.
	queries, hits []string
	// queriesExcludeHits: the queries counter counts only tokens computed,
	// so queries = counter + hits (llama.cpp prompt_tokens_total).
	queriesExcludeHits bool
	// hitsSource, if set, keeps only hits samples with cache_source equal
	// to it when the label is present (SGLang splits device/host/storage).
	hitsSource string
	lora       string
	// sleep is the sleep-state gauge (sleep_state="awake" 0: asleep).
	sleep string
}

var vllmSpec = pageSpec{
	// docs/PROTOCOLS.md §2.1; vllm/v1/metrics/loggers.py.
	waiting: []string{"vllm:num_requests_waiting"},
	running: []string{"vllm:num_requests_running"},
	// kv_cache_usage_perc is a fraction despite its name; the deprecated
	// gpu_cache_usage_perc (vLLM #18354) is the fallback for older versions.
	kvUtil:      []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"},
	cacheInfo:   "vllm:cache_config_info",
	blockLabel:  "block_size",
	blocksLabel: "num_gpu_blocks",
	queries:     []string{"vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"},
	hits:        []string{"vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"},
	lora:        "vllm:lora_requests_info",
	sleep:       "vllm:engine_sleep_state",
}

var specs = map[Kind]pageSpec{
	VLLM: vllmSpec,
	Sim:  vllmSpec,
	SGLang: {
		// docs/PROTOCOLS.md §2.2–2.3; sglang metrics collector. Newer versions
		// export page_size and num_pages as gauges; the GIE/llm-d EPP reads
		// them as labels of sglang:cache_config_info, kept as the fallback.
		waiting:     []string{"sglang:num_queue_reqs"},
		running:     []string{"sglang:num_running_reqs"},
		kvUtil:      []string{"sglang:token_usage"},
		cacheInfo:   "sglang:cache_config_info",
		blockLabel:  "page_size",
		blocksLabel: "num_pages",
		blockGauge:  "sglang:page_size",
		blocksGauge: "sglang:num_pages",
		// prompt_tokens_total counts every prompt token, cached or not;
		// cached_tokens_total is split by cache_source in newer versions.
		queries:    []string{"sglang:prompt_tokens_total"},
		hits:       []string{"sglang:cached_tokens_total"},
		hitsSource: "device",
	},
	TGI: {
		// docs/PROTOCOLS.md §2.4: no KV, prefix or LoRA metric.
		waiting: []string{"tgi_queue_size"},
		running: []string{"tgi_batch_current_size"},
	},
	LlamaCpp: {
		// docs/PROTOCOLS.md §2.5; tools/server server-task.cpp to_metrics().
		// kv_cache_usage_ratio: older builds only. prompt_tokens_total
		// excludes cached tokens; prompt_tokens_cached_total: newer builds.
		waiting:            []string{"llamacpp:requests_deferred"},
		running:            []string{"llamacpp:requests_processing"},
		kvUtil:             []string{"llamacpp:kv_cache_usage_ratio"},
		queries:            []string{"llamacpp:prompt_tokens_total"},
		hits:               []string{"llamacpp:prompt_tokens_cached_total"},
		queriesExcludeHits: true,
	},
}

// names returns the set of metric names sp reads.
func (sp *pageSpec) names() map[string]bool {
	set := map[string]bool{}
	for _, l := range [][]string{sp.waiting, sp.running, sp.kvUtil, sp.queries, sp.hits,
		{sp.cacheInfo, sp.blockGauge, sp.blocksGauge, sp.lora, sp.sleep}} {
		for _, n := range l {
			if n != "" {
				set[n] = true
			}
		}
	}
	return set
}

// specNames caches pageSpec.names per kind.
var specNames = func() map[Kind]map[string]bool {
	m := map[Kind]map[string]bool{}
	for k, sp := range specs {
		m[k] = sp.names()
	}
	return m
}()

// ParseMetrics reads one Prometheus text-format metrics page (exposition
// format 0.0.4) of an engine of the given kind and returns its Load.
//
// Only the lines of the metrics the kind's Load is read from are parsed
// (with prometheus/common/expfmt), so a malformed or huge line elsewhere on
// the page does not matter, and a page costs about a twentieth of a full
// parse (BenchmarkParseMetrics). Non-finite samples are ignored; negative
// counts and counters read as 0 and utilizations are clamped to 0..1.
//
// It returns an error for Ollama (ErrNoMetrics), for an unknown kind, for a
// read or parse error, and for a page without any of the kind's load
// metrics (usually a wrong kind, or SGLang without --enable-metrics).
func ParseMetrics(kind Kind, r io.Reader) (Load, error) {
	if kind == Ollama {
		return UnknownLoad(), fmt.Errorf("%s: %w", kind, ErrNoMetrics)
	}
	sp, ok := specs[kind]
	if !ok {
		return UnknownLoad(), fmt.Errorf("parse metrics: unknown engine kind %q", kind)
	}
	var buf bytes.Buffer
	lines, err := filterPage(r, specNames[kind], &buf)
	if err != nil {
		return UnknownLoad(), fmt.Errorf("read metrics: %w", err)
	}
	// UTF8Validation: the zero TextParser has no validation scheme and
	// panics; the names read here (with ':') are valid either way.
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(&buf)
	if err != nil {
		var pe expfmt.ParseError
		if errors.As(err, &pe) && pe.Line >= 1 && pe.Line <= len(lines) {
			pe.Line = lines[pe.Line-1] // the page's line, not the filtered text's
			err = pe
		}
		return UnknownLoad(), fmt.Errorf("parse metrics: %w", err)
	}
	if len(fams) == 0 {
		return UnknownLoad(), fmt.Errorf("parse metrics: no %s load metric on the page (wrong engine kind?)", kind)
	}
	return sp.load(metricsPage(fams)), nil
}

// filterPage copies to out the lines of r that are samples, HELP or TYPE
// lines of the metrics in want, and returns the page's line number (from 1)
// of each line copied. A line longer than maxLine is an error only when it
// is kept.
func filterPage(r io.Reader, want map[string]bool, out *bytes.Buffer) ([]int, error) {
	var lines []int
	br := lineReaders.Get().(*bufio.Reader)
	br.Reset(r)
	defer func() { br.Reset(nil); lineReaders.Put(br) }()
	for lineNo := 1; ; lineNo++ {
		chunk, err := br.ReadSlice('\n')
		if len(chunk) > 0 {
			keep := want[string(lineMetric(chunk))]
			var name string // of a kept line (chunk's bytes change on the next read)
			if keep {
				name = string(lineMetric(chunk))
				lines = append(lines, lineNo)
				out.Write(chunk)
			}
			for n := len(chunk); err == bufio.ErrBufferFull; n += len(chunk) { // the rest of a long line
				chunk, err = br.ReadSlice('\n')
				if keep {
					if n+len(chunk) > maxLine {
						return nil, fmt.Errorf("line %d (%s) is longer than %d bytes", lineNo, name, maxLine)
					}
					out.Write(chunk)
				}
			}
		}
		switch {
		case err == io.EOF:
			return lines, nil
		case err != nil:
			return nil, err
		}
	}
}

// lineReaders recycles filterPage's line readers.
var lineReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 64<<10) }}

// lineMetric returns the metric name a text-format line is about: the name
// of a sample line, or of a "# HELP" or "# TYPE" line; empty for anything
// else.
func lineMetric(line []byte) []byte {
	line = bytes.TrimLeft(line, " \t")
	if len(line) > 0 && line[0] == '#' {
		line = bytes.TrimLeft(line[1:], " \t")
		if !bytes.HasPrefix(line, []byte("HELP")) && !bytes.HasPrefix(line, []byte("TYPE")) {
			return nil
		}
		if rest := line[4:]; len(rest) > 0 && (rest[0] == ' ' || rest[0] == '\t') {
			line = bytes.TrimLeft(rest, " \t")
		} else {
			return nil
		}
	}
	end := bytes.IndexAny(line, "{ \t\r\n")
	if end < 0 {
		end = len(line)
	}
	return line[:end]
}

// metricsPage is a parsed metrics page.
type metricsPage map[string]*dto.MetricFamily

// first returns the samples of the first of names present on the page.
func (p metricsPage) first(names ...string) []*dto.Metric {
	for _, n := range names {
		if f := p[n]; f != nil && len(f.GetMetric()) > 0 {
			return f.GetMetric()
		}
	}
	return nil
}

// sampleValue returns a gauge, counter or untyped sample's value; false when it
// has none or it is NaN or infinite.
func sampleValue(m *dto.Metric) (float64, bool) {
	var v float64
	switch {
	case m.GetGauge() != nil:
		v = m.GetGauge().GetValue()
	case m.GetCounter() != nil:
		v = m.GetCounter().GetValue()
	case m.GetUntyped() != nil:
		v = m.GetUntyped().GetValue()
	default:
		return 0, false
	}
	return v, !math.IsNaN(v) && !math.IsInf(v, 0)
}

// sampleLabel returns the value of the sample's label name.
func sampleLabel(m *dto.Metric, name string) (string, bool) {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue(), true
		}
	}
	return "", false
}

// sumSamples adds the finite samples of ms, negatives as 0, and counts them.
func sumSamples(ms []*dto.Metric) (total float64, n int) {
	for _, m := range ms {
		if v, ok := sampleValue(m); ok {
			total += max(v, 0)
			n++
		}
	}
	return total, n
}

// toCount converts a summed count to an int, clamped to 0..maxCount.
func toCount(v float64) int { return int(math.Round(min(max(v, 0), maxCount))) }

// positiveInt parses a label or gauge value as a positive int; 0 if it is not one.
func positiveInt(s string) int {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil || n <= 0 || n > maxCount {
		return 0
	}
	return n
}

// load reads a Load from p as sp says.
func (sp *pageSpec) load(p metricsPage) Load {
	l := UnknownLoad()

	waiting, nw := sumSamples(p.first(sp.waiting...))
	running, nr := sumSamples(p.first(sp.running...))
	l.Waiting, l.Running, l.Engines = toCount(waiting), toCount(running), nr
	l.HasQueue = nw > 0 && nr > 0

	// The mean of the samples, each clamped to 0..1 so that one bad
	// engine cannot hide another's load.
	var util float64
	var n int
	for _, m := range p.first(sp.kvUtil...) {
		if v, ok := sampleValue(m); ok {
			util += min(max(v, 0), 1)
			n++
		}
	}
	if n > 0 {
		l.KVUtil, l.HasKVUtil = util/float64(n), true
	}

	l.BlockSize, l.NumBlocks = sp.blocks(p)
	l.PrefixQueries, l.PrefixHits = sp.prefix(p)
	if sp.lora != "" {
		l.LoRA = loraState(p.first(sp.lora))
	}
	if sp.sleep != "" {
		for _, m := range p.first(sp.sleep) {
			if st, ok := sampleLabel(m, "sleep_state"); ok && st == "awake" {
				if v, ok := sampleValue(m); ok && v == 0 {
					l.Asleep = true
				}
			}
		}
	}
	return l
}

// blocks returns the KV block size and count. Both come from the sample
// with the largest count: vLLM labels every DP engine's cache_config_info
// with the front end's CacheConfig, whose num_gpu_blocks is already the
// sum over engines (vllm/v1/engine/utils.py, wait_for_engine_startup: "Sum
// values from all engines in DP case"), so summing the samples would count
// it once per engine. For SGLang the largest is one scheduler's pool.
func (sp *pageSpec) blocks(p metricsPage) (size, n int) {
	if sp.blockGauge != "" {
		for _, m := range p.first(sp.blocksGauge) {
			if v, ok := sampleValue(m); ok && v >= 1 && v <= maxCount && int(v) > n {
				n = int(v)
			}
		}
		for _, m := range p.first(sp.blockGauge) {
			if v, ok := sampleValue(m); ok && v >= 1 && v <= maxCount && int(v) > size {
				size = int(v)
			}
		}
		if size > 0 && n > 0 {
			return size, n
		}
		size, n = 0, 0
	}
	if sp.cacheInfo == "" {
		return 0, 0
	}
	for _, m := range p.first(sp.cacheInfo) {
		bs, _ := sampleLabel(m, sp.blockLabel)
		nb, _ := sampleLabel(m, sp.blocksLabel)
		if b, c := positiveInt(bs), positiveInt(nb); b > 0 && c > n {
			size, n = b, c
		}
	}
	return size, n
}

// prefix returns the prefix-cache query and hit counters, -1 when unknown.
func (sp *pageSpec) prefix(p metricsPage) (queries, hits float64) {
	for i := range sp.queries {
		q, nq := sumSamples(p.first(sp.queries[i]))
		hs := p.first(sp.hits[i])
		if sp.hitsSource != "" {
			hs = withLabel(hs, "cache_source", sp.hitsSource)
		}
		h, nh := sumSamples(hs)
		if nq == 0 || nh == 0 {
			continue
		}
		if sp.queriesExcludeHits {
			q += h
		}
		return q, h
	}
	return -1, -1
}

// withLabel returns the samples of ms with label name equal to v, or all of
// ms when none of them has the label.
func withLabel(ms []*dto.Metric, name, v string) []*dto.Metric {
	var out []*dto.Metric
	labelled := false
	for _, m := range ms {
		if lv, ok := sampleLabel(m, name); ok {
			labelled = true
			if lv == v {
				out = append(out, m)
			}
		}
	}
	if !labelled {
		return ms
	}
	return out
}

// loraState reads vllm:lora_requests_info: the sample with the largest
// value (vLLM sets it to the current time on each update and keeps old
// label sets; docs/PROTOCOLS.md §2.1).
func loraState(ms []*dto.Metric) LoRAState {
	if len(ms) == 0 {
		return LoRAState{}
	}
	best, bestV := ms[0], math.Inf(-1)
	for _, m := range ms {
		if v, ok := sampleValue(m); ok && v > bestV {
			best, bestV = m, v
		}
	}
	st := LoRAState{Known: true}
	r, _ := sampleLabel(best, "running_lora_adapters")
	w, _ := sampleLabel(best, "waiting_lora_adapters")
	mx, _ := sampleLabel(best, "max_lora")
	st.Running, st.Waiting, st.Max = splitAdapters(r), splitAdapters(w), positiveInt(mx)
	if bestV > 0 && bestV < 1<<40 { // seconds since 1970; anything else is not a time
		sec, frac := math.Modf(bestV)
		st.Updated = time.Unix(int64(sec), int64(frac*1e9))
	}
	return st
}

// splitAdapters splits a comma-separated adapter list; nil when empty.
func splitAdapters(s string) []string {
	var out []string
	for _, a := range strings.Split(s, ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	return out
}

// Scraping defaults.
const (
	// DefaultScrapeInterval is the default time between scrape rounds. The
	// gateway counts its own in-flight requests exactly and for free; a
	// scrape corrects that with what only the engine knows (requests from
	// other clients, KV utilization, cache config), which a second's delay
	// does not spoil. Polling every 50 ms cost more CPU than routing
	// (docs/ARCHITECTURE.md, Pitfalls); at 1 s one endpoint costs one small GET
	// and one filtered parse (about 0.1 ms for a vLLM page, against 2 ms
	// for a full parse; BenchmarkParseMetrics) per second. Large fleets
	// may set it longer.
	DefaultScrapeInterval = time.Second
	// DefaultMaxBytes bounds a metrics page (after decompression); a vLLM
	// page is tens of KiB, growing with histogram label sets.
	DefaultMaxBytes = 4 << 20
	// DefaultScrapeConcurrency is how many endpoints a round scrapes at
	// once. A round lasts up to ceil(h/Concurrency) × Timeout when h
	// endpoints hang, and the others' loads go stale after 3 intervals, so
	// it is generous: waiting costs no CPU.
	DefaultScrapeConcurrency = 16
	// staleIntervals: a Load older than this many intervals is unknown.
	staleIntervals = 3
)

// ErrTooLarge is returned when a metrics page exceeds ScrapeConfig.MaxBytes.
var ErrTooLarge = errors.New("metrics page too large")

// Target is an engine whose metrics a Scraper polls (a scrape target).
type Target struct {
	// URL is the engine's base URL, e.g. "http://10.0.0.7:8000".
	URL string
	// Kind is the engine kind; its MetricsPath is appended to URL.
	Kind Kind
	// MetricsURL, if set, is the full metrics URL instead (TGI with
	// --prometheus-port, llama.cpp router mode's /metrics?model=<id>).
	MetricsURL string
	// Header is added to every scrape request: the engine's credentials
	// and extra headers (Authorization for a metrics page behind a key).
	// Read-only; nil for none. Accept is the Scraper's own.
	Header http.Header
}

// ScrapeConfig configures a Scraper; zero fields take the defaults.
type ScrapeConfig struct {
	// Interval is the time between scrape rounds (DefaultScrapeInterval).
	Interval time.Duration
	// Timeout bounds one GET, body included (default Interval).
	Timeout time.Duration
	// MaxBytes bounds one metrics page (DefaultMaxBytes).
	MaxBytes int64
	// Concurrency is how many endpoints are scraped at once
	// (DefaultScrapeConcurrency).
	Concurrency int
	// Phase pins the rounds after the first to absolute time: each starts
	// at an instant whose Unix time is Phase modulo Interval (UntilPhase;
	// PhaseOffset makes one from a name, as Prometheus offsets each
	// target's scrapes), so that scrapers started together (the gateway's,
	// one per endpoint) do not scrape together every Interval; taken
	// modulo Interval (0: the instants that are multiples of Interval).
	Phase time.Duration
	// Client sends the GETs. Default: a client of the Scraper's own with
	// keep-alive connections, closed when Run returns, that follows no
	// redirect (noRedirects). A client given here should not either: the
	// engine's credentials (Target.Header) would go with it.
	Client *http.Client
}

// Scraper polls the metrics pages of a fixed list of endpoints and keeps
// the latest Load of each. Run drives it; Latest and Err may be called from
// any goroutine at any time.
type Scraper struct {
	eps      []Target
	urls     []string // metrics URL per endpoint, "" when it has none
	states   []atomic.Pointer[scrapeResult]
	cfg      ScrapeConfig
	ownsHTTP bool
	round    sync.Mutex // one round at a time
	now      func() time.Time
}

// scrapeResult is the state of one endpoint after its latest scrape.
type scrapeResult struct {
	load Load
	at   time.Time // when load was read; zero before the first success
	err  error     // of the latest scrape; nil when it succeeded
}

// NewScraper returns a Scraper of eps (endpoint i is index i in Latest).
// Endpoints whose kind has no metrics page (Ollama) are kept but never
// scraped; their Err is ErrNoMetrics.
func NewScraper(eps []Target, cfg ScrapeConfig) (*Scraper, error) {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultScrapeInterval
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = cfg.Interval
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = DefaultMaxBytes
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = DefaultScrapeConcurrency
	}
	s := &Scraper{
		eps:    append([]Target(nil), eps...),
		urls:   make([]string, len(eps)),
		states: make([]atomic.Pointer[scrapeResult], len(eps)),
		now:    time.Now,
	}
	for i, ep := range eps {
		if !ep.Kind.Valid() {
			return nil, fmt.Errorf("scraper: endpoint %d (%s): unknown engine kind %q", i, ep.URL, ep.Kind)
		}
		u := ep.MetricsURL
		switch {
		case ep.Kind.Info().MetricsPath == "":
			s.states[i].Store(&scrapeResult{err: fmt.Errorf("%s: %w", ep.Kind, ErrNoMetrics)})
			continue
		case u == "":
			u = strings.TrimRight(ep.URL, "/") + ep.Kind.Info().MetricsPath
		}
		if pu, err := url.Parse(u); err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
			return nil, fmt.Errorf("scraper: endpoint %d: bad metrics URL %q", i, u)
		}
		s.urls[i] = u
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{
			Transport: &http.Transport{
				DialContext:         (&net.Dialer{Timeout: cfg.Timeout, KeepAlive: 30 * time.Second}).DialContext,
				MaxIdleConnsPerHost: 1,
				IdleConnTimeout:     staleIntervals*cfg.Interval + 30*time.Second,
				// No Accept-Encoding: gzip. The page is compressed by the
				// engine's own process (vLLM and SGLang serve /metrics with
				// prometheus_client from their API server), every second
				// here against Prometheus's 15-30 s: one scrape of a
				// simulated engine cost it 3.6 ms of CPU gzipped against
				// 2.1 ms plain (35 KB of text, 3.5 KB gzipped; gateway/
				// README.md "What each replica spends on the exchange"),
				// and the gateway spent half its scrape CPU decompressing.
				// 35 KB a second per engine is nothing on a cluster network.
				DisableCompression: true,
			},
			CheckRedirect: noRedirects,
		}
		s.ownsHTTP = true
	}
	s.cfg = cfg
	return s, nil
}

// noRedirects is the default client's CheckRedirect: a redirect is
// answered as the engine's answer (a non-200, so the scrape fails), never
// followed. net/http drops Authorization on a redirect to another host but
// keeps every other header, so following one sent the engine's credentials
// (an Api-Key header, an OpenAI-Organization) wherever a hostile or
// misconfigured engine pointed (the attack run's redirect-leak finding).
func noRedirects(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// Len returns the number of endpoints.
func (s *Scraper) Len() int { return len(s.eps) }

// Run scrapes every endpoint at once, then every Interval at Phase, until
// ctx is done; it returns when the round in progress has ended. Rounds
// that would overlap are skipped. Run starts no goroutine that outlives it.
func (s *Scraper) Run(ctx context.Context) {
	if s.ownsHTTP {
		defer s.cfg.Client.CloseIdleConnections()
	}
	if ctx.Err() != nil {
		return
	}
	s.ScrapeOnce(ctx)
	t := time.NewTimer(UntilPhase(time.Now(), s.cfg.Phase, s.cfg.Interval))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		began := time.Now()
		s.ScrapeOnce(ctx)
		t.Reset(NextPhase(time.Now(), began, s.cfg.Phase, s.cfg.Interval))
	}
}

// ScrapeOnce scrapes every endpoint once, Concurrency at a time, and
// returns when all are done (or ctx is).
func (s *Scraper) ScrapeOnce(ctx context.Context) {
	s.round.Lock()
	defer s.round.Unlock()
	sem := make(chan struct{}, s.cfg.Concurrency)
	var wg sync.WaitGroup
	defer wg.Wait()
	for i, u := range s.urls {
		if u == "" {
			continue
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			s.scrape(ctx, i)
		}()
	}
}

// scrape reads endpoint i's page and records the outcome, unless ctx ended
// first (shutdown is not the endpoint's failure).
func (s *Scraper) scrape(ctx context.Context, i int) {
	load, err := s.fetch(ctx, s.urls[i], s.eps[i].Kind, s.eps[i].Header)
	if ctx.Err() != nil {
		return
	}
	r := &scrapeResult{err: err}
	if prev := s.states[i].Load(); prev != nil {
		r.load, r.at = prev.load, prev.at
	}
	if err == nil {
		r.load, r.at = load, s.now()
	}
	s.states[i].Store(r)
}

// fetch GETs one metrics page, with header's entries added, and parses it.
func (s *Scraper) fetch(ctx context.Context, u string, kind Kind, header http.Header) (Load, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return Load{}, fmt.Errorf("scrape %s: %w", u, err)
	}
	for k, vs := range header {
		req.Header[k] = vs // shared, never modified
	}
	// The text format: prometheus_client answers OpenMetrics only when asked.
	req.Header.Set("Accept", "text/plain;version=0.0.4;q=1,*/*;q=0.1")
	resp, err := s.cfg.Client.Do(req)
	if err != nil {
		return Load{}, fmt.Errorf("scrape %s: %w", u, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // keep the connection reusable
		if resp.StatusCode/100 == 3 {
			return Load{}, fmt.Errorf("scrape %s: status %d (redirects are not followed: the engine's credentials would go with them)", u, resp.StatusCode)
		}
		return Load{}, fmt.Errorf("scrape %s: status %d", u, resp.StatusCode)
	}
	body := &capReader{r: resp.Body, n: s.cfg.MaxBytes}
	load, err := ParseMetrics(kind, body)
	if body.over {
		return Load{}, fmt.Errorf("scrape %s: %w (limit %d bytes)", u, ErrTooLarge, s.cfg.MaxBytes)
	}
	if err != nil {
		return Load{}, fmt.Errorf("scrape %s: %w", u, err)
	}
	return load, nil
}

// capReader reads at most n bytes of r, then fails with ErrTooLarge if r
// has more.
type capReader struct {
	r    io.Reader
	n    int64
	over bool
}

func (c *capReader) Read(p []byte) (int, error) {
	if c.n <= 0 {
		// At the cap: one more byte decides between EOF and too large.
		var b [1]byte
		n, err := c.r.Read(b[:])
		if n > 0 {
			c.over = true
			return 0, ErrTooLarge
		}
		return 0, err
	}
	if int64(len(p)) > c.n {
		p = p[:c.n]
	}
	n, err := c.r.Read(p)
	c.n -= int64(n)
	return n, err
}

// Latest returns endpoint i's most recent Load and when it was read. ok is
// false, and the Load unknown, when there is none yet, the endpoint has no
// metrics page, or the Load is older than 3 intervals (stale: the last
// scrapes failed). A single failed scrape keeps the previous Load.
func (s *Scraper) Latest(i int) (load Load, at time.Time, ok bool) {
	return s.LatestAt(i, s.now())
}

// LatestAt is Latest judged at now (a caller reading many endpoints reads
// the clock once).
func (s *Scraper) LatestAt(i int, now time.Time) (load Load, at time.Time, ok bool) {
	if i < 0 || i >= len(s.states) {
		return UnknownLoad(), time.Time{}, false
	}
	r := s.states[i].Load()
	if r == nil || r.at.IsZero() {
		return UnknownLoad(), time.Time{}, false
	}
	if now.Sub(r.at) > staleIntervals*s.cfg.Interval {
		return UnknownLoad(), r.at, false
	}
	return r.load, r.at, true
}

// Err returns the error of endpoint i's latest scrape: nil after a success
// or before the first scrape, ErrNoMetrics (wrapped) for a kind without a
// metrics page.
func (s *Scraper) Err(i int) error {
	if i < 0 || i >= len(s.states) {
		return fmt.Errorf("scraper: no endpoint %d", i)
	}
	if r := s.states[i].Load(); r != nil {
		return r.err
	}
	return nil
}
