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

// prefixPolicy routes to the endpoint holding the longest prefix of the
// prompt unless that endpoint is overloaded or its advantage is negligible,
// then to the least-loaded endpoint; it records every pick in an approximate
// prefix index.
type prefixPolicy struct {
	cfg   PrefixConfig
	index *prefix.Index
	rng   *lockedRand
}

func newPrefixPolicy(cfg PrefixConfig, capacity []int, rng *lockedRand) (*prefixPolicy, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ix, err := prefix.NewIndex(capacity)
	if err != nil {
		return nil, err
	}
	return &prefixPolicy{cfg: cfg, index: ix, rng: rng}, nil
}

func (*prefixPolicy) Name() string      { return Prefix }
func (*prefixPolicy) NeedsHashes() bool { return true }

// Forget implements Forgetter: endpoint i's blocks are dropped from the index.
func (p *prefixPolicy) Forget(i int) { p.index.Clear(i) }

// SetCapacity implements Resizer.
func (p *prefixPolicy) SetCapacity(i, blocks int) { p.index.SetCapacity(i, blocks) }

func (p *prefixPolicy) Pick(req *Request, eps []Endpoint) Decision {
	var buf [prefix.MaxEndpoints]int
	matched := buf[:min(len(eps), prefix.MaxEndpoints)]
	eps = eps[:len(matched)]
	p.index.Match(req.Hashes, matched)

	least := leastLoaded(eps, p.rng, matched)
	if least < 0 {
		return Decision{Endpoint: -1}
	}
	chosen := least
	if best := p.bestMatch(eps, matched); best >= 0 && best != least {
		gain := matched[best] - matched[least]
		enough := float64(gain) >= p.cfg.MinMatchGain*float64(len(req.Hashes)) && gain > 0
		lb, ll := eps[best].InFlight, eps[least].InFlight
		if enough && !overloaded(lb, ll, p.cfg.BalanceAbsThreshold, p.cfg.BalanceRelThreshold) {
			chosen = best
		}
	}
	p.index.Insert(chosen, req.Hashes)
	return Decision{Endpoint: chosen, MatchedBlocks: matched[chosen]}
}

// bestMatch returns the ready endpoint with the most matched blocks (ties:
// fewest in flight, then uniformly at random), or -1 if none matched.
func (p *prefixPolicy) bestMatch(eps []Endpoint, matched []int) int {
	best, ties := -1, 0
	for i, ep := range eps {
		if !ep.Ready || matched[i] == 0 {
			continue
		}
		switch {
		case best < 0 || matched[i] > matched[best] ||
			(matched[i] == matched[best] && ep.InFlight < eps[best].InFlight):
			best, ties = i, 1
		case matched[i] == matched[best] && ep.InFlight == eps[best].InFlight:
			ties++
			if p.rng.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}
