package gateway

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
)

// Growing a pool past its slots at a reload or a discovery change (which
// reloads the gateway with the discovered endpoints: discovered.go) keeps
// what the indexes hold for the endpoints that stay. Until 2026-12-05 a
// pool that outgrew its 64 slots got a new, empty precise index and a new
// policy (approximate index, speculative entries): a scale-up from 64 to
// 65 pods routed cold until the engines' next events.

// growPrompt is the token ids of prompt s: tokens tokens, the first shared
// of them those the engine stores.
func growPrompt(s, tokens int) []uint32 {
	out := make([]uint32, tokens)
	for k := range out {
		out[k] = uint32(1000 + s*7919 + k)
	}
	return out
}

// growPick picks an endpoint for a completion of toks in model m0 and
// returns its address (the pick is done at once: no load left).
func growPick(t *testing.T, g *Gateway, toks []uint32) string {
	t.Helper()
	pk, ref := g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathCompletions, Header: http.Header{}, Body: growBody(toks)})
	if ref != nil {
		t.Fatalf("refused: %d %s", ref.Status, ref.Body)
	}
	defer pk.Done()
	return pk.Destinations()[0]
}

// growBody is a completion request of toks in model m0.
func growBody(toks []uint32) []byte {
	b := []byte(`{"model":"m0","max_tokens":8,"prompt":[`)
	for k, v := range toks {
		if k > 0 {
			b = append(b, ',')
		}
		b = fmt.Append(b, v)
	}
	return append(b, "]}"...)
}

// growAddr is the address of eppBenchConfig's endpoint i.
func growAddr(i int) string { return fmt.Sprintf("10.%d.%d.%d:8000", i>>16&255, i>>8&255, i&255) }

// deadKVAddr is a tcp:// address nothing listens on: the KV subscriptions
// to it retry in the background and never reset what the test fed.
func deadKVAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return "tcp://" + l.Addr().String()
}

// preciseKVConfig is a precise-prefix pool of n endpoints (growAddr's
// addresses) whose KV subscriptions all go to dead (deadKVAddr).
func preciseKVConfig(n int, dead string) Config {
	cfg := eppBenchConfig(sched.PrecisePrefix, n, 1)
	for i := range cfg.Endpoints {
		cfg.Endpoints[i].KVEvents = &KVEventsConfig{Endpoint: dead}
	}
	return cfg
}

// waitKVStarted waits until the KV subscription of every endpoint of g
// (and of feed extra, if any) has started (reset its appliers once); what
// is fed after that stays.
func waitKVStarted(t *testing.T, g *Gateway, extra *kvFeed) {
	t.Helper()
	st := g.state.Load()
	feeds := []*kvFeed{}
	for _, ep := range st.endpoints {
		feeds = append(feeds, st.feeds[ep].kv)
	}
	if extra != nil {
		feeds = append(feeds, extra)
	}
	deadline := time.Now().Add(30 * time.Second)
	for i, f := range feeds {
		for f.sub.Stats().Resets == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("feed %d: the subscription never started", i)
			}
			time.Sleep(time.Millisecond)
		}
	}
}

// storeKV feeds endpoint e's KV subscription a BlockStored of toks (whole
// blocks) in medium ("" for GPU), engine keys salted by s.
func storeKV(f *kvFeed, s int, toks []uint32, medium string) {
	eng := make([]uint64, len(toks)/prefix.DefaultBlockSize)
	for k := range eng {
		eng[k] = uint64(s)<<32 | uint64(k+1)
	}
	f.KVBatch(1, &kvevents.Batch{Events: []kvevents.Event{{Type: kvevents.BlockStored,
		BlockHashes: eng, TokenIDs: toks, BlockSize: prefix.DefaultBlockSize, Medium: medium}}})
}

