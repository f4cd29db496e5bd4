package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/simserver"
)

// renderEngine is a fake engine whose render and /tokenize answers the
// test scripts; every other path is a fakeEngine's.
type renderEngine struct {
	*fakeEngine
	srv    *httptest.Server
	mu     sync.Mutex
	answer func(w http.ResponseWriter, r *http.Request, body []byte)
	calls  []string // paths asked
	bodies [][]byte
	auth   []string
}

func newRenderEngine(t testing.TB, answer func(w http.ResponseWriter, r *http.Request, body []byte)) *renderEngine {
	t.Helper()
	e := &renderEngine{fakeEngine: newFakeEngine(t, "r"), answer: answer}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/chat/completions/render", "/v1/completions/render", "/tokenize":
			b, _ := io.ReadAll(r.Body)
			e.mu.Lock()
			e.calls, e.bodies, e.auth = append(e.calls, r.URL.Path), append(e.bodies, b), append(e.auth, r.Header.Get("Authorization"))
			answer := e.answer
			e.mu.Unlock()
			answer(w, r, b)
		default:
			e.fakeEngine.ServeHTTP(w, r)
		}
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *renderEngine) URL() string { return e.srv.URL }

func (e *renderEngine) asked() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.calls)
}

func renderConfig(engines ...*renderEngine) Config {
	cfg := Config{EjectDuration: 100 * time.Millisecond, HealthCheckInterval: 20 * time.Millisecond, HealthCheckTimeout: time.Second}
	cfg.Routing.Policy = sched.CacheAware
	for _, e := range engines {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: e.URL(), Model: "m", KVBlocks: 1000})
	}
	cfg.Render = map[string]string{"m": RenderEngine}
	// A bound, not a measurement: a loaded host must not turn a render
	// into a timeout (the stall test sets its own).
	cfg.RenderTimeout = 30 * time.Second
	return cfg
}

func chatExchange(t testing.TB, body string) *exchange {
	t.Helper()
	x := &exchange{body: []byte(body)}
	if err := openai.Decode(x.body, &x.chat); err != nil {
		t.Fatal(err)
	}
	return x
}

