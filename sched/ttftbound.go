package sched

import (
	"fmt"
	"math"
)

// FilterTTFTBound is the ttft-bound filter's configuration name.
const FilterTTFTBound = "ttft-bound"

// TTFTBoundConfig tunes the ttft-bound filter (YAML routing.ttft_bound).
type TTFTBoundConfig struct {
	// Slack is how many of the request's own cold prefill times a
	// candidate's estimated TTFT may exceed the fastest candidate's by
	// (default 1.0, ≥ 0).
	Slack float64 `yaml:"slack"`
}

// DefaultTTFTBoundSlack is TTFTBoundConfig.Slack's default.
const DefaultTTFTBoundSlack = 1.0

// ttftBoundFilter bounds what affinity may cost a request: it keeps the
// candidates whose estimated TTFT (the cost scorer's: prefill backlog plus
// the request's uncached part, at the prefill rate) is within Slack cold
// prefills of the fastest candidate's,
//
//	keep e  ⇔  TTFT_e ≤ min_f TTFT_f + Slack · P / rate
//
// with P the prompt's tokens and rate the fastest candidate's prefill
// rate (the configured one unless every candidate reports its own). A hit
// saves at most the request's cold prefill (P / rate) of work, so a
// request never waits longer than that, beyond the fastest endpoint, for
// one: a short follow-up is not queued behind another request's
// 100k-token prefill on the endpoint that holds its prefix, and the
// penalty grows with the wait in seconds, which the cost scorer's
// relative score (at most one weight unit) does not (issue 19, item 4).
// A preference: the fastest candidate always stays.
type ttftBoundFilter struct {
	cost  *costScorer
	slack float64
}

func newTTFTBound(cfg Config, pcfg PrefixConfig) (Filter, error) {
	slack := cfg.TTFTBound.Slack
	if slack == 0 {
		slack = DefaultTTFTBoundSlack
	}
	if !(slack >= 0) || math.IsInf(slack, 0) {
		return nil, fmt.Errorf("ttft_bound.slack %g must be >= 0 and finite", slack)
	}
	cost, err := newCostScorer(cfg, pcfg)
	if err != nil {
		return nil, err
	}
	return ttftBoundFilter{cost: cost, slack: slack}, nil
}

func (ttftBoundFilter) Name() string { return FilterTTFTBound }

func (f ttftBoundFilter) Filter(c *Cycle, cands []int) []int {
	if len(cands) < 2 {
		return cands
	}
	ttft := c.scores[:len(cands)] // scratch: scores are written after the filters
	f.cost.estimate(c, cands, ttft)
	lo, rate, known := math.Inf(1), 0.0, true
	for k, i := range cands {
		lo = min(lo, ttft[k])
		known = known && c.Eps[i].PrefillTokensPerSecond > 0
		rate = max(rate, c.Eps[i].PrefillTokensPerSecond)
	}
	if !known {
		rate = f.cost.rate
	}
	bound := lo + f.slack*float64(c.Req.PromptTokens)/rate
	out := cands[:0]
	for k, i := range cands {
		if ttft[k] <= bound {
			out = append(out, i)
		}
	}
	return out
}
