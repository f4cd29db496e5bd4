package sched

import (
	"fmt"
	"math"
	"slices"
	"sync"

	"github.com/cespare/xxhash/v2"

	"github.com/infergate/infergate/internal/lru"
	"github.com/infergate/infergate/prefix"
)

// Plugin names, as written in a profile's YAML. Each has a section in
// README.md (formula, inputs, defaults, source).
const (
	// Filters.
	FilterModel           = "model"
	FilterAdapterCapacity = "adapter-capacity"
	FilterHotSpot         = "hot-spot"
	// Scorers.
	ScorerPrefix         = "prefix"
	ScorerPrecisePrefix  = "precise-prefix"
	ScorerQueue          = "queue"
	ScorerKVUtilization  = "kv-utilization"
	ScorerInFlightTokens = "in-flight-tokens"
	ScorerSession        = "session"
	ScorerLoRA           = "lora"
	ScorerCost           = "cost"
	// Pickers.
	PickerMaxScore       = "max-score"
	PickerWeightedRandom = "weighted-random"
	PickerPowerOfTwo     = "power-of-two"
	PickerRoundRobin     = "round-robin"
	PickerLeastRequest   = "least-request"
	PickerPrefixRule     = "prefix-rule"
)

// ---- filters ----

// inSorted reports whether the sorted names hold name: O(log n), no
// allocation (Endpoint.Models).
func inSorted(names []string, name string) bool {
	_, ok := slices.BinarySearch(names, name)
	return ok
}

// modelFilter keeps endpoints that serve the requested model (or adapter):
// Endpoint.Models nil means "every model of the pool". Hard constraint.
type modelFilter struct{}

func (modelFilter) Name() string { return FilterModel }

func (modelFilter) Filter(c *Cycle, cands []int) []int {
	want := c.Req.Model
	if c.Req.Adapter != "" {
		want = c.Req.Adapter
	}
	out := cands[:0]
	for _, i := range cands {
		if m := c.Eps[i].Models; m == nil || inSorted(m, want) {
			out = append(out, i)
		}
	}
	return out
}

// adapterCapacityFilter drops, for an adapter request, the endpoints that have
// not loaded the adapter and have no free adapter slot (loading it there
// would evict another adapter or queue behind max_loras). Preference: if no
// endpoint qualifies, every candidate is kept.
type adapterCapacityFilter struct{}

func (adapterCapacityFilter) Name() string { return FilterAdapterCapacity }

func (adapterCapacityFilter) Filter(c *Cycle, cands []int) []int {
	a := c.Req.Adapter
	if a == "" {
		return cands
	}
	fits := func(ep *Endpoint) bool {
		return ep.MaxAdapters == 0 || len(ep.Adapters) < ep.MaxAdapters || slices.Contains(ep.Adapters, a)
	}
	n := 0
	for _, i := range cands {
		if fits(&c.Eps[i]) {
			n++
		}
	}
	if n == 0 || n == len(cands) {
		return cands
	}
	out := cands[:0]
	for _, i := range cands {
		if fits(&c.Eps[i]) {
			out = append(out, i)
		}
	}
	return out
}

// hotSpotFilter removes hot endpoints: those overloaded (Balance) against
// the least-loaded candidate, which is never hot, so the set never empties.
// With Balance.KeepFastest (cost non-nil) an overloaded candidate whose
// estimated TTFT (costScorer.estimate, s) is lower than every candidate's
// that is not overloaded stays: moving the request elsewhere could only
// make it later by the estimate (a tie moves it),
// e.g. a warm follower whose 12k-token document the hot endpoint holds,
// sent to recompute it behind nothing (sched/README.md, "The rag and
// agentic cells").
type hotSpotFilter struct {
	cfg  Balance
	cost *costScorer
}

func (hotSpotFilter) Name() string { return FilterHotSpot }

// newHotSpotKeepFastest is the hot-spot filter with Balance.KeepFastest,
// its estimate the cost scorer's with the routing configuration's rate and
// batch model.
func newHotSpotKeepFastest(cfg Config, pcfg PrefixConfig, b Balance) (Filter, error) {
	cost, err := newCostScorer(cfg, pcfg)
	if err != nil {
		return nil, err
	}
	return hotSpotFilter{cfg: b, cost: cost}, nil
}

