package fleet

import (
	"fmt"
	"strings"
)

// Kind is an engine implementation: what the gateway may expect from an
// endpoint's health check, metrics page and OpenAI responses.
type Kind string

// The engine kinds the gateway knows. Sim is infergate's own simulator
// (package sim), which speaks vLLM's protocol and metric names.
const (
	VLLM     Kind = "vllm"
	SGLang   Kind = "sglang"
	LlamaCpp Kind = "llamacpp"
	Ollama   Kind = "ollama"
	TGI      Kind = "tgi"
	Sim      Kind = "sim"
)

// kinds lists the kinds in the order Kinds returns them.
var kinds = [...]Kind{VLLM, SGLang, LlamaCpp, Ollama, TGI, Sim}

// aliases maps the other spellings ParseKind accepts (lower case) to kinds.
var aliases = map[string]Kind{
	"llama.cpp":                 LlamaCpp,
	"llama-cpp":                 LlamaCpp,
	"llama_cpp":                 LlamaCpp,
	"llama-server":              LlamaCpp,
	"text-generation-inference": TGI,
}

// Kinds returns every known kind, in a fixed order.
func Kinds() []Kind { return append([]Kind(nil), kinds[:]...) }

// ParseKind returns the kind named s, ignoring case and surrounding blanks.
// Besides the kind names it accepts "llama.cpp", "llama-cpp", "llama_cpp"
// and "llama-server" for LlamaCpp and "text-generation-inference" for TGI.
func ParseKind(s string) (Kind, error) {
	name := strings.ToLower(strings.TrimSpace(s))
	for _, k := range kinds {
		if name == string(k) {
			return k, nil
		}
	}
	if k, ok := aliases[name]; ok {
		return k, nil
	}
	names := make([]string, len(kinds))
	for i, k := range kinds {
		names[i] = string(k)
	}
	return "", fmt.Errorf("unknown engine kind %q (want one of %s)", s, strings.Join(names, ", "))
}

// String returns the kind's name.
func (k Kind) String() string { return string(k) }

// Valid reports whether k is a known kind.
func (k Kind) Valid() bool {
	_, ok := infos[k]
	return ok
}

// UnmarshalText parses a kind with ParseKind, so a Kind can be read from
// YAML or JSON configuration.
func (k *Kind) UnmarshalText(b []byte) error {
	v, err := ParseKind(string(b))
	if err != nil {
		return err
	}
	*k = v
	return nil
}

// Signals is a set of load signals an engine's metrics page carries.
type Signals uint8

// The load signals ParseMetrics can read (the fields of Load they fill).
const (
	// SignalQueue: requests waiting and running (Load.Waiting, Load.Running).
	SignalQueue Signals = 1 << iota
	// SignalKVUtil: KV-cache utilization (Load.KVUtil).
	SignalKVUtil
	// SignalCacheConfig: KV block size and capacity (Load.BlockSize, Load.NumBlocks).
	SignalCacheConfig
	// SignalPrefixCounters: prefix-cache queried and hit tokens
	// (Load.PrefixQueries, Load.PrefixHits).
	SignalPrefixCounters
	// SignalLoRA: adapters running and waiting (Load.LoRA).
	SignalLoRA

	// allSignals is every signal a scheduler can use.
	allSignals = SignalQueue | SignalKVUtil | SignalCacheConfig | SignalPrefixCounters | SignalLoRA
)

// Has reports whether s includes every signal in x.
func (s Signals) Has(x Signals) bool { return s&x == x }

// Info is the static description of a kind. What it says of engine
// behaviour comes from the sources cited in infos and in README.md; entries
// marked UNCERTAIN there depend on the engine's version.
type Info struct {
	// Name is the engine's usual name, for logs and tables.
	Name string
	// MetricsPath is the path of the engine's Prometheus text page, "" when
	// it has none.
	MetricsPath string
	// HealthPath is the path the gateway probes with GET; a 2xx answer means
	// ready.
	HealthPath string
	// Signals are the load signals the metrics page carries (in the engine
	// versions we know; a page may lack some, and Load says which it had).
	Signals Signals
	// CachedTokens is where an OpenAI-compatible response reports the prompt
	// tokens served from the engine's prefix cache, as a JSON path; "" when
	// it does not report them.
	CachedTokens string
	// CachedTokensNote qualifies CachedTokens: the flag it needs, versions.
	CachedTokensNote string
	// OwnAccounting is true when the engine exposes no load signal at all,
	// so the gateway's own in-flight accounting is all it has.
	OwnAccounting bool
}

// Missing returns the load signals the engine does not report, which the
// gateway must estimate itself (in-flight counts for the queue, its prefix
// index for the cache) or do without.
func (in Info) Missing() Signals { return allSignals &^ in.Signals }

