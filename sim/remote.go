package sim

import (
	"github.com/infergate/infergate/kvevents/kvevent"
)

// RemoteStore is an in-memory RemoteTier: the shared remote KV store of a
// virtual fleet, holding metadata only (block hashes), bounded to a
// capacity in blocks and evicting the least recently stored block. A
// store's chain is touched tail first, so its head is the most recent and
// outlives its tail (as vLLM's GPU free queue orders a request's blocks):
// eviction keeps stored prefixes closed, so a stored block's parent is
// almost always held and a gateway's index can key it (an evicted parent
// would orphan every descendant's event). Lookups (Holds) do not touch. When events are on it
// records them as kvstore publishes them: BlockStored with medium REMOTE,
// the writer's token ids and parent (so a gateway's index can key them
// without an engine's GPU event), and BlockRemoved on eviction.
//
// Not safe for concurrent use: the engines of a virtual fleet run on one
// goroutine.
type RemoteStore struct {
	hashLRU
	ev *kvEventLog // nil: no events
}

// NewRemoteStore returns an empty store of capacity blocks (at least 1)
// that records KV events when events is set.
func NewRemoteStore(capacity int, events bool) *RemoteStore {
	r := &RemoteStore{hashLRU: newHashLRU(max(1, capacity))}
	if events {
		r.ev = &kvEventLog{}
	}
	return r
}

// Capacity returns the store's capacity in blocks.
func (r *RemoteStore) Capacity() int { return r.capacity }

// Len returns the number of blocks held.
func (r *RemoteStore) Len() int { return r.len() }

// Holds implements RemoteTier.
func (r *RemoteStore) Holds(h uint64) bool { return r.holds(h) }

// Store implements RemoteTier.
func (r *RemoteStore) Store(hashes []uint64, parent uint64, hasParent bool, tokens []uint32, blockSize int, lora string) {
	if r.ev != nil {
		r.ev.begin()
	}
	run := -1 // first block of the current run of new blocks
	flush := func(end int) {
		if run < 0 || r.ev == nil {
			run = -1
			return
		}
		l := r.ev
		h0, t0 := len(l.hashes), len(l.tokens)
		l.hashes = append(l.hashes, hashes[run:end]...)
		l.tokens = append(l.tokens, tokens[run*blockSize:end*blockSize]...)
		ev := kvevent.Event{
			Type:        kvevent.BlockStored,
			BlockHashes: l.hashes[h0:len(l.hashes):len(l.hashes)],
			TokenIDs:    l.tokens[t0:len(l.tokens):len(l.tokens)],
			BlockSize:   blockSize,
			LoRAName:    lora,
			Medium:      kvevent.MediumRemote,
		}
		switch {
		case run > 0:
			ev.ParentBlockHash, ev.HasParent = hashes[run-1], true
		case hasParent:
			ev.ParentBlockHash, ev.HasParent = parent, true
		}
		l.events = append(l.events, ev)
		run = -1
	}
	for k, h := range hashes {
		if r.touch(h) {
			flush(k)
			continue
		}
		for r.full() {
			flush(k) // its removal event follows the stores before it
			r.evictLRU()
		}
		r.insert(h)
		if run < 0 {
			run = k
		}
	}
	flush(len(hashes))
	for k := len(hashes) - 1; k >= 0; k-- {
		r.touch(hashes[k]) // the chain's head ends most recent
	}
}

func (r *RemoteStore) evictLRU() {
	h := r.evict()
	if r.ev != nil {
		r.ev.removedIn(h, kvevent.MediumRemote)
	}
}

// TakeEvents returns the events recorded since the last call (nil when
// none or events are off); the slice is valid until the next Store or
// TakeEvents.
func (r *RemoteStore) TakeEvents() []kvevent.Event {
	if r.ev == nil {
		return nil
	}
	evs := r.ev.take()
	r.ev.begin()
	return evs
}
