package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/infergate/infergate/sched"
)

// The endpoint's own key and a client's key, in every test below.
const (
	engineKey = "sk-engine-5ecret-0123456789"
	clientKey = "sk-client-0123456789abcdef"
)

// keyedEngine is a fakeEngine behind vLLM's --api-key check (simserver/auth.go
// mirrors it: every /v1 path needs "Authorization: Bearer <key>", else 401
// {"error":"Unauthorized"}; /health and /metrics open unless guardAll),
// recording the headers each path received.
type keyedEngine struct {
	*fakeEngine
	key      string
	guardAll bool         // /health and /metrics need the key too (a hosted backend behind a proxy)
	refused  atomic.Int64 // requests answered 401

	mu   sync.Mutex
	seen map[string][]http.Header // by path
}

func newKeyedEngine(t *testing.T, name, key string) *keyedEngine {
	k := &keyedEngine{fakeEngine: &fakeEngine{name: name, canceled: make(chan struct{}, 16)}, key: key, seen: map[string][]http.Header{}}
	k.srv = httptest.NewServer(k)
	t.Cleanup(k.srv.Close)
	return k
}

func (k *keyedEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	k.mu.Lock()
	k.seen[r.URL.Path] = append(k.seen[r.URL.Path], r.Header.Clone())
	k.mu.Unlock()
	if (k.guardAll || strings.HasPrefix(r.URL.Path, "/v1")) && r.Header.Get("Authorization") != "Bearer "+k.key {
		k.refused.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusUnauthorized)
		_, _ = io.WriteString(w, `{"error":"Unauthorized"}`)
		return
	}
	if r.URL.Path == pathModels {
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","max_model_len":4096}]}`)
		return
	}
	k.fakeEngine.ServeHTTP(w, r)
}

// headers returns the headers path received, in order.
func (k *keyedEngine) headers(path string) []http.Header {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]http.Header(nil), k.seen[path]...)
}

func TestSecretNeverShown(t *testing.T) {
	ec := EndpointConfig{URL: "http://e:8000", Model: "m", APIKey: engineKey,
		Headers: map[string]Secret{"OpenAI-Organization": "org-5ecret"}}
	cfg := Config{Endpoints: []EndpointConfig{ec}}
	var shown []string
	for _, f := range []string{"%v", "%+v", "%#v", "%s", "%q", "%x", "%X", "%10s"} {
		shown = append(shown, fmt.Sprintf(f, cfg), fmt.Sprintf(f, ec), fmt.Sprintf(f, ec.APIKey))
	}
	js, _ := json.Marshal(cfg)
	ys, _ := yaml.Marshal(cfg)
	var logs bytes.Buffer
	slog.New(slog.NewTextHandler(&logs, nil)).Info("config", "cfg", cfg, "ep", ec, "key", ec.APIKey)
	slog.New(slog.NewJSONHandler(&logs, nil)).Info("config", "cfg", cfg, "ep", ec, "key", ec.APIKey)
	shown = append(shown, string(js), string(ys), logs.String())
	for _, s := range shown {
		if strings.Contains(s, "5ecret") || strings.Contains(s, "35656372") || strings.Contains(s, "35454352") {
			t.Fatalf("a secret is shown: %s", s)
		}
	}
	if !strings.Contains(string(ys), redacted) || !strings.Contains(fmt.Sprintf("%+v", ec), redacted) {
		t.Errorf("no %s in the dumps:\n%s\n%+v", redacted, ys, ec)
	}
	if fmt.Sprint(Secret("")) != "" {
		t.Error("an empty Secret shows something")
	}
	// Decoding keeps the value: YAML in, the key reaches the engine.
	var back EndpointConfig
	if err := yaml.Unmarshal([]byte("api_key: "+engineKey+"\nheaders: {api-key: k2}\n"), &back); err != nil || string(back.APIKey) != engineKey ||
		string(back.Headers["api-key"]) != "k2" {
		t.Fatalf("decoded %v (%q) err %v", back, string(back.APIKey), err)
	}
}

