package sched

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/infergate/infergate/prefix"
)

// ProfileConfig composes a scheduling profile (YAML routing.profiles.NAME):
//
//	routing:
//	  policy: my-profile
//	  profiles:
//	    my-profile:
//	      filters: [model, adapter-capacity, hot-spot]
//	      scorers:
//	        - {type: prefix, weight: 2}
//	        - {type: cost, weight: 1}
//	      picker: max-score
//
// Readiness is always filtered first. Unknown names are errors.
type ProfileConfig struct {
	// Filters run in order (names: model, adapter-capacity, hot-spot,
	// ttft-bound).
	Filters []string `yaml:"filters"`
	// Scorers and their weights (≥ 0; names: prefix, precise-prefix, queue,
	// kv-utilization, in-flight-tokens, session, lora, cost, ttft, and the peers'
	// llm-d-prefix, no-hit-lru, sglang-tree; peers.go).
	Scorers []ScorerConfig `yaml:"scorers"`
	// Picker: max-score (default), weighted-random, power-of-two, or a
	// rule picker (round-robin, least-request, prefix-rule, and the peers'
	// sglang-cache-aware, dynamo-cost; peers.go).
	Picker string `yaml:"picker"`
	// TieTolerance overrides routing.tie_tolerance for this profile's
	// max-score picker (0: only exactly equal totals tie, as GIE's
	// max-score-picker; the llm-d profile's). Unset: routing.tie_tolerance.
	TieTolerance *float64 `yaml:"tie_tolerance"`
	// TierWeights credits a prompt block by the tier it would come from
	// (keys gpu, cpu, disk, remote; weights in [0, 1]) in the precise and
	// cost scorers, as llm-d and Dynamo weigh tiers; unset, hits are
	// priced by their load time (tiers.go). Only pools with Tiers use it.
	TierWeights map[string]float64 `yaml:"tier_weights"`
	// SpeculativeTTL, for a profile with a precise-prefix scorer, counts
	// each decision's prompt as held by the chosen endpoint in the precise
	// index's match until this long after the decision (llm-d's
	// speculative indexing; speculative.go): the index otherwise learns
	// the blocks only from the engine's KV events, after the request's
	// queueing and prefill. 0 (the default of a composed profile): off.
	// The built-in precise-prefix profile sets DefaultSpeculativeTTL. Not
	// applied on a pool with tiers (the tier split comes from the index's
	// per-medium matches alone).
	SpeculativeTTL time.Duration `yaml:"speculative_ttl"`
}

// ScorerConfig is one weighted scorer of a profile.
type ScorerConfig struct {
	Type   string  `yaml:"type"`
	Weight float64 `yaml:"weight"`
}

// Built-in profile names. Every policy is a profile: the rule policies
// (round-robin, least-request, random, prefix) are profiles whose picker
// carries the rule and reads no scores.
const (
	// RoundRobin cycles through the ready endpoints.
	RoundRobin = "round-robin"
	// LeastRequest takes the ready endpoint with the fewest requests in
	// flight, ties at random.
	LeastRequest = "least-request"
	// Random takes a ready endpoint uniformly at random.
	Random = "random"
	// Prefix is the two-threshold cache-affinity rule on the approximate
	// index (README.md, "prefix").
	Prefix = "prefix"
	// PowerOfTwo samples two endpoints and takes the one with the shorter
	// queue: a load-only baseline.
	PowerOfTwo = "power-of-two"
	// CacheAware is the weighted form of prefix routing on the approximate
	// index: prefix match plus the cost (estimated TTFT) scorer, hot spots
	// filtered.
	CacheAware = "cache-aware"
	// PrecisePrefix is CacheAware on the index fed by the engines' KV
	// events, its speculative entries bridging their lag (with tiers: the
	// approximate index instead, precisePrefixScorers); it needs a pool
	// whose endpoints publish them. With tiers, hits below the GPU are
	// priced by their load time.
	PrecisePrefix = "precise-prefix"
	// LLMDTiered is PrecisePrefix's tiered composition (precisePrefixScorers)
	// with llm-d's fixed tier weights (gpu 1.0, cpu 0.8; no disk or remote
	// tier) in place of priced loads.
	LLMDTiered = "llm-d-tiered"
	// DynamoTiered is PrecisePrefix's tiered composition
	// (precisePrefixScorers) with Dynamo's fixed tier weights (gpu 1.0,
	// host 0.75, disk 0.25; no remote tier).
	DynamoTiered = "dynamo-tiered"
	// TieredCost routes on the estimated TTFT alone — queue drain, load time
	// of the lower-tier part, prefill of the rest (the cost scorer with the
	// pool's tiers priced; the precise index its only match source) — and
	// lets no affinity score outweigh it: with a shared remote tier any
	// endpoint can load a prefix, so load balance decides (sched/README.md,
	// "KV tiers").
	TieredCost = "tiered-cost"
	// CacheAwareTTFT routes on the ttft scorer alone on the approximate
	// index: the request's estimated TTFT plus the prefill work it adds,
	// hit and backlog in one unit (seconds; ttft.go), hot spots filtered.
	CacheAwareTTFT = "cache-aware-ttft"
)

