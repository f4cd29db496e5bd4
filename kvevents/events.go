package kvevents

import "github.com/infergate/infergate/kvevents/kvevent"

// Type is the tag of a KV-cache event (kvevent.Type: the msgspec class name
// vLLM puts on the wire).
type Type = kvevent.Type

// KV-cache event types (kvevent.BlockStored, ...).
const (
	BlockStored       = kvevent.BlockStored
	BlockRemoved      = kvevent.BlockRemoved
	AllBlocksCleared  = kvevent.AllBlocksCleared
	TierBlocksCleared = kvevent.TierBlocksCleared
)

// Constant fields of the events AppendBatch writes: one full-attention
// KV-cache group on the GPU, as the simulated engine models.
const (
	// MediumGPU is BlockStored/BlockRemoved.medium of the GPU block pool
	// (vLLM MEDIUM_GPU); kvevent documents the other media.
	MediumGPU    = kvevent.MediumGPU
	MediumCPU    = kvevent.MediumCPU
	MediumDisk   = kvevent.MediumDisk
	MediumRemote = kvevent.MediumRemote
	// CacheSpecFullAttention is BlockStored.kv_cache_spec_kind.
	CacheSpecFullAttention = "full_attention"
)

// Event is one KV-cache event (kvevent.Event, which documents its fields):
// the simulated engine records its events in this form, AppendBatch encodes
// them and DecodeBatch fills them from a payload.
type Event = kvevent.Event

// Batch is one decoded message payload: vLLM's KVEventBatch (EventBatch
// fields ts, events, data_parallel_rank).
type Batch struct {
	// TS is the engine's timestamp of the batch, in seconds since the epoch.
	TS float64
	// DataParallelRank is the publishing rank (-1 when null or absent).
	DataParallelRank int
	// Events are the batch's events of known types, in order.
	Events []Event
	// Unknown counts events of other types, left out of Events.
	Unknown int
}
