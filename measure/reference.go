package measure

import (
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/trace"
)

// PooledCacheHitRate is the pooled-cache reference of a fleet: the fraction
// of prompt tokens a single prefix cache of capacityBlocks blocks of
// blockSize tokens (the whole fleet's KV capacity in one engine) would serve,
// replaying records in order with no concurrency. Each prompt hits its
// longest cached prefix of full blocks, capped at len−1 tokens as vLLM
// recomputes at least the last prompt token
// (vllm/v1/core/kv_cache_manager.py get_computed_blocks), then all its blocks
// become the most recently used, touched tail-first so that a prompt's head
// outlives its tail, as vLLM's free-block queue orders them. This is the hit
// rate a perfect router could approach without replicating any prefix; no
// cache-aware policy on N engines of C blocks should be expected to exceed
// it by much (replication only costs capacity). Prompts are the records'
// tokens (trace.Record.Tokens) hashed like the gateway's routing, with seed
// 0. It returns 0 for no prompt tokens.
func PooledCacheHitRate(records []trace.Record, capacityBlocks, blockSize int) float64 {
	prompt, hits := pooledHits(records, capacityBlocks, blockSize)
	var p, h int64
	for i := range prompt {
		p += int64(prompt[i])
		h += int64(hits[i])
	}
	if p == 0 {
		return 0
	}
	return float64(h) / float64(p)
}

// pooledHits replays records through one prefix cache of capacityBlocks
// blocks (see PooledCacheHitRate) and returns each record's prompt length
// and hit (tokens).
func pooledHits(records []trace.Record, capacityBlocks, blockSize int) (prompt, hits []int) {
	prompt, hits = make([]int, len(records)), make([]int, len(records))
	if blockSize <= 0 {
		return prompt, hits
	}
	ix, err := prefix.NewIndex([]int{max(capacityBlocks, 1)})
	if err != nil {
		return prompt, hits // one endpoint is always accepted
	}
	var toks []uint32
	var hashes []uint64
	matched := make([]int, 1)
	for i := range records {
		toks = records[i].Tokens(toks[:0])
		hashes = prefix.Hashes(hashes[:0], toks, blockSize, 0)
		n := len(toks)
		ix.Match(hashes, matched)
		prompt[i] = n
		if n > 0 {
			hits[i] = min(matched[0]*blockSize, n-1)
		}
		ix.Insert(0, hashes)
	}
	return prompt, hits
}

// References are the reference prefix-cache hits of a replayed workload,
// per record in replay order (Record.Index): what a pooled cache (one cache
// with the fleet's whole KV capacity, PooledCacheHitRate) and an infinite
// cache (trace.InfiniteCacheHitRate) would serve each request. A run's
// reference hit rates are these summed over the same requests its own hit
// rate counts (Apply): warm-up requests fill the reference caches, as they
// fill the engines', but are not counted.
type References struct {
	// Prompt is each record's prompt length (tokens).
	Prompt []int `json:"-"`
	// Pooled is each record's pooled-cache hit (tokens); nil when there is
	// no fleet capacity to pool (a --target run).
	Pooled []int `json:"-"`
	// Infinite is each record's infinite-cache hit (tokens); nil when the
	// records have no hash ids.
	Infinite []int `json:"-"`
	// PooledBlocks and BlockSize are the pooled cache's capacity: blocks
	// of BlockSize tokens (0 when Pooled is nil).
	PooledBlocks int `json:"pooled_blocks,omitempty"`
	BlockSize    int `json:"block_size,omitempty"`
	// Tiered is each record's hit in the pooled reference's tiered twin:
	// one cache of TieredBlocks, the fleet's blocks in every tier (GPU,
	// host, disk, remote) pooled; nil without tiers (AddTiered).
	Tiered       []int `json:"-"`
	TieredBlocks int   `json:"tiered_blocks,omitempty"`
}

// AddTiered computes the tiered twin of the pooled reference (Tiered) for
// a fleet whose tiers hold tieredBlocks blocks in all, GPUs included. It
// prices no load: a tiered hit is a hit, as the engines count it.
func (r *References) AddTiered(records []trace.Record, tieredBlocks, blockSize int) {
	if tieredBlocks <= 0 || blockSize <= 0 {
		return
	}
	_, r.Tiered = pooledHits(records, tieredBlocks, blockSize)
	r.TieredBlocks = tieredBlocks
}

// TieredRate is Rates' sum for the tiered twin (nil without one).
func (r *References) TieredRate(recs []Record) *float64 {
	if r == nil || r.Tiered == nil {
		return nil
	}
	var prompt, h int64
	for i := range recs {
		k := recs[i].Index
		if recs[i].Error != "" || recs[i].Warmup || k < 0 || k >= len(r.Prompt) {
			continue
		}
		prompt += int64(r.Prompt[k])
		h += int64(r.Tiered[k])
	}
	if prompt == 0 {
		return nil
	}
	v := float64(h) / float64(prompt)
	return &v
}

// NewReferences computes the references of records for a fleet whose KV
// capacity is capacityBlocks blocks of blockSize tokens in all
// (capacityBlocks ≤ 0: none, no pooled reference).
func NewReferences(records []trace.Record, capacityBlocks, blockSize int) *References {
	r := &References{}
	if capacityBlocks > 0 && blockSize > 0 {
		r.Prompt, r.Pooled = pooledHits(records, capacityBlocks, blockSize)
		r.PooledBlocks, r.BlockSize = capacityBlocks, blockSize
	} else {
		r.Prompt = make([]int, len(records))
		var toks []uint32
		for i := range records {
			toks = records[i].Tokens(toks[:0])
			r.Prompt[i] = len(toks)
		}
	}
	for i := range records {
		if len(records[i].HashIDs) > 0 {
			r.Infinite = trace.InfiniteCacheHits(records)
			break
		}
	}
	return r
}

// Rates returns the pooled and infinite reference hit rates of recs (Σ
// reference hits / Σ prompt tokens over recs' successful, measured
// requests, looked up by Record.Index, as Summary.HitRate counts them); nil
// for a reference not computed or no such requests.
func (r *References) Rates(recs []Record) (pooled, infinite *float64) {
	if r == nil {
		return nil, nil
	}
	var prompt, hp, hi int64
	for i := range recs {
		k := recs[i].Index
		if recs[i].Error != "" || recs[i].Warmup || k < 0 || k >= len(r.Prompt) {
			continue
		}
		prompt += int64(r.Prompt[k])
		if r.Pooled != nil {
			hp += int64(r.Pooled[k])
		}
		if r.Infinite != nil {
			hi += int64(r.Infinite[k])
		}
	}
	if prompt == 0 {
		return nil, nil
	}
	if r.Pooled != nil {
		v := float64(hp) / float64(prompt)
		pooled = &v
	}
	if r.Infinite != nil {
		v := float64(hi) / float64(prompt)
		infinite = &v
	}
	return pooled, infinite
}

// Apply sets s's reference hit rates (Summary.PooledHitRate,
// InfiniteHitRate) to Rates(recs); recs are the run's records.
func (r *References) Apply(s *Summary, recs []Record) {
	s.PooledHitRate, s.InfiniteHitRate = r.Rates(recs)
	s.PooledTieredHitRate = r.TieredRate(recs)
}

// All returns the pooled and infinite reference hit rates of every record
// (warm-up included), as Report.PooledHitRate and InfiniteHitRate hold them.
func (r *References) All() (pooled, infinite *float64) {
	if r == nil {
		return nil, nil
	}
	recs := make([]Record, len(r.Prompt))
	for i := range recs {
		recs[i].Index = i
	}
	return r.Rates(recs)
}