func TestEndpointHeaderRules(t *testing.T) {
	env := map[string]string{"ENGINE_KEY": engineKey, "EMPTY": "", "NEWLINE": engineKey + "\n"}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	type hdrs = map[string]Secret
	for _, tc := range []struct {
		name string
		ec   EndpointConfig
		want http.Header // nil with err
		err  string      // substring of the error
	}{
		{"none", EndpointConfig{}, nil, ""},
		{"inline key", EndpointConfig{APIKey: engineKey}, http.Header{"Authorization": {"Bearer " + engineKey}}, ""},
		{"key from env", EndpointConfig{APIKeyEnv: "ENGINE_KEY"}, http.Header{"Authorization": {"Bearer " + engineKey}}, ""},
		{"azure header", EndpointConfig{APIKeyEnv: "ENGINE_KEY", APIKeyHeader: "api-key"}, http.Header{"Api-Key": {engineKey}}, ""},
		{"extra headers", EndpointConfig{APIKey: engineKey, Headers: hdrs{"openai-organization": "org-1", "X-Tenant": "a b"}},
			http.Header{"Authorization": {"Bearer " + engineKey}, "Openai-Organization": {"org-1"}, "X-Tenant": {"a b"}}, ""},
		{"authorization without key", EndpointConfig{Headers: hdrs{"Authorization": "Basic dXNlcjpwdw=="}},
			http.Header{"Authorization": {"Basic dXNlcjpwdw=="}}, ""},
		{"env unset", EndpointConfig{APIKeyEnv: "NOT_SET"}, nil, "NOT_SET is not set"},
		{"env empty", EndpointConfig{APIKeyEnv: "EMPTY"}, nil, "EMPTY is empty"},
		{"env trailing newline", EndpointConfig{APIKeyEnv: "NEWLINE"}, nil, "ends with whitespace or a newline"},
		{"bad env name", EndpointConfig{APIKeyEnv: "A-B"}, nil, "not an environment variable name"},
		{"both", EndpointConfig{APIKey: engineKey, APIKeyEnv: "ENGINE_KEY"}, nil, "both set"},
		{"header without key", EndpointConfig{APIKeyHeader: "api-key"}, nil, "without api_key"},
		{"key header twice", EndpointConfig{APIKey: engineKey, Headers: hdrs{"authorization": "x"}}, nil, "also set by api_key"},
		{"case duplicate", EndpointConfig{Headers: hdrs{"X-A": "1", "x-a": "2"}}, nil, "given twice"},
		{"not a token", EndpointConfig{Headers: hdrs{"X A": "1"}}, nil, "not a header name"},
		{"pseudo header", EndpointConfig{Headers: hdrs{":authority": "x"}}, nil, "not a header name"},
		{"empty name", EndpointConfig{Headers: hdrs{"": "x"}}, nil, "not a header name"},
		{"CRLF injection", EndpointConfig{Headers: hdrs{"X-A": "1\r\nX-Infergate-Attempts: 9"}}, nil, "control character"},
		{"NUL", EndpointConfig{Headers: hdrs{"X-A": "a\x00b"}}, nil, "control character"},
		{"empty value", EndpointConfig{Headers: hdrs{"X-A": ""}}, nil, "empty"},
		{"leading space", EndpointConfig{Headers: hdrs{"X-A": " a"}}, nil, "begins with whitespace"},
		{"key with newline", EndpointConfig{APIKey: "k\nHost: evil"}, nil, "control character"},
		{"api_key_header refused", EndpointConfig{APIKey: engineKey, APIKeyHeader: "Host"}, nil, "may not carry the key"},
		{"too many", EndpointConfig{Headers: func() hdrs {
			h := hdrs{}
			for i := range maxEndpointHeaders + 1 {
				h[fmt.Sprintf("X-H%d", i)] = "v"
			}
			return h
		}()}, nil, "at most"},
		{"too large", EndpointConfig{APIKey: Secret(strings.Repeat("k", maxEndpointHeaderBytes))}, nil, "bytes, at most"},
	} {
		h, err := endpointHeader(tc.ec, lookup)
		switch {
		case tc.err == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%s: error %v, want one saying %q", tc.name, err, tc.err)
		case tc.err == "" && fmt.Sprint(h) != fmt.Sprint(tc.want):
			t.Errorf("%s: header %v, want %v", tc.name, h, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), "5ecret") {
			t.Errorf("%s: the error shows the key: %v", tc.name, err)
		}
	}
	// Every name the gateway governs is refused, in any case.
	for _, name := range []string{"connection", "Keep-Alive", "Proxy-Authorization", "TE", "Trailer", "Transfer-Encoding", "Upgrade",
		"host", "Content-Length", "content-type", "Content-Encoding", "Accept-Encoding", "Expect", "x-request-id",
		"X-Forwarded-For", "X-Forwarded-Proto", "Forwarded", "X-Real-IP", "X-Infergate-Attempts", "x-priority",
		"traceparent", "Tracestate"} {
		if _, err := endpointHeader(EndpointConfig{Headers: hdrs{name: "v"}}, lookup); err == nil || !strings.Contains(err.Error(), "may not be configured") {
			t.Errorf("header %q accepted (%v)", name, err)
		}
	}
}