// TestReloadGrowKeepsPrecise reproduces issue 17's scale-up: a
// precise-prefix pool of 64 endpoints whose engines' KV events put
// prompts on endpoints 0, 10 and 63; a reload adds a 65th endpoint (the
// index's second group). The prompts still route to the endpoints that
// hold them, the precise index is the same object holding the same blocks,
// and the new endpoint starts empty and routes on its own events. A second
// reload removes endpoint 20 and adds two: the one that takes slot 20
// inherits none of endpoint 20's blocks.
func TestReloadGrowKeepsPrecise(t *testing.T) {
	const shared, total = 1024, 1100 // tokens the engine stored, and of the prompt
	dead := deadKVAddr(t)
	cfg := eppBenchConfig(sched.PrecisePrefix, 64, 1)
	for i := range cfg.Endpoints {
		cfg.Endpoints[i].KVEvents = &KVEventsConfig{Endpoint: dead}
	}
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ix := g.PreciseIndex("m0")
	policy := g.state.Load().pools["m0"].policy
	if ix.Endpoints() != 64 {
		t.Fatalf("precise index of %d slots", ix.Endpoints())
	}
	waitKVStarted(t, g, nil)
	homes := []int{0, 10, 20, 63}
	for s, e := range homes {
		storeKV(kvFeedOf(g, e), s, growPrompt(s, shared), "")
		if got := growPick(t, g, growPrompt(s, total)); got != growAddr(e) {
			t.Fatalf("before the reload: prompt %d routed to %s, its blocks are on %s", s, got, growAddr(e))
		}
	}
	blocks := ix.Stats().Blocks

	grown := cfg
	grown.Endpoints = append(append([]EndpointConfig(nil), cfg.Endpoints...), eppBenchConfig(sched.PrecisePrefix, 65, 1).Endpoints[64])
	grown.Endpoints[64].KVEvents = &KVEventsConfig{Endpoint: dead}
	if err := g.Reload(grown); err != nil {
		t.Fatal(err)
	}
	for s, e := range homes {
		if got := growPick(t, g, growPrompt(s, total+16)); got != growAddr(e) {
			t.Fatalf("after the reload to 65 endpoints: prompt %d routed to %s, its blocks are on %s", s, got, growAddr(e))
		}
	}
	p := g.state.Load().pools["m0"]
	if g.PreciseIndex("m0") != ix || p.policy != policy || ix.Endpoints() != 128 || ix.Groups() != 2 {
		t.Fatalf("after the reload: index kept %v (%d slots), policy kept %v", g.PreciseIndex("m0") == ix, ix.Endpoints(), p.policy == policy)
	}
	if ix.Stats().Blocks != blocks || ix.Len(64, prefix.MediumGPU) != 0 {
		t.Fatalf("after the reload: %d blocks (%d before), %d on the new endpoint", ix.Stats().Blocks, blocks, ix.Len(64, prefix.MediumGPU))
	}
	waitKVStarted(t, g, nil)
	storeKV(kvFeedOf(g, 64), 9, growPrompt(9, shared), "")
	if got := growPick(t, g, growPrompt(9, total)); got != growAddr(64) {
		t.Fatalf("the new endpoint's own prompt routed to %s", got)
	}

	// Endpoint 20 leaves, two arrive: the first takes slot 20, forgotten.
	moved := append([]EndpointConfig(nil), grown.Endpoints[:20]...)
	moved = append(moved, grown.Endpoints[21:]...)
	for _, i := range []int{65, 66} {
		ec := eppBenchConfig(sched.PrecisePrefix, 67, 1).Endpoints[i]
		ec.KVEvents = &KVEventsConfig{Endpoint: dead}
		moved = append(moved, ec)
	}
	grown.Endpoints = moved
	if err := g.Reload(grown); err != nil {
		t.Fatal(err)
	}
	p = g.state.Load().pools["m0"]
	u20, _ := normalizeURL(moved[len(moved)-2].URL)
	u65, _ := normalizeURL(moved[len(moved)-1].URL)
	if p.endpoints[20].name != u20 || p.endpoints[65].name != u65 {
		t.Fatalf("slots 20 and 65: %s, %s; want %s, %s", p.endpoints[20].name, p.endpoints[65].name, u20, u65)
	}
	h20 := prefix.Hashes(nil, growPrompt(2, shared), prefix.DefaultBlockSize, prefix.Seed("m0\x00"))
	if got := ix.MatchEndpoint(h20, prefix.MediumGPU, 20); got != 0 || ix.Len(20, prefix.MediumGPU) != 0 {
		t.Fatalf("slot 20's new endpoint holds %d blocks of the one that left (%d in all)", got, ix.Len(20, prefix.MediumGPU))
	}
	for s, e := range homes {
		if e == 20 {
			continue
		}
		if got := growPick(t, g, growPrompt(s, total+32)); got != growAddr(e) {
			t.Fatalf("after the second reload: prompt %d routed to %s, its blocks are on %s", s, got, growAddr(e))
		}
	}
}

