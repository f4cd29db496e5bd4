package sched

import (
	"fmt"

	"github.com/infergate/infergate/prefix"
)

// PrefixConfig tunes the prefix (cache-aware) policy; see README.md for the
// rule. Zero values take the defaults noted.
type PrefixConfig struct {
	// BlockSize is the number of tokens per hashed block (default 16, vLLM's
	// default KV block size).
	BlockSize int `yaml:"block_size"`
	// BalanceAbsThreshold and BalanceRelThreshold define "overloaded": the
	// best-matching endpoint is skipped for the least-loaded one when its
	// in-flight requests exceed the least-loaded endpoint's by more than
	// BalanceAbsThreshold (default 12 requests) AND by a factor of more than
	// BalanceRelThreshold (default 2). Same two-threshold form as SGLang's
	// router (balance_abs_threshold, balance_rel_threshold).
	BalanceAbsThreshold int     `yaml:"balance_abs_threshold"`
	BalanceRelThreshold float64 `yaml:"balance_rel_threshold"`
	// MinMatchGain is the smallest advantage, as a fraction of the prompt's
	// blocks, that the best-matching endpoint must hold over the least-loaded
	// one to be preferred (default 0.05). A shared system prompt that every
	// endpoint holds gives no advantage, so such requests balance by load.
	MinMatchGain float64 `yaml:"min_match_gain"`
}

// Defaults of PrefixConfig.
const (
	DefaultBalanceAbsThreshold = 12
	DefaultBalanceRelThreshold = 2.0
	DefaultMinMatchGain        = 0.05
)

// WithDefaults returns c with zero fields set to their defaults.
func (c PrefixConfig) WithDefaults() PrefixConfig {
	if c.BlockSize == 0 {
		c.BlockSize = prefix.DefaultBlockSize
	}
	if c.BalanceAbsThreshold == 0 {
		c.BalanceAbsThreshold = DefaultBalanceAbsThreshold
	}
	if c.BalanceRelThreshold == 0 {
		c.BalanceRelThreshold = DefaultBalanceRelThreshold
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
	case c.BalanceRelThreshold < 1:
		return fmt.Errorf("prefix.balance_rel_threshold %g: must be >= 1", c.BalanceRelThreshold)
	case c.MinMatchGain < 0 || c.MinMatchGain > 1:
		return fmt.Errorf("prefix.min_match_gain %g: must be in [0, 1]", c.MinMatchGain)
	}
	return nil
}
