package sched

import (
	"slices"
	"sync"
	"testing"

	"github.com/infergate/infergate/prefix"
)

func TestSplitTiers(t *testing.T) {
	for _, c := range []struct {
		m, want [NumTiers]int
		max     int
	}{
		{[NumTiers]int{4, 0, 0, 0}, [NumTiers]int{4, 0, 0, 0}, 10},
		{[NumTiers]int{4, 9, 0, 0}, [NumTiers]int{4, 5, 0, 0}, 10},  // the host tier continues the GPU's prefix
		{[NumTiers]int{4, 2, 7, 12}, [NumTiers]int{4, 0, 3, 3}, 10}, // capped at maxBlocks
		{[NumTiers]int{0, 0, 0, 6}, [NumTiers]int{0, 0, 0, 6}, 10},  // remote only
		{[NumTiers]int{8, 8, 8, 8}, [NumTiers]int{8, 0, 0, 0}, 10},  // write-through: all hold it, the GPU serves it
		{[NumTiers]int{5, 3, 0, 0}, [NumTiers]int{3, 0, 0, 0}, 3},   // at most prompt−1 tokens
	} {
		if got := SplitTiers(c.m, c.max); got != c.want {
			t.Errorf("SplitTiers(%v, %d) = %v, want %v", c.m, c.max, got, c.want)
		}
	}
}

