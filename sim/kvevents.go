package sim

import "github.com/infergate/infergate/kvevents/kvevent"

// KV-cache events, as vLLM publishes them (docs/PROTOCOLS.md §1).
//
// The pure core (Engine, blockPool) records the events a vLLM block pool would
// queue — vllm/v1/core/block_pool.py: cache_full_blocks → BlockStored,
// _maybe_evict_cached_block → BlockRemoved, reset_prefix_cache →
// AllBlocksCleared — as kvevent.Event values (a transport-free record type, so
// the engine links no ZeroMQ) and hands them out per step (StepResult.Events).
// A simserver.Server publishes them with a kvevents.Publisher (vLLM's msgspec
// encoding over ZeroMQ, like its ZmqEventPublisher). See README.md "KV
// events", ../simserver/README.md and ../kvevents/README.md.

// kvEventLog records the events of one step (and of ResetPrefixCache calls
// made since the previous step). Events point into the hashes and tokens
// arenas, which are reused once the events have been taken.
type kvEventLog struct {
	events []kvevent.Event
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
func (l *kvEventLog) take() []kvevent.Event {
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
	ev := kvevent.Event{
		Type:        kvevent.BlockStored,
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

// removed records a BlockRemoved for one hash evicted from the GPU pool
// (vLLM BlockPool._maybe_evict_cached_block).
func (l *kvEventLog) removed(h uint64) { l.removedIn(h, "") }

// removedIn records a BlockRemoved for one hash evicted from medium ("" for
// the GPU, whose events leave the field to the encoder's default).
func (l *kvEventLog) removedIn(h uint64, medium string) {
	if medium == kvevent.MediumGPU {
		medium = ""
	}
	h0 := len(l.hashes)
	l.hashes = append(l.hashes, h)
	l.events = append(l.events, kvevent.Event{Type: kvevent.BlockRemoved, BlockHashes: l.hashes[h0:len(l.hashes):len(l.hashes)], Medium: medium})
}

// cleared records an AllBlocksCleared.
func (l *kvEventLog) cleared() {
	l.events = append(l.events, kvevent.Event{Type: kvevent.AllBlocksCleared})
}

// TakeKVEvents returns the KV events recorded since the previous Step or
// TakeKVEvents — in practice those of ResetPrefixCache calls made while the
// engine is idle — and nil when there are none or Config.KVEvents is off.
// Like StepResult.Events, the slice is owned by the engine and valid until
// the next call to Step, ResetPrefixCache or TakeKVEvents.
func (e *Engine) TakeKVEvents() []kvevent.Event { return e.kv.take() }

// ResetPrefixCache drops the hash of every cached block so that no later
// request hits them, and records an AllBlocksCleared event. Like vLLM's
// BlockPool.reset_prefix_cache (vllm/v1/core/block_pool.py) it only succeeds
// (and, AllBlocksCleared being pod-wide, it empties the host and disk tiers
// too; the shared remote tier is not the engine's to reset)
// when no block is held by a request — every cached block is then an
// unreferenced one in the free queue — and otherwise changes nothing and
// returns false. The free queue keeps its order. Running or waiting requests
// do not make it fail by themselves: only blocks they hold do.
func (e *Engine) ResetPrefixCache() bool {
	if e.pool.used() > 0 {
		return false
	}
	e.pool.clearHashes()
	if e.tiers != nil {
		e.tiers.clear() // AllBlocksCleared is pod-wide: every tier
	}
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

// CachedHashes returns the multiset of hashes currently registered in the
// prefix cache (hash → number of blocks holding it; vLLM does not
// de-duplicate identical blocks computed concurrently, and neither do its
// events). Tests compare it with what a subscriber rebuilt from the events;
// simserver's run it on the driver goroutine (Server.withEngine), since the
// engine is not safe for concurrent use.
func (e *Engine) CachedHashes() map[uint64]int {
	m := make(map[uint64]int)
	for i := range e.pool.blocks {
		if b := &e.pool.blocks[i]; b.cached {
			m[b.hash]++
		}
	}
	return m
}