// builtinProfiles are the profiles every configuration knows.
var builtinProfiles = map[string]ProfileConfig{
	RoundRobin:   {Picker: PickerRoundRobin},
	LeastRequest: {Picker: PickerLeastRequest},
	// weighted-random without scorers: every total is 0, so uniform.
	Random: {Picker: PickerWeightedRandom},
	// The prefix scorer provides the approximate index (match and
	// learning); the rule picker reads the match, not the score.
	Prefix: {
		Scorers: []ScorerConfig{{Type: ScorerPrefix, Weight: 1}},
		Picker:  PickerPrefixRule,
	},
	PowerOfTwo: {
		Scorers: []ScorerConfig{{Type: ScorerQueue, Weight: 1}},
		Picker:  PickerPowerOfTwo,
	},
	CacheAware: {
		Filters: []string{FilterModel, FilterAdapterCapacity, FilterHotSpot},
		Scorers: []ScorerConfig{
			{Type: ScorerPrefix, Weight: 2},
			{Type: ScorerCost, Weight: 1},
			{Type: ScorerLoRA, Weight: 0.5},
		},
		Picker: PickerMaxScore,
	},
	PrecisePrefix: {
		Filters: []string{FilterModel, FilterAdapterCapacity, FilterHotSpot},
		// The precise index alone, at the weight of cache-aware's prefix
		// scorer: until the engine's KV events for a decision arrive (they
		// come after the engine's step), its prompt counts as held by its
		// endpoint in the precise match (speculative.go), a peer
		// replica's decisions too (Profile.LearnPeer). On a pool with
		// tiers, which has no speculative entries, the approximate index
		// bridges that lag instead (precisePrefixScorers, NewPolicy).
		Scorers:        []ScorerConfig{{Type: ScorerPrecisePrefix, Weight: 2}, {Type: ScorerCost, Weight: 1}, {Type: ScorerLoRA, Weight: 0.5}},
		Picker:         PickerMaxScore,
		SpeculativeTTL: DefaultSpeculativeTTL,
	},
	LLMDTiered: {
		Filters:     []string{FilterModel, FilterAdapterCapacity, FilterHotSpot},
		Scorers:     precisePrefixScorers,
		Picker:      PickerMaxScore,
		TierWeights: map[string]float64{"gpu": 1, "cpu": 0.8},
	},
	CacheAwareTTFT: {
		Filters: []string{FilterModel, FilterAdapterCapacity, FilterHotSpot},
		// The prefix scorer at weight 0 only provides the approximate
		// index (match and learning): the ttft scorer prices the hit.
		Scorers: []ScorerConfig{{Type: ScorerPrefix, Weight: 0}, {Type: ScorerTTFT, Weight: 1}, {Type: ScorerLoRA, Weight: 0.5}},
		Picker:  PickerMaxScore,
	},
	TieredCost: {
		Filters: []string{FilterModel, FilterAdapterCapacity, FilterHotSpot},
		// The precise scorer at weight 0 only makes the precise index the
		// profile's match source (Cycle.Matched, the tiers' GPU part).
		Scorers: []ScorerConfig{{Type: ScorerPrecisePrefix, Weight: 0}, {Type: ScorerCost, Weight: 1}, {Type: ScorerLoRA, Weight: 0.5}},
		Picker:  PickerMaxScore,
	},
	DynamoTiered: {
		Filters:     []string{FilterModel, FilterAdapterCapacity, FilterHotSpot},
		Scorers:     precisePrefixScorers,
		Picker:      PickerMaxScore,
		TierWeights: map[string]float64{"gpu": 1, "cpu": 0.75, "disk": 0.25},
	},
	// The peers' routers (peers.go, README.md "Reference profiles of the
	// peers").
	LLMD:   peerProfiles[LLMD],
	SGLang: peerProfiles[SGLang],
	Dynamo: peerProfiles[Dynamo],
}

