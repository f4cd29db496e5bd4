package sched

import (
	"fmt"
	"math/bits"
	"strings"

	"github.com/infergate/infergate/prefix"
)

// Tier pricing: what routing knows of the KV tiers behind each endpoint's
// GPU (host memory, local disk) and of the shared remote tier, and what a
// hit in each is worth.
//
// An engine serves a prompt's leading blocks from its GPU prefix cache,
// then block by block from its host tier, its disk tier, the remote store,
// stopping at the first block none holds (vLLM's offloading connector and
// LMCache; sim/tiers.go). The index knows, per endpoint and medium, the
// leading blocks held (prefix.PreciseIndex fed by the engines' and the
// kvstore's KV events); SplitTiers turns those into the blocks each tier
// supplies. The cost scorer then estimates
//
//	TTFT_e ≈ (PendingPrefillTokens_e + max(1, P − B·Σ_t n_t)) / rate_e
//	         + Σ_{t below GPU, n_t > 0} (n_t · LoadSeconds_e[t] + Latency_e[t])
//
// (queue drain, prefill of the rest, loads of the lower-tier part; loads are
// asynchronous in the engine and queue on their tier's link, which the
// estimate leaves out), and the precise scorer credits a block from tier t
// with weight w_t = max(0, 1 − LoadSeconds_e[t] / (B / rate_e)): the
// fraction of its prefill time a load saves.
//
// Peers weigh tiers by fixed factors instead, and a profile's tier_weights
// reproduce them (both scorers then use Σ_t w_t · n_t as the matched blocks
// and price no load time): llm-d's precise prefix scorer gpu 1.0, cpu 0.8
// (llm-d-kv-cache, kvblock tier weights, docs/PROTOCOLS.md §8); Dynamo's
// kv-router --router-host-cache-hit-weight 0.75 and
// --router-disk-cache-hit-weight 0.25 (ai-dynamo/dynamo router docs).

// NumTiers is the number of tiers routing prices: the media of
// prefix.PreciseIndex from MediumGPU to MediumRemote.
const NumTiers = int(prefix.MediumRemote) + 1

// TierSource answers per-medium prefix matches: matched[e] is the number of
// leading blocks of hashes endpoint e holds in medium m, for every
// e < len(matched); MatchEndpoint is that number for endpoint e alone
// (matching e's group only); MatchPast is Match exact only past a floor
// per endpoint (at most the floor below it); Owners is the endpoints of group g (endpoints
// 64g … 64g+63) holding one block in medium m (bit i for endpoint 64g+i);
// Holey is the endpoints of group g whose blocks in m may not be
// prefix-closed (the others hold no block of a prompt past their Match).
// *prefix.PreciseIndex implements it.
type TierSource interface {
	Match(hashes []uint64, m prefix.Medium, matched []int)
	MatchEndpoint(hashes []uint64, m prefix.Medium, e int) int
	MatchPast(hashes []uint64, m prefix.Medium, from, matched []int)
	Owners(h uint64, m prefix.Medium, g int) uint64
	Holey(m prefix.Medium, g int) uint64
}

// Tiers is what a policy is told about its pool's tiers (Pool.Tiers).
type Tiers struct {
	// Source is the per-medium index; its endpoints are the pool's, then
	// (Remote) the remote store's.
	Source TierSource
	// Remote is the index in Source of the remote store, or -1 when the
	// pool has no remote tier.
	Remote int
	// LoadSeconds[e][t] is the time to load one block from tier t into
	// endpoint e's GPUs, seconds; Latency[e][t] the fixed cost of one load
	// (sim.Config.LoadCost for a simulated engine). Entries of tiers an
	// endpoint lacks are 0. Length: the pool size.
	LoadSeconds, Latency [][NumTiers]float64
}

// SplitTiers turns leading matches per tier (m[t]: leading prompt blocks
// tier t holds; the remote tier's are the store's, shared) into the blocks
// an engine takes from each: the GPU its m[GPU], then each lower tier,
// fastest first, the blocks past what faster tiers supplied, at most
// maxBlocks in all (an engine computes at least one prompt token:
// maxBlocks = (P − 1) / B). It assumes each tier's blocks are
// prefix-closed, which the lookup's block-by-block walk makes an
// underestimate when they are not.
func SplitTiers(m [NumTiers]int, maxBlocks int) (n [NumTiers]int) {
	reach := 0
	for t, k := range m {
		k = min(k, maxBlocks)
		if k > reach {
			n[t] = k - reach
			reach = k
		}
	}
	return n
}

// TierWeights are the fixed per-tier credits of a profile's tier_weights
// (YAML map: gpu, cpu, disk, remote; missing tiers 0, gpu 1 when missing).
type TierWeights [NumTiers]float64