func TestEndpointCredentialsValidated(t *testing.T) {
	t.Setenv("INFERGATE_TEST_ENGINE_KEY", engineKey)
	e := newFakeEngine(t, "e0")
	cfg := testConfig(sched.RoundRobin, e)
	cfg.Endpoints[0].APIKeyEnv = "INFERGATE_TEST_MISSING_KEY"
	_, err := New(context.Background(), cfg, nil)
	if err == nil || !strings.Contains(err.Error(), "endpoints[0]: api_key_env: the environment variable INFERGATE_TEST_MISSING_KEY is not set") {
		t.Fatalf("New with a missing key variable: %v", err)
	}
	// One engine listed under two models must have one set of credentials.
	cfg.Endpoints = []EndpointConfig{{URL: e.URL(), Model: "m", APIKeyEnv: "INFERGATE_TEST_ENGINE_KEY"},
		{URL: e.URL(), Model: "lora", APIKey: engineKey}}
	if _, err := New(context.Background(), cfg, nil); err == nil || !strings.Contains(err.Error(), "listed again with different api_key") || strings.Contains(err.Error(), "5ecret") {
		t.Fatalf("New with two credentials for one engine: %v", err)
	}
}

// TestEngineCredentials: with the gateway authenticating clients, the
// engine sees the endpoint's key and headers on every call the gateway
// makes (inference, health, metrics, the start-up model list), never a
// client's credentials; open, the same.
func TestEngineCredentials(t *testing.T) {
	for _, withAuth := range []bool{true, false} {
		t.Run(fmt.Sprintf("gateway-auth=%v", withAuth), func(t *testing.T) {
			t.Setenv("INFERGATE_TEST_ENGINE_KEY", engineKey)
			k := newKeyedEngine(t, "e0", engineKey)
			k.kvBlocks = 1000
			k.guardAll = true // so the probe and the reads fail without the key
			cfg := testConfig(sched.RoundRobin)
			cfg.Endpoints = []EndpointConfig{{URL: k.URL(), Model: "m", APIKeyEnv: "INFERGATE_TEST_ENGINE_KEY",
				Headers: map[string]Secret{"OpenAI-Organization": "org-gateway", "X-Tenant": "t1"}}}
			if withAuth {
				if err := cfg.Auth.AddKeys("alice plain:"+clientKey, "test"); err != nil {
					t.Fatal(err)
				}
			}
			g, url := startGateway(t, cfg)
			c := testClient(t)
			waitFor(t, "endpoint ready", func() bool { return g.state.Load().endpoints[0].ready.Load() })
			for _, stream := range []bool{false, true} {
				resp, b := post(t, c, url+pathChat, map[bool]string{false: chatBody, true: streamBody(true)}[stream],
					"Authorization", "Bearer "+clientKey, "X-Api-Key", clientKey, "Api-Key", clientKey, "Cookie", "s="+clientKey,
					"OpenAI-Organization", "org-client", "Proxy-Authorization", "Basic "+clientKey)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("stream %v: %d %s", stream, resp.StatusCode, b)
				}
			}
			if g.Config().Endpoints[0].MaxModelLen != 4096 {
				t.Errorf("max_model_len %d: GET /v1/models was not read with the key", g.Config().Endpoints[0].MaxModelLen)
			}
			if g.Config().Endpoints[0].KVBlocks != 1000 {
				t.Errorf("kv_blocks %d: /metrics was not read with the key", g.Config().Endpoints[0].KVBlocks)
			}
			waitFor(t, "a metrics scrape", func() bool { return len(k.headers("/metrics")) >= 2 })
			for _, path := range []string{pathChat, "/health", "/metrics", pathModels} {
				hs := k.headers(path)
				if len(hs) == 0 {
					t.Errorf("%s: never called", path)
				}
				for _, h := range hs {
					if h.Get("Authorization") != "Bearer "+engineKey || h.Get("Openai-Organization") != "org-gateway" ||
						h.Get("X-Tenant") != "t1" || len(h["Openai-Organization"]) != 1 {
						t.Errorf("%s: engine got %v", path, h)
					}
					for name, vs := range h {
						if strings.Contains(strings.Join(vs, " "), clientKey) {
							t.Errorf("%s: the client's credential reached the engine in %s", path, name)
						}
					}
				}
			}
			if n := k.refused.Load(); n != 0 {
				t.Errorf("%d engine calls refused", n)
			}
		})
	}
}

