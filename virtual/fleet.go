package virtual

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/infergate/infergate/kvevents/kvevent"
	"github.com/infergate/infergate/load"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
)

// Config configures a Fleet.
type Config struct {
	// Engines is the number of engines (at least 1).
	Engines int
	// Engine configures every engine (zero fields take sim.Config defaults).
	Engine sim.Config
	// Model is the model name routing hashes are seeded with, as the gateway
	// seeds them: prefix.Seed(Model + "\x00"). Default: the engine profile's
	// model, else sim.DefaultModel.
	Model string
	// Policy picks an engine for each request from the gateway-side snapshot
	// (readiness and in-flight counts). nil builds one from Routing.
	Policy sched.Policy
	// Routing builds the policy when Policy is nil, sized as the gateway sizes
	// it: engine i can hold NumBlocks × BlockSize / routing block size prompt
	// blocks. Routing.Prefix.BlockSize is also the block size routing hashes
	// use (0: the engines' block size, as bench.Compare sets it), with a
	// given Policy too.
	Routing sched.Config
	// SkipITL leaves Result.ITL nil, saving one duration per output
	// token for very large replays.
	SkipITL bool
	// TrackPrecise keeps a precise prefix index (prefix.PreciseIndex) fed by
	// the engines' KV events as a live gateway subscribed to them would, and
	// records its prediction for every request (Result.
	// PreciseMatchedBlocks) whatever the policy. It is implied by a policy
	// built from Routing that scores with the precise index. The routing
	// block size must equal the engines'.
	TrackPrecise bool
	// KVEventDelay is how long after the end of a step the precise index
	// applies the step's KV events (0: at the step's end). A live gateway
	// hears them after the engine publishes them, the ZeroMQ hop and its
	// subscriber's decoding: milliseconds on one quiet host, more across
	// nodes or on a loaded one, and in a real-time bench at speedup S each
	// wall-clock millisecond of it is S ms of engine time. The remote
	// tier's events are not delayed.
	KVEventDelay time.Duration
	// ScrapeInterval is the period at which routing sees the engines' own
	// load (Waiting, Running, KVUtil), as the live gateway scrapes each
	// engine's /metrics (gateway.DefaultScrapeInterval, 1 s, when 0;
	// negative: never, as for engines without a metrics page). A scrape at
	// t reads every engine's state after the steps ending at t.
	ScrapeInterval time.Duration
	// Remote is the size of a shared remote KV tier every engine writes
	// through to and loads from (sim.RemoteStore, as infergate kvstore
	// serves it; a multiple is of one engine's GPU KV cache); zero: none.
	// The engines' host and disk tiers are Engine.Tiers. With a precise
	// index the store's KV events feed it as one more endpoint (index
	// Engines), medium REMOTE.
	Remote sim.TierSize
	// Replicas is the number of gateway replicas behind a round-robin
	// front (replicas.go; 0 or 1: one gateway). Each has its own policy
	// (its own approximate index) and its own load ledgers; with
	// ReplicaSync they exchange replica messages. It needs Policy nil and
	// Prefill 0.
	Replicas int
	// ReplicaSync makes the replicas exchange what they learn and their
	// load (package replica's messages through replica.Node.Apply, as the
	// live gateway does over Redis Streams), each message delivered
	// ReplicaDelay after it was sent, loads every LoadInterval (default
	// 200 ms) counted for LoadTTL (default replica.DefaultLoadTTL).
	ReplicaSync  bool
	ReplicaDelay time.Duration
	LoadInterval time.Duration
	LoadTTL      time.Duration
	// ReplicaNoStagger turns off the synced replicas' staggered decisions
	// in bursts (replica.Node.Stagger: while a replica's decisions come in
	// bursts, each waits for the learns of the replicas ranked before it,
	// at most rank × 3 of the exchange's delay, the time its
	// own learns take to come back, before it decides; replicas.go).
	ReplicaNoStagger bool
	// KillAt, when positive, kills replica KillReplica at that time: the
	// requests it holds (routed, not finished) end with ErrReplicaKilled
	// and are aborted on their engines, as a gateway process's death
	// closes its engine connections; the front sends later arrivals to
	// the survivors only.
	KillAt      time.Duration
	KillReplica int
	// Prefill makes the first Prefill engines prefill engines and the
	// others decode engines (sched.RolePrefill, RoleDecode), routed by
	// sched.PD built from Routing (Routing.PD tunes the decider), with
	// vLLM's NIXL hand-off (sim/pd.go, pd.go here); 0: every engine
	// serves whole requests. It needs Policy nil and fewer than Engines.
	Prefill int
	// Autoscale, when set, scales the fleet with an autoscale.Scaler in
	// virtual time (autoscale.go): Engines is then the most it runs, and
	// engines start (unroutable for their start-up time) and stop as the
	// policy decides. It needs one gateway replica and no prefill engines.
	Autoscale *Autoscale
}

// DefaultScrapeInterval is Config.ScrapeInterval's default: the gateway's
// (gateway.DefaultScrapeInterval).
const DefaultScrapeInterval = time.Second

// Request is one request of a virtual-time replay.
type Request struct {
	// Arrival is when the request reaches the gateway (simulated time).
	// Requests must be given in non-decreasing Arrival order.
	Arrival time.Duration
	// Tokens is the prompt. When nil, Prompt is called instead.
	Tokens []uint32
	// Prompt appends the prompt to dst and returns the extended slice. It is
	// called once, at the request's arrival, and the result is not kept past
	// routing and Engine.Add (which copies it): prompts can be synthesized
	// lazily, so that only the unfinished requests' tokens are in memory.
	Prompt func(dst []uint32) []uint32
	// MaxTokens is the exact number of tokens to generate.
	MaxTokens int
	// Adapter is the LoRA adapter the request names ("" for the base
	// model): one of Config.Engine.LoRA.Adapters. It is routed as the live
	// gateway routes an adapter's request (gateway/adapters.go):
	// sched.Request.Adapter set, the prompt hashed from the adapter's root
	// seed, the engines' adapters scraped (Endpoint.Adapters).
	Adapter string
}

