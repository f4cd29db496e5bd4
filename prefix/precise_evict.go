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
// lists[l].prev the most recent. The per-medium lists' sentinels follow
// (tierLists); firstNode is the first node that is not a sentinel.
const (
	leafList  uint32 = 0
	innerList uint32 = 1
	firstNode uint32 = 2 + 2*NumMedia
)

// evictNode is one engine key's place in an eviction list.
type evictNode struct {
	key        uint64
	prev, next uint32
}

// evictState is an endpoint's capacity and eviction lists (ep.mu guards it).
type evictState struct {
	capacity int         // engine keys and orphans held at most; 0: unbounded
	nodes    []evictNode // [0, firstNode) are the lists' sentinels
	free     uint32      // first free node (linked by next); 0: none
	tiers    [NumMedia]tierState
}

// tierState is an endpoint's bound in one medium (SetMediumCapacity) and,
// while it is bounded, that medium's eviction lists: a node (in
// evictState.nodes) per engine key held in the medium with a request key.
type tierState struct {
	capacity int               // engine keys held in the medium at most; 0: unbounded, no lists
	nodes    map[uint64]uint32 // engine key -> its node in the medium's lists, while capacity > 0
	evicted  uint64            // engine keys evicted from the medium (ep.mu)
}

// tierLists returns the sentinels of medium m's leaf and inner lists.
func tierLists(m Medium) (leaf, inner uint32) {
	return 2 + 2*uint32(m), 3 + 2*uint32(m)
}

func (ep *preciseEndpoint) resetLists() {
	ep.nodes = ep.nodes[:0:0]
	for l := range firstNode {
		ep.nodes = append(ep.nodes, evictNode{prev: l, next: l})
	}
	ep.free = 0
	for m := range ep.tiers {
		if t := &ep.tiers[m]; t.capacity > 0 {
			t.nodes = make(map[uint64]uint32)
		}
	}
}

// newNode returns a node for key h at the most recent end of the leaves.
func (ep *preciseEndpoint) newNode(h uint64) uint32 {
	n := ep.allocNode(h)
	ep.link(n, leafList, false)
	return n
}

// allocNode returns an unlinked node for key h.
func (ep *preciseEndpoint) allocNode(h uint64) uint32 {
	n := ep.free
	if n != 0 {
		ep.free = ep.nodes[n].next
		ep.nodes[n] = evictNode{key: h}
	} else {
		n = uint32(len(ep.nodes))
		ep.nodes = append(ep.nodes, evictNode{key: h})
	}
	return n
}