// TestClientAuthorizationNeverForwarded: without an endpoint key, the
// client's credentials are dropped all the same, open gateway or not.
func TestClientAuthorizationNeverForwarded(t *testing.T) {
	e := newFakeEngine(t, "e0")
	_, url := startGateway(t, testConfig(sched.RoundRobin, e))
	resp, b := post(t, testClient(t), url+pathChat, chatBody, "Authorization", "Bearer "+clientKey, "X-Api-Key", clientKey)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	h, _ := e.last()
	if _, ok := h["Authorization"]; ok || h.Get("X-Api-Key") != "" {
		t.Fatalf("the engine got the client's credentials: %v", h)
	}
}

// TestEngineAuthRefusal: an engine that refuses the gateway's key (401) is
// the operator's error: the request is retried on an endpoint with the
// right key, the refusing one ejected at once and counted, and when no
// endpoint is left the client gets 502 upstream_auth, never the engine's
// 401 (which an OpenAI SDK reads as "your API key is wrong").
func TestEngineAuthRefusal(t *testing.T) {
	lc := &logCapture{}
	prev := slog.Default()
	slog.SetDefault(slog.New(lc))
	t.Cleanup(func() { slog.SetDefault(prev) })

	good := newKeyedEngine(t, "good", engineKey)
	bad := newKeyedEngine(t, "bad", engineKey)
	cfg := testConfig(sched.RoundRobin)
	cfg.EjectDuration = time.Hour // stays out for the test
	cfg.Outlier.MaxEjectionTime = time.Hour
	cfg.Endpoints = []EndpointConfig{{URL: bad.URL(), Model: "m", KVBlocks: 1000, MaxModelLen: 4096, APIKey: "sk-wrong-5ecret"},
		{URL: good.URL(), Model: "m", KVBlocks: 1000, MaxModelLen: 4096, APIKey: engineKey}}
	if err := cfg.Auth.AddKeys("alice plain:"+clientKey, "test"); err != nil {
		t.Fatal(err)
	}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	waitFor(t, "both ready", func() bool {
		return g.state.Load().endpoints[0].ready.Load() && g.state.Load().endpoints[1].ready.Load()
	})
	for i := range 4 {
		resp, b := post(t, c, url+pathChat, chatBody, "Authorization", "Bearer "+clientKey)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
	}
	if n := bad.refused.Load(); n != 1 {
		t.Errorf("the refusing engine got %d requests, want 1 (ejected at its first 401)", n)
	}
	if g.state.Load().endpoints[0].ready.Load() {
		t.Error("the refusing endpoint is still in rotation")
	}
	m := scrape(t, c, url)
	for _, want := range []struct {
		name, sel string
		v         float64
	}{
		{"infergate_endpoint_ejections_total", `reason="auth"`, 1},
		{"infergate_retries_total", `reason="auth"`, 1},
		{"infergate_endpoint_auth_failures_total", `source="request"`, 1},
		{"infergate_requests_total", `code="200"`, 4},
	} {
		if got := m.value(want.name, want.sel); got != want.v {
			t.Errorf("%s{%s} = %v, want %v", want.name, want.sel, got, want.v)
		}
	}

	// Only refusing endpoints: 502 upstream_auth, as many times as asked,
	// logged once.
	g2, url2 := startGateway(t, Config{EjectDuration: time.Millisecond, HealthCheckInterval: time.Hour, HealthCheckTimeout: time.Second,
		Routing:   sched.Config{Policy: sched.RoundRobin},
		Endpoints: []EndpointConfig{{URL: bad.URL(), Model: "m", KVBlocks: 1000, MaxModelLen: 4096, APIKey: "sk-wrong-5ecret"}}})
	for i := range 3 {
		g2.state.Load().endpoints[0].ejectedUntil.Store(0)
		g2.state.Load().endpoints[0].setReady(true) // back, as a health probe (open /health) would put it
		resp, b := post(t, c, url2+pathChat, streamBody(false))
		e := decodeError(t, b)
		if resp.StatusCode != http.StatusBadGateway || e.Code != codeUpstreamAuth || e.Type != "server_error" ||
			strings.Contains(string(b), "Unauthorized") || !strings.Contains(e.Message, "not your API key") {
			t.Fatalf("request %d: %d %s, want 502 upstream_auth", i, resp.StatusCode, b)
		}
	}
	lc.mu.Lock()
	logs := lc.buf.String()
	lc.mu.Unlock()
	if n := strings.Count(logs, "refused the gateway's credentials"); n != 2 { // one per gateway
		t.Errorf("refusals logged %d times, want 2 (once per run of refusals):\n%s", n, logs)
	}
	if strings.Contains(logs, "5ecret") || strings.Contains(logs, engineKey) || strings.Contains(logs, clientKey) {
		t.Errorf("a key is logged:\n%s", logs)
	}
}