// Result is the outcome of one Request. Times are simulated.
type Result struct {
	// Engine is the index of the engine the policy chose (-1 if none).
	Engine int
	// Arrival is the request's arrival time.
	Arrival time.Duration
	// FirstToken is when the first output token was delivered (the end of the
	// step that sampled it).
	FirstToken time.Duration
	// Finish is when the last output token was delivered.
	Finish time.Duration
	// ITL holds the gaps between consecutive output tokens (OutputTokens−1
	// of them; nil with Config.SkipITL).
	ITL []time.Duration
	// PromptTokens and CachedTokens are the prompt length and its prefix-cache
	// hit at first admission, as the engine reports them in usage.
	PromptTokens, CachedTokens int
	// OutputTokens is the number of tokens generated.
	OutputTokens int
	// MatchedBlocks is the number of routing blocks the policy expected the
	// chosen engine to hold (sched.Decision.MatchedBlocks).
	MatchedBlocks int
	// PreciseMatchedBlocks is what the precise index (fed by KV events)
	// said the chosen engine held at routing time; -1 without
	// Config.TrackPrecise.
	PreciseMatchedBlocks int
	// TierTokens splits CachedTokens by the tier the engine took each
	// block from (sim.Output.TierTokens).
	TierTokens [sim.NumTiers]int
	// PredictedTierBlocks is what the precise index predicted the chosen
	// engine would take from each tier (sched.SplitTiers of its per-medium
	// matches; zero without a precise index).
	PredictedTierBlocks [sim.NumTiers]int
	// P/D (Config.Prefill; pd.go). Prefill is the prefill engine of a
	// split request, −1 for one served whole (Engine is its decode engine
	// either way); PDReason is sched.PDDecision.Reason. For a split
	// request, CachedTokens and TierTokens are the prefill engine's (as
	// the gateway rewrites D's usage from P's), HandOff is when P's answer
	// reached the gateway and D was sent the request, Transferred when D's
	// read of the KV ended, and TransferredTokens what D read.
	Prefill           int
	PDReason          string
	HandOff           time.Duration
	Transferred       time.Duration
	TransferredTokens int
	// Replica is the gateway replica that routed it (Config.Replicas; 0
	// with one).
	Replica int
	// Err is why the request was not served (no endpoint, or the engine
	// rejected it as Engine.Add does); nil on success.
	Err error
}

// TTFT is the time to first token.
func (r *Result) TTFT() time.Duration { return r.FirstToken - r.Arrival }

// E2E is the end-to-end latency, from arrival to the last token.
func (r *Result) E2E() time.Duration { return r.Finish - r.Arrival }

// ErrNoEndpoint is Result.Err when the policy picked no engine.
var ErrNoEndpoint = errors.New("sim: no endpoint available")

// Fleet runs Engines in virtual time: a discrete-event loop with no
// goroutines, no sleeping and no clock, routing each request with a
// sched.Policy over gateway-side in-flight counts as the live gateway does.
// Event semantics are those of the real-time Server driver:
//
//   - An engine idle when a request is added starts a step with it at once,
//     at the arrival time. A request arriving while the engine is mid-step
//     joins its waiting queue and is considered by the next step, which
//     starts when the current one ends.
//   - A step's outputs are delivered at its end (start + Duration). A request
//     is finished for the gateway (its in-flight count drops) when its last
//     token is delivered.
//
// Ties are resolved deterministically: at one instant, step ends are
// delivered first (engines in index order), then a metrics scrape due then
// reads the engines (Config.ScrapeInterval), then arrivals are routed in
// request order, then the engines whose step just ended and that still have
// work start their next step — so a request arriving exactly at a step's end
// joins the next step, as the driver's post-delivery drain does. Two requests
// arriving at once at an idle engine are not batched: the first starts a step
// alone, as with the real driver, which steps as soon as a request arrives.
//
// A Fleet is not safe for concurrent use.
type Fleet struct {
	cfg       Config
	policy    sched.Policy
	precise   *prefix.PreciseIndex  // nil unless tracked
	remote    *sim.RemoteStore      // nil unless Config.Remote
	tiers     *sched.Tiers          // the routing view of the tiers; nil without
	matched   []int                 // precise match scratch
	tierMatch []int                 // Tiers.Split scratch
	tierSplit [][sched.NumTiers]int // Tiers.Split result, per engine
	seed      uint64                // routing hash seed
	blockSize int                   // routing block size
	engines   []engine
	// reps are the gateway replicas (one without Config.Replicas), each
	// with its policy, load ledgers and snapshot (replicas.go).
	reps    []*rep
	rx      exchange
	heap    stepHeap
	pending []int32
	now     time.Duration
	nextID  int // id of the next request (across Runs)
	// nextScrape is the time of the next metrics scrape (never: none).
	nextScrape time.Duration

	// kvq holds the steps' KV events waiting for their delivery
	// (Config.KVEventDelay), in due order from kvHead.
	kvq    []kvBatch
	kvHead int

	// P/D (Config.Prefill): the decisions, and the split requests whose
	// prefill leg ended at the current instant (sent to D after the
	// instant's deliveries).
	pd       *sched.PD
	handoffs []int

	// as is the autoscaling state (nil: a fixed fleet).
	as *scaler

	// Per Run.
	reqs   []Request
	res    []Result
	shares []load.Share // per request: its part of its engine's load ledger
	owner  []int32      // per request: the replica that routed it
	open   []bool       // per request: routed and not finished
	base   int
	prompt []uint32
	hashes []uint64
	req    sim.Request
	sreq   sched.Request

	// routed[k] is request k's routing hashes while it runs, kept when its
	// policy learns on finish (sched.Finisher); spare the reusable slices.
	routed [][]uint64
	pinned []bool // per request: its pick pinned its prompt (sched.Request.Pinned)
	spare  [][]uint64
}