func (ep *preciseEndpoint) freeNode(n uint32) {
	if n < firstNode {
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
	ep, bit, ok := ix.at(e)
	if !ok {
		return
	}
	ep.mu.Lock()
	defer ep.mu.Unlock()
	ep.capacity = max(0, blocks)
	ix.evict(ep, bit)
	syncHoley(ep, bit)
}

// evict brings ep down to its capacity in every medium, then overall.
// ep.mu is held.
func (ix *PreciseIndex) evict(ep *preciseEndpoint, bit owner) {
	for m := range Medium(NumMedia) {
		ix.evictIn(ep, bit, m)
	}
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

// Per-medium bounds.
//
// An engine's tiers have capacities of their own: its GPU block pool, the
// host memory of its CPU offloading connector, its disk. SetMediumCapacity
// bounds the engine keys an endpoint holds in one medium; beyond it a key
// is dropped from that medium only, as if the engine had removed it there
// (BlockRemoved with that medium), and kept in the others.
//
// A bounded medium keeps its own pair of lists, with the same order as the
// overall ones restricted to the medium: a node per engine key held there
// (with a request key; orphans are bounded by the overall capacity alone),
// leaves — request keys without held children in that medium — first,
// least recently stored first. The nodes share evictState.nodes and its
// free list; the medium's map finds an engine key's node. Every operation
// that moves a key in the overall lists moves it in the medium's lists of
// the media involved: a store in m, or a store chained from it in m, to the
// most recent end; its request key's first child in m to the inner list,
// its last child in m leaving to the least recent end of the leaves. Each
// is one map lookup and O(1) list surgery, and each eviction removes a node
// that one store added, so eviction is O(1) amortised. An unbounded medium
// keeps no lists and costs nothing: GPU-only users pay no memory for this
// (a bounded medium: about 40 bytes per engine key held there).
//
// Duplicates are as in the overall lists: only the engine key last stored
// under a request key moves between a medium's leaves and inner blocks.

// SetMediumCapacity bounds endpoint e to blocks engine keys held in medium
// m (its KV capacity in that tier, in blocks of the index's block size); 0
// removes the bound. Blocks beyond it are dropped from m now and whenever
// a Stored call adds more. The overall bound (SetCapacity) still applies.
// Bounding a medium that already holds keys lists them in the order of the
// overall lists (least recent first). An out-of-range e or m is ignored.
func (ix *PreciseIndex) SetMediumCapacity(e int, m Medium, blocks int) {
	if ix.check(e, m) != nil {
		return
	}
	ep, bit, _ := ix.at(e)
	ep.mu.Lock()
	defer ep.mu.Unlock()
	t := &ep.tiers[m]
	if blocks <= 0 {
		for _, n := range t.nodes {
			ep.freeNode(n)
		}
		t.capacity, t.nodes = 0, nil
		return
	}
	if t.capacity == 0 {
		t.capacity = blocks
		t.nodes = make(map[uint64]uint32)
		for _, l := range []uint32{leafList, innerList} {
			for n := ep.nodes[l].next; n != l; n = ep.nodes[n].next {
				h := ep.nodes[n].key
				if ent, ok := ep.eng[h]; ok && ent.n.get(m) > 0 {
					ep.tierAdd(m, h)
					ep.touchIn(m, h)
				}
			}
		}
	}
	t.capacity = blocks
	ix.evictIn(ep, bit, m)
	syncHoley(ep, bit)
}

// tierAdd gives engine key h, just held in medium m, a node at the most
// recent end of m's leaves, if m is bounded. ep.mu is held.
func (ep *preciseEndpoint) tierAdd(m Medium, h uint64) {
	t := &ep.tiers[m]
	if t.nodes == nil {
		return
	}
	if _, ok := t.nodes[h]; ok {
		return
	}
	n := ep.allocNode(h)
	leaf, _ := tierLists(m)
	ep.link(n, leaf, false)
	t.nodes[h] = n
}

// tierDrop frees engine key h's node in medium m, if it has one. ep.mu is
// held.
func (ep *preciseEndpoint) tierDrop(m Medium, h uint64) {
	t := &ep.tiers[m]
	if t.nodes == nil {
		return
	}
	if n, ok := t.nodes[h]; ok {
		delete(t.nodes, h)
		ep.freeNode(n)
	}
}

// touchIn marks engine key h as just used in medium m: the most recent end
// of m's leaves or inner blocks. ep.mu is held.
func (ep *preciseEndpoint) touchIn(m Medium, h uint64) {
	t := &ep.tiers[m]
	if t.nodes == nil {
		return
	}
	n, ok := t.nodes[h]
	if !ok {
		return
	}
	leaf, inner := tierLists(m)
	l := leaf
	if ep.held[ep.eng[h].req].kids[m] != 0 {
		l = inner
	}
	ep.unlink(n)
	ep.link(n, l, false)
}

// relistIn moves engine key h, if it has a node in medium m, to m's leaves
// (toLeaf) or inner blocks, at the least recent end when lru. ep.mu is held.
func (ep *preciseEndpoint) relistIn(m Medium, h uint64, toLeaf, lru bool) {
	t := &ep.tiers[m]
	if h == 0 || t.nodes == nil {
		return
	}
	n, ok := t.nodes[h]
	if !ok {
		return
	}
	leaf, inner := tierLists(m)
	l := inner
	if toLeaf {
		l = leaf
	}
	ep.unlink(n)
	ep.link(n, l, lru)
}

// evictIn brings ep down to its capacity in medium m. ep.mu is held.
func (ix *PreciseIndex) evictIn(ep *preciseEndpoint, bit owner, m Medium) {
	t := &ep.tiers[m]
	leaf, inner := tierLists(m)
	for t.capacity > 0 && len(t.nodes) > t.capacity {
		n := ep.nodes[leaf].next
		if n == leaf {
			if n = ep.nodes[inner].next; n == inner {
				return // unreachable: every key held in m has a node
			}
		}
		h := ep.nodes[n].key
		ent, ok := ep.eng[h]
		if !ok || ent.n.get(m) == 0 {
			delete(t.nodes, h) // unreachable: a node without a key held in m
			ep.freeNode(n)
			continue
		}
		t.evicted++
		ix.dropIn(ep, bit, m, h, ent)
	}
}
