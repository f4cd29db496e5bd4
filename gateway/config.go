package gateway

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/internal/boundedfile"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
)

// Bounds of request bodies (bytes).
const (
	// MaxMaxBodyBytes is the largest max_body_bytes accepted (256 MiB): 5×
	// the 50 MB payload OpenAI's API documents for a request's image
	// inputs, 16× the default, and no more than the default
	// max_body_bytes_in_flight, so that one largest body fits it. Without
	// a bound a typo (16000000000) let every client hold gigabytes.
	MaxMaxBodyBytes = 256 << 20
	// DefaultMaxBodyBytesInFlight bounds the request bodies being read,
	// all requests together (256 MiB, as max_held_response_bytes): their
	// buffers then hold at most twice that (a buffer doubles as bytes
	// arrive; readBody). Measured with 96 clients that each sent 4 MiB of
	// a declared 16 MiB and stalled: without it 384 MiB of bodies held,
	// the heap 772 MiB over its start, until body_read_timeout; with it
	// 256 MiB held, +515 MiB of heap, 32 clients refused. 16 largest
	// default bodies (16 MiB) fit it at once, or 13,000 chat requests of
	// 20 KiB.
	DefaultMaxBodyBytesInFlight = 256 << 20
	// DefaultMaxBodyBytesHeld bounds the request bodies held by requests
	// in progress, from the end of their read to the request's end, all
	// together (1 GiB; bodybudget.go): 64 largest default bodies, or
	// 52,000 chat requests of 20 KiB — more than 1,024 requests in flight
	// and as many queued on each of 25 endpoints.
	DefaultMaxBodyBytesHeld = 1 << 30
)

// Defaults of Config and EndpointConfig (see README.md for the rationale).
const (
	DefaultListen                = "127.0.0.1:8080"
	DefaultMaxBodyBytes          = 16 << 20 // bytes
	DefaultBodyReadTimeout       = 30 * time.Second
	DefaultConnectTimeout        = 5 * time.Second
	DefaultResponseHeaderTimeout = 10 * time.Minute
	DefaultIdleConnTimeout       = 90 * time.Second
	DefaultMaxIdleConnsPerHost   = 1024
	DefaultEjectDuration         = 10 * time.Second
	DefaultHealthCheckInterval   = 5 * time.Second
	DefaultHealthCheckTimeout    = 2 * time.Second
	// DefaultHealthCheckAbortAfter is the consecutive failed probes after
	// which the requests waiting for an endpoint's response headers are
	// aborted and retried elsewhere (healthabort.go): two, so that one slow
	// probe of a busy engine (a garbage-collection pause, an event loop
	// late by a few seconds) aborts nothing, and a frozen engine's clients
	// wait about 2 × (5 s + 2 s) rather than response_header_timeout.
	DefaultHealthCheckAbortAfter = 2
	// DefaultShutdownGrace is how long requests in flight get to finish
	// after SIGTERM: 25 s, so that with the 2 s for the final writes the
	// shutdown ends within Kubernetes' default terminationGracePeriodSeconds
	// (30 s) before the kubelet's SIGKILL.
	DefaultShutdownGrace = 25 * time.Second
	// DefaultPolicy is the routing policy when the configuration names
	// none: sched.DefaultPolicy (cache-aware), as in bench and plan.
	// precise-prefix is opt-in even where endpoints publish KV events (the
	// gateway still subscribes to them then, for the precise index's
	// prediction-error metric).
	DefaultPolicy = sched.DefaultPolicy
	// DefaultScrapeInterval is the period of the engines' metrics scrape
	// (fleet.DefaultScrapeInterval's rationale: the gateway's own in-flight
	// accounting is exact, scraped queues only correct it).
	DefaultScrapeInterval = time.Second
	// DefaultModelsRefreshInterval is the period of the endpoints' GET
	// /v1/models read (LoRA adapters loaded or unloaded at run time,
	// vLLM's /v1/load_lora_adapter). Adapters change far less often than
	// load, which is scraped every second; an adapter loaded on an engine
	// is routed to within this period (and at once by a reload).
	DefaultModelsRefreshInterval = 10 * time.Second
	// DefaultKVBlocks is the KV capacity (blocks) assumed for an endpoint
	// whose kv_blocks is 0 and whose /metrics does not report
	// vllm:cache_config_info.
	DefaultKVBlocks = 65536
)

// Defaults of the upstream answer timeouts (README.md "Request lifecycle").
const (
	// DefaultFirstEventTimeout bounds a stream's wait for its first output
	// event: Envoy's stream_idle_timeout default (5 min), not nginx's 60 s
	// proxy_read_timeout, because the first token waits for the engine's
	// queue and the prefill of up to a whole context, which under load
	// take minutes (the Mooncake replay in README.md reaches a TTFT p99 of
	// 160 s under round-robin), and a retry elsewhere starts both over. It
	// is there to catch an engine that will never answer, not a slow one.
	DefaultFirstEventTimeout = 5 * time.Minute
	// DefaultStreamIdleTimeout bounds the silence of an answer once it has
	// begun: nginx's proxy_read_timeout default (60 s). A decoding engine
	// emits a token every few to a few hundred milliseconds (a preempted
	// request is rescheduled within seconds); a minute without one is a
	// stall.
	DefaultStreamIdleTimeout = time.Minute
)

