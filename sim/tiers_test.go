package sim

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/infergate/infergate/kvevents/kvevent"
	"github.com/infergate/infergate/prefix"
)

func TestParseTierSize(t *testing.T) {
	for _, c := range []struct {
		in   string
		want TierSize
	}{
		{"0", TierSize{}},
		{"4x", TierSize{Multiple: 4}},
		{"0.25x", TierSize{Multiple: 0.25}},
		{"512GiB", TierSize{Bytes: 512 << 30}},
		{"1.5TB", TierSize{Bytes: 1.5e12}},
		{"3e11", TierSize{Bytes: 3e11}},
		{" 2 MiB ", TierSize{Bytes: 2 << 20}},
	} {
		got, err := ParseTierSize(c.in)
		if err != nil || got != c.want {
			t.Errorf("ParseTierSize(%q) = %+v, %v; want %+v", c.in, got, err, c.want)
		}
		back, err := ParseTierSize(got.String())
		if err != nil || back != got {
			t.Errorf("%q: String %q reads back as %+v, %v", c.in, got.String(), back, err)
		}
	}
	for _, bad := range []string{"", "x", "-1", "-2x", "4y", "NaN", "Infx", "1e400"} {
		if _, err := ParseTierSize(bad); err == nil {
			t.Errorf("ParseTierSize(%q) accepted", bad)
		}
	}
}

func TestTierValidation(t *testing.T) {
	p := DefaultProfile()
	big := TierSize{Bytes: 2 * p.HostKVBytes}
	if err := (Config{Tiers: TiersConfig{Host: big}}).Validate(); !errors.Is(err, ErrTierConfig) {
		t.Fatalf("a host tier beyond host_kv_bytes: %v", err)
	}
	if err := (Config{Tiers: TiersConfig{Host: TierSize{Multiple: 4}, Disk: TierSize{Multiple: 16}}}).Validate(); err != nil {
		t.Fatal(err)
	}
	cpu := Profiles()["tiny-llama-cpu-ollama"]
	if err := (Config{Profile: cpu, Tiers: TiersConfig{Host: TierSize{Multiple: 1}}}).Validate(); !errors.Is(err, ErrTierConfig) {
		t.Fatalf("a host tier on a profile without host_bandwidth: %v", err)
	}
	if err := (Config{Tiers: TiersConfig{Host: TierSize{Bytes: 1}}}).Validate(); !errors.Is(err, ErrTierConfig) {
		t.Fatalf("a host tier smaller than a block: %v", err)
	}
}

// tieredEngine is a small engine (8 GPU blocks of 16 tokens) of the default
// profile with a host tier of hostBlocks blocks.
func tieredEngine(hostBlocks int, remote RemoteTier) *Engine {
	c := Config{NumBlocks: 8, MaxNumBatchedTokens: 64, KVEvents: true}
	c.Tiers.Host = TierSize{Bytes: float64(hostBlocks) * c.BlockBytes()}
	c.Tiers.Remote = remote
	return NewEngine(c)
}

