package sim

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"math"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// KV-cache events, as vLLM publishes them (docs/PROTOCOLS.md §1).
//
// The pure core (Engine, blockPool) records the events a vLLM block pool would
// queue — vllm/v1/core/block_pool.py: cache_full_blocks → BlockStored,
// _maybe_evict_cached_block → BlockRemoved, reset_prefix_cache →
// AllBlocksCleared — and hands them out per step (StepResult.Events).
// AppendKVEventBatch encodes them as vLLM's msgspec structs
// (vllm/distributed/kv_events.py) and KVEventPublisher publishes them over
// ZeroMQ like vLLM's ZmqEventPublisher. See README.md "KV events".

// KVEventType is the tag of a KV-cache event: the msgspec class name vLLM
// puts on the wire (vllm/distributed/kv_events.py, tag=True).
type KVEventType uint8

// KV-cache event types.
const (
	// KVBlockStored: full blocks got their hash registered in the prefix cache.
	KVBlockStored KVEventType = iota + 1
	// KVBlockRemoved: a cached block's hash was evicted (the block was reused).
	KVBlockRemoved
	// KVAllBlocksCleared: the whole prefix cache was reset.
	KVAllBlocksCleared
	// KVTierBlocksCleared: the prefix cache of one tier (Medium, "GPU" for
	// the simulator) was reset. Published in place of AllBlocksCleared with
	// KVEventsConfig.TierScopedClearEvents, as vLLM does.
	KVTierBlocksCleared
)

// String returns the vLLM class name: "BlockStored", "BlockRemoved" or "AllBlocksCleared".
func (t KVEventType) String() string {
	switch t {
	case KVBlockStored:
		return "BlockStored"
	case KVBlockRemoved:
		return "BlockRemoved"
	case KVAllBlocksCleared:
		return "AllBlocksCleared"
	case KVTierBlocksCleared:
		return "TierBlocksCleared"
	}
	return "KVEventType(?)"
}

// Constant fields of the simulator's events. The simulator models one
// full-attention KV-cache group on the GPU.
const (
	// KVMediumGPU is BlockStored/BlockRemoved.medium (vLLM MEDIUM_GPU).
	KVMediumGPU = "GPU"
	// KVCacheSpecFullAttention is BlockStored.kv_cache_spec_kind.
	KVCacheSpecFullAttention = "full_attention"
)

// KVEvent is one KV-cache event of the simulated block pool. The medium
// ("GPU"), group index (0) and KV-cache spec kind ("full_attention") are
// constants of the simulator and not stored.
type KVEvent struct {
	Type KVEventType
	// BlockHashes are the chained prefix-cache hashes of the stored blocks, in
	// sequence order (BlockStored), or the one evicted hash (BlockRemoved; vLLM
	// emits one event per evicted block). They are the engine's own 64-bit
	// hashes (see README "KV cache"), published as unsigned integers like vLLM
	// with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1.
	BlockHashes []uint64
	// ParentBlockHash is the hash of the block preceding the first stored
	// block; valid when HasParent. HasParent is false when the first stored
	// block is the first block of its sequence (vLLM parent_block_hash=None).
	ParentBlockHash uint64
	HasParent       bool
	// TokenIDs are the tokens of all stored blocks, concatenated:
	// len(TokenIDs) == len(BlockHashes) × BlockSize (BlockStored only).
	TokenIDs []uint32
	// BlockSize is the block size in tokens (BlockStored only).
	BlockSize int
	// LoRAName and LoRAID identify the adapter of the request that stored
	// the blocks ("" and 0 for the base model; BlockStored only). They are
	// published as lora_name and lora_id (null for the base model), and the
	// name as every block's extra_keys entry [lora_name], as vLLM does
	// (vllm/v1/core/block_pool.py cache_full_blocks).
	LoRAName string
	LoRAID   int
}

// kvEventLog records the events of one step (and of ResetPrefixCache calls
// made since the previous step). Events point into the hashes and tokens
// arenas, which are reused once the events have been taken.
type kvEventLog struct {
	events []KVEvent
	hashes []uint64
	tokens []uint32
	taken  bool // events were handed out; the next begin recycles the buffers
}

// begin starts recording: it recycles the buffers if their events were taken.
func (l *kvEventLog) begin() {
	if l.taken {
		l.events = l.events[:0]
		l.hashes = l.hashes[:0]
		l.tokens = l.tokens[:0]
		l.taken = false
	}
}

// take hands out the events recorded since the last take (nil when none or
// when l is nil, i.e. KV events are disabled).
func (l *kvEventLog) take() []KVEvent {
	if l == nil || l.taken {
		return nil
	}
	l.taken = true
	if len(l.events) == 0 {
		return nil
	}
	return l.events
}

