package gateway

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/sched"
)

// TestSessionAffinity: a profile scoring only session affinity keeps each
// session (X-Session-Id header, else the "user" field) on one endpoint.
func TestSessionAffinity(t *testing.T) {
	engines := []*fakeEngine{newFakeEngine(t, "e0"), newFakeEngine(t, "e1"), newFakeEngine(t, "e2"), newFakeEngine(t, "e3")}
	cfg := testConfig("sticky", engines...)
	// No health probes: one that timed out on a loaded host (load 13)
	// took a home out of rotation, its sessions forgotten with it, and
	// moved a session mid-test.
	cfg.HealthCheckPath = healthCheckOff
	cfg.Routing.Profiles = map[string]sched.ProfileConfig{"sticky": {
		Scorers: []sched.ScorerConfig{{Type: sched.ScorerSession, Weight: 1}},
	}}
	_, url := startGateway(t, cfg)
	c := testClient(t)
	homes := map[string]bool{}
	for s := range 6 {
		key := fmt.Sprintf("sess-%d", s)
		var home string
		for turn := range 5 {
			resp, b := post(t, c, url+pathChat, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, SessionHeader, key)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, b)
			}
			got := resp.Header.Get("X-Engine")
			if turn == 0 {
				home = got
				homes[got] = true
			} else if got != home {
				t.Fatalf("session %s turn %d went to %s, home %s", key, turn, got, home)
			}
		}
	}
	if len(homes) < 2 {
		t.Errorf("6 sessions all homed on %v: first turns should spread", homes)
	}
	// The "user" field is the fallback key.
	body := `{"model":"m","user":"alice","messages":[{"role":"user","content":"hi"}]}`
	first := routeOf(t, c, url, pathChat, body)
	for range 4 {
		if got := routeOf(t, c, url, pathChat, body); got != first {
			t.Fatalf("user alice moved from %s to %s", first, got)
		}
	}
}

// TestCacheAwareProfile: the weighted cache-aware profile routes prompts
// sharing a long prefix together and releases its token accounting.
func TestCacheAwareProfile(t *testing.T) {
	engines := []*fakeEngine{newFakeEngine(t, "e0"), newFakeEngine(t, "e1"), newFakeEngine(t, "e2")}
	g, url := startGateway(t, testConfig(sched.CacheAware, engines...))
	c := testClient(t)
	first := routeOf(t, c, url, pathCompletions, tokenPrompt(512, 40, 1))
	for i := 2; i < 6; i++ {
		if got := routeOf(t, c, url, pathCompletions, tokenPrompt(512, 40, uint32(i))); got != first {
			t.Fatalf("prompt %d with the shared 512-token prefix went to %s, not %s", i, got, first)
		}
	}
	resp, b := post(t, c, url+pathCompletions, tokenPrompt(512, 40, 9)[:len(tokenPrompt(512, 40, 9))-1]+`,"stream":true}`)
	if resp.StatusCode != 200 {
		t.Fatalf("stream: %d %s", resp.StatusCode, b)
	}
	p := g.state.Load().pools["m"]
	for i, ep := range p.endpoints {
		if n, m := ep.ledger.InFlightTokens(), ep.ledger.PendingPrefill(); n != 0 || m != 0 {
			t.Errorf("endpoint %d: %d in-flight tokens, %d pending prefill tokens after every request ended", i, n, m)
		}
	}
}

// TestDefaultPolicy: an unset policy becomes the measured default, which
// must be a valid built-in (sched/README.md "Evaluation" chose it).
func TestDefaultPolicy(t *testing.T) {
	c := Config{}.WithDefaults()
	if c.Routing.Policy != DefaultPolicy || DefaultPolicy != sched.CacheAware {
		t.Fatalf("default policy %q (DefaultPolicy %q), want %q", c.Routing.Policy, DefaultPolicy, sched.CacheAware)
	}
	if err := sched.Validate(c.Routing); err != nil {
		t.Fatal(err)
	}
}

// TestSnapshotKVUtilUnknown: an engine whose metrics page has its queues
// but no KV-cache gauge is seen by the scheduler with a negative KVUtil
// (not reported), which the kv-utilization scorer leaves unscored; before,
// it read as 0, an empty cache, the most attractive endpoint.
func TestSnapshotKVUtilUnknown(t *testing.T) {
	page := func(kv bool) string {
		s := "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"
		if kv {
			s += "vllm:kv_cache_usage_perc 0.5\n"
		}
		return s
	}
	engine := func(kv bool) *httptest.Server {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/metrics" {
				_, _ = io.WriteString(w, page(kv))
				return
			}
			w.WriteHeader(http.StatusOK)
		}))
		t.Cleanup(srv.Close)
		return srv
	}
	with, without := engine(true), engine(false)
	cfg := Config{HealthCheckInterval: time.Hour, ScrapeInterval: 20 * time.Millisecond, Endpoints: []EndpointConfig{
		{URL: with.URL, Model: "m", KVBlocks: 100, Kind: fleet.VLLM}, {URL: without.URL, Model: "m", KVBlocks: 100, Kind: fleet.VLLM}}}
	g, _ := startGateway(t, cfg)
	p := g.state.Load().pools["m"]
	var snap []sched.Endpoint
	waitFor(t, "both endpoints scraped", func() bool {
		sp := p.snapshot()
		defer p.release(sp)
		snap = slices.Clone(*sp)
		return snap[0].Metrics && snap[1].Metrics
	})
	if snap[0].KVUtil != 0.5 || snap[0].Waiting != 1 || snap[0].Running != 2 {
		t.Errorf("engine with the gauge: %+v", snap[0])
	}
	if !(snap[1].KVUtil < 0) || snap[1].Waiting != 1 {
		t.Errorf("engine without the KV gauge: KVUtil %v (want negative: not reported), waiting %d", snap[1].KVUtil, snap[1].Waiting)
	}
}
