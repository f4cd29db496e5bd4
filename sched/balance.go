package sched

import (
	"errors"
	"fmt"
)

// Balance is the one load-balance test of every policy (YAML
// routing.balance): an endpoint is overloaded against the least-loaded
// candidate when its requests in flight from this gateway exceed the least
// loaded's by more than Abs AND are more than Rel times them, the
// two-threshold form of SGLang's router (sgl-router cache_aware.rs,
// balance_abs_threshold / balance_rel_threshold). The hot-spot filter drops
// overloaded candidates; the prefix rule leaves its best match for the
// least-loaded endpoint when the match is overloaded.
//
// It replaces two settings of the same test with different names and
// defaults, kept as deprecated aliases (Config.Deprecated):
// routing.hot_spot.{abs,rel} (the hot-spot filter's, 32 and 3.0) and
// routing.prefix.{balance_abs_threshold,balance_rel_threshold} (the prefix
// rule's, 12 and 2.0).
type Balance struct {
	// Abs is the load gap in requests (default 32, ≥ 0).
	Abs int `yaml:"abs"`
	// Rel is the load ratio (default 3.0, ≥ 1).
	Rel float64 `yaml:"rel"`
	// KeepFastest makes the hot-spot filter keep an overloaded candidate
	// whose estimated TTFT for this request (the cost scorer's: prefill
	// backlog plus the request's uncached part, at the prefill rate) is
	// lower than every other candidate's that is not overloaded: the filter
	// then moves a request only to an endpoint the load estimate itself
	// expects to serve it no later. The prefix rule ignores it. nil: the
	// default, DefaultBalanceKeepFastest.
	KeepFastest *bool `yaml:"keep_fastest"`
}

// DefaultBalanceKeepFastest is Balance.KeepFastest's default: on since
// 2026-12-06. Judged on the policy table (sched/README.md, "keep_fastest
// by default"): 7 workloads, 8 engines seeds 0–4, 4 and 6 engines seeds
// 0–2, 16 engines seed 0, the default profile loses fewer of issue 19's
// cells on every size (42 → 38, 26 → 24, 57 → 51, 48 → 47, 16 → 15; 20
// gained, 6 given up) and has a smaller geometric excess over the table's
// best on every one (plan.Margins); so does precise-prefix on 8 engines
// (cache-aware-ttft on seeds 0–2, not 3–4: 1.9% → 2.0%).
const DefaultBalanceKeepFastest = true

// keepFastest is b's KeepFastest or its default.
func (b Balance) keepFastest() bool {
	if b.KeepFastest == nil {
		return DefaultBalanceKeepFastest
	}
	return *b.KeepFastest
}

// HotSpotConfig is the deprecated name of Balance (YAML routing.hot_spot).
type HotSpotConfig = Balance

// Defaults of Balance: the hot-spot filter's, loose because the cost
// scorer of the default policy already weighs load; the filter is the
// backstop when affinity would still pile work on one endpoint. Chosen on
// the Mooncake trace (README.md): the prefix rule's tighter 12 / 2.0 cost
// the cache-aware profile about a point of hit rate for no gain in TTFT.
const (
	DefaultBalanceAbs = 32
	DefaultBalanceRel = 3.0
)

// overloaded reports whether load is overloaded against least.
func (b Balance) overloaded(load, least int) bool {
	return load-least > b.Abs && float64(load) > b.Rel*float64(least)
}

// balance resolves cfg's balance test: routing.balance, else the
// deprecated routing.hot_spot, else the deprecated
// routing.prefix.balance_*_threshold, field by field, then the defaults. Two
// of them set to different values are an error.
func (cfg Config) balance() (Balance, error) {
	abs := []setting[int]{
		{"balance.abs", cfg.Balance.Abs},
		{"hot_spot.abs", cfg.HotSpot.Abs},
		{"prefix.balance_abs_threshold", cfg.Prefix.BalanceAbsThreshold},
	}
	rel := []setting[float64]{
		{"balance.rel", cfg.Balance.Rel},
		{"hot_spot.rel", cfg.HotSpot.Rel},
		{"prefix.balance_rel_threshold", cfg.Prefix.BalanceRelThreshold},
	}
	b := Balance{Abs: DefaultBalanceAbs, Rel: DefaultBalanceRel, KeepFastest: cfg.Balance.KeepFastest}
	var errA, errR, errK error
	b.Abs, errA = resolve(abs, b.Abs)
	b.Rel, errR = resolve(rel, b.Rel)
	switch on, dep := cfg.Balance.KeepFastest, cfg.HotSpot.KeepFastest; {
	case on == nil:
		b.KeepFastest = dep
	case dep != nil && *dep != *on:
		errK = fmt.Errorf("routing.balance.keep_fastest %v and routing.hot_spot.keep_fastest %v disagree: set routing.balance.keep_fastest only", *on, *dep)
	}
	if err := errors.Join(errA, errR, errK); err != nil {
		return b, err
	}
	switch {
	case b.Abs < 0:
		return b, fmt.Errorf("routing.balance.abs %d: must be >= 0", b.Abs)
	case !(b.Rel >= 1):
		return b, fmt.Errorf("routing.balance.rel %g: must be >= 1", b.Rel)
	}
	return b, nil
}

type setting[T comparable] struct {
	key string
	v   T
}

// resolve returns the first set (non-zero) value of s, or def; an error if
// two set values differ.
func resolve[T comparable](s []setting[T], def T) (T, error) {
	var zero T
	first := -1
	for i, x := range s {
		switch {
		case x.v == zero:
		case first < 0:
			first = i
		case x.v != s[first].v:
			return def, fmt.Errorf("routing.%s %v and routing.%s %v disagree: set routing.%s only", s[first].key, s[first].v, x.key, x.v, s[0].key)
		}
	}
	if first < 0 {
		return def, nil
	}
	return s[first].v, nil
}

// Deprecated returns a warning for every deprecated setting cfg uses, for
// the caller to log (package sched does no I/O).
func (cfg Config) Deprecated() []string {
	var out []string
	if cfg.HotSpot != (Balance{}) {
		out = append(out, "routing.hot_spot is deprecated: write routing.balance {abs, rel, keep_fastest}, the one balance test of the hot-spot filter and the prefix rule")
	}
	if cfg.Prefix.BalanceAbsThreshold != 0 || cfg.Prefix.BalanceRelThreshold != 0 {
		out = append(out, "routing.prefix.balance_abs_threshold and balance_rel_threshold are deprecated: write routing.balance {abs, rel}, the one balance test of the hot-spot filter and the prefix rule (which now applies to both)")
	}
	return out
}