// precisePrefixScorers are the scorers of PrecisePrefix's tiered peers,
// and PrecisePrefix's on a pool with tiers (NewPolicy). The approximate
// index rides along at a lower weight: it learns from the decision itself,
// so a follow-up that arrives before the engine's KV events for its
// predecessor still finds its home; once the events arrive the precise
// index outweighs it, eviction included. Without tiers the speculative
// entries do that (PrecisePrefix's own scorers): with them, and without the
// approximate index, the precise profile's decisions differ only on the
// Mooncake trace (azure, shared-prefix, chat, agentic, rag and long-tail
// identical in virtual time, also with --kv-event-delay 50ms and 500ms),
// where over routing seeds 0–5
// hit rate and TTFT p90/p99 stay within the seeds' spread (hit mean 16.93
// → 16.98%, p99 mean 23.2 → 22.5 s; seed 0: 16.8 → 17.7%, where the
// approximate index's stale beliefs, blocks the engine had evicted, pulled
// follow-ups to a former home; in real time seed 0 read 17.0 → 16.9%), and
// a decision among 1,000 endpoints costs half (sched/README.md,
// "precise-prefix without the approximate index").
var precisePrefixScorers = []ScorerConfig{
	{Type: ScorerPrecisePrefix, Weight: 1.5},
	{Type: ScorerPrefix, Weight: 0.5},
	{Type: ScorerCost, Weight: 1},
	{Type: ScorerLoRA, Weight: 0.5},
}

// Pool is what a policy is told about its pool when it is built.
type Pool struct {
	// Capacity[i] is about how many prompt blocks (of the routing block
	// size) endpoint i's KV cache holds; its length is the pool size.
	Capacity []int
	// Precise is the pool's precise prefix index (fed by KV events), or nil
	// when its endpoints publish none. Profiles with a precise-prefix scorer
	// need it.
	Precise MatchSource
	// Tiers is what the pool's index knows of the tiers below the GPU, nil
	// when the endpoints have none (or publish no events of them).
	Tiers *Tiers
	// Now is the pool's clock (monotonic; virtual time's in a simulated
	// fleet), read by profiles with a SpeculativeTTL to age their entries.
	// nil: entries never expire by time, only by being overwritten by
	// later decisions (speculative.go, specSlots).
	Now func() time.Duration
}

// ErrNoPrecise is returned by NewPolicy for a profile with a precise-prefix
// scorer on a pool without a precise index.
var ErrNoPrecise = errors.New("precise-prefix scorer needs the endpoints' KV events (kv_events in the endpoint config)")

