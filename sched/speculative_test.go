package sched

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/infergate/infergate/prefix"
	"gopkg.in/yaml.v3"
)

// TestCommonRun checks the bisection against a linear scan on chained
// hashes of prompts that share a random leading run, at every floor.
func TestCommonRun(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 300 {
		n, m := 1+r.IntN(40), 1+r.IntN(40)
		shared := 1 + r.IntN(min(n, m)) // tokens' blocks in common (≥ 1)
		a := prefix.Hashes(nil, append(tokens(shared*16, 0), tokens((n-shared)*16, 1_000_000)...), 16, 0)
		b := prefix.Hashes(nil, append(tokens(shared*16, 0), tokens((m-shared)*16, 2_000_000)...), 16, 0)
		want := 0
		for want < min(len(a), len(b)) && a[want] == b[want] {
			want++
		}
		if want != shared {
			t.Fatalf("test setup: run %d, want %d", want, shared)
		}
		for floor := 0; floor <= min(len(a), len(b))+1; floor++ {
			if got := commonRun(a, b, floor); got != max(floor, want) {
				t.Fatalf("n %d m %d shared %d floor %d: commonRun %d, want %d", n, m, shared, floor, got, max(floor, want))
			}
		}
	}
}

// clock is a settable Pool.Now.
type clock struct{ t time.Duration }

func (c *clock) now() time.Duration { return c.t }

// specProfile is precise-prefix on a precise index that has heard no
// events (fm of zeros): what the gateway's index knows right after a burst
// of new prompts.
func specProfile(t *testing.T, cfg Config, c *clock) *Profile {
	t.Helper()
	return newProfileT(t, cfg, Pool{Capacity: caps(4, 100000), Precise: fm(0, 0, 0, 0), Now: c.now})
}

// TestSpeculativeBridgesEvents: a request sharing a just-routed prompt's
// prefix finds it on the chosen endpoint before any KV event, counted in
// Decision.MatchedBlocks (the gateway's prefill backlog subtracts it), until
// the TTL; without the TTL the precise match is 0.
func TestSpeculativeBridgesEvents(t *testing.T) {
	c := &clock{}
	p := specProfile(t, Config{Policy: PrecisePrefix}, c)
	eps := ready(4)
	system := tokens(1600, 0) // 100 blocks
	first := p.Pick(req(append(system, tokens(160, 1_000_000)...)), eps)
	if first.Endpoint < 0 || first.MatchedBlocks != 0 {
		t.Fatalf("first decision %+v, want an endpoint and no match", first)
	}
	eps[first.Endpoint].InFlight++
	c.t += DefaultSpeculativeTTL / 2
	d := p.Pick(req(append(system, tokens(160, 2_000_000)...)), eps)
	if d.Endpoint != first.Endpoint || d.MatchedBlocks != 100 {
		t.Fatalf("within the TTL: %+v, want endpoint %d with 100 blocks", d, first.Endpoint)
	}
	c.t += DefaultSpeculativeTTL
	d = p.Pick(req(append(system, tokens(160, 3_000_000)...)), eps)
	if d.MatchedBlocks != 0 {
		t.Fatalf("past the TTL: %+v, want no precise match", d)
	}

	// The same scorers without a TTL: the precise match stays 0.
	off := Config{Policy: "off", Profiles: map[string]ProfileConfig{"off": {
		Filters: builtinProfiles[PrecisePrefix].Filters,
		Scorers: builtinProfiles[PrecisePrefix].Scorers,
	}}}
	p = specProfile(t, off, c)
	eps = ready(4)
	first = p.Pick(req(append(system, tokens(160, 1_000_000)...)), eps)
	if d := p.Pick(req(append(system, tokens(160, 2_000_000)...)), eps); d.MatchedBlocks != 0 || p.spec != nil {
		t.Fatalf("without speculative_ttl: %+v, want no precise match", d)
	}
}

