// Package sched is infergate's scheduling core: given a request's view and a
// read-only snapshot of the endpoints that serve its model, a Policy picks one.
// It does no I/O and reads no clock, so the live gateway, benchmarks and
// (later) the virtual-time planner run the same decisions.
package sched

import (
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
)

// Endpoint is the scheduler's view of one endpoint at decision time.
type Endpoint struct {
	// Name identifies the endpoint in logs and metrics (its base URL).
	Name string
	// Ready is false while the endpoint is failing health checks or ejected.
	Ready bool
	// InFlight is the number of requests the gateway has sent to the endpoint
	// that have not finished (gateway-side accounting, requests).
	InFlight int
}

// Request is the scheduler's view of one request.
type Request struct {
	// Model is the requested model name.
	Model string
	// Hashes are the chained block hashes of the prompt (see package prefix);
	// empty for policies that do not need them.
	Hashes []uint64
	// PromptTokens is the prompt length in tokens.
	PromptTokens int
}

// Decision is a policy's pick.
type Decision struct {
	// Endpoint is the index of the chosen endpoint in the snapshot, or -1 if
	// no endpoint is ready.
	Endpoint int
	// MatchedBlocks is the number of leading prompt blocks the policy expects
	// the endpoint to hold (prefix policy only; 0 otherwise).
	MatchedBlocks int
}

// Policy picks an endpoint for a request. Implementations are safe for
// concurrent use. The eps slice is indexed consistently across calls: entry i
// is always the same endpoint of the pool the policy was built for.
type Policy interface {
	// Name returns the policy's configuration name ("prefix", ...).
	Name() string
	// Pick chooses among the ready endpoints of eps.
	Pick(req *Request, eps []Endpoint) Decision
	// NeedsHashes reports whether Pick reads Request.Hashes, so callers can
	// skip tokenization for policies that do not.
	NeedsHashes() bool
}

// Forgetter is implemented by policies that keep per-endpoint state an
// engine restart invalidates (the prefix policy's index). The gateway calls
// Forget when it takes an endpoint out of rotation after a failure, since an
// engine that failed has likely lost its KV cache.
type Forgetter interface {
	// Forget drops what the policy believes endpoint i holds.
	Forget(i int)
}

// Policy names accepted by New.
const (
	RoundRobin   = "round-robin"
	LeastRequest = "least-request"
	Random       = "random"
	Prefix       = "prefix"
)

// Names lists the policy names New accepts, default first.
func Names() []string { return []string{Prefix, RoundRobin, LeastRequest, Random} }

// Config selects and tunes a policy (YAML key "routing").
type Config struct {
	// Policy is one of Names(); default "prefix".
	Policy string `yaml:"policy"`
	// Seed seeds tie-breaking and the random policy (0 = fixed default seed).
	Seed uint64 `yaml:"seed"`
	// Prefix tunes the prefix policy.
	Prefix PrefixConfig `yaml:"prefix"`
}

// New builds the configured policy for a pool whose endpoint i can hold about
// capacity[i] prompt blocks (of Config.Prefix.BlockSize tokens). It returns an
// error for an unknown policy name or invalid prefix settings.
func New(cfg Config, capacity []int) (Policy, error) {
	seed := cfg.Seed
	if seed == 0 {
		seed = 0x1f0a
	}
	r := newLockedRand(seed)
	switch cfg.Policy {
	case RoundRobin:
		return &roundRobin{}, nil
	case LeastRequest:
		return &leastRequest{rng: r}, nil
	case Random:
		return &random{rng: r}, nil
	case Prefix, "":
		return newPrefixPolicy(cfg.Prefix, capacity, r)
	}
	names := Names()
	sort.Strings(names)
	return nil, fmt.Errorf("unknown routing policy %q (want one of %v)", cfg.Policy, names)
}

// lockedRand is a seeded PCG behind a mutex: deterministic for a given seed
// and call order, safe for concurrent use.
type lockedRand struct {
	mu sync.Mutex
	r  *rand.Rand
}

func newLockedRand(seed uint64) *lockedRand {
	return &lockedRand{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

// IntN returns a uniform int in [0, n).
func (l *lockedRand) IntN(n int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.IntN(n)
}

// roundRobin cycles through the ready endpoints.
type roundRobin struct {
	mu   sync.Mutex
	next int
}

func (*roundRobin) Name() string      { return RoundRobin }
func (*roundRobin) NeedsHashes() bool { return false }

func (p *roundRobin) Pick(_ *Request, eps []Endpoint) Decision {
	p.mu.Lock()
	defer p.mu.Unlock()
	for range eps {
		i := p.next % len(eps)
		p.next = i + 1
		if eps[i].Ready {
			return Decision{Endpoint: i}
		}
	}
	return Decision{Endpoint: -1}
}

// leastRequest picks the ready endpoint with the fewest in-flight requests,
// breaking ties uniformly at random.
type leastRequest struct{ rng *lockedRand }

func (*leastRequest) Name() string      { return LeastRequest }
func (*leastRequest) NeedsHashes() bool { return false }

func (p *leastRequest) Pick(_ *Request, eps []Endpoint) Decision {
	return Decision{Endpoint: leastLoaded(eps, p.rng, nil)}
}

// leastLoaded returns the ready endpoint with the fewest in-flight requests
// (ties broken uniformly at random by reservoir sampling; when matched is not
// nil, ties are first broken by the longest match), or -1.
func leastLoaded(eps []Endpoint, rng *lockedRand, matched []int) int {
	best, ties := -1, 0
	for i, ep := range eps {
		if !ep.Ready {
			continue
		}
		switch {
		case best < 0 || ep.InFlight < eps[best].InFlight ||
			(ep.InFlight == eps[best].InFlight && matched != nil && matched[i] > matched[best]):
			best, ties = i, 1
		case ep.InFlight == eps[best].InFlight && (matched == nil || matched[i] == matched[best]):
			ties++
			if rng.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}

// random picks a ready endpoint uniformly at random.
type random struct{ rng *lockedRand }

func (*random) Name() string      { return Random }
func (*random) NeedsHashes() bool { return false }

func (p *random) Pick(_ *Request, eps []Endpoint) Decision {
	ready := 0
	for _, ep := range eps {
		if ep.Ready {
			ready++
		}
	}
	if ready == 0 {
		return Decision{Endpoint: -1}
	}
	k := p.rng.IntN(ready)
	for i, ep := range eps {
		if ep.Ready {
			if k == 0 {
				return Decision{Endpoint: i}
			}
			k--
		}
	}
	return Decision{Endpoint: -1}
}