// NewPolicy builds cfg.Policy ("" for DefaultPolicy) for pool: a
// built-in profile (Names) or a profile of cfg.Profiles (which may
// override a built-in's name). Errors name the offending setting.
//
// A profile with per-endpoint state (an approximate index, a session
// table) is returned as a *Profile, which implements Forgetter and
// Resizer; one without is returned as a Policy that implements neither,
// so that callers skip the calls.
func NewPolicy(cfg Config, pool Pool) (Policy, error) {
	name, pc, ok := cfg.profile()
	if !ok {
		names := append(Names(), slices.Collect(mapKeys(cfg.Profiles))...)
		sort.Strings(names)
		return nil, fmt.Errorf("unknown routing policy %q (want one of %v)", name, names)
	}
	if _, own := cfg.Profiles[name]; name == PrecisePrefix && !own && pool.Tiers != nil {
		// No speculative entries with tiers (newScorer): the
		// approximate index bridges the KV events' lag.
		pc.Scorers = precisePrefixScorers
	}
	seed := cfg.Seed
	if seed == 0 {
		seed = 0x1f0a
	}
	p, err := newProfile(name, pc, cfg, pool, seed)
	if err != nil {
		return nil, err
	}
	if p.approx == nil && len(p.forget) == 0 {
		return stateless{p}, nil
	}
	return p, nil
}

// profile returns the name cfg.Policy selects ("": DefaultPolicy) and its
// profile: one of cfg.Profiles, else a built-in; ok is false for neither.
func (cfg Config) profile() (name string, pc ProfileConfig, ok bool) {
	name = cfg.Policy
	if name == "" {
		name = DefaultPolicy
	}
	if pc, ok = cfg.Profiles[name]; !ok {
		pc, ok = builtinProfiles[name]
	}
	return name, pc, ok
}

// stateless is a Profile without per-endpoint state, its Forget and
// SetCapacity hidden.
type stateless struct{ p *Profile }

func (s stateless) Name() string                               { return s.p.Name() }
func (s stateless) NeedsHashes() bool                          { return s.p.NeedsHashes() }
func (s stateless) Pick(req *Request, eps []Endpoint) Decision { return s.p.Pick(req, eps) }

// Grow implements Grower: nothing is kept per slot.
func (stateless) Grow(int) error { return nil }

// SetTiers implements TierSetter.
func (s stateless) SetTiers(t *Tiers) { s.p.SetTiers(t) }

// Tiers returns the tiers the profile's decisions price (nil: none).
func (s stateless) Tiers() *Tiers { return s.p.Tiers() }

// Validate checks cfg without a pool: the policy name, every profile of
// cfg.Profiles and the tuning sections.
func Validate(cfg Config) error {
	pool := Pool{Precise: nopMatch{}}
	for name := range cfg.Profiles {
		c := cfg
		c.Policy = name
		if _, err := NewPolicy(c, pool); err != nil {
			return err
		}
	}
	_, err := NewPolicy(cfg, pool)
	return err
}

// UsesPrecise reports whether cfg's policy reads the precise index.
func UsesPrecise(cfg Config) bool {
	_, pc, ok := cfg.profile()
	if !ok {
		return false
	}
	// Any precise-prefix scorer, weight 0 included: it makes the precise
	// index the profile's match source (TieredCost).
	for _, s := range pc.Scorers {
		if s.Type == ScorerPrecisePrefix {
			return true
		}
	}
	return false
}

type nopMatch struct{}

func (nopMatch) Match([]uint64, []int) {}