type engine struct {
	e       *sim.Engine
	busy    bool // a step is in progress (or a sleep, when sleeping); it ends at end
	pending bool // its step ended now and the next starts after this instant's arrivals
	// sleeping: its last step scheduled nothing while loads were in flight,
	// and it waits for the first to end (its heap entry); an arrival ends
	// the wait early.
	sleeping bool
	end      time.Duration
	outs     []sim.Output    // the step's outputs, delivered at end (owned by e)
	events   []kvevent.Event // the step's KV events, applied at end (owned by e)
	// The remote store's events of its step, applied at the step's end.
	rEvents []kvevent.Event
	rHashes []uint64
	rTokens []uint32
	// adapters are its running then waiting adapters as last scraped
	// (vllm:lora_requests_info), the snapshots' Endpoint.Adapters.
	adapters []string
	// Autoscaling (Config.Autoscale): its state (engineReady for a fixed
	// fleet), since when it is up and when a starting engine is ready.
	state            uint8
	upSince, readyAt time.Duration
}

// NewFleet returns a fleet of cfg.Engines idle engines at time 0.
func NewFleet(cfg Config) (*Fleet, error) {
	if cfg.Engines < 1 {
		return nil, fmt.Errorf("sim: fleet size must be >= 1, got %d", cfg.Engines)
	}
	if err := cfg.Engine.Validate(); err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	eng := cfg.Engine.WithDefaults()
	if cfg.Model == "" {
		cfg.Model = eng.Profile.Model
	}
	if cfg.Model == "" {
		cfg.Model = sim.DefaultModel
	}
	if cfg.ScrapeInterval == 0 {
		cfg.ScrapeInterval = DefaultScrapeInterval
	}
	if cfg.Routing.Prefix.BlockSize == 0 {
		cfg.Routing.Prefix.BlockSize = eng.BlockSize
	}
	bs := cfg.Routing.Prefix.BlockSize
	if bs < 1 {
		return nil, fmt.Errorf("sim: routing block size %d: must be at least 1", bs)
	}
	var remote *sim.RemoteStore
	var precise *prefix.PreciseIndex
	tracked := cfg.TrackPrecise || (cfg.Policy == nil && sched.UsesPrecise(cfg.Routing))
	if !cfg.Remote.IsZero() {
		remote = sim.NewRemoteStore(eng.TierBlocks(cfg.Remote), tracked)
		eng.Tiers.Remote = remote
		if err := eng.Validate(); err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
	}
	// The engines' blocks in all their local tiers.
	held := eng.NumBlocks + eng.TierBlocks(eng.Tiers.Host) + eng.TierBlocks(eng.Tiers.Disk)
	if tracked {
		if bs != eng.BlockSize {
			return nil, fmt.Errorf("sim: the precise prefix index needs the routing block size (%d) to equal the engines' (%d)", bs, eng.BlockSize)
		}
		var err error
		n := cfg.Engines
		if remote != nil {
			n++ // the remote store's events, as one more endpoint
		}
		if precise, err = prefix.NewPreciseIndex(n, bs); err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
		for i := range cfg.Engines {
			// As the gateway bounds it: all the engine's tiers, and each.
			precise.SetCapacity(i, held)
			if eng.Tiers.Enabled() {
				precise.SetMediumCapacity(i, prefix.MediumGPU, eng.NumBlocks)
				precise.SetMediumCapacity(i, prefix.MediumCPU, eng.TierBlocks(eng.Tiers.Host))
				precise.SetMediumCapacity(i, prefix.MediumDisk, eng.TierBlocks(eng.Tiers.Disk))
			}
		}
		if remote != nil {
			precise.SetCapacity(cfg.Engines, remote.Capacity())
		}
		eng.KVEvents = true
	}
	if cfg.Prefill < 0 || cfg.Prefill >= cfg.Engines || (cfg.Prefill > 0 && cfg.Policy != nil) {
		return nil, fmt.Errorf("sim: %d prefill engines of %d (want 0, or 1..%d with no given Policy)", cfg.Prefill, cfg.Engines, cfg.Engines-1)
	}
	if cfg.Prefill > 0 && eng.Profile.KVTransferBandwidth <= 0 {
		return nil, fmt.Errorf("sim: prefill engines need the profile's kv_transfer_bandwidth (%s has none)", eng.Profile.Name)
	}
	if cfg.Replicas > 1 && cfg.Policy != nil {
		return nil, fmt.Errorf("sim: %d replicas need a policy built from Routing", cfg.Replicas)
	}
	if cfg.KillAt > 0 && (cfg.KillReplica < 0 || cfg.KillReplica >= max(cfg.Replicas, 1) || cfg.Replicas < 2) {
		return nil, fmt.Errorf("sim: kill replica %d of %d: want one of 2 or more replicas", cfg.KillReplica, cfg.Replicas)
	}
	var pd *sched.PD
	var pool sched.Pool
	var f *Fleet
	policy := cfg.Policy
	if policy == nil {
		capacity := make([]int, cfg.Engines)
		for i := range capacity {
			capacity[i] = max(1, held*eng.BlockSize/bs)
		}
		pool = sched.Pool{Capacity: capacity}
		if precise != nil {
			pool.Precise = precise.On(prefix.MediumGPU)
			// The fleet's virtual clock, for profiles that age what they
			// learn (sched.ProfileConfig.SpeculativeTTL); decisions are
			// made at the arrival's time.
			pool.Now = func() time.Duration { return f.now }
			if eng.Tiers.Enabled() {
				pool.Tiers = tierPool(precise, cfg.Engines, remote != nil, eng)
			}
		}
		var err error
		if policy, err = sched.NewPolicy(cfg.Routing, pool); err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
		if cfg.Prefill > 0 {
			if pd, err = sched.NewPD(cfg.Routing, pool); err != nil {
				return nil, fmt.Errorf("sim: %w", err)
			}
			policy = pd.Decode()
		}
	}
	f = &Fleet{
		cfg:        cfg,
		nextScrape: never,
		policy:     policy,
		precise:    precise,
		remote:     remote,
		matched:    make([]int, cfg.Engines),
		seed:       prefix.Seed(cfg.Model + "\x00"),
		blockSize:  bs,
		engines:    make([]engine, cfg.Engines),
		pd:         pd,
	}
	snap := make([]sched.Endpoint, cfg.Engines)
	for i := range f.engines {
		snap[i] = sched.Endpoint{Name: "virtual-" + strconv.Itoa(i), Ready: true}
		ecfg := eng
		if pd != nil {
			snap[i].Role = sched.RoleDecode
			if i < cfg.Prefill {
				snap[i].Role = sched.RolePrefill
			} else {
				ecfg = eng.ForDecode() // its own token budget (sim.PDConfig)
			}
		}
		f.engines[i].e = sim.NewEngine(ecfg)
	}
	if err := f.newReplicas(snap, pool); err != nil {
		return nil, err
	}
	if cfg.Autoscale != nil {
		var err error
		if f.as, err = newScaler(*cfg.Autoscale, &cfg); err != nil {
			return nil, err
		}
		f.startFleet()
	}
	if cfg.ScrapeInterval > 0 {
		f.nextScrape = 0
	}
	if precise != nil && eng.Tiers.Enabled() {
		f.tiers = tierPool(precise, cfg.Engines, remote != nil, eng)
	}
	return f, nil
}

