package gateway

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
)

// rotatingEngine is a fakeEngine behind vLLM's --api-key check whose
// accepted keys can change while it serves (an engine re-keyed, or one
// accepting the old and the new key during a rotation). /health and
// /metrics are open, as vLLM's; every /v1 path needs one of the keys.
type rotatingEngine struct {
	*fakeEngine
	keys    atomic.Pointer[[]string]
	refused atomic.Int64

	mu   sync.Mutex
	sent map[string]int // chat requests by the key they carried
}

func newRotatingEngine(t *testing.T, name string, keys ...string) *rotatingEngine {
	e := &rotatingEngine{fakeEngine: &fakeEngine{name: name, canceled: make(chan struct{}, 16)}, sent: map[string]int{}}
	e.accept(keys...)
	e.srv = httptest.NewServer(e)
	t.Cleanup(e.srv.Close)
	return e
}

func (e *rotatingEngine) accept(keys ...string) { e.keys.Store(&keys) }

func (e *rotatingEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.HasPrefix(r.URL.Path, "/v1") {
		got, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		ok := false
		for _, k := range *e.keys.Load() {
			ok = ok || got == k
		}
		if !ok {
			e.refused.Add(1)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = io.WriteString(w, `{"error":"Unauthorized"}`)
			return
		}
		if r.URL.Path == pathChat {
			e.mu.Lock()
			e.sent[got]++
			e.mu.Unlock()
		}
		if r.URL.Path == pathModels {
			_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model","max_model_len":4096}]}`)
			return
		}
	}
	e.fakeEngine.ServeHTTP(w, r)
}

func (e *rotatingEngine) sentWith(key string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.sent[key]
}

// TestReloadRotatesEngineCredentials: an engine re-keyed behind the
// gateway's back refuses the gateway (502 upstream_auth, ejected for the
// hour eject_duration says); a reload with the new key puts it back in
// rotation at once (the ejection was the old key's), the engine accepting
// it. A rotation through api_key_env (the variable changed, the file
// not) applies at the next reload, under clients sending without a pause:
// no request fails. A reload to a key the engine refuses takes it out of
// rotation before any request is sent with it.
func TestReloadRotatesEngineCredentials(t *testing.T) {
	const k1, k2, k3 = "sk-engine-old-0123456789", "sk-engine-new-0123456789", "sk-engine-next-0123456789"
	e := newRotatingEngine(t, "e0", k2) // re-keyed: k1 no longer works
	cfg := testConfig(sched.RoundRobin)
	cfg.EjectDuration = time.Hour
	cfg.Outlier.MaxEjectionTime = time.Hour
	cfg.HealthCheckInterval = time.Hour // nothing but the reload may put it back
	cfg.Endpoints = []EndpointConfig{{URL: e.URL(), Model: "m", KVBlocks: 1000, MaxModelLen: 4096, APIKey: k1}}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	ep := g.state.Load().endpoints[0]
	waitFor(t, "ready", ep.ready.Load)

	resp, b := post(t, c, url+pathChat, chatBody)
	if resp.StatusCode != http.StatusBadGateway || decodeError(t, b).Code != codeUpstreamAuth {
		t.Fatalf("with the old key: %d %s, want 502 upstream_auth", resp.StatusCode, b)
	}
	if resp, b := post(t, c, url+pathChat, chatBody); resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("ejected: %d %s, want 503", resp.StatusCode, b)
	}

	cfg.Endpoints[0].APIKey = k2
	mustReload(t, g, cfg)
	if endpointOf(g, e.URL()) != ep || !ep.ready.Load() {
		t.Fatal("after the reload with the engine's key: the endpoint is not the same object back in rotation")
	}
	for i := range 3 {
		if resp, b := post(t, c, url+pathChat, chatBody); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d with the new key: %d %s", i, resp.StatusCode, b)
		}
	}

	// Through the environment, under load: the engine accepts k2 and k3
	// while the gateway moves from one to the other.
	const env = "INFERGATE_TEST_ROTATED_KEY"
	t.Setenv(env, k2)
	cfg.Endpoints[0].APIKey, cfg.Endpoints[0].APIKeyEnv = "", env
	mustReload(t, g, cfg)
	e.accept(k2, k3)
	var (
		stop   atomic.Bool
		wg     sync.WaitGroup
		failMu sync.Mutex
		failed []string
		sent   atomic.Int64
	)
	for range 4 {
		wg.Go(func() {
			for !stop.Load() {
				req, _ := http.NewRequest(http.MethodPost, url+pathChat, strings.NewReader(chatBody))
				req.Header.Set("Content-Type", "application/json")
				resp, err := c.Do(req)
				if err != nil {
					failMu.Lock()
					failed = append(failed, err.Error())
					failMu.Unlock()
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				sent.Add(1)
				if resp.StatusCode != http.StatusOK {
					failMu.Lock()
					failed = append(failed, fmt.Sprintf("%d %s", resp.StatusCode, b))
					failMu.Unlock()
				}
			}
		})
	}
	waitFor(t, "requests with k2", func() bool { return e.sentWith(k2) >= 8 })
	t.Setenv(env, k3)
	mustReload(t, g, cfg) // the same configuration: the variable is read again
	waitFor(t, "requests with k3", func() bool { return e.sentWith(k3) >= 8 })
	e.accept(k3) // the old key revoked
	n := sent.Load()
	waitFor(t, "requests after the revocation", func() bool { return sent.Load() >= n+8 })
	stop.Store(true)
	wg.Wait()
	if len(failed) > 0 {
		t.Fatalf("%d of %d requests failed during the rotation, first: %s", len(failed), sent.Load(), failed[0])
	}
	if !ep.ready.Load() {
		t.Fatal("the endpoint left rotation during the rotation")
	}

	// A key the engine refuses: ejected at the reload, before a request.
	refusedBefore := e.refused.Load()
	t.Setenv(env, k1)
	mustReload(t, g, cfg)
	if ep.ready.Load() {
		t.Fatal("after a reload to a key the engine refuses: still in rotation")
	}
	if e.refused.Load() == refusedBefore {
		t.Fatal("the new key was not tried before the reload published it")
	}
	m := scrape(t, c, url)
	if got := m.value("infergate_endpoint_auth_failures_total", `source="discover"`); got != 1 {
		t.Errorf("auth failures from the reload's check: %v, want 1", got)
	}
	if got := m.value("infergate_endpoint_ejections_total", `reason="auth"`); got != 2 {
		t.Errorf("auth ejections: %v, want 2 (the old key's request, the refused reload)", got)
	}
	if resp, b := post(t, c, url+pathChat, chatBody); resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("after the refused key's reload: %d %s, want 503 (no endpoint in rotation)", resp.StatusCode, b)
	}
}