func TestHostTierHitAfterGPUEviction(t *testing.T) {
	e := tieredEngine(6, nil)
	cfg := e.Config()
	a := seqTokens(1, 64) // 4 full blocks
	must(t, e.Add(&Request{ID: "a", Tokens: a, MaxTokens: 1}, 0))
	r := e.Step(0)
	// GPU store (with tokens), then the write-through to the host tier
	// (no tokens, no parent, medium CPU).
	var gpu, cpu []kvevent.Event
	for _, ev := range r.Events {
		if ev.Type != kvevent.BlockStored {
			continue
		}
		switch ev.Medium {
		case "":
			gpu = append(gpu, ev)
		case kvevent.MediumCPU:
			cpu = append(cpu, ev)
		}
	}
	if len(gpu) != 1 || len(gpu[0].TokenIDs) != 64 || len(cpu) != 1 || len(cpu[0].TokenIDs) != 0 || cpu[0].HasParent ||
		!slices.Equal(cpu[0].BlockHashes, gpu[0].BlockHashes) {
		t.Fatalf("events of the first step: %+v", r.Events)
	}
	now, _ := run(t, e, r.Duration)

	// b fills the GPU (7 blocks), evicting a's cached blocks there.
	must(t, e.Add(&Request{ID: "b", Tokens: seqTokens(500, 128), MaxTokens: 1}, now))
	now, _ = run(t, e, now)
	if got := e.CachedHashes(); len(got) != 8 {
		t.Fatalf("GPU holds %d hashes", len(got))
	}
	// The 6-block host tier kept the 6 most recently stored blocks, b's
	// last 6: a's are gone from every tier.
	st := e.Stats()
	if st.TierBlocks[TierHost] != 6 || st.TierCapacity[TierHost] != 6 {
		t.Fatalf("host tier holds %d of %d", st.TierBlocks[TierHost], st.TierCapacity[TierHost])
	}

	// A host tier big enough for both keeps a's blocks.
	e = tieredEngine(32, nil)
	must(t, e.Add(&Request{ID: "a", Tokens: a, MaxTokens: 1}, 0))
	now, _ = run(t, e, 0)
	must(t, e.Add(&Request{ID: "b", Tokens: seqTokens(500, 128), MaxTokens: 1}, now))
	now, _ = run(t, e, now)
	must(t, e.Add(&Request{ID: "a2", Tokens: a, MaxTokens: 2}, now))
	r = e.Step(now)
	if r.Duration != 0 || len(r.Outputs) != 0 {
		t.Fatalf("the step admitting a load ran work: %+v", r)
	}
	at, ok := e.NextLoad()
	want := now + cfg.Profile.HostLatency + time.Duration(3*cfg.BlockBytes()/(float64(cfg.Profile.TensorParallel)*cfg.Profile.HostBandwidth)*float64(time.Second))
	if !ok || at != want {
		t.Fatalf("NextLoad = %v, %v; want %v", at, ok, want)
	}
	if st := e.Stats(); st.Loading != 1 || st.LoadedBlocks != 3 {
		t.Fatalf("stats while loading: %+v", st)
	}
	// Stepping before the load ends does nothing.
	if r = e.Step(at - 1); r.Duration != 0 {
		t.Fatalf("ran before the load ended: %+v", r)
	}
	r = e.Step(at)
	if r.Cost.Tokens != 16 || r.Cost.AttnPairs != 16*(48+8.5) {
		t.Fatalf("after the load: cost %+v, want 16 tokens on 48 of context", r.Cost)
	}
	var stored bool
	for _, ev := range r.Events {
		stored = stored || (ev.Type == kvevent.BlockStored && ev.Medium == "" && len(ev.BlockHashes) == 3 && len(ev.TokenIDs) == 48)
	}
	if !stored {
		t.Fatalf("loaded blocks were not stored on the GPU: %+v", r.Events)
	}
	_, outs := run(t, e, at+r.Duration)
	o := append(r.Outputs, outs["a2"]...)
	if o[0].CachedTokens != 48 || o[0].TierTokens != [NumTiers]int{TierHost: 48} {
		t.Fatalf("a2: cached %d by tier %v", o[0].CachedTokens, o[0].TierTokens)
	}
	if o[0].Scheduled != at {
		t.Fatalf("a2 scheduled at %v, its load ended at %v", o[0].Scheduled, at)
	}
	st = e.Stats()
	if st.ExternalHits != 48 || st.TierHits[TierHost] != 48 || st.ExternalQueries != 64+128+64 || st.Loading != 0 {
		t.Fatalf("stats: %+v", st)
	}
	checkEngine(t, e)
}

func TestTierLinkQueuesLoads(t *testing.T) {
	e := tieredEngine(32, nil)
	cfg := e.Config()
	a, b := seqTokens(1, 33), seqTokens(200, 33) // 2 loadable blocks each
	must(t, e.Add(&Request{ID: "a", Tokens: a, MaxTokens: 1}, 0))
	must(t, e.Add(&Request{ID: "b", Tokens: b, MaxTokens: 1}, 0))
	now, _ := run(t, e, 0)
	must(t, e.Add(&Request{ID: "c", Tokens: seqTokens(900, 128), MaxTokens: 1}, now)) // evicts a and b on the GPU
	now, _ = run(t, e, now)
	must(t, e.Add(&Request{ID: "a2", Tokens: a, MaxTokens: 1}, now))
	must(t, e.Add(&Request{ID: "b2", Tokens: b, MaxTokens: 1}, now))
	e.Step(now)
	one := cfg.Profile.HostLatency + time.Duration(2*cfg.BlockBytes()/(float64(cfg.Profile.TensorParallel)*cfg.Profile.HostBandwidth)*float64(time.Second))
	var done []time.Duration
	for _, s := range e.waiting.buf[e.waiting.head:] {
		if !s.loading {
			t.Fatalf("%s is not loading", s.id)
		}
		done = append(done, s.loadDone)
	}
	if !slices.Equal(done, []time.Duration{now + one, now + 2*one}) {
		t.Fatalf("loads end at %v, want one after the other on the link (%v each)", done, one)
	}
}