// tierPool is what routing is told of the engines' tiers: the precise
// index per medium (the remote store its endpoint n when there is one)
// and every engine's load costs.
func tierPool(ix *prefix.PreciseIndex, n int, remote bool, eng sim.Config) *sched.Tiers {
	t := &sched.Tiers{Source: ix, Remote: -1}
	if remote {
		t.Remote = n
	}
	perBlock, latency := eng.LoadCost()
	t.LoadSeconds = make([][sched.NumTiers]float64, n)
	t.Latency = make([][sched.NumTiers]float64, n)
	for i := range n {
		t.LoadSeconds[i], t.Latency[i] = perBlock, latency
	}
	return t
}

// never is a time no event reaches.
const never = time.Duration(math.MaxInt64)

// BlockSize is the routing block size (tokens per hashed block).
func (f *Fleet) BlockSize() int { return f.blockSize }

// Policy returns the routing policy in use.
func (f *Fleet) Policy() sched.Policy { return f.policy }

// ReplicaPolicy returns replica r's routing policy (r 0 is Policy's).
func (f *Fleet) ReplicaPolicy(r int) sched.Policy { return f.reps[r].policy }

// ReplicaStagger is replica r's staggered decisions so far (Config.Replicas,
// ReplicaSync; zero otherwise).
func (f *Fleet) ReplicaStagger(r int) StaggerStats { return f.reps[r].stagger }

// Now is the simulated time of the last event processed: after Run, when the
// last request finished (or the last arrival, if later).
func (f *Fleet) Now() time.Duration { return f.now }

// Stats returns every engine's sim.Stats, in engine order (BusyTime included).
func (f *Fleet) Stats() []sim.Stats {
	st := make([]sim.Stats, len(f.engines))
	for i := range f.engines {
		st[i] = f.engines[i].e.Stats()
	}
	return st
}

// Utilization is the engines' mean busy fraction of [0, Now] (0..1); of
// their up time (ScaleStats.EngineSeconds) when the fleet autoscales.
func (f *Fleet) Utilization() float64 {
	if f.now <= 0 {
		return 0
	}
	var busy time.Duration
	for i := range f.engines {
		busy += f.engines[i].e.Stats().BusyTime
	}
	if f.as != nil {
		if up := f.ScaleStats().EngineSeconds; up > 0 {
			return busy.Seconds() / up
		}
		return 0
	}
	return float64(busy) / float64(f.now) / float64(len(f.engines))
}

// InFlight returns the gateway-side in-flight count of engine i, summed
// over the replicas.
func (f *Fleet) InFlight(i int) int {
	n := 0
	for _, r := range f.reps {
		n += int(r.ledgers[i].InFlight())
	}
	return n
}