// stored records a BlockStored for blocks [from, to) of s, whose hashes were
// just registered (vLLM BlockPool.cache_full_blocks emits one event per call,
// i.e. per request and step).
func (l *kvEventLog) stored(s *seq, from, to, blockSize int) {
	h0, t0 := len(l.hashes), len(l.tokens)
	l.hashes = append(l.hashes, s.hashes[from:to]...)
	l.tokens = append(l.tokens, s.tokens[from*blockSize:to*blockSize]...)
	ev := KVEvent{
		Type:        KVBlockStored,
		BlockHashes: l.hashes[h0:len(l.hashes):len(l.hashes)],
		TokenIDs:    l.tokens[t0:len(l.tokens):len(l.tokens)],
		BlockSize:   blockSize,
		LoRAName:    s.lora,
		LoRAID:      s.loraID,
	}
	if from > 0 {
		ev.ParentBlockHash, ev.HasParent = s.hashes[from-1], true
	}
	l.events = append(l.events, ev)
}

// removed records a BlockRemoved for one evicted hash (vLLM
// BlockPool._maybe_evict_cached_block).
func (l *kvEventLog) removed(h uint64) {
	h0 := len(l.hashes)
	l.hashes = append(l.hashes, h)
	l.events = append(l.events, KVEvent{Type: KVBlockRemoved, BlockHashes: l.hashes[h0:len(l.hashes):len(l.hashes)]})
}

// cleared records an AllBlocksCleared.
func (l *kvEventLog) cleared() { l.events = append(l.events, KVEvent{Type: KVAllBlocksCleared}) }

// TakeKVEvents returns the KV events recorded since the previous Step or
// TakeKVEvents — in practice those of ResetPrefixCache calls made while the
// engine is idle — and nil when there are none or Config.KVEvents is off.
// Like StepResult.Events, the slice is owned by the engine and valid until
// the next call to Step, ResetPrefixCache or TakeKVEvents.
func (e *Engine) TakeKVEvents() []KVEvent { return e.kv.take() }

// ResetPrefixCache drops the hash of every cached block so that no later
// request hits them, and records an AllBlocksCleared event. Like vLLM's
// BlockPool.reset_prefix_cache (vllm/v1/core/block_pool.py) it only succeeds
// when no block is held by a request — every cached block is then an
// unreferenced one in the free queue — and otherwise changes nothing and
// returns false. The free queue keeps its order. Running or waiting requests
// do not make it fail by themselves: only blocks they hold do.
func (e *Engine) ResetPrefixCache() bool {
	if e.pool.used() > 0 {
		return false
	}
	e.pool.clearHashes()
	if e.kv != nil {
		e.kv.begin()
		e.kv.cleared()
	}
	return true
}

// clearHashes uncaches every block without touching the free queue or
// recording BlockRemoved events.
func (p *blockPool) clearHashes() {
	for i := range p.blocks {
		b := &p.blocks[i]
		b.cached = false
		b.dupPrev, b.dupNext = noBlock, noBlock
	}
	clear(p.index)
}

// cachedHashes returns the multiset of hashes currently registered in the
// prefix cache (hash → number of blocks holding it; vLLM does not
// de-duplicate identical blocks computed concurrently, and neither do its
// events). Tests compare it with what a subscriber rebuilt from the events.
func (e *Engine) cachedHashes() map[uint64]int {
	m := make(map[uint64]int)
	for i := range e.pool.blocks {
		if b := &e.pool.blocks[i]; b.cached {
			m[b.hash]++
		}
	}
	return m
}

// ---------------------------------------------------------------------------
// Wire encoding (vllm/distributed/kv_events.py, msgspec → msgpack)

// Encodings of KVEventsConfig.Encoding.
const (
	// KVEncodingArray is vLLM before PR #42892: every event is a msgpack array
	// ["BlockStored", f1, f2, ...] (msgspec array_like=True), trailing fields
	// equal to their declared default omitted.
	KVEncodingArray = "array"
	// KVEncodingMap is vLLM after PR #42892 (merged 2026-06-09): every event
	// is a msgpack map with the tag under "type" and fields by name, fields
	// equal to their declared default omitted (msgspec omit_defaults). The
	// outer batch stays an array.
	KVEncodingMap = "map"
)