// TestHealthProbeAuthRefusal: a probe answered 401 (a backend whose health
// path needs the key too) takes the endpoint out of rotation and says why,
// once; the start-up model read's 401 ejects it before any request.
func TestHealthProbeAuthRefusal(t *testing.T) {
	lc := &logCapture{}
	prev := slog.Default()
	slog.SetDefault(slog.New(lc))
	t.Cleanup(func() { slog.SetDefault(prev) })

	k := newKeyedEngine(t, "e0", engineKey)
	k.guardAll = true
	cfg := testConfig(sched.RoundRobin)
	cfg.Endpoints = []EndpointConfig{{URL: k.URL(), Model: "m", KVBlocks: 1000, APIKey: "sk-wrong-5ecret"}}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	waitFor(t, "several probes", func() bool { return len(k.headers("/health")) >= 4 })
	if g.state.Load().endpoints[0].ready.Load() {
		t.Fatal("an endpoint whose probe gets 401 is in rotation")
	}
	m := scrape(t, c, url)
	if m.value("infergate_endpoint_auth_failures_total", `source="health"`) < 3 ||
		m.value("infergate_endpoint_auth_failures_total", `source="discover"`) != 1 ||
		m.value("infergate_endpoint_ejections_total", `reason="auth"`) != 1 {
		t.Errorf("metrics:\n%s", strings.Join(m, "\n"))
	}
	resp, b := post(t, c, url+pathChat, chatBody)
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("%d %s, want 503 no endpoint", resp.StatusCode, b)
	}
	lc.mu.Lock()
	logs := lc.buf.String()
	lc.mu.Unlock()
	if n := strings.Count(logs, "failed its health check"); n != 1 || !strings.Contains(logs, "status 401: the engine refused the gateway's credentials") {
		t.Errorf("want the probe's refusal logged once with its reason:\n%s", logs)
	}
	if strings.Contains(logs, "5ecret") {
		t.Errorf("the key is logged:\n%s", logs)
	}
}

