package sched

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/infergate/infergate/prefix"
)

// The max-score picker and the cost scorer as they were until 2026-12-05,
// a pass over every candidate per step (the picker with the Preferred
// endpoints' margin, PreferredTolerance, since 2026-12-06): the
// references the current ones must match to the bit (TestMaxScorePickerMatchesFullScan,
// TestCostScorerMatchesFullScan).

func fullScanMaxScorePick(tol float64, c *Cycle, cands []int, total []float64) int {
	if len(cands) == 0 {
		return -1
	}
	top := math.Inf(-1)
	for _, t := range total {
		top = max(top, t)
	}
	tol = max(tol, 1e-9)
	margin := max(tol, PreferredTolerance)
	topPref := math.Inf(-1)
	for k, t := range total {
		if t >= top-margin && preferred(c, cands[k]) {
			topPref = max(topPref, t)
		}
	}
	pref := !math.IsInf(topPref, -1)
	lo := top - tol
	if pref {
		lo = max(topPref-tol, top-margin)
	}
	pick, ties := -1, 0
	for k, t := range total {
		if t >= lo && (!pref || preferred(c, cands[k])) {
			ties++
			if c.IntN(ties) == 0 {
				pick = k
			}
		}
	}
	return pick
}

func fullScanEstimate(s *costScorer, c *Cycle, cands []int, ttft []float64, work, block float64) {
	matched := c.Matched()
	p := float64(c.Req.PromptTokens)
	known := true
	for _, i := range cands {
		known = known && c.Eps[i].PrefillTokensPerSecond > 0
	}
	rate := s.rate
	for k, i := range cands {
		ttft[k] = float64(matched[i])
	}
	for k, i := range cands {
		ep := &c.Eps[i]
		if known {
			rate = ep.PrefillTokensPerSecond
		}
		hit, load := ttft[k], 0.0
		own := max(1, p-float64(s.blockSize)*hit)
		ttft[k] = (float64(ep.PendingPrefillTokens)+(1+work+block*float64(ep.InFlight))*own)/rate + load
	}
}

// randomCycle is a decision over n endpoints with loads, matches,
// prefill rates (none, all or some) and preferences drawn from r, few
// distinct values each so that ties are common; cands a random ordered
// subset.
func randomCycle(r *rand.Rand, n int) (*Cycle, []int) {
	eps := make([]Endpoint, n)
	rates := r.IntN(3)
	for i := range eps {
		eps[i] = Endpoint{Ready: true, InFlight: r.IntN(4), PendingPrefillTokens: r.IntN(3) * 1000, Preferred: r.IntN(5) == 0}
		if rates == 1 || (rates == 2 && r.IntN(2) == 0) {
			eps[i].PrefillTokensPerSecond = float64(5000 + r.IntN(3)*2500)
		}
	}
	matched := make([]int, n)
	for i := range matched {
		if r.IntN(4) == 0 {
			matched[i] = r.IntN(40)
		}
	}
	var cands []int
	for i := range n {
		if r.IntN(5) != 0 {
			cands = append(cands, i)
		}
	}
	p := &Profile{seed: r.Uint64()}
	c := &Cycle{p: p, Eps: eps, Req: &Request{PromptTokens: 16 * (1 + r.IntN(50)), Hashes: make([]uint64, 40)},
		matched: matched, matchedDone: true, n: r.Uint64()}
	return c, cands
}

func TestMaxScorePickerMatchesFullScan(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for trial := range 20000 {
		c, cands := randomCycle(r, 1+r.IntN(200))
		total := make([]float64, len(cands))
		for k := range total {
			total[k] = float64(r.IntN(4)) * 0.25
			if r.IntN(3) == 0 {
				total[k] += r.Float64() * 0.05 // within or beyond the tolerance
			}
		}
		tol := []float64{0, 0.02, 0.3}[r.IntN(3)]
		got := maxScorePicker{tol: tol}.Pick(c, cands, total)
		c.seeded = false // the same decision's stream again
		if want := fullScanMaxScorePick(tol, c, cands, total); got != want {
			t.Fatalf("trial %d: picked %d, the full scan %d", trial, got, want)
		}
	}
}