// AppendKVEventBatch appends the msgpack encoding of one vLLM KVEventBatch to
// dst: the array [ts, [events...], dataParallelRank] (EventBatch fields ts,
// events, data_parallel_rank; the publisher always fills the rank). ts is in
// seconds (vLLM: time.time() when the batch is built). encoding is
// KVEncodingArray or KVEncodingMap ("" means map).
//
// Events carry the fields of the newest vLLM declaration, in its order:
//
//	BlockStored      block_hashes, parent_block_hash, token_ids, block_size,
//	                 lora_id (adapter id or null), medium ("GPU"),
//	                 lora_name (adapter name or null), extra_keys (one
//	                 entry per block: [lora_name] for an adapter, else
//	                 null), group_idx (0),
//	                 kv_cache_spec_kind ("full_attention"),
//	                 kv_cache_spec_sliding_window (null: the default, omitted)
//	BlockRemoved     block_hashes, medium ("GPU"), group_idx (null: omitted)
//	AllBlocksCleared (no fields)
//	TierBlocksCleared medium ("GPU"); ownership (null: the default, omitted)
//
// Fields without a default (up to lora_name, and BlockRemoved.medium) are
// always written, null included. Integers use the shortest msgpack form, as
// msgspec does; hashes above 2^63-1 are msgpack uint64.
func AppendKVEventBatch(dst []byte, ts float64, events []KVEvent, dataParallelRank int, encoding string) []byte {
	asMap := encoding != KVEncodingArray
	dst = mpArray(dst, 3)
	dst = mpFloat64(dst, ts)
	dst = mpArray(dst, len(events))
	for i := range events {
		dst = appendKVEvent(dst, &events[i], asMap)
	}
	return mpInt(dst, int64(dataParallelRank))
}

func appendKVEvent(dst []byte, ev *KVEvent, asMap bool) []byte {
	// field appends a field: its name first in map form.
	field := func(dst []byte, name string) []byte {
		if asMap {
			dst = mpStr(dst, name)
		}
		return dst
	}
	n := 1 // the tag
	switch ev.Type {
	case KVBlockStored:
		n = 11
	case KVBlockRemoved:
		n = 3
	case KVTierBlocksCleared:
		n = 2
	}
	if asMap {
		dst = mpMap(dst, n)
		dst = mpStr(dst, "type")
	} else {
		dst = mpArray(dst, n)
	}
	dst = mpStr(dst, ev.Type.String())
	switch ev.Type {
	case KVBlockStored:
		dst = field(dst, "block_hashes")
		dst = mpUints(dst, ev.BlockHashes)
		dst = field(dst, "parent_block_hash")
		if ev.HasParent {
			dst = mpUint(dst, ev.ParentBlockHash)
		} else {
			dst = mpNil(dst)
		}
		dst = field(dst, "token_ids")
		dst = mpArray(dst, len(ev.TokenIDs))
		for _, t := range ev.TokenIDs {
			dst = mpUint(dst, uint64(t))
		}
		dst = field(dst, "block_size")
		dst = mpInt(dst, int64(ev.BlockSize))
		dst = field(dst, "lora_id")
		if ev.LoRAName != "" {
			dst = mpInt(dst, int64(ev.LoRAID))
		} else {
			dst = mpNil(dst)
		}
		dst = field(dst, "medium")
		dst = mpStr(dst, KVMediumGPU)
		dst = field(dst, "lora_name")
		if ev.LoRAName != "" {
			dst = mpStr(dst, ev.LoRAName)
		} else {
			dst = mpNil(dst)
		}
		// One entry per block: the block's extra hash keys, [lora_name] for an
		// adapter (the cache salt is folded into the root hash instead), else null.
		dst = field(dst, "extra_keys")
		dst = mpArray(dst, len(ev.BlockHashes))
		for range ev.BlockHashes {
			if ev.LoRAName != "" {
				dst = mpArray(dst, 1)
				dst = mpStr(dst, ev.LoRAName)
			} else {
				dst = mpNil(dst)
			}
		}
		dst = field(dst, "group_idx")
		dst = mpInt(dst, 0)
		dst = field(dst, "kv_cache_spec_kind")
		dst = mpStr(dst, KVCacheSpecFullAttention)
	case KVBlockRemoved:
		dst = field(dst, "block_hashes")
		dst = mpUints(dst, ev.BlockHashes)
		dst = field(dst, "medium")
		dst = mpStr(dst, KVMediumGPU)
	case KVTierBlocksCleared:
		dst = field(dst, "medium")
		dst = mpStr(dst, KVMediumGPU)
	}
	return dst
}

// Minimal msgpack writers (https://github.com/msgpack/msgpack/blob/master/spec.md),
// shortest forms like msgspec.

func mpNil(b []byte) []byte { return append(b, 0xc0) }

func mpArray(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= 0xffff:
		return append(b, 0xdc, byte(n>>8), byte(n))
	}
	return append(b, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
}

func mpMap(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x80|byte(n))
	case n <= 0xffff:
		return append(b, 0xde, byte(n>>8), byte(n))
	}
	return append(b, 0xdf, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
}