func TestParseTierWeights(t *testing.T) {
	w, err := parseTierWeights(map[string]float64{"cpu": 0.8})
	if err != nil || *w != (TierWeights{1, 0.8, 0, 0}) {
		t.Fatalf("llm-d weights: %v, %v", w, err)
	}
	if w, err := parseTierWeights(nil); w != nil || err != nil {
		t.Fatalf("none: %v, %v", w, err)
	}
	for _, bad := range []map[string]float64{{"cpu": 1.5}, {"nvme": 0.5}, {"gpu": -1}} {
		if _, err := parseTierWeights(bad); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

// tierIndex is a precise index of n endpoints (and the remote store as
// endpoint n) holding what hold says: per endpoint and medium, the number
// of leading blocks of prompt.
func tierIndex(t *testing.T, n int, prompt []uint32, hold map[[2]int]int) *prefix.PreciseIndex {
	t.Helper()
	ix, err := prefix.NewPreciseIndex(n+1, 16)
	if err != nil {
		t.Fatal(err)
	}
	hashes := prefix.Hashes(nil, prompt, 16, 0)
	for k, blocks := range hold {
		e, m := k[0], prefix.Medium(k[1])
		// GPU events with tokens name the blocks; lower tiers store them
		// without (an offload) when the endpoint knows them, with tokens
		// otherwise (the remote store).
		if err := ix.Stored(e, m, hashes[:blocks], 0, false, prompt[:16*blocks], 0); err != nil {
			t.Fatal(err)
		}
	}
	return ix
}

func TestCostScorerPricesTiers(t *testing.T) {
	prompt := make([]uint32, 16*20+1)
	for i := range prompt {
		prompt[i] = uint32(i)
	}
	hashes := prefix.Hashes(nil, prompt, 16, 0)
	// Endpoint 0 holds 20 blocks on the GPU, endpoint 1 the same 20 in host
	// memory, endpoint 2 nothing but the remote store holds 20 for anyone.
	ix := tierIndex(t, 3, prompt, map[[2]int]int{
		{0, int(prefix.MediumGPU)}: 20, {1, int(prefix.MediumCPU)}: 20, {3, int(prefix.MediumRemote)}: 20,
	})
	tiers := func(hostSecondsPerBlock float64) *Tiers {
		tr := &Tiers{Source: ix, Remote: 3, LoadSeconds: make([][NumTiers]float64, 3), Latency: make([][NumTiers]float64, 3)}
		for e := range 3 {
			tr.LoadSeconds[e] = [NumTiers]float64{0, hostSecondsPerBlock, 0.002, 0.001}
		}
		return tr
	}
	// Each has 1000 tokens of prefill queued (0.1 s at the default 10k
	// tokens/s): the cost scorer's TTFT ratios compare queue, prefill and
	// load time.
	eps := []Endpoint{{Ready: true, PendingPrefillTokens: 1000}, {Ready: true, PendingPrefillTokens: 1000}, {Ready: true, PendingPrefillTokens: 1000}}
	req := &Request{Hashes: hashes, PromptTokens: len(prompt)}
	scores := func(pc ProfileConfig, tr *Tiers) (d Decision, s []float64) {
		cfg := Config{Policy: "t", Profiles: map[string]ProfileConfig{"t": pc}}
		p := newProfileT(t, cfg, Pool{Capacity: caps(3, 1000), Precise: ix.On(prefix.MediumGPU), Tiers: tr})
		c := &Cycle{p: p, Req: req, Eps: eps, matched: make([]int, 3), other: make([]int, 3)}
		s = make([]float64, 3)
		p.scorers[0].Scorer.Score(c, []int{0, 1, 2}, s)
		return p.Pick(req, eps), s
	}
	// Priced: a cheap host load (2 ms in all) costs little, the remote
	// load (20 ms) more.
	pc := ProfileConfig{Scorers: []ScorerConfig{{Type: ScorerCost, Weight: 1}, {Type: ScorerPrecisePrefix, Weight: 0}}}
	d, s := scores(pc, tiers(0.0001))
	if !(s[0] == 1 && s[1] > 0.97 && s[1] < 1 && s[2] < s[1] && s[2] > 0.8) {
		t.Fatalf("priced scores %v", s)
	}
	if d.TierBlocks != [NumTiers]int{20, 0, 0, 0} || d.MatchedBlocks != 20 {
		t.Fatalf("decision %+v", d)
	}
	// A slow host tier (1 s a block) is worth less than recomputing.
	if _, s = scores(pc, tiers(1)); !(s[1] < s[2]) {
		t.Fatalf("a slow host tier scored %v", s)
	}
	// llm-d's fixed weights: the host hit is worth 0.8 of a GPU hit and
	// the remote one nothing, whatever the load cost.
	pc.TierWeights = map[string]float64{"gpu": 1, "cpu": 0.8}
	_, s1 := scores(pc, tiers(0.0001))
	_, s2 := scores(pc, tiers(1))
	if s1[1] != s2[1] || !(s1[1] < 1 && s1[2] < s1[1]) {
		t.Fatalf("fixed weights %v then %v", s1, s2)
	}
}

// TestSetTiers: a profile told new tiers (a gateway reload: an endpoint
// joined, a price changed) prices its next decisions by them, keeping what
// it learnt; SetTiers is safe under concurrent picks (run with -race).
func TestSetTiers(t *testing.T) {
	prompt := make([]uint32, 16*20+1)
	for i := range prompt {
		prompt[i] = uint32(i)
	}
	hashes := prefix.Hashes(nil, prompt, 16, 0)
	// Endpoint 0 holds the prompt in host memory; endpoint 1 nothing, but
	// the remote store (slot 2) holds it for anyone.
	ix := tierIndex(t, 2, prompt, map[[2]int]int{{0, int(prefix.MediumCPU)}: 20, {2, int(prefix.MediumRemote)}: 20})
	tiers := func(hostSecondsPerBlock float64) *Tiers {
		tr := &Tiers{Source: ix, Remote: 2, LoadSeconds: make([][NumTiers]float64, 2), Latency: make([][NumTiers]float64, 2)}
		for e := range 2 {
			tr.LoadSeconds[e] = [NumTiers]float64{0, hostSecondsPerBlock, 0.002, 0.001}
		}
		return tr
	}
	cheap, slow := tiers(0.0001), tiers(1)
	cfg := Config{Policy: "t", Profiles: map[string]ProfileConfig{"t": {Scorers: []ScorerConfig{
		{Type: ScorerCost, Weight: 1}, {Type: ScorerPrecisePrefix, Weight: 0}}}}}
	p := newProfileT(t, cfg, Pool{Capacity: caps(2, 1000), Precise: ix.On(prefix.MediumGPU), Tiers: cheap})
	eps := []Endpoint{{Ready: true, PendingPrefillTokens: 1000}, {Ready: true, PendingPrefillTokens: 1000}}
	req := &Request{Hashes: hashes, PromptTokens: len(prompt)}
	if d := p.Pick(req, eps); d.Endpoint != 0 || d.TierBlocks[prefix.MediumCPU] != 20 {
		t.Fatalf("a cheap host tier: %+v", d)
	}
	// A host tier slower than recomputing: the remote store's copy wins.
	p.SetTiers(slow)
	if p.Tiers() != slow {
		t.Fatal("Tiers is not what SetTiers told")
	}
	if d := p.Pick(req, eps); d.Endpoint != 1 || d.TierBlocks[prefix.MediumRemote] != 20 {
		t.Fatalf("a slow host tier: %+v", d)
	}
	// Without a remote tier (the store removed) endpoint 1 has nothing.
	noStore := *slow
	noStore.Remote = -1
	p.SetTiers(&noStore)
	if d := p.Pick(req, eps); d.TierBlocks[prefix.MediumRemote] != 0 {
		t.Fatalf("without the store: %+v", d)
	}

	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Go(func() {
		for k := 0; ; k++ {
			select {
			case <-stop:
				return
			default:
			}
			p.SetTiers([]*Tiers{cheap, slow}[k%2])
		}
	})
	for range 2000 {
		if d := p.Pick(req, eps); d.Endpoint < 0 || d.Endpoint > 1 {
			t.Errorf("picked %d", d.Endpoint)
			break
		}
	}
	close(stop)
	wg.Wait()
}

// TestTiersSplitWalksHoles: a tier that lost a prompt's first blocks but
// kept the next ones still serves them after a slower tier served the
// first: the split walks on past the tiers' leading prefixes block by
// block, as the engine's lookup does, so the total is the engine's. (Inside
// the leading prefixes a slower tier's may be credited with blocks a faster
// tier also holds past a hole: the total is exact, the load time an upper
// bound.)
func TestTiersSplitWalksHoles(t *testing.T) {
	prompt := make([]uint32, 16*12+1)
	for i := range prompt {
		prompt[i] = uint32(3 * i)
	}
	hashes := prefix.Hashes(nil, prompt, 16, 0)
	ix, err := prefix.NewPreciseIndex(2, 16)
	if err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	// Endpoint 0 held blocks 0-9 in host memory and lost 0-4; the remote
	// store (endpoint 1) holds blocks 0-4.
	must(ix.Stored(0, prefix.MediumCPU, hashes[:10], 0, false, prompt[:160], 0))
	ix.Removed(0, prefix.MediumCPU, hashes[:5])
	must(ix.Stored(1, prefix.MediumRemote, hashes[:5], 0, false, prompt[:80], 0))
	tr := &Tiers{Source: ix, Remote: 1}
	out := make([][NumTiers]int, 1)
	tr.Split(hashes, 12, []int{0}, out, nil)
	// Blocks 0-4 from the remote store, then 5-9 from host memory.
	if want := [NumTiers]int{0, 5, 0, 5}; out[0] != want {
		t.Fatalf("split %v, want %v", out[0], want)
	}
	// Capped at maxBlocks.
	tr.Split(hashes, 7, []int{0}, out, nil)
	if want := [NumTiers]int{0, 2, 0, 5}; out[0] != want {
		t.Fatalf("capped split %v, want %v", out[0], want)
	}
}

// TestTiersSplitWalksHolesOver64: the walk of TestTiersSplitWalksHoles in a
// pool of 130 endpoints (three groups of 64 in the precise index), the
// remote store in slot 130 (group 2): endpoints 0, 64 and 129 held blocks
// 0-9 in host memory and lost 0-4, so each takes 0-4 from the store and
// 5-9 from its host memory; every other endpoint takes 0-4 from the store
// and stops.
func TestTiersSplitWalksHolesOver64(t *testing.T) {
	prompt := make([]uint32, 16*12+1)
	for i := range prompt {
		prompt[i] = uint32(3 * i)
	}
	hashes := prefix.Hashes(nil, prompt, 16, 0)
	const n = 130
	ix, err := prefix.NewPreciseIndex(n+1, 16)
	if err != nil {
		t.Fatal(err)
	}
	holed := []int{0, 64, 129}
	for _, e := range holed {
		if err := ix.Stored(e, prefix.MediumCPU, hashes[:10], 0, false, prompt[:160], 0); err != nil {
			t.Fatal(err)
		}
		ix.Removed(e, prefix.MediumCPU, hashes[:5])
	}
	if err := ix.Stored(n, prefix.MediumRemote, hashes[:5], 0, false, prompt[:80], 0); err != nil {
		t.Fatal(err)
	}
	tr := &Tiers{Source: ix, Remote: n}
	out := make([][NumTiers]int, n)
	tr.Split(hashes, 12, make([]int, n), out, nil)
	for e := range n {
		want := [NumTiers]int{0, 0, 0, 5}
		if slices.Contains(holed, e) {
			want = [NumTiers]int{0, 5, 0, 5}
		}
		if out[e] != want {
			t.Fatalf("endpoint %d: split %v, want %v", e, out[e], want)
		}
	}
}