// TestReloadGrowKeepsApproximate: a cache-aware pool of 64 endpoints
// (the approximate index only) routes 6 prompts; a reload adds a 65th
// endpoint; each prompt, asked again in reverse order, goes where it went,
// as the policy (and its index) is kept and grown, not rebuilt.
func TestReloadGrowKeepsApproximate(t *testing.T) {
	cfg := eppBenchConfig(sched.CacheAware, 64, 1)
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	policy := g.state.Load().pools["m0"].policy
	homes := make([]string, 6)
	for s := range homes {
		homes[s] = growPick(t, g, growPrompt(s, 1100))
	}
	grown := cfg
	grown.Endpoints = eppBenchConfig(sched.CacheAware, 65, 1).Endpoints
	if err := g.Reload(grown); err != nil {
		t.Fatal(err)
	}
	// In reverse order: a policy's n-th decision draws its ties from a
	// stream of its seed and n (sched.Config.Seed), so a new policy would
	// repeat the old one's draws in the same order.
	for s := len(homes) - 1; s >= 0; s-- {
		if got := growPick(t, g, growPrompt(s, 1100+16)); got != homes[s] {
			t.Fatalf("after the reload to 65 endpoints: prompt %d routed to %s, before to %s", s, got, homes[s])
		}
	}
	if p := g.state.Load().pools["m0"]; p.policy != policy || p.policySlots != 128 {
		t.Fatalf("after the reload: policy kept %v, %d slots", p.policy == policy, p.policySlots)
	}
}

// policyTiers is the tiers policy prices (sched.Profile.Tiers).
func policyTiers(t *testing.T, policy sched.Policy) *sched.Tiers {
	t.Helper()
	pt, ok := policy.(interface{ Tiers() *sched.Tiers })
	if !ok {
		t.Fatalf("policy %T tells no tiers", policy)
	}
	return pt.Tiers()
}

// TestReloadTieredKeepsPolicy: a cache-aware pool of 8 endpoints with KV
// tiers (kv_events.tiers: a priced CPU tier) routes 6 prompts; a pod
// joins, then one leaves, then an endpoint's CPU bandwidth changes: after
// each reload every prompt still goes where it went (those of the endpoint
// that left aside), the policy is the same object, and it prices the
// pool's new tiers (one entry per slot, the changed price). Until
// 2026-12-05 the policy of a pool with tiers was rebuilt at every change
// of its endpoint count or prices (sched.Tiers changed length), and its
// approximate index, pins and sessions were lost: routing went cold.
func TestReloadTieredKeepsPolicy(t *testing.T) {
	dead := deadKVAddr(t)
	tiered := func(n int) Config {
		cfg := eppBenchConfig(sched.CacheAware, n, 1)
		for i := range cfg.Endpoints {
			cfg.Endpoints[i].KVEvents = &KVEventsConfig{Endpoint: dead, Tiers: &KVTiersConfig{BlockBytes: 5242880,
				CPU: &KVTierConfig{Blocks: 4000, Bandwidth: 200e9, Latency: 100 * time.Microsecond}}}
		}
		return cfg
	}
	cfg := tiered(8)
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	p := g.state.Load().pools["m0"]
	policy := p.policy
	if p.tiers == nil || policyTiers(t, policy) != p.tiers {
		t.Fatal("the pool has no tiers, or its policy prices others")
	}
	homes := make([]string, 6)
	for s := range homes {
		homes[s] = growPick(t, g, growPrompt(s, 1100))
	}
	check := func(stage string, gone string, ask int) {
		t.Helper()
		// In reverse order: a new policy would repeat the old one's draws
		// in the same order (TestReloadGrowKeepsApproximate).
		for s := len(homes) - 1; s >= 0; s-- {
			if homes[s] == gone {
				continue
			}
			if got := growPick(t, g, growPrompt(s, 1100+ask)); got != homes[s] {
				t.Fatalf("%s: prompt %d routed to %s, before to %s", stage, s, got, homes[s])
			}
		}
		p := g.state.Load().pools["m0"]
		if p.policy != policy {
			t.Fatalf("%s: the policy was rebuilt", stage)
		}
		if got := policyTiers(t, policy); got != p.tiers || len(got.LoadSeconds) != len(p.endpoints) {
			t.Fatalf("%s: the policy prices %d slots, the pool has %d", stage, len(got.LoadSeconds), len(p.endpoints))
		}
	}

	joined := tiered(9)
	if err := g.Reload(joined); err != nil {
		t.Fatal(err)
	}
	check("a pod joined", "", 16)

	left := joined
	left.Endpoints = append(append([]EndpointConfig(nil), joined.Endpoints[:3]...), joined.Endpoints[4:]...)
	if err := g.Reload(left); err != nil {
		t.Fatal(err)
	}
	check("a pod left", growAddr(3), 32)

	priced := left
	priced.Endpoints = slices.Clone(left.Endpoints)
	kv := *priced.Endpoints[0].KVEvents
	tiers := *kv.Tiers
	cpu := *tiers.CPU
	cpu.Bandwidth = 100e9
	tiers.CPU, kv.Tiers = &cpu, &tiers
	priced.Endpoints[0].KVEvents = &kv
	if err := g.Reload(priced); err != nil {
		t.Fatal(err)
	}
	check("a price changed", growAddr(3), 48)
	if got := policyTiers(t, policy).LoadSeconds[0][prefix.MediumCPU]; got != 5242880/100e9 {
		t.Fatalf("the policy prices a CPU block of endpoint 0 at %g s, want %g", got, 5242880/100e9)
	}
}

