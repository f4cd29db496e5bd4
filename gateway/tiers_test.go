package gateway

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/simserver"
)

func TestKVTiersConfig(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "g.yaml")
	yaml := `
endpoints:
  - url: http://10.0.0.7:8000
    model: m
    kv_blocks: 1000
    kv_events:
      endpoint: tcp://10.0.0.7:5557
      offload_blocks: 4000
      tiers:
        block_bytes: 5242880
        cpu:  {blocks: 4000, bandwidth: 200e9, latency: 100us}
        disk: {blocks: 0}
        remote: {bandwidth: 40e9, latency: 1ms}
kv_stores:
  m:
    endpoint: tcp://10.0.0.9:5557
    replay_endpoint: tcp://10.0.0.9:5558
    topic: kv@kvstore@m
    blocks: 100000
    block_bytes: 5242880
    bandwidth: 25e9
    latency: 2ms
`
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	kt := cfg.Endpoints[0].KVEvents.Tiers
	if kt.BlockBytes != 5242880 || kt.CPU.Blocks != 4000 || kt.CPU.Bandwidth != 200e9 || kt.CPU.Latency != 100*time.Microsecond ||
		kt.Disk.Blocks != 0 || kt.Remote.Latency != time.Millisecond {
		t.Fatalf("tiers %+v %+v %+v", kt, kt.CPU, kt.Remote)
	}
	if s := cfg.KVStores["m"]; s.Blocks != 100000 || s.Topic != "kv@kvstore@m" || s.Latency != 2*time.Millisecond {
		t.Fatalf("kv_store %+v", s)
	}
	if err := cfg.WithDefaults().Validate(); err != nil {
		t.Fatal(err)
	}

	bad := func(what string, edit func(*Config), want string) {
		t.Helper()
		c, _ := LoadConfig(path)
		edit(&c)
		err := c.WithDefaults().Validate()
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", what, err, want)
		}
	}
	bad("contradictory offload", func(c *Config) { c.Endpoints[0].KVEvents.OffloadBlocks = 10 }, "contradicts offload_blocks 10")
	bad("no block bytes", func(c *Config) { c.Endpoints[0].KVEvents.Tiers.BlockBytes = 0 }, "block_bytes: required")
	bad("remote blocks", func(c *Config) { c.Endpoints[0].KVEvents.Tiers.Remote.Blocks = 5 }, "remote.blocks 5")
	bad("store blocks", func(c *Config) { s := c.KVStores["m"]; s.Blocks = 0; c.KVStores["m"] = s }, "capacity in blocks is required")
	bad("store model", func(c *Config) { c.KVStores["x"] = c.KVStores["m"] }, `kv_stores["x"]: no endpoint`)
	// Sizes whose sums would overflow, load costs that are not finite
	// (found by an attack run: they passed and unbounded the index).
	bad("huge cpu blocks", func(c *Config) { c.Endpoints[0].KVEvents.Tiers.CPU.Blocks = math.MaxInt }, "cpu.blocks")
	bad("huge store", func(c *Config) { s := c.KVStores["m"]; s.Blocks = math.MaxInt; c.KVStores["m"] = s }, "capacity in blocks is required")
	bad("infinite block bytes", func(c *Config) { c.Endpoints[0].KVEvents.Tiers.BlockBytes = math.Inf(1) }, "block_bytes +Inf")
	bad("infinite load time", func(c *Config) {
		c.Endpoints[0].KVEvents.Tiers.BlockBytes, c.Endpoints[0].KVEvents.Tiers.CPU.Bandwidth = 1e308, 1e-320
	}, "not a finite load time")
	bad("store without events", func(c *Config) {
		c.Endpoints = append(c.Endpoints, EndpointConfig{URL: "http://10.0.0.8:8000", Model: "m"})
	}, "needs kv_events on every endpoint")
	// The precise index holds up to prefix.MaxIndexEndpoints slots in
	// groups of 64, the store's included: 64 endpoints and a store pass
	// (the store takes slot 127), one endpoint more than the index's
	// largest size less the store does not.
	grow := func(c *Config, n int) {
		for i := range n - 1 {
			e := c.Endpoints[0]
			e.URL = fmt.Sprintf("http://10.1.%d.%d:8000", i>>8, i&255)
			c.Endpoints = append(c.Endpoints, e)
		}
	}
	c, _ := LoadConfig(path)
	grow(&c, 64)
	if err := c.WithDefaults().Validate(); err != nil {
		t.Errorf("64 endpoints and a kv_store: %v", err)
	}
	bad("too many endpoints", func(c *Config) { grow(c, prefix.MaxIndexEndpoints) },
		fmt.Sprintf("the model has %d endpoints; with a kv_store at most %d", prefix.MaxIndexEndpoints, prefix.MaxIndexEndpoints-1))
}