// Config is the gateway's configuration (YAML; see README.md for every key).
// Zero values take the defaults of WithDefaults.
type Config struct {
	// Listen is the address the gateway serves on (default "127.0.0.1:8080").
	Listen string `yaml:"listen"`
	// Routing selects and tunes the scheduling policy, one instance per model
	// pool.
	Routing sched.Config `yaml:"routing"`
	// Endpoints are the engines behind the gateway.
	Endpoints []EndpointConfig `yaml:"endpoints"`
	// KVStores are the models' shared remote KV stores, by model
	// (KVStoreConfig): their events feed the model's precise index, and
	// routing prices hits in them.
	KVStores map[string]KVStoreConfig `yaml:"kv_stores"`
	// Tokenizers are the models' own tokenizers, by model: a Hugging Face
	// tokenizer.json, or a folder holding one and its tokenizer_config.json
	// (package hftokenizer). The model's prompts are then tokenized for
	// routing as its engines tokenize them (chats rendered with the
	// folder's chat_template), so the precise index matches the engines'
	// own tokens. A model without one is tokenized with cl100k_base (the
	// fallback, metric infergate_pool_tokenizer).
	Tokenizers map[string]string `yaml:"tokenizers"`
	// Render is, by model, who turns a prompt into the token ids routing
	// hashes: "gateway" (the default: the tokenizers entry, else
	// cl100k_base) or "engine": one of the pool's engines is asked
	// (vLLM's /v1/chat/completions/render and /v1/completions/render,
	// /tokenize for engines without them), its answers cached, the
	// gateway's own tokens the fallback when it fails (render.go).
	Render map[string]string `yaml:"render"`
	// RenderTimeout bounds one engine render call of a render: engine pool
	// (default 200ms); past it the request is routed on the gateway's own
	// tokens and the endpoint is not asked for a while.
	RenderTimeout time.Duration `yaml:"render_timeout"`
	// RenderConcurrency bounds, per render: engine pool, the render calls
	// in flight at once (0: DefaultRenderConcurrency, 64): each may hold an
	// answer of up to 16 MiB, so a pool's calls hold at most 1 GiB. A
	// request past it is routed on the gateway's own tokens at once
	// (fallback reason saturated).
	RenderConcurrency int `yaml:"render_concurrency"`
	// Aliases are model names served by configured models, each an ordered
	// fallback list (alias.go): `fast: [llama-8b, llama-70b]`.
	Aliases map[string][]string `yaml:"aliases"`
	// Adapters are LoRA adapters served on configured models, by base
	// model: `llama: [sql-lora, chat-lora]` (adapters.go). A request whose
	// model is an adapter goes to its base model's pool with the adapter
	// kept in the body; the engines that list it in GET /v1/models (or all
	// of the pool's, where that list is not read) are its candidates.
	// Adapters an engine lists with a `parent` are added to these without
	// configuration (models_refresh_interval).
	Adapters map[string][]string `yaml:"adapters"`
	// Responses configures the Responses API's session affinity
	// (responses.go).
	Responses ResponsesConfig `yaml:"responses"`
	// PD configures the hand-off of requests split between a prefill and a
	// decode endpoint, in pools whose endpoints have roles (pd.go; the
	// split decision is routing.pd's).
	PD PDConfig `yaml:"pd"`
	// MaxBodyBytes bounds a request body (bytes, default 16 MiB); larger
	// bodies get 413 request_too_large.
	MaxBodyBytes int64 `yaml:"max_body_bytes"`
	// MaxBodyBytesInFlight bounds the bytes of request bodies being read,
	// all requests together (bytes, default 256 MiB; at least
	// max_body_bytes). Bytes are charged as they arrive and given back
	// when the body is read or abandoned; a read that would take the
	// total past it is refused with 503 overloaded and Retry-After: 1
	// (bodybudget.go).
	MaxBodyBytesInFlight int64 `yaml:"max_body_bytes_in_flight"`
	// MaxBodyBytesHeld bounds the bytes of request bodies held by
	// requests in progress (read whole, not yet answered), all requests
	// together (bytes, default 1 GiB; at least max_body_bytes). A body
	// that would take the total past it is refused once read, before it is
	// decoded, with 503 overloaded and Retry-After: 1 (bodybudget.go).
	MaxBodyBytesHeld int64 `yaml:"max_body_bytes_held"`
	// MaxHeldResponseBytes bounds the bytes of non-streaming answers held
	// until their end (for retries and usage), all requests together
	// (default 256 MiB; negative: none is held). Beyond it an answer is
	// relayed as it arrives: not retry-safe, its usage not read.
	MaxHeldResponseBytes int64 `yaml:"max_held_response_bytes"`
	// BodyReadTimeout bounds reading one request body (default 30s), so a
	// client that sends headers and then trickles or stalls the body
	// (slowloris) cannot hold a connection; expiry answers 408.
	BodyReadTimeout time.Duration `yaml:"body_read_timeout"`

	// ConnectTimeout bounds dialing an endpoint, TLS handshake included
	// (default 5s).
	ConnectTimeout time.Duration `yaml:"connect_timeout"`
	// ResponseHeaderTimeout bounds the wait for an endpoint's response
	// headers after the request was sent (default 10m; engines send the
	// headers of a non-streaming completion only when it is done, so this
	// must exceed the longest generation). Expiry answers 504.
	ResponseHeaderTimeout time.Duration `yaml:"response_header_timeout"`
	// FirstEventTimeout bounds a streaming attempt's wait for its first
	// output-carrying event (the first token), from the request sent:
	// response headers, queueing and prefill included (default 5m). SSE
	// comments and events without output (a role chunk) do not end the
	// wait. Expiry fails the attempt as a timeout of the endpoint (outlier
	// detection), retried elsewhere since nothing reached the client; 504
	// upstream_timeout when it is not.
	FirstEventTimeout time.Duration `yaml:"first_event_timeout"`
	// StreamIdleTimeout bounds the engine's silence once an answer has
	// begun (default 1m): a stream's gap between output events (comments,
	// keep-alives and events without output do not count), and a
	// non-streaming body's gap between reads after its headers. Time the
	// gateway spends writing to the client is not counted. A stream that
	// stalls after its first output ends with an upstream_timeout error
	// event; a body that stalls before any byte reached the client is
	// retried.
	StreamIdleTimeout time.Duration `yaml:"stream_idle_timeout"`
	// IdleConnTimeout is how long an idle upstream connection is kept
	// (default 90s).
	IdleConnTimeout time.Duration `yaml:"idle_conn_timeout"`
	// MaxIdleConnsPerHost is the number of idle upstream connections kept per
	// endpoint (default 1024: many concurrent streams to few hosts).
	MaxIdleConnsPerHost int `yaml:"max_idle_conns_per_host"`

	// EjectDuration is how long an endpoint is taken out of rotation after a
	// connection failure (passive health; default 10s). After it, the next
	// successful health check restores the endpoint.
	EjectDuration time.Duration `yaml:"eject_duration"`
	// HealthCheckInterval is the period of the active health check of each
	// endpoint (default 5s).
	HealthCheckInterval time.Duration `yaml:"health_check_interval"`
	// HealthCheckTimeout bounds one health probe and the start-up /metrics
	// read of an endpoint (default 2s).
	HealthCheckTimeout time.Duration `yaml:"health_check_timeout"`
	// HealthCheckPath is the path probed with GET on every endpoint; a 2xx
	// answer means healthy. Empty (the default) uses each endpoint kind's own
	// path (fleet.Kind.Info: "/health" for vLLM, SGLang, llama.cpp, TGI and
	// sim; "/api/version" for Ollama). Set it to "-" to disable probing:
	// endpoints are then always healthy except during an ejection.
	HealthCheckPath string `yaml:"health_check_path"`
	// HealthCheckAbortAfter is how many consecutive failed probes abort the
	// attempts waiting for the endpoint's response headers, which are then
	// retried elsewhere (healthabort.go; default 2, negative: never). A
	// frozen engine's non-streaming clients otherwise wait the whole
	// response_header_timeout.
	HealthCheckAbortAfter int `yaml:"health_check_abort_after"`
	// ScrapeInterval is the period of the metrics scrape of the endpoints
	// whose kind has a metrics page (queue, KV utilisation, LoRA adapters
	// for the load scorers); default 1s, negative disables scraping.
	ScrapeInterval time.Duration `yaml:"scrape_interval"`
	// ModelsRefreshInterval is the period of each endpoint's GET
	// /v1/models read, which finds the LoRA adapters it serves and their
	// base model (`parent`; adapters.go); default 10s, negative disables
	// the reads after the one at start (and at a reload that adds the
	// endpoint).
	ModelsRefreshInterval time.Duration `yaml:"models_refresh_interval"`

	// Retry resends a request that failed before any byte reached the
	// client to another endpoint (resilience.go).
	Retry RetryConfig `yaml:"retry"`
	// Outlier is passive outlier detection: consecutive errors eject an
	// endpoint for a back-off that doubles per ejection.
	Outlier OutlierConfig `yaml:"outlier"`
	// CircuitBreaker bounds the requests in flight to one endpoint.
	CircuitBreaker CircuitBreakerConfig `yaml:"circuit_breaker"`
	// Admission bounds the requests in flight per model, queueing the
	// excess by priority (admission.go).
	Admission AdmissionConfig `yaml:"admission"`
	// ScaleFromZero holds requests while a pool has no ready endpoint,
	// per model ("*": every model without its own entry; coldstart.go,
	// README "Scale from zero"). Off by default.
	ScaleFromZero map[string]ScaleFromZeroConfig `yaml:"scale_from_zero"`

	// ShutdownGrace is how long requests in flight get to finish after the
	// server is told to stop (SIGTERM; default 25s) before they are ended
	// with an explicit error (Gateway.Abort). The gateway itself does not
	// use it: `infergate serve` and `up` do (shutdown.go, README "Shutdown").
	ShutdownGrace time.Duration `yaml:"shutdown_grace"`

	// EdgeConfig holds API keys, TLS, trusted proxies, header limits and
	// client timeouts (limits.go, auth.go, tls.go); its keys are top-level.
	EdgeConfig `yaml:",inline"`
	// ObservabilityConfig holds the log, access log, response headers and
	// tracing settings (observability.go); its keys are top-level.
	ObservabilityConfig `yaml:",inline"`
	// EPP is `infergate epp`'s ext_proc and health listeners (epp.go);
	// serve ignores it.
	EPP EPPConfig `yaml:"epp"`
	// Discovery adds the engines found through the Kubernetes API to
	// Endpoints (discovered.go); the gateway only validates it and keeps
	// its model's pool, `infergate serve` and `epp` watch.
	Discovery DiscoveryConfig `yaml:"discovery"`
	// Replicas is the exchange between gateway replicas behind one L4
	// balancer (replicas.go); off without redis_url.
	Replicas ReplicasConfig `yaml:"replicas"`
	// Autoscale is the per-pool scaling policy whose decisions and signals
	// the gateway exports (autoscale.go; off without a policy).
	Autoscale AutoscaleConfig `yaml:"autoscale"`
}