// usageCached is the OpenAI usage field that carries cached prompt tokens.
const usageCached = "usage.prompt_tokens_details.cached_tokens"

// vllmInfo is shared by VLLM and Sim.
var vllmInfo = Info{
	Name: "vLLM",
	// Sources: vllm/entrypoints/openai/api_server.py (GET /health, the
	// prometheus_client /metrics mount); docs/PROTOCOLS.md §2.1.
	MetricsPath: "/metrics",
	HealthPath:  "/health",
	Signals:     SignalQueue | SignalKVUtil | SignalCacheConfig | SignalPrefixCounters | SignalLoRA,
	// vLLM's OpenAI server adds prompt_tokens_details only when started with
	// --enable-prompt-tokens-details (default off); a stream carries usage
	// only with stream_options.include_usage.
	CachedTokens:     usageCached,
	CachedTokensNote: "only with --enable-prompt-tokens-details",
}

// infos describes each kind.
var infos = map[Kind]Info{
	VLLM: vllmInfo,
	Sim: func() Info {
		in := vllmInfo
		in.Name = "infergate sim"
		// simserver/server.go usage(): always reported (simserver/metrics.go exports
		// the vLLM names above; simserver/server.go serves GET /health).
		in.CachedTokensNote = "always reported"
		return in
	}(),
	SGLang: {
		Name: "SGLang",
		// Sources: sglang/srt/entrypoints/http_server.py (GET /health;
		// /health_generate also runs a one-token generation); metrics only
		// with --enable-metrics (docs/PROTOCOLS.md §2.3; metrics collector in
		// python/sglang/srt/.../metrics_collector.py).
		MetricsPath: "/metrics",
		HealthPath:  "/health",
		Signals:     SignalQueue | SignalKVUtil | SignalCacheConfig | SignalPrefixCounters,
		// SGLang's OpenAI adapter fills prompt_tokens_details.cached_tokens
		// when started with --enable-cache-report.
		CachedTokens:     usageCached,
		CachedTokensNote: "only with --enable-cache-report",
	},
	LlamaCpp: {
		Name: "llama.cpp",
		// Sources: ggml-org/llama.cpp tools/server/README.md (GET /health:
		// 503 while the model loads, 200 {"status":"ok"} after; /metrics
		// only with --metrics); docs/PROTOCOLS.md §2.5. In router mode (several
		// models) /metrics needs ?model=<id>: set Endpoint.MetricsURL.
		MetricsPath: "/metrics",
		HealthPath:  "/health",
		// KV utilization only from older builds (llamacpp:kv_cache_usage_ratio),
		// prefix counters only from newer ones (prompt_tokens_cached_total);
		// no paged blocks, no LoRA metric.
		Signals: SignalQueue | SignalKVUtil | SignalPrefixCounters,
		// tools/server server-task.cpp usage_json_oaicompat() writes
		// prompt_tokens_details.cached_tokens (n_prompt_tokens_cache), and
		// responses carry the non-standard timings.cache_n. Which build
		// introduced them is UNCERTAIN; older builds report neither in the
		// OpenAI routes (the native /completion has tokens_cached).
		CachedTokens:     usageCached,
		CachedTokensNote: "recent builds; also timings.cache_n; older builds: none (UNCERTAIN since which build)",
	},
	Ollama: {
		Name: "Ollama",
		// Sources: ollama docs/api.md (GET /api/version; GET / answers
		// "Ollama is running"); no Prometheus endpoint (docs/PROTOCOLS.md §2.6:
		// issue #3144, PR #18508 unmerged as of Sep 2026, UNCERTAIN later).
		MetricsPath:   "",
		HealthPath:    "/api/version",
		Signals:       0,
		OwnAccounting: true,
		// The OpenAI-compatible usage has prompt_tokens and
		// completion_tokens only.
		CachedTokensNote: "not reported",
	},
	TGI: {
		Name: "TGI",
		// Sources: huggingface/text-generation-inference router (GET /health,
		// GET /metrics), docs/source/reference/metrics.md; docs/PROTOCOLS.md §2.4.
		// Newer launchers also take --prometheus-port (UNCERTAIN whether the
		// main port still serves /metrics there): set Endpoint.MetricsURL.
		MetricsPath: "/metrics",
		HealthPath:  "/health",
		Signals:     SignalQueue, // no KV utilization, block config, prefix or LoRA metric
		// The OpenAI-compatible usage has prompt, completion and total
		// tokens only.
		CachedTokensNote: "not reported",
	},
}

// Info returns the kind's description; the zero Info for an unknown kind.
func (k Kind) Info() Info { return infos[k] }