func (f hotSpotFilter) Filter(c *Cycle, cands []int) []int {
	least := math.MaxInt
	for _, i := range cands {
		least = min(least, c.Eps[i].InFlight)
	}
	if f.cost == nil {
		out := cands[:0]
		for _, i := range cands {
			if !f.cfg.overloaded(c.Eps[i].InFlight, least) {
				out = append(out, i)
			}
		}
		return out
	}
	hot := false
	for _, i := range cands {
		hot = hot || f.cfg.overloaded(c.Eps[i].InFlight, least)
	}
	if !hot {
		return cands
	}
	ttft := c.scores[:len(cands)] // scratch: scores are written after the filters
	f.cost.estimate(c, cands, ttft)
	cool := math.Inf(1) // the lowest estimate of a candidate that is not hot
	for k, i := range cands {
		if !f.cfg.overloaded(c.Eps[i].InFlight, least) {
			cool = min(cool, ttft[k])
		}
	}
	out := cands[:0]
	for k, i := range cands {
		if !f.cfg.overloaded(c.Eps[i].InFlight, least) || ttft[k] < cool {
			out = append(out, i)
		}
	}
	return out
}

// ---- scorers ----

// prefixScorer: matched leading blocks beyond the least any candidate
// matches, as a fraction of the prompt's blocks (0 below minGain), from the
// approximate index, which learns every decision of the profile.
type prefixScorer struct {
	ix      *prefix.Index
	minGain float64
	pin     bool // learn_on_finish: a pick pins the prompt until Profile.Finished
	// blockSize is the index's block size (tokens): its capacity in
	// tokens for the pin's load rule (Learn).
	blockSize int
}

func (*prefixScorer) Name() string { return ScorerPrefix }

func (s *prefixScorer) Score(c *Cycle, cands []int, scores []float64) {
	matchGain(c, c.MatchedBy(s.ix), cands, scores, s.minGain)
}

// Learn records the prompt's blocks as held by the chosen endpoint: queued
// for Profile.Settle, and counted by the index's Match at once
// (prefix/learn.go). With learn_on_finish the prompt is pinned until the
// request ends (Profile.Finished) when the endpoint can hold it running
// (runs), else learnt unpinned, as without learn_on_finish; Request.Pinned
// records which, for the request's end.
func (s *prefixScorer) Learn(c *Cycle, chosen int) {
	c.Req.Pinned = s.pin && s.runs(c, chosen)
	if c.Req.Pinned {
		s.ix.LearnPinned(chosen, c.Req.Hashes) // released by Profile.Finished
		return
	}
	s.ix.Learn(chosen, c.Req.Hashes)
}

// runs reports whether endpoint i's KV cache holds the prompts of every
// request in flight there and this one's: InFlightTokens + PromptTokens ≤
// the index's capacity of i in tokens. A vLLM engine keeps a running
// request's blocks out of its free queue (the pin) but a waiting request
// holds none (vllm/v1/core/sched/scheduler.py allocates a request's blocks
// when it schedules it, and preempts running ones when they no longer
// fit), so past that bound the request waits or is preempted, and a pin
// would keep its prompt in the index while the engine's free queue, given
// to the running, holds little. An endpoint whose load is not accounted
// (InFlightTokens 0) pins as before.
//
// Measured in virtual time (sched/README.md, "Pins under overload"): on 4
// engines, which cannot keep up with the workloads (Mooncake's TTFT p50
// 4.5 minutes), 84% of agentic's picks go unpinned and the default gains
// 29 of issue 19's cells over seeds 0–4 for 3 given up; on 6 engines 2
// gained; on 16, and on 8 in seeds 0–2, the same cells (on 8, 0.6–1.3% of
// Mooncake's picks unpinned, in its bursts); on 8 in seeds 3–4, 2.3–2.6%
// unpinned give up 2 cells (hit −0.3 to −0.6 points).
func (s *prefixScorer) runs(c *Cycle, i int) bool {
	return c.Eps[i].InFlightTokens+c.Req.PromptTokens <= s.ix.Capacity(i)*s.blockSize
}

// preciseScorer: matched leading blocks / prompt blocks, from the index the
// engines' KV events feed.
type preciseScorer struct {
	src     MatchSource
	minGain float64
}

func (*preciseScorer) Name() string { return ScorerPrecisePrefix }

func (s *preciseScorer) Score(c *Cycle, cands []int, scores []float64) {
	tb := c.TierBlocks()
	if tb == nil {
		matchGain(c, c.MatchedBy(s.src), cands, scores, s.minGain)
		return
	}
	// With tiers: each candidate's blocks credited by tier (tiers.go), the
	// GPU's from the precise index.
	gpu := c.MatchedBy(s.src)
	least := math.Inf(1)
	priced := c.p.tierWeights == nil
	for k, i := range cands {
		n := tb[i]
		n[0] = min(gpu[i], n[0]+n[1]+n[2]+n[3]) // the precise GPU match, under the split's reach
		if priced && n[1]|n[2]|n[3] == 0 {
			scores[k] = float64(n[0]) // tierCredit's: the GPU's blocks only, no price to work out
		} else {
			scores[k] = c.tierCredit(i, n)
		}
		least = min(least, scores[k])
	}
	total := float64(len(c.Req.Hashes))
	for k := range cands {
		g := 0.0
		if total > 0 {
			g = (scores[k] - least) / total
		}
		if g < s.minGain {
			g = 0
		}
		scores[k] = g
	}
}

