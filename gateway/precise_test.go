package gateway

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
)

// TestPrecisePrefixOnSimFleet runs precise-prefix in front of real
// simulated engines that publish KV events: the
// gateway subscribes over ZeroMQ, the precise index learns what the engine
// cached, and a follow-up sharing the prompt goes to that engine and is
// served from its cache as predicted.
func TestPrecisePrefixOnSimFleet(t *testing.T) {
	f, err := sim.StartFleet(3, sim.ServerConfig{Model: "m", TimeScale: 100, KVEvents: sim.KVEventsConfig{Enable: true}})
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
	g, url := startGateway(t, cfg)
	c := testClient(t)
	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 40)
	chat := func(q string) (cached int) {
		t.Helper()
		body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 4, "messages": []map[string]string{
			{"role": "system", "content": sys}, {"role": "user", "content": q}}})
		resp, b := post(t, c, url+pathChat, string(body))
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
		var out struct {
			Usage struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatal(err)
		}
		return out.Usage.Details.Cached
	}
	chat("first question")
	ix := g.PreciseIndex("m")
	held := func() (n int) {
		for e := range ix.Endpoints() {
			if ix.Len(e, prefix.MediumGPU) > 0 {
				n++
			}
		}
		return n
	}
	deadline := time.Now().Add(10 * time.Second)
	for held() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no KV event reached the precise index in 10s: %+v", ix.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := held(); n != 1 {
		t.Fatalf("%d engines hold blocks after one request", n)
	}
	for _, q := range []string{"second question", "third question"} {
		if got := chat(q); got < 400 {
			t.Fatalf("follow-up %q: %d cached tokens, want the ~480-token system prompt", q, got)
		}
	}
	if n := held(); n != 1 {
		t.Fatalf("follow-ups spread over %d engines", n)
	}
	m := scrape(t, c, url)
	if n := m.value("infergate_prefix_prediction_error_tokens_count", `index="precise"`); n < 3 {
		t.Fatalf("precise prediction error observed %v times, want 3", n)
	}
	if mean := m.value("infergate_prefix_prediction_error_tokens_sum", `index="precise"`) / 3; mean > 32 {
		t.Errorf("precise prediction off by %.0f tokens on average", mean)
	}
}
