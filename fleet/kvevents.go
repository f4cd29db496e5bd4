package fleet

import (
	"strconv"
	"sync/atomic"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/prefix"
)

// KV-cache events (docs/PROTOCOLS.md §1): an engine publishes what its prefix
// cache stores and evicts; the gateway subscribes (kvevents.Subscriber) and
// keeps a prefix.PreciseIndex of it with a KVEventApplier per endpoint.

// KVSeeds returns the root seeds the gateway hashes prompts with
// (gateway.go): prefix.Seed(model+"\x00") for the base model, and
// prefix.Seed(adapter+"\x00") for blocks an adapter computed.
func KVSeeds(model string) func(loraName string) uint64 {
	base := prefix.Seed(model + "\x00")
	return func(lora string) uint64 {
		if lora == "" {
			return base
		}
		return prefix.Seed(lora + "\x00")
	}
}

// loraIDSeed is the root seed of blocks an engine says an adapter computed
// by its lora_id alone (vLLM before lora_name, PR #27577): the id is the
// engine's own numbering (vllm/entrypoints/openai/serving_models.py
// assigns it at load), not a name a request sends, so no prompt is hashed
// from this seed. The blocks are indexed, and never matched for the base
// model, whose blocks they are not (vLLM's block hashes differ by the
// adapter's extra key).
func loraIDSeed(id int) uint64 {
	return prefix.Seed("\x00lora_id\x00" + strconv.Itoa(id))
}

// KVEventApplier is the kvevents.Handler that keeps one engine's blocks in a
// prefix.PreciseIndex, as endpoint Endpoint. Request keys are recomputed
// from each BlockStored's token ids, the first block of a sequence chained
// from SeedFor(lora_name). Every event lands in the medium it names
// (prefix.ParseMedium: GPU, CPU, DISK, REMOTE, else OTHER); a BlockStored
// without token ids (an offloading connector copying GPU blocks to another
// tier) is resolved through the blocks the endpoint stored with tokens
// (prefix.PreciseIndex.Stored).
type KVEventApplier struct {
	ix      *prefix.PreciseIndex
	e       int
	seedFor func(loraName string) uint64
	// media are the media the stream may name (bit m for prefix.Medium m):
	// an engine's every medium but the shared store's, a store's only
	// REMOTE. Events of other media are skipped and counted (Refused), so
	// that a stream cannot fill the slot's bounds in media it has none of.
	media   uint32
	refused atomic.Uint64

	stored, removed, cleared      atomic.Uint64
	invalid                       atomic.Uint64
	blockSizeMismatch, otherMedia atomic.Uint64
}

// KVEventApplierStats are an applier's counters, in events.
type KVEventApplierStats struct {
	// Stored, Removed and Cleared count events applied.
	Stored, Removed, Cleared uint64
	// UnknownParents counts BlockStored events whose parent block the index
	// did not know on the endpoint (its own BlockStored was lost, or came
	// before the subscription); they are kept as orphans or joined to a
	// routed prompt (prefix.PreciseIndex). Joined counts the events joined;
	// OrphansDropped the orphan blocks evicted or reset before a join.
	UnknownParents, Joined, OrphansDropped uint64
	// Evicted counts blocks the index evicted because the endpoint held more
	// than its capacity (prefix.PreciseIndex.SetCapacity).
	Evicted uint64
	// UnresolvedStores counts blocks of BlockStored events without token
	// ids (an offloading connector's, e.g. vLLM's CPU offload) whose engine
	// hash the endpoint had not stored with tokens before: skipped, not
	// invalid (such an event whose blocks are known counts in Stored).
	UnresolvedStores uint64
	// BlockSizeMismatch counts BlockStored events skipped because their
	// block size is not the index's; Invalid other skipped BlockStored events
	// (token count neither blocks × block size nor 0).
	BlockSizeMismatch, Invalid uint64
	// OtherMedia counts events whose medium is not GPU, CPU, DISK or REMOTE
	// (indexed as prefix.MediumOther).
	OtherMedia uint64
	// Refused counts events skipped because their medium is not the
	// stream's (REMOTE from an engine; anything else from a store).
	Refused uint64
}