// parseTierWeights reads a profile's tier_weights; nil for none (priced).
func parseTierWeights(m map[string]float64) (*TierWeights, error) {
	if m == nil {
		return nil, nil
	}
	w := TierWeights{1}
	for k, v := range m {
		if v < 0 || v > 1 || v != v {
			return nil, fmt.Errorf("tier_weights.%s %g must be in [0, 1]", k, v)
		}
		switch strings.ToLower(k) {
		case "gpu":
			w[prefix.MediumGPU] = v
		case "cpu", "host":
			w[prefix.MediumCPU] = v
		case "disk":
			w[prefix.MediumDisk] = v
		case "remote":
			w[prefix.MediumRemote] = v
		default:
			return nil, fmt.Errorf("tier_weights: unknown tier %q (want gpu, cpu, disk, remote)", k)
		}
	}
	return &w, nil
}

// poolTiers is the profile's tiers for the decision: read once, so that
// a SetTiers meanwhile (a reload) changes none of its prices midway.
func (c *Cycle) poolTiers() *Tiers {
	if !c.tiersLoaded {
		c.tiers, c.tiersLoaded = c.p.tiers.Load(), true
	}
	return c.tiers
}

// TierBlocks returns, for every endpoint of c.Eps, the prompt blocks it
// would take from each tier (Tiers.Split, the GPU's part being the
// profile's own Matched), or nil when the pool has no Tiers. Computed once
// per decision; valid until the decision ends.
func (c *Cycle) TierBlocks() [][NumTiers]int {
	t := c.poolTiers()
	if t == nil || t.Source == nil {
		return nil
	}
	if c.tierDone {
		return c.tierBlocks
	}
	c.tierDone = true
	n := len(c.Eps)
	if cap(c.tierBlocks) < n {
		c.tierBlocks = make([][NumTiers]int, n)
	}
	out := c.tierBlocks[:n]
	clear(out)
	if len(c.Req.Hashes) == 0 {
		return out
	}
	maxBlocks := len(c.Req.Hashes)
	if c.Req.PromptTokens > 0 {
		maxBlocks = min(maxBlocks, (c.Req.PromptTokens-1)/max(1, c.p.blockSize))
	}
	c.tierScratch = t.Split(c.Req.Hashes, maxBlocks, c.Matched(), out, c.tierScratch)
	return out
}

// Split sets out[e], for every e < len(out), to the blocks of a prompt
// (its request keys hashes) endpoint e would take from each tier: gpu[e]
// leading blocks from its GPU, then block by block from the fastest lower
// tier holding the next one (its host memory, its disk, the remote store),
// up to the first block none holds and at most maxBlocks in all — the
// engine's own lookup (sim/tiers.go). It starts from SplitTiers of the
// per-medium leading matches (host memory's past the GPU's: MatchPast; a
// bisecting Match of the pool for disk; the remote store's alone; a group
// that holds nothing in a medium costs one atomic load, a pool without a
// remote tier no remote match) and
// walks on from there (extend), so the total is the engine's; within the
// leading prefixes a slower tier may be credited with blocks a faster one
// also holds past a hole (the load time is then an upper bound). scratch
// is reused and returned. No allocation once scratch is large enough.
func (t *Tiers) Split(hashes []uint64, maxBlocks int, gpu []int, out [][NumTiers]int, scratch []int) []int {
	n := len(out)
	if cap(scratch) < 2*n {
		scratch = make([]int, 2*n)
	}
	cpu, disk := scratch[:n], scratch[n:2*n]
	clear(scratch[:2*n]) // Match leaves entries past the index's endpoints alone
	remote := 0
	if t.Remote >= 0 {
		remote = t.Source.MatchEndpoint(hashes, prefix.MediumRemote, t.Remote)
	}
	// Host memory's blocks count past the GPU's only (SplitTiers): an
	// endpoint's host match is needed where it exceeds its GPU match.
	t.Source.MatchPast(hashes, prefix.MediumCPU, gpu, cpu)
	t.Source.Match(hashes, prefix.MediumDisk, disk)
	for e := range n {
		if cpu[e]|disk[e]|remote == 0 { // the GPU's part only: SplitTiers' answer
			out[e] = [NumTiers]int{max(0, min(gpu[e], maxBlocks))}
			continue
		}
		out[e] = SplitTiers([NumTiers]int{gpu[e], cpu[e], disk[e], remote}, maxBlocks)
	}
	t.extend(hashes, out, maxBlocks)
	return scratch
}