// TestSpeculativeKeepsTheLongerMatch: the overlay never lowers what the
// index knows, and takes the longest run among an endpoint's entries.
func TestSpeculativeKeepsTheLongerMatch(t *testing.T) {
	c := &clock{}
	p := newProfileT(t, Config{Policy: PrecisePrefix}, Pool{Capacity: caps(2, 100000), Precise: fm(7, 0), Now: c.now})
	s := p.spec
	short := req(tokens(320, 0)) // 20 blocks
	long := req(tokens(960, 0))  // 60 blocks, the same first 20
	s.Learn(&Cycle{Req: short}, 1)
	s.Learn(&Cycle{Req: long}, 1)
	s.Learn(&Cycle{Req: req(tokens(960, 5_000_000))}, 0) // another prompt
	m := make([]int, 2)
	s.Match(req(tokens(1600, 0)).Hashes, m)
	if m[0] != 7 || m[1] != 60 {
		t.Fatalf("matched %v, want [7 60]", m)
	}
	s.forget(1)
	s.Match(req(tokens(1600, 0)).Hashes, m)
	if m[0] != 7 || m[1] != 0 {
		t.Fatalf("after forget(1): matched %v, want [7 0]", m)
	}
}

// TestSpeculativeForget: an endpoint leaving rotation drops its entries.
func TestSpeculativeForget(t *testing.T) {
	c := &clock{}
	p := specProfile(t, Config{Policy: PrecisePrefix}, c)
	eps := ready(4)
	system := tokens(1600, 0)
	first := p.Pick(req(append(system, tokens(160, 1_000_000)...)), eps)
	p.Forget(first.Endpoint)
	if d := p.Pick(req(append(system, tokens(160, 2_000_000)...)), eps); d.MatchedBlocks != 0 {
		t.Fatalf("after Forget(%d): %+v, want no precise match", first.Endpoint, d)
	}
}

// TestSpeculativeConfig: the YAML key, its validation, and the pools and
// profiles it does not apply to.
func TestSpeculativeConfig(t *testing.T) {
	src := `
policy: mine
profiles:
  mine:
    scorers: [{type: precise-prefix, weight: 1}]
    speculative_ttl: 750ms
`
	var cfg Config
	dec := yaml.NewDecoder(strings.NewReader(src))
	dec.KnownFields(true)
	if err := dec.Decode(&cfg); err != nil {
		t.Fatal(err)
	}
	p := newProfileT(t, cfg, Pool{Capacity: caps(2, 100), Precise: fm(0, 0)})
	if p.spec == nil || p.spec.ttl != 750*time.Millisecond || p.match != MatchSource(p.spec) {
		t.Fatalf("speculative_ttl 750ms: spec %+v", p.spec)
	}
	bad := cfg
	bad.Profiles = map[string]ProfileConfig{"mine": {Scorers: cfg.Profiles["mine"].Scorers, SpeculativeTTL: -time.Second}}
	if _, err := NewPolicy(bad, Pool{Capacity: caps(2, 100), Precise: fm(0, 0)}); err == nil || !strings.Contains(err.Error(), "speculative_ttl") {
		t.Fatalf("negative speculative_ttl: %v", err)
	}
	// Profiles without a precise-prefix scorer, and pools with tiers, keep
	// no entries; nor do the other built-ins that read the precise index.
	noPrecise := Config{Policy: "np", Profiles: map[string]ProfileConfig{"np": {
		Scorers: []ScorerConfig{{Type: ScorerPrefix, Weight: 1}}, SpeculativeTTL: time.Second}}}
	if p := newProfileT(t, noPrecise, Pool{Capacity: caps(2, 100)}); p.spec != nil {
		t.Fatal("a profile without precise-prefix keeps speculative entries")
	}
	ix, err := prefix.NewPreciseIndex(2, 16)
	if err != nil {
		t.Fatal(err)
	}
	tr := &Tiers{Source: ix, Remote: -1, LoadSeconds: make([][NumTiers]float64, 2), Latency: make([][NumTiers]float64, 2)}
	if p := newProfileT(t, Config{Policy: PrecisePrefix}, Pool{Capacity: caps(2, 100), Precise: ix.On(prefix.MediumGPU), Tiers: tr}); p.spec != nil {
		t.Fatal("precise-prefix keeps speculative entries on a pool with tiers")
	}
	for _, name := range []string{LLMDTiered, DynamoTiered, TieredCost, Dynamo} {
		if p := newProfileT(t, Config{Policy: name}, Pool{Capacity: caps(2, 100), Precise: fm(0, 0)}); p.spec != nil {
			t.Fatalf("%s keeps speculative entries", name)
		}
	}
}