// waitReady waits until every endpoint of the model's pool is in rotation.
func waitReady(t testing.TB, g *Gateway, model string) *pool {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		p := g.state.Load().pools[model]
		all := true
		for _, ep := range p.endpoints {
			all = all && ep.ready.Load()
		}
		if all {
			return p
		}
		if time.Now().After(deadline) {
			t.Fatal("endpoints not ready in 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

const renderChat = `{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.5}`

// The ids of a render: engine pool are the engine's render answer (every
// form vLLM has answered), the body sent is the request's with the
// endpoint's credentials, and an identical request (other sampling
// parameters) is answered from the cache.
func TestEngineRenderIDs(t *testing.T) {
	e := newRenderEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		io.WriteString(w, `{"request_id":"chatcmpl-1","token_ids":[7,8,9],"features":null,"sampling_params":{"max_tokens":5,"stop":[]},"model":"m"}`)
	})
	cfg := renderConfig(e)
	cfg.Endpoints[0].APIKey = "sk-engine"
	g, url := startGateway(t, cfg)
	p := waitReady(t, g, "m")
	if !p.engineRender || p.renderTimeout != 30*time.Second {
		t.Fatalf("pool: engineRender %v, timeout %v", p.engineRender, p.renderTimeout)
	}
	ctx := context.Background()
	got, ok := g.engineTokens(ctx, nil, chatExchange(t, renderChat), kindChat, p)
	if !ok || !slices.Equal(got, []uint32{7, 8, 9}) {
		t.Fatalf("ids %v %v", got, ok)
	}
	e.mu.Lock()
	if e.calls[0] != "/v1/chat/completions/render" || string(e.bodies[0]) != renderChat || e.auth[0] != "Bearer sk-engine" {
		t.Errorf("asked %s with %s, auth %q", e.calls[0], e.bodies[0], e.auth[0])
	}
	e.mu.Unlock()
	// The same chat with other sampling: from the cache.
	got, ok = g.engineTokens(ctx, []uint32{1}, chatExchange(t, `{"model":"m","temperature":1,"stream":true,"messages":[{"role":"user","content":"hi"}],"max_tokens":3}`), kindChat, p)
	if !ok || !slices.Equal(got, []uint32{1, 7, 8, 9}) || len(e.asked()) != 1 {
		t.Fatalf("cached: %v %v after %d calls", got, ok, len(e.asked()))
	}
	// Another tool list is another prompt.
	if _, ok := g.engineTokens(ctx, nil, chatExchange(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[]}`), kindChat, p); !ok || len(e.asked()) != 2 {
		t.Fatalf("tools: %v, %d calls", ok, len(e.asked()))
	}
	// Completions: the first prompt of the list answer.
	e.mu.Lock()
	e.answer = func(w http.ResponseWriter, r *http.Request, _ []byte) {
		io.WriteString(w, `[{"request_id":"cmpl-1","token_ids":[1,2]},{"request_id":"cmpl-2","token_ids":[3]}]`)
	}
	e.mu.Unlock()
	x := &exchange{body: []byte(`{"model":"m","prompt":["a","b"]}`)}
	if err := openai.Decode(x.body, &x.comp); err != nil {
		t.Fatal(err)
	}
	if got, ok := g.engineTokens(ctx, nil, x, kindCompletion, p); !ok || !slices.Equal(got, []uint32{1, 2}) || e.asked()[2] != "/v1/completions/render" {
		t.Fatalf("completion: %v %v %v", got, ok, e.asked())
	}
	// Token-id prompts are not rendered.
	x = &exchange{body: []byte(`{"model":"m","prompt":[5,6]}`)}
	_ = openai.Decode(x.body, &x.comp)
	if _, ok := g.engineTokens(ctx, nil, x, kindCompletion, p); ok || len(e.asked()) != 3 {
		t.Fatal("a token-id prompt was rendered")
	}

	// Through the request path: the routed request's prompt tokens are the
	// engine's (in-flight accounting reads them).
	c := testClient(t)
	resp, b := post(t, c, url+pathChat, `{"model":"m","messages":[{"role":"user","content":"through the gateway"}],"max_tokens":2}`)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("chat: %d %s", resp.StatusCode, b)
	}
	m := scrape(t, c, url)
	if m.value("infergate_render_requests_total", `api="render",endpoint="`+e.URL()+`",model="m",result="ok"`) != 4 ||
		m.value("infergate_render_cache_lookups_total", `result="hit"`) != 1 ||
		m.value("infergate_pool_tokenizer", `model="m",tokenizer="engine_render"`) != 1 ||
		m.value("infergate_render_duration_seconds_count", `api="render"`) != 4 {
		t.Errorf("metrics:\n%s", strings.Join(m.grep("infergate_render"), "\n"))
	}
}

// An engine without render (FastAPI's 404) is asked /tokenize with the
// chat's render-relevant members, from then on; one serving neither is
// not asked again.
func TestEngineRenderTokenizeFallback(t *testing.T) {
	var tokenize atomic.Bool
	tokenize.Store(true)
	e := newRenderEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		if r.URL.Path == "/tokenize" && tokenize.Load() {
			io.WriteString(w, `{"count":2,"max_model_len":4096,"tokens":[40,41],"token_strs":null}`)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		io.WriteString(w, `{"detail":"Not Found"}`)
	})
	g, _ := startGateway(t, renderConfig(e))
	p := waitReady(t, g, "m")
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}],"add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":false},"max_tokens":9}`
	got, ok := g.engineTokens(context.Background(), nil, chatExchange(t, body), kindChat, p)
	if !ok || !slices.Equal(got, []uint32{40, 41}) {
		t.Fatalf("ids %v %v", got, ok)
	}
	e.mu.Lock()
	calls, sent := slices.Clone(e.calls), string(e.bodies[1])
	e.mu.Unlock()
	if !slices.Equal(calls, []string{"/v1/chat/completions/render", "/tokenize"}) {
		t.Fatalf("asked %v", calls)
	}
	var tb map[string]json.RawMessage
	if err := json.Unmarshal([]byte(sent), &tb); err != nil {
		t.Fatalf("tokenize body %s: %v", sent, err)
	}
	for k, want := range map[string]string{"model": `"m"`, "messages": `[{"role":"user","content":"hi"}]`, "tools": `[{"type":"function"}]`,
		"add_generation_prompt": `false`, "chat_template_kwargs": `{"enable_thinking":false}`} {
		if string(tb[k]) != want {
			t.Errorf("tokenize body %s: %s = %s, want %s", sent, k, tb[k], want)
		}
	}
	if _, has := tb["max_tokens"]; has {
		t.Errorf("tokenize body %s carries max_tokens", sent)
	}
	// The next request goes straight to /tokenize.
	if _, ok := g.engineTokens(context.Background(), nil, chatExchange(t, renderChat), kindChat, p); !ok || e.asked()[2] != "/tokenize" {
		t.Fatalf("second request: %v, asked %v", ok, e.asked())
	}
	// A completion: its prompt.
	x := &exchange{body: []byte(`{"model":"m","prompt":"a \"quoted\"\nline","add_special_tokens":false}`)}
	_ = openai.Decode(x.body, &x.comp)
	if _, ok := g.engineTokens(context.Background(), nil, x, kindCompletion, p); !ok {
		t.Fatal("completion through /tokenize")
	}
	e.mu.Lock()
	last := e.bodies[len(e.bodies)-1]
	e.mu.Unlock()
	var cb struct {
		Prompt  string `json:"prompt"`
		Special *bool  `json:"add_special_tokens"`
	}
	if json.Unmarshal(last, &cb) != nil || cb.Prompt != "a \"quoted\"\nline" || cb.Special == nil || *cb.Special {
		t.Fatalf("completion tokenize body %s", last)
	}
	// /tokenize gone too: a fallback, and the endpoint is not asked again.
	tokenize.Store(false)
	n := len(e.asked())
	if _, ok := g.engineTokens(context.Background(), nil, chatExchange(t, `{"model":"m","messages":[{"role":"user","content":"new"}]}`), kindChat, p); ok {
		t.Fatal("ids from an engine serving neither")
	}
	if _, ok := g.engineTokens(context.Background(), nil, chatExchange(t, `{"model":"m","messages":[{"role":"user","content":"newer"}]}`), kindChat, p); ok || len(e.asked()) != n+1 {
		t.Fatalf("asked %v after it served neither", e.asked()[n:])
	}
}

// A stalled engine costs one render_timeout, then backs off: the next
// requests fall back at once (no_endpoint) or go to another endpoint; an
// engine refusing the request (an OpenAI 4xx) is not penalised.
func TestEngineRenderStallAndBackoff(t *testing.T) {
	release := make(chan struct{})
	var stalled sync.WaitGroup
	slow := newRenderEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		stalled.Add(1)
		defer stalled.Done()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	defer func() { close(release); stalled.Wait() }()
	cfg := renderConfig(slow)
	cfg.RenderTimeout = 30 * time.Millisecond
	g, url := startGateway(t, cfg)
	g.render.backoff = time.Hour // no second call within the test, however slow the host
	p := waitReady(t, g, "m")
	ctx := context.Background()
	// A client that goes away mid-call costs the endpoint nothing.
	gone, leave := context.WithCancel(ctx)
	done := make(chan bool, 1)
	go func() {
		_, ok := g.engineTokens(gone, nil, chatExchange(t, `{"model":"m","messages":[{"role":"user","content":"gone"}]}`), kindChat, p)
		done <- ok
	}()
	for deadline := time.Now().Add(30 * time.Second); len(slow.asked()) == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the render call never reached the engine")
		}
	}
	leave()
	if <-done {
		t.Fatal("ids from a canceled call")
	}
	if h := g.render.healthOf(slow.URL()); h.until.Load() != 0 || h.fails.Load() != 0 {
		t.Fatal("a canceled call counted against the endpoint")
	}
	go func() {
		_, ok := g.engineTokens(ctx, nil, chatExchange(t, renderChat), kindChat, p)
		done <- ok
	}()
	select {
	case ok := <-done:
		if ok {
			t.Fatal("ids from a stalled engine")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("render call not bounded by render_timeout")
	}
	if _, ok := g.engineTokens(ctx, nil, chatExchange(t, `{"model":"m","messages":[{"role":"user","content":"x"}]}`), kindChat, p); ok || len(slow.asked()) != 2 {
		t.Fatalf("asked %d times: the stalled endpoint is backing off", len(slow.asked()))
	}
	// A request still routes (on the fallback tokens) while the engine
	// stalls its render.
	c := testClient(t)
	if resp, b := post(t, c, url+pathChat, `{"model":"m","messages":[{"role":"user","content":"still served"}],"max_tokens":2}`); resp.StatusCode != http.StatusOK {
		t.Fatalf("chat: %d %s", resp.StatusCode, b)
	}
	m := scrape(t, c, url)
	if m.value("infergate_render_fallbacks_total", `model="m",reason="timeout"`) != 1 ||
		m.value("infergate_render_fallbacks_total", `model="m",reason="no_endpoint"`) != 2 ||
		m.value("infergate_render_requests_total", `result="timeout"`) != 1 ||
		m.value("infergate_render_fallbacks_total", `model="m",reason="canceled"`) != 1 {
		t.Errorf("metrics:\n%s", strings.Join(m.grep("infergate_render"), "\n"))
	}

	// An OpenAI error is the engine refusing this request: no backoff.
	var n atomic.Int32
	refuse := newRenderEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
		n.Add(1)
		openai.WriteError(w, openai.NewError(http.StatusBadRequest, "too long", "", ""))
	})
	g2, _ := startGateway(t, renderConfig(refuse))
	p2 := waitReady(t, g2, "m")
	for i := range 3 {
		if _, ok := g2.engineTokens(ctx, nil, chatExchange(t, fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%d"}]}`, i)), kindChat, p2); ok {
			t.Fatal("ids from a refusal")
		}
	}
	if n.Load() != 3 {
		t.Fatalf("a refusing engine was asked %d times of 3", n.Load())
	}
	// Garbage answers are errors and back off.
	garbage := newRenderEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) { io.WriteString(w, `{"token_ids":[1,-2]}`) })
	g3, _ := startGateway(t, renderConfig(garbage))
	g3.render.backoff = time.Hour
	p3 := waitReady(t, g3, "m")
	for range 2 {
		if _, ok := g3.engineTokens(ctx, nil, chatExchange(t, renderChat), kindChat, p3); ok {
			t.Fatal("ids from a malformed answer")
		}
	}
	if len(garbage.asked()) != 1 {
		t.Fatalf("a malformed answer's engine was asked %d times", len(garbage.asked()))
	}
}

