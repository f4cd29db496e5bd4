package sched

import (
	"fmt"

	"github.com/infergate/infergate/prefix"
)

// PrefixConfig tunes prefix matching (YAML routing.prefix): the block size
// of every prefix index and the smallest match gain that counts. Zero values
// take the defaults noted.
type PrefixConfig struct {
	// BlockSize is the number of tokens per hashed block (default 16, vLLM's
	// default KV block size).
	BlockSize int `yaml:"block_size"`
	// BalanceAbsThreshold and BalanceRelThreshold are deprecated aliases of
	// Config.Balance's Abs and Rel (which apply to the hot-spot filter
	// too); 0 when not set. They once defined the prefix rule's own
	// overload test, default 12 requests and 2.0.
	BalanceAbsThreshold int     `yaml:"balance_abs_threshold"`
	BalanceRelThreshold float64 `yaml:"balance_rel_threshold"`
	// MinMatchGain is the smallest advantage, as a fraction of the prompt's
	// blocks, that the best-matching endpoint must hold over the least-loaded
	// one to be preferred (default 0.05). A shared system prompt that every
	// endpoint holds gives no advantage, so such requests balance by load.
	MinMatchGain float64 `yaml:"min_match_gain"`
	// LearnOnFinish makes the approximate index (the prefix scorer's) evict
	// in the engine's order: a pick pins the prompt on its endpoint
	// (prefix.Index.LearnPinned) and the request's end (Finisher) releases
	// it and touches it (prefix.Index.Release). A vLLM engine keeps a running
	// request's blocks out of its LRU free queue and frees a finished one's
	// tail first to the queue's recent end (vllm/v1/core/block_pool.py
	// free_blocks, kv_cache_utils.py FreeKVCacheBlockQueue), so what it
	// evicts next depends on what still runs and when the rest ended, not on
	// when requests were routed. Without it the index orders each
	// endpoint's blocks by routing time and forgets long prompts the engine
	// still holds (sched/README.md "Eviction by finish time"). A pick pins
	// only when its endpoint's KV cache holds every prompt in flight there
	// and this one; past that a request waits in the engine, holding no
	// blocks, so it is learnt unpinned and its end changes nothing
	// (prefixScorer.runs, Request.Pinned; sched/README.md "Pins under
	// overload"). nil: the default, DefaultLearnOnFinish.
	LearnOnFinish *bool `yaml:"learn_on_finish"`
}

// DefaultLearnOnFinish is PrefixConfig.LearnOnFinish's default: on since
// 2026-12-05, when `infergate plan judge` found it winning the ten Mooncake
// cells of issue 19's table that plain cache-aware lost, for two agentic p50s
// moved by 0.3–0.6% (sched/README.md "The default, cell by cell").
const DefaultLearnOnFinish = true

// learnOnFinish is c's LearnOnFinish or its default.
func (c PrefixConfig) learnOnFinish() bool {
	if c.LearnOnFinish == nil {
		return DefaultLearnOnFinish
	}
	return *c.LearnOnFinish
}

// DefaultMinMatchGain is PrefixConfig.MinMatchGain's default.
const DefaultMinMatchGain = 0.05

// WithDefaults returns c with zero fields set to their defaults.
func (c PrefixConfig) WithDefaults() PrefixConfig {
	if c.BlockSize == 0 {
		c.BlockSize = prefix.DefaultBlockSize
	}
	if c.MinMatchGain == 0 {
		c.MinMatchGain = DefaultMinMatchGain
	}
	return c
}

// Validate reports the first invalid setting.
func (c PrefixConfig) Validate() error {
	switch {
	case c.BlockSize < 1:
		return fmt.Errorf("prefix.block_size %d: must be at least 1", c.BlockSize)
	case c.BalanceAbsThreshold < 0:
		return fmt.Errorf("prefix.balance_abs_threshold %d: must be >= 0", c.BalanceAbsThreshold)
	case c.BalanceRelThreshold != 0 && !(c.BalanceRelThreshold >= 1):
		return fmt.Errorf("prefix.balance_rel_threshold %g: must be >= 1", c.BalanceRelThreshold)
	case c.MinMatchGain < 0 || c.MinMatchGain > 1:
		return fmt.Errorf("prefix.min_match_gain %g: must be in [0, 1]", c.MinMatchGain)
	}
	return nil
}