func mpStr(b []byte, s string) []byte {
	n := len(s)
	switch {
	case n < 32:
		b = append(b, 0xa0|byte(n))
	case n <= 0xff:
		b = append(b, 0xd9, byte(n))
	case n <= 0xffff:
		b = append(b, 0xda, byte(n>>8), byte(n))
	default:
		b = append(b, 0xdb, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, s...)
}

func mpUint(b []byte, v uint64) []byte {
	switch {
	case v < 128:
		return append(b, byte(v))
	case v <= 0xff:
		return append(b, 0xcc, byte(v))
	case v <= 0xffff:
		return append(b, 0xcd, byte(v>>8), byte(v))
	case v <= 0xffffffff:
		return append(b, 0xce, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

func mpInt(b []byte, v int64) []byte {
	if v >= 0 {
		return mpUint(b, uint64(v))
	}
	switch {
	case v >= -32:
		return append(b, byte(v))
	case v >= math.MinInt8:
		return append(b, 0xd0, byte(v))
	case v >= math.MinInt16:
		return append(b, 0xd1, byte(v>>8), byte(v))
	case v >= math.MinInt32:
		return append(b, 0xd2, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(v))
}

func mpUints(b []byte, vs []uint64) []byte {
	b = mpArray(b, len(vs))
	for _, v := range vs {
		b = mpUint(b, v)
	}
	return b
}

func mpFloat64(b []byte, f float64) []byte {
	return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(f))
}

// ---------------------------------------------------------------------------
// Publisher (vllm/distributed/kv_events.py ZmqEventPublisher)

// Defaults of KVEventsConfig, those of vLLM's KVEventsConfig
// (vllm/config/kv_events.py).
const (
	DefaultKVEventsEndpoint = "tcp://*:5557"
	DefaultKVBufferSteps    = 10000
	DefaultKVHWM            = 100000
	DefaultKVMaxQueueSize   = 100000
)

// KVEventsConfig configures the KV-event publisher of a Server. It mirrors
// vLLM's --kv-events-config JSON, every field of KVEventsConfig in
// vllm/config/kv_events.py (newest read: with tier_scoped_clear_events),
// plus Encoding and Bind. Zero fields take defaults.
type KVEventsConfig struct {
	// Enable turns KV-cache events on (vLLM enable_kv_cache_events).
	Enable bool `yaml:"enable_kv_cache_events" json:"enable_kv_cache_events"`
	// Publisher is vLLM's publisher kind: "zmq", or "null" (events are
	// recorded but published nowhere). "" is vLLM's default: "zmq" when
	// Enable is set, else "null". Events are published when Publishes().
	Publisher string `yaml:"publisher" json:"publisher"`
	// Endpoint is the PUB socket address (default "tcp://*:5557"). Like vLLM,
	// the socket binds when the address contains "*" or "::" or starts with
	// ipc:// or inproc://, and connects otherwise (a router that binds a SUB
	// socket; reconnects automatically).
	Endpoint string `yaml:"endpoint" json:"endpoint"`
	// ReplayEndpoint, when set, is the address a ROUTER socket binds to
	// answer replay requests (docs/PROTOCOLS.md §1.3).
	ReplayEndpoint string `yaml:"replay_endpoint" json:"replay_endpoint"`
	// BufferSteps is the number of past batches kept for replay (default 10000).
	BufferSteps int `yaml:"buffer_steps" json:"buffer_steps"`
	// HWM is the send high-water mark of the PUB socket, in messages
	// (default 100000): messages beyond it are dropped by the socket.
	HWM int `yaml:"hwm" json:"hwm"`
	// MaxQueueSize bounds the in-process queue of batches waiting for the
	// publishing goroutine (default 100000). When it is full the batch is
	// dropped and counted, and its sequence number is skipped so that
	// subscribers see the gap: the engine never waits for the publisher.
	// (vLLM blocks its engine instead.)
	MaxQueueSize int `yaml:"max_queue_size" json:"max_queue_size"`
	// Topic is the first frame of every message (default ""); llm-d uses
	// "kv@<pod>@<model>".
	Topic string `yaml:"topic" json:"topic"`
	// TierScopedClearEvents publishes a prefix-cache reset as
	// TierBlocksCleared(medium="GPU"), in a batch of its own, instead of
	// AllBlocksCleared (vLLM tier_scoped_clear_events: the reset cleared
	// only the GPU block pool; the simulator has no other tier, and vLLM
	// with no KV connector attached publishes the same). Subscribers must
	// decode the tag (fleet does).
	TierScopedClearEvents bool `yaml:"tier_scoped_clear_events" json:"tier_scoped_clear_events"`
	// Encoding is the event encoding: "map" (default; vLLM after PR #42892)
	// or "array" (before). Not a vLLM option.
	Encoding string `yaml:"encoding" json:"encoding"`
	// Bind makes the PUB socket bind Endpoint whatever vLLM's heuristic says
	// (so that "tcp://127.0.0.1:0" listens on loopback only, as the embedded
	// fleet of `infergate up` needs). Not a vLLM option.
	Bind bool `yaml:"bind" json:"bind"`
}

// Publishes reports whether events are published: Enable, and Publisher
// "zmq" or unset (vLLM's EventPublisherFactory: a "null" publisher, or
// events off, publishes nothing).
func (c KVEventsConfig) Publishes() bool { return c.Enable && c.Publisher != KVPublisherNull }

// Publisher kinds of KVEventsConfig.Publisher (vLLM's Literal["null", "zmq"]).
const (
	KVPublisherZMQ  = "zmq"
	KVPublisherNull = "null"
)

// WithDefaults returns c with zero fields replaced by their defaults.
func (c KVEventsConfig) WithDefaults() KVEventsConfig {
	if c.Publisher == "" {
		c.Publisher = KVPublisherNull
		if c.Enable {
			c.Publisher = KVPublisherZMQ
		}
	}
	if c.Endpoint == "" {
		c.Endpoint = DefaultKVEventsEndpoint
	}
	if c.BufferSteps == 0 {
		c.BufferSteps = DefaultKVBufferSteps
	}
	if c.HWM == 0 {
		c.HWM = DefaultKVHWM
	}
	if c.MaxQueueSize == 0 {
		c.MaxQueueSize = DefaultKVMaxQueueSize
	}
	if c.Encoding == "" {
		c.Encoding = KVEncodingMap
	}
	return c
}

// Validate reports whether c (after defaults) is usable.
func (c KVEventsConfig) Validate() error {
	c = c.WithDefaults()
	var errs []error
	checkEP := func(name, ep string) {
		scheme, addr, ok := strings.Cut(ep, "://")
		switch {
		case !ok || addr == "":
			errs = append(errs, fmt.Errorf("kv events %s %q: want tcp://host:port, ipc://path or inproc://name", name, ep))
		case scheme != "tcp" && scheme != "ipc" && scheme != "inproc":
			errs = append(errs, fmt.Errorf("kv events %s %q: unsupported transport %q", name, ep, scheme))
		}
	}
	if c.Publisher != KVPublisherZMQ && c.Publisher != KVPublisherNull {
		errs = append(errs, fmt.Errorf("kv events publisher must be %q or %q, got %q", KVPublisherZMQ, KVPublisherNull, c.Publisher))
	}
	checkEP("endpoint", c.Endpoint)
	if c.ReplayEndpoint != "" {
		checkEP("replay_endpoint", c.ReplayEndpoint)
	}
	if c.BufferSteps < 1 {
		errs = append(errs, fmt.Errorf("kv events buffer_steps must be >= 1, got %d", c.BufferSteps))
	}
	if c.HWM < 0 {
		errs = append(errs, fmt.Errorf("kv events hwm must be >= 0, got %d", c.HWM))
	}
	if c.MaxQueueSize < 1 {
		errs = append(errs, fmt.Errorf("kv events max_queue_size must be >= 1, got %d", c.MaxQueueSize))
	}
	if c.Encoding != KVEncodingArray && c.Encoding != KVEncodingMap {
		errs = append(errs, fmt.Errorf("kv events encoding must be %q or %q, got %q", KVEncodingArray, KVEncodingMap, c.Encoding))
	}
	return errors.Join(errs...)
}

// kvBindsEndpoint is vLLM's bind-or-connect heuristic for the PUB socket.
func kvBindsEndpoint(ep string) bool {
	return strings.Contains(ep, "*") || strings.Contains(ep, "::") ||
		strings.HasPrefix(ep, "ipc://") || strings.HasPrefix(ep, "inproc://")
}

// KVReplayEndSeq is the sequence number of the replay end marker: -1 as an
// 8-byte signed big-endian integer.
const KVReplayEndSeq = ^uint64(0)

// kvMsg is one encoded batch and its sequence number.
type kvMsg struct {
	seq     uint64
	payload []byte
}

// KVEventPublisherStats are cumulative publisher counters, in batches.
type KVEventPublisherStats struct {
	// Published batches were handed to the PUB socket (which may still drop
	// them at its high-water mark or when no subscriber is connected).
	Published uint64
	// Dropped batches found the queue full, or the publisher closed.
	Dropped uint64
}

// KVEventPublisher publishes KV-event batches like vLLM's ZmqEventPublisher:
// a PUB socket sends every batch as the 3-frame message [topic, seq (8-byte
// big-endian, from 0, +1 per batch), msgpack payload]; an optional ROUTER
// socket replays buffered batches. Publish encodes the batch in the caller
// and queues it without blocking; one goroutine sends, another answers replay
// requests. Safe for concurrent use.
type KVEventPublisher struct {
	cfg    KVEventsConfig
	topic  []byte
	ctx    context.Context
	cancel context.CancelFunc
	pub    zmq4.Socket
	replay zmq4.Socket // nil without ReplayEndpoint
	dial   bool        // connect the PUB socket (from the sending goroutine)

	mu       sync.Mutex // orders sequence numbers with queue order
	nextSeq  uint64
	closed   bool
	queue    chan kvMsg
	quit     chan struct{} // closed by Close
	dialed   chan struct{} // closed when the PUB socket is bound or connected (or gave up)
	sent     chan struct{} // closed when the sending goroutine exits
	replayWG sync.WaitGroup
	once     sync.Once

	bufMu   sync.Mutex
	buf     []kvMsg // ring of the last BufferSteps sent batches
	bufHead int     // index of the oldest batch once the ring is full

	published, dropped atomic.Uint64
}

// NewKVEventPublisher validates cfg, opens the sockets (binding now, or
// connecting in the background per the endpoint heuristic) and starts the
// publishing goroutines. cfg.Enable is not consulted.
func NewKVEventPublisher(cfg KVEventsConfig) (*KVEventPublisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	cfg = cfg.WithDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	p := &KVEventPublisher{
		cfg:    cfg,
		topic:  []byte(cfg.Topic),
		ctx:    ctx,
		cancel: cancel,
		dial:   !cfg.Bind && !kvBindsEndpoint(cfg.Endpoint),
		queue:  make(chan kvMsg, cfg.MaxQueueSize),
		quit:   make(chan struct{}),
		dialed: make(chan struct{}),
		sent:   make(chan struct{}),
	}
	quiet := log.New(io.Discard, "", 0)
	if p.dial {
		p.pub = zmq4.NewPub(ctx, zmq4.WithLogger(quiet), zmq4.WithDialerMaxRetries(-1), zmq4.WithAutomaticReconnect(true))
	} else {
		p.pub = zmq4.NewPub(ctx, zmq4.WithLogger(quiet))
	}
	if err := p.pub.SetOption(zmq4.OptionHWM, cfg.HWM); err != nil {
		p.closeSockets()
		return nil, fmt.Errorf("sim: kv events: setting hwm: %w", err)
	}
	if !p.dial {
		if err := p.pub.Listen(cfg.Endpoint); err != nil {
			p.closeSockets()
			return nil, fmt.Errorf("sim: kv events: %w", err)
		}
	}
	if cfg.ReplayEndpoint != "" {
		p.replay = zmq4.NewRouter(ctx, zmq4.WithLogger(quiet))
		if err := p.replay.Listen(cfg.ReplayEndpoint); err != nil {
			p.closeSockets()
			return nil, fmt.Errorf("sim: kv events replay: %w", err)
		}
		p.replayWG.Add(1)
		go p.serveReplay()
	}
	if p.dial {
		// zmq4 dials synchronously, retrying until the context is cancelled;
		// batches queue (and drop when the queue is full) meanwhile.
		go func() {
			_ = p.pub.Dial(cfg.Endpoint)
			close(p.dialed)
		}()
	} else {
		close(p.dialed)
	}
	go p.run()
	return p, nil
}

// Config returns the configuration with defaults applied.
func (p *KVEventPublisher) Config() KVEventsConfig { return p.cfg }

// Addr returns the address the PUB socket listens on (useful with port 0),
// or nil when it connects.
func (p *KVEventPublisher) Addr() net.Addr {
	if p.dial {
		return nil
	}
	return p.pub.Addr()
}

// ReplayAddr returns the address of the replay ROUTER socket, or nil.
func (p *KVEventPublisher) ReplayAddr() net.Addr {
	if p.replay == nil {
		return nil
	}
	return p.replay.Addr()
}

// Stats returns the publisher's counters.
func (p *KVEventPublisher) Stats() KVEventPublisherStats {
	return KVEventPublisherStats{Published: p.published.Load(), Dropped: p.dropped.Load()}
}

// Publish encodes events as one KVEventBatch stamped ts (seconds since the
// Unix epoch) and queues it for sending, without blocking. It reports false
// when the batch was dropped (queue full or publisher closed). An empty
// batch is not published (vLLM publishes only steps with events). events
// may be reused once Publish returns.
func (p *KVEventPublisher) Publish(ts float64, events []KVEvent) bool {
	if len(events) == 0 {
		return true
	}
	if p.cfg.TierScopedClearEvents {
		return p.publishTierScoped(ts, events)
	}
	return p.enqueue(p.encode(ts, events))
}

// publishTierScoped publishes events with every AllBlocksCleared as a
// TierBlocksCleared(medium="GPU") in a batch of its own, the events around
// it in batches before and after, in order (vLLM's
// isolate_tier_clear_batches: a subscriber that cannot decode the tag then
// loses only that batch).
func (p *KVEventPublisher) publishTierScoped(ts float64, events []KVEvent) bool {
	ok := true
	start := 0
	for i := range events {
		if events[i].Type != KVAllBlocksCleared {
			continue
		}
		if i > start {
			ok = p.enqueue(p.encode(ts, events[start:i])) && ok
		}
		ok = p.enqueue(p.encode(ts, []KVEvent{{Type: KVTierBlocksCleared}})) && ok
		start = i + 1
	}
	if start < len(events) {
		ok = p.enqueue(p.encode(ts, events[start:])) && ok
	}
	return ok
}

// encode returns the payload of one batch (data parallel rank 0).
func (p *KVEventPublisher) encode(ts float64, events []KVEvent) []byte {
	return AppendKVEventBatch(nil, ts, events, 0, p.cfg.Encoding)
}

// enqueue gives payload the next sequence number and queues it; a full queue
// drops it, leaving a gap in the sequence numbers.
func (p *KVEventPublisher) enqueue(payload []byte) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.dropped.Add(1)
		return false
	}
	m := kvMsg{seq: p.nextSeq, payload: payload}
	p.nextSeq++
	select {
	case p.queue <- m:
		return true
	default:
		p.dropped.Add(1)
		return false
	}
}

// run is the sending goroutine: once the PUB socket is connected it sends
// queued batches and records them for replay until Close, then sends what is
// still queued. Closed before connecting, it drops the queue.
func (p *KVEventPublisher) run() {
	defer close(p.sent)
	select {
	case <-p.dialed:
	case <-p.quit:
		select {
		case <-p.dialed:
		default:
			p.cancel() // stop dialing
			<-p.dialed
			p.drain(nil)
			return
		}
	}
	for {
		select {
		case m := <-p.queue:
			p.send(m)
		case <-p.quit:
			p.drain(p.send)
			return
		}
	}
}

// drain empties the queue, passing each batch to f (or dropping it if f is nil).
func (p *KVEventPublisher) drain(f func(kvMsg)) {
	for {
		select {
		case m := <-p.queue:
			if f == nil {
				p.dropped.Add(1)
			} else {
				f(m)
			}
		default:
			return
		}
	}
}

func (p *KVEventPublisher) send(m kvMsg) {
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], m.seq)
	// A PUB send only queues inside zmq4 (dropping beyond the HWM); it does
	// not fail for lack of subscribers.
	_ = p.pub.SendMulti(zmq4.NewMsgFrom(p.topic, seq[:], m.payload))
	p.published.Add(1)
	p.bufMu.Lock()
	if len(p.buf) < p.cfg.BufferSteps {
		p.buf = append(p.buf, m)
	} else {
		p.buf[p.bufHead] = m
		p.bufHead = (p.bufHead + 1) % len(p.buf)
	}
	p.bufMu.Unlock()
}

