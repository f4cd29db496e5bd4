package sim

// noBlock marks the absence of a block in the intrusive lists below.
const noBlock = -1

// block is one KV-cache page of blockSize tokens.
type block struct {
	hash uint64 // valid when cached
	ref  int32  // number of requests holding the block
	prev int32  // free-queue links (noBlock at the ends / when not free)
	next int32
	// Chain of cached blocks sharing a hash: dupNext links head to tail; the
	// head's dupPrev points to the tail, the others' to their predecessor.
	dupPrev, dupNext int32
	cached           bool // the block is full, hashed and findable by prefix lookup
	free             bool // the block is in the free queue
}

// blockPool is a paged KV cache with automatic prefix caching, modelled on
// vLLM v1's BlockPool (vllm/v1/core/block_pool.py) and FreeKVCacheBlockQueue
// (kv_cache_utils.py):
//
//   - blocks with ref == 0 sit in a doubly linked free queue; allocation pops
//     from the head, release appends at the tail, so the head is the least
//     recently released block (LRU);
//   - a full block is registered under its chained hash as soon as it is
//     scheduled to be filled, and keeps its hash after release: it stays
//     findable while in the free queue and is evicted (hash dropped) only when
//     popped for reuse;
//   - a prefix hit on a free block removes it from the queue (touch);
//   - like vLLM, identical blocks computed concurrently by two requests are not
//     de-duplicated: both are registered and lookup returns the earliest.
//
// Unlike vLLM there is no reserved null block, and there is a single KV-cache group.
type blockPool struct {
	blocks     []block
	head, tail int32
	numFree    int
	index      map[uint64]int32 // hash → first block of its chain
	ev         *kvEventLog      // records BlockRemoved on eviction; nil when KV events are off
}

func newBlockPool(n int) *blockPool {
	p := &blockPool{
		blocks: make([]block, n),
		head:   noBlock,
		tail:   noBlock,
		index:  make(map[uint64]int32, n),
	}
	for i := range p.blocks {
		p.blocks[i].dupPrev, p.blocks[i].dupNext = noBlock, noBlock
		p.pushBack(int32(i))
	}
	return p
}

// used is the number of blocks held by at least one request.
func (p *blockPool) used() int { return len(p.blocks) - p.numFree }

func (p *blockPool) pushBack(id int32) {
	b := &p.blocks[id]
	b.prev, b.next, b.free = p.tail, noBlock, true
	if p.tail == noBlock {
		p.head = id
	} else {
		p.blocks[p.tail].next = id
	}
	p.tail = id
	p.numFree++
}

func (p *blockPool) remove(id int32) {
	b := &p.blocks[id]
	if b.prev == noBlock {
		p.head = b.next
	} else {
		p.blocks[b.prev].next = b.next
	}
	if b.next == noBlock {
		p.tail = b.prev
	} else {
		p.blocks[b.next].prev = b.prev
	}
	b.prev, b.next, b.free = noBlock, noBlock, false
	p.numFree--
}

// lookup returns the first cached block with hash h, or noBlock.
func (p *blockPool) lookup(h uint64) int32 {
	if id, ok := p.index[h]; ok {
		return id
	}
	return noBlock
}

// register makes block id findable under hash h, appended at the end of the
// chain of h so that lookup keeps returning the earliest registered copy (vLLM
// returns the first entry of an insertion-ordered dict). O(1).
func (p *blockPool) register(id int32, h uint64) {
	b := &p.blocks[id]
	b.hash, b.cached, b.dupNext = h, true, noBlock
	first, ok := p.index[h]
	if !ok {
		p.index[h] = id
		b.dupPrev = id // the head's dupPrev is the chain's tail
		return
	}
	tail := p.blocks[first].dupPrev
	p.blocks[tail].dupNext = id
	b.dupPrev = tail
	p.blocks[first].dupPrev = id
}

// evict drops the hash of block id, if any, so prefix lookups no longer find it. O(1).
func (p *blockPool) evict(id int32) {
	b := &p.blocks[id]
	if !b.cached {
		return
	}
	b.cached = false
	if p.ev != nil {
		p.ev.removed(b.hash)
	}
	first := p.index[b.hash]
	switch {
	case first == id && b.dupNext == noBlock:
		delete(p.index, b.hash)
	case first == id:
		p.blocks[b.dupNext].dupPrev = b.dupPrev // the new head inherits the tail pointer
		p.index[b.hash] = b.dupNext
	default:
		p.blocks[b.dupPrev].dupNext = b.dupNext
		if b.dupNext == noBlock {
			p.blocks[first].dupPrev = b.dupPrev
		} else {
			p.blocks[b.dupNext].dupPrev = b.dupPrev
		}
	}
	b.dupPrev, b.dupNext = noBlock, noBlock
}

// allocate pops n blocks from the head of the free queue, evicting their hashes,
// and appends them to dst with ref 1. The caller checks numFree first.
func (p *blockPool) allocate(dst []int32, n int) []int32 {
	for range n {
		id := p.head
		p.remove(id)
		p.evict(id)
		p.blocks[id].ref = 1
		dst = append(dst, id)
	}
	return dst
}

// touch takes a reference on cached blocks found by a prefix lookup, taking
// them off the free queue if they were unreferenced.
func (p *blockPool) touch(ids []int32) {
	for _, id := range ids {
		b := &p.blocks[id]
		if b.ref == 0 {
			p.remove(id)
		}
		b.ref++
	}
}

// release drops one reference on each block, in eviction order: blocks
// reaching ref 0 are appended to the free queue in the order given.
func (p *blockPool) release(ids []int32) {
	for _, id := range ids {
		b := &p.blocks[id]
		b.ref--
		if b.ref == 0 {
			p.pushBack(id)
		}
	}
}
