package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Keys of the tests below: the engines', a wrong one, and the gateway's
// client key.
const (
	simKey    = "sk-vllm-5ecret-key-0123"
	wrongKey  = "sk-wrong-5ecret-key-456"
	clientKey = "sk-client-0123456789abcd"
)

var addrRe = regexp.MustCompile(`addr=(http://[0-9.:]+)`)

// ejectLong keeps an ejected endpoint out for the whole test, however slow
// the machine (no second refusal once the health check is back).
const ejectLong = "eject_duration: 10m\noutlier: {max_ejection_time: 10m}\n"

// request sends a chat completion (stream or not) to the gateway at base
// with the client's key and returns the status, a header and the body.
func request(t *testing.T, c *http.Client, base string, stream bool) (int, http.Header, string) {
	t.Helper()
	body := `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hello"}]}`
	if stream {
		body = strings.Replace(body, `"max_tokens"`, `"stream":true,"max_tokens"`, 1)
	}
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+clientKey)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

// metric sums the samples of name whose line contains sel on base's /metrics.
func metric(t *testing.T, c *http.Client, base, name, sel string) float64 {
	t.Helper()
	resp, err := c.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, name+"{") && strings.Contains(l, sel) {
			if v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64); err == nil {
				sum += v
			}
		}
	}
	return sum
}

// TestEngineAPIKey runs real processes: two `infergate sim` engines that
// require a key as vLLM's --api-key does (one given --api-key, the other
// VLLM_API_KEY), behind `infergate serve` with API keys of its own and the
// engines' key from api_key_env. A client with the gateway's key is
// served; an endpoint configured with a wrong key is refused by its
// engine, ejected at once and the request retried on the other; with no
// endpoint left the client gets 502 upstream_auth, never the engine's 401;
// a missing key variable stops start-up; no key reaches a log.
func TestEngineAPIKey(t *testing.T) {
	a := startEnv(t, []string{"VLLM_API_KEY=" + simKey}, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "m")
	b := startEnv(t, []string{"VLLM_API_KEY=ignored"}, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", "m",
		"--api-key", simKey) // --api-key takes precedence over VLLM_API_KEY, as in vLLM
	simA, simB := a.await(t, addrRe), b.await(t, addrRe)
	c := &http.Client{Timeout: 30 * time.Second}

	// The engines answer as vLLM does: /v1 needs the key, /health and
	// /metrics are open.
	for _, u := range []string{simA, simB} {
		for _, tc := range []struct {
			path, auth string
			want       int
		}{{"/v1/models", "", 401}, {"/v1/models", "Bearer ignored", 401}, {"/v1/models", "Bearer " + simKey, 200},
			{"/health", "", 200}, {"/metrics", "", 200}} {
			req, _ := http.NewRequest(http.MethodGet, u+tc.path, nil)
			if tc.auth != "" {
				req.Header.Set("Authorization", tc.auth)
			}
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tc.want || (tc.want == 401 && string(body) != `{"error":"Unauthorized"}`) {
				t.Fatalf("%s%s (%q): %d %s, want %d", u, tc.path, tc.auth, resp.StatusCode, body, tc.want)
			}
		}
	}

	env := []string{"ENGINE_KEY=" + simKey, "WRONG_KEY=" + wrongKey, "INFERGATE_API_KEYS=alice plain:" + clientKey}
	serve := func(yaml string, args ...string) *proc {
		t.Helper()
		cfg := filepath.Join(t.TempDir(), "gw.yaml")
		if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		return startEnv(t, env, append([]string{"serve", "--listen", "127.0.0.1:0", "--policy", "round-robin", "-c", cfg}, args...)...)
	}
	var logs []string

	// 1. Flags: every --endpoint engine with the key from ENGINE_KEY.
	g := serve("{}\n", "--endpoint", simA+"=m", "--endpoint", simB+"=m", "--endpoint-api-key-env", "ENGINE_KEY")
	base := g.await(t, addrRe)
	for i := range 4 {
		if code, _, body := request(t, c, base, i%2 == 0); code != 200 || !strings.Contains(body, `"choices"`) {
			t.Fatalf("request %d: %d %s", i, code, body)
		}
	}
	if n := metric(t, c, base, "infergate_endpoint_auth_failures_total", ""); n != 0 {
		t.Errorf("%v refusals with the right key", n)
	}
	g.stop(t)
	logs = append(logs, g.all.String())

	// 2. Endpoint B with a wrong key: refused, ejected, retried on A.
	// max_model_len and kv_blocks are given so that no start-up read is
	// refused first (which would eject B before any request: case 4).
	g = serve("retry: {budget_percent: 100}\n" + ejectLong + "endpoints:\n" +
		"  - {url: " + simA + ", model: m, api_key_env: ENGINE_KEY, max_model_len: 4096, kv_blocks: 1000}\n" +
		"  - {url: " + simB + ", model: m, api_key_env: WRONG_KEY, max_model_len: 4096, kv_blocks: 1000}\n")
	base = g.await(t, addrRe)
	retried := 0
	for i := range 6 {
		code, h, body := request(t, c, base, i%2 == 0)
		if code != 200 || !strings.Contains(body, `"choices"`) && !strings.HasSuffix(body, "data: [DONE]\n\n") {
			t.Fatalf("request %d: %d %s", i, code, body)
		}
		if h.Get("X-Infergate-Attempts") == "2" {
			retried++
		}
	}
	if retried != 1 {
		t.Errorf("%d requests retried, want 1 (the wrong key's endpoint ejected at its first 401)", retried)
	}
	for _, m := range []struct{ name, sel string }{
		{"infergate_endpoint_ejections_total", `reason="auth"`},
		{"infergate_retries_total", `reason="auth"`},
		{"infergate_endpoint_auth_failures_total", `source="request"`},
	} {
		if v := metric(t, c, base, m.name, m.sel); v != 1 {
			t.Errorf("%s{%s} = %v, want 1", m.name, m.sel, v)
		}
	}
	g.stop(t)
	logs = append(logs, g.all.String())

	// 3. Only the wrong key: 502 upstream_auth, never the engine's 401.
	g = serve("endpoints:\n  - {url: " + simB + ", model: m, api_key_env: WRONG_KEY, max_model_len: 4096, kv_blocks: 1000}\n")
	base = g.await(t, addrRe)
	code, _, body := request(t, c, base, true)
	if code != http.StatusBadGateway || !strings.Contains(body, `"code":"upstream_auth"`) || strings.Contains(body, "Unauthorized") {
		t.Fatalf("wrong key: %d %s, want 502 upstream_auth", code, body)
	}
	g.stop(t)
	logs = append(logs, g.all.String())

	// 4. The start-up model list read is refused: ejected before any
	// request, and said so once.
	g = serve(ejectLong + "endpoints:\n  - {url: " + simB + ", model: m, api_key_env: WRONG_KEY}\n")
	base = g.await(t, addrRe)
	if code, _, body := request(t, c, base, false); code != http.StatusServiceUnavailable {
		t.Errorf("refused at start: %d %s, want 503 (out of rotation)", code, body)
	}
	if v := metric(t, c, base, "infergate_endpoint_auth_failures_total", `source="discover"`); v != 1 {
		t.Errorf("discover refusals %v, want 1", v)
	}
	g.stop(t)
	out := g.all.String()
	if strings.Count(out, "refused the gateway's credentials") != 1 {
		t.Errorf("want the refusal logged once:\n%s", out)
	}
	logs = append(logs, out)

	// 5. A key variable that is not set: start-up fails, naming it.
	g = serve("endpoints:\n  - {url: " + simA + ", model: m, api_key_env: NOT_SET_KEY}\n")
	if err := g.cmd.Wait(); err == nil || !strings.Contains(g.all.String(), "the environment variable NOT_SET_KEY is not set") {
		t.Errorf("start with an unset key variable: %v\n%s", err, g.all.String())
	}

	for _, l := range append(logs, a.all.String(), b.all.String()) {
		for _, k := range []string{"5ecret", clientKey} {
			if strings.Contains(l, k) {
				t.Errorf("a key is logged:\n%s", l)
			}
		}
	}
}