func TestCostScorerMatchesFullScan(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for trial := range 20000 {
		c, cands := randomCycle(r, 1+r.IntN(200))
		s := &costScorer{rate: DefaultPrefillTokensPerSecond, blockSize: 16}
		work, block := 0.0, 0.0
		if r.IntN(2) == 0 {
			work, block = r.Float64(), r.Float64()
		}
		got, want := make([]float64, len(cands)), make([]float64, len(cands))
		s.estimateWork(c, cands, got, work, block, 0)
		fullScanEstimate(s, c, cands, want, work, block)
		for k := range got {
			if math.Float64bits(got[k]) != math.Float64bits(want[k]) {
				t.Fatalf("trial %d: candidate %d: TTFT %v, the full scan %v", trial, cands[k], got[k], want[k])
			}
		}
	}
}

// The tiered estimate and the precise scorer's tier credits as they were
// until 2026-12-06 (estimateWork's general path: a pass for the rates'
// check, one for the hits, one for the TTFT; the precise scorer read
// every candidate's prefill rate): the references
// TestTieredScoringMatchesFullScan holds estimateTiers, tierCredit and
// the precise scorer to, to the bit.

func fullScanTierCredit(c *Cycle, e int, n [NumTiers]int, rate float64) float64 {
	if w := c.p.tierWeights; w != nil {
		s := 0.0
		for t, k := range n {
			s += w[t] * float64(k)
		}
		return s
	}
	s := float64(n[prefix.MediumGPU])
	if n[prefix.MediumCPU]|n[prefix.MediumDisk]|n[prefix.MediumRemote] == 0 {
		return s
	}
	perBlock := float64(c.p.blockSize) / rate
	for t := 1; t < NumTiers; t++ {
		if n[t] == 0 {
			continue
		}
		ld := c.poolTiers().LoadSeconds
		w := 1.0
		if e < len(ld) {
			w = max(0, 1-ld[e][t]/perBlock)
		}
		s += w * float64(n[t])
	}
	return s
}

func fullScanEstimateTiers(s *costScorer, c *Cycle, cands []int, ttft []float64, work, block, minGain float64) {
	matched := c.Matched()
	p := float64(c.Req.PromptTokens)
	tb := c.TierBlocks()
	known := true
	for _, i := range cands {
		known = known && c.Eps[i].PrefillTokensPerSecond > 0
	}
	rate := s.rate
	least := math.Inf(1)
	for k, i := range cands {
		if known {
			rate = c.Eps[i].PrefillTokensPerSecond
		}
		hit := float64(matched[i])
		switch {
		case tb != nil && c.p.tierWeights != nil:
			hit = fullScanTierCredit(c, i, tb[i], rate)
		case tb != nil:
			n := tb[i]
			hit = float64(n[0] + n[1] + n[2] + n[3])
		}
		ttft[k] = hit
		least = min(least, hit)
	}
	floor := minGain * float64(len(c.Req.Hashes))
	for k, i := range cands {
		ep := &c.Eps[i]
		if known {
			rate = ep.PrefillTokensPerSecond
		}
		hit, load := ttft[k], 0.0
		if tb != nil && c.p.tierWeights == nil {
			load = c.loadSeconds(i, tb[i])
		}
		if minGain > 0 && hit-least < floor {
			hit = least
		}
		own := max(1, p-float64(s.blockSize)*hit)
		ttft[k] = s.seconds(ep, own, rate, work, block) + load
	}
}

func fullScanPreciseTiers(c *Cycle, cands []int, scores []float64, minGain float64) {
	tb, gpu := c.TierBlocks(), c.Matched()
	least := math.Inf(1)
	for k, i := range cands {
		n := tb[i]
		n[0] = min(gpu[i], n[0]+n[1]+n[2]+n[3])
		scores[k] = fullScanTierCredit(c, i, n, c.rate(i))
		least = min(least, scores[k])
	}
	total := float64(len(c.Req.Hashes))
	for k := range cands {
		g := 0.0
		if total > 0 {
			g = (scores[k] - least) / total
		}
		if g < minGain {
			g = 0
		}
		scores[k] = g
	}
}