// tieredFleet is one simulated engine with a host tier of 4× its GPU
// cache and a shared remote store of 8×, publishing KV events.
func tieredFleet(t *testing.T) (*simserver.Fleet, sim.Config) {
	t.Helper()
	eng := sim.Config{NumBlocks: 64}
	eng.Tiers.Host = sim.TierSize{Multiple: 4}
	f, err := simserver.StartFleet(1, simserver.ServerConfig{Model: "m", Engine: eng, TimeScale: 100,
		KVRemote: sim.TierSize{Multiple: 8}, KVEvents: kvevents.PublisherConfig{Enable: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f, f.Servers[0].EngineConfig()
}

// tieredConfig configures a gateway in front of tieredFleet's fleet, its
// tiers as the engine has them.
func tieredConfig(f *simserver.Fleet, eng sim.Config) Config {
	pub, replay := f.KVEventEndpoints()
	perBlock, latency := eng.LoadCost()
	bb := eng.BlockBytes()
	cfg := Config{HealthCheckInterval: time.Second, HealthCheckPath: healthCheckOff}
	cfg.Routing.Policy = sched.PrecisePrefix
	cfg.Endpoints = []EndpointConfig{{URL: f.URLs[0], Model: "m", Kind: fleet.Sim,
		KVEvents: &KVEventsConfig{Endpoint: pub[0], ReplayEndpoint: replay[0], Tiers: &KVTiersConfig{
			BlockBytes: bb,
			CPU: &KVTierConfig{Blocks: eng.TierBlocks(eng.Tiers.Host), Bandwidth: bb / perBlock[sim.TierHost],
				Latency: time.Duration(latency[sim.TierHost] * float64(time.Second))},
		}}}}
	rp, rr := f.Remote.KVEventEndpoints()
	cfg.KVStores = map[string]KVStoreConfig{"m": {Endpoint: rp, ReplayEndpoint: rr, Topic: simserver.DefaultRemoteTopic("m"),
		Blocks: f.Remote.Capacity(), BlockBytes: bb, Bandwidth: bb / perBlock[sim.TierRemote],
		Latency: time.Duration(latency[sim.TierRemote] * float64(time.Second))}}
	return cfg
}

// chatCached sends a chat request through the gateway and returns the
// cached tokens its engine reported.
func chatCached(t *testing.T, url, sys, q string) int {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 2, "messages": []map[string]string{
		{"role": "system", "content": sys}, {"role": "user", "content": q}}})
	resp, b := post(t, testClient(t), url+pathChat, string(body))
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
	_ = json.Unmarshal(b, &out)
	return out.Usage.Details.Cached
}

// syncFeeds waits until the gateway's feeds applied every batch the fleet's
// engine and remote store published.
func syncFeeds(t *testing.T, g *Gateway, f *simserver.Fleet) {
	t.Helper()
	waitFor(t, "the KV events to reach the index", func() bool {
		st := g.state.Load()
		ep, store := st.feeds[st.endpoints[0]].kv, st.stores["m"]
		p, r := f.Servers[0].KVEventPublisher(), f.Remote.Publisher()
		return ep != nil && store != nil && ep.sub.Stats().Batches == p.NextSeq() && store.sub.Stats().Batches == r.NextSeq()
	})
}

// TestTieredPoolOnSimFleet: a pool whose endpoint has a host tier and whose
// model has a kv_store: the index is bounded per medium, the policy is
// told the load costs, the store's events fill its slot, and a prompt the
// engine's GPU evicted but its host tier kept is routed with a CPU
// prediction and served from the host tier.
func TestTieredPoolOnSimFleet(t *testing.T) {
	f, eng := tieredFleet(t)
	cfg := tieredConfig(f, eng)
	g, url := startGateway(t, cfg)
	p := g.state.Load().pools["m"]
	ix := g.PreciseIndex("m")
	want := [prefix.NumMedia]int{prefix.MediumGPU: 64, prefix.MediumCPU: 256}
	if got := ix.EndpointStats(0).MediumCapacity; got != want {
		t.Fatalf("medium capacities %v, want %v", got, want)
	}
	if got := ix.EndpointStats(storeSlot(ix)).Capacity; got != f.Remote.Capacity() {
		t.Fatalf("store slot capacity %d, want %d", got, f.Remote.Capacity())
	}
	perBlock, _ := eng.LoadCost()
	if p.tiers == nil || p.tiers.Remote != storeSlot(ix) || !near(p.tiers.LoadSeconds[0][prefix.MediumCPU], perBlock[sim.TierHost]) ||
		!near(p.tiers.LoadSeconds[0][prefix.MediumRemote], perBlock[sim.TierRemote]) {
		t.Fatalf("tiers %+v", p.tiers)
	}

	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 40)
	if n := chatCached(t, url, sys, "first question"); n != 0 {
		t.Fatalf("cold request cached %d", n)
	}
	// Other prompts fill the 64-block GPU cache: the first one's blocks
	// leave the GPU, stay in the host tier and the store.
	for i, w := range []string{"Alpha", "Bravo", "Charlie", "Delta"} {
		chatCached(t, url, strings.Repeat(w+" is a word the assistant repeats. ", 60), "question "+string(rune('a'+i)))
	}
	syncFeeds(t, g, f)
	if ix.Len(0, prefix.MediumCPU) == 0 || ix.Len(storeSlot(ix), prefix.MediumRemote) == 0 {
		t.Fatalf("index: %d CPU blocks, %d in the store", ix.Len(0, prefix.MediumCPU), ix.Len(storeSlot(ix), prefix.MediumRemote))
	}
	rm := p.routes[0]
	cpu0 := testutil.ToFloat64(rm.predictedTier[prefix.MediumCPU])
	cached := chatCached(t, url, sys, "first question again")
	predicted := testutil.ToFloat64(rm.predictedTier[prefix.MediumCPU]) - cpu0
	if cached < 16*16 || predicted < 16*16 {
		t.Fatalf("served %d cached tokens; predicted %v from the CPU tier", cached, predicted)
	}
	if st := f.Servers[0].Stats(); st.ExternalHits == 0 {
		t.Fatalf("the engine loaded nothing: %+v", st.TierHits)
	}
}