// buffered returns the buffered batches with seq >= start, oldest first.
func (p *KVEventPublisher) buffered(start uint64) []kvMsg {
	p.bufMu.Lock()
	defer p.bufMu.Unlock()
	out := make([]kvMsg, 0, len(p.buf))
	for i := range p.buf {
		if m := p.buf[(p.bufHead+i)%len(p.buf)]; m.seq >= start {
			out = append(out, m)
		}
	}
	return out
}

// serveReplay answers replay requests on the ROUTER socket: a request
// [identity, "", start_seq (8-byte BE)] gets every buffered batch with
// seq >= start_seq as [identity, "", seq, payload], then the end marker
// [identity, "", 0xFFFFFFFFFFFFFFFF, ""]. Requests of another frame count
// are ignored, as in vLLM.
func (p *KVEventPublisher) serveReplay() {
	defer p.replayWG.Done()
	end := binary.BigEndian.AppendUint64(nil, KVReplayEndSeq)
	for {
		req, err := p.replay.Recv()
		if err != nil {
			if p.ctx.Err() != nil {
				return
			}
			continue
		}
		if len(req.Frames) != 3 {
			continue
		}
		id, raw := req.Frames[0], req.Frames[2]
		var start uint64 // int.from_bytes(raw, "big"), truncated to 64 bits
		for _, b := range raw {
			start = start<<8 | uint64(b)
		}
		for _, m := range p.buffered(start) {
			var seq [8]byte
			binary.BigEndian.PutUint64(seq[:], m.seq)
			if p.replay.Send(zmq4.NewMsgFrom(id, nil, seq[:], m.payload)) != nil {
				break
			}
		}
		_ = p.replay.Send(zmq4.NewMsgFrom(id, nil, end, nil))
	}
}