// Run replays reqs, which must be in non-decreasing Arrival order and not
// before Now, and advances the fleet until every engine is idle. It returns
// one result per request, in request order; requests the fleet could not
// serve carry Err. The fleet keeps its state (caches, policy index, clock)
// for a later Run.
func (f *Fleet) Run(reqs []Request) ([]Result, error) {
	for i := range reqs {
		if reqs[i].Arrival < 0 || (i > 0 && reqs[i].Arrival < reqs[i-1].Arrival) {
			return nil, fmt.Errorf("sim: request %d arrives at %v, out of order", i, reqs[i].Arrival)
		}
		if reqs[i].Tokens == nil && reqs[i].Prompt == nil {
			return nil, fmt.Errorf("sim: request %d has neither Tokens nor Prompt", i)
		}
	}
	if len(reqs) > 0 && reqs[0].Arrival < f.now {
		return nil, fmt.Errorf("sim: request 0 arrives at %v, before the fleet's time %v", reqs[0].Arrival, f.now)
	}
	f.reqs, f.res = reqs, make([]Result, len(reqs))
	f.shares = make([]load.Share, len(reqs))
	f.owner, f.open = make([]int32, len(reqs)), make([]bool, len(reqs))
	f.routed, f.pinned = make([][]uint64, len(reqs)), make([]bool, len(reqs))
	f.base = f.nextID
	f.nextID += len(reqs)
	defer func() {
		f.reqs, f.res, f.shares, f.owner, f.open, f.routed, f.pinned = nil, nil, nil, nil, nil, nil, nil
	}()

	next := 0
	for next < len(reqs) || f.heap.len() > 0 || len(f.rx.held) > 0 || (f.as != nil && len(f.as.held) > 0) {
		t := never
		if f.heap.len() > 0 {
			t = f.engines[f.heap.top()].end
		}
		if next < len(reqs) && reqs[next].Arrival < t {
			t = reqs[next].Arrival
			if f.heap.len() == 0 && f.nextScrape < t {
				// An idle fleet's scrapes all read the same state: only
				// the last one before the arrival is taken.
				iv := f.cfg.ScrapeInterval
				f.nextScrape = t - (t-f.nextScrape)%iv
			}
		}
		scrape := f.nextScrape <= t
		if scrape {
			t = f.nextScrape
		}
		if rt := f.rx.next(); rt < t {
			t, scrape = rt, false
		}
		if f.as != nil {
			if at := f.nextScaleEvent(); at < t {
				t, scrape = at, false
			}
		}
		if f.kvHead < len(f.kvq) && f.kvq[f.kvHead].due < t {
			t, scrape = f.kvq[f.kvHead].due, false
		}
		f.now = t
		// 0. The KV events due now (Config.KVEventDelay).
		f.applyDueKVEvents(t)
		// 1. Deliver the steps ending now.
		f.pending = f.pending[:0]
		for f.heap.len() > 0 && f.engines[f.heap.top()].end == t {
			i := f.heap.pop(f.engines)
			ve := &f.engines[i]
			ve.busy, ve.sleeping = false, false
			if f.precise != nil {
				if f.cfg.KVEventDelay > 0 {
					f.queueKVEvents(int(i), ve, t+f.cfg.KVEventDelay)
				} else {
					f.applyKVEvents(int(i), ve.events)
				}
				ve.events = nil
				if f.remote != nil {
					f.applyRemoteEvents(ve)
				}
			}
			f.deliver(int(i), ve, t)
			if ve.e.HasWork() {
				ve.pending = true
				f.pending = append(f.pending, i)
			} else if ve.state == engineStopping {
				f.maybeOff(int(i), t)
			}
		}
		// 2. The metrics scrape of this instant, if any.
		if scrape {
			f.scrape()
			f.nextScrape += f.cfg.ScrapeInterval
		}
		// 2b. The replicas' messages due now, their load reports, a kill.
		f.exchange(t)
		// 2c. Autoscaling: engines ready now, held requests' TTLs, a
		// decision due now; then the held requests go to ready engines.
		if f.as != nil {
			f.scale(t)
		}
		// 3. Send the split requests whose prefill ended now to their
		// decode engines, then route the arrivals of this instant.
		f.handOff(t)
		f.release(t)
		for next < len(reqs) && reqs[next].Arrival == t {
			f.arrive(next, &reqs[next], t)
			next++
		}
		// 4. Engines whose step just ended start the next one.
		for _, i := range f.pending {
			f.engines[i].pending = false
			f.step(i, t)
		}
	}
	f.prompt = f.prompt[:0]
	return f.res, nil
}

// scrape sets the routing snapshot's engine-reported load from every
// engine's state now, as the gateway's scraper reads vLLM's
// num_requests_waiting, num_requests_running and kv_cache_usage_perc
// (simserver.Server publishes them from Engine.Stats after each step).
func (f *Fleet) scrape() {
	for i := range f.engines {
		ve := &f.engines[i]
		st := ve.e.Stats()
		// vllm:lora_requests_info's running and waiting adapters and
		// max_lora, as the gateway reads them (gateway/route.go
		// loraAdapters).
		ve.adapters = append(append(ve.adapters[:0], st.RunningLoRAs...), st.WaitingLoRAs...)
		maxLoras := 0
		if f.cfg.Engine.LoRA.Enabled() {
			maxLoras = f.cfg.Engine.LoRA.MaxLoras
		}
		for _, r := range f.reps { // every replica scrapes every engine
			e := &r.snap[i]
			e.Metrics, e.Waiting, e.Running, e.KVUtil = true, st.Waiting, st.Running, max(st.KVUsage, 0)
			e.Adapters, e.MaxAdapters = ve.adapters, maxLoras
		}
	}
}

