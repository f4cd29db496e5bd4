// Package sched is infergate's scheduling core: given a request's view and a
// read-only snapshot of the endpoints that serve its model, a Policy picks one.
// It does no I/O and reads no clock, so the live gateway, benchmarks and
// (later) the virtual-time planner run the same decisions.
package sched

// Endpoint is the scheduler's view of one endpoint at decision time.
type Endpoint struct {
	// Name identifies the endpoint in logs and metrics (its base URL).
	Name string
	// Ready is false while the endpoint is failing health checks or ejected.
	Ready bool
	// InFlight is the number of requests the gateway has sent to the endpoint
	// that have not finished (gateway-side accounting, requests).
	InFlight int
	// InFlightTokens is the sum of the prompt tokens of those requests
	// (gateway-side accounting, tokens).
	InFlightTokens int
	// PendingPrefillTokens is the sum, over in-flight requests that have not
	// produced their first token, of their prompt tokens the scheduler did not
	// expect the endpoint to hold (prompt − predicted matched tokens): the
	// prefill backlog ahead of a new request (gateway-side accounting, tokens).
	PendingPrefillTokens int
	// PrefillTokensPerSecond is the endpoint's prefill throughput (tokens/s)
	// from its engine profile or learned online; 0 when unknown.
	PrefillTokensPerSecond float64

	// Metrics is true when the engine-reported fields below are fresh
	// (scraped from the engine's metrics endpoint); false for engines that
	// export none, whose load scorers fall back to gateway-side accounting.
	Metrics bool
	// Waiting and Running are the engine's queued and running requests
	// (vllm:num_requests_waiting / _running and their peers).
	Waiting, Running int
	// KVUtil is the engine's KV-cache utilisation, a fraction in [0, 1]
	// (vllm:kv_cache_usage_perc), or negative when the engine's metrics
	// have no such gauge (fleet.Load.KVUtil's −1).
	KVUtil float64

	// Adapters are the LoRA adapters the endpoint has loaded (running or
	// waiting, vllm:lora_requests_info); MaxAdapters is its adapter slot
	// count (max_lora), 0 when unknown.
	Adapters    []string
	MaxAdapters int
	// Models lists the model names (bases and adapters) the endpoint serves,
	// sorted (the model filter searches it: an engine may list 1,024
	// adapters, fleet.MaxListedModels); nil means every model of its pool.
	Models []string
	// Role is the endpoint's part in a P/D pool (pd.go); RoleBoth outside one.
	Role Role
	// Preferred marks the endpoints a gateway replica takes first among
	// candidates its picker counts as tied (the max-score picker's totals
	// within the tie tolerance, or within PreferredTolerance of the best
	// for a Preferred one; least-request's equal loads): its share of
	// the pool (replica.Node.Expect), so that replicas deciding on one view
	// at one instant spread over the ties instead of drawing from the same
	// set. False everywhere without replicas: ties are then broken among
	// all of them, exactly as before the field existed.
	Preferred bool
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
	// Adapter is the LoRA adapter requested ("" for the base model).
	Adapter string
	// SessionKey identifies a conversation for session affinity (the
	// X-Session-Id header, else the OpenAI "user" field; "" for none).
	SessionKey string
	// Priority orders admission (higher first); routing ignores it today.
	Priority int
	// Role is the leg being routed in a P/D pool (PD sets it for each of
	// its picks): only endpoints of that role or RoleBoth are candidates.
	// RoleBoth, the zero value, puts no constraint.
	Role Role
	// Pinned is set by a pick whose learn_on_finish pinned the prompt on
	// the chosen endpoint (the prefix scorer's Learn; false otherwise, the
	// endpoint overfull or the policy not pinning): the request's end
	// passes it to Finisher.Finished, which releases only a pin the pick
	// took.
	Pinned bool
}

