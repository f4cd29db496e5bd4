package sched

import (
	"math"
	"math/rand/v2"
	"testing"
)

// The max-score picker and the cost scorer as they were until 2026-12-05,
// a pass over every candidate per step: the references the current ones
// must match to the bit (TestMaxScorePickerMatchesFullScan,
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
	pref := false
	for k, t := range total {
		if t >= top-tol && preferred(c, cands[k]) {
			pref = true
			break
		}
	}
	pick, ties := -1, 0
	for k, t := range total {
		if t >= top-tol && (!pref || preferred(c, cands[k])) {
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