// NewKVEventApplier returns an applier of endpoint e's events to ix; seedFor
// gives the root seed of a sequence computed under an adapter ("" for the
// base model); see KVSeeds.
func NewKVEventApplier(ix *prefix.PreciseIndex, e int, seedFor func(loraName string) uint64) *KVEventApplier {
	return &KVEventApplier{ix: ix, e: e, seedFor: seedFor, media: (1<<prefix.NumMedia - 1) &^ (1 << prefix.MediumRemote)}
}

// NewStoreEventApplier is NewKVEventApplier for a shared remote store's
// stream (infergate kvstore): only its REMOTE events are applied.
func NewStoreEventApplier(ix *prefix.PreciseIndex, e int, seedFor func(loraName string) uint64) *KVEventApplier {
	return &KVEventApplier{ix: ix, e: e, seedFor: seedFor, media: 1 << prefix.MediumRemote}
}

// allowed reports whether the stream may name medium m, counting refusals.
func (a *KVEventApplier) allowed(m prefix.Medium) bool {
	if a.media&(1<<m) != 0 {
		return true
	}
	a.refused.Add(1)
	return false
}

// KVBatch applies b's events in order.
func (a *KVEventApplier) KVBatch(_ uint64, b *kvevents.Batch) {
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Type {
		case kvevents.BlockStored:
			if ev.BlockSize != 0 && ev.BlockSize != a.ix.BlockSize() {
				a.blockSizeMismatch.Add(1)
				continue
			}
			m := a.medium(ev.Medium)
			if !a.allowed(m) {
				continue
			}
			seed := a.seedFor(ev.LoRAName)
			if ev.LoRAName == "" && ev.LoRAID != 0 {
				seed = loraIDSeed(ev.LoRAID)
			}
			err := a.ix.Stored(a.e, m, ev.BlockHashes, ev.ParentBlockHash, ev.HasParent, ev.TokenIDs, seed)
			if err == nil {
				a.stored.Add(1)
			} else {
				a.invalid.Add(1)
			}
		case kvevents.BlockRemoved:
			if m := a.medium(ev.Medium); a.allowed(m) {
				a.ix.Removed(a.e, m, ev.BlockHashes)
				a.removed.Add(1)
			}
		case kvevents.AllBlocksCleared:
			a.ix.Cleared(a.e)
			a.cleared.Add(1)
		case kvevents.TierBlocksCleared:
			if m := a.medium(ev.Medium); a.allowed(m) {
				a.ix.ClearedMedium(a.e, m)
				a.cleared.Add(1)
			}
		}
	}
}

// KVReset forgets the endpoint's blocks.
func (a *KVEventApplier) KVReset(kvevents.ResetReason) { a.Forget() }

// Forget forgets the endpoint's blocks now. Unlike the handler methods it
// may be called from any goroutine (the owner calls it when the endpoint
// leaves rotation, then kvevents.Subscriber.Resync).
func (a *KVEventApplier) Forget() { a.ix.Forget(a.e) }

func (a *KVEventApplier) medium(name string) prefix.Medium {
	m, known := prefix.ParseMedium(name)
	if !known {
		a.otherMedia.Add(1)
	}
	return m
}

// Stats returns the applier's counters.
func (a *KVEventApplier) Stats() KVEventApplierStats {
	ix := a.ix.EndpointStats(a.e)
	return KVEventApplierStats{
		Stored: a.stored.Load(), Removed: a.removed.Load(), Cleared: a.cleared.Load(),
		UnknownParents: ix.UnknownParents, Joined: ix.Joined, OrphansDropped: ix.OrphansDropped, Evicted: ix.Evicted,
		UnresolvedStores:  ix.UnresolvedStores,
		BlockSizeMismatch: a.blockSizeMismatch.Load(), Invalid: a.invalid.Load(), OtherMedia: a.otherMedia.Load(),
		Refused: a.refused.Load(),
	}
}
