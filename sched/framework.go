package sched

import (
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/infergate/infergate/prefix"
)

// The scheduling framework: a Profile runs a request through Filters, then
// weighted Scorers, then a Picker, the shape of the Kubernetes scheduler
// framework as the Gateway API Inference Extension / llm-d endpoint picker use
// it (llm-d/llm-d-router pkg/epp/framework/interface/scheduling/plugins.go):
//
//	candidates = ready endpoints of the pool
//	for each filter:  candidates = filter(candidates)   (a filter never empties the set; see Filter)
//	total[e] = Σ_s weight_s · score_s(e),   score_s(e) ∈ [0, 1]
//	chosen = picker(candidates, total)
//	for each learner: learn(chosen)
//
// Scores in [0, 1] make weights comparable: a weight is how many "whole
// endpoints' worth" of preference a scorer can express. Everything runs on a
// Cycle, one per decision, reused from a pool so that a decision allocates
// nothing in steady state.

// Filter removes endpoints that cannot or should not serve the request.
type Filter interface {
	// Name is the filter's configuration name.
	Name() string
	// Filter returns the subset of cands (endpoint indexes into c.Eps) to
	// keep, written in place into cands' backing array. A filter that would
	// remove every candidate returns cands unchanged when it is a preference
	// (hot-spot, adapter capacity) and an empty slice when it is a hard
	// constraint (readiness, model served); the Profile then picks nothing.
	Filter(c *Cycle, cands []int) []int
}

// Scorer rates candidates in [0, 1]; higher is better.
type Scorer interface {
	// Name is the scorer's configuration name.
	Name() string
	// Score writes scores[k] ∈ [0, 1] for endpoint cands[k], for every k.
	Score(c *Cycle, cands []int, scores []float64)
}

// Picker chooses one candidate from the weighted total scores.
type Picker interface {
	// Name is the picker's configuration name.
	Name() string
	// Pick returns an index k into cands (total[k] is cands[k]'s score), or
	// -1 if cands is empty.
	Pick(c *Cycle, cands []int, total []float64) int
}

// Learner is implemented by plugins that keep state from decisions (the
// approximate prefix index, the session table). Learn runs after the pick.
type Learner interface {
	Learn(c *Cycle, chosen int)
}

// Cycle is one scheduling decision's state: the request, the snapshot and
// values plugins share within the decision (the prefix match, computed once).
// It is owned by one goroutine for the duration of Profile.Pick.
type Cycle struct {
	// Req is the request being scheduled.
	Req *Request
	// Eps is the snapshot of the pool's endpoints; indexes are stable.
	Eps []Endpoint

	p *Profile
	// matched[e] is the number of leading prompt blocks endpoint e is
	// believed to hold per the profile's match source; valid once
	// matchedDone.
	matched     []int
	matchedDone bool
	// Matches of other sources (a profile with both prefix scorers).
	other    []int
	otherSrc MatchSource
	cands    []int
	total    []float64
	scores   []float64
	// Per-endpoint tier split (TierBlocks), valid once tierDone; tiers
	// the profile's tiers for the decision, valid once tiersLoaded.
	tierBlocks  [][NumTiers]int
	tierScratch []int
	tierDone    bool
	tiers       *Tiers
	tiersLoaded bool
	// ties is the max-score picker's scratch (tieScratch).
	ties []int
	// The decision's random stream: n is its ordinal among the profile's
	// decisions, seeded on the first draw.
	n      uint64
	seeded bool
	pcg    *rand.PCG
	rng    *rand.Rand
}

// Matched returns, for every endpoint of c.Eps, the number of leading prompt
// blocks (of the profile's block size) the profile's prefix index believes it
// holds: the precise index when the profile has one, else the approximate
// index, else all zeros. Computed on first use and shared by every plugin of
// the decision. The slice is valid until the decision ends.
func (c *Cycle) Matched() []int {
	if c.matchedDone {
		return c.matched
	}
	c.matchedDone = true
	m := c.matched[:len(c.Eps)]
	clear(m)
	if c.p.match != nil && len(c.Req.Hashes) > 0 {
		c.p.match.Match(c.Req.Hashes, m)
	}
	return m
}