// Close sends the batches still queued, then closes the sockets and waits for
// the publisher's goroutines. Later Publish calls drop their batch.
// Idempotent.
func (p *KVEventPublisher) Close() error {
	p.once.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		close(p.quit)
		// Wait for the sender before closing the sockets it uses; the replay
		// goroutine exits when its socket closes.
		<-p.sent
		p.closeSockets()
		p.replayWG.Wait()
	})
	return nil
}

// closeSockets cancels the sockets' context and closes them.
func (p *KVEventPublisher) closeSockets() {
	p.cancel()
	_ = p.pub.Close()
	if p.replay != nil {
		_ = p.replay.Close()
	}
}

// offsetEndpointPort is vLLM's ZmqEventPublisher.offset_endpoint_port: the
// publisher of data-parallel rank r adds r to a tcp port and appends "_dp<r>"
// to an inproc name. A fleet applies it with the engine's index, so that its
// engines do not all bind one port; port 0 (any free port) is kept.
func offsetEndpointPort(ep string, rank int) string {
	if ep == "" || rank == 0 {
		return ep
	}
	if strings.Contains(ep, "inproc") {
		return fmt.Sprintf("%s_dp%d", ep, rank)
	}
	if strings.Contains(ep, "tcp") {
		i := strings.LastIndexByte(ep, ':')
		port, err := strconv.Atoi(ep[i+1:])
		if i < 0 || err != nil || port == 0 {
			return ep
		}
		return fmt.Sprintf("%s:%d", ep[:i], port+rank)
	}
	return ep
}