// matchGain scores each candidate by the prompt blocks it holds beyond the
// candidate that holds the fewest, as a fraction of the prompt's n blocks:
//
//	score(e) = (m(e) − min m) / n,  0 when below minGain
//
// A prefix every candidate holds (a shared system prompt) gives no
// preference, and neither does a sliver (one chat-template block) that is
// not worth piling sessions onto one endpoint for (docs/ARCHITECTURE.md,
// "starvation from a universal prefix").
func matchGain(c *Cycle, matched []int, cands []int, scores []float64, minGain float64) {
	n := len(c.Req.Hashes)
	least := math.MaxInt
	for _, i := range cands {
		least = min(least, matched[i])
	}
	for k, i := range cands {
		scores[k] = 0
		if n == 0 {
			continue
		}
		if g := float64(matched[i]-least) / float64(n); g >= minGain {
			scores[k] = g
		}
	}
}

// minMaxLow scores a "lower is better" quantity q by (max − q)/(max − min),
// 1 for every candidate when all are equal (the GIE queue scorer's form).
func minMaxLow(cands []int, scores []float64, q func(i int) float64) {
	lo, hi := math.Inf(1), math.Inf(-1)
	for k, i := range cands {
		v := q(i)
		scores[k] = v
		lo, hi = min(lo, v), max(hi, v)
	}
	for k := range cands {
		if hi == lo {
			scores[k] = 1
		} else {
			scores[k] = (hi - scores[k]) / (hi - lo)
		}
	}
}

// queueScorer prefers short queues: the engines' waiting requests when
// every candidate's metrics are fresh, else the gateway's in-flight counts.
// One quantity for all: min–max over an engine's waiting queue (0 while it
// runs all it was sent) and another endpoint's in-flight requests would rank
// a busy engine above an idle one that exports no metrics.
type queueScorer struct{}

func (queueScorer) Name() string { return ScorerQueue }

func (queueScorer) Score(c *Cycle, cands []int, scores []float64) {
	engine := true
	for _, i := range cands {
		engine = engine && c.Eps[i].Metrics
	}
	minMaxLow(cands, scores, func(i int) float64 {
		if engine {
			return float64(c.Eps[i].Waiting)
		}
		return float64(c.Eps[i].InFlight)
	})
}

// kvUtilScorer: 1 − KV-cache utilisation where it is known (fresh metrics
// with a KVUtil ≥ 0). An endpoint that reports none is left unscored (0: the
// other scorers decide), not scored as an empty cache, which would make the
// endpoint nothing is known about the most attractive one (llm-d fixed the
// same in its kv-cache-utilization scorer, llm-d/llm-d-router#2695).
type kvUtilScorer struct{}

func (kvUtilScorer) Name() string { return ScorerKVUtilization }

func (kvUtilScorer) Score(c *Cycle, cands []int, scores []float64) {
	for k, i := range cands {
		ep := &c.Eps[i]
		scores[k] = 0
		if ep.Metrics && ep.KVUtil >= 0 {
			scores[k] = 1 - ep.KVUtil
		}
	}
}

// inFlightTokensScorer prefers endpoints with fewer prompt tokens in flight.
type inFlightTokensScorer struct{}

func (inFlightTokensScorer) Name() string { return ScorerInFlightTokens }

func (inFlightTokensScorer) Score(c *Cycle, cands []int, scores []float64) {
	minMaxLow(cands, scores, func(i int) float64 { return float64(c.Eps[i].InFlightTokens) })
}

// SessionConfig bounds the session-affinity table (YAML routing.session).
type SessionConfig struct {
	// MaxSessions is how many sessions are remembered, least recently routed
	// forgotten first (default 100,000; each costs a 24-byte list node and
	// a map slot, estimated, not measured).
	MaxSessions int `yaml:"max_sessions"`
}

// DefaultMaxSessions is SessionConfig.MaxSessions's default.
const DefaultMaxSessions = 100_000

// sessionScorer scores 1 the endpoint that last served the request's session
// and 0 the others (0 for all without a session key or on a first turn).
type sessionScorer struct {
	mu    sync.Mutex
	table *sessionTable
}

func (*sessionScorer) Name() string { return ScorerSession }

func (s *sessionScorer) Score(c *Cycle, cands []int, scores []float64) {
	home := -1
	if c.Req.SessionKey != "" {
		s.mu.Lock()
		home = s.table.get(xxhash.Sum64String(c.Req.SessionKey))
		s.mu.Unlock()
	}
	for k, i := range cands {
		scores[k] = 0
		if i == home {
			scores[k] = 1
		}
	}
}