func near(a, b float64) bool { return a > 0 && (a-b)/b < 1e-9 && (b-a)/b < 1e-9 }

// TestReloadTiers: reloads that change an endpoint's tiers re-bound its
// slot and tell the kept policy the new tier prices, keeping the KV feed
// (and what the index learnt); removing the kv_store stops its feed,
// forgets its slot and tells the policy there is no remote tier; adding
// it back subscribes again and prices it again. (Until 2026-12-05 a price
// change rebuilt the policy: TestReloadTieredKeepsPolicy.)
func TestReloadTiers(t *testing.T) {
	f, eng := tieredFleet(t)
	cfg := tieredConfig(f, eng)
	g, url := startGateway(t, cfg)
	chatCached(t, url, strings.Repeat("A prompt for the store. ", 40), "q")
	syncFeeds(t, g, f)
	ix := g.PreciseIndex("m")
	feed := kvFeedOf(g, 0)
	store := g.state.Load().stores["m"]
	policy := g.state.Load().pools["m"].policy
	if ix.Len(storeSlot(ix), prefix.MediumRemote) == 0 {
		t.Fatal("no store blocks in the index")
	}

	// Halve the host tier and its bandwidth.
	cpu := *cfg.Endpoints[0].KVEvents.Tiers.CPU
	cpu.Blocks, cpu.Bandwidth = cpu.Blocks/2, cpu.Bandwidth/2
	kv := *cfg.Endpoints[0].KVEvents
	tiers := *kv.Tiers
	tiers.CPU, kv.Tiers = &cpu, &tiers
	cfg.Endpoints[0].KVEvents = &kv
	mustReload(t, g, cfg)
	st := g.state.Load()
	p := st.pools["m"]
	if got := ix.EndpointStats(0).MediumCapacity[prefix.MediumCPU]; got != cpu.Blocks {
		t.Fatalf("CPU bound %d after reload, want %d", got, cpu.Blocks)
	}
	if kvFeedOf(g, 0) != feed || st.stores["m"] != store || g.PreciseIndex("m") != ix {
		t.Fatal("a tier change replaced a feed or the index")
	}
	perBlock, _ := eng.LoadCost()
	if p.policy != policy || policyTiers(t, policy) != p.tiers || !near(p.tiers.LoadSeconds[0][prefix.MediumCPU], 2*perBlock[sim.TierHost]) {
		t.Fatalf("policy kept %v, CPU load %v", p.policy == policy, p.tiers.LoadSeconds[0][prefix.MediumCPU])
	}

	// The store goes: its feed stops, its slot is forgotten, no tier
	// remote is priced.
	noStore := cfg
	noStore.KVStores = nil
	mustReload(t, g, noStore)
	select {
	case <-store.done:
	case <-time.After(time.Minute):
		t.Fatal("the store's feed did not stop")
	}
	if n := ix.Len(storeSlot(ix), prefix.MediumRemote); n != 0 || g.state.Load().pools["m"].tiers.Remote != -1 {
		t.Fatalf("store slot holds %d blocks after the store was removed", n)
	}
	if p := g.state.Load().pools["m"]; p.policy != policy || policyTiers(t, policy).Remote != -1 {
		t.Fatalf("without the store: policy kept %v, it prices a store at slot %d", p.policy == policy, policyTiers(t, p.policy).Remote)
	}
	// And comes back.
	mustReload(t, g, cfg)
	syncFeeds(t, g, f)
	if ix.Len(storeSlot(ix), prefix.MediumRemote) == 0 {
		t.Fatal("the store's blocks did not come back")
	}
	if p := g.state.Load().pools["m"]; p.policy != policy || policyTiers(t, policy).Remote != storeSlot(ix) {
		t.Fatalf("with the store back: policy kept %v, it prices a store at slot %d", p.policy == policy, policyTiers(t, p.policy).Remote)
	}

	// The tiers go (kv_events without tiers, no store): a new policy,
	// untiered, whose precise-prefix scores with the precise index and its
	// speculative entries alone — no approximate index, so nothing learns
	// on finish — and come back: a new tiered one with the approximate
	// index again (sched.NewPolicy picks the composition by the pool's
	// tiers, so a kept policy must never change sides).
	approx := func(p sched.Policy) bool {
		l, ok := p.(interface{ LearnsOnFinish() bool })
		return ok && l.LearnsOnFinish()
	}
	if !approx(policy) {
		t.Fatal("the tiered precise-prefix policy has no approximate index")
	}
	untiered := cfg
	untiered.KVStores = nil
	ep := cfg.Endpoints[0]
	kvNo := *ep.KVEvents
	kvNo.Tiers = nil
	ep.KVEvents = &kvNo
	untiered.Endpoints = []EndpointConfig{ep}
	mustReload(t, g, untiered)
	if p := g.state.Load().pools["m"]; p.policy == policy || policyTiers(t, p.policy) != nil || approx(p.policy) {
		t.Fatalf("without tiers: policy kept %v, tiers %v, approximate index %v", p.policy == policy, policyTiers(t, p.policy) != nil, approx(p.policy))
	}
	mustReload(t, g, cfg)
	if p := g.state.Load().pools["m"]; policyTiers(t, p.policy) == nil || !approx(p.policy) {
		t.Fatalf("with tiers again: tiers %v, approximate index %v", policyTiers(t, p.policy) != nil, approx(p.policy))
	}
}

// storeSlot is the kv_store's slot of ix, its last, while no reload grows
// it (pool.storeSlot).
func storeSlot(ix *prefix.PreciseIndex) int { return ix.Endpoints() - 1 }