// TestReloadAuthRefusalOfOldCredentials: a request sent with the
// credentials in force before a reload and refused after it does not eject
// the endpoint, whose new credentials the refusal says nothing about.
func TestReloadAuthRefusalOfOldCredentials(t *testing.T) {
	e := newRotatingEngine(t, "e0", "k-new-0123456789")
	cfg := testConfig(sched.RoundRobin)
	cfg.EjectDuration = time.Hour
	cfg.Outlier.MaxEjectionTime = time.Hour
	cfg.Endpoints = []EndpointConfig{{URL: e.URL(), Model: "m", KVBlocks: 1000, MaxModelLen: 4096, APIKey: "k-old-0123456789"}}
	g, _ := startGateway(t, cfg)
	ep := g.state.Load().endpoints[0]
	old := ep.spec.Load()
	cfg.Endpoints[0].APIKey = "k-new-0123456789"
	mustReload(t, g, cfg)
	waitFor(t, "ready", ep.ready.Load)
	resp := &http.Response{StatusCode: http.StatusUnauthorized, Body: io.NopCloser(strings.NewReader(`{"error":"Unauthorized"}`))}
	if f := g.authRefused(ep, old, g.unknown, resp, "r1"); f == nil || f.reason != reasonAuth {
		t.Fatalf("failure %+v, want an auth failure", f)
	}
	if !ep.ready.Load() {
		t.Fatal("a refusal of the old credentials ejected the endpoint")
	}
	resp.Body = io.NopCloser(strings.NewReader(`{"error":"Unauthorized"}`))
	g.authRefused(ep, ep.spec.Load(), g.unknown, resp, "r2")
	if ep.ready.Load() {
		t.Fatal("a refusal of the credentials in force did not eject the endpoint")
	}
}

// TestReloadRediscoversWithNewCredentials: an engine that refused the
// start-up GET /v1/models (a wrong key) has the default context length;
// the reload that gives it the right key reads it again, and its
// max_model_len is the engine's.
func TestReloadRediscoversWithNewCredentials(t *testing.T) {
	e := newRotatingEngine(t, "e0", "k-right-0123456789")
	cfg := testConfig(sched.RoundRobin)
	cfg.Endpoints = []EndpointConfig{{URL: e.URL(), Model: "m", KVBlocks: 1000, APIKey: "k-wrong-0123456789"}}
	g, _ := startGateway(t, cfg)
	if n := g.Config().Endpoints[0].MaxModelLen; n != DefaultMaxModelLen {
		t.Fatalf("max_model_len %d with the models read refused, want the default %d", n, DefaultMaxModelLen)
	}
	cfg.Endpoints[0].APIKey = "k-right-0123456789"
	mustReload(t, g, cfg)
	if n := g.Config().Endpoints[0].MaxModelLen; n != 4096 {
		t.Fatalf("max_model_len %d after the reload with the engine's key, want its 4096", n)
	}
	if !g.state.Load().endpoints[0].ready.Load() {
		t.Fatal("the endpoint ejected at start for its key is not back in rotation")
	}
}