// TestCredentialsNotExposed: the key is in no answer of the gateway's own
// (metrics, dashboard state, model list, errors).
func TestCredentialsNotExposed(t *testing.T) {
	k := newKeyedEngine(t, "e0", engineKey)
	cfg := testConfig(sched.RoundRobin)
	cfg.Endpoints = []EndpointConfig{{URL: k.URL(), Model: "m", KVBlocks: 1000, APIKey: engineKey,
		Headers: map[string]Secret{"X-Tenant": "tenant-5ecret"}}}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	waitFor(t, "ready", func() bool { return g.state.Load().endpoints[0].ready.Load() })
	post(t, c, url+pathChat, chatBody)
	post(t, c, url+pathChat, `{"model":"nope","messages":[]}`)
	for _, path := range []string{pathMetrics, pathDashboardState, pathModels, "/v1/nothing", pathReadyz} {
		resp, err := c.Get(url + path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.Contains(string(b), "5ecret") {
			t.Errorf("%s shows a secret:\n%s", path, b)
		}
	}
	if s := fmt.Sprintf("%+v %v", g.Config(), g.Config().Endpoints); strings.Contains(s, "5ecret") {
		t.Errorf("Config() formats a secret: %s", s)
	}
}

// FuzzEndpointHeader: whatever an endpoint's configured header, key and
// key header, endpointHeader does not panic, errors never quote a value,
// and what it accepts is a well-formed, bounded header set the gateway
// does not govern, carrying the key.
func FuzzEndpointHeader(f *testing.F) {
	for _, s := range [][4]string{
		{"OpenAI-Organization", "org-1", engineKey, ""},
		{"X-A", "1\r\nX-Infergate-Attempts: 9", engineKey, ""}, // header injection
		{"X-A\r\nHost", "evil", "", ""},
		{"Host", "evil.example", "", ""},
		{"transfer-encoding", "chunked", "", ""},
		{"content-length", "0", engineKey, ""},
		{"Authorization", "Basic x", engineKey, ""},
		{"api-key", "k", engineKey, "API-KEY"},
		{"X-B", "v", "k\nX: y", "x-api-key"},
		{"X-C", strings.Repeat("v", maxEndpointHeaderBytes), "", ""},
		{":path", "/admin", "", ""},
		{"X-D", "v\x00", "\x7f", "Authorization"},
		{"X-É", "ü", "ключ", "ключ"},
		{"", "", "", "Connection"},
	} {
		f.Add(s[0], s[1], s[2], s[3])
	}
	f.Fuzz(func(t *testing.T, name, value, key, keyHeader string) {
		ec := EndpointConfig{Headers: map[string]Secret{name: Secret(value)}, APIKey: Secret(key), APIKeyHeader: keyHeader}
		h, err := endpointHeader(ec, func(string) (string, bool) { return "", false })
		if err != nil {
			msg := err.Error()
			for _, v := range []string{value, key} {
				if len(v) >= 8 && strings.Contains(msg, v) && !strings.Contains(name, v) && !strings.Contains(keyHeader, v) {
					t.Fatalf("the error quotes a value: %v", err)
				}
			}
			return
		}
		size := 0
		for k, vs := range h {
			if len(vs) != 1 || !validHeaderName(k) || k != http.CanonicalHeaderKey(k) || refusedEndpointHeader(k) != "" {
				t.Fatalf("accepted %q: %q", k, vs)
			}
			if p := headerValueProblem(vs[0]); p != "" || strings.ContainsAny(vs[0], "\r\n\x00") {
				t.Fatalf("accepted %q: %q (%s)", k, vs[0], p)
			}
			size += len(k) + len(vs[0])
		}
		if len(h) > maxEndpointHeaders+1 || size > maxEndpointHeaderBytes {
			t.Fatalf("%d headers, %d bytes", len(h), size)
		}
		if key != "" {
			hk := defaultAPIKeyHeader
			if keyHeader != "" {
				hk = http.CanonicalHeaderKey(keyHeader)
			}
			if v := h.Get(hk); v != key && v != "Bearer "+key {
				t.Fatalf("the key is not in %s: %v", hk, h)
			}
		}
	})
}