// EndpointConfig describes one engine.
type EndpointConfig struct {
	// URL is the engine's base URL, e.g. "http://127.0.0.1:8001" (http or
	// https; a path, if any, is prefixed to the request paths).
	URL string `yaml:"url"`
	// Model is the model name the engine serves (the request's "model").
	Model string `yaml:"model"`
	// KVBlocks is the engine's KV capacity in blocks of BlockSize tokens
	// (vLLM's num_gpu_blocks). 0 reads vllm:cache_config_info from the
	// endpoint's /metrics at start, falling back to DefaultKVBlocks.
	KVBlocks int `yaml:"kv_blocks"`
	// BlockSize is the engine's KV block size in tokens (default 16).
	BlockSize int `yaml:"block_size"`
	// Kind is the engine: vllm (default), sglang, llamacpp, ollama, tgi or
	// sim. It sets the health path, the metrics page and names read for
	// load (package fleet), and whether the gateway's own accounting is all
	// there is (ollama).
	Kind fleet.Kind `yaml:"kind"`
	// MaxModelLen is the engine's context length in tokens (prompt and
	// output; vLLM's --max-model-len). 0 reads it from the engine's
	// GET /v1/models at start (vLLM and sim report it), falling back to
	// DefaultMaxModelLen. A key's tokens_per_minute reserves it for a
	// request without max_tokens.
	MaxModelLen int `yaml:"max_model_len"`
	// MetricsURL overrides the metrics page URL (TGI's --prometheus-port,
	// llama.cpp router mode's /metrics?model=ID).
	MetricsURL string `yaml:"metrics_url"`
	// KVEvents subscribes to the engine's KV-cache events (vLLM
	// --kv-events-config publisher, docs/PROTOCOLS.md §1), which feed the
	// precise prefix index. nil: no subscription.
	KVEvents *KVEventsConfig `yaml:"kv_events"`

	// APIKey is the gateway's own credential for the engine (vLLM's
	// --api-key, a hosted OpenAI-compatible backend's key), sent with every
	// request the gateway makes to it: inference, health probes, metrics
	// scrapes and the start-up reads. It goes in APIKeyHeader. Inline keys
	// end up in files and backups: prefer APIKeyEnv. Never shown (Secret).
	APIKey Secret `yaml:"api_key"`
	// APIKeyEnv names the environment variable holding the key, read at
	// start (unset or empty: New fails) and at every reload (unset or
	// empty: the reload is refused). Exclusive with APIKey.
	APIKeyEnv string `yaml:"api_key_env"`
	// APIKeyHeader is the request header that carries the key: default
	// "Authorization", sent as "Bearer <key>"; any other name (Azure
	// OpenAI's "api-key", "x-api-key") carries the key as it is.
	APIKeyHeader string `yaml:"api_key_header"`
	// Headers are extra request headers sent to the engine with every
	// request (e.g. OpenAI-Organization, OpenAI-Project), replacing a
	// client's header of the same name. Hop-by-hop, framing and the
	// gateway's own headers are refused (credentials.go,
	// refusedEndpointHeader). Values are never shown (Secret).
	Headers map[string]Secret `yaml:"headers"`

	// Role is the endpoint's part in a P/D pool: prefill, decode or both
	// (the default). A model whose endpoints have roles is routed by
	// routing.pd's decisions and split across a prefill and a decode
	// endpoint by pd.connector (pd.go).
	Role string `yaml:"role"`
	// BootstrapPort is a prefill endpoint's KV bootstrap port (SGLang
	// --disaggregation-bootstrap-port, vLLM VLLM_MOONCAKE_BOOTSTRAP_PORT;
	// 0: disagg.DefaultBootstrapPort, 8998), for the sglang and mooncake
	// connectors.
	BootstrapPort int `yaml:"bootstrap_port"`
}

