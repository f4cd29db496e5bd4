package gateway

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/internal/polltest"
)

// engineMode selects how a fakeEngine answers completions.
type engineMode int32

const (
	modeNormal     engineMode = iota
	modeMidFail               // stream two events, then drop the connection
	modeHang                  // stream one event, then wait for the request context to end
	modeDrop                  // close the connection before answering
	modeError400              // answer a vLLM-style JSON 400
	modeError500              // answer a plain-text 500
	modeNoDone                // end the stream cleanly but without [DONE]
	modeErrorEvent            // stream one token, then a vLLM error event and [DONE]
	modeReasoning             // stream reasoning deltas before content (chat)
)

// fakeEngine is a vLLM-compatible engine for tests: /health, /metrics with
// vllm:cache_config_info, and chat/text completions, streaming vLLM-style
// SSE with deterministic ids and contents.
type fakeEngine struct {
	name     string
	srv      *httptest.Server
	kvBlocks int // reported in /metrics if > 0
	mode     atomic.Int32
	down     atomic.Bool // /health answers 503
	requests atomic.Int64
	canceled chan struct{} // a hung request saw its context end
	// models is GET /v1/models's answer (nil: 404).
	models atomic.Pointer[string]

	mu         sync.Mutex
	lastHeader http.Header
	lastBody   []byte
}

func newFakeEngine(t testing.TB, name string) *fakeEngine {
	t.Helper()
	e := newEngineNoCleanup(t, name)
	t.Cleanup(e.srv.Close)
	return e
}

// newEngineNoCleanup starts an engine the caller closes.
func newEngineNoCleanup(_ testing.TB, name string) *fakeEngine {
	e := &fakeEngine{name: name, canceled: make(chan struct{}, 16)}
	e.srv = httptest.NewServer(e)
	return e
}

// newServerNoCleanup serves h on loopback; the caller closes it.
func newServerNoCleanup(h http.Handler) *httptest.Server { return httptest.NewServer(h) }

func (e *fakeEngine) URL() string { return e.srv.URL }

func (e *fakeEngine) last() (http.Header, []byte) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.lastHeader, e.lastBody
}

func (e *fakeEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/health":
		if e.down.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	case "/metrics":
		if e.kvBlocks == 0 {
			http.NotFound(w, r)
			return
		}
		fmt.Fprintf(w, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"+
			"# TYPE vllm:cache_config_info gauge\n"+
			"vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"%d\"} 1.0\n", e.kvBlocks)
	case "/v1/chat/completions", "/v1/completions":
		e.serveCompletion(w, r)
	case "/v1/models":
		if m := e.models.Load(); m != nil {
			io.WriteString(w, *m)
			return
		}
		http.NotFound(w, r)
	default:
		http.NotFound(w, r)
	}
}