func mapKeys[V any](m map[string]V) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// newProfile builds profile name of pc for pool, its plugins tuned by cfg
// and its random streams seeded by seed; errors name the profile.
func newProfile(name string, pc ProfileConfig, cfg Config, pool Pool, seed uint64) (*Profile, error) {
	pcfg := cfg.Prefix.WithDefaults()
	if err := pcfg.Validate(); err != nil {
		return nil, err
	}
	balance, err := cfg.balance()
	if err != nil {
		return nil, err
	}
	p := &Profile{name: name, seed: seed, blockSize: pcfg.BlockSize, rate: cfg.Cost.PrefillTokensPerSecond}
	p.tiers.Store(pool.Tiers)
	if p.rate <= 0 {
		p.rate = DefaultPrefillTokensPerSecond
	}
	if p.tierWeights, err = parseTierWeights(pc.TierWeights); err != nil {
		return nil, fmt.Errorf("routing profile %q: %w", name, err)
	}
	where := func(format string, a ...any) error {
		return fmt.Errorf("routing profile %q: %s", name, fmt.Sprintf(format, a...))
	}
	for _, fname := range pc.Filters {
		f, err := newFilter(fname, balance)
		if fname == FilterHotSpot && balance.keepFastest() {
			f, err = newHotSpotKeepFastest(cfg, pcfg, balance)
		}
		if fname == FilterTTFTBound {
			f, err = newTTFTBound(cfg, pcfg)
		}
		if err != nil {
			return nil, where("%v", err)
		}
		p.filters = append(p.filters, f)
	}
	if len(pc.Scorers) == 0 && !scoreless(pc.Picker) {
		return nil, where("no scorers")
	}
	if pc.SpeculativeTTL < 0 {
		return nil, where("speculative_ttl %v must be >= 0", pc.SpeculativeTTL)
	}
	p.specTTL = pc.SpeculativeTTL
	var precise, cost bool
	for _, sc := range pc.Scorers {
		if sc.Weight < 0 || sc.Weight != sc.Weight {
			return nil, where("scorer %q weight %g must be >= 0", sc.Type, sc.Weight)
		}
		s, err := p.newScorer(sc.Type, cfg, pool, pcfg)
		if err != nil {
			return nil, where("%v", err)
		}
		p.scorers = append(p.scorers, WeightedScorer{Scorer: s, Weight: sc.Weight})
		precise = precise || sc.Type == ScorerPrecisePrefix
		cost = cost || sc.Type == ScorerCost || sc.Type == ScorerTTFT
	}
	switch {
	case precise && p.spec != nil:
		p.match = p.spec
	case precise:
		p.match = pool.Precise
	case p.peerMatch != nil:
		p.match = p.peerMatch
	case p.approx != nil:
		p.match = p.approx
	}
	if cost && p.match != nil {
		p.hashes = true
	}
	if p.picker, err = p.newPeerPicker(pc.Picker, cfg); err != nil {
		return nil, where("%v", err)
	}
	if p.picker == nil {
		if pc.TieTolerance != nil {
			if t := *pc.TieTolerance; t < 0 || t != t {
				return nil, where("tie_tolerance %g must be >= 0", t)
			}
		}
		if p.picker, err = newPicker(pc.Picker, cfg, p.match != nil, balance, pcfg.MinMatchGain); err != nil {
			return nil, where("%v", err)
		}
		if mp, ok := p.picker.(maxScorePicker); ok && pc.TieTolerance != nil {
			mp.tol = *pc.TieTolerance
			p.picker = mp
		}
	}
	return p, nil
}