// TestEngineHeaders: `infergate serve` sends the endpoint's key and extra
// headers on every call it makes to the engine — inference, health probe,
// metrics scrape, the start-up model list and metrics reads — in place of
// the client's credentials, which never reach the engine.
func TestEngineHeaders(t *testing.T) {
	var (
		mu   sync.Mutex
		seen = map[string][]http.Header{}
	)
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen[r.URL.Path] = append(seen[r.URL.Path], r.Header.Clone())
		mu.Unlock()
		switch r.URL.Path {
		case "/v1/models":
			_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","max_model_len":2048}]}`)
		case "/v1/chat/completions":
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
		case "/metrics":
			_, _ = io.WriteString(w, "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"+
				`vllm:cache_config_info{block_size="16",num_gpu_blocks="500"} 1`+"\n")
		}
	}))
	defer engine.Close()
	cfg := filepath.Join(t.TempDir(), "gw.yaml")
	if err := os.WriteFile(cfg, []byte("health_check_interval: 50ms\nendpoints:\n  - url: "+engine.URL+"\n    model: m\n"+
		"    api_key_env: ENGINE_KEY\n    headers: {OpenAI-Organization: org-gw, X-Tenant: t1}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	g := startEnv(t, []string{"ENGINE_KEY=" + simKey, "INFERGATE_API_KEYS=alice plain:" + clientKey},
		"serve", "--listen", "127.0.0.1:0", "-c", cfg)
	base := g.await(t, addrRe)
	c := &http.Client{Timeout: 30 * time.Second}
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions",
		strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hello"}]}`))
	req.Header.Set("Authorization", "Bearer "+clientKey)
	req.Header.Set("X-Api-Key", clientKey)
	req.Header.Set("OpenAI-Organization", "org-client")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	deadline := time.Now().Add(time.Minute) // an upper bound: a probe and a scrape after the start-up ones
	for {
		mu.Lock()
		n := min(len(seen["/health"]), len(seen["/metrics"]))
		mu.Unlock()
		if n >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no second probe and scrape")
		}
		time.Sleep(10 * time.Millisecond)
	}
	g.stop(t)
	mu.Lock()
	defer mu.Unlock()
	for _, path := range []string{"/v1/chat/completions", "/health", "/metrics", "/v1/models"} {
		if len(seen[path]) == 0 {
			t.Errorf("%s never called", path)
		}
		for _, h := range seen[path] {
			if h.Get("Authorization") != "Bearer "+simKey || h.Get("OpenAI-Organization") != "org-gw" ||
				len(h["Openai-Organization"]) != 1 || h.Get("X-Tenant") != "t1" {
				t.Errorf("%s: engine got %v", path, h)
			}
			for name, vs := range h {
				if strings.Contains(strings.Join(vs, ","), clientKey) {
					t.Errorf("%s: the client's key reached the engine in %s", path, name)
				}
			}
		}
	}
	if strings.Contains(g.all.String(), "5ecret") {
		t.Errorf("the key is logged:\n%s", g.all.String())
	}
}