func (e *fakeEngine) serveCompletion(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	e.mu.Lock()
	e.lastHeader, e.lastBody = r.Header.Clone(), body
	e.mu.Unlock()
	e.requests.Add(1)
	w.Header().Set("X-Engine", e.name)

	switch engineMode(e.mode.Load()) {
	case modeDrop:
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = conn.Close()
		}
		return
	case modeError400:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error":{"message":"This model's maximum context length is 8 tokens.","type":"BadRequestError","param":null,"code":400}}`)
		return
	case modeError500:
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, "Internal Server Error")
		return
	}

	var req struct {
		Model         string `json:"model"`
		Stream        bool   `json:"stream"`
		StreamOptions *struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	chat := r.URL.Path == "/v1/chat/completions"
	usage := `{"prompt_tokens":40,"completion_tokens":3,"total_tokens":43,"prompt_tokens_details":{"cached_tokens":32}}`
	pieces := []string{"Hel", "lo", " world"}

	w.Header().Set("X-Request-Id", r.Header.Get("X-Request-Id")) // as vLLM --enable-request-id-headers
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		if engineMode(e.mode.Load()) == modeMidFail {
			w.Header().Set("Content-Length", "500")
			_, _ = io.WriteString(w, `{"id":"chatcmpl-1",`)
			_ = http.NewResponseController(w).Flush()
			panic(http.ErrAbortHandler)
		}
		if chat {
			fmt.Fprintf(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"Hello world"},"logprobs":null,"finish_reason":"stop"}],"usage":%s}`, req.Model, usage)
		} else {
			fmt.Fprintf(w, `{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":%q,"choices":[{"index":0,"text":"Hello world","logprobs":null,"finish_reason":"stop"}],"usage":%s}`, req.Model, usage)
		}
		return
	}

	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	rc := http.NewResponseController(w)
	event := func(s string) {
		_, _ = io.WriteString(w, "data: "+s+"\n\n")
		_ = rc.Flush()
	}
	chunk := func(delta, finish string) string {
		fin := "null"
		if finish != "" {
			fin = `"` + finish + `"`
		}
		if chat {
			return fmt.Sprintf(`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":%q,"choices":[{"index":0,"delta":%s,"logprobs":null,"finish_reason":%s}]}`, req.Model, delta, fin)
		}
		return fmt.Sprintf(`{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":%q,"choices":[{"index":0,"text":%s,"logprobs":null,"finish_reason":%s}]}`, req.Model, delta, fin)
	}
	piece := func(p string) string {
		if chat {
			return fmt.Sprintf(`{"content":%q}`, p)
		}
		return fmt.Sprintf("%q", p)
	}

	if chat {
		event(chunk(`{"role":"assistant","content":""}`, ""))
	}
	if chat && engineMode(e.mode.Load()) == modeReasoning {
		event(chunk(`{"reasoning":"Thinking"}`, ""))
		event(chunk(`{"reasoning_content":" more"}`, ""))
	}
	for i, p := range pieces {
		switch engineMode(e.mode.Load()) {
		case modeErrorEvent:
			if i == 1 {
				event(`{"error":{"message":"engine died","type":"InternalServerError","param":null,"code":500}}`)
				_, _ = io.WriteString(w, "data: [DONE]\n\n")
				return
			}
		case modeMidFail:
			if i == 2 {
				panic(http.ErrAbortHandler) // drop the connection mid-stream
			}
		case modeHang:
			if i == 1 {
				<-r.Context().Done()
				e.canceled <- struct{}{}
				return
			}
		}
		event(chunk(piece(p), ""))
	}
	if chat {
		event(chunk(`{}`, "stop"))
	} else {
		event(chunk(`""`, "stop"))
	}
	if req.StreamOptions != nil && req.StreamOptions.IncludeUsage {
		if chat {
			event(fmt.Sprintf(`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":%q,"choices":[],"usage":%s}`, req.Model, usage))
		} else {
			event(fmt.Sprintf(`{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":%q,"choices":[],"usage":%s}`, req.Model, usage))
		}
	}
	if engineMode(e.mode.Load()) != modeNoDone {
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}
}

// testClient returns an HTTP client with its own transport, closed at the
// end of the test.
func testClient(t testing.TB) *http.Client {
	tr := &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// testConfig returns a configuration over engines serving model "m" with
// short health intervals.
func testConfig(policy string, engines ...*fakeEngine) Config {
	cfg := Config{
		EjectDuration:       100 * time.Millisecond,
		HealthCheckInterval: 20 * time.Millisecond,
		HealthCheckTimeout:  time.Second,
	}
	cfg.Routing.Policy = policy
	for _, e := range engines {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: e.URL(), Model: "m", KVBlocks: 1000})
	}
	return cfg
}

// startGateway builds a gateway for cfg and serves it on loopback.
func startGateway(t testing.TB, cfg Config) (*Gateway, string) {
	t.Helper()
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	srv := httptest.NewServer(g.Handler())
	t.Cleanup(func() {
		srv.Close()
		g.Close()
	})
	return g, srv.URL
}

// post sends body to url and returns the response with its body read.
func post(t testing.TB, c *http.Client, url, body string, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("POST %s: read body: %v", url, err)
	}
	return resp, b
}

// waitFor waits until cond holds (polltest.Until: a minute at most).
var waitFor = polltest.Until

// closedURL returns the URL of a loopback port nothing listens on.
func closedURL(t testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return "http://" + addr
}

// contextWithCancel returns a context canceled by cancel or at the end of
// the test.
func contextWithCancel(t testing.TB) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return ctx, cancel
}

// TestMain silences the gateway's warnings (ejections, failed streams are
// provoked on purpose); run with -v to see them.
func TestMain(m *testing.M) {
	flag.Parse()
	if !testing.Verbose() {
		slog.SetDefault(slog.New(slog.NewTextHandler(io.Discard, nil)))
	}
	os.Exit(m.Run())
}