// newScorer returns the scorer of that name for p, adding what it brings to
// p: the approximate index (one per profile, created by the first scorer
// that needs it), a learner, a forget hook, the need for hashes.
func (p *Profile) newScorer(name string, cfg Config, pool Pool, pcfg PrefixConfig) (Scorer, error) {
	switch name {
	case ScorerPrefix:
		if p.approx == nil {
			ix, err := prefix.NewIndex(pool.Capacity)
			if err != nil {
				return nil, err
			}
			p.approx = ix
			p.forget = append(p.forget, ix.Clear)
			p.grow = append(p.grow, func(n int) error { return ix.Grow(n, 1) })
			p.finishLearn = pcfg.learnOnFinish()
		}
		ps := &prefixScorer{ix: p.approx, minGain: pcfg.MinMatchGain, pin: p.finishLearn, blockSize: pcfg.BlockSize}
		p.learners = append(p.learners, ps)
		p.hashes = true
		return ps, nil
	case ScorerPrecisePrefix:
		if pool.Precise == nil {
			return nil, ErrNoPrecise
		}
		p.hashes = true
		src := pool.Precise
		if p.specTTL > 0 && pool.Tiers == nil {
			if p.spec == nil {
				p.spec = newSpeculative(pool.Precise, p.specTTL, pool.Now)
				p.learners = append(p.learners, p.spec)
				p.forget = append(p.forget, p.spec.forget)
			}
			src = p.spec
		}
		return &preciseScorer{src: src, minGain: pcfg.MinMatchGain}, nil
	case ScorerQueue:
		return queueScorer{}, nil
	case ScorerKVUtilization:
		return kvUtilScorer{}, nil
	case ScorerInFlightTokens:
		return inFlightTokensScorer{}, nil
	case ScorerSession:
		n := cfg.Session.MaxSessions
		if n == 0 {
			n = DefaultMaxSessions
		}
		if n < 0 {
			return nil, fmt.Errorf("session.max_sessions %d must be > 0", n)
		}
		ss := &sessionScorer{table: newSessionTable(n)}
		p.learners = append(p.learners, ss)
		p.forget = append(p.forget, ss.forget)
		return ss, nil
	case ScorerLoRA:
		return loraScorer{}, nil
	case ScorerLLMDPrefix, ScorerNoHitLRU, ScorerSGLangTree:
		return p.newPeerScorer(name, cfg, pool, pcfg)
	case ScorerTTFT:
		return newTTFTScorer(cfg, pcfg)
	case ScorerCost:
		return newCostScorer(cfg, pcfg)
	}
	return nil, fmt.Errorf("unknown scorer %q (want prefix, precise-prefix, queue, kv-utilization, in-flight-tokens, session, lora, cost, ttft, %s)", name, peerPluginsScorer)
}

// newFilter returns the filter of that name.
func newFilter(name string, balance Balance) (Filter, error) {
	switch name {
	case FilterModel:
		return modelFilter{}, nil
	case FilterAdapterCapacity:
		return adapterCapacityFilter{}, nil
	case FilterHotSpot:
		return hotSpotFilter{cfg: balance}, nil
	}
	return nil, fmt.Errorf("unknown filter %q (want model, adapter-capacity, hot-spot, ttft-bound)", name)
}

// newPicker returns the picker of that name ("": max-score); matched says
// whether the profile has a prefix match source, which prefix-rule reads.
func newPicker(name string, cfg Config, matched bool, balance Balance, minGain float64) (Picker, error) {
	switch name {
	case PickerMaxScore, "":
		tol := cfg.TieTolerance
		if tol == 0 {
			tol = DefaultTieTolerance
		}
		if tol < 0 || tol != tol {
			return nil, fmt.Errorf("tie_tolerance %g must be >= 0", tol)
		}
		return maxScorePicker{tol: tol}, nil
	case PickerWeightedRandom:
		return weightedRandomPicker{}, nil
	case PickerPowerOfTwo:
		return powerOfTwoPicker{}, nil
	case PickerRoundRobin:
		return &roundRobinPicker{}, nil
	case PickerLeastRequest:
		return leastRequestPicker{}, nil
	case PickerPrefixRule:
		if !matched {
			return nil, fmt.Errorf("picker %s needs a prefix or precise-prefix scorer", PickerPrefixRule)
		}
		return prefixRulePicker{balance: balance, minGain: minGain}, nil
	}
	return nil, fmt.Errorf("unknown picker %q (want max-score, weighted-random, power-of-two, round-robin, least-request, prefix-rule, %s, %s)", name, PickerSGLang, PickerDynamoCost)
}

// scoreless reports whether a picker chooses without scores, so that its
// profile may have no scorer: round-robin, least-request, and
// weighted-random (uniform when no scorer adds to the totals).
func scoreless(picker string) bool {
	switch picker {
	case PickerRoundRobin, PickerLeastRequest, PickerWeightedRandom:
		return true
	}
	return false
}
