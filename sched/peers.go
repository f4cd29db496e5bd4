package sched

import (
	"fmt"
	"math"
	"slices"
	"sync"

	"github.com/infergate/infergate/prefix"
)

// The peers' routers as profiles of this framework, each from its documented
// formula and defaults (README.md, "Reference profiles of the peers"): the
// bar the default policy must clear on every workload. Their plugins:
//
//   - llm-d-prefix (scorer): llm-d's approximate prefix-cache scorer, with
//     its own index of 64-token blocks, a match cap and a fixed LRU capacity
//     per server; score = matched blocks / prompt blocks.
//   - no-hit-lru (scorer): llm-d's no-hit-LRU scorer, which spreads cold
//     requests over the endpoints least recently sent one.
//   - sglang-tree (scorer, weight 0) + sglang-cache-aware (picker): SGLang
//     router's cache-aware policy on its approximate per-worker tree.
//   - dynamo-cost (picker): Dynamo's KV router cost on the precise index.

// Peer profile names.
const (
	// LLMD is llm-d's "optimized baseline" scheduling profile: prefix-cache
	// scorer ×3 (64-token blocks, at most 256 matched, 31,250 per server),
	// queue ×2, KV-cache utilisation ×2, no-hit-LRU ×2, max-score picker
	// with exact ties broken at random.
	LLMD = "llm-d"
	// SGLang is SGLang router's (SMG's) cache_aware policy: shortest queue
	// when imbalanced (abs 64, rel 1.5), else the longest tree match when
	// its match rate exceeds 0.3, else the smallest tree.
	SGLang = "sglang"
	// Dynamo is Dynamo's KV router: argmin of overlap_weight·prefill_blocks
	// + decode_blocks (weight 1.0) on the engines' KV events, softmax
	// sampling at router_temperature (0: argmin, ties at random).
	Dynamo = "dynamo"
)

// Peer plugin names.
const (
	ScorerLLMDPrefix  = "llm-d-prefix"
	ScorerNoHitLRU    = "no-hit-lru"
	ScorerSGLangTree  = "sglang-tree"
	PickerSGLang      = "sglang-cache-aware"
	PickerDynamoCost  = "dynamo-cost"
	peerPluginsScorer = "llm-d-prefix, no-hit-lru, sglang-tree"
)

// LLMDConfig tunes the llm-d-prefix scorer (YAML routing.llm_d). Zero
// values take the Gateway API Inference Extension prefix plugin's defaults
// (kubernetes-sigs/gateway-api-inference-extension v1.0.0,
// pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go:
// DefaultHashBlockSize 64, DefaultMaxPrefixBlocks 256,
// DefaultLRUCapacityPerServer 31250), the 64-token blocks issue 19 names
// for llm-d's optimized baseline (whose guide, llm-d v0.9.0, sets no
// prefix parameter). GIE v1.0.0 counted the 64 in characters of the
// prompt; later releases (blockSizeTokens) and llm-d's guides count
// tokens, as here. llm-d-router's current approximate producer defaults
// differ (16-token blocks, a 131,072-token cap, autotuned from the
// engines' metrics).
type LLMDConfig struct {
	// BlockSizeTokens is the scorer's hash block (tokens; default 64). It
	// must be a multiple of routing.prefix.block_size: a block of it
	// matches when its last routing block does (the hashes are chained).
	BlockSizeTokens int `yaml:"block_size_tokens"`
	// MaxPrefixBlocksToMatch caps the blocks hashed and matched per prompt
	// (default 256: 16,384 tokens at 64 per block). Two prompts equal up to
	// the cap look the same.
	MaxPrefixBlocksToMatch int `yaml:"max_prefix_blocks_to_match"`
	// LRUCapacityPerServer bounds the index per endpoint (blocks of
	// BlockSizeTokens; default 31,250, sized in GIE for Llama-3-8B on one
	// H100: 500k tokens at 16 per block). It does not follow the engine's
	// KV capacity (2M tokens at 64 per block: 4.3× what one of the
	// simulated 70B engines holds).
	LRUCapacityPerServer int `yaml:"lru_capacity_per_server"`
	// LRUSize is how many endpoints the no-hit-lru scorer tracks (default
	// 1024, llm-d's defaultLRUSize).
	LRUSize int `yaml:"lru_size"`
}