// arrive routes request k at time t and adds it to the chosen engine,
// starting a step at once if the engine is idle.
func (f *Fleet) arrive(k int, vr *Request, t time.Duration) {
	r := &f.res[k]
	r.Arrival, r.Engine = vr.Arrival, -1
	if f.as != nil {
		if vr.Arrival == t {
			f.as.arrived++
		}
		if f.readyCount() == 0 {
			f.hold(k, t)
			return
		}
	}
	var rp *rep
	if f.rx.releasing {
		rp = f.reps[f.owner[k]] // chosen at its arrival, then held
	} else {
		rp = f.front(k)
		if turn, ok := rp.wait(t); ok {
			f.rx.hold(k, t, turn)
			return
		}
	}
	r.Replica = int(f.owner[k])
	policy := rp.policy
	tokens := vr.Tokens
	if tokens == nil {
		f.prompt = vr.Prompt(f.prompt[:0])
		tokens = f.prompt
	}
	f.sreq = sched.Request{Model: f.cfg.Model, Adapter: vr.Adapter}
	if policy.NeedsHashes() || f.precise != nil || (rp.pd != nil && rp.pd.NeedsHashes()) {
		f.hashes = prefix.Hashes(f.hashes[:0], tokens, f.blockSize, f.seedOf(vr.Adapter))
		f.sreq.Hashes, f.sreq.PromptTokens = f.hashes, len(tokens)
	}
	rp.fill(t)
	r.Prefill = -1
	var d sched.Decision
	var maxTokens int
	var pdd sched.PDDecision
	if rp.pd != nil {
		pdd = rp.pd.Pick(&f.sreq, rp.snap)
		r.PDReason = pdd.Reason
		if pdd.Split && pdd.Decode.Endpoint >= 0 {
			// The prefill leg first: D (chosen now, as llm-d's
			// scheduler picks both) gets the request when it ends.
			r.Engine, r.Prefill = pdd.Decode.Endpoint, pdd.Prefill.Endpoint
			d, maxTokens = pdd.Prefill, 1
		} else {
			d = pdd.Decode
		}
	} else {
		d = policy.Pick(&f.sreq, rp.snap)
	}
	// The decision's learning, queued by Pick (sched.Settler), applied
	// before anything else happens: virtual time decides as if it were
	// applied inline, deterministically, whatever the live gateway's
	// settler does.
	if rp.pd != nil {
		rp.pd.Settle()
	} else if s, ok := policy.(sched.Settler); ok {
		s.Settle()
	}
	if d.Endpoint < 0 || d.Endpoint >= len(f.engines) {
		r.Engine, r.Err = -1, ErrNoEndpoint
		return
	}
	if rp.pd != nil {
		f.learntPD(rp, pdd, t)
	} else {
		f.learnt(rp, d, t)
	}
	if fin := f.finisher(k); fin != nil && len(f.sreq.Hashes) > 0 {
		h := f.spare
		var keep []uint64
		if n := len(h); n > 0 {
			keep, f.spare = h[n-1][:0], h[:n-1]
		}
		f.routed[k] = append(keep, f.sreq.Hashes...)
		f.pinned[k] = f.sreq.Pinned
	}
	if r.Prefill < 0 {
		r.Engine = d.Endpoint
	}
	r.MatchedBlocks, r.PreciseMatchedBlocks = d.MatchedBlocks, -1
	if f.precise != nil {
		f.precise.Match(f.sreq.Hashes, prefix.MediumGPU, f.matched)
		r.PreciseMatchedBlocks = f.matched[d.Endpoint]
		if f.tiers != nil {
			r.PredictedTierBlocks = f.predictTiers(d.Endpoint, len(tokens))
		}
		f.precise.Routed(d.Endpoint, f.sreq.Hashes) // as the gateway does
	}
	if maxTokens == 0 {
		maxTokens = vr.MaxTokens
	}
	f.req = sim.Request{ID: strconv.Itoa(f.base + k), Tokens: tokens, MaxTokens: maxTokens, HoldKV: r.Prefill >= 0, LoRA: vr.Adapter}
	if r.Prefill >= 0 {
		// As the gateway takes D's slot when it decides, before P's leg.
		f.ledger(k, r.Engine).Acquire()
	}
	f.send(k, d.Endpoint, len(tokens), d.MatchedBlocks*f.blockSize, t, true)
}

// send adds f.req, request k's leg of promptTokens to engine e at t with
// matched tokens expected cached there, accounting it as the gateway's
// attempt does (an in-flight slot, its prompt in flight, its uncached part
// in the prefill backlog), and starts a step at once if e is idle.
func (f *Fleet) send(k, e, promptTokens, matched int, t time.Duration, acquire bool) {
	r := &f.res[k]
	ve := &f.engines[e]
	err := ve.e.Add(&f.req, t)
	f.req.Tokens = nil
	if err != nil {
		r.Err = err
		if !acquire || r.Prefill >= 0 {
			f.ledger(k, r.Engine).Release() // D's slot, taken at the decision
		}
		return
	}
	if acquire {
		f.ledger(k, e).Acquire()
	}
	f.ledger(k, e).Send(&f.shares[k], promptTokens, matched, t)
	f.open[k] = true
	switch {
	case ve.sleeping:
		// Waiting for a load, and now it has work to run meanwhile.
		f.heap.remove(f.engines, int32(e))
		ve.busy, ve.sleeping = false, false
		f.step(int32(e), t)
	case !ve.busy && !ve.pending:
		f.step(int32(e), t)
	}
}

// handOff sends every split request whose prefill leg ended now to its
// decode engine with RemotePrefill (the NIXL flow's second leg: D reads
// the blocks P holds), accounted on D with its whole prompt expected
// cached: D prefills nothing but one token.
func (f *Fleet) handOff(t time.Duration) {
	for _, k := range f.handoffs {
		r := &f.res[k]
		vr := &f.reqs[k]
		tokens := vr.Tokens
		if tokens == nil {
			f.prompt = vr.Prompt(f.prompt[:0])
			tokens = f.prompt
		}
		r.HandOff = t
		if f.precise != nil {
			f.precise.Routed(r.Engine, f.hashesOf(tokens, vr.Adapter))
		}
		f.req = sim.Request{ID: strconv.Itoa(f.base + k), Tokens: tokens, MaxTokens: vr.MaxTokens, RemotePrefill: true, LoRA: vr.Adapter}
		f.send(k, r.Engine, len(tokens), len(tokens), t, false) // D's slot was taken at the decision
		if r.Err != nil {
			f.engines[r.Prefill].e.Release(f.req.ID) // no D will read them
		}
	}
	f.handoffs = f.handoffs[:0]
}

// hashesOf returns the routing block hashes of tokens under adapter ("":
// the base model; f.hashes reused).
func (f *Fleet) hashesOf(tokens []uint32, adapter string) []uint64 {
	f.hashes = prefix.Hashes(f.hashes[:0], tokens, f.blockSize, f.seedOf(adapter))
	return f.hashes
}

// seedOf is the root seed of a prompt under adapter: the model's for the
// base model, the adapter's own otherwise, as the gateway hashes it and
// the precise index keys the engines' KV events (lora_name).
func (f *Fleet) seedOf(adapter string) uint64 {
	if adapter == "" {
		return f.seed
	}
	return prefix.Seed(adapter + "\x00")
}

