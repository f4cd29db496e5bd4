package sim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/infergate/infergate/kvevents/kvevent"
	"github.com/infergate/infergate/prefix"
)

// Defaults of Config, matching vLLM v1 online serving on a large GPU.
const (
	DefaultBlockSize           = 16   // vLLM --block-size
	DefaultMaxNumSeqs          = 256  // vLLM --max-num-seqs
	DefaultMaxNumBatchedTokens = 8192 // vLLM --max-num-batched-tokens (chunked prefill)
)

// Config configures an Engine. Zero fields take defaults.
type Config struct {
	// Profile is the model and hardware; zero (Layers == 0) means DefaultProfile().
	Profile GPUProfile `yaml:"profile"`
	// BlockSize is the KV-cache page size in tokens (default 16).
	BlockSize int `yaml:"block_size"`
	// NumBlocks is the KV capacity in blocks; 0 derives it from Profile.NumBlocks.
	NumBlocks int `yaml:"num_blocks"`
	// MaxNumSeqs bounds the running set (default 256).
	MaxNumSeqs int `yaml:"max_num_seqs"`
	// MaxNumBatchedTokens is the per-step token budget shared by decodes and
	// prefill chunks (default 8192).
	MaxNumBatchedTokens int `yaml:"max_num_batched_tokens"`
	// Seed seeds the pseudo-random output tokens.
	Seed uint64 `yaml:"seed"`
	// OutputVocab is the set of token ids output tokens are drawn from. nil means
	// ids 1000..1999. A front that renders text sets it to ids whose decoded text
	// re-tokenizes to the same ids, so that multi-turn prompts hit the cached
	// output blocks as they do on a real engine.
	OutputVocab []uint32 `yaml:"-"`
	// FirstOutputVocab, when set, is the set a request's first output token
	// is drawn from (OutputVocab the rest): a front whose chat template
	// trims the assistant's content sets it to words without a leading
	// space, as a model's reply starts, so that the reply still
	// re-tokenizes to the same ids (simserver/words.go).
	FirstOutputVocab []uint32 `yaml:"-"`
	// KVEvents makes the engine record vLLM KV-cache events (BlockStored,
	// BlockRemoved, AllBlocksCleared) in StepResult.Events; see kvevents.go.
	// Off, recording costs nothing.
	KVEvents bool `yaml:"kv_events"`
	// LoRA enables LoRA adapters (off when LoRA.Adapters is empty); see lora.go.
	LoRA LoRAConfig `yaml:"lora"`
	// Tiers puts host-memory, disk and remote KV tiers behind the GPU (all
	// off by default); see tiers.go.
	Tiers TiersConfig `yaml:"kv_tiers"`
	// PD tunes the engine's side of P/D hand-offs (pd.go).
	PD PDConfig `yaml:"pd"`
}

// WithDefaults returns c with zero fields replaced by their defaults.
func (c Config) WithDefaults() Config {
	if c.Profile.Layers == 0 {
		c.Profile = DefaultProfile()
	}
	if c.BlockSize == 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.NumBlocks == 0 {
		c.NumBlocks = c.Profile.NumBlocks(c.BlockSize)
	}
	if c.MaxNumSeqs == 0 {
		c.MaxNumSeqs = DefaultMaxNumSeqs
	}
	if c.MaxNumBatchedTokens == 0 {
		c.MaxNumBatchedTokens = DefaultMaxNumBatchedTokens
	}
	if len(c.OutputVocab) == 0 {
		c.OutputVocab = defaultVocab
	}
	c.LoRA = c.LoRA.WithDefaults()
	c.PD = c.PD.WithDefaults()
	return c
}

var defaultVocab = func() []uint32 {
	v := make([]uint32, 1000)
	for i := range v {
		v[i] = uint32(1000 + i)
	}
	return v
}()