// extend continues each endpoint's split past its reach block by block,
// as the engine's lookup does (sim/tiers.go: after the GPU prefix, each
// block from the fastest lower tier holding it, the remote store's
// included, up to the first block none holds): SplitTiers sees each tier's
// leading prefix only, and a tier evicting LRU by block keeps a prompt's
// later blocks after its first ones (which a faster tier may still hold).
// Each step reads the block's owners in the lower media once for every
// endpoint at that position; positions no endpoint is at are skipped, so
// the work is the length of the extensions, not of the prompt. Endpoints
// are walked in groups of prefix.MaxEndpoints (the index's owners masks),
// one group after the other.
//
// Only endpoints holey in a lower medium (TierSource.Holey), or all when
// the remote store is, can go on: one prefix-closed in host memory, disk
// and the store's view holds no block there past its leading match, and
// its reach (below maxBlocks) is the largest of those matches, so the walk
// would stop it at its first step.
func (t *Tiers) extend(hashes []uint64, out [][NumTiers]int, maxBlocks int) {
	remoteHoley := false
	if t.Remote >= 0 {
		remoteHoley = t.Source.Holey(prefix.MediumRemote, t.Remote/prefix.MaxEndpoints)&(1<<(t.Remote%prefix.MaxEndpoints)) != 0
	}
	for lo := 0; lo < len(out); lo += prefix.MaxEndpoints {
		g := lo / prefix.MaxEndpoints
		may := ^uint64(0)
		if !remoteHoley {
			may = t.Source.Holey(prefix.MediumCPU, g) | t.Source.Holey(prefix.MediumDisk, g)
		}
		if may != 0 {
			t.extendGroup(hashes, out[lo:min(len(out), lo+prefix.MaxEndpoints)], g, maxBlocks, may)
		}
	}
}

// extendGroup is extend for the endpoints of group g, out[i] being
// endpoint 64g+i's, those of may (bit i for out[i]) only.
func (t *Tiers) extendGroup(hashes []uint64, out [][NumTiers]int, g, maxBlocks int, may uint64) {
	var reach [prefix.MaxEndpoints]int
	var alive uint64
	for e := range out {
		k := out[e][0] + out[e][1] + out[e][2] + out[e][3]
		reach[e] = k
		if k < maxBlocks && k < len(hashes) {
			alive |= 1 << e
		}
	}
	alive &= may
	remoteBit, remoteGroup := uint64(0), 0
	if t.Remote >= 0 {
		remoteBit, remoteGroup = 1<<(t.Remote%prefix.MaxEndpoints), t.Remote/prefix.MaxEndpoints
	}
	for alive != 0 {
		i := maxBlocks
		for s := alive; s != 0; s &= s - 1 {
			i = min(i, reach[bits.TrailingZeros64(s)])
		}
		if i >= maxBlocks || i >= len(hashes) {
			return
		}
		h := hashes[i]
		cpu, disk := t.Source.Owners(h, prefix.MediumCPU, g), t.Source.Owners(h, prefix.MediumDisk, g)
		remote := remoteBit != 0 && t.Source.Owners(h, prefix.MediumRemote, remoteGroup)&remoteBit != 0
		for s := alive; s != 0; s &= s - 1 {
			e := bits.TrailingZeros64(s)
			if reach[e] != i {
				continue
			}
			bit := uint64(1) << e
			switch {
			case cpu&bit != 0:
				out[e][prefix.MediumCPU]++
			case disk&bit != 0:
				out[e][prefix.MediumDisk]++
			case remote:
				out[e][prefix.MediumRemote]++
			default:
				alive &^= bit
				continue
			}
			reach[e]++
			if reach[e] >= maxBlocks || reach[e] >= len(hashes) {
				alive &^= bit
			}
		}
	}
}

// tierCredit is the matched blocks endpoint e is credited with from its
// tier split n: Σ_t w_t · n_t with the profile's fixed weights, or priced
// weights (Tiers) at e's prefill rate (Cycle.rate, tokens/s, read only
// when n has a lower-tier block) when the profile has none.
func (c *Cycle) tierCredit(e int, n [NumTiers]int) float64 {
	if w := c.p.tierWeights; w != nil {
		s := 0.0
		for t, k := range n {
			s += w[t] * float64(k)
		}
		return s
	}
	s := float64(n[prefix.MediumGPU])
	if n[prefix.MediumCPU]|n[prefix.MediumDisk]|n[prefix.MediumRemote] == 0 {
		return s // the GPU's blocks only: no price to work out
	}
	perBlock := float64(c.p.blockSize) / c.rate(e) // prefill seconds a block costs
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

// rate is endpoint i's prefill rate for pricing tier hits: its own when
// known, else the cost scorer's configured one.
func (c *Cycle) rate(i int) float64 {
	if r := c.Eps[i].PrefillTokensPerSecond; r > 0 {
		return r
	}
	return c.p.rate
}

// loadSeconds is the estimated time endpoint e spends loading its
// lower-tier blocks n (0 with fixed tier weights, which price no loads).
func (c *Cycle) loadSeconds(e int, n [NumTiers]int) float64 {
	if n[prefix.MediumCPU]|n[prefix.MediumDisk]|n[prefix.MediumRemote] == 0 {
		return 0 // nothing to load
	}
	t := c.poolTiers()
	if c.p.tierWeights != nil || t == nil || e >= len(t.LoadSeconds) {
		return 0
	}
	s := 0.0
	for k := 1; k < NumTiers; k++ {
		if n[k] > 0 {
			s += float64(n[k])*t.LoadSeconds[e][k] + t.Latency[e][k]
		}
	}
	return s
}
