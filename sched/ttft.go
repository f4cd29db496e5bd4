package sched

import (
	"fmt"
	"math"
)

// ScorerTTFT is the ttft scorer's configuration name.
const ScorerTTFT = "ttft"

// TTFTConfig tunes the ttft scorer (YAML routing.ttft).
type TTFTConfig struct {
	// WorkWeight is α of the ttft scorer: the seconds of other requests'
	// waiting charged for each second of prefill a candidate would compute
	// for this request (≥ 0; default DefaultTTFTWorkWeight). 0 is the
	// request's own earliest first token (Mooncake's Conductor); larger
	// values keep more hits at the price of this request's wait.
	WorkWeight *float64 `yaml:"work_weight"`
	// BlockWeight is β of the ttft scorer: each request in flight at a
	// candidate is charged β times this request's prefill time there, the
	// head-of-line wait it imposes on the follow-ups of the sessions that
	// candidate serves (≥ 0; default DefaultTTFTBlockWeight).
	BlockWeight *float64 `yaml:"block_weight"`
}

// Defaults of TTFTConfig, measured in virtual time on seven workloads ×
// seeds 0–2 (README.md, "Evaluation against the peers": α 1, 2, 5, 10
// and β 0, 0.1, 0.3). α 10 keeps the most hits (within 0.6 points of
// cache-aware's everywhere) with most of the tail gain (long-tail TTFT p99
// −15 to −20%); α 2 and 5 give up 0.9–2.0 points of hit rate on the
// Mooncake and long-tail workloads for a little more tail; β 0.1 (at α 5)
// gains hits back on Mooncake but costs the shared-prefix burst 12.8% of
// its TTFT p99, so it is off by default.
const (
	DefaultTTFTWorkWeight  = 10.0
	DefaultTTFTBlockWeight = 0.0
)

// ttftScorer rates each candidate by the seconds the decision costs there,
// in one unit: the request's own estimated time to first token plus the
// prefill work it adds, charged to the requests that will queue behind it,
//
//	cost_e = W_e + (1 + α + β · N_e) · U_e / rate_e + L_e
//	W_e    = PendingPrefillTokens_e / rate_e          (the backlog ahead, s)
//	U_e    = max(1, P − B · m_e)                      (its uncached tokens)
//	L_e    = load time of its lower-tier blocks (tiers.go; 0 without tiers)
//	N_e    = requests in flight at e (Endpoint.InFlight)
//
// and scores candidates min–max over cost (1 the cheapest, 0 the dearest,
// 1 for all when equal). W_e + U_e / rate_e + L_e is the cost scorer's
// TTFT estimate, after Mooncake's Conductor (Qin et al., FAST '25, §6.1,
// Algorithm 1: queueing time + prefill time of the uncached part, the
// minimum wins); the α term is the cache's value to everyone else: a token
// computed again is prefill capacity the fleet loses (Preble, Srivatsa et
// al., ICLR 2025, §4: prefill load with cache hits subtracted; Dynamo's
// KV router charges prefill blocks at overlap_score_weight); the β term is
// the head-of-line wait the prefill imposes on the sessions in flight at e,
// whose next turns come back to e and queue behind it (an FCFS engine
// prefills a waiting prompt only after the running ones: vLLM v1's
// scheduler, sim/engine.go Step). Unlike the
// cost scorer's ratio min TTFT / TTFT_e, which costs an endpoint at most
// one weight unit however long its backlog, here a hit is worth exactly
// the seconds it saves: a short follow-up is not queued behind another
// request's 100k-token prefill at its prefix's home for a hit worth a
// fraction of a second, while a long prompt's hit outweighs seconds of
// backlog. With one scorer carrying both, the prefix scorer rides at
// weight 0 in its profiles for its index only. As in the prefix scorer, a
// match that exceeds the least candidate's by less than
// routing.prefix.min_match_gain of the prompt's blocks counts as the
// least's: a chat template's first block, which one endpoint of an idle
// fleet happens to hold, does not pull every new session there
// (TestIdleFleetSpreadsNewSessions).
type ttftScorer struct {
	cost    *costScorer
	work    float64
	block   float64
	minGain float64
}

func newTTFTScorer(cfg Config, pcfg PrefixConfig) (*ttftScorer, error) {
	work := DefaultTTFTWorkWeight
	if w := cfg.TTFT.WorkWeight; w != nil {
		work = *w
	}
	if !(work >= 0) || math.IsInf(work, 0) {
		return nil, fmt.Errorf("ttft.work_weight %g must be >= 0 and finite", work)
	}
	cost, err := newCostScorer(cfg, pcfg)
	if err != nil {
		return nil, err
	}
	if math.IsInf(cost.rate, 0) {
		return nil, fmt.Errorf("cost.prefill_tokens_per_second %g must be > 0", cost.rate)
	}
	block := DefaultTTFTBlockWeight
	if b := cfg.TTFT.BlockWeight; b != nil {
		block = *b
	}
	if !(block >= 0) || math.IsInf(block, 0) {
		return nil, fmt.Errorf("ttft.block_weight %g must be >= 0 and finite", block)
	}
	return &ttftScorer{cost: cost, work: work, block: block, minGain: pcfg.MinMatchGain}, nil
}

func (*ttftScorer) Name() string { return ScorerTTFT }

func (s *ttftScorer) Score(c *Cycle, cands []int, scores []float64) {
	s.cost.estimateWork(c, cands, scores, s.work, s.block, s.minGain)
	lo, hi := math.Inf(1), math.Inf(-1)
	for k := range cands {
		lo, hi = min(lo, scores[k]), max(hi, scores[k])
	}
	for k := range cands {
		if hi == lo {
			scores[k] = 1
		} else {
			scores[k] = (hi - scores[k]) / (hi - lo)
		}
	}
}