// ---------------------------------------------------------------------------
// Server wiring

// KVEventPublisher returns the server's KV-event publisher (for its
// addresses and counters), or nil when KV events are off.
func (s *Server) KVEventPublisher() *KVEventPublisher { return s.kvpub }

// ResetPrefixCache resets the engine's prefix cache (Engine.ResetPrefixCache,
// like vLLM's /reset_prefix_cache) and publishes the resulting
// AllBlocksCleared at once. It reports false when a request holds KV blocks
// or the server is not running.
func (s *Server) ResetPrefixCache() bool {
	ok := false
	ran := s.withEngine(func(e *Engine, _ time.Duration) { ok = e.ResetPrefixCache() })
	return ran && ok
}

// engineCall is a function to run on the driver goroutine, which owns the engine.
type engineCall struct {
	f    func(e *Engine, now time.Duration)
	done chan struct{}
}

// withEngine runs f on the driver goroutine between steps (or during a step's
// wall-clock wait, after the step's events were queued) and waits for it. It
// reports false, without running f, when the driver is not running.
func (s *Server) withEngine(f func(e *Engine, now time.Duration)) bool {
	if !s.started.Load() {
		return false
	}
	c := &engineCall{f: f, done: make(chan struct{})}
	select {
	case s.control <- c:
		<-c.done
		return true
	case <-s.done:
		return false
	}
}