// TestReloadGrowMovesStore: a precise pool of 63 endpoints with a kv_store
// (slot 63, the index's last); a reload adds a 64th endpoint, which takes
// slot 63: the index grows to 128 slots and the store's blocks move to
// slot 127 with it, the new endpoint starts empty, and the policy is told
// the store's new slot.
func TestReloadGrowMovesStore(t *testing.T) {
	const shared = 1024
	dead := deadKVAddr(t)
	cfg := eppBenchConfig(sched.PrecisePrefix, 63, 1)
	for i := range cfg.Endpoints {
		cfg.Endpoints[i].KVEvents = &KVEventsConfig{Endpoint: dead}
	}
	cfg.KVStores = map[string]KVStoreConfig{"m0": {Endpoint: dead, Blocks: 1000}}
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ix := g.PreciseIndex("m0")
	store := g.state.Load().stores["m0"]
	policy := g.state.Load().pools["m0"].policy
	waitKVStarted(t, g, store)
	storeKV(store, 1, growPrompt(1, shared), "REMOTE")
	storeKV(kvFeedOf(g, 5), 2, growPrompt(2, shared), "")
	h1 := prefix.Hashes(nil, growPrompt(1, shared), prefix.DefaultBlockSize, prefix.Seed("m0\x00"))
	h2 := prefix.Hashes(nil, growPrompt(2, shared), prefix.DefaultBlockSize, prefix.Seed("m0\x00"))
	if got := ix.MatchEndpoint(h1, prefix.MediumRemote, 63); got != len(h1) {
		t.Fatalf("the store's slot holds %d of %d blocks", got, len(h1))
	}

	grown := cfg
	grown.Endpoints = eppBenchConfig(sched.PrecisePrefix, 64, 1).Endpoints
	for i := range grown.Endpoints {
		grown.Endpoints[i].KVEvents = &KVEventsConfig{Endpoint: dead}
	}
	if err := g.Reload(grown); err != nil {
		t.Fatal(err)
	}
	p := g.state.Load().pools["m0"]
	if got := g.PreciseIndex("m0").MatchEndpoint(h1, prefix.MediumRemote, p.storeSlot()); got != len(h1) {
		t.Fatalf("after the reload the store's slot %d holds %d of its %d blocks", p.storeSlot(), got, len(h1))
	}
	if g.PreciseIndex("m0") != ix || ix.Endpoints() != 128 || p.storeSlot() != 127 || p.tiers == nil || p.tiers.Remote != 127 {
		t.Fatalf("after the reload: index kept %v, %d slots, store slot %d", g.PreciseIndex("m0") == ix, ix.Endpoints(), p.storeSlot())
	}
	// The policy is kept (its approximate index with it) and prices the
	// store's new slot.
	if p.policy != policy || policyTiers(t, policy).Remote != 127 {
		t.Fatalf("after the reload: policy kept %v, its store slot %d", p.policy == policy, policyTiers(t, p.policy).Remote)
	}
	if ix.EndpointStats(127).Capacity != 1000 || ix.EndpointStats(63).Capacity != p.pcap[63] {
		t.Fatalf("capacities: store %d, slot 63 %d (want %d)", ix.EndpointStats(127).Capacity, ix.EndpointStats(63).Capacity, p.pcap[63])
	}
	for m := range prefix.Medium(prefix.NumMedia) {
		if ix.Len(63, m) != 0 {
			t.Fatalf("the new endpoint at slot 63 holds %d blocks in %v", ix.Len(63, m), m)
		}
	}
	if got := ix.MatchEndpoint(h2, prefix.MediumGPU, 5); got != len(h2) {
		t.Fatalf("endpoint 5 holds %d of %d blocks after the reload", got, len(h2))
	}
	// The store's next events land in its new slot.
	storeKV(store, 3, growPrompt(3, shared), "REMOTE")
	h3 := prefix.Hashes(nil, growPrompt(3, shared), prefix.DefaultBlockSize, prefix.Seed("m0\x00"))
	if ix.MatchEndpoint(h3, prefix.MediumRemote, 127) != len(h3) || ix.MatchEndpoint(h3, prefix.MediumRemote, 63) != 0 {
		t.Fatal("the store's events after the reload did not go to its new slot")
	}
}