// MatchedBy is Matched for a given source (computed once per decision and
// source; the profile's primary source shares Matched's buffer).
func (c *Cycle) MatchedBy(src MatchSource) []int {
	if src == c.p.match {
		return c.Matched()
	}
	if c.otherSrc != src {
		c.otherSrc = src
		m := c.other[:len(c.Eps)]
		clear(m)
		if len(c.Req.Hashes) > 0 {
			src.Match(c.Req.Hashes, m)
		}
	}
	return c.other[:len(c.Eps)]
}

// tieScratch returns an empty slice with room for n indexes, the cycle's
// own (valid until the decision ends).
func (c *Cycle) tieScratch(n int) []int {
	if cap(c.ties) < n {
		c.ties = make([]int, 0, n)
	}
	return c.ties[:0]
}

// IntN returns a uniform int in [0, n) from the decision's random stream.
func (c *Cycle) IntN(n int) int { return c.rand().IntN(n) }

// Float64 returns a uniform float64 in [0, 1) from the decision's random
// stream.
func (c *Cycle) Float64() float64 { return c.rand().Float64() }

// rand returns the decision's stream, seeded on first use from the
// profile's seed and the decision's ordinal.
func (c *Cycle) rand() *rand.Rand {
	if c.rng == nil {
		c.pcg = new(rand.PCG)
		c.rng = rand.New(c.pcg)
	}
	if !c.seeded {
		c.seeded = true
		c.pcg.Seed(decisionSeed(c.p.seed, c.n))
	}
	return c.rng
}

// MatchSource answers prefix matches: matched[e] = leading blocks of hashes
// endpoint e holds, for e < len(matched). *prefix.Index implements it; the
// precise index does through PreciseSource.
type MatchSource interface {
	Match(hashes []uint64, matched []int)
}

// WeightedScorer is a scorer with its weight (≥ 0).
type WeightedScorer struct {
	Scorer Scorer
	Weight float64
}

// Profile is a composed scheduling policy: filters, weighted scorers, a
// picker, and the learners among its plugins. It implements Policy and is
// safe for concurrent use.
type Profile struct {
	name     string
	filters  []Filter
	scorers  []WeightedScorer
	picker   Picker
	learners []Learner
	match    MatchSource // source of Cycle.Matched; nil: none
	hashes   bool        // some plugin reads Request.Hashes
	forget   []func(int)
	grow     []func(int) error // Grow's, one per index of the profile
	approx   *prefix.Index     // the approximate index, nil when no scorer uses it
	// spec is the precise index with the recent decisions' prompts
	// (speculative.go), nil unless the profile has a SpeculativeTTL and a
	// precise-prefix scorer; specTTL is the profile's TTL.
	spec    *speculative
	specTTL time.Duration
	// finishLearn: the approximate index learns a prompt again when its
	// request ends (PrefixConfig.LearnOnFinish, Finished).
	finishLearn bool
	// peerMatch is a peer scorer's own index (llm-d-prefix, sglang-tree;
	// peers.go), the match source when the profile has no precise one;
	// sglang is the sglang-tree scorer, which its picker reads.
	peerMatch MatchSource
	sglang    *sglangTree
	// tiers is the pool's tiers (nil: GPU only; replaced whole by
	// SetTiers, read once per decision: Cycle.poolTiers); tierWeights the
	// profile's fixed tier credits (nil: priced from tiers' load costs);
	// blockSize the routing block size (tokens).
	tiers       atomic.Pointer[Tiers]
	tierWeights *TierWeights
	blockSize   int
	rate        float64 // the cost scorer's configured prefill rate (tokens/s)
	// seed and decisions make each decision's random stream (Cycle.IntN):
	// decision n draws from a PCG seeded by (seed, n), so that its draws
	// depend on neither how many draws earlier decisions made (their ties,
	// their pickers) nor on concurrent decisions taking draws from a shared
	// source in between its own.
	seed      uint64
	decisions atomic.Uint64
	cycles    sync.Pool // *Cycle
}