// predictTiers is what the precise index says engine e would take from
// each tier for a prompt of tokens tokens whose hashes are f.sreq.Hashes:
// the routing view (sched.Tiers.Split, every engine's, as a policy sees
// it) with the precise GPU match.
func (f *Fleet) predictTiers(e, tokens int) [sim.NumTiers]int {
	f.precise.Match(f.sreq.Hashes, prefix.MediumGPU, f.matched)
	if len(f.tierSplit) != len(f.engines) {
		f.tierSplit = make([][sched.NumTiers]int, len(f.engines))
	}
	f.tierMatch = f.tiers.Split(f.sreq.Hashes, min(len(f.sreq.Hashes), (tokens-1)/f.blockSize), f.matched, f.tierSplit, f.tierMatch)
	return f.tierSplit[e]
}

// step starts a step of engine i at time t. A step that schedules nothing
// while lower-tier loads are in flight is a wait for the first to end: the
// engine sleeps until then, and an arrival wakes it earlier (arrive).
func (f *Fleet) step(i int32, t time.Duration) {
	ve := &f.engines[i]
	res := ve.e.Step(t)
	for _, id := range res.Transferred {
		// D read the blocks: P frees them (NIXL's finished-sending
		// notification), which wakes P if it waits for free blocks.
		k := f.index(id)
		f.res[k].Transferred = t
		p := int32(f.res[k].Prefill)
		f.engines[p].e.Release(id)
		if pe := &f.engines[p]; pe.sleeping {
			f.heap.remove(f.engines, p)
			pe.busy, pe.sleeping = false, false
			f.step(p, t)
		}
	}
	if f.remote != nil && f.precise != nil {
		ve.keepRemoteEvents(f.remote.TakeEvents())
	}
	end := t + res.Duration
	if res.Duration == 0 {
		at, ok := ve.e.NextLoad()
		if !ok && ve.e.HasWork() {
			// Its free blocks are held for decode engines: it waits for a
			// release (which wakes it) or the holds' abort timeout.
			at, ok = ve.e.NextHeldExpiry()
		}
		if !ok {
			// Nothing ran and nothing loads (every running request was
			// preempted, say): step again at once, after this instant.
			at = t
		}
		end = max(at, t)
		ve.sleeping = ok
	}
	ve.busy, ve.end, ve.outs, ve.events = true, end, res.Outputs, res.Events
	f.heap.push(f.engines, i)
}

// keepRemoteEvents copies the remote store's events of ve's step (the
// store reuses its buffers at the next write, another engine's) to be
// applied at the step's end, when the engine's writes reach the store.
func (ve *engine) keepRemoteEvents(evs []kvevent.Event) {
	for _, ev := range evs {
		h0, t0 := len(ve.rHashes), len(ve.rTokens)
		ve.rHashes = append(ve.rHashes, ev.BlockHashes...)
		ve.rTokens = append(ve.rTokens, ev.TokenIDs...)
		ev.BlockHashes = ve.rHashes[h0:len(ve.rHashes):len(ve.rHashes)]
		ev.TokenIDs = ve.rTokens[t0:len(ve.rTokens):len(ve.rTokens)]
		ve.rEvents = append(ve.rEvents, ev)
	}
}

// applyRemoteEvents feeds the remote store's events of ve's step to the
// precise index as those of endpoint Engines, as a gateway subscribed to
// the kvstore's event stream applies them, at the step's end (the engine's
// own events are applied then too: applied at its start, the store's
// would tell routing of blocks the engine's tiers hold but have not yet
// announced).
func (f *Fleet) applyRemoteEvents(ve *engine) {
	e := f.cfg.Engines
	defer func() { ve.rEvents, ve.rHashes, ve.rTokens = ve.rEvents[:0], ve.rHashes[:0], ve.rTokens[:0] }()
	for _, ev := range ve.rEvents {
		switch ev.Type {
		case kvevent.BlockStored:
			seed := f.seed
			if ev.LoRAName != "" {
				seed = prefix.Seed(ev.LoRAName + "\x00")
			}
			_ = f.precise.Stored(e, prefix.MediumRemote, ev.BlockHashes, ev.ParentBlockHash, ev.HasParent, ev.TokenIDs, seed)
		case kvevent.BlockRemoved:
			f.precise.Removed(e, prefix.MediumRemote, ev.BlockHashes)
		}
	}
}

// kvBatch is a step's KV events waiting for their delivery.
type kvBatch struct {
	due    time.Duration
	engine int
	events []kvevent.Event // deep copies
}

// queueKVEvents keeps engine i's step events for delivery at due: copies,
// since the engine reuses its buffers.
func (f *Fleet) queueKVEvents(i int, ve *engine, due time.Duration) {
	if len(ve.events) == 0 {
		return
	}
	if f.kvHead == len(f.kvq) {
		f.kvq, f.kvHead = f.kvq[:0], 0
	}
	evs := make([]kvevent.Event, len(ve.events))
	for k, ev := range ve.events {
		ev.BlockHashes = slices.Clone(ev.BlockHashes)
		ev.TokenIDs = slices.Clone(ev.TokenIDs)
		evs[k] = ev
	}
	f.kvq = append(f.kvq, kvBatch{due: due, engine: i, events: evs})
}

// applyDueKVEvents applies the queued KV events due by t, in the order
// their steps ended.
func (f *Fleet) applyDueKVEvents(t time.Duration) {
	for f.kvHead < len(f.kvq) && f.kvq[f.kvHead].due <= t {
		b := &f.kvq[f.kvHead]
		f.applyKVEvents(b.engine, b.events)
		*b = kvBatch{}
		f.kvHead++
	}
}