// TestReloadGrowUnderLoad (run with -race): picks and KV-event batches
// flow while three reloads grow a precise-prefix pool from 64 to 65, 130
// and 200 endpoints; afterwards a prompt stored at endpoint 10 before the
// first reload still routes there.
func TestReloadGrowUnderLoad(t *testing.T) {
	const shared = 1024
	dead := deadKVAddr(t)
	config := func(n int) Config { return preciseKVConfig(n, dead) }
	g, err := New(context.Background(), config(64), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	waitKVStarted(t, g, nil)
	storeKV(kvFeedOf(g, 10), 1, growPrompt(1, shared), "")
	feeds := make([]*kvFeed, 64)
	for i := range feeds {
		feeds[i] = kvFeedOf(g, i)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // picks of prompts nobody stored
		defer wg.Done()
		for k := 0; ; k++ {
			select {
			case <-stop:
				return
			default:
			}
			pk, ref := g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathCompletions,
				Header: http.Header{}, Body: growBody(growPrompt(100+k%7, 600))})
			if ref != nil {
				t.Errorf("refused during the reloads: %d %s", ref.Status, ref.Body)
				return
			}
			pk.Done()
		}
	}()
	go func() { // events of the first 64 engines (not endpoint 10)
		defer wg.Done()
		for k := 0; ; k++ {
			select {
			case <-stop:
				return
			default:
			}
			e := k % 64
			if e == 10 {
				continue
			}
			if k%5 == 4 {
				feeds[e].KVBatch(uint64(k), &kvevents.Batch{Events: []kvevents.Event{{Type: kvevents.AllBlocksCleared}}})
				continue
			}
			storeKV(feeds[e], 200+k%11, growPrompt(200+k%11, 256), "")
		}
	}()
	for _, n := range []int{65, 130, 200} {
		if err := g.Reload(config(n)); err != nil {
			t.Error(err)
			break
		}
	}
	close(stop)
	wg.Wait()
	if ix := g.PreciseIndex("m0"); ix.Endpoints() != 256 || ix.Groups() != 4 {
		t.Fatalf("precise index of %d slots in %d groups", ix.Endpoints(), ix.Groups())
	}
	if got := growPick(t, g, growPrompt(1, shared+64)); got != growAddr(10) {
		t.Fatalf("after growing to 200 endpoints under load the prompt stored at endpoint 10 routed to %s", got)
	}
}