func TestRenderConfigErrors(t *testing.T) {
	e := newFakeEngine(t, "a")
	for _, tc := range []struct {
		render  map[string]string
		timeout time.Duration
		want    string
	}{
		{map[string]string{"m": "yes"}, 0, `render["m"]`},
		{map[string]string{"nope": RenderEngine}, 0, "no endpoint serves"},
		{map[string]string{"m": RenderEngine}, -time.Second, "render_timeout"},
	} {
		cfg := testConfig(sched.CacheAware, e)
		cfg.Render, cfg.RenderTimeout = tc.render, tc.timeout
		err := cfg.WithDefaults().Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v %v: %v, want %q", tc.render, tc.timeout, err, tc.want)
		}
	}
	for _, n := range []int{-1, maxRenderConcurrency + 1} {
		cfg := testConfig(sched.CacheAware, e)
		cfg.Render, cfg.RenderConcurrency = map[string]string{"m": RenderEngine}, n
		if err := cfg.WithDefaults().Validate(); err == nil || !strings.Contains(err.Error(), "render_concurrency") {
			t.Errorf("render_concurrency %d: %v", n, err)
		}
	}
	if n := (Config{}).WithDefaults().RenderConcurrency; n != DefaultRenderConcurrency {
		t.Errorf("render_concurrency defaults to %d", n)
	}
	cfg := testConfig(sched.CacheAware, e)
	cfg.Render = map[string]string{"m": RenderGateway}
	if err := cfg.WithDefaults().Validate(); err != nil {
		t.Fatal(err)
	}
	if d := cfg.WithDefaults().RenderTimeout; d != DefaultRenderTimeout {
		t.Fatalf("render_timeout defaults to %v", d)
	}
}