// KVEventsConfig locates an engine's KV-event publisher.
type KVEventsConfig struct {
	// Endpoint is the engine's ZeroMQ PUB address the gateway dials, e.g.
	// "tcp://10.0.0.7:5557" (vLLM's endpoint "tcp://*:5557", with its host).
	Endpoint string `yaml:"endpoint"`
	// ReplayEndpoint is the engine's ROUTER address for replaying missed
	// batches ("" when the engine has none: a gap then clears the
	// endpoint's entries in the index).
	ReplayEndpoint string `yaml:"replay_endpoint"`
	// Topic is the subscription prefix ("" = every topic).
	Topic string `yaml:"topic"`
	// MaxMessageBytes bounds one message from the publisher (0: kvevents'
	// DefaultMaxMessageBytes, 8 MiB); a peer announcing more is
	// disconnected before anything is allocated for it.
	MaxMessageBytes int `yaml:"max_message_bytes"`
	// OffloadBlocks is the engine's KV capacity in its lower tiers (CPU or
	// disk offloading; blocks of block_size), which its events may report
	// beside the GPU's kv_blocks: the precise index holds at most kv_blocks
	// + OffloadBlocks of the endpoint's blocks and evicts the rest.
	OffloadBlocks int `yaml:"offload_blocks"`
	// Tiers describes the engine's KV tiers below the GPU (its offloading
	// connector's CPU and disk tiers, its link to the pool's kv_store):
	// their capacities bound the precise index per medium, their load
	// costs price hits in them (sched/tiers.go). nil: the events' lower
	// media are held within offload_blocks and credited as GPU blocks.
	Tiers *KVTiersConfig `yaml:"tiers"`
}

// KVTiersConfig is an engine's KV tiers below the GPU (kv_events.tiers).
type KVTiersConfig struct {
	// BlockBytes is the KV size of one block of block_size tokens over all
	// TP ranks, in bytes (e.g. 5242880 for Llama-3.1-70B in bf16, 16
	// tokens): a load of n blocks from a tier takes n × block_bytes /
	// bandwidth + latency. Required when a tier has a bandwidth.
	BlockBytes float64 `yaml:"block_bytes"`
	// CPU and Disk are the host-memory and local-disk tiers (events of
	// medium CPU and DISK).
	CPU  *KVTierConfig `yaml:"cpu"`
	Disk *KVTierConfig `yaml:"disk"`
	// Remote is the engine's link to its pool's kv_store (medium REMOTE):
	// bandwidth and latency only, overriding the store's; the capacity is
	// the store's blocks.
	Remote *KVTierConfig `yaml:"remote"`
}

// KVTierConfig is one KV tier of an engine.
type KVTierConfig struct {
	// Blocks is the tier's capacity in blocks of block_size tokens (the
	// precise index's bound for the medium; 0: no tier).
	Blocks int `yaml:"blocks"`
	// Bandwidth is the rate of loads from the tier into the engine's GPUs,
	// bytes per second (host: PCIe over the TP ranks; 0: loads unpriced,
	// a hit there credited as a GPU hit).
	Bandwidth float64 `yaml:"bandwidth"`
	// Latency is the fixed cost of one load (e.g. 100us).
	Latency time.Duration `yaml:"latency"`
}