// randomTieredCycle is randomCycle with a pool's tiers: per-endpoint load
// costs (for all endpoints, or only the first few: an endpoint past them
// is credited in full), a tier split per endpoint (most the GPU's alone,
// some with host memory, disk or remote blocks past it), the profile's
// fixed tier weights sometimes (none, llm-d's, Dynamo's, random), a
// batch-priced cost scorer sometimes.
func randomTieredCycle(r *rand.Rand, src TierSource, n int) (*Cycle, []int, *costScorer) {
	c, cands := randomCycle(r, n)
	c.p.blockSize, c.p.rate = 16, DefaultPrefillTokensPerSecond
	switch r.IntN(4) {
	case 1:
		c.p.tierWeights = &TierWeights{1, 0.8}
	case 2:
		c.p.tierWeights = &TierWeights{1, 0.75, 0.25}
	case 3:
		c.p.tierWeights = &TierWeights{r.Float64(), r.Float64(), r.Float64(), r.Float64()}
	}
	loads := n
	if r.IntN(4) == 0 {
		loads = r.IntN(n + 1)
	}
	t := &Tiers{Source: src, Remote: -1, LoadSeconds: make([][NumTiers]float64, loads), Latency: make([][NumTiers]float64, loads)}
	for e := range loads {
		for k := 1; k < NumTiers; k++ {
			t.LoadSeconds[e][k] = float64(1+r.IntN(4)) * 40e-6 * float64(k)
			t.Latency[e][k] = float64(r.IntN(3)) * 1e-3
		}
	}
	c.tiers, c.tiersLoaded = t, true
	maxBlocks := len(c.Req.Hashes)
	c.tierBlocks, c.tierDone = make([][NumTiers]int, n), true
	for e := range n {
		c.tierBlocks[e][0] = min(c.matched[e], maxBlocks)
		if r.IntN(6) == 0 {
			k := 1 + r.IntN(NumTiers-1)
			c.tierBlocks[e][k] = r.IntN(maxBlocks - c.tierBlocks[e][0] + 1)
		}
	}
	s := &costScorer{rate: c.p.rate, blockSize: c.p.blockSize}
	if r.IntN(4) == 0 {
		s.batch, _ = newBatchModel(BatchConfig{StepSeconds: 0.02, KVTokensPerSecond: 23.2e6})
	}
	return c, cands, s
}

// TestTieredScoringMatchesFullScan: the cost scorer's estimate with tiers
// (the cost scorer's and, with a minimum gain, the ttft scorer's) and the
// precise scorer's tier credits match the full scans they replaced to the
// bit, over 20,000 random decisions.
func TestTieredScoringMatchesFullScan(t *testing.T) {
	src, err := prefix.NewPreciseIndex(1, 16) // never asked: the splits are the cycles'
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(5, 6))
	priced := 0
	for trial := range 20000 {
		c, cands, s := randomTieredCycle(r, src, 1+r.IntN(200))
		work, block, minGain := 0.0, 0.0, 0.0
		if r.IntN(2) == 0 {
			work, block = r.Float64(), r.Float64()
		}
		if r.IntN(3) == 0 {
			minGain = []float64{0.01, 0.1, 0.5}[r.IntN(3)]
		}
		got, want := make([]float64, len(cands)), make([]float64, len(cands))
		s.estimateWork(c, cands, got, work, block, minGain)
		fullScanEstimateTiers(s, c, cands, want, work, block, minGain)
		for k := range got {
			if math.Float64bits(got[k]) != math.Float64bits(want[k]) {
				t.Fatalf("trial %d: candidate %d: TTFT %v, the full scan %v", trial, cands[k], got[k], want[k])
			}
		}
		ps := &preciseScorer{minGain: minGain}
		c.p.match = nil // Matched is the cycle's own (matchedDone)
		ps.src = nil
		ps.Score(c, cands, got)
		fullScanPreciseTiers(c, cands, want, minGain)
		for k := range got {
			if math.Float64bits(got[k]) != math.Float64bits(want[k]) {
				t.Fatalf("trial %d: candidate %d: precise score %v, the full scan %v", trial, cands[k], got[k], want[k])
			}
			if want[k] > 0 && c.p.tierWeights == nil && c.tierBlocks[cands[k]][1]|c.tierBlocks[cands[k]][2]|c.tierBlocks[cands[k]][3] != 0 {
				priced++
			}
		}
	}
	if priced < 1000 {
		t.Fatalf("only %d scores priced a lower tier: the trials miss the tier pricing", priced)
	}
}