// Defaults of LLMDConfig (sources on LLMDConfig).
const (
	DefaultLLMDBlockSizeTokens        = 64
	DefaultLLMDMaxPrefixBlocksToMatch = 256
	DefaultLLMDLRUCapacityPerServer   = 31250
	DefaultLLMDNoHitLRUSize           = 1024
)

func (c LLMDConfig) withDefaults() LLMDConfig {
	if c.BlockSizeTokens == 0 {
		c.BlockSizeTokens = DefaultLLMDBlockSizeTokens
	}
	if c.MaxPrefixBlocksToMatch == 0 {
		c.MaxPrefixBlocksToMatch = DefaultLLMDMaxPrefixBlocksToMatch
	}
	if c.LRUCapacityPerServer == 0 {
		c.LRUCapacityPerServer = DefaultLLMDLRUCapacityPerServer
	}
	if c.LRUSize == 0 {
		c.LRUSize = DefaultLLMDNoHitLRUSize
	}
	return c
}

// SGLangConfig tunes the sglang-cache-aware picker and its tree (YAML
// routing.sglang). Zero values take SGLang model gateway's defaults
// (sgl-project/sglang sgl-router, src/main.rs CliArgs and
// src/policies/cache_aware.rs, 2026: cache_threshold 0.3,
// balance_abs_threshold 64, balance_rel_threshold 1.5, max_tree_size
// 67,108,864 characters per worker, eviction every 120 s).
type SGLangConfig struct {
	// CacheThreshold is the match rate (matched / prompt tokens) above
	// which the longest-matching worker is taken (default 0.3).
	CacheThreshold float64 `yaml:"cache_threshold"`
	// BalanceAbsThreshold and BalanceRelThreshold define imbalance over the
	// candidates' in-flight requests: max − min > abs AND max > rel · min
	// (defaults 64 and 1.5); imbalanced, the least-loaded worker is taken.
	BalanceAbsThreshold int     `yaml:"balance_abs_threshold"`
	BalanceRelThreshold float64 `yaml:"balance_rel_threshold"`
	// MaxTreeSize bounds each worker's tree in characters (default 2^26),
	// kept here as an LRU of MaxTreeSize / (4 · block_size) blocks per
	// endpoint (4 characters per token, the estimate llm-d uses too).
	// SGLang evicts its trees' LRU leaves to this size every
	// eviction_interval_secs; the bound here holds at every insert.
	MaxTreeSize int `yaml:"max_tree_size"`
}

// Defaults of SGLangConfig (sources on SGLangConfig).
const (
	DefaultSGLangCacheThreshold      = 0.3
	DefaultSGLangBalanceAbsThreshold = 64
	DefaultSGLangBalanceRelThreshold = 1.5
	DefaultSGLangMaxTreeSize         = 1 << 26
	sglangCharsPerToken              = 4
)

func (c SGLangConfig) withDefaults() SGLangConfig {
	if c.CacheThreshold == 0 {
		c.CacheThreshold = DefaultSGLangCacheThreshold
	}
	if c.BalanceAbsThreshold == 0 {
		c.BalanceAbsThreshold = DefaultSGLangBalanceAbsThreshold
	}
	if c.BalanceRelThreshold == 0 {
		c.BalanceRelThreshold = DefaultSGLangBalanceRelThreshold
	}
	if c.MaxTreeSize == 0 {
		c.MaxTreeSize = DefaultSGLangMaxTreeSize
	}
	return c
}

// DynamoConfig tunes the dynamo-cost picker (YAML routing.dynamo). Zero
// values take Dynamo's defaults (ai-dynamo/dynamo KvRouterConfig,
// lib/llm/src/kv_router.rs: overlap_score_weight 1.0,
// router_temperature 0.0).
type DynamoConfig struct {
	// OverlapScoreWeight weighs the prefill blocks against the decode
	// blocks (default 1.0; --kv-overlap-score-weight).
	OverlapScoreWeight float64 `yaml:"overlap_score_weight"`
	// Temperature is the softmax sampling temperature (default 0: the
	// cheapest endpoint, exact ties at random; --router-temperature).
	// Negative values are refused; set a small positive value for
	// "almost 0".
	Temperature float64 `yaml:"router_temperature"`
}