func TestRemoteTierSharedAcrossEngines(t *testing.T) {
	store := NewRemoteStore(64, true)
	e1, e2 := tieredEngine(0, store), tieredEngine(0, store)
	prompt := seqTokens(1, 80) // 5 full blocks
	must(t, e1.Add(&Request{ID: "a", Tokens: prompt, MaxTokens: 1}, 0))
	_, _ = run(t, e1, 0)
	evs := store.TakeEvents()
	var hashes []uint64
	for i, ev := range evs {
		if ev.Type != kvevent.BlockStored || ev.Medium != kvevent.MediumRemote || len(ev.TokenIDs) != len(ev.BlockHashes)*16 {
			t.Fatalf("store event %d: %+v", i, ev)
		}
		if (i > 0) != ev.HasParent || (i > 0 && ev.ParentBlockHash != hashes[len(hashes)-1]) {
			t.Fatalf("store event %d parent: %+v", i, ev)
		}
		hashes = append(hashes, ev.BlockHashes...)
	}
	if want := prefix.Hashes(nil, prompt, 16, RootHash("", 0)); !slices.Equal(hashes, want) {
		t.Fatalf("stored %x, want %x", hashes, want)
	}
	// Another engine loads the first 4 blocks (79 tokens at most) from it.
	must(t, e2.Add(&Request{ID: "a", Tokens: prompt, MaxTokens: 1}, 0))
	_, outs := run(t, e2, 0)
	if o := outs["a"][0]; o.TierTokens != [NumTiers]int{TierRemote: 64} {
		t.Fatalf("second engine: %+v", o)
	}
	// Eviction is LRU and published.
	small := NewRemoteStore(2, true)
	small.Store(hashes[:3], 0, false, prompt[:48], 16, "")
	evs = small.TakeEvents()
	if len(evs) != 3 || evs[1].Type != kvevent.BlockRemoved || evs[1].BlockHashes[0] != hashes[0] || !small.Holds(hashes[2]) || small.Holds(hashes[0]) {
		t.Fatalf("evictions: %+v", evs)
	}
}

func TestTieredRandomizedInvariants(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	store := NewRemoteStore(48, true)
	c := Config{NumBlocks: 64, MaxNumBatchedTokens: 128, MaxNumSeqs: 8, KVEvents: true}
	c.Tiers = TiersConfig{Host: TierSize{Multiple: 0.5}, Disk: TierSize{Multiple: 1}, Remote: store}
	e := NewEngine(c)
	var live []string
	now := time.Duration(0)
	for step := 0; step < 20000; step++ {
		if rng.IntN(3) == 0 {
			id := string(rune('A'+step%26)) + string(rune('0'+step/26%10)) + string(rune('a'+step/260%26))
			prompt := concat(seqTokens(rng.IntN(4), rng.IntN(100)), seqTokens(10+rng.IntN(50), 1+rng.IntN(200)))
			if err := e.Add(&Request{ID: id, Tokens: prompt, MaxTokens: 1 + rng.IntN(300)}, now); err == nil {
				live = append(live, id)
			} else if !errors.Is(err, ErrNoCapacity) && !errors.Is(err, ErrDuplicateID) {
				t.Fatal(err)
			}
		}
		if rng.IntN(20) == 0 && len(live) > 0 {
			i := rng.IntN(len(live))
			e.Abort(live[i])
			live = slices.Delete(live, i, i+1)
		}
		r := e.Step(now)
		now += r.Duration
		if r.Duration == 0 {
			if at, ok := e.NextLoad(); ok {
				now = at
			}
		}
		checkEngine(t, e)
		if st := e.Stats(); st.TierBlocks[TierHost] > st.TierCapacity[TierHost] || st.TierBlocks[TierDisk] > st.TierCapacity[TierDisk] || store.Len() > 48 {
			t.Fatalf("a tier exceeds its capacity: %+v", st)
		}
	}
	_, _ = run(t, e, now)
	checkEngine(t, e)
	if e.pool.numFree != 64 {
		t.Fatalf("blocks leaked: %d free of 64", e.pool.numFree)
	}
	st := e.Stats()
	for tier := TierGPU; tier < NumTiers; tier++ {
		if st.TierHits[tier] == 0 {
			t.Errorf("no hit in tier %s: %+v", tier, st.TierHits)
		}
	}
	if st.Preemptions == 0 {
		t.Error("test did not exercise preemption")
	}
}