// blocks returns the tier's capacity (0 when nil).
func (c *KVTierConfig) blocks() int {
	if c == nil {
		return 0
	}
	return c.Blocks
}

// offloadBlocks is the engine's KV capacity below the GPU: the tiers'
// blocks, else offload_blocks.
func (k *KVEventsConfig) offloadBlocks() int {
	if k.Tiers != nil {
		if n := k.Tiers.CPU.blocks() + k.Tiers.Disk.blocks(); n > 0 {
			return n
		}
	}
	return k.OffloadBlocks
}

// KVStoreConfig is a model pool's shared remote KV store (kv_stores): its
// event stream, as infergate kvstore (or an LMCache remote with events)
// publishes it — BlockStored with medium REMOTE, token ids and parents —
// and its capacity and default load cost. Its blocks are held in the
// pool's precise index as one reserved slot (the index's last: 63 for a
// pool of at most 63 endpoints, else the last of its groups of 64), so a
// pool with a kv_store has at most prefix.MaxIndexEndpoints − 1
// endpoints.
type KVStoreConfig struct {
	// Endpoint is the store's ZeroMQ PUB address, tcp://host:port.
	Endpoint string `yaml:"endpoint"`
	// ReplayEndpoint is its replay ROUTER address ("" for none).
	ReplayEndpoint string `yaml:"replay_endpoint"`
	// Topic is the subscription prefix (kvstore's: kv@kvstore@<model>; ""
	// = every topic).
	Topic string `yaml:"topic"`
	// MaxMessageBytes bounds one message (0: kvevents' default).
	MaxMessageBytes int `yaml:"max_message_bytes"`
	// Blocks is the store's capacity in blocks of the routing block size
	// (required): the index's bound for the store's slot.
	Blocks int `yaml:"blocks"`
	// BlockBytes, Bandwidth and Latency are the load cost of a block from
	// the store into an engine, for the endpoints whose kv_events.tiers
	// do not set their own (block_bytes, remote.bandwidth/latency).
	BlockBytes float64       `yaml:"block_bytes"`
	Bandwidth  float64       `yaml:"bandwidth"`
	Latency    time.Duration `yaml:"latency"`
}

// stream is the subscription the store's feed makes.
func (c KVStoreConfig) stream() KVEventsConfig {
	return KVEventsConfig{Endpoint: c.Endpoint, ReplayEndpoint: c.ReplayEndpoint, Topic: c.Topic, MaxMessageBytes: c.MaxMessageBytes}
}

// MaxConfigBytes bounds a configuration file (bytes): LoadConfig reads at
// most this much and refuses a larger file (one replaced by a link to
// /dev/zero was read without end, at start or at a SIGHUP reload).
const MaxConfigBytes = 16 << 20

// LoadConfig reads a YAML configuration file (at most MaxConfigBytes). Unknown keys are an error;
// deprecated ones are logged as warnings (sched.Config.Deprecated). The
// result is not defaulted or validated; New does both.
func LoadConfig(path string) (Config, error) {
	data, err := boundedfile.Read(path, MaxConfigBytes)
	if err != nil {
		return Config{}, fmt.Errorf("load gateway config: %w", err)
	}
	var c Config
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil && !errors.Is(err, io.EOF) {
		return Config{}, fmt.Errorf("load gateway config %s: %w", path, err)
	}
	for _, w := range c.Routing.Deprecated() {
		slog.Warn("gateway config " + path + ": " + w)
	}
	for _, w := range c.pdWarnings() {
		slog.Warn("gateway config " + path + ": " + w)
	}
	return c, nil
}

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Listen == "" {
		c.Listen = DefaultListen
	}
	if c.RenderTimeout == 0 {
		c.RenderTimeout = DefaultRenderTimeout
	}
	if c.RenderConcurrency == 0 {
		c.RenderConcurrency = DefaultRenderConcurrency
	}
	if c.Routing.Policy == "" {
		c.Routing.Policy = DefaultPolicy
	}
	c.Routing.Prefix = c.Routing.Prefix.WithDefaults()
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.MaxBodyBytesInFlight == 0 {
		c.MaxBodyBytesInFlight = DefaultMaxBodyBytesInFlight
	}
	if c.MaxBodyBytesHeld == 0 {
		c.MaxBodyBytesHeld = DefaultMaxBodyBytesHeld
	}
	if c.BodyReadTimeout == 0 {
		c.BodyReadTimeout = DefaultBodyReadTimeout
	}
	if c.MaxHeldResponseBytes == 0 {
		c.MaxHeldResponseBytes = DefaultMaxHeldResponseBytes
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = DefaultConnectTimeout
	}
	if c.ResponseHeaderTimeout == 0 {
		c.ResponseHeaderTimeout = DefaultResponseHeaderTimeout
	}
	if c.FirstEventTimeout == 0 {
		c.FirstEventTimeout = DefaultFirstEventTimeout
	}
	if c.StreamIdleTimeout == 0 {
		c.StreamIdleTimeout = DefaultStreamIdleTimeout
	}
	if c.IdleConnTimeout == 0 {
		c.IdleConnTimeout = DefaultIdleConnTimeout
	}
	if c.MaxIdleConnsPerHost == 0 {
		c.MaxIdleConnsPerHost = DefaultMaxIdleConnsPerHost
	}
	if c.EjectDuration == 0 {
		c.EjectDuration = DefaultEjectDuration
	}
	if c.HealthCheckInterval == 0 {
		c.HealthCheckInterval = DefaultHealthCheckInterval
	}
	if c.HealthCheckTimeout == 0 {
		c.HealthCheckTimeout = DefaultHealthCheckTimeout
	}
	if c.HealthCheckAbortAfter == 0 {
		c.HealthCheckAbortAfter = DefaultHealthCheckAbortAfter
	}
	if c.ModelsRefreshInterval == 0 {
		c.ModelsRefreshInterval = DefaultModelsRefreshInterval
	}
	if c.ScrapeInterval == 0 {
		c.ScrapeInterval = DefaultScrapeInterval
	}
	if c.ShutdownGrace == 0 {
		c.ShutdownGrace = DefaultShutdownGrace
	}
	c.Retry, c.Outlier = c.Retry.withDefaults(), c.Outlier.withDefaults()
	c.CircuitBreaker, c.Admission = c.CircuitBreaker.withDefaults(), c.Admission.withDefaults()
	c.EdgeConfig = c.EdgeConfig.withDefaults()
	c.Responses = c.Responses.withDefaults()
	c.PD = c.PD.withDefaults(c.FirstEventTimeout)
	c.ObservabilityConfig = c.ObservabilityConfig.withDefaults()
	c.Replicas = c.Replicas.withDefaults()
	eps := make([]EndpointConfig, len(c.Endpoints))
	for i, e := range c.Endpoints {
		if e.BlockSize == 0 {
			e.BlockSize = prefix.DefaultBlockSize
		}
		if e.Kind == "" {
			e.Kind = fleet.VLLM
		}
		eps[i] = e
	}
	c.Endpoints = eps
	return c
}