func (s *sessionScorer) Learn(c *Cycle, chosen int) {
	if c.Req.SessionKey == "" {
		return
	}
	s.mu.Lock()
	s.table.put(xxhash.Sum64String(c.Req.SessionKey), chosen)
	s.mu.Unlock()
}

func (s *sessionScorer) forget(e int) {
	s.mu.Lock()
	s.table.dropEndpoint(e)
	s.mu.Unlock()
}

// loraScorer: for an adapter request, 1 where the adapter is loaded, 0.5
// where a slot is free (or slots are unknown), 0 where loading it would evict
// another adapter. Base-model requests score 1 everywhere.
type loraScorer struct{}

func (loraScorer) Name() string { return ScorerLoRA }

func (loraScorer) Score(c *Cycle, cands []int, scores []float64) {
	a := c.Req.Adapter
	for k, i := range cands {
		ep := &c.Eps[i]
		switch {
		case a == "" || slices.Contains(ep.Adapters, a):
			scores[k] = 1
		case ep.MaxAdapters == 0 || len(ep.Adapters) < ep.MaxAdapters:
			scores[k] = 0.5
		default:
			scores[k] = 0
		}
	}
}

// CostConfig tunes the cost scorer (YAML routing.cost).
type CostConfig struct {
	// PrefillTokensPerSecond is the prefill throughput assumed for endpoints
	// that report none (default 10,000 tokens/s). Only ratios between
	// endpoints matter for the score, so in a homogeneous fleet it cancels
	// (unless Batch is on: its step time is in seconds).
	PrefillTokensPerSecond float64 `yaml:"prefill_tokens_per_second"`
	// Batch prices the batch a request joins (batch.go); off by default.
	Batch BatchConfig `yaml:"batch"`
}

// DefaultPrefillTokensPerSecond is CostConfig.PrefillTokensPerSecond's default.
const DefaultPrefillTokensPerSecond = 10_000

// costScorer estimates each endpoint's TTFT for the request as the time to
// drain its prefill backlog plus the request's own uncached prefill:
//
//	TTFT_e ≈ (PendingPrefillTokens_e + max(1, P − B·m_e)) / rate_e
//
// (P prompt tokens, m_e matched blocks of B tokens, rate_e the endpoint's
// prefill tokens/s) and scores min_e TTFT_e / TTFT_e ∈ (0, 1]: 1 for the
// fastest, 0.5 for one twice as slow. The prefill term dominates TTFT under
// chunked prefill (vLLM v1 schedules waiting prompts behind running decodes
// within a token budget), which is why decode load is left out.
type costScorer struct {
	rate      float64
	blockSize int
	// batch, when on, replaces the estimate by the step-time model's
	// (batch.go): the step in progress, the memory floor of each step and
	// the decodes riding in it.
	batch batchModel
}

// newCostScorer is the cost scorer of the routing configuration: its
// prefill rate (cost.prefill_tokens_per_second, tokens/s; 0 takes
// DefaultPrefillTokensPerSecond) and batch model (cost.batch), blocks of
// pcfg.BlockSize tokens. The cost scorer, the ttft scorer and the filters
// that price TTFT (ttft-bound, hot-spot's keep_fastest) share it.
func newCostScorer(cfg Config, pcfg PrefixConfig) (*costScorer, error) {
	rate := cfg.Cost.PrefillTokensPerSecond
	if rate == 0 {
		rate = DefaultPrefillTokensPerSecond
	}
	if !(rate > 0) {
		return nil, fmt.Errorf("cost.prefill_tokens_per_second %g must be > 0", rate)
	}
	batch, err := newBatchModel(cfg.Cost.Batch)
	if err != nil {
		return nil, err
	}
	return &costScorer{rate: rate, blockSize: pcfg.BlockSize, batch: batch}, nil
}

func (*costScorer) Name() string { return ScorerCost }

func (s *costScorer) Score(c *Cycle, cands []int, scores []float64) {
	best := math.Inf(1)
	s.estimate(c, cands, scores)
	for k := range cands {
		best = min(best, scores[k])
	}
	for k := range cands {
		scores[k] = best / scores[k]
	}
}

// estimate writes each candidate's estimated TTFT (s) into ttft[k]: its
// prefill backlog plus the request's own uncached part at its prefill
// rate, plus the load time of the lower-tier part when the pool has tiers
// (the formula on costScorer; the ttft-bound filter reads it too).
func (s *costScorer) estimate(c *Cycle, cands []int, ttft []float64) {
	s.estimateWork(c, cands, ttft, 0, 0, 0)
}