// DefaultDynamoOverlapScoreWeight is DynamoConfig.OverlapScoreWeight's
// default.
const DefaultDynamoOverlapScoreWeight = 1.0

func (c DynamoConfig) withDefaults() DynamoConfig {
	if c.OverlapScoreWeight == 0 {
		c.OverlapScoreWeight = DefaultDynamoOverlapScoreWeight
	}
	return c
}

// exactTies is the tie tolerance of the peers' max-score pickers: GIE's
// max-score-picker shuffles the endpoints and takes the highest score, so
// only exactly equal totals tie.
var exactTies = 0.0

// peerProfiles are the peers' built-in profiles.
var peerProfiles = map[string]ProfileConfig{
	// llm-d/llm-d guides/optimized-baseline (v0.9.0) and
	// llm-d-router test/epp well-known configs "optimized-baseline":
	// queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer
	// 3, no-hit-lru-scorer 2; max-score-picker; no filter.
	LLMD: {
		Scorers: []ScorerConfig{
			{Type: ScorerQueue, Weight: 2},
			{Type: ScorerKVUtilization, Weight: 2},
			{Type: ScorerLLMDPrefix, Weight: 3},
			{Type: ScorerNoHitLRU, Weight: 2},
		},
		Picker:       PickerMaxScore,
		TieTolerance: &exactTies,
	},
	// The tree is the picker's match source and learner; it scores
	// nothing (weight 0): the rule picker decides.
	SGLang: {
		Scorers: []ScorerConfig{{Type: ScorerSGLangTree, Weight: 0}},
		Picker:  PickerSGLang,
	},
	// The precise index (KV events, as Dynamo's KvIndexer) at weight 0
	// only provides the overlap; the picker computes the cost.
	Dynamo: {
		Scorers: []ScorerConfig{{Type: ScorerPrecisePrefix, Weight: 0}},
		Picker:  PickerDynamoCost,
	},
}

// ---- llm-d: prefix-cache scorer on 64-token blocks ----

// llmdPrefix is llm-d's approximate prefix-cache scorer (GIE prefix
// plugin, sources on LLMDConfig): its own index of blocks of
// stride·block_size tokens, at most maxBlocks of them per prompt, each
// endpoint's LRU bounded by LRUCapacityPerServer regardless of its KV
// cache, learning every decision. As a MatchSource it reports matches in
// routing blocks (its blocks × stride), so Decision.MatchedBlocks and the
// ledger's prefill estimate read it like any index.
//
//	score(e) = m(e) / n,   m(e) = leading blocks e holds, n = blocks hashed
//
// (no gain over the least-matching endpoint, no threshold: GIE's
// formula). A block of the scorer is identified by the chained hash of its
// last routing block, Request.Hashes[k·stride + stride − 1], which
// identifies the prompt up to the block's end.
type llmdPrefix struct {
	ix        *prefix.Index
	stride    int
	maxBlocks int
	bufs      sync.Pool // *[]uint64, the strided hashes of one call
}

func newLLMDPrefix(cfg LLMDConfig, routingBlock, endpoints int) (*llmdPrefix, error) {
	cfg = cfg.withDefaults()
	switch {
	case cfg.BlockSizeTokens < 1 || cfg.BlockSizeTokens%routingBlock != 0:
		return nil, fmt.Errorf("llm_d.block_size_tokens %d: must be a positive multiple of prefix.block_size %d", cfg.BlockSizeTokens, routingBlock)
	case cfg.MaxPrefixBlocksToMatch < 1:
		return nil, fmt.Errorf("llm_d.max_prefix_blocks_to_match %d: must be at least 1", cfg.MaxPrefixBlocksToMatch)
	case cfg.LRUCapacityPerServer < 1:
		return nil, fmt.Errorf("llm_d.lru_capacity_per_server %d: must be at least 1", cfg.LRUCapacityPerServer)
	}
	capacity := make([]int, endpoints)
	for i := range capacity {
		capacity[i] = cfg.LRUCapacityPerServer
	}
	ix, err := prefix.NewIndex(capacity)
	if err != nil {
		return nil, err
	}
	return &llmdPrefix{ix: ix, stride: cfg.BlockSizeTokens / routingBlock, maxBlocks: cfg.MaxPrefixBlocksToMatch}, nil
}