// Validate reports every invalid setting of a defaulted configuration.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		bad("listen %q: %v", c.Listen, err)
	}
	if err := sched.Validate(c.Routing); err != nil {
		bad("routing: %w", err)
	}
	if c.MaxBodyBytes <= 0 || c.MaxBodyBytes > MaxMaxBodyBytes {
		bad("max_body_bytes %d: must be positive and at most %d (256 MiB)", c.MaxBodyBytes, MaxMaxBodyBytes)
	}
	if c.MaxBodyBytesInFlight < c.MaxBodyBytes {
		bad("max_body_bytes_in_flight %d: must be at least max_body_bytes (%d), or one largest body can never be read",
			c.MaxBodyBytesInFlight, c.MaxBodyBytes)
	}
	if c.MaxBodyBytesHeld < c.MaxBodyBytes {
		bad("max_body_bytes_held %d: must be at least max_body_bytes (%d), or one largest body can never be served",
			c.MaxBodyBytesHeld, c.MaxBodyBytes)
	}
	if err := c.EPP.Validate(); err != nil {
		errs = append(errs, err)
	}
	for _, d := range []struct {
		key string
		v   time.Duration
	}{
		{"connect_timeout", c.ConnectTimeout},
		{"response_header_timeout", c.ResponseHeaderTimeout},
		{"first_event_timeout", c.FirstEventTimeout},
		{"stream_idle_timeout", c.StreamIdleTimeout},
		{"idle_conn_timeout", c.IdleConnTimeout},
		{"eject_duration", c.EjectDuration},
		{"health_check_interval", c.HealthCheckInterval},
		{"health_check_timeout", c.HealthCheckTimeout},
		{"shutdown_grace", c.ShutdownGrace},
	} {
		if d.v <= 0 {
			bad("%s %v: must be positive", d.key, d.v)
		}
	}
	if c.MaxIdleConnsPerHost < 0 {
		bad("max_idle_conns_per_host %d: must be >= 0", c.MaxIdleConnsPerHost)
	}
	errs = append(errs, c.validateResilience()...)
	errs = append(errs, c.validateScaleFromZero()...)
	errs = append(errs, c.EdgeConfig.validate()...)
	errs = append(errs, c.ObservabilityConfig.validate()...)
	if c.HealthCheckPath != "" && c.HealthCheckPath != healthCheckOff && !strings.HasPrefix(c.HealthCheckPath, "/") {
		bad("health_check_path %q: must start with / (or be %q to disable probing, or empty for each kind's own path)", c.HealthCheckPath, healthCheckOff)
	}

	if k := c.Discovery.Kubernetes; k != nil {
		errs = append(errs, k.validate(c)...)
	} else if len(c.Endpoints) == 0 {
		bad("endpoints: at least one endpoint is required (or discovery.kubernetes)")
	}
	errs = append(errs, c.validateAliases()...)
	errs = append(errs, c.validateAdapters()...)
	errs = append(errs, c.Responses.validate()...)
	errs = append(errs, c.validateEndpoints()...)
	errs = append(errs, c.validateKVStores()...)
	errs = append(errs, c.validateTokenizers()...)
	errs = append(errs, c.validateRender()...)
	errs = append(errs, c.validatePD()...)
	errs = append(errs, c.Replicas.validate()...)
	errs = append(errs, c.Autoscale.validate()...)
	if len(errs) > 0 {
		return fmt.Errorf("invalid gateway config: %w", errors.Join(errs...))
	}
	return nil
}

// validateEndpoints checks every entry of Endpoints (EndpointConfig.validate)
// and what the entries must agree on: no URL twice for a model, one URL's
// entries with the same KV shape and credentials, at most slotLimit
// endpoints per model for a policy with per-endpoint state.
func (c Config) validateEndpoints() []error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	type shape struct{ kvBlocks, blockSize int }
	byURL := map[string]shape{}
	firstOf := map[string]EndpointConfig{} // the first entry of each URL
	seen := map[[2]string]bool{}
	perModel := map[string]int{}
	for i, e := range c.Endpoints {
		at := fmt.Sprintf("endpoints[%d]", i)
		base, err := normalizeURL(e.URL)
		if err != nil {
			bad("%s.url: %w", at, err)
			continue
		}
		errs = append(errs, e.validate(at, c.Routing)...)
		key := [2]string{base, e.Model}
		if seen[key] {
			bad("%s: duplicate endpoint %s for model %q", at, base, e.Model)
		}
		seen[key] = true
		perModel[e.Model]++
		s := shape{e.KVBlocks, e.BlockSize}
		if prev, ok := byURL[base]; ok && prev != s {
			bad("%s: endpoint %s is listed again with different kv_blocks/block_size", at, base)
		}
		byURL[base] = s
		if first, ok := firstOf[base]; !ok {
			firstOf[base] = e
		} else if !sameCredentials(first, e) {
			bad("%s: endpoint %s is listed again with different api_key, api_key_env, api_key_header or headers", at, base)
		}
	}
	if limit, stateful := slotLimit(c.Routing); stateful {
		for m, n := range perModel {
			if n > limit {
				bad("model %q: %d endpoints, the %s policy supports at most %d per model", m, n, c.Routing.Policy, limit)
			}
		}
	}
	return errs
}