// Name returns the profile's name.
func (p *Profile) Name() string { return p.name }

// NeedsHashes implements Policy.
func (p *Profile) NeedsHashes() bool { return p.hashes }

// Forget implements Forgetter: plugins with per-endpoint state (the
// approximate index, the session table) drop what they hold for endpoint i.
func (p *Profile) Forget(i int) {
	for _, f := range p.forget {
		f(i)
	}
}

// SetTiers implements TierSetter: the decisions that start after it price
// tiers by t.
func (p *Profile) SetTiers(t *Tiers) { p.tiers.Store(t) }

// Tiers returns the tiers the profile's decisions price (nil: none).
func (p *Profile) Tiers() *Tiers { return p.tiers.Load() }

// Grow implements Grower: the profile's indexes (the approximate index,
// a peer scorer's) take n slots, keeping what they hold.
func (p *Profile) Grow(n int) error {
	for _, g := range p.grow {
		if err := g(n); err != nil {
			return err
		}
	}
	return nil
}

// LearnPeer implements PeerLearner: the approximate index (when the
// profile has one) learns that endpoint i holds hashes, as the prefix
// scorer's Learn does for the profile's own decisions, and the precise
// match's speculative entries (when it has them) count them as held by i
// until the TTL or the engine's KV events, as this replica's own picks.
func (p *Profile) LearnPeer(i int, hashes []uint64) {
	if p.approx != nil {
		p.approx.Insert(i, hashes)
	}
	if p.spec != nil {
		p.spec.hold(i, hashes)
	}
}

// PinsPeers implements PeerFinisher: LearnOnFinish with a prefix scorer
// that pins its picks (not a P/D profile's, which only touch).
func (p *Profile) PinsPeers() bool {
	if !p.finishLearn || p.approx == nil {
		return false
	}
	for _, l := range p.learners {
		if ps, ok := l.(*prefixScorer); ok && ps.pin {
			return true
		}
	}
	return false
}

// LearnPeerPinned implements PeerFinisher: a peer's pick pins hashes on
// endpoint i (prefix.Index.LearnPinned, applied at once), as this
// replica's own picks do, until ReleasePeer. Whatever the endpoint's load:
// the peer's message does not say whether its own pick pinned
// (prefixScorer.runs), so an overfull endpoint's peer picks stay pinned
// here until their finish.
func (p *Profile) LearnPeerPinned(i int, hashes []uint64) {
	if p.finishLearn && p.approx != nil {
		p.approx.LearnPinned(i, hashes)
		p.approx.Settle()
	}
}

// ReleasePeer implements PeerFinisher: the end of a peer's pick that
// LearnPeerPinned pinned (prefix.Index.Release, applied at once).
func (p *Profile) ReleasePeer(i int, hashes []uint64) {
	if p.finishLearn && p.approx != nil {
		p.approx.Release(i, hashes)
		p.approx.Settle()
	}
}

// FinishPeer implements PeerFinisher: the approximate index touches
// hashes on endpoint i, tail to head so that the head is the freshest,
// inserting the blocks it no longer holds (prefix.Index.Insert, applied at
// once). Not Release: no pin of the peer's is there to take (its learn
// went unpinned or was never applied here), and a block this replica's
// own running request pinned (a shared system prompt) keeps its pin.
func (p *Profile) FinishPeer(i int, hashes []uint64) {
	if p.finishLearn && p.approx != nil {
		p.approx.Insert(i, hashes)
	}
}

// Finished implements Finisher: with PrefixConfig.LearnOnFinish, the
// approximate index releases the pin the pick took on hashes for endpoint
// i (the prefix scorer's Learn is then prefix.Index.LearnPinned) and makes
// them its most recently used blocks, the prompt's head the freshest, as
// the engine's free queue takes a finished request's blocks; a pick that
// did not pin (pinned false: its endpoint could not hold it running,
// prefixScorer.runs) changes nothing at its end — an overfull engine gives
// a finished request's blocks to the waiting ones at once, and its prompt
// may share blocks another running request pinned. A P/D profile's picks
// never pin: their ends touch the prompt (prefix.Index.Release). Applied
// by Settle.
func (p *Profile) Finished(i int, hashes []uint64, pinned bool) {
	if !p.finishLearn || len(hashes) == 0 {
		return
	}
	if p.PinsPeers() && !pinned {
		return
	}
	p.approx.Release(i, hashes)
}