// TestSpeculativeAllocFree: a precise-prefix decision with the overlay
// full allocates nothing once every slot has held a prompt that long.
func TestSpeculativeAllocFree(t *testing.T) {
	if raceEnabled {
		t.Skip("sync.Pool drops items under the race detector")
	}
	c := &clock{}
	p := newProfileT(t, Config{Policy: PrecisePrefix}, Pool{Capacity: caps(16, 100000), Precise: fm(make([]int, 16)...), Now: c.now})
	eps := ready(16)
	r := req(tokens(12000, 1))
	for range specSlots + 64 {
		p.Pick(r, eps)
		p.Settle()
	}
	if n := testing.AllocsPerRun(50, func() { p.Pick(r, eps); p.Settle() }); n != 0 {
		t.Fatalf("Pick and Settle allocate %.0f times", n)
	}
}

// TestSpeculativeMemoryBound: the overlay's hashes are bounded by blocks,
// not by decisions. After 3 × specSlots decisions on prompts of
// specMaxBlocks blocks (64k tokens), per-slot storage held 1,024 × 4,096
// hashes (32 MiB) for good; the arena holds at most specArena (2 MiB), keeps
// the most recent prompts that fit whole, and drops the older ones rather
// than match them against hashes a later prompt wrote over.
func TestSpeculativeMemoryBound(t *testing.T) {
	c := &clock{}
	s := newSpeculative(fm(0, 0, 0, 0), time.Hour, c.now)
	prompt := func(i int) []uint64 { // distinct prompts: no shared run
		h := make([]uint64, specMaxBlocks)
		for j := range h {
			h[j] = uint64(i)<<32 | uint64(j+1)
		}
		return h
	}
	const picks = 3 * specSlots
	for i := range picks {
		s.Learn(&Cycle{Req: &Request{Hashes: prompt(i)}}, i%4)
	}
	bound := specArena*8 + int(unsafe.Sizeof(s.entries))
	if got := s.heldBytes(); got > bound {
		t.Fatalf("after %d picks of %d blocks: %d bytes held, bound %d", picks, specMaxBlocks, got, bound)
	}
	fit := specArena / specMaxBlocks // prompts the arena holds whole
	m := make([]int, 4)
	for i := picks - fit + 1; i < picks; i++ { // the newest fit−1 are live
		s.Match(prompt(i), m)
		if m[i%4] != specMaxBlocks {
			t.Fatalf("prompt %d of the newest %d: matched %v, want %d on endpoint %d", i, fit, m, specMaxBlocks, i%4)
		}
	}
	for _, i := range []int{0, specSlots, picks - 2*fit} { // written over
		s.Match(prompt(i), m)
		if m[i%4] != 0 {
			t.Fatalf("prompt %d, written over: matched %v, want 0", i, m)
		}
	}
	// A prompt shorter than the arena's free tail still lands whole; and
	// one longer than specMaxBlocks keeps its first specMaxBlocks.
	long := append(prompt(picks), prompt(picks+1)...)
	s.Learn(&Cycle{Req: &Request{Hashes: long}}, 2)
	s.Match(long, m)
	if m[2] != specMaxBlocks {
		t.Fatalf("long prompt: matched %v, want %d on endpoint 2", m, specMaxBlocks)
	}
}