func (*llmdPrefix) Name() string { return ScorerLLMDPrefix }

// strided returns the scorer's block hashes of a prompt's routing-block
// hashes in a pooled buffer; the caller puts it back.
func (s *llmdPrefix) strided(hashes []uint64) *[]uint64 {
	bp, _ := s.bufs.Get().(*[]uint64)
	if bp == nil {
		bp = new([]uint64)
	}
	b := (*bp)[:0]
	for i := s.stride - 1; i < len(hashes) && len(b) < s.maxBlocks; i += s.stride {
		b = append(b, hashes[i])
	}
	*bp = b
	return bp
}

// Match implements MatchSource in routing blocks.
func (s *llmdPrefix) Match(hashes []uint64, matched []int) {
	bp := s.strided(hashes)
	defer s.bufs.Put(bp)
	if len(*bp) == 0 {
		clear(matched)
		return
	}
	s.ix.Match(*bp, matched)
	for i := range matched {
		matched[i] *= s.stride
	}
}

func (s *llmdPrefix) Score(c *Cycle, cands []int, scores []float64) {
	n := min(len(c.Req.Hashes)/s.stride, s.maxBlocks)
	m := c.MatchedBy(s)
	for k, i := range cands {
		scores[k] = 0
		if n > 0 {
			scores[k] = float64(m[i]/s.stride) / float64(n)
		}
	}
}

// Learn records the prompt's blocks as held by the chosen endpoint (GIE's
// PreRequest adds them, asynchronously there).
func (s *llmdPrefix) Learn(c *Cycle, chosen int) {
	bp := s.strided(c.Req.Hashes)
	s.ix.Insert(chosen, *bp)
	s.bufs.Put(bp)
}

// ---- llm-d: no-hit-LRU scorer ----

// noHitLRU is llm-d's no-hit-lru-scorer (llm-d/llm-d-router,
// pkg/epp/framework/plugins/scheduling/scorer/nohitlru/no_hit_lru.go): a
// request is cold when no candidate holds any of its blocks (the profile's
// match source; without one every request is cold). A warm request scores
// 0.5 everywhere. A cold one, among n candidates: the endpoints that never
// received a cold request first, in candidate order, then the others from
// least to most recently sent one,
//
//	score = 1 − rank / (n − 1),   rank = never-used before it, or
//	        (never-used count) + its position in the LRU (0 = oldest),
//
// floored at 0 (1 for a lone candidate). The chosen endpoint of a cold
// request becomes the most recent. This spreads the cache growth of cold
// prompts evenly.
type noHitLRU struct {
	mu    sync.Mutex
	size  int
	order []int32 // endpoints that received a cold request, oldest first
}

func (*noHitLRU) Name() string { return ScorerNoHitLRU }

// cold reports whether no candidate (ready endpoint) matches.
func cold(c *Cycle) bool {
	m := c.Matched()
	for i := range c.Eps {
		if c.Eps[i].Ready && m[i] > 0 {
			return false
		}
	}
	return true
}