// runEngineCall runs c on the driver at simulated time now and publishes the
// KV events it caused.
func (s *Server) runEngineCall(e *Engine, c *engineCall, now time.Duration) {
	defer close(c.done)
	c.f(e, now)
	s.kvEnqueue(s.kvEncode(e.TakeKVEvents(), now))
}

// kvEncode encodes the events of a step ending (or a call made) at simulated
// time at into a batch payload, or returns nil when there are none.
func (s *Server) kvEncode(events []KVEvent, at time.Duration) []byte {
	if s.kvpub == nil || len(events) == 0 {
		return nil
	}
	return s.kvpub.encode(s.kvTS(at), events)
}

// kvEnqueue queues an encoded batch (if any) and returns nil.
func (s *Server) kvEnqueue(payload []byte) []byte {
	if payload != nil {
		s.kvpub.enqueue(payload)
	}
	return nil
}

// kvTS is the batch timestamp of simulated time at: seconds since the Unix
// epoch on the simulated clock, which starts at the driver's wall-clock start
// (vLLM stamps batches with time.time()). At TimeScale 1 it follows the wall
// clock; faster servers run ahead of it, so stamps stay consistent with the
// simulated latencies the server reports.
func (s *Server) kvTS(at time.Duration) float64 {
	t0 := s.startWall.Load()
	return float64(t0/1e9) + float64(t0%1e9)/1e9 + at.Seconds()
}