// Decision is a policy's pick.
type Decision struct {
	// Endpoint is the index of the chosen endpoint in the snapshot, or -1 if
	// no endpoint is ready.
	Endpoint int
	// MatchedBlocks is the number of leading prompt blocks the policy expects
	// the endpoint to hold (prefix policy only; 0 otherwise), in all its
	// tiers when the pool has Tiers: the prompt tokens it will not prefill.
	MatchedBlocks int
	// TierBlocks splits MatchedBlocks by tier (SplitTiers) when the pool
	// has Tiers; zero otherwise.
	TierBlocks [NumTiers]int
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

// Resizer is implemented by policies that bound per-endpoint state by the
// endpoint's KV capacity (the approximate prefix index). A policy is built
// for a pool with a fixed number of endpoint slots (Pool.Capacity's
// length); the gateway calls SetCapacity when a configuration reload puts
// another engine in slot i, or changes its kv_blocks, after Forget(i).
type Resizer interface {
	// SetCapacity bounds what the policy keeps for endpoint i to about
	// blocks prompt blocks (of Config.Prefix.BlockSize tokens).
	SetCapacity(i, blocks int)
}

// Grower is implemented by policies whose per-endpoint state can take more
// endpoint slots in place, keeping what it learnt of the slots it has
// (the prefix scorer's approximate index and the peers' indexes grow,
// prefix.Index.Grow; the session table, the speculative entries and the
// no-hit LRU name slots and need nothing). Grow(n) makes the policy one
// for n slots, as if Pool.Capacity had n entries, the new ones bounded at
// 1 block (the peers' indexes: their configured bound) until SetCapacity;
// n at most the slots it has changes nothing. The gateway grows a kept
// policy when a reload or a discovery change gives its pool more slots,
// before any Pick sees the new endpoints. Safe for concurrent use with
// Pick: the picks that started before it returns match the slots they
// had. Errors only past prefix.MaxIndexEndpoints. A policy without
// per-endpoint state implements it as a no-op.
type Grower interface {
	Grow(n int) error
}

// TierSetter is implemented by policies that price KV tiers (Pool.Tiers):
// SetTiers tells them the pool's tiers again — each slot's load costs,
// the remote store's slot — keeping everything they learnt. The gateway
// calls it when a reload changes a kept policy's pool (an endpoint joins
// or leaves, a kv_store's slot moves as the index grows, an endpoint's
// kv_events.tiers prices change), before the pool is published. t is
// nil exactly when the policy was built with nil Tiers (a pool that gains
// or loses its tiers gets a new policy: a profile's speculative entries
// are made only without tiers). Safe for concurrent use with Pick: a
// decision prices by the tiers in force when it first reads them.
type TierSetter interface {
	SetTiers(t *Tiers)
}

// Finisher is implemented by policies whose approximate prefix index
// evicts in the engine's order (PrefixConfig.LearnOnFinish): Pick pins the
// prompt on the chosen endpoint when the endpoint can hold it running
// (else learns it unpinned) and says so in Request.Pinned, and Finished
// with pinned true releases the pin and touches the prompt, with pinned
// false does nothing (a P/D profile's, which never pins, touches). Each
// Pick that chose endpoint i must be followed by exactly one Finished(i,
// the request's Request.Hashes, its Request.Pinned), whatever becomes of
// the request (an EPP request the proxy served elsewhere: one on the
// picked endpoint when it moves, one on the one that served it, pinned
// false, at its end): the gateway calls it when its attempt on i ends (answered,
// failed or cut short), at an EPP pick's Done, and at once for a pick
// whose endpoint had no breaker slot left; the virtual fleet when the
// engine emits the request's last token. Finished queues the update like
// Pick's learning (Settler); the caller settles it. It does nothing when
// LearnOnFinish is off or hashes is empty, reads hashes only during the
// call, allocates nothing once the index's queue has grown, and is safe for
// concurrent use with Pick. LearnsOnFinish reports whether Finished does
// anything, so that a caller keeps a request's hashes until it ends only
// then.
type Finisher interface {
	Finished(i int, hashes []uint64, pinned bool)
	LearnsOnFinish() bool
}

// Settler is implemented by policies that learn from their decisions off
// the pick path (the approximate prefix index of the prefix scorer): Pick
// queues what the decision taught, counted by the policy's next decisions
// at once, and Settle applies it (prefix.Index.Learn). The gateway settles
// on a goroutine of its own, the virtual fleet after every decision (so
// that virtual time decides as if Pick applied it inline). Unsettled
// reports whether anything is queued. Safe for concurrent use with Pick.
type Settler interface {
	Settle()
	Unsettled() bool
	// Queued is the number of learns waiting for Settle.
	Queued() int
}

// PeerLearner is implemented by policies whose scorers learn from
// routing decisions (the approximate prefix index of the prefix scorer,
// the precise-prefix scorer's speculative entries): LearnPeer records that
// another gateway replica sent endpoint i a prompt of these chained block
// hashes (prefix.Hashes, the pool's block size and seed), as if this
// replica had routed it, so that replicas behind one L4 balancer share
// what their approximate indexes and speculative entries learn (package
// replica).
// Out-of-range i and empty hashes are ignored. Safe for concurrent use with
// Pick.
type PeerLearner interface {
	LearnPeer(i int, hashes []uint64)
}

// PeerFinisher is implemented by policies that learn from their peers'
// decisions (PeerLearner) and evict in the engine's order
// (PrefixConfig.LearnOnFinish), so that replicas share the finish-time
// learning too (package replica's finish messages). PinsPeers reports
// whether the policy pins its own picks (LearnOnFinish on a profile that
// pins: not a P/D profile); a peer's learn is then LearnPeerPinned and its
// finish ReleasePeer of the same hashes, which must follow each
// LearnPeerPinned exactly once (package replica keeps the pairs and
// releases those whose finish never came: the peer died, a message was
// dropped). FinishPeer is a finish without a pin of its own: the prompt is
// touched, the head freshest, and a pinned block keeps its pins (this
// replica's running requests'). Each applies the update before it
// returns, as LearnPeer does; each is a no-op when LearnOnFinish is off;
// out-of-range i and empty hashes are ignored. Safe for concurrent use
// with Pick.
type PeerFinisher interface {
	PinsPeers() bool
	LearnPeerPinned(i int, hashes []uint64)
	ReleasePeer(i int, hashes []uint64)
	FinishPeer(i int, hashes []uint64)
}

// DefaultPolicy is the policy of a configuration that names none, in the
// gateway, bench and plan alike: cache-aware, the best measured on the
// Mooncake conversation trace (README.md "Evaluation": in real time the one
// policy at ≥ 90% of the pooled-cache hit rate with TTFT p99 below
// least-request's in every run, p50 and p90 about half of least-request's
// and of the prefix rule's). precise-prefix reaches a higher hit rate but
// in real time mostly a worse p99, and needs the engines' KV events.
const DefaultPolicy = CacheAware

// Names lists the built-in policy names (every one a built-in profile, see
// builtinProfiles), the default first.
func Names() []string {
	return []string{CacheAware, Prefix, RoundRobin, LeastRequest, Random, PowerOfTwo, PrecisePrefix, TieredCost, LLMDTiered, DynamoTiered, CacheAwareTTFT, LLMD, SGLang, Dynamo}
}

// Config selects and tunes a policy (YAML key "routing").
type Config struct {
	// Policy is one of Names() or a key of Profiles; default DefaultPolicy.
	Policy string `yaml:"policy"`
	// Seed seeds tie-breaking and the random choices (0 = fixed default
	// seed): decision n of a policy draws from its own stream, a function
	// of Seed and n only (see Profile.Pick).
	Seed uint64 `yaml:"seed"`
	// Prefix sets the block size of every index and the prefix match's
	// smallest gain.
	Prefix PrefixConfig `yaml:"prefix"`
	// Profiles are user-composed profiles (see ProfileConfig), selectable
	// by name in Policy.
	Profiles map[string]ProfileConfig `yaml:"profiles"`
	// Balance is the load-balance test of the hot-spot filter and the
	// prefix rule.
	Balance Balance `yaml:"balance"`
	// HotSpot is the deprecated alias of Balance.
	HotSpot HotSpotConfig `yaml:"hot_spot"`
	// Session tunes the session scorer.
	Session SessionConfig `yaml:"session"`
	// Cost tunes the cost scorer.
	Cost CostConfig `yaml:"cost"`
	// PD configures the decisions of pools whose endpoints have P/D roles
	// (pd.go).
	PD PDConfig `yaml:"pd"`
	// TTFT tunes the ttft scorer (ttft.go).
	TTFT TTFTConfig `yaml:"ttft"`
	// TTFTBound tunes the ttft-bound filter (ttftbound.go).
	TTFTBound TTFTBoundConfig `yaml:"ttft_bound"`
	// LLMD, SGLang and Dynamo tune the peers' plugins (peers.go): the
	// llm-d-prefix and no-hit-lru scorers, SGLang's tree and picker,
	// Dynamo's cost picker. Zero values take each peer's defaults.
	LLMD   LLMDConfig   `yaml:"llm_d"`
	SGLang SGLangConfig `yaml:"sglang"`
	Dynamo DynamoConfig `yaml:"dynamo"`
	// TieTolerance is how close to the best total a candidate's total must
	// be for the max-score picker to count it as a tie (default 0.02, in
	// units of scorer weight).
	TieTolerance float64 `yaml:"tie_tolerance"`
}

// DefaultTieTolerance is Config.TieTolerance's default: a cost difference
// of 2% of one weight unit, e.g. one 16-token block of an 800-token prompt,
// does not break a tie.
const DefaultTieTolerance = 0.02

// New builds the configured policy for a pool whose endpoint i can hold about
// capacity[i] prompt blocks (of Config.Prefix.BlockSize tokens) and that has
// no precise index; see NewPolicy.
func New(cfg Config, capacity []int) (Policy, error) {
	return NewPolicy(cfg, Pool{Capacity: capacity})
}

// decisionSeed returns the PCG seed of decision n of a policy seeded with
// seed: both words through splitmix64 (Steele et al., OOPSLA 2014), so that
// consecutive decisions draw from unrelated streams.
func decisionSeed(seed, n uint64) (uint64, uint64) {
	return splitmix64(seed ^ splitmix64(n)), splitmix64(seed + n*0x9e3779b97f4a7c15)
}

func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}