func (s *noHitLRU) Score(c *Cycle, cands []int, scores []float64) {
	if !cold(c) {
		for k := range cands {
			scores[k] = 0.5
		}
		return
	}
	n := len(cands)
	if n == 1 {
		scores[0] = 1
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	never := 0
	for k, i := range cands {
		if !slices.Contains(s.order, int32(i)) {
			scores[k] = 1 - float64(never)/float64(n-1)
			never++
		}
	}
	for k, i := range cands {
		if pos := slices.Index(s.order, int32(i)); pos >= 0 {
			scores[k] = max(0, 1-float64(never+pos)/float64(n-1))
		}
	}
}

// Learn moves the chosen endpoint of a cold request to the front (most
// recent), dropping the oldest beyond size.
func (s *noHitLRU) Learn(c *Cycle, chosen int) {
	if !cold(c) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if pos := slices.Index(s.order, int32(chosen)); pos >= 0 {
		s.order = slices.Delete(s.order, pos, pos+1)
	} else if len(s.order) >= s.size {
		s.order = slices.Delete(s.order, 0, 1)
	}
	s.order = append(s.order, int32(chosen))
}

func (s *noHitLRU) forget(e int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if pos := slices.Index(s.order, int32(e)); pos >= 0 {
		s.order = slices.Delete(s.order, pos, pos+1)
	}
}

// ---- SGLang: cache-aware policy ----

// sglangTree is SGLang router's approximate per-worker tree as an index
// of routing blocks: every request routed is inserted for its worker
// (in the imbalanced branch too), each worker's part bounded by
// MaxTreeSize characters. Tree size (Len) is what "smallest tree" compares.
// It scores nothing: the sglang-cache-aware picker decides.
type sglangTree struct{ ix *prefix.Index }

func (*sglangTree) Name() string { return ScorerSGLangTree }

func (*sglangTree) Score(_ *Cycle, _ []int, scores []float64) { clear(scores) }

func (t *sglangTree) Learn(c *Cycle, chosen int) { t.ix.Insert(chosen, c.Req.Hashes) }

func newSGLangTree(cfg SGLangConfig, routingBlock, endpoints int) (*sglangTree, error) {
	cfg = cfg.withDefaults()
	if cfg.MaxTreeSize < 1 {
		return nil, fmt.Errorf("sglang.max_tree_size %d: must be at least 1", cfg.MaxTreeSize)
	}
	capacity := make([]int, endpoints)
	for i := range capacity {
		capacity[i] = sglangCapacity(cfg, routingBlock)
	}
	ix, err := prefix.NewIndex(capacity)
	if err != nil {
		return nil, err
	}
	return &sglangTree{ix: ix}, nil
}

// sglangCapacity is a worker's bound in the sglang-tree index, in routing
// blocks: MaxTreeSize characters at sglangCharsPerToken (cfg defaulted).
func sglangCapacity(cfg SGLangConfig, routingBlock int) int {
	return max(1, cfg.MaxTreeSize/(sglangCharsPerToken*routingBlock))
}

// sglangPicker is SGLang router's cache_aware select_worker
// (sgl-project/sglang sgl-router/src/policies/cache_aware.rs):
//
//	imbalanced = max L − min L > abs  AND  max L > rel · min L
//	imbalanced:          the least-loaded candidate (first of equals)
//	else, b = argmax m:  b when m(b)·B / P > cache_threshold,
//	                     else the candidate with the smallest tree
//
// with L the in-flight requests the router counts per worker (its
// load()), m the tree's leading matched blocks of B tokens, P the prompt's
// tokens (SGLang divides matched by prompt characters). Ties of the match
// and of the tree size go uniformly at random (SGLang: the tree's and the
// map's iteration order).
type sglangPicker struct {
	cfg  SGLangConfig
	tree *sglangTree
}

func (sglangPicker) Name() string { return PickerSGLang }

func (p sglangPicker) Pick(c *Cycle, cands []int, _ []float64) int {
	if len(cands) == 0 {
		return -1
	}
	lo, hi, least := math.MaxInt, math.MinInt, -1
	for k, i := range cands {
		l := c.Eps[i].InFlight
		if l < lo {
			lo, least = l, k
		}
		hi = max(hi, l)
	}
	if hi-lo > p.cfg.BalanceAbsThreshold && float64(hi) > p.cfg.BalanceRelThreshold*float64(lo) {
		return least
	}
	m := c.Matched()
	best, ties := -1, 0
	for k, i := range cands {
		switch {
		case best < 0 || m[i] > m[cands[best]]:
			best, ties = k, 1
		case m[i] == m[cands[best]]:
			ties++
			if c.IntN(ties) == 0 {
				best = k
			}
		}
	}
	if p.rate(c, m[cands[best]]) > p.cfg.CacheThreshold {
		return best
	}
	small, ties, size := -1, 0, math.MaxInt
	for k, i := range cands {
		n := p.tree.ix.Len(i)
		switch {
		case n < size:
			small, ties, size = k, 1, n
		case n == size:
			ties++
			if c.IntN(ties) == 0 {
				small = k
			}
		}
	}
	return small
}

// rate is the match rate of m leading blocks: matched tokens / prompt
// tokens, at most 1.
func (p sglangPicker) rate(c *Cycle, m int) float64 {
	if c.Req.PromptTokens <= 0 {
		return 0
	}
	return min(1, float64(m*c.p.blockSize)/float64(c.Req.PromptTokens))
}

// ---- Dynamo: KV router cost ----

// dynamoPicker is Dynamo's KV router worker selection
// (ai-dynamo/dynamo DefaultWorkerSelector, lib/llm/src/kv_router/
// scheduler.rs, later lib/kv-router/src/scheduling/selector.rs; docs
// "KV Router": logit = kv_overlap_score_weight × potential_prefill_blocks
// + potential_active_blocks):
//
//	prefill_blocks(e) = (pending prefill(e) + P − B·m(e)) / B
//	decode_blocks(e)  = ⌈in-flight prompt tokens(e) / B⌉ + ⌈P / B⌉
//	logit(e)          = w · prefill_blocks(e) + decode_blocks(e)   (lower is better)
//
// with m(e) the profile's match (the precise index, as Dynamo's KvIndexer
// fed by KV events), P prompt tokens, B the block size. Dynamo's active
// sequences count the blocks of every request in flight once (shared ones
// deduplicated) and grow with decoded tokens; the gateway's ledger knows
// the prompt tokens in flight, so shared prefixes in flight count once per
// request here and decoded tokens not at all. At temperature 0 the lowest
// logit wins, exact ties at random (Dynamo: tree size, then map order);
// above 0 an endpoint is drawn with probability softmax(−logit / ((max −
// min) · T)) (selector.rs softmax_sample).
type dynamoPicker struct{ cfg DynamoConfig }

func (dynamoPicker) Name() string { return PickerDynamoCost }

func (p dynamoPicker) Pick(c *Cycle, cands []int, total []float64) int {
	if len(cands) == 0 {
		return -1
	}
	m := c.Matched()
	b := float64(c.p.blockSize)
	pt := float64(c.Req.PromptTokens)
	lo, hi := math.Inf(1), math.Inf(-1)
	logit := total // the totals are unused (no weighted scorer): reuse the buffer
	for k, i := range cands {
		ep := &c.Eps[i]
		prefill := (float64(ep.PendingPrefillTokens) + max(0, pt-b*float64(m[i]))) / b
		decode := math.Ceil(float64(ep.InFlightTokens)/b) + math.Ceil(pt/b)
		logit[k] = p.cfg.OverlapScoreWeight*prefill + decode
		lo, hi = min(lo, logit[k]), max(hi, logit[k])
	}
	if p.cfg.Temperature <= 0 || hi == lo {
		pick, ties := -1, 0
		for k := range cands {
			if logit[k] == lo {
				ties++
				if c.IntN(ties) == 0 {
					pick = k
				}
			}
		}
		return pick
	}
	// softmax of −logit/((hi−lo)·T), shifted by its maximum −lo/((hi−lo)·T).
	scale := 1 / ((hi - lo) * p.cfg.Temperature)
	sum := 0.0
	for k := range cands {
		logit[k] = math.Exp(-(logit[k] - lo) * scale)
		sum += logit[k]
	}
	x := c.Float64() * sum
	for k := range cands {
		if x < logit[k] {
			return k
		}
		x -= logit[k]
	}
	return len(cands) - 1
}

// ---- wiring ----

// newPeerScorer builds a peer scorer for p (newScorer's peer cases),
// registering its index as p's peer match source, its learner and its
// forget hook.
func (p *Profile) newPeerScorer(name string, cfg Config, pool Pool, pcfg PrefixConfig) (Scorer, error) {
	n := len(pool.Capacity)
	switch name {
	case ScorerLLMDPrefix:
		s, err := newLLMDPrefix(cfg.LLMD, pcfg.BlockSize, n)
		if err != nil {
			return nil, err
		}
		if p.peerMatch != nil {
			return nil, fmt.Errorf("scorer %s: the profile already has a peer index", name)
		}
		p.peerMatch = s
		p.learners = append(p.learners, s)
		p.forget = append(p.forget, s.ix.Clear)
		perServer := cfg.LLMD.withDefaults().LRUCapacityPerServer
		p.grow = append(p.grow, func(n int) error { return s.ix.Grow(n, perServer) })
		p.hashes = true
		return s, nil
	case ScorerNoHitLRU:
		lc := cfg.LLMD.withDefaults()
		if lc.LRUSize < 1 {
			return nil, fmt.Errorf("llm_d.lru_size %d: must be at least 1", lc.LRUSize)
		}
		s := &noHitLRU{size: lc.LRUSize}
		p.learners = append(p.learners, s)
		p.forget = append(p.forget, s.forget)
		return s, nil
	case ScorerSGLangTree:
		t, err := newSGLangTree(cfg.SGLang, pcfg.BlockSize, n)
		if err != nil {
			return nil, err
		}
		if p.peerMatch != nil {
			return nil, fmt.Errorf("scorer %s: the profile already has a peer index", name)
		}
		p.peerMatch, p.sglang = t.ix, t
		p.learners = append(p.learners, t)
		p.forget = append(p.forget, t.ix.Clear)
		perWorker := sglangCapacity(cfg.SGLang.withDefaults(), pcfg.BlockSize)
		p.grow = append(p.grow, func(n int) error { return t.ix.Grow(n, perWorker) })
		p.hashes = true
		return t, nil
	}
	return nil, fmt.Errorf("unknown scorer %q", name)
}

// newPeerPicker returns the peer picker of that name for p, or nil for
// any other name (newPicker's).
func (p *Profile) newPeerPicker(name string, cfg Config) (Picker, error) {
	switch name {
	case PickerSGLang:
		if p.sglang == nil {
			return nil, fmt.Errorf("picker %s needs an %s scorer", name, ScorerSGLangTree)
		}
		sc := cfg.SGLang.withDefaults()
		switch {
		case !(sc.CacheThreshold >= 0 && sc.CacheThreshold <= 1):
			return nil, fmt.Errorf("sglang.cache_threshold %g: must be in [0, 1]", sc.CacheThreshold)
		case sc.BalanceAbsThreshold < 0:
			return nil, fmt.Errorf("sglang.balance_abs_threshold %d: must be >= 0", sc.BalanceAbsThreshold)
		case !(sc.BalanceRelThreshold >= 1) || math.IsInf(sc.BalanceRelThreshold, 0):
			return nil, fmt.Errorf("sglang.balance_rel_threshold %g: must be >= 1 and finite", sc.BalanceRelThreshold)
		}
		return sglangPicker{cfg: sc, tree: p.sglang}, nil
	case PickerDynamoCost:
		if p.match == nil {
			return nil, fmt.Errorf("picker %s needs a prefix, precise-prefix or llm-d-prefix scorer for its overlap", name)
		}
		dc := cfg.Dynamo.withDefaults()
		switch {
		case !(dc.OverlapScoreWeight >= 0) || math.IsInf(dc.OverlapScoreWeight, 0):
			return nil, fmt.Errorf("dynamo.overlap_score_weight %g: must be >= 0 and finite", dc.OverlapScoreWeight)
		case !(dc.Temperature >= 0) || math.IsInf(dc.Temperature, 0):
			return nil, fmt.Errorf("dynamo.router_temperature %g: must be >= 0 and finite", dc.Temperature)
		}
		return dynamoPicker{cfg: dc}, nil
	}
	return nil, nil
}