// applyKVEvents feeds engine i's step events to the precise index, at the
// step's end, as the engine publishes them after the step (or
// Config.KVEventDelay later).
func (f *Fleet) applyKVEvents(i int, events []kvevent.Event) {
	for k := range events {
		ev := &events[k]
		switch ev.Type {
		case kvevent.BlockStored:
			seed := f.seed
			if ev.LoRAName != "" {
				seed = prefix.Seed(ev.LoRAName + "\x00")
			}
			// A parent evicted before the event: kept as an orphan, as a
			// subscriber would.
			m, _ := prefix.ParseMedium(ev.Medium)
			_ = f.precise.Stored(i, m, ev.BlockHashes, ev.ParentBlockHash, ev.HasParent, ev.TokenIDs, seed)
		case kvevent.BlockRemoved:
			m, _ := prefix.ParseMedium(ev.Medium)
			f.precise.Removed(i, m, ev.BlockHashes)
		case kvevent.AllBlocksCleared:
			f.precise.Cleared(i)
		}
	}
}

// deliver hands the outputs of ve's step, ending at t, to their requests.
func (f *Fleet) deliver(i int, ve *engine, t time.Duration) {
	for _, o := range ve.outs {
		if o.NewTokens == 0 {
			continue
		}
		k := f.index(o.ID)
		r := &f.res[k]
		if r.Err != nil { // its replica was killed mid-step (replicas.go)
			continue
		}
		if r.Prefill >= 0 && &f.engines[r.Prefill] == ve { // prefill and decode engines differ
			// The prefill leg's one token: P's answer, with the usage the
			// gateway rewrites D's from; D gets the request now.
			r.PromptTokens, r.CachedTokens, r.TierTokens = o.PromptTokens, o.CachedTokens, o.TierTokens
			f.shares[k].Finish()
			f.ledger(k, i).Release()
			f.finished(k, i, false, t) // P frees the prompt's blocks once D read them; the hand-off is at this instant
			f.handoffs = append(f.handoffs, k)
			continue
		}
		if o.FirstToken {
			f.shares[k].FirstToken(t) // the learnt prefill rate, as relayStream teaches it
			r.FirstToken = t
			if f.as != nil && f.as.cfg.Policy.TTFTTarget > 0 {
				f.as.ttfts = append(f.as.ttfts, t-r.Arrival)
			}
			if r.Prefill < 0 {
				r.PromptTokens, r.CachedTokens, r.TierTokens = o.PromptTokens, o.CachedTokens, o.TierTokens
			} else {
				r.TransferredTokens = o.TransferredTokens
			}
			if m := f.reqs[k].MaxTokens; !f.cfg.SkipITL && m > 1 {
				r.ITL = make([]time.Duration, 0, m-1)
			}
		} else if !f.cfg.SkipITL {
			r.ITL = append(r.ITL, t-r.Finish)
		}
		r.Finish = t
		r.OutputTokens = o.OutputTokens
		if o.Finished {
			f.shares[k].Finish()
			f.ledger(k, i).Release()
			f.open[k] = false
			f.finished(k, i, true, t)
		}
	}
	ve.outs = nil
}

// finisher is the policy that routed request k when it learns on finish
// (sched.Finisher), else nil.
func (f *Fleet) finisher(k int) sched.Finisher {
	rp := f.reps[f.owner[k]]
	var p any = rp.policy
	if rp.pd != nil {
		p = rp.pd
	}
	if fin, ok := p.(sched.Finisher); ok && fin.LearnsOnFinish() {
		return fin
	}
	return nil
}

// finished tells request k's policy that engine i ended it, as the
// gateway does when its relay ends, and settles the learn at once (as
// arrive settles a decision's); last: the request's last leg, whose hashes
// are then released.
func (f *Fleet) finished(k, i int, last bool, t time.Duration) {
	h := f.routed[k]
	if h == nil {
		return
	}
	fin := f.finisher(k)
	fin.Finished(i, h, f.pinned[k])
	if s, ok := fin.(sched.Settler); ok {
		s.Settle()
	}
	f.finishedPeers(k, i, h, t)
	if last {
		f.routed[k] = nil
		f.spare = append(f.spare, h)
	}
}

// index parses the decimal request id given in arrive back to a result index.
func (f *Fleet) index(id string) int {
	n := 0
	for i := 0; i < len(id); i++ {
		n = n*10 + int(id[i]-'0')
	}
	return n - f.base
}

// stepHeap is a binary min-heap of engine indices ordered by step end, then
// index (deterministic ties).
type stepHeap struct{ h []int32 }

func (h *stepHeap) len() int   { return len(h.h) }
func (h *stepHeap) top() int32 { return h.h[0] }

func stepBefore(es []engine, a, b int32) bool {
	if es[a].end != es[b].end {
		return es[a].end < es[b].end
	}
	return a < b
}

func (h *stepHeap) push(es []engine, i int32) {
	h.h = append(h.h, i)
	h.up(es, len(h.h)-1)
}

// remove takes engine i out of the heap.
func (h *stepHeap) remove(es []engine, i int32) {
	j := slices.Index(h.h, i)
	if j < 0 {
		return
	}
	n := len(h.h) - 1
	h.h[j] = h.h[n]
	h.h = h.h[:n]
	if j == n {
		return
	}
	h.down(es, j)
	h.up(es, j)
}

func (h *stepHeap) up(es []engine, j int) {
	for j > 0 {
		p := (j - 1) / 2
		if !stepBefore(es, h.h[j], h.h[p]) {
			break
		}
		h.h[j], h.h[p] = h.h[p], h.h[j]
		j = p
	}
}

func (h *stepHeap) down(es []engine, j int) {
	n := len(h.h)
	for {
		l := 2*j + 1
		if l >= n {
			break
		}
		c := l
		if r := l + 1; r < n && stepBefore(es, h.h[r], h.h[l]) {
			c = r
		}
		if !stepBefore(es, h.h[c], h.h[j]) {
			break
		}
		h.h[j], h.h[c] = h.h[c], h.h[j]
		j = c
	}
}

func (h *stepHeap) pop(es []engine) int32 {
	top := h.h[0]
	n := len(h.h) - 1
	h.h[0] = h.h[n]
	h.h = h.h[:n]
	h.down(es, 0)
	return top
}