// unpinned makes the prefix scorer's picks learn without pinning (P/D's
// profiles); Finished then only touches.
func (p *Profile) unpinned() {
	for _, l := range p.learners {
		if ps, ok := l.(*prefixScorer); ok {
			ps.pin = false
		}
	}
}

// LearnsOnFinish implements Finisher.
func (p *Profile) LearnsOnFinish() bool { return p.finishLearn }

// Settle implements Settler: the approximate index applies the learns
// its decisions queued (prefix.Index.Settle).
func (p *Profile) Settle() {
	if p.approx != nil {
		p.approx.Settle()
	}
}

// Unsettled implements Settler.
func (p *Profile) Unsettled() bool { return p.approx != nil && p.approx.Queued() > 0 }

// Queued implements Settler.
func (p *Profile) Queued() int {
	if p.approx == nil {
		return 0
	}
	return p.approx.Queued()
}

// SetCapacity implements Resizer: the approximate index's bound for
// endpoint i.
func (p *Profile) SetCapacity(i, blocks int) {
	if p.approx != nil {
		p.approx.SetCapacity(i, blocks)
	}
}

// Pick implements Policy: filter, score, pick, learn. Decision.MatchedBlocks
// is Cycle.Matched for the chosen endpoint. It allocates nothing once the
// profile has served a decision of the same pool size. Its random draws
// are a function of the policy's seed and the decision's ordinal (the
// number of Picks before it) only.
func (p *Profile) Pick(req *Request, eps []Endpoint) Decision {
	req.Pinned = false // set by the prefix scorer's Learn when it pins
	c, _ := p.cycles.Get().(*Cycle)
	if c == nil {
		c = &Cycle{p: p}
	}
	defer p.cycles.Put(c)
	n := len(eps)
	if cap(c.cands) < n {
		c.cands = make([]int, n)
		c.total = make([]float64, n)
		c.scores = make([]float64, n)
		c.matched = make([]int, n)
		c.other = make([]int, n)
	}
	c.Req, c.Eps, c.matchedDone, c.otherSrc, c.tierDone, c.tiersLoaded = req, eps, false, nil, false, false
	c.n, c.seeded = p.decisions.Add(1)-1, false
	defer func() { c.Req, c.Eps, c.otherSrc, c.tiers = nil, nil, nil, nil }()

	cands := c.cands[:0]
	for i := range eps {
		if eps[i].Ready && serves(eps[i].Role, req.Role) {
			cands = append(cands, i)
		}
	}
	for _, f := range p.filters {
		if len(cands) == 0 {
			break
		}
		cands = f.Filter(c, cands)
	}
	if len(cands) == 0 {
		return Decision{Endpoint: -1}
	}
	total := c.total[:len(cands)]
	clear(total)
	scores := c.scores[:len(cands)]
	for _, ws := range p.scorers {
		if ws.Weight == 0 {
			continue
		}
		ws.Scorer.Score(c, cands, scores)
		for k, s := range scores {
			total[k] += ws.Weight * clamp01(s)
		}
	}
	k := p.picker.Pick(c, cands, total)
	if k < 0 {
		return Decision{Endpoint: -1}
	}
	chosen := cands[k]
	d := Decision{Endpoint: chosen}
	if p.match != nil {
		d.MatchedBlocks = c.Matched()[chosen]
	}
	if tb := c.TierBlocks(); tb != nil {
		d.TierBlocks = tb[chosen]
		d.MatchedBlocks = 0
		for _, k := range d.TierBlocks {
			d.MatchedBlocks += k
		}
	}
	for _, l := range p.learners {
		l.Learn(c, chosen)
	}
	return d
}

func clamp01(x float64) float64 {
	switch {
	case x > 1:
		return 1
	case x >= 0:
		return x
	}
	return 0 // negative or NaN
}
