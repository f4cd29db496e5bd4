package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/sim"
)

// TestServeKVStoreTiers runs the shared remote KV tier as it is deployed:
// `infergate kvstore` as its own process, two `infergate sim` engines
// writing through to it and loading from it (kvstore.EngineTier, metadata-only
// blocks of the engine's size) with host-memory tiers, and `infergate serve`
// scoring every tier from real KV events: the engines' (GPU, CPU) and the
// store's (REMOTE), over ZeroMQ. Conversations overflow the engines' GPU
// caches; their second turns are served from the lower tiers, the engines
// say so (vllm:external_prefix_cache_hits_total), and so does the gateway's
// per-tier prediction (infergate_prefix_predicted_tier_tokens_total).
func TestServeKVStoreTiers(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	const model = "m"
	kv := start(t, "kvstore", "--listen", "127.0.0.1:0", "--lm-listen", "", "--model", model, "--memory-bytes", "64GiB",
		"--events", "tcp://127.0.0.1:0", "--events-replay", "tcp://127.0.0.1:0")
	line := kv.await(t, regexp.MustCompile(`(kvstore listening.*)`))
	field := func(s, name string) string {
		m := regexp.MustCompile(name + `=(\S+)`).FindStringSubmatch(s)
		if m == nil {
			t.Fatalf("no %s in %q", name, s)
		}
		return m[1]
	}
	api, events, replay := field(line, "api"), field(line, "events"), field(line, "replay")
	defer kv.stop(t)

	// Engines: 64 GPU blocks (of 16 tokens), a host tier twice that, the
	// kvstore as remote tier; KV events on loopback.
	eng := sim.Config{NumBlocks: 64}
	bb := eng.BlockBytes()
	perBlock, latency := eng.LoadCost()
	addrRe := regexp.MustCompile(`simulated engine listening.* addr=(http://[0-9.:]+)`)
	kvRe := regexp.MustCompile(`publishing KV events.* endpoint=([0-9.:]+)`)
	type engine struct{ url, events string }
	var engines []engine
	for range 2 {
		s := start(t, "sim", "--listen", "127.0.0.1:0", "--time-scale", "100", "--model", model, "--num-gpu-blocks", "64",
			"--kv-host", "2x", "--kv-store-url", api, "--kv-store-events", events, "--kv-store-events-replay", replay,
			"--kv-events-config", `{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:0","bind":true}`)
		url := s.await(t, addrRe)
		engines = append(engines, engine{url: url, events: "tcp://" + s.await(t, kvRe)})
		defer s.stop(t)
	}
	var cfg strings.Builder
	fmt.Fprintf(&cfg, "listen: 127.0.0.1:0\nrouting: {policy: tiered-cost}\nendpoints:\n")
	for _, e := range engines {
		fmt.Fprintf(&cfg, `  - url: %s
    model: %s
    kv_blocks: 64
    block_size: 16
    kv_events:
      endpoint: %s
      tiers:
        block_bytes: %g
        cpu: {blocks: 128, bandwidth: %g, latency: %s}
        remote: {bandwidth: %g, latency: %s}
`, e.url, model, e.events, bb, bb/perBlock[sim.TierHost], time.Duration(latency[sim.TierHost]*float64(time.Second)),
			bb/perBlock[sim.TierRemote], time.Duration(latency[sim.TierRemote]*float64(time.Second)))
	}
	fmt.Fprintf(&cfg, "kv_stores:\n  %s: {endpoint: %s, replay_endpoint: %s, blocks: %d}\n", model, events, replay, int(64<<30/bb))
	path := filepath.Join(t.TempDir(), "gateway.yaml")
	if err := os.WriteFile(path, []byte(cfg.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	g := start(t, "serve", "-c", path, "--access-log=false")
	base := g.await(t, regexp.MustCompile(`gateway listening.* addr=(http://[0-9.:]+)`))
	defer g.stop(t)

	ss := tierSessions(6) // 180 blocks over 2 × 64 GPU blocks
	for i := range ss {
		ss[i].chat(t, base, model, false)
	}
	// The store holds the first turns' blocks once the engines' writes have
	// landed; wait for its count to settle, then for the gateway to have
	// applied every stream's events (its batch counters stop moving).
	settle := func(what string, value func() float64) {
		last := -1.0
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(200 * time.Millisecond) {
			n := value()
			if n > 0 && n == last {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %v, still changing or zero", what, n)
			}
			last = n
		}
	}
	settle("kvstore blocks", func() float64 {
		resp, err := http.Get(api + "/v1/stats")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var st struct {
			Store struct {
				MemoryEntries float64 `json:"memory_entries"`
			} `json:"store"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&st)
		return st.Store.MemoryEntries
	})
	settle("KV-event batches applied", func() float64 {
		return metricSum(t, http.DefaultClient, base, "infergate_kv_events_batches_total", "")
	})
	cached := 0.0
	for i := range ss {
		cached += ss[i].chat(t, base, model, true)
	}
	ext := 0.0
	for _, e := range engines {
		ext += metricSum(t, http.DefaultClient, e.url, "vllm:external_prefix_cache_hits_total", "")
	}
	remote := metricSum(t, http.DefaultClient, base, "infergate_prefix_predicted_tier_tokens_total", `tier="remote"`)
	lower := remote + metricSum(t, http.DefaultClient, base, "infergate_prefix_predicted_tier_tokens_total", `tier="cpu"`)
	if cached == 0 || ext == 0 || lower == 0 || remote == 0 {
		t.Fatalf("second turns cached %v tokens; engines' external hits %v; gateway's lower-tier predictions %v (remote %v)\ngateway output:\n%s",
			cached, ext, lower, remote, g.all.String())
	}
	t.Logf("second turns: %v cached tokens, %v from lower tiers (engines); the gateway predicted %v from cpu and remote, %v from the kvstore", cached, ext, lower, remote)
}