// estimateWork is estimate with the request's own uncached prefill
// counted 1 + work + block·InFlight_e times, and a candidate's hit counted only when it
// exceeds the least candidate's by at least minGain of the prompt's
// blocks (else it is taken as the least's): the ttft scorer's cost. With
// work 0 and minGain 0 it is estimate's TTFT.
func (s *costScorer) estimateWork(c *Cycle, cands []int, ttft []float64, work, block, minGain float64) {
	matched := c.Matched()
	p := float64(c.Req.PromptTokens)
	tb := c.TierBlocks()
	if minGain == 0 {
		if tb == nil {
			s.estimatePlain(c, cands, ttft, matched, p, work, block)
		} else {
			s.estimateTiers(c, cands, ttft, tb, p, work, block)
		}
		return
	}
	// Per-endpoint rates only when every candidate has one: a fleet half
	// learnt would compare learnt rates with the configured guess.
	known := true
	for _, i := range cands {
		known = known && c.Eps[i].PrefillTokensPerSecond > 0
	}
	rate := s.rate
	// Pass 1: each candidate's hit (blocks, tier-credited), into ttft.
	least := math.Inf(1)
	for k, i := range cands {
		ttft[k] = s.tierHit(c, i, matched, tb)
		least = min(least, ttft[k])
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

// tierHit is candidate i's hit in blocks for the estimate: its matched
// blocks without tiers (tb nil), the fixed tier credits of the profile's
// tier_weights, else every block its tier split supplies (the lower
// tiers' priced by their load time instead, loadSeconds).
func (s *costScorer) tierHit(c *Cycle, i int, matched []int, tb [][NumTiers]int) float64 {
	switch {
	case tb == nil:
		return float64(matched[i])
	case c.p.tierWeights != nil:
		return c.tierCredit(i, tb[i]) // fixed credits, no load time
	}
	n := tb[i]
	return float64(n[0] + n[1] + n[2] + n[3])
}

// estimateTiers is estimateWork with tiers and without minGain (the cost
// scorer's case with Pool.Tiers), the same TTFT to the bit in one pass
// over the candidates when they have no prefill rate of their own and
// two when every one has, as estimatePlain: the pass prices with the
// configured rate while it finds whether every candidate has its own.
// An endpoint whose split is the GPU's alone is priced inline, as
// estimatePlain prices a match (no tier credit, no load time: its
// estimate adds a load of 0.0, which changes nothing but a −0 the
// positive own term rules out). Until 2026-12-06 it was estimateWork's
// general path: a pass for the rates' check, one for the hits and one for
// the TTFT, each over every candidate (at 1,000 endpoints about a fifth
// of the tiered precise pick, BenchmarkDecisionPrecise1000x1M).
func (s *costScorer) estimateTiers(c *Cycle, cands []int, ttft []float64, tb [][NumTiers]int, p, work, block float64) {
	if s.tierPass(c, cands, ttft, tb, p, work, block, false) {
		s.tierPass(c, cands, ttft, tb, p, work, block, true)
	}
}

// tierPass is one pass of estimateTiers, at the configured rate or, with
// own, at each candidate's; it reports whether every candidate has a
// prefill rate of its own.
func (s *costScorer) tierPass(c *Cycle, cands []int, ttft []float64, tb [][NumTiers]int, p, work, block float64, own bool) (known bool) {
	priced := c.p.tierWeights == nil
	plain := priced && !s.batch.on()
	b := float64(s.blockSize)
	known = true
	for k, i := range cands {
		ep := &c.Eps[i]
		known = known && ep.PrefillTokensPerSecond > 0
		rate := s.rate
		if own {
			rate = ep.PrefillTokensPerSecond
		}
		n := tb[i]
		if plain && n[1]|n[2]|n[3] == 0 { // seconds' formula, its GPU hit only
			ttft[k] = (float64(ep.PendingPrefillTokens) + (1+work+block*float64(ep.InFlight))*max(1, p-b*float64(n[0]))) / rate
			continue
		}
		ttft[k] = s.tierSeconds(c, ep, i, n, priced, p, rate, work, block)
	}
	return known
}

// tierSeconds is estimateTiers' TTFT of endpoint i (ep) with tier split n
// at prefill rate (tokens/s): seconds of its uncached part plus, priced,
// the load time of its lower-tier part.
func (s *costScorer) tierSeconds(c *Cycle, ep *Endpoint, i int, n [NumTiers]int, priced bool, p, rate, work, block float64) float64 {
	var hit, load float64
	switch {
	case !priced:
		hit = c.tierCredit(i, n)
	case n[1]|n[2]|n[3] == 0:
		hit = float64(n[0]) // the GPU's blocks only: nothing to load (loadSeconds' 0)
	default:
		hit = float64(n[0] + n[1] + n[2] + n[3])
		load = c.loadSeconds(i, n)
	}
	return s.seconds(ep, max(1, p-float64(s.blockSize)*hit), rate, work, block) + load
}

// seconds is one candidate's estimate without its tiers' load time: the
// backlog and its own uncached prefill (own tokens) at rate, the prefill
// counted 1 + work + block·InFlight times; with the batch priced, the
// step-time model's TTFT plus (work + block·InFlight) times the work its
// tokens add (batchModel).
func (s *costScorer) seconds(ep *Endpoint, own, rate, work, block float64) float64 {
	if !s.batch.on() {
		return (float64(ep.PendingPrefillTokens) + (1+work+block*float64(ep.InFlight))*own) / rate
	}
	n := float64(ep.InFlight)
	t, w := s.batch.estimate(float64(ep.PendingPrefillTokens), own, n, float64(ep.InFlightTokens), rate)
	return t + (work+block*n)*w
}

// estimatePlain is estimateWork without tiers and minGain (the cost
// scorer's case), the same TTFT to the bit in one pass over the
// candidates when they have no prefill rate of their own (the gateway's
// case: it passes none, load.Ledger.Fill) and two when every one has: the
// pass prices with the configured rate while it finds whether every
// candidate has its own, and a second prices with theirs if so
// (estimateWork adds a load of 0.0, which changes nothing but a −0 the
// positive own term rules out). Until
// 2026-12-05 a pass for the rates' check, one for the hits and one for
// the TTFT, each reading every candidate's 160-byte Endpoint.
func (s *costScorer) estimatePlain(c *Cycle, cands []int, ttft []float64, matched []int, p, work, block float64) {
	if s.batch.on() {
		s.estimateBatch(c, cands, ttft, matched, p, work, block)
		return
	}
	known, rate := true, s.rate
	for k, i := range cands {
		ep := &c.Eps[i]
		known = known && ep.PrefillTokensPerSecond > 0
		own := max(1, p-float64(s.blockSize)*float64(matched[i]))
		ttft[k] = (float64(ep.PendingPrefillTokens) + (1+work+block*float64(ep.InFlight))*own) / rate
	}
	if !known {
		return
	}
	for k, i := range cands {
		ep := &c.Eps[i]
		own := max(1, p-float64(s.blockSize)*float64(matched[i]))
		ttft[k] = (float64(ep.PendingPrefillTokens) + (1+work+block*float64(ep.InFlight))*own) / ep.PrefillTokensPerSecond
	}
}

// estimateBatch is estimatePlain with the batch priced (seconds).
func (s *costScorer) estimateBatch(c *Cycle, cands []int, ttft []float64, matched []int, p, work, block float64) {
	known := true
	for _, i := range cands {
		known = known && c.Eps[i].PrefillTokensPerSecond > 0
	}
	rate := s.rate
	for k, i := range cands {
		ep := &c.Eps[i]
		if known {
			rate = ep.PrefillTokensPerSecond
		}
		ttft[k] = s.seconds(ep, max(1, p-float64(s.blockSize)*float64(matched[i])), rate, work, block)
	}
}

// ---- pickers ----

// maxScorePicker takes the highest total; totals within tol of the best
// are ties, broken uniformly at random (so that differences too small to
// matter — one block of a long prompt — do not pile work on one endpoint)
// among the tied endpoints marked Preferred when there are any, else
// among all of them. A Preferred endpoint (a gateway replica's share of
// the pool) within PreferredTolerance of the best is taken instead of the
// best: the ties are then the Preferred endpoints within tol of the best
// of them.
type maxScorePicker struct{ tol float64 }

// PreferredTolerance is how close to the best total a Preferred
// endpoint's total must be for the max-score picker to take it instead
// (in units of scorer weight; Endpoint.Preferred is set only among gateway
// replicas, replica.Node.Expect). Replicas that decide within the
// exchange's delay of each other decide on views that lack each other's
// latest decisions, and take the same best endpoint; with a margin of
// 0.15 — at equal prefix scores, an endpoint whose estimated TTFT is
// within 1/0.85 ≈ 1.18× the best's at the cost scorer's weight 1 — each
// takes a near-best endpoint of its own share instead, and a clearly
// better one (a longer cached prefix, a much shorter backlog) still wins
// on every replica. Virtual time, the first 2,000 Mooncake requests on 8
// engines, three replicas against one on TTFT p90 with arrivals spread
// uniformly over S after their whole-second timestamps, mean of seeds
// 0–5, with replica.Node.Turn's turns (bench --virtual --engines 8
// --compare cache-aware --workload mooncake --requests 2000 --replicas
// 1,3 --replica-sync true --replica-delay 1ms --spread S):
//
//	S                          0      1 ms    2 ms    5 ms
//	exact ties only (margin 0) +1.3%  +8.6%   +7.2%   +15.8%
//	margin 0.15                −0.9%  +4.2%   +7.5%   +8.8%
//
// at 100 ms and 1 s of spread −0.9% and −2.9% (seeds 0–2). Its price is
// where a burst is sequenced exactly by the turns and the margin only
// moves work off the best endpoint: shared-prefix's 1,024 requests at one
// instant, +6.2% against one gateway where exact ties had 0.0% (a margin
// of 0.3, tried with the earlier turns, cost +25% there).
const PreferredTolerance = 0.15

func (maxScorePicker) Name() string { return PickerMaxScore }

func (p maxScorePicker) Pick(c *Cycle, cands []int, total []float64) int {
	if len(cands) == 0 {
		return -1
	}
	top := math.Inf(-1)
	for _, t := range total {
		top = max(top, t)
	}
	tol := max(p.tol, 1e-9)
	margin := max(tol, PreferredTolerance)
	// The candidates within the Preferred margin of the best, in order,
	// into the cycle's scratch (one more pass over the totals), and the
	// best Preferred total among them; then the ties and the draws over
	// them alone (until 2026-12-05 two more passes over every candidate).
	near, topPref := c.tieScratch(len(cands)), math.Inf(-1)
	for k, t := range total {
		if t >= top-margin {
			near = append(near, k)
			if preferred(c, cands[k]) {
				topPref = max(topPref, t)
			}
		}
	}
	// With a Preferred candidate near the best, the ties are the
	// Preferred ones within the tolerance of the best of them (and
	// within the margin of the best); else those within the tolerance of
	// the best.
	pref, lo := topPref > math.Inf(-1), top-tol
	if pref {
		lo = max(topPref-tol, top-margin)
	}
	pick, n := -1, 0
	for _, k := range near {
		if total[k] >= lo && (!pref || preferred(c, cands[k])) {
			n++
			if c.IntN(n) == 0 {
				pick = k
			}
		}
	}
	return pick
}

// preferred reports whether endpoint i of c is Preferred (false for an
// index beyond the snapshot: a picker driven without one).
func preferred(c *Cycle, i int) bool { return i < len(c.Eps) && c.Eps[i].Preferred }

// weightedRandomPicker picks candidate k with probability total[k] / Σ total
// (uniformly when every total is 0).
type weightedRandomPicker struct{}

func (weightedRandomPicker) Name() string { return PickerWeightedRandom }

func (weightedRandomPicker) Pick(c *Cycle, cands []int, total []float64) int {
	if len(cands) == 0 {
		return -1
	}
	sum := 0.0
	for _, t := range total {
		sum += t
	}
	if sum <= 0 {
		return c.IntN(len(cands))
	}
	x := c.Float64() * sum
	for k, t := range total {
		if x < t {
			return k
		}
		x -= t
	}
	return len(cands) - 1
}

// powerOfTwoPicker samples two distinct candidates uniformly and takes the
// higher total (ties: the first sampled), the "power of two choices" of
// Mitzenmacher (IEEE TPDS 2001).
type powerOfTwoPicker struct{}

func (powerOfTwoPicker) Name() string { return PickerPowerOfTwo }

func (powerOfTwoPicker) Pick(c *Cycle, cands []int, total []float64) int {
	switch len(cands) {
	case 0:
		return -1
	case 1:
		return 0
	}
	a := c.IntN(len(cands))
	b := c.IntN(len(cands) - 1)
	if b >= a {
		b++
	}
	if total[b] > total[a] {
		return b
	}
	return a
}

// ---- session table ----

// sessionTable is a bounded LRU map from session hash to endpoint.
type sessionTable struct {
	cap   int
	slot  map[uint64]int32
	nodes []lru.Node[sessionEntry]
	order lru.List[sessionEntry] // most to least recently routed
}

type sessionEntry struct {
	key uint64
	ep  int32 // -1: free
}

func newSessionTable(capacity int) *sessionTable {
	t := &sessionTable{cap: max(capacity, 1), slot: make(map[uint64]int32)}
	t.order.Init()
	return t
}

func (t *sessionTable) get(k uint64) int {
	if i, ok := t.slot[k]; ok {
		return int(t.nodes[i].Val.ep)
	}
	return -1
}

func (t *sessionTable) put(k uint64, ep int) {
	if i, ok := t.slot[k]; ok {
		t.nodes[i].Val.ep = int32(ep)
		t.order.MoveFront(t.nodes, i)
		return
	}
	var i int32
	if len(t.nodes) < t.cap {
		t.nodes = append(t.nodes, lru.Node[sessionEntry]{})
		i = int32(len(t.nodes) - 1)
	} else {
		i = t.order.Tail()
		if t.nodes[i].Val.ep >= 0 {
			delete(t.slot, t.nodes[i].Val.key)
		}
		t.order.Unlink(t.nodes, i)
	}
	t.nodes[i].Val = sessionEntry{key: k, ep: int32(ep)}
	t.slot[k] = i
	t.order.PushFront(t.nodes, i)
}

// dropEndpoint forgets the sessions homed on endpoint e (they are re-homed on
// their next turn).
func (t *sessionTable) dropEndpoint(e int) {
	for k, i := range t.slot {
		if t.nodes[i].Val.ep == int32(e) {
			t.nodes[i].Val.ep = -1
			delete(t.slot, k)
			t.order.Unlink(t.nodes, i)
			t.order.PushBack(t.nodes, i)
		}
	}
	// Freed nodes (ep −1) sit at the tail and are reused first.
}

// ---- rule pickers ----
//
// The pickers below carry the rule policies: each decides from the
// snapshot (and the prefix match) itself and reads no scores, so their
// profiles need no scorer but the one that provides the match.

// roundRobinPicker takes the next candidate, by endpoint index, in a fixed
// cycle over the pool: the first candidate at or after the one following
// the last pick, wrapping around.
type roundRobinPicker struct {
	mu   sync.Mutex
	next int // endpoint index after the last pick
}

func (*roundRobinPicker) Name() string { return PickerRoundRobin }

func (p *roundRobinPicker) Pick(c *Cycle, cands []int, _ []float64) int {
	if len(cands) == 0 {
		return -1
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	start := p.next % len(c.Eps)
	k := 0
	for j, i := range cands { // cands ascend: filters keep the order
		if i >= start {
			k = j
			break
		}
	}
	p.next = cands[k] + 1
	return k
}

// leastRequestPicker takes the candidate with the fewest requests in flight
// (Endpoint.InFlight), ties broken uniformly at random.
type leastRequestPicker struct{}

func (leastRequestPicker) Name() string { return PickerLeastRequest }

func (leastRequestPicker) Pick(c *Cycle, cands []int, _ []float64) int {
	return leastLoaded(c, cands, nil)
}

// leastLoaded returns the k of the candidate with the fewest in-flight
// requests, or -1 for no candidates. Ties go to the larger matched[cands[k]]
// when matched is not nil, then to a Preferred endpoint, then uniformly at
// random (reservoir sampling: one draw per tie after the first, in
// candidate order).
func leastLoaded(c *Cycle, cands []int, matched []int) int {
	eps := c.Eps
	best, ties := -1, 0
	for k, i := range cands {
		if best < 0 {
			best, ties = k, 1
			continue
		}
		b := cands[best]
		same := eps[i].InFlight == eps[b].InFlight && (matched == nil || matched[i] == matched[b])
		switch {
		case eps[i].InFlight < eps[b].InFlight ||
			(eps[i].InFlight == eps[b].InFlight && matched != nil && matched[i] > matched[b]) ||
			(same && eps[i].Preferred && !eps[b].Preferred):
			best, ties = k, 1
		case same && eps[i].Preferred == eps[b].Preferred:
			ties++
			if c.IntN(ties) == 0 {
				best = k
			}
		}
	}
	return best
}

// prefixRulePicker is the two-threshold cache-affinity rule (README.md,
// "prefix"): the candidate holding the longest prefix of the prompt (the
// profile's match source, Cycle.Matched) unless its advantage over the
// least-loaded candidate is below minGain of the prompt's blocks, or it is
// overloaded against it (balance); then the least-loaded candidate.
type prefixRulePicker struct {
	balance Balance
	minGain float64
}

func (prefixRulePicker) Name() string { return PickerPrefixRule }

func (p prefixRulePicker) Pick(c *Cycle, cands []int, _ []float64) int {
	matched := c.Matched()
	least := leastLoaded(c, cands, matched)
	if least < 0 {
		return -1
	}
	best := bestMatch(c, cands, matched)
	if best < 0 || best == least {
		return least
	}
	b, l := cands[best], cands[least]
	gain := matched[b] - matched[l]
	enough := float64(gain) >= p.minGain*float64(len(c.Req.Hashes)) && gain > 0
	if enough && !p.balance.overloaded(c.Eps[b].InFlight, c.Eps[l].InFlight) {
		return best
	}
	return least
}

// bestMatch returns the k of the candidate with the most matched blocks
// (ties: fewest in flight, then uniformly at random), or -1 if none
// matched.
func bestMatch(c *Cycle, cands []int, matched []int) int {
	eps := c.Eps
	best, ties := -1, 0
	for k, i := range cands {
		if matched[i] == 0 {
			continue
		}
		if best < 0 {
			best, ties = k, 1
			continue
		}
		b := cands[best]
		switch {
		case matched[i] > matched[b] || (matched[i] == matched[b] && eps[i].InFlight < eps[b].InFlight):
			best, ties = k, 1
		case matched[i] == matched[b] && eps[i].InFlight == eps[b].InFlight:
			ties++
			if c.IntN(ties) == 0 {
				best = k
			}
		}
	}
	return best
}