// slotLimit is the most endpoints a pool of routing's policy may have and
// whether the policy keeps per-endpoint state (slots; reslotted): any
// stateful policy (the approximate or the precise index, both in groups of
// 64 up to prefix.MaxIndexEndpoints; a session table; the peers' own
// indexes), prefix.MaxIndexEndpoints (a kv_store takes one more slot of
// the precise index: validateKVStores); round-robin, least-request and
// random keep none (any number; reslotted renumbers their slots past
// prefix.MaxEndpoints).
func slotLimit(routing sched.Config) (int, bool) {
	if routing.Policy == sched.RoundRobin || routing.Policy == sched.LeastRequest || routing.Policy == sched.Random {
		return prefix.MaxEndpoints, false
	}
	return prefix.MaxIndexEndpoints, true
}

// validate checks one entry of Endpoints, at (its path in errors), for the
// routing in force; its URL has been checked.
func (e EndpointConfig) validate(at string, routing sched.Config) []error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if e.Model == "" {
		bad("%s.model: required", at)
	}
	if e.KVBlocks < 0 {
		bad("%s.kv_blocks %d: must be >= 0", at, e.KVBlocks)
	}
	if e.BlockSize < 1 {
		bad("%s.block_size %d: must be at least 1", at, e.BlockSize)
	}
	if e.MaxModelLen < 0 || e.MaxModelLen > maxModelLenLimit {
		bad("%s.max_model_len %d: want 0 (discover) to %d", at, e.MaxModelLen, maxModelLenLimit)
	}
	if !e.Kind.Valid() {
		bad("%s.kind %q: want one of %v", at, e.Kind, fleet.Kinds())
	}
	if e.MetricsURL != "" {
		if _, err := normalizeURL(e.MetricsURL); err != nil {
			bad("%s.metrics_url: %w", at, err)
		}
	}
	if _, err := endpointHeader(e, os.LookupEnv); err != nil {
		bad("%s: %w", at, err)
	}
	if kv := e.KVEvents; kv != nil {
		for _, a := range []struct{ key, v string }{{"endpoint", kv.Endpoint}, {"replay_endpoint", kv.ReplayEndpoint}} {
			if (a.v != "" || a.key == "endpoint") && !strings.HasPrefix(a.v, "tcp://") {
				bad("%s.kv_events.%s %q: want tcp://host:port", at, a.key, a.v)
			}
		}
		if kv.MaxMessageBytes < 0 {
			bad("%s.kv_events.max_message_bytes %d: must be >= 0", at, kv.MaxMessageBytes)
		}
		if kv.OffloadBlocks < 0 || kv.OffloadBlocks > maxTierBlocks {
			bad("%s.kv_events.offload_blocks %d: must be in [0, %d]", at, kv.OffloadBlocks, maxTierBlocks)
		}
		if t := kv.Tiers; t != nil {
			errs = append(errs, t.validate(at+".kv_events.tiers", kv.OffloadBlocks)...)
		}
		if e.BlockSize != routing.Prefix.BlockSize {
			bad("%s.kv_events: the engine's block_size %d must equal routing.prefix.block_size %d for the precise index",
				at, e.BlockSize, routing.Prefix.BlockSize)
		}
	} else if sched.UsesPrecise(routing) {
		bad("%s: routing policy %q needs kv_events on every endpoint", at, routing.Policy)
	}
	return errs
}

// maxTierBlocks bounds a tier's or a store's blocks in the configuration
// (2^40: 5 EiB of the 70B default's 5 MiB blocks), so that sums of them
// cannot overflow.
const maxTierBlocks = 1 << 40

// validate checks an endpoint's kv_events.tiers, at (its path in
// errors), against its offload_blocks.
func (t *KVTiersConfig) validate(at string, offload int) []error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if t.BlockBytes < 0 || t.BlockBytes != t.BlockBytes || math.IsInf(t.BlockBytes, 0) {
		bad("%s.block_bytes %g: must be >= 0 and finite", at, t.BlockBytes)
	}
	for _, tc := range []struct {
		name string
		c    *KVTierConfig
	}{{"cpu", t.CPU}, {"disk", t.Disk}, {"remote", t.Remote}} {
		c := tc.c
		if c == nil {
			continue
		}
		switch {
		case c.Blocks < 0 || c.Blocks > maxTierBlocks:
			bad("%s.%s.blocks %d: must be in [0, %d]", at, tc.name, c.Blocks, maxTierBlocks)
		case tc.name == "remote" && c.Blocks != 0:
			bad("%s.remote.blocks %d: the remote tier's capacity is its kv_stores entry's blocks", at, c.Blocks)
		}
		if !(c.Bandwidth >= 0) || math.IsInf(c.Bandwidth, 0) {
			bad("%s.%s.bandwidth %g: must be >= 0 bytes/s", at, tc.name, c.Bandwidth)
		} else if c.Bandwidth > 0 && !(t.BlockBytes > 0) {
			bad("%s.block_bytes: required to price %s loads (bandwidth %g)", at, tc.name, c.Bandwidth)
		} else if c.Bandwidth > 0 && math.IsInf(t.BlockBytes/c.Bandwidth, 0) {
			bad("%s.%s: block_bytes / bandwidth (%g / %g) is not a finite load time", at, tc.name, t.BlockBytes, c.Bandwidth)
		}
		if c.Latency < 0 {
			bad("%s.%s.latency %v: must be >= 0", at, tc.name, c.Latency)
		}
	}
	if n := t.CPU.blocks() + t.Disk.blocks(); offload != 0 && n != 0 && offload != n {
		bad("%s: cpu.blocks + disk.blocks = %d contradicts offload_blocks %d (set one, or both alike)", at, n, offload)
	}
	return errs
}