// TestEngineRenderPreciseOnSimFleet: a pool whose gateway tokenizer is not
// the engines' (a byte-level toy against the simulator's cl100k) routes
// precisely only through render: engine; with it the precise index's
// prediction of a chat's cached tokens is the engine's within a block.
func TestEngineRenderPreciseOnSimFleet(t *testing.T) {
	f, err := simserver.StartFleet(2, simserver.ServerConfig{Model: "m", TimeScale: 100, KVEvents: kvevents.PublisherConfig{Enable: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	pub, replay := f.KVEventEndpoints()
	cfg := Config{HealthCheckInterval: time.Second}
	cfg.Routing.Policy = sched.PrecisePrefix
	for i, u := range f.URLs {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: u, Model: "m", Kind: fleet.Sim,
			KVEvents: &KVEventsConfig{Endpoint: pub[i], ReplayEndpoint: replay[i]}})
	}
	cfg.Tokenizers = map[string]string{"m": byteLevelFolder(t)} // the fallback: not the engines' tokens
	cfg.Render = map[string]string{"m": RenderEngine}
	cfg.RenderTimeout = 30 * time.Second // a bound: a loaded host must not make it a fallback
	g, url := startGateway(t, cfg)
	waitReady(t, g, "m")
	c := testClient(t)
	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 40)
	var msgs []map[string]string
	msgs = append(msgs, map[string]string{"role": "system", "content": sys})
	ix := g.PreciseIndex("m")
	stored := func() (n int) {
		for e := range ix.Endpoints() {
			n += ix.Len(e, prefix.MediumGPU)
		}
		return n
	}
	var cachedSum int
	for turn := range 4 {
		msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("Question %d: tell me about rivers number %d.", turn, turn)})
		body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 8, "messages": msgs})
		before := stored()
		resp, b := post(t, c, url+pathChat, string(body))
		if resp.StatusCode != 200 {
			t.Fatalf("turn %d: %d %s", turn, resp.StatusCode, b)
		}
		var out struct {
			Choices []struct {
				Message struct {
					Content string `json:"content"`
				} `json:"message"`
			} `json:"choices"`
			Usage struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(b, &out); err != nil || len(out.Choices) == 0 {
			t.Fatalf("turn %d: %s", turn, b)
		}
		cachedSum += out.Usage.Details.Cached
		msgs = append(msgs, map[string]string{"role": "assistant", "content": out.Choices[0].Message.Content})
		// Wait for this turn's blocks to reach the index before the next.
		deadline := time.Now().Add(10 * time.Second)
		for stored() <= before {
			if time.Now().After(deadline) {
				t.Fatalf("turn %d: no KV event reached the precise index in 10s", turn)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	if cachedSum < 3*400 {
		t.Fatalf("turns 2–4 hit %d cached tokens in all: want each the ~480-token history", cachedSum)
	}
	m := scrape(t, c, url)
	n := m.value("infergate_prefix_prediction_error_tokens_count", `index="precise"`)
	mean := m.value("infergate_prefix_prediction_error_tokens_sum", `index="precise"`) / n
	t.Logf("precise prediction error over %v turns: mean %.1f tokens; render calls %v, fallbacks %v", n, mean,
		m.value("infergate_render_requests_total", `result="ok"`), m.value("infergate_render_fallbacks_total", ""))
	if n != 4 || mean > 16 {
		t.Errorf("precise prediction error: %v observations, mean %.1f tokens (want ≤ one block)", n, mean)
	}
	if m.value("infergate_render_fallbacks_total", "") != 0 || m.value("infergate_render_requests_total", `result="ok"`) != 4 {
		t.Errorf("metrics:\n%s", strings.Join(m.grep("infergate_render"), "\n"))
	}
}

// grep returns the lines of s that start with prefix.
func (s scraped) grep(prefix string) []string {
	var out []string
	for _, l := range s {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return out
}

// The render state of endpoints is bounded: past maxRenderHealth names
// (discovery churn) it starts over.
func TestRenderHealthBounded(t *testing.T) {
	var r engineRender
	first := r.healthOf("http://a")
	first.fails.Store(3)
	if r.healthOf("http://a") != first {
		t.Fatal("a second lookup made a new state")
	}
	for i := range maxRenderHealth {
		r.healthOf(fmt.Sprintf("http://10.0.%d.%d", i/256, i%256))
	}
	if n := r.healthN.Load(); n > maxRenderHealth {
		t.Fatalf("%d states kept", n)
	}
	if r.healthOf("http://a").fails.Load() != 0 {
		t.Fatal("the state was not cleared past the bound")
	}
}

// A render answered by a redirect (which the client does not follow) or
// another non-200 status below 400 is the endpoint's doing, not a refusal
// of the request: it backs off like an error instead of costing every
// request a round trip (before: counted as rejected, asked once per
// request).
func TestEngineRenderRedirectBacksOff(t *testing.T) {
	for _, status := range []int{http.StatusTemporaryRedirect, http.StatusMovedPermanently, http.StatusNoContent} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			var n atomic.Int32
			e := newRenderEngine(t, func(w http.ResponseWriter, r *http.Request, _ []byte) {
				n.Add(1)
				if status != http.StatusNoContent {
					w.Header().Set("Location", "http://127.0.0.1:1/elsewhere")
				}
				w.WriteHeader(status)
			})
			g, url := startGateway(t, renderConfig(e))
			g.render.backoff = time.Hour
			p := waitReady(t, g, "m")
			for i := range 3 {
				if _, ok := g.engineTokens(context.Background(), nil,
					chatExchange(t, fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"%d"}]}`, i)), kindChat, p); ok {
					t.Fatal("ids from a redirect")
				}
			}
			if n.Load() != 1 {
				t.Fatalf("an endpoint answering %d was asked %d times of 3: not backing off", status, n.Load())
			}
			m := scrape(t, testClient(t), url)
			if m.value("infergate_render_requests_total", `result="error"`) != 1 ||
				m.value("infergate_render_fallbacks_total", `model="m",reason="no_endpoint"`) != 2 {
				t.Errorf("metrics:\n%s", strings.Join(m.grep("infergate_render"), "\n"))
			}
		})
	}
}
