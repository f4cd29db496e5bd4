package prefix

// Capacity bound of a PreciseIndex endpoint.
//
// A correct engine never holds more blocks than its KV capacity: vLLM emits
// BlockRemoved for a cached block before it reuses it. An endpoint whose
// events announce more (removals lost without a gap being seen, or a broken
// or hostile engine: one announcing 150× its capacity grew the heap by about
// 118 bytes per block without bound) is held to its capacity by evicting, as
// if the engine had removed them, the blocks it most likely no longer holds.
//
// Order: leaves first, least recently stored first — the order of a radix
// prefix cache, and close to vLLM's, whose free queue takes a finished
// request's blocks tail first, so a parent is at least as recently used as
// its children. Every engine key has a node in one of two lists: leaves
// (its request key has no held child) and inner blocks. A stored or re-stored
// block, and the parent of a stored block (just used by the request that
// stored it), move to the most recent end of their list; a block that gains
// its first child moves to the inner list, one that loses its last child to
// the least recent end of the leaves, so a cold chain unwinds from its tail
// before anything else. Evicting leaves never leaves a hole in a prefix;
// when no leaf is left (saturated kids counts, hash cycles, orphans only),
// the least recent inner block goes and its children become holes, which
// Match handles as an engine's own out-of-order eviction.
//
// Duplicates: only the engine key last stored under a request key moves
// between the lists (heldEntry.eng); another engine key with the same request
// key stays where it was, and may be evicted as a leaf while the request key
// has children (the key stays held through its other engine key).

// Sentinel nodes of the two lists: lists[l].next is the least recent entry,
// lists[l].prev the most recent.
const (
	leafList  uint32 = 0
	innerList uint32 = 1
)

// evictNode is one engine key's place in an eviction list.
type evictNode struct {
	key        uint64
	prev, next uint32
}

// evictState is an endpoint's capacity and eviction lists (ep.mu guards it).
type evictState struct {
	capacity int         // engine keys and orphans held at most; 0: unbounded
	nodes    []evictNode // [0] and [1] are the lists' sentinels
	free     uint32      // first free node (linked by next); 0: none
}

func (ep *preciseEndpoint) resetLists() {
	ep.nodes = append(ep.nodes[:0:0], evictNode{prev: leafList, next: leafList}, evictNode{prev: innerList, next: innerList})
	ep.free = 0
}

// newNode returns a node for key h at the most recent end of the leaves.
func (ep *preciseEndpoint) newNode(h uint64) uint32 {
	n := ep.free
	if n != 0 {
		ep.free = ep.nodes[n].next
		ep.nodes[n] = evictNode{key: h}
	} else {
		n = uint32(len(ep.nodes))
		ep.nodes = append(ep.nodes, evictNode{key: h})
	}
	ep.link(n, leafList, false)
	return n
}

func (ep *preciseEndpoint) freeNode(n uint32) {
	if n <= innerList {
		return
	}
	ep.unlink(n)
	ep.nodes[n] = evictNode{next: ep.free}
	ep.free = n
}

func (ep *preciseEndpoint) unlink(n uint32) {
	p, x := ep.nodes[n].prev, ep.nodes[n].next
	ep.nodes[p].next, ep.nodes[x].prev = x, p
}

// link puts n in list l: at its least recent end when lru, else at its most
// recent end. n must not be linked.
func (ep *preciseEndpoint) link(n, l uint32, lru bool) {
	s := &ep.nodes[l]
	if lru {
		first := s.next
		ep.nodes[n].prev, ep.nodes[n].next = l, first
		ep.nodes[first].prev = n
		ep.nodes[l].next = n
		return
	}
	last := s.prev
	ep.nodes[n].prev, ep.nodes[n].next = last, l
	ep.nodes[last].next = n
	ep.nodes[l].prev = n
}

// relist moves engine key h (if held with a request key) to list l.
func (ep *preciseEndpoint) relist(h uint64, l uint32, lru bool) {
	if h == 0 {
		return
	}
	ent, ok := ep.eng[h]
	if !ok {
		return
	}
	ep.unlink(ent.node)
	ep.link(ent.node, l, lru)
}

// touch marks engine key h (held or orphan) as just used: the most recent
// end of its list.
func (ep *preciseEndpoint) touch(h uint64) {
	if ent, ok := ep.eng[h]; ok {
		l := leafList
		if ep.pinned(ent.req) {
			l = innerList
		}
		ep.unlink(ent.node)
		ep.link(ent.node, l, false)
	} else if o, ok := ep.orphans[h]; ok {
		ep.unlink(o.node)
		ep.link(o.node, leafList, false)
	}
}

// SetCapacity bounds endpoint e to blocks engine keys: its KV capacity in
// all tiers together (GPU blocks plus those of CPU or disk offloading), in
// blocks of the index's block size; 0 removes the bound. Blocks beyond it
// are evicted now and whenever a Stored call adds more.
func (ix *PreciseIndex) SetCapacity(e int, blocks int) {
	if e < 0 || e >= len(ix.eps) {
		return
	}
	ep := &ix.eps[e]
	ep.mu.Lock()
	defer ep.mu.Unlock()
	ep.capacity = max(0, blocks)
	ix.evict(ep, uint64(1)<<e)
}

// evict brings ep down to its capacity. ep.mu is held.
func (ix *PreciseIndex) evict(ep *preciseEndpoint, bit uint64) {
	for ep.capacity > 0 && len(ep.eng)+len(ep.orphans) > ep.capacity {
		n := ep.nodes[leafList].next
		if n == leafList {
			if n = ep.nodes[innerList].next; n == innerList {
				return // unreachable: every key has a node
			}
		}
		h := ep.nodes[n].key
		ep.evicted.Add(1)
		if ent, ok := ep.eng[h]; ok {
			ix.dropEngineKey(ep, bit, h, ent)
			continue
		}
		if o, ok := ep.orphans[h]; ok {
			delete(ep.orphans, h)
			ep.orphansDropped.Add(1)
			ep.freeNode(o.node)
			continue
		}
		ep.freeNode(n) // unreachable: a node without a key
	}
}
