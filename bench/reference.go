package bench

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
	ix, err := prefix.NewIndex([]int{max(capacityBlocks, 1)})
	if err != nil {
		return 0 // one endpoint is always accepted
	}
	var toks []uint32
	var hashes []uint64
	matched := make([]int, 1)
	var prompt, hit int64
	for i := range records {
		toks = records[i].Tokens(toks[:0])
		hashes = prefix.Hashes(hashes[:0], toks, blockSize, 0)
		ix.Match(hashes, matched)
		prompt += int64(len(toks))
		if len(toks) > 0 {
			hit += int64(min(matched[0]*blockSize, len(toks)-1))
		}
		ix.Insert(0, hashes)
	}
	if prompt == 0 {
		return 0
	}
	return float64(hit) / float64(prompt)
}