// Validate reports whether c (after defaults) describes a runnable engine.
func (c Config) Validate() error {
	c = c.WithDefaults()
	if err := c.Profile.Validate(); err != nil {
		return err
	}
	var errs []error
	if c.BlockSize < 1 {
		errs = append(errs, fmt.Errorf("block_size must be >= 1, got %d", c.BlockSize))
	}
	if c.NumBlocks < 1 {
		errs = append(errs, fmt.Errorf("num_blocks must be >= 1, got %d (does the model fit the GPUs?)", c.NumBlocks))
	}
	if c.MaxNumSeqs < 1 {
		errs = append(errs, fmt.Errorf("max_num_seqs must be >= 1, got %d", c.MaxNumSeqs))
	}
	if c.MaxNumBatchedTokens < 1 {
		errs = append(errs, fmt.Errorf("max_num_batched_tokens must be >= 1, got %d", c.MaxNumBatchedTokens))
	}
	if err := c.LoRA.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := validatePD(c); err != nil {
		errs = append(errs, err)
	}
	if c.NumBlocks >= 1 && c.BlockSize >= 1 {
		if err := validateTiers(c.Tiers, c.Profile, c.NumBlocks, c.BlockSize); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Request is one generation request given to an Engine.
type Request struct {
	// ID identifies the request in Outputs and Abort; it must be unique among
	// unfinished requests.
	ID string
	// Tokens is the prompt. The engine copies it.
	Tokens []uint32
	// MaxTokens is the exact number of tokens to generate (the engine has no EOS).
	MaxTokens int
	// Extra is the cache-salt identity (0 for none; the HTTP front uses
	// prefix.Seed(cache_salt)). Together with LoRA it makes the parent hash of
	// the first block (RootHash(LoRA, Extra)), so requests with different
	// Extra or LoRA share no cached blocks.
	Extra uint64
	// LoRA names the adapter the request runs under ("" for the base model);
	// it must be one of Config.LoRA.Adapters.
	LoRA string
	// HoldKV keeps the request's blocks after it finishes, for a decode
	// engine to read (a P leg: kv_transfer_params.do_remote_decode; pd.go).
	HoldKV bool
	// RemotePrefill reads the prompt's KV from the prefill engine that
	// computed it instead of computing it (a D leg:
	// kv_transfer_params.do_remote_prefill with P's blocks; pd.go).
	RemotePrefill bool
}

// Output is what one step produced for one request.
type Output struct {
	ID string
	// NewTokens is 1 when the step sampled a token for the request, else 0
	// (the engine only reports requests that produced a token or finished).
	NewTokens int
	// Token is the id of the sampled token (valid when NewTokens == 1).
	Token uint32
	// FirstToken is set on the request's first output token.
	FirstToken bool
	// Finished is set when the request has produced MaxTokens tokens.
	Finished bool
	// PromptTokens is the prompt length.
	PromptTokens int
	// CachedTokens is the number of prompt tokens served from the prefix cache
	// when the request was first scheduled. This is vLLM's num_cached_tokens,
	// which reports the first admission and is not updated on re-admission after
	// a preemption (vllm/v1/core/sched/scheduler.py). It counts the tokens
	// loaded from lower tiers too, as vLLM's does with a KV connector.
	CachedTokens int
	// TierTokens splits CachedTokens by the tier each block came from
	// (TierGPU: the GPU prefix cache; the others were loaded; tiers.go).
	TierTokens [NumTiers]int
	// TransferredTokens is the part of CachedTokens read from a prefill
	// engine (RemotePrefill; pd.go).
	TransferredTokens int
	// OutputTokens is the number of tokens generated so far, this one included.
	OutputTokens int
	// Scheduled is the simulated time the request was first scheduled: the
	// start of the step that first admitted it (vLLM's SCHEDULED event;
	// queue time = Scheduled − arrival).
	Scheduled time.Duration
}

// StepResult is the outcome of one engine step.
type StepResult struct {
	// Duration is the simulated time the step takes; its outputs happen at now+Duration.
	Duration time.Duration
	// Outputs lists requests that produced a token in the step. The slice is
	// owned by the Engine and reused: it is valid until the next call to Step.
	Outputs []Output
	// Cost is the work the step did.
	Cost StepCost
	// Events are the KV-cache events of the step, in the order the block pool
	// produced them (evictions of an allocation before the stores it makes
	// room for), preceded by those of ResetPrefixCache calls made since the
	// previous Step. nil unless Config.KVEvents. Owned by the Engine: valid
	// until the next call to Step, ResetPrefixCache or TakeKVEvents.
	Events []kvevent.Event
	// LoRALoads is the number of adapters loaded for the step; Duration
	// includes LoRALoads × LoRAConfig.LoadLatency.
	LoRALoads int
	// Transferred lists the RemotePrefill requests whose KV reads from
	// their prefill engine ended by the step's start: the driver releases
	// their blocks there (Engine.Release). Owned by the Engine, valid until
	// the next Step.
	Transferred []string
}

// Stats is a snapshot of engine state and cumulative counters.
type Stats struct {
	Running, Waiting int
	// KVUsage is the fraction of blocks held by at least one request (0..1).
	// Cached blocks in the free queue count as free, as in vLLM's kv_cache_usage_perc.
	KVUsage   float64
	NumBlocks int
	BlockSize int
	// PrefixQueries and PrefixHits are cumulative prompt tokens looked up in and
	// found in the prefix cache, at first admission only (vLLM counts
	// re-admissions after preemption separately).
	PrefixQueries, PrefixHits int64
	Preemptions               int64
	// PromptTokens counts prompts when their first token is produced;
	// GenerationTokens counts output tokens.
	PromptTokens, GenerationTokens int64
	// Prompts counts requests whose first token was produced (requests).
	Prompts int64
	// PrefillTokens counts tokens computed in prefill (prompt chunks and
	// recomputation after preemption): the work prefix caching saves.
	PrefillTokens int64
	// BusyTime is the simulated time spent in steps (for utilisation).
	BusyTime time.Duration
	// CachedPromptTokens counts prefix-cache hit tokens of prompts when their
	// first token is produced (vLLM prompt_tokens_cached), lower tiers included.
	CachedPromptTokens int64
	// ExternalQueries and ExternalHits are prompt tokens looked up in and
	// found in the lower tiers at first admission (vLLM
	// external_prefix_cache_queries and _hits, the KV connector's); TierHits
	// splits the hits of every tier, the GPU's (PrefixHits) included, and
	// LoadedBlocks counts the blocks loaded (re-admissions included).
	ExternalQueries, ExternalHits int64
	TierHits                      [NumTiers]int64
	LoadedBlocks                  int64
	// Loading is the number of waiting requests whose blocks are being
	// loaded from a lower tier (vLLM WAITING_FOR_REMOTE_KVS).
	Loading int
	// TierBlocks and TierCapacity are the blocks each local tier holds and
	// can hold (TierGPU: cached blocks in the GPU pool and its size; the
	// remote tier's are the store's, 0 here).
	TierBlocks, TierCapacity [NumTiers]int

	// WaitingDeferred is the number of waiting requests that could not be
	// admitted now whatever the free KV blocks and token budget, because
	// their adapter would exceed LoRAConfig.MaxLoras (vLLM
	// num_requests_waiting_by_reason{reason="deferred"}); the other
	// Waiting − WaitingDeferred wait for capacity.
	WaitingDeferred int
	// RunningLoRAs and WaitingLoRAs are the distinct adapters of running and
	// of waiting requests, sorted (nil when LoRA is disabled or none).
	RunningLoRAs, WaitingLoRAs []string
	// LoRALoads counts adapter loads (each cost LoRAConfig.LoadLatency).
	LoRALoads int64

	// P/D (pd.go). HeldRequests and HeldBlocks are the finished prefill
	// requests whose blocks are held for a decode engine, and their
	// blocks (counted in KVUsage); HeldReleased and HeldExpired count the
	// holds that ended by Release or Abort and by the abort timeout.
	HeldRequests, HeldBlocks  int
	HeldReleased, HeldExpired int64
	// TransferredBlocks counts blocks read from prefill engines.
	TransferredBlocks int64
}

// Errors returned by Engine.Add.
var (
	ErrDuplicateID  = errors.New("sim: duplicate request id")
	ErrEmptyPrompt  = errors.New("sim: empty prompt")
	ErrBadMaxTokens = errors.New("sim: max tokens must be >= 1")
	ErrTooLong      = errors.New("sim: request exceeds the maximum model length")
	ErrNoCapacity   = errors.New("sim: request exceeds the KV cache capacity")
)

// seq is the engine's state of one request.
type seq struct {
	id          string
	tokens      []uint32 // prompt followed by generated tokens
	promptLen   int
	maxTokens   int
	root        uint64 // parent hash of block 0: RootHash(lora, Request.Extra)
	lora        string // adapter, "" for the base model
	loraID      int    // LoRAConfig.AdapterID(lora); 0 for the base model
	seed        uint64
	hashes      []uint64      // chained hashes of the full blocks of tokens
	blocks      []int32       // KV blocks, in sequence order
	numCachedBl int           // leading blocks registered in the prefix cache
	computed    int           // tokens whose KV is computed (vLLM num_computed_tokens)
	cached      int           // prefix-cache hit tokens at first admission; -1 before
	tierTokens  [NumTiers]int // cached, split by tier
	admitted    bool          // has been scheduled at least once
	loading     bool          // waiting for its lower-tier blocks (loadDone)
	loadDone    time.Duration // when they are all in GPU memory
	loadBlocks  int           // leading blocks held once loaded (GPU hit + loaded)
	holdKV      bool          // Request.HoldKV
	remote      bool          // Request.RemotePrefill
	transferred int           // prompt tokens read from the prefill engine
	arrival     time.Duration // simulated time of Add
	scheduledAt time.Duration // start of the step that first admitted it
}

func (s *seq) output() int { return len(s.tokens) - s.promptLen }

type scheduled struct {
	s *seq
	n int
}

// Engine is a simulated vLLM v1 engine core: a continuous-batching scheduler
// over a paged KV cache with automatic prefix caching, timed by a roofline
// model of the Profile. It is a pure state machine: no goroutines, no I/O, no
// clock; simulated time is passed in. It is not safe for concurrent use.
type Engine struct {
	cfg     Config
	pool    *blockPool
	waiting queue  // FCFS
	running []*seq // in admission order; the tail is preempted first
	byID    map[string]*seq
	sched   []scheduled
	out     []Output
	hit     []int32
	stats   Stats
	kv      *kvEventLog // nil unless cfg.KVEvents
	lora    *loraState  // nil unless cfg.LoRA.Enabled()
	tiers   *tiers      // nil unless cfg.Tiers.Enabled()
	loads   int         // waiting requests loading
	// P/D (pd.go).
	xfer        link               // the interconnect D reads P's blocks over
	held        map[string]*heldKV // finished HoldKV requests' blocks
	heldBlocks  int
	justHeld    []*heldKV // held in the current step: their timeout starts at its end
	expiry      []*heldKV // holds in expiry order (done ones skipped)
	transferred []string  // StepResult.Transferred
}

// NewEngine returns an idle engine. It panics if cfg.Validate fails; callers
// taking configuration from users should call Validate first.
func NewEngine(cfg Config) *Engine {
	if err := cfg.Validate(); err != nil {
		panic(fmt.Sprintf("sim.NewEngine: %v", err))
	}
	cfg = cfg.WithDefaults()
	e := &Engine{
		cfg:   cfg,
		pool:  newBlockPool(cfg.NumBlocks),
		byID:  make(map[string]*seq),
		stats: Stats{NumBlocks: cfg.NumBlocks, BlockSize: cfg.BlockSize},
	}
	if cfg.KVEvents {
		e.kv = &kvEventLog{}
		e.pool.ev = e.kv
	}
	if cfg.LoRA.Enabled() {
		e.lora = newLoRAState(cfg.LoRA)
	}
	e.tiers = newTiers(cfg, e.kv)
	for t := TierHost; e.tiers != nil && t < TierRemote; t++ {
		if tc := e.tiers.local[t]; tc != nil {
			e.stats.TierCapacity[t] = tc.capacity
		}
	}
	e.stats.TierCapacity[TierGPU] = cfg.NumBlocks
	e.xfer = link{bw: cfg.Profile.KVTransferBandwidth, latency: cfg.Profile.KVTransferLatency}
	return e
}

// Config returns the engine's configuration with defaults applied.
func (e *Engine) Config() Config { return e.cfg }

// Add queues a request at simulated time now. It fails if the ID is in use,
// the prompt is empty, MaxTokens < 1, prompt+MaxTokens exceeds the profile's
// MaxModelLen, the request could not fit the KV cache even alone (which
// would otherwise preempt itself forever), or it names an unknown adapter.
func (e *Engine) Add(r *Request, now time.Duration) error {
	if err := e.cfg.CheckRequest(len(r.Tokens), r.MaxTokens); err != nil {
		return err
	}
	if r.LoRA != "" && e.cfg.LoRA.AdapterID(r.LoRA) == 0 {
		return fmt.Errorf("%w: %q", ErrUnknownLoRA, r.LoRA)
	}
	if _, dup := e.byID[r.ID]; dup {
		return fmt.Errorf("%w: %q", ErrDuplicateID, r.ID)
	}
	if _, dup := e.held[r.ID]; dup {
		return fmt.Errorf("%w: %q (its blocks are held for a decode engine)", ErrDuplicateID, r.ID)
	}
	if r.RemotePrefill && e.xfer.bw <= 0 {
		return ErrNoInterconnect
	}
	total := len(r.Tokens) + r.MaxTokens
	bs := e.cfg.BlockSize
	s := &seq{
		id:        r.ID,
		tokens:    make([]uint32, len(r.Tokens), total),
		promptLen: len(r.Tokens),
		maxTokens: r.MaxTokens,
		root:      RootHash(r.LoRA, r.Extra),
		lora:      r.LoRA,
		loraID:    e.cfg.LoRA.AdapterID(r.LoRA),
		cached:    -1,
		arrival:   now,
		hashes:    make([]uint64, 0, total/bs),
		holdKV:    r.HoldKV,
		remote:    r.RemotePrefill,
	}
	copy(s.tokens, r.Tokens)
	s.hashes = prefix.Hashes(s.hashes, s.tokens, bs, s.root)
	s.seed = e.promptSeed(s)
	e.byID[r.ID] = s
	e.waiting.pushBack(s)
	return nil
}

// CheckRequest reports whether a request of promptTokens and maxTokens can be
// served by an engine of this configuration (defaults applied): the prompt is
// not empty, maxTokens >= 1, prompt+maxTokens fits the profile's MaxModelLen,
// and the request fits the KV cache alone — otherwise it would preempt itself
// forever. The last sampled token is never fed back, so a request holds at
// most promptTokens+maxTokens-1 tokens of KV. Engine.Add performs the same checks.
func (c Config) CheckRequest(promptTokens, maxTokens int) error {
	c = c.WithDefaults()
	switch {
	case promptTokens < 1:
		return ErrEmptyPrompt
	case maxTokens < 1:
		return ErrBadMaxTokens
	case promptTokens > maxRequestTokens || maxTokens > maxRequestTokens:
		// Too long for any cache, and their sum would overflow (the API
		// accepts a max_tokens of 2^63-1).
		return fmt.Errorf("%w: %d prompt + %d output tokens", ErrTooLong, promptTokens, maxTokens)
	}
	total := promptTokens + maxTokens
	if m := c.Profile.MaxModelLen; m > 0 && total > m {
		return fmt.Errorf("%w: %d prompt + %d output tokens > %d", ErrTooLong, promptTokens, maxTokens, m)
	}
	bs := c.BlockSize
	if need := (total - 1 + bs - 1) / bs; need > c.NumBlocks {
		return fmt.Errorf("%w: needs %d blocks of %d tokens, the cache has %d", ErrNoCapacity, need, bs, c.NumBlocks)
	}
	return nil
}

// maxRequestTokens bounds a request's prompt and its output (tokens): far
// beyond any model's context, low enough that their sum and the block
// arithmetic cannot overflow.
const maxRequestTokens = 1 << 40

// Abort removes a request, waiting or running, and releases its blocks;
// a finished HoldKV request's held blocks too. Other unknown or finished
// IDs are ignored.
func (e *Engine) Abort(id string) {
	s, ok := e.byID[id]
	if !ok {
		e.Release(id)
		return
	}
	delete(e.byID, id)
	if i := slices.Index(e.running, s); i >= 0 {
		e.running = slices.Delete(e.running, i, i+1)
		e.freeBlocks(s)
		if e.lora != nil {
			e.lora.stop(s.lora)
		}
		return
	}
	e.waiting.remove(s)
	if s.loading {
		s.loading = false
		e.loads--
	}
	e.freeBlocks(s) // a request loading from a lower tier holds blocks
}

// HasWork reports whether any request is waiting or running.
func (e *Engine) HasWork() bool { return len(e.running) > 0 || e.waiting.len() > 0 }

// Stats returns current gauges and cumulative counters.
func (e *Engine) Stats() Stats {
	st := e.stats
	st.Running = len(e.running)
	st.Waiting = e.waiting.len()
	st.KVUsage = float64(e.pool.used()) / float64(len(e.pool.blocks))
	st.Loading = e.loads
	st.TierBlocks[TierGPU] = len(e.pool.index)
	st.HeldRequests, st.HeldBlocks = len(e.held), e.heldBlocks
	if e.tiers != nil {
		for t := TierHost; t < TierRemote; t++ {
			if tc := e.tiers.local[t]; tc != nil {
				st.TierBlocks[t] = tc.len()
			}
		}
	}
	if e.lora != nil {
		st.LoRALoads = e.lora.loads
		st.RunningLoRAs = e.lora.runningAdapters()
		var waiting map[string]bool
		for _, s := range e.waiting.buf[e.waiting.head:] {
			if s.lora == "" {
				continue
			}
			if !e.lora.admissible(s.lora) {
				st.WaitingDeferred++
			}
			if !waiting[s.lora] {
				if waiting == nil {
					waiting = make(map[string]bool)
				}
				waiting[s.lora] = true
				st.WaitingLoRAs = append(st.WaitingLoRAs, s.lora)
			}
		}
		slices.Sort(st.WaitingLoRAs)
	}
	return st
}

// Step schedules and runs one engine step starting at simulated time now and
// returns its duration and outputs. The scheduler follows vLLM v1
// (vllm/v1/core/sched/scheduler.py, Scheduler.schedule):
//
//  1. Running requests, in admission order, each get min(remaining, budget)
//     tokens: one for a decode, a chunk for an unfinished prefill. If their
//     blocks cannot be allocated, the most recently admitted running request is
//     preempted (blocks freed, back to the head of the waiting queue, to be
//     recomputed) until allocation succeeds or the request preempted itself.
//
//  2. If nothing was preempted, waiting requests are admitted FCFS while the
//     budget lasts and fewer than MaxNumSeqs run: each looks up its longest
//     cached prefix of full blocks (at most prompt-1 tokens), then gets a
//     chunk of the rest. Admission stops at the first request whose blocks
//     cannot be allocated. With LoRA, a request whose adapter would make more
//     than MaxLoras distinct adapters run is skipped — it keeps its place in
//     the queue and later requests may pass it — as vLLM skips it; an adapter
//     that is not loaded adds LoadLatency to the step that admits it.
//
//  3. With KV tiers (tiers.go), loads that have ended are first registered in
//     the GPU prefix cache; a waiting request whose prefix continues in a
//     lower tier takes the blocks to load into and waits, skipped, until its
//     load ends (vLLM WAITING_FOR_REMOTE_KVS); a step that schedules nothing
//     while loads are in flight takes no time, and the driver steps again at
//     NextLoad (or at the next arrival).
//
// A request whose computed tokens reach its length samples one token; one that
// has MaxTokens tokens finishes and releases its blocks.
//
// The engine keeps no clock: now only marks the step's start for the caller's
// bookkeeping; the step's outputs happen at now + Duration.
func (e *Engine) Step(now time.Duration) StepResult {
	e.sched = e.sched[:0]
	e.out = e.out[:0]
	e.transferred = e.transferred[:0]
	if e.kv != nil {
		e.kv.begin()
	}
	if len(e.held) > 0 {
		e.ExpireHeld(now)
	}
	budget, preempted := e.scheduleRunning(e.cfg.MaxNumBatchedTokens)
	e.finishLoads(now)
	loads := 0
	if !preempted {
		loads = e.admitWaiting(budget, now)
	}
	cost := e.run()
	d := e.cfg.Profile.StepTime(cost) + time.Duration(loads)*e.cfg.LoRA.LoadLatency
	e.stats.BusyTime += d
	for _, h := range e.justHeld {
		h.expires = now + d + e.cfg.PD.AbortTimeout
	}
	clear(e.justHeld)
	e.justHeld = e.justHeld[:0]
	return StepResult{Duration: d, Outputs: e.out, Cost: cost, Events: e.kv.take(), LoRALoads: loads, Transferred: e.transferred}
}

// scheduleRunning is Step's phase 1: every running request, in admission
// order, gets min(remaining, budget) tokens, preempting from the tail when
// its blocks cannot be allocated. It returns the budget left and whether it
// preempted.
func (e *Engine) scheduleRunning(budget int) (left int, preempted bool) {
	for i := 0; i < len(e.running) && budget > 0; {
		s := e.running[i]
		n := min(len(s.tokens)-s.computed, budget)
		if n <= 0 {
			i++
			continue
		}
		ok := false
		for {
			if e.allocate(s, n, nil) {
				ok = true
				break
			}
			victim := e.running[len(e.running)-1]
			e.running = e.running[:len(e.running)-1]
			e.preempt(victim)
			preempted = true
			if victim == s {
				break
			}
		}
		if !ok {
			break
		}
		e.sched = append(e.sched, scheduled{s, n})
		budget -= n
		i++
	}
	return budget, preempted
}

// finishLoads registers the loads that ended by now: their blocks join the
// GPU prefix cache before admission (vLLM's scheduler does this first:
// _update_waiting_for_remote_kv for finished_recving_kv_req_ids).
func (e *Engine) finishLoads(now time.Duration) {
	if e.loads == 0 {
		return
	}
	for _, s := range e.waiting.buf[e.waiting.head:] {
		if s.loading && s.loadDone <= now {
			e.loaded(s)
		}
	}
}

// admitWaiting is Step's phase 2: waiting requests are admitted FCFS while
// the budget lasts and fewer than MaxNumSeqs run (Step's comment); a
// request whose prefix continues in a lower tier starts its load instead.
// It returns the adapters it loaded.
func (e *Engine) admitWaiting(budget int, now time.Duration) (loads int) {
	for i := 0; i < e.waiting.len() && budget > 0 && len(e.running) < e.cfg.MaxNumSeqs; {
		s := e.waiting.at(i)
		if e.lora != nil && !e.lora.admissible(s.lora) {
			i++ // deferred: would exceed max_loras (vLLM skips it, keeping its place)
			continue
		}
		if s.loading {
			i++ // its blocks are still being loaded (vLLM skips it, keeping its place)
			continue
		}
		var hit []int32
		computed := s.computed // loaded earlier, the rest did not fit then; else 0
		if len(s.blocks) == 0 {
			hit = e.findCached(s)
			if s.remote {
				if !e.startTransfer(s, hit, now) {
					if e.unblock() {
						continue
					}
					break
				}
				i++ // it waits for its read, as for a load
				continue
			}
			if lower, ok := e.lowerHits(s, len(hit)); ok {
				if !e.startLoad(s, hit, lower, now) {
					if e.unblock() {
						continue
					}
					break // no free blocks to load into: admission stops, as for an allocation
				}
				i++ // it waits for its load, not running, using no budget
				continue
			}
			computed = len(hit) * e.cfg.BlockSize
		}
		n := min(len(s.tokens)-computed, budget)
		if !e.allocate(s, n, hit) {
			if e.unblock() {
				continue // the same request, with the blocks given back
			}
			break
		}
		if e.tiers != nil && len(hit) > 0 {
			e.tiers.hit(s, len(hit), e.cfg.BlockSize)
		}
		e.waiting.removeAt(i)
		e.running = append(e.running, s)
		if e.lora != nil && e.lora.start(s.lora) {
			loads++
		}
		s.computed = computed
		if !s.admitted {
			s.admitted = true
			s.scheduledAt = now
			if s.cached < 0 {
				e.firstLookup(s, computed, [NumTiers]int{TierGPU: computed / e.cfg.BlockSize})
			}
		}
		e.sched = append(e.sched, scheduled{s, n})
		budget -= n
	}
	return loads
}

// run computes the scheduled tokens: a request whose computed tokens reach
// its length samples one token, one with MaxTokens tokens finishes and
// releases its blocks. It returns the step's cost.
func (e *Engine) run() StepCost {
	var cost StepCost
	for _, sc := range e.sched {
		cost.Add(sc.n, sc.s.computed)
		if !(sc.n == 1 && sc.s.output() > 0 && sc.s.computed == len(sc.s.tokens)-1) {
			e.stats.PrefillTokens += int64(sc.n)
		}
	}
	finished := false
	for _, sc := range e.sched {
		s := sc.s
		s.computed += sc.n
		if s.computed < len(s.tokens) {
			continue // partial prefill chunk: the sampled token is discarded
		}
		if e.emit(s) {
			finished = true
		}
	}
	if finished {
		e.running = slices.DeleteFunc(e.running, func(s *seq) bool { return s.computed < 0 })
	}
	return cost
}

// emit samples s's next token and records its output; it reports whether s
// finished (its blocks released, marked by computed −1 for run's compaction).
func (e *Engine) emit(s *seq) bool {
	tok := e.sample(s)
	s.tokens = append(s.tokens, tok)
	out := s.output()
	if out == 1 {
		e.stats.PromptTokens += int64(s.promptLen)
		e.stats.Prompts++
		e.stats.CachedPromptTokens += int64(max(s.cached, 0))
		for t, n := range s.tierTokens {
			e.stats.TierHits[t] += int64(n)
		}
	}
	e.stats.GenerationTokens++
	done := out >= s.maxTokens
	e.out = append(e.out, Output{
		ID:           s.id,
		NewTokens:    1,
		Token:        tok,
		FirstToken:   out == 1,
		Finished:     done,
		PromptTokens: s.promptLen,
		CachedTokens: max(s.cached, 0),
		TierTokens:   s.tierTokens,
		OutputTokens: out,
		Scheduled:    s.scheduledAt,

		TransferredTokens: s.transferred,
	})
	if done {
		if s.holdKV {
			e.hold(s)
		} else {
			e.freeBlocks(s)
		}
		if e.lora != nil {
			e.lora.stop(s.lora)
		}
		delete(e.byID, s.id)
		s.computed = -1
	}
	return done
}

// findCached returns the blocks of the longest cached prefix of s, capped so
// that at least one token is computed (vLLM get_computed_blocks uses
// max_cache_hit_length = num_tokens - 1). The slice is scratch space.
func (e *Engine) findCached(s *seq) []int32 {
	e.hit = e.hit[:0]
	if s.computed > 0 || len(s.blocks) > 0 {
		return e.hit
	}
	e.ensureHashes(s, len(s.tokens))
	maxBlocks := (len(s.tokens) - 1) / e.cfg.BlockSize
	for _, h := range s.hashes[:min(maxBlocks, len(s.hashes))] {
		id := e.pool.lookup(h)
		if id == noBlock {
			break
		}
		e.hit = append(e.hit, id)
	}
	return e.hit
}

// allocate gives s the blocks to hold n more tokens beyond its computed ones,
// after taking the prefix-cache hit blocks (when admitting), and registers
// the blocks that become full in the prefix cache (vLLM
// KVCacheManager.allocate_slots). It reports false, changing nothing, when the
// free queue is too short.
func (e *Engine) allocate(s *seq, n int, hit []int32) bool {
	bs := e.cfg.BlockSize
	computed := s.computed + len(hit)*bs // hit is only given at admission, when s.computed is 0
	need := (computed+n+bs-1)/bs - len(s.blocks) - len(hit)
	evictable := 0 // hit blocks now in the free queue also consume free blocks
	for _, id := range hit {
		if e.pool.blocks[id].ref == 0 {
			evictable++
		}
	}
	if max(need, 0)+evictable > e.pool.numFree {
		return false
	}
	if len(hit) > 0 {
		e.pool.touch(hit)
		s.blocks = append(s.blocks, hit...)
		s.numCachedBl = len(hit)
	}
	if need > 0 {
		s.blocks = e.pool.allocate(s.blocks, need)
	}
	full := min(computed+n, len(s.tokens)) / bs
	if full > s.numCachedBl {
		e.cacheBlocks(s, full)
	}
	return true
}

// cacheBlocks registers blocks [s.numCachedBl, full) of s in the GPU prefix
// cache, records their BlockStored and writes them through to the lower
// tiers.
func (e *Engine) cacheBlocks(s *seq, full int) {
	bs := e.cfg.BlockSize
	e.ensureHashes(s, full*bs)
	for i := s.numCachedBl; i < full; i++ {
		e.pool.register(s.blocks[i], s.hashes[i])
	}
	if e.kv != nil {
		e.kv.stored(s, s.numCachedBl, full, bs)
	}
	if e.tiers != nil {
		e.tiers.store(s, s.numCachedBl, full, bs)
	}
	s.numCachedBl = full
}

// lowerHits returns how many blocks of s, after its first gpu blocks (its
// GPU prefix hit), each lower tier would supply, block by block as
// tiers.find picks them, up to the first block no tier holds and at most
// prompt−1 tokens in all; ok is false when there is none.
func (e *Engine) lowerHits(s *seq, gpu int) (n [NumTiers]int, ok bool) {
	if e.tiers == nil {
		return n, false
	}
	maxBlocks := min((len(s.tokens)-1)/e.cfg.BlockSize, len(s.hashes))
	for _, h := range s.hashes[gpu:max(gpu, maxBlocks)] {
		t := e.tiers.find(h)
		if t == TierGPU {
			break
		}
		n[t]++
		ok = true
	}
	return n, ok
}

// startLoad admits s to load lower[t] blocks from each lower tier after
// its GPU hit blocks at now: it takes the hit blocks and allocates the
// loaded ones, queues the transfers, and leaves s waiting until loadDone
// (vLLM: allocate_slots with the external tokens, then
// WAITING_FOR_REMOTE_KVS). It reports false, changing nothing, when the free
// queue is too short.
func (e *Engine) startLoad(s *seq, hit []int32, lower [NumTiers]int, now time.Duration) bool {
	n := 0
	for _, k := range lower {
		n += k
	}
	if !e.takeForLoad(s, hit, n) {
		return false
	}
	s.loadDone = e.tiers.load(now, lower)
	e.stats.LoadedBlocks += int64(n)
	e.tiers.hit(s, len(hit), e.cfg.BlockSize)
	if s.cached < 0 {
		blocks := lower
		blocks[TierGPU] = len(hit)
		e.firstLookup(s, s.loadBlocks*e.cfg.BlockSize, blocks)
	}
	return true
}

// takeForLoad gives s, waiting, its GPU hit blocks and n more to load
// into, and marks it loading (the caller sets loadDone). It reports false,
// changing nothing, when the free queue is too short: hit blocks in the
// free queue consume free blocks too.
func (e *Engine) takeForLoad(s *seq, hit []int32, n int) bool {
	evictable := 0
	for _, id := range hit {
		if e.pool.blocks[id].ref == 0 {
			evictable++
		}
	}
	if n+evictable > e.pool.numFree {
		return false
	}
	e.pool.touch(hit)
	s.blocks = append(s.blocks, hit...)
	s.numCachedBl = len(hit)
	s.blocks = e.pool.allocate(s.blocks, n)
	s.loadBlocks = len(hit) + n
	s.loading = true
	e.loads++
	return true
}

// unblock is called when a waiting request cannot get its blocks: if no
// request runs — so none will free any — the waiting requests holding
// loaded blocks give them back (cached on the GPU now, their next lookup
// hits them there) rather than hold them for ever against the head of the
// queue. It reports whether it freed any. Requests still loading keep
// theirs; their loads end (NextLoad) and unblock runs again.
func (e *Engine) unblock() bool {
	if len(e.running) > 0 {
		return false
	}
	freed := false
	for _, s := range e.waiting.buf[e.waiting.head:] {
		if !s.loading && len(s.blocks) > 0 {
			e.freeBlocks(s)
			s.computed = 0
			freed = true
		}
	}
	return freed
}

// loaded ends the load of s: its loaded blocks join the GPU prefix cache
// (vLLM _update_waiting_for_remote_kv → cache_blocks: BlockStored on the
// GPU) and count as computed.
func (e *Engine) loaded(s *seq) {
	s.loading = false
	e.loads--
	bs := e.cfg.BlockSize
	// A read from a prefill engine covers the partial last block too: only
	// full blocks are cached, and the last prompt token is recomputed to
	// sample the first output (pd.go). A tier load stops at prompt − 1.
	if full := min(s.loadBlocks, len(s.tokens)/bs); full > s.numCachedBl {
		e.cacheBlocks(s, full)
	}
	s.computed = min(s.loadBlocks*bs, len(s.tokens)-1)
	if s.remote {
		s.remote = false // preempted later, it recomputes
		e.transferred = append(e.transferred, s.id)
	}
}

// firstLookup records the prefix-cache hit of s at its first admission:
// cached tokens in all, blocks[t] from each tier.
func (e *Engine) firstLookup(s *seq, cached int, blocks [NumTiers]int) {
	bs := e.cfg.BlockSize
	s.cached = cached
	for t, n := range blocks {
		s.tierTokens[t] = n * bs
	}
	e.stats.PrefixQueries += int64(len(s.tokens))
	e.stats.PrefixHits += int64(s.tierTokens[TierGPU])
	if e.tiers != nil {
		e.stats.ExternalQueries += int64(len(s.tokens))
		e.stats.ExternalHits += int64(cached - s.tierTokens[TierGPU])
	}
}

// NextLoad returns when the earliest lower-tier load in progress completes
// (ok false when none is): a driver whose Step scheduled nothing while
// loads are pending steps again then.
func (e *Engine) NextLoad() (at time.Duration, ok bool) {
	if e.loads == 0 {
		return 0, false
	}
	at = time.Duration(math.MaxInt64)
	for _, s := range e.waiting.buf[e.waiting.head:] {
		if s.loading {
			at = min(at, s.loadDone)
		}
	}
	return at, true
}

// ensureHashes extends s.hashes to cover the full blocks of s.tokens[:upTo].
func (e *Engine) ensureHashes(s *seq, upTo int) {
	bs := e.cfg.BlockSize
	have := len(s.hashes)
	if (have+1)*bs > upTo {
		return
	}
	parent := s.root
	if have > 0 {
		parent = s.hashes[have-1]
	}
	s.hashes = prefix.Hashes(s.hashes, s.tokens[have*bs:upTo], bs, parent)
}

// promptSeed derives the seed of the output stream of s from its whole prompt
// (the last full block's chained hash and the partial tail), its Extra and
// adapter, and the engine seed, so identical requests get identical outputs,
// like greedy decoding.
func (e *Engine) promptSeed(s *seq) uint64 {
	parent := s.root
	if n := len(s.hashes); n > 0 {
		parent = s.hashes[n-1]
	}
	var buf [8 + 4*DefaultBlockSize]byte
	var d xxhash.Digest
	d.ResetWithSeed(e.cfg.Seed)
	binary.LittleEndian.PutUint64(buf[:8], parent)
	_, _ = d.Write(buf[:8])
	tail := s.tokens[len(s.hashes)*e.cfg.BlockSize:]
	for len(tail) > 0 {
		n := min(len(tail), DefaultBlockSize)
		for i, t := range tail[:n] {
			binary.LittleEndian.PutUint32(buf[4*i:], t)
		}
		_, _ = d.Write(buf[:4*n])
		tail = tail[n:]
	}
	return d.Sum64()
}

// preempt frees the blocks of a running request (already removed from
// e.running) and puts it back at the head of the waiting queue, to recompute
// its prompt and generated tokens (vLLM recompute preemption).
func (e *Engine) preempt(s *seq) {
	e.freeBlocks(s)
	if e.lora != nil {
		e.lora.stop(s.lora)
	}
	s.computed = 0
	e.stats.Preemptions++
	e.waiting.pushFront(s)
}

// freeBlocks releases the blocks of s in reverse order, so that its tail
// blocks are evicted before its prefix (vLLM SingleTypeKVCacheManager.free).
func (e *Engine) freeBlocks(s *seq) {
	slices.Reverse(s.blocks)
	e.pool.release(s.blocks)
	s.blocks = s.blocks[:0]
	s.numCachedBl = 0
}

// sample returns the next output token of s: a deterministic function of the
// prompt, Extra, the seed and the position.
func (e *Engine) sample(s *seq) uint32 {
	x := s.seed + uint64(s.output()+1)*0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	x ^= x >> 31
	v := e.cfg.OutputVocab
	if s.output() == 0 && len(e.cfg.FirstOutputVocab) > 0 {
		v = e.cfg.FirstOutputVocab
	}
	return v[x%uint64(len(v))]
}

// queue is a FIFO of requests that also supports pushing to the front, with
// amortised O(1) operations at both ends.
type queue struct {
	buf  []*seq
	head int
}

func (q *queue) len() int        { return len(q.buf) - q.head }
func (q *queue) at(i int) *seq   { return q.buf[q.head+i] }
func (q *queue) pushBack(s *seq) { q.buf = append(q.buf, s) }

// removeAt removes the i-th request from the front; O(1) for the front,
// O(n) otherwise (only when LoRA made the scheduler skip requests).
func (q *queue) removeAt(i int) {
	if i == 0 {
		q.popFront()
		return
	}
	q.buf = slices.Delete(q.buf, q.head+i, q.head+i+1)
}

func (q *queue) popFront() {
	q.buf[q.head] = nil
	q.head++
	if q.head == len(q.buf) {
		q.buf, q.head = q.buf[:0], 0
	} else if q.head >= 1024 && q.head*2 >= len(q.buf) {
		n := copy(q.buf, q.buf[q.head:])
		clear(q.buf[n:])
		q.buf, q.head = q.buf[:n], 0
	}
}

func (q *queue) pushFront(s *seq) {
	if q.head > 0 {
		q.head--
		q.buf[q.head] = s
		return
	}
	q.buf = slices.Insert(q.buf, 0, s)
}

func (q *queue) remove(s *seq) {
	if i := slices.Index(q.buf[q.head:], s); i >= 0 {
		q.buf = slices.Delete(q.buf, q.head+i, q.head+i+1)
	}
}
