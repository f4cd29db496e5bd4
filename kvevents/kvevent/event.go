// Package kvevent holds the record of one vLLM KV-cache event (Event, its
// Type), with no transport: the simulated engine (package sim) emits these
// records and links nothing of kvevents' ZeroMQ publisher or msgpack decoder.
// Package kvevents encodes, decodes, publishes and subscribes to them, and
// re-exports both names (kvevents.Event, kvevents.Type and the type
// constants are aliases of these), so wire users need not import this package.
package kvevent

import "fmt"

// Type is the tag of a KV-cache event: the msgspec class name vLLM puts on
// the wire (vllm/distributed/kv_events.py, KVCacheEvent with tag=True).
type Type uint8

// KV-cache event types. vLLM's block pool (vllm/v1/core/block_pool.py)
// queues them: cache_full_blocks → BlockStored, _maybe_evict_cached_block →
// BlockRemoved, reset_prefix_cache → AllBlocksCleared.
const (
	// BlockStored: full blocks got their hash registered in the prefix cache.
	BlockStored Type = iota + 1
	// BlockRemoved: cached blocks were evicted (vLLM emits one event per
	// evicted block).
	BlockRemoved
	// AllBlocksCleared: the engine's whole prefix cache was reset.
	AllBlocksCleared
	// TierBlocksCleared: the prefix cache of one tier (Event.Medium; "GPU"
	// when null) was reset, blocks in other tiers kept (vLLM with
	// tier_scoped_clear_events, vllm/distributed/kv_events.py; Dynamo's
	// kv-router decodes it the same way). A publisher with
	// kvevents.PublisherConfig.TierScopedClearEvents sends it in place of
	// AllBlocksCleared.
	TierBlocksCleared
)

// String returns the vLLM class name: "BlockStored", "BlockRemoved",
// "AllBlocksCleared" or "TierBlocksCleared".
func (t Type) String() string {
	switch t {
	case BlockStored:
		return "BlockStored"
	case BlockRemoved:
		return "BlockRemoved"
	case AllBlocksCleared:
		return "AllBlocksCleared"
	case TierBlocksCleared:
		return "TierBlocksCleared"
	}
	return fmt.Sprintf("kvevents.Type(%d)", uint8(t))
}

// Media: the medium field of BlockStored, BlockRemoved and
// TierBlocksCleared, the tier a block is held in. vLLM's GPU block pool
// writes "GPU" (vllm/v1/core/block_pool.py) and its CPU offloading connector
// "CPU" (vllm/v1/kv_offload, medium of CPULoadStoreSpec); the names of the
// newer disk and remote tiers are not fixed across engines (llm-d
// lower-cases whatever it gets), so these are the ones infergate writes:
// the simulated engine's local-disk tier "DISK" and the shared remote
// store (infergate kvstore) "REMOTE".
const (
	MediumGPU    = "GPU"
	MediumCPU    = "CPU"
	MediumDisk   = "DISK"
	MediumRemote = "REMOTE"
)

// Event is one KV-cache event (vllm/distributed/kv_events.py: BlockStored,
// BlockRemoved, AllBlocksCleared, TierBlocksCleared; docs/PROTOCOLS.md §1.4).
// Fields a type does not carry are zero. The simulated engine records its
// events in this form (sim.StepResult.Events), kvevents.AppendBatch encodes
// them and kvevents.DecodeBatch fills them from a payload.
type Event struct {
	Type Type
	// BlockHashes are the chained prefix-cache hashes of the stored blocks,
	// in sequence order (BlockStored), or of the removed blocks
	// (BlockRemoved), as unsigned 64-bit integers: vLLM publishes the last 8
	// bytes of each hash big-endian with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1
	// (its default). kvevents.DecodeBatch reads integer hashes as sent (a negative
	// int64 reinterpreted) and byte-string hashes by their last 8 bytes
	// big-endian (docs/PROTOCOLS.md §1.5).
	BlockHashes []uint64
	// ParentBlockHash is the hash of the block preceding the first stored
	// block; valid when HasParent. HasParent is false when the first stored
	// block is the first block of its sequence (parent_block_hash null).
	ParentBlockHash uint64
	HasParent       bool
	// TokenIDs are the tokens of all stored blocks, concatenated:
	// len(TokenIDs) == len(BlockHashes) × BlockSize (BlockStored only).
	TokenIDs []uint32
	// BlockSize is the block size in tokens (BlockStored only; 0 when absent).
	BlockSize int
	// LoRAName is the adapter the blocks were computed under ("" for the
	// base model; BlockStored only). kvevents.AppendBatch publishes it as lora_name
	// (null for "") and as every block's extra_keys entry [lora_name], as
	// vLLM does (vllm/v1/core/block_pool.py cache_full_blocks).
	LoRAName string
	// LoRAID is the adapter's id, published as lora_id (null when LoRAName
	// is ""; 0 when null). vLLM deprecated it for lora_name; the gateway
	// keys adapters by name, and an event of an engine that publishes only
	// the id (vLLM before lora_name, PR #27577) apart from the base model's
	// (fleet.KVEventApplier).
	LoRAID int
	// Medium is the cache tier ("" when null, which means the GPU; the
	// Medium* constants). Filled by kvevents.DecodeBatch; kvevents.AppendBatch
	// writes it, MediumGPU when "".
	Medium string
	// GroupIdx is the KV-cache group of hybrid models (-1 when null or
	// absent). Filled by kvevents.DecodeBatch; kvevents.AppendBatch always writes group 0 on
	// BlockStored and leaves BlockRemoved's null.
	GroupIdx int
}