// validateTokenizers checks tokenizers: each names a model of the
// endpoints and a path (the file is read when the pool is built).
func (c Config) validateTokenizers() []error {
	var errs []error
	perModel := map[string]int{}
	for _, e := range c.Endpoints {
		perModel[e.Model]++
	}
	for _, model := range slices.Sorted(maps.Keys(c.Tokenizers)) {
		at := fmt.Sprintf("tokenizers[%q]", model)
		switch {
		case perModel[model] == 0 && model != c.discoveredModel():
			errs = append(errs, fmt.Errorf("%s: no endpoint serves the model", at))
		case c.Tokenizers[model] == "":
			errs = append(errs, fmt.Errorf("%s: want a tokenizer.json or a folder holding one", at))
		}
	}
	return errs
}

// validateRender checks render, render_timeout and render_concurrency:
// each render entry names a model of the endpoints and a known mode.
func (c Config) validateRender() []error {
	var errs []error
	perModel := map[string]int{}
	for _, e := range c.Endpoints {
		perModel[e.Model]++
	}
	for _, model := range slices.Sorted(maps.Keys(c.Render)) {
		at := fmt.Sprintf("render[%q]", model)
		switch v := c.Render[model]; {
		case perModel[model] == 0 && model != c.discoveredModel():
			errs = append(errs, fmt.Errorf("%s: no endpoint serves the model", at))
		case v != RenderEngine && v != RenderGateway:
			errs = append(errs, fmt.Errorf("%s: %q: want %q or %q", at, v, RenderEngine, RenderGateway))
		}
	}
	if c.RenderTimeout < 0 {
		errs = append(errs, fmt.Errorf("render_timeout %v: must be >= 0", c.RenderTimeout))
	}
	if c.RenderConcurrency < 0 || c.RenderConcurrency > maxRenderConcurrency {
		errs = append(errs, fmt.Errorf("render_concurrency %d: must be in [0, %d] (0: the default, %d)",
			c.RenderConcurrency, maxRenderConcurrency, DefaultRenderConcurrency))
	}
	return errs
}

// validateKVStores checks kv_stores: each names a model of the endpoints,
// all of whose endpoints publish KV events, at most
// prefix.MaxIndexEndpoints − 1 of them (the store takes the last slot of
// the precise index).
func (c Config) validateKVStores() []error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	perModel, withEvents := map[string]int{}, map[string]int{}
	for _, e := range c.Endpoints {
		perModel[e.Model]++
		if e.KVEvents != nil {
			withEvents[e.Model]++
		}
	}
	for _, model := range slices.Sorted(maps.Keys(c.KVStores)) {
		s, at := c.KVStores[model], fmt.Sprintf("kv_stores[%q]", model)
		switch n := perModel[model]; {
		case n == 0 && model == c.discoveredModel():
			// engines yet to be discovered
		case n == 0:
			bad("%s: no endpoint serves the model", at)
		case withEvents[model] != n:
			bad("%s: needs kv_events on every endpoint of the model (the store's blocks go to its precise index)", at)
		case n > prefix.MaxIndexEndpoints-1:
			bad("%s: the model has %d endpoints; with a kv_store at most %d (the store takes a slot of the precise index)", at, n, prefix.MaxIndexEndpoints-1)
		}
		for _, a := range []struct{ key, v string }{{"endpoint", s.Endpoint}, {"replay_endpoint", s.ReplayEndpoint}} {
			if (a.v != "" || a.key == "endpoint") && !strings.HasPrefix(a.v, "tcp://") {
				bad("%s.%s %q: want tcp://host:port", at, a.key, a.v)
			}
		}
		if s.MaxMessageBytes < 0 {
			bad("%s.max_message_bytes %d: must be >= 0", at, s.MaxMessageBytes)
		}
		if s.Blocks < 1 || s.Blocks > maxTierBlocks {
			bad("%s.blocks %d: the store's capacity in blocks is required, in [1, %d]", at, s.Blocks, maxTierBlocks)
		}
		if !(s.BlockBytes >= 0) || math.IsInf(s.BlockBytes, 0) || !(s.Bandwidth >= 0) || math.IsInf(s.Bandwidth, 0) || s.Latency < 0 {
			bad("%s: block_bytes, bandwidth and latency must be >= 0 and finite", at)
		} else if s.Bandwidth > 0 && math.IsInf(s.BlockBytes/s.Bandwidth, 0) {
			bad("%s: block_bytes / bandwidth (%g / %g) is not a finite load time", at, s.BlockBytes, s.Bandwidth)
		}
	}
	return errs
}

// healthCheckOff is the HealthCheckPath value that disables probing.
const healthCheckOff = "-"

// normalizeURL validates an endpoint base URL and returns it without a
// trailing slash.
func normalizeURL(raw string) (string, error) {
	if raw == "" {
		return "", errors.New("required")
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "", err
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return "", fmt.Errorf("%q: scheme must be http or https", raw)
	case u.Host == "":
		return "", fmt.Errorf("%q: no host", raw)
	case u.User != nil:
		return "", fmt.Errorf("%q: credentials in the URL are not supported", raw)
	case u.RawQuery != "" || u.Fragment != "":
		return "", fmt.Errorf("%q: must not have a query or fragment", raw)
	}
	return strings.TrimRight(u.Scheme+"://"+u.Host+u.EscapedPath(), "/"), nil
}