// TestPrecisePrefixScorers: the built-in precise-prefix scores with the
// precise index alone (×2) where its match has speculative entries, and
// keeps the approximate index at ×0.5 beside the precise ×1.5 on a pool
// with tiers, which has none; a profile of the same name in the
// configuration is taken as written.
func TestPrecisePrefixScorers(t *testing.T) {
	weights := func(p *Profile) map[string]float64 {
		w := map[string]float64{}
		for _, s := range p.scorers {
			w[s.Scorer.Name()] = s.Weight
		}
		return w
	}
	p := newProfileT(t, Config{Policy: PrecisePrefix}, Pool{Capacity: caps(2, 100), Precise: fm(0, 0)})
	if w := weights(p); p.approx != nil || p.spec == nil || w[ScorerPrecisePrefix] != 2 || len(w) != 3 {
		t.Fatalf("without tiers: approximate index %v, speculative %v, scorers %v", p.approx != nil, p.spec != nil, w)
	}
	ix, err := prefix.NewPreciseIndex(2, 16)
	if err != nil {
		t.Fatal(err)
	}
	tr := &Tiers{Source: ix, Remote: -1, LoadSeconds: make([][NumTiers]float64, 2), Latency: make([][NumTiers]float64, 2)}
	p = newProfileT(t, Config{Policy: PrecisePrefix}, Pool{Capacity: caps(2, 100), Precise: ix.On(prefix.MediumGPU), Tiers: tr})
	if w := weights(p); p.approx == nil || p.spec != nil || w[ScorerPrecisePrefix] != 1.5 || w[ScorerPrefix] != 0.5 {
		t.Fatalf("with tiers: approximate index %v, speculative %v, scorers %v", p.approx != nil, p.spec != nil, w)
	}
	own := Config{Policy: PrecisePrefix, Profiles: map[string]ProfileConfig{PrecisePrefix: {
		Scorers: []ScorerConfig{{Type: ScorerPrecisePrefix, Weight: 1}, {Type: ScorerPrefix, Weight: 1}}}}}
	p = newProfileT(t, own, Pool{Capacity: caps(2, 100), Precise: ix.On(prefix.MediumGPU), Tiers: tr})
	if w := weights(p); w[ScorerPrecisePrefix] != 1 || w[ScorerPrefix] != 1 {
		t.Fatalf("configured profile: scorers %v", w)
	}
}

// TestSpeculativePeerLearn: a peer replica's decision (Profile.LearnPeer)
// counts in the precise match like this replica's own until the TTL, so
// that a follow-up routed here before the engine's KV events finds the
// peer's endpoint.
func TestSpeculativePeerLearn(t *testing.T) {
	c := &clock{}
	p := specProfile(t, Config{Policy: PrecisePrefix}, c)
	eps := ready(4)
	system := tokens(1600, 0) // 100 blocks
	p.LearnPeer(2, req(append(system, tokens(160, 1_000_000)...)).Hashes)
	if d := p.Pick(req(append(system, tokens(160, 2_000_000)...)), eps); d.Endpoint != 2 || d.MatchedBlocks != 100 {
		t.Fatalf("after a peer's decision on endpoint 2: %+v, want endpoint 2 with 100 blocks", d)
	}
	c.t += 2 * DefaultSpeculativeTTL
	next, written := p.spec.next, p.spec.written
	p.LearnPeer(1, nil) // no prompt: nothing held
	p.LearnPeer(-1, req(system).Hashes)
	if p.spec.next != next || p.spec.written != written {
		t.Fatalf("an empty prompt or a negative endpoint took a slot: next %d → %d, written %d → %d", next, p.spec.next, written, p.spec.written)
	}
	if d := p.Pick(req(append(system, tokens(160, 3_000_000)...)), eps); d.MatchedBlocks != 0 {
		t.Fatalf("past the TTL: %+v, want no precise match", d)
	}
}

// TestSpeculativePeerLearnConcurrent: peers' learns (the replica exchange's
// goroutine) and picks (request goroutines) on one precise-prefix profile
// at once; run under -race, as CI does.
func TestSpeculativePeerLearnConcurrent(t *testing.T) {
	c := &clock{}
	p := specProfile(t, Config{Policy: PrecisePrefix}, c)
	system := tokens(1600, 0)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 500 {
			p.LearnPeer(i%4, req(append(system, tokens(160, uint32(i+1)*10_000)...)).Hashes)
		}
	}()
	eps := ready(4)
	for i := range 500 {
		if d := p.Pick(req(append(system, tokens(160, uint32(i+1)*20_000_000)...)), eps); d.Endpoint < 0 {
			t.Fatalf("pick %d: no endpoint", i)
		}
	}
	<-done
	if d := p.Pick(req(append(system, tokens(160, 3)...)), eps); d.MatchedBlocks < 100 {
		t.Fatalf("after the peers' learns: %+v, want the system prompt's 100 blocks matched", d)
	}
}
