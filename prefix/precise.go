package prefix

import (
	"fmt"
	"math/bits"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

// Medium is a KV-cache tier an engine reports blocks in: the medium field of
// vLLM's BlockStored and BlockRemoved events (docs/PROTOCOLS.md §1.4; "GPU" for
// the GPU block pool, "CPU" from the offloading connectors).
type Medium uint8

// Media a PreciseIndex keeps apart. Names are matched case-insensitively by
// ParseMedium; a name it does not know is MediumOther.
const (
	MediumGPU Medium = iota
	MediumCPU
	MediumDisk
	// MediumRemote is a store shared by several engines (LMCache's remote
	// backends, Mooncake, infergate's kvstore), reported as "REMOTE".
	MediumRemote
	MediumOther
	// NumMedia is the number of media.
	NumMedia = 5
)

// ParseMedium returns the medium named name, case-insensitively: "" (the
// event's medium was null) and "GPU" are MediumGPU, "CPU" MediumCPU, "DISK"
// MediumDisk, "REMOTE" MediumRemote (the names of kvevent's Medium
// constants). Any other name is MediumOther, and known is false.
func ParseMedium(name string) (m Medium, known bool) {
	switch {
	case name == "" || strings.EqualFold(name, "GPU"):
		return MediumGPU, true
	case strings.EqualFold(name, "CPU"):
		return MediumCPU, true
	case strings.EqualFold(name, "DISK"):
		return MediumDisk, true
	case strings.EqualFold(name, "REMOTE"):
		return MediumRemote, true
	}
	return MediumOther, false
}

// String returns "GPU", "CPU", "DISK", "REMOTE" or "OTHER".
func (m Medium) String() string {
	switch m {
	case MediumGPU:
		return "GPU"
	case MediumCPU:
		return "CPU"
	case MediumDisk:
		return "DISK"
	case MediumRemote:
		return "REMOTE"
	case MediumOther:
		return "OTHER"
	}
	return fmt.Sprintf("Medium(%d)", uint8(m))
}

// preciseShards is the number of shards of each medium's block table, picked
// by the top 6 bits of the request key.
const preciseShards = 64

// PreciseIndex is the gateway's precise prefix index: which endpoint holds
// which blocks, in which medium, as the engines report it in their KV-cache
// events (kvevents.Subscriber feeds it), not as guessed from routing.
//
// It keeps two keys per block, like llm-d's KV-cache manager (docs/PROTOCOLS.md
// §1.7). The engines' block hashes ("engine keys") are opaque: they depend on
// the engine's hash algorithm and its per-process seed. The index's own
// "request keys" are Hashes over the event's token ids, chained from the
// parent block's request key, the first block of a sequence from a root seed
// the caller gives (Seed of the model or adapter name), so a prompt's
// Hashes — computed by the gateway from the prompt alone — look blocks up
// directly. Per endpoint it maps engine key → request key (to chain the next
// event from its parent and to evict), and counts, per medium, the engine
// blocks behind each request key: vLLM does not de-duplicate identical
// blocks, and engine keys that differ only in what request keys leave out
// (a cache salt, multimodal inputs) share one request key. The endpoint's
// bit for a block is set in a medium while that count is positive.
//
// Blocks whose parent the index does not know (its event was lost, or the
// gateway started after the engine cached it and there is no replay) are
// kept under their engine keys as orphans, and joined to request keys when a
// prompt the gateway routed to the endpoint explains them (precise_join.go).
//
// Each endpoint holds at most its capacity of engine keys (SetCapacity: the
// engine's blocks in all its tiers); beyond it the least recently stored
// leaf block is evicted as if the engine had removed it (precise_evict.go).
// SetMediumCapacity bounds one tier alike, dropping blocks from that medium
// only.
//
// Tiers: offloading connectors store a GPU block's copy in another medium
// without its tokens; Stored resolves it by engine key, and the engine key
// stays mapped while any medium holds it. MatchTiers answers, per endpoint,
// for every medium at once.
//
// Block tables are sharded 64 ways by request key, each shard behind its own
// RWMutex, so Match (read locks, one block at a time) is never held up for
// longer than a writer's update of one block; writers of one endpoint take
// that endpoint's mutex first.
//
// # More than 64 endpoints
//
// A block's owners are a 64-bit mask, so endpoints are kept in groups of
// MaxEndpoints (64), as in Index: endpoint e is bit e%64 of group e/64, and
// every group has its own 64 shards of block tables. A pool of at most 64
// endpoints is one group: the layout, the code path and the costs of the
// index before groups. NewPreciseIndex takes up to MaxIndexEndpoints
// (16,384). A block held in k groups has an owners entry in each (16 bytes
// of key and mask plus the map's overhead); Stored, Removed, Cleared and the
// capacities touch their endpoint's group only; Match bisects each group
// whose endpoints hold the prompt's first block, cut first at the lengths
// the first such group found (at most maxHints), and costs one lookup for
// each of the others. Grow adds endpoints in place and Move hands one
// endpoint's state to another (precise_grow.go).
//
// Limits: request keys see only tokens and the root seed, so blocks that
// differ only in a cache salt or in multimodal inputs (vLLM's extra_keys) are
// one block to the index, and a prompt may be credited with blocks the
// engine would not hit for it. The engines' block size must be the index's
// (llm-d also maps one engine block to several request blocks and back).
//
// Memory: 151 bytes per (endpoint, block) measured for 200k blocks on one
// endpoint (map slots in the endpoint's engine → request map, in its
// per-request-key entries — counts, kids counts, parent link for hole
// tracking, engine key for eviction order — in the eviction lists, and in
// the shared block table; TestPreciseIndexBytesPerBlock holds it under 160).
// It was 140 with four media: MediumRemote grew a heldEntry's per-medium
// counts from 32 to 40 bytes (engCounts are packed, so an engEntry stayed
// 16). About 24 of them are the block table's, paid once per distinct block
// however many endpoints hold it. An endpoint's capacity bounds its share.
//
// Safe for concurrent use.
type PreciseIndex struct {
	blockSize int
	// shape is the endpoints, in groups: endpoints 64g … 64g+63 are
	// groups[g]. Grow replaces it whole under growMu; readers and writers
	// load it once per call.
	shape  atomic.Pointer[preciseShape]
	growMu sync.Mutex

	storedEvents, removedEvents, clears atomic.Uint64
	unknownParents, unknownRemovals     atomic.Uint64
	unresolvedStores                    atomic.Uint64
	blocks                              atomic.Int64
}

// preciseGroup is the block tables of up to MaxEndpoints endpoints:
// endpoint e's bit is 1<<(e%64) in group e/64.
type preciseGroup struct {
	// holey[m] has the bit of every endpoint of the group with holes in
	// medium m, or whose kids counts saturated there (Match scans them
	// linearly): one load per group for Match instead of two per
	// endpoint. Kept by syncHoley before every writer returns.
	holey [NumMedia]atomic.Uint64
	_     [64 - 8*NumMedia%64]byte
	// bits[m] counts the (endpoint, request key) bits set in the group's
	// owner tables of medium m, kept exact by setBit, clearBit and
	// moveBits under the shard's lock (raised before a bit is set, lowered
	// after it is cleared), so that a Match or Owners of a medium the group
	// holds nothing in costs one atomic load instead of a shard lookup.
	bits   [NumMedia]atomic.Int64
	_      [64 - 8*NumMedia%64]byte
	shards [preciseShards]preciseShard
	// eps are the group's endpoints; those at or past the index's
	// Endpoints() are untouched (nil maps) until Grow resets them.
	eps [MaxEndpoints]preciseEndpoint
}

// preciseShape is a PreciseIndex's endpoints: n of them, in groups of
// MaxEndpoints (the last possibly part full). Grow publishes a new shape
// that shares every group of the old one (copy on write of the slice, not
// of the groups), so a call that loaded the old shape works on the same
// endpoints and block tables as one that loads the new.
type preciseShape struct {
	groups []*preciseGroup
	n      int
}

// endpoint returns endpoint e's state and where its bit lives (0 <= e < s.n).
func (s *preciseShape) endpoint(e int) (*preciseEndpoint, owner) {
	g := s.groups[e/MaxEndpoints]
	return &g.eps[e%MaxEndpoints], owner{g: g, bit: uint64(1) << (e % MaxEndpoints)}
}

// newPreciseGroup returns a group with empty block tables and its
// endpoints not yet reset.
func newPreciseGroup() *preciseGroup {
	g := new(preciseGroup)
	for i := range g.shards {
		for m := range g.shards[i].owners {
			g.shards[i].owners[m] = make(map[uint64]uint64)
		}
	}
	return g
}

type preciseShard struct {
	mu     sync.RWMutex
	owners [NumMedia]map[uint64]uint64 // request key -> bitmask of the group's endpoints
	_      [64]byte                    // keep hot shards off each other's cache lines
}

// owner is where an endpoint's bit lives: its group's block tables and its
// bit in that group's masks.
type owner struct {
	g   *preciseGroup
	bit uint64
}

// at returns endpoint e's state and owner bit, ok false for an
// out-of-range e.
func (ix *PreciseIndex) at(e int) (ep *preciseEndpoint, o owner, ok bool) {
	s := ix.shape.Load()
	if e < 0 || e >= s.n {
		return nil, owner{}, false
	}
	ep, o = s.endpoint(e)
	return ep, o, true
}

// endpoint returns endpoint e's state (0 <= e < Endpoints()).
func (ix *PreciseIndex) endpoint(e int) *preciseEndpoint {
	ep, _ := ix.shape.Load().endpoint(e)
	return ep
}

// group returns group g (0 <= g < Groups()).
func (ix *PreciseIndex) group(g int) *preciseGroup { return ix.shape.Load().groups[g] }

// syncHoley brings ep's bit (o) in its group's holey masks up to date with
// its hole counts and saturation. Every writer of ep calls it before
// releasing ep.mu, so without concurrent writers Match sees every
// endpoint's true state; with them, a Match may mix states (as it does
// anyway). ep.mu is held.
func syncHoley(ep *preciseEndpoint, o owner) {
	for m := range ep.holes {
		want := ep.holes[m].Load() != 0 || ep.saturated[m].Load()
		if have := o.g.holey[m].Load()&o.bit != 0; want != have {
			if want {
				o.g.holey[m].Or(o.bit)
			} else {
				o.g.holey[m].And(^o.bit)
			}
		}
	}
}

// mediaCounts counts blocks per medium (saturating at 65535).
type mediaCounts [NumMedia]uint16

// engCounts counts the blocks of one engine key per medium, 6 bits per
// medium packed in a uint32 (saturating at 63: more identical blocks than
// that in one tier are not told apart), so that an engEntry stays 16 bytes
// with five media.
type engCounts uint32

const (
	engCountBits        = 6
	maxEngCount  uint8  = 1<<engCountBits - 1
	engCountMask uint32 = 1<<engCountBits - 1
)

// get returns the count of medium m.
func (c engCounts) get(m Medium) uint8 {
	return uint8(uint32(c) >> (engCountBits * uint32(m)) & engCountMask)
}

// set returns c with medium m's count n (at most maxEngCount).
func (c engCounts) set(m Medium, n uint8) engCounts {
	sh := engCountBits * uint32(m)
	return engCounts(uint32(c)&^(engCountMask<<sh) | uint32(n)<<sh)
}

// engEntry is one engine key of an endpoint: its request key, how many
// blocks with that engine key the endpoint holds in each medium, and its
// node in the endpoint's eviction lists.
type engEntry struct {
	req  uint64
	n    engCounts
	node uint32
}

type preciseEndpoint struct {
	mu     sync.Mutex
	eng    map[uint64]engEntry  // engine key -> request key, counts
	held   map[uint64]heldEntry // request key -> engine blocks per medium, chain links
	blocks [NumMedia]int        // request keys with a positive count, per medium
	keys   []uint64             // scratch: request keys of one event
	// holes[m] counts the request keys held in medium m whose parent is not
	// held there (a prefix with a gap: the engine evicted an ancestor but
	// kept a descendant). While it is 0 the endpoint's blocks are
	// prefix-closed and Match may bisect; written under mu, read by Match.
	holes [NumMedia]atomic.Int64
	// saturated[m] is set when a kids count saturated in medium m: holes[m]
	// is then unreliable, and Match scans the endpoint linearly until reset.
	saturated [NumMedia]atomic.Bool

	evictState // precise_evict.go
	joinState  // precise_join.go

	evicted, unknownParents, joined, orphansDropped atomic.Uint64
	unresolvedStores                                atomic.Uint64
}

// heldEntry is one request key of an endpoint: how many engine blocks with
// it the endpoint holds per medium, how many of its children (request keys
// chained from it) are held per medium, its own parent, and its engine key.
type heldEntry struct {
	c    mediaCounts
	kids mediaCounts // saturating: a saturated count makes the endpoint holey until cleared
	// parent is the request key it is chained from; rootParent when it is
	// chained from a seed; 0 while unknown (an entry created only to count
	// the kids of a key the endpoint does not hold).
	parent uint64
	// eng is the engine key last stored under it (0: none known), whose
	// eviction-list node moves as the key gains and loses children.
	eng uint64
}

// rootParent marks a request key chained from a seed, not from a block.
const rootParent = ^uint64(0)

// PreciseStats are a PreciseIndex's cumulative event counters and its size.
type PreciseStats struct {
	// StoredEvents and RemovedEvents count applied Stored and Removed calls;
	// Clears counts Cleared and Forget calls.
	StoredEvents, RemovedEvents, Clears uint64
	// UnknownParents counts Stored calls whose parent block was unknown on
	// the endpoint (neither joined nor kept as an orphan).
	UnknownParents uint64
	// UnknownRemovals counts removed engine keys the endpoint did not hold in
	// that medium (ignored).
	UnknownRemovals uint64
	// UnresolvedStores counts the blocks of Stored calls without tokens (an
	// offloading connector's event) whose engine key the endpoint did not
	// know (skipped).
	UnresolvedStores uint64
	// Blocks is the number of (endpoint, medium, request key) entries held.
	Blocks int64
}

// PreciseEndpointStats are one endpoint's counters and sizes.
type PreciseEndpointStats struct {
	// EngineKeys counts the engine keys held with a request key, Orphans
	// those kept without one (their parent unknown); Capacity bounds the two
	// together (0: no bound).
	EngineKeys, Orphans, Capacity int
	// Evicted counts engine keys evicted because the endpoint held more than
	// its capacity.
	Evicted uint64
	// UnknownParents counts Stored calls whose parent the endpoint did not
	// know; Joined those (and calls chained from orphans) joined to a routed
	// prompt; OrphansDropped the orphan engine keys evicted or forgotten
	// before they were joined.
	UnknownParents, Joined, OrphansDropped uint64
	// UnresolvedStores counts the blocks of Stored calls without tokens
	// whose engine key the endpoint did not know (skipped).
	UnresolvedStores uint64
	// MediumCapacity is the bound per medium (SetMediumCapacity; 0: none),
	// MediumEvicted the engine keys dropped from a medium because the
	// endpoint held more than its bound there.
	MediumCapacity [NumMedia]int
	MediumEvicted  [NumMedia]uint64
}

// NewPreciseIndex returns an empty index over endpoints endpoints (at most
// MaxIndexEndpoints, in groups of MaxEndpoints) whose blocks are blockSize
// tokens long (the block size the gateway hashes prompts with, which must
// equal the engines' block size). Endpoints are unbounded until SetCapacity.
func NewPreciseIndex(endpoints, blockSize int) (*PreciseIndex, error) {
	if endpoints < 0 || endpoints > MaxIndexEndpoints {
		return nil, fmt.Errorf("precise prefix index: %d endpoints, want 0 to %d", endpoints, MaxIndexEndpoints)
	}
	if blockSize <= 0 {
		return nil, fmt.Errorf("precise prefix index: block size %d, want > 0", blockSize)
	}
	ix := &PreciseIndex{blockSize: blockSize}
	s := &preciseShape{n: endpoints, groups: make([]*preciseGroup, max(1, (endpoints+MaxEndpoints-1)/MaxEndpoints))}
	for g := range s.groups {
		s.groups[g] = newPreciseGroup()
	}
	for e := range endpoints {
		ep, _ := s.endpoint(e)
		ep.reset()
	}
	ix.shape.Store(s)
	return ix, nil
}

func (ep *preciseEndpoint) reset() {
	ep.eng = make(map[uint64]engEntry)
	ep.held = make(map[uint64]heldEntry)
	ep.blocks = [NumMedia]int{}
	for m := range ep.holes {
		ep.holes[m].Store(0)
		ep.saturated[m].Store(false)
	}
	ep.resetLists()
	ep.resetOrphans()
}

// pinned reports whether request key req has held children (in any medium).
// ep.mu is held.
func (ep *preciseEndpoint) pinned(req uint64) bool {
	return ep.held[req].kids != (mediaCounts{})
}

// gained records that request key req (chained from parent, or from a seed
// when root) became held in medium m: its held children stop being holes,
// and it is one itself if its parent is not held. A parent that had no
// children is no longer a leaf. ep.mu is held.
func (ep *preciseEndpoint) gained(m Medium, req uint64, h *heldEntry) {
	if h.kids[m] != ^uint16(0) {
		ep.holes[m].Add(-int64(h.kids[m]))
	}
	if h.parent == rootParent {
		return
	}
	p := ep.held[h.parent]
	wasLeaf, wasLeafIn := p.kids == (mediaCounts{}), p.kids[m] == 0
	if p.c[m] == 0 {
		ep.holes[m].Add(1)
	}
	if p.kids[m] == ^uint16(0)-1 {
		// Saturating: from now on this parent's kids are not counted, so
		// hole counts are unreliable and the endpoint is matched linearly
		// until it is cleared.
		ep.saturated[m].Store(true)
	}
	if p.kids[m] != ^uint16(0) {
		p.kids[m]++
	}
	ep.held[h.parent] = p
	if wasLeaf {
		ep.relist(p.eng, innerList, false)
	}
	if wasLeafIn {
		ep.relistIn(m, p.eng, false, false)
	}
}

// lost records that request key req stopped being held in medium m: its
// held children become holes, and if it was a hole that hole is gone. A
// parent left without children becomes the next leaf to evict. ep.mu is
// held.
func (ep *preciseEndpoint) lost(m Medium, h *heldEntry) {
	if h.kids[m] != ^uint16(0) {
		ep.holes[m].Add(int64(h.kids[m]))
	}
	if h.parent == rootParent {
		return
	}
	p, ok := ep.held[h.parent]
	if !ok {
		return
	}
	if p.c[m] == 0 {
		ep.holes[m].Add(-1)
	}
	if p.kids[m] != ^uint16(0) {
		p.kids[m]--
	}
	ep.put(h.parent, p)
	if p.kids == (mediaCounts{}) {
		// A parent is used at least as recently as its children: it goes
		// right after the child that was the least recent.
		ep.relist(p.eng, leafList, true)
	}
	if p.kids[m] == 0 {
		ep.relistIn(m, p.eng, true, true)
	}
}

// put stores h under req, or deletes it when it records nothing. ep.mu is held.
func (ep *preciseEndpoint) put(req uint64, h heldEntry) {
	if h.c == (mediaCounts{}) && h.kids == (mediaCounts{}) {
		delete(ep.held, req)
		return
	}
	ep.held[req] = h
}

// Endpoints returns the number of endpoints the index tracks.
func (ix *PreciseIndex) Endpoints() int { return ix.shape.Load().n }

// BlockSize returns the block size in tokens.
func (ix *PreciseIndex) BlockSize() int { return ix.blockSize }

// Groups returns the number of endpoint groups: endpoints 64g … 64g+63 are
// group g (Owners).
func (ix *PreciseIndex) Groups() int { return len(ix.shape.Load().groups) }

func (g *preciseGroup) shard(req uint64) *preciseShard { return &g.shards[req>>58] }

func (ix *PreciseIndex) check(e int, m Medium) error {
	if n := ix.Endpoints(); e < 0 || e >= n {
		return fmt.Errorf("precise prefix index: endpoint %d out of range [0, %d)", e, n)
	}
	if m >= NumMedia {
		return fmt.Errorf("precise prefix index: unknown medium %d", m)
	}
	return nil
}

// Stored records a BlockStored event of endpoint e: the blocks with engine
// keys engineHashes, whose tokens (concatenated) are tokens, are now held in
// medium m. len(tokens) must be len(engineHashes) × BlockSize, or 0. The
// first block's request key is chained from the request key of the parent
// block (engine key parent) when hasParent, else from seed (the root: Seed
// of the model or adapter name the blocks were computed under).
//
// If the parent is not held by e in any medium, or is an orphan, the event
// is joined to a prompt recently routed to e when one explains it (Routed;
// the prompt's blocks before it are then held too), and its blocks are kept
// as orphans otherwise (precise_join.go). Either way it is not an error.
//
// Without tokens (vLLM's CPU offloading connector stores a block it copied
// from the GPU pool with empty token_ids and, usually, a null parent;
// llm-d-kv-cache docs/architecture.md) each block is resolved by its engine
// key alone: a key e knows with a request key (from an event with tokens, in
// any medium) is held in m under that request key, chained from the same
// parent as before; an orphan key is held in m as an orphan; an unknown key
// is skipped and counted (UnresolvedStores). parent, hasParent and seed are
// then not used.
//
// Afterwards e holds at most its capacity (SetCapacity) and, in each
// medium, its capacity there (SetMediumCapacity).
func (ix *PreciseIndex) Stored(e int, m Medium, engineHashes []uint64, parent uint64, hasParent bool, tokens []uint32, seed uint64) error {
	if err := ix.check(e, m); err != nil {
		return err
	}
	tokenless := len(tokens) == 0 && len(engineHashes) > 0
	if !tokenless && len(tokens) != len(engineHashes)*ix.blockSize {
		return fmt.Errorf("precise prefix index: %d tokens for %d blocks of %d", len(tokens), len(engineHashes), ix.blockSize)
	}
	ep, bit, _ := ix.at(e)
	ep.mu.Lock()
	defer ep.mu.Unlock()
	defer syncHoley(ep, bit)
	defer ix.evict(ep, bit)
	ix.storedEvents.Add(1)
	if tokenless {
		ix.resolve(ep, bit, m, engineHashes)
		return nil
	}
	if hasParent {
		p, ok := ep.eng[parent]
		if !ok {
			_, orphan := ep.orphans[parent]
			if !orphan {
				ix.unknownParents.Add(1)
				ep.unknownParents.Add(1)
			}
			req, joined := ix.join(ep, bit, m, parent, engineHashes, tokens)
			if !joined {
				ix.storeOrphans(ep, bit, m, parent, engineHashes)
				return nil
			}
			p = engEntry{req: req}
		}
		seed = p.req
	}
	ep.keys = Hashes(ep.keys[:0], tokens, ix.blockSize, seed)
	for i, h := range engineHashes {
		parentReq := rootParent
		switch {
		case i > 0:
			parentReq = ep.keys[i-1]
		case hasParent:
			parentReq = seed // the parent block's request key
		}
		ix.hold(ep, bit, m, h, ep.keys[i], parentReq)
	}
	if hasParent {
		ep.touch(parent) // the request that stored the blocks used it
		ep.touchIn(m, parent)
	}
	return nil
}

// resolve holds the blocks engineHashes, stored in medium m without
// tokens, under the request keys ep knows them by (see Stored). ep.mu is
// held.
func (ix *PreciseIndex) resolve(ep *preciseEndpoint, bit owner, m Medium, engineHashes []uint64) {
	for _, h := range engineHashes {
		if ent, ok := ep.eng[h]; ok {
			ix.hold(ep, bit, m, h, ent.req, ep.held[ent.req].parent)
			continue
		}
		if o, ok := ep.orphans[h]; ok {
			if c := o.n.get(m); c < maxEngCount {
				o.n = o.n.set(m, c+1)
				ep.orphans[h] = o
			}
			ep.touch(h)
			continue
		}
		ix.unresolvedStores.Add(1)
		ep.unresolvedStores.Add(1)
	}
}

// hold records one block with engine key h and request key req, chained
// from request key parentReq (rootParent: from a seed), as held by ep in
// medium m. ep.mu is held.
func (ix *PreciseIndex) hold(ep *preciseEndpoint, bit owner, m Medium, h, req, parentReq uint64) {
	ent, ok := ep.eng[h]
	if ok && ent.req != req {
		// The engine reused an engine key for other tokens: trust the
		// newer event and drop what the old mapping held.
		ix.dropEngineKey(ep, bit, h, ent)
		ok = false
	}
	var adopted engCounts
	if !ok {
		if o, orphan := ep.orphans[h]; orphan {
			// Known as an orphan, now with a request key: its blocks are
			// held under it too (after this one).
			delete(ep.orphans, h)
			ep.freeNode(o.node)
			adopted = o.n
		}
	}
	he := ep.held[req]
	if he.parent == 0 {
		he.parent = parentReq
	}
	if ent.n.get(m) == maxEngCount || he.c[m] == ^uint16(0) {
		if ok {
			ep.touch(h)
			ep.touchIn(m, h)
		}
		return // saturated: a later removal may forget the block early
	}
	if !ok {
		ent = engEntry{req: req, node: ep.newNode(h)}
	}
	if ent.n.get(m) == 0 {
		ep.tierAdd(m, h)
	}
	ent.n = ent.n.set(m, ent.n.get(m)+1)
	ep.eng[h] = ent
	he.c[m]++
	prevEng := he.eng
	he.eng = h
	ep.held[req] = he
	if he.c[m] == 1 {
		setBit(m, req, bit)
		ep.blocks[m]++
		ix.blocks.Add(1)
		ep.gained(m, req, &he)
	}
	ep.touch(h)
	ep.touchIn(m, h)
	if prevEng != h {
		// h is now the engine key that moves for req in every medium's
		// lists; its nodes in other media may sit in the list of another
		// kids count: they move too, as just used.
		for md := range Medium(NumMedia) {
			if md != m {
				ep.touchIn(md, h)
			}
		}
	}
	if ep.synthetic > 0 && h != syntheticKey(req) {
		ix.dropSynthetic(ep, bit, m, req)
	}
	for md := range Medium(NumMedia) {
		for range adopted.get(md) {
			ix.hold(ep, bit, md, h, req, parentReq)
		}
	}
}

// Removed records a BlockRemoved event of endpoint e: one block per engine
// key of engineHashes is no longer held in medium m. Keys e does not hold in
// m are ignored (and counted). An out-of-range e or m is ignored.
func (ix *PreciseIndex) Removed(e int, m Medium, engineHashes []uint64) {
	if ix.check(e, m) != nil {
		return
	}
	ep, bit, _ := ix.at(e)
	ep.mu.Lock()
	defer ep.mu.Unlock()
	defer syncHoley(ep, bit)
	for _, h := range engineHashes {
		ent, ok := ep.eng[h]
		if !ok || ent.n.get(m) == 0 {
			if !ep.removeOrphan(m, h) {
				ix.unknownRemovals.Add(1)
			}
			continue
		}
		ent.n = ent.n.set(m, ent.n.get(m)-1)
		if ent.n.get(m) == 0 {
			ep.tierDrop(m, h)
		}
		if ent.n == 0 {
			ix.forgetEngineKey(ep, h, ent)
		} else {
			ep.eng[h] = ent
		}
		ix.release(ep, bit, m, ent.req, 1)
	}
	ix.removedEvents.Add(1)
}

// release takes n blocks of request key req in medium m away from ep,
// clearing its bit when none is left. ep.mu is held.
func (ix *PreciseIndex) release(ep *preciseEndpoint, bit owner, m Medium, req uint64, n uint16) {
	he := ep.held[req]
	if he.c[m] <= n { // < only after saturation
		if he.c[m] > 0 {
			clearBit(m, req, bit)
			ep.blocks[m]--
			ix.blocks.Add(-1)
			he.c[m] = 0
			ep.held[req] = he
			ep.lost(m, &he)
			he = ep.held[req] // lost touched req itself only on a hash cycle
		}
	} else {
		he.c[m] -= n
	}
	ep.put(req, he)
}

// dropEngineKey forgets engine key h of ep and every block it held. ep.mu is held.
func (ix *PreciseIndex) dropEngineKey(ep *preciseEndpoint, bit owner, h uint64, ent engEntry) {
	ix.forgetEngineKey(ep, h, ent)
	for m := range Medium(NumMedia) {
		if n := ent.n.get(m); n > 0 {
			ix.release(ep, bit, m, ent.req, uint16(n))
		}
	}
}

// dropIn takes every block of engine key h (entry ent) away from ep in
// medium m, and keeps what h holds in other media. ep.mu is held.
func (ix *PreciseIndex) dropIn(ep *preciseEndpoint, bit owner, m Medium, h uint64, ent engEntry) {
	n := ent.n.get(m)
	ent.n = ent.n.set(m, 0)
	ep.tierDrop(m, h)
	if ent.n == 0 {
		ix.forgetEngineKey(ep, h, ent)
	} else {
		ep.eng[h] = ent
	}
	ix.release(ep, bit, m, ent.req, uint16(n))
}

// forgetEngineKey deletes engine key h (entry ent) from ep's map and lists;
// the blocks it held are the caller's to release. ep.mu is held.
func (ix *PreciseIndex) forgetEngineKey(ep *preciseEndpoint, h uint64, ent engEntry) {
	delete(ep.eng, h)
	ep.freeNode(ent.node)
	for m := range Medium(NumMedia) {
		ep.tierDrop(m, h)
	}
	if h == syntheticKey(ent.req) {
		ep.synthetic--
	}
	if he, ok := ep.held[ent.req]; ok && he.eng == h {
		he.eng = 0
		ep.held[ent.req] = he
	}
}

// Cleared records an AllBlocksCleared event of endpoint e: it holds nothing,
// in any medium. An out-of-range e is ignored.
func (ix *PreciseIndex) Cleared(e int) {
	ep, bit, ok := ix.at(e)
	if !ok {
		return
	}
	ep.mu.Lock()
	defer ep.mu.Unlock()
	defer syncHoley(ep, bit)
	ix.clearLocked(ep, bit)
	ix.clears.Add(1)
}

// clearLocked forgets every block and orphan of ep (owner bit). ep.mu is
// held; the caller syncs the holey masks.
func (ix *PreciseIndex) clearLocked(ep *preciseEndpoint, bit owner) {
	var n int64
	for req, h := range ep.held {
		for m, k := range h.c {
			if k > 0 {
				clearBit(Medium(m), req, bit)
				n++
			}
		}
	}
	ix.blocks.Add(-n)
	ep.orphansDropped.Add(uint64(len(ep.orphans)))
	ep.reset()
}

// ClearedMedium records a TierBlocksCleared event of endpoint e (vLLM with
// tier_scoped_clear_events, vllm/distributed/kv_events.py: a prefix-cache
// reset that cleared only the GPU block pool): it holds nothing in medium
// m, and keeps what it holds in other media. An out-of-range e or m is
// ignored.
func (ix *PreciseIndex) ClearedMedium(e int, m Medium) {
	if ix.check(e, m) != nil {
		return
	}
	ep, bit, _ := ix.at(e)
	ep.mu.Lock()
	defer ep.mu.Unlock()
	defer syncHoley(ep, bit)
	for h, ent := range ep.eng {
		if ent.n.get(m) > 0 {
			ix.dropIn(ep, bit, m, h, ent)
		}
	}
	for h, o := range ep.orphans {
		if n := o.n.get(m); n > 0 {
			ep.orphansDropped.Add(uint64(n))
			for ; n > 0; n-- {
				ep.removeOrphan(m, h)
			}
		}
	}
	ix.clears.Add(1)
}

// Forget drops everything known about endpoint e, for example when its event
// stream lost batches or its engine restarted: forgetting is safe, believing
// stale state is not. It is Cleared under another name (the prompts routed
// to e are forgotten too).
func (ix *PreciseIndex) Forget(e int) {
	if ep, _, ok := ix.at(e); ok {
		ep.forgetRouted()
	}
	ix.Cleared(e)
}

// setBit sets o's bit for request key req in medium m.
func setBit(m Medium, req uint64, o owner) {
	s := o.g.shard(req)
	s.mu.Lock()
	if v := s.owners[m][req]; v&o.bit == 0 {
		o.g.bits[m].Add(1)
		s.owners[m][req] = v | o.bit
	}
	s.mu.Unlock()
}

// clearBit clears o's bit for request key req in medium m.
func clearBit(m Medium, req uint64, o owner) {
	s := o.g.shard(req)
	s.mu.Lock()
	if v, ok := s.owners[m][req]; ok && v&o.bit != 0 {
		if v &^= o.bit; v == 0 {
			delete(s.owners[m], req)
		} else {
			s.owners[m][req] = v
		}
		o.g.bits[m].Add(-1)
	}
	s.mu.Unlock()
}

// Match sets matched[e] to the number of leading blocks of hashes (request
// keys: Hashes of a prompt under the seed its blocks are stored with) that
// endpoint e holds in medium m, for every e < len(matched) (extra entries
// are left alone). It allocates nothing.
//
// Engines usually evict prefix-closed — vLLM frees a finished request's
// blocks tail first, so a parent is always at least as recently used as its
// child (vllm/v1/core/block_pool.py free_blocks) — but not always (a shared
// ancestor can be evicted while a descendant is still in use elsewhere). The
// index counts, per endpoint and medium, the held blocks whose parent is not
// held ("holes", kept exact by Stored/Removed). Endpoints without holes hold
// prefix-closed sets, so for them owners(h_i) is non-increasing along the
// prompt and Match bisects: O(distinct lengths × log n) lookups instead of
// n. Endpoints with holes get the linear scan, which stops at the first gap
// as the engine's own prefix lookup does. Each lookup takes one shard read
// lock; under concurrent updates the result mixes states from before and
// after them, as any unlocked read would.
//
// With more than 64 endpoints each group of 64 is matched on its own block
// tables, as one index of at most 64 endpoints is: a group none of whose
// endpoints holds the prompt's first block costs one lookup.
func (ix *PreciseIndex) Match(hashes []uint64, m Medium, matched []int) {
	s := ix.shape.Load()
	n := min(len(matched), s.n)
	matched = matched[:n]
	for e := range matched {
		matched[e] = 0
	}
	if n == 0 || len(hashes) == 0 || m >= NumMedia {
		return
	}
	if len(s.groups) == 1 {
		s.groups[0].match(hashes, m, matched, nil, false)
		return
	}
	// More than one group: the lengths the first group that holds the
	// prompt's first block found (at most maxHints of them: a shared
	// system prompt's end is usually every group's) are where the others
	// are cut first, before they bisect what is left. When every endpoint
	// of that group held the first block (lead: a prefix the pool shares),
	// the others read the cuts before the prompt's ends: two lookups for a
	// group whose endpoints all stop at the hint, against four (matchBisect).
	var hints [maxHints]int
	nh, lead := -1, false
	for g := range s.groups {
		lo := g * MaxEndpoints
		if lo >= n {
			break
		}
		hi := min(n, lo+MaxEndpoints)
		found := s.groups[g].match(hashes, m, matched[lo:hi], hints[:max(nh, 0)], lead)
		if nh < 0 && found {
			nh, lead = 0, true
			for _, k := range matched[lo:hi] {
				lead = lead && k > 0
				if k > 0 && k < len(hashes) && !slices.Contains(hints[:nh], k) {
					if nh == maxHints {
						nh = 0 // too many lengths to be worth the lookups
						break
					}
					hints[nh] = k
					nh++
				}
			}
			lead = lead && nh > 0
		}
	}
}

// match is Match of one group: matched has an entry, zeroed, for each of
// the group's first len(matched) endpoints (at most 64; bit e of its masks
// for matched[e]). The bisection cuts first at hints (lengths), read
// before the prompt's ends when lead (matchBisect). It reports whether an
// endpoint bisected holds the prompt's first block.
func (g *preciseGroup) match(hashes []uint64, m Medium, matched []int, hints []int, lead bool) (found bool) {
	if g.bits[m].Load() == 0 {
		return false // the group holds nothing in m
	}
	alive := ^uint64(0) >> (64 - len(matched))
	holey := g.holey[m].Load() & alive
	if closed := alive &^ holey; closed != 0 {
		found = g.matchBisect(hashes, m, matched, closed, hints, lead)
	}
	if holey != 0 {
		matchLinear(hashes, matched, holey, func(h uint64) uint64 { return g.lookup(m, h) })
	}
	return found
}

// MatchEndpoint returns the number of leading blocks of hashes endpoint e
// holds in medium m: Match's matched[e], matching e's group of 64 only (0
// for an out-of-range e or m). It allocates nothing.
func (ix *PreciseIndex) MatchEndpoint(hashes []uint64, m Medium, e int) int {
	if ix.check(e, m) != nil || len(hashes) == 0 {
		return 0
	}
	var buf [MaxEndpoints]int
	s := ix.shape.Load()
	g := e / MaxEndpoints
	lo := g * MaxEndpoints
	hi := min(s.n, lo+MaxEndpoints)
	one := buf[:hi-lo]
	s.groups[g].match(hashes, m, one, nil, false)
	return one[e-lo]
}

// MatchPast is Match for a caller that needs only the blocks past a floor
// per endpoint (sched.Tiers.Split: a lower tier's blocks past the GPU's):
// for every e < len(matched) (len(from) >= len(matched)), matched[e] is
// the number of leading blocks of hashes endpoint e holds in medium m when
// that number exceeds from[e], and some number at most from[e] otherwise.
// An endpoint whose blocks are prefix-closed holds more than from[e]
// leading blocks exactly when it holds block from[e], so per group the
// endpoints of each distinct floor cost one lookup there, and those that
// hold it a bisection of the rest of the prompt; Match's bisection from
// the first block re-proves the prefix the floor already stands for. A
// group with more than maxHints distinct floors among its prefix-closed
// endpoints, and its holey endpoints, are matched as Match does. It
// allocates nothing.
func (ix *PreciseIndex) MatchPast(hashes []uint64, m Medium, from, matched []int) {
	s := ix.shape.Load()
	n := min(len(matched), s.n)
	matched = matched[:n]
	clear(matched)
	if n == 0 || len(hashes) == 0 || m >= NumMedia {
		return
	}
	for g := range s.groups {
		lo := g * MaxEndpoints
		if lo >= n {
			break
		}
		hi := min(n, lo+MaxEndpoints)
		s.groups[g].matchPast(hashes, m, from[lo:hi], matched[lo:hi])
	}
}

// matchPast is MatchPast of one group: matched has an entry, zeroed, for
// each of the group's first len(matched) endpoints, from their floors.
func (g *preciseGroup) matchPast(hashes []uint64, m Medium, from, matched []int) {
	if g.bits[m].Load() == 0 {
		return
	}
	alive := ^uint64(0) >> (64 - len(matched))
	holey := g.holey[m].Load() & alive
	closed := alive &^ holey
	var floors [maxHints]int
	var sets [maxHints]uint64
	nf := 0
	for s := closed; s != 0; s &= s - 1 {
		e := bits.TrailingZeros64(s)
		f := min(max(from[e], 0), len(hashes))
		i := slices.Index(floors[:nf], f)
		if i < 0 {
			if nf == maxHints { // no pattern: bisect from the first block
				nf = -1
				break
			}
			i = nf
			floors[i] = f
			nf++
		}
		sets[i] |= 1 << e
	}
	if nf < 0 {
		if closed != 0 {
			g.matchBisect(hashes, m, matched, closed, nil, false)
		}
	} else {
		for i, f := range floors[:nf] {
			switch {
			case f >= len(hashes): // nothing past the prompt: 0 stands
			case f == 0:
				g.matchBisect(hashes, m, matched, sets[i], nil, false)
			default:
				past := g.lookup(m, hashes[f]) & sets[i]
				if past == 0 {
					continue
				}
				g.matchBisect(hashes[f:], m, matched, past, nil, false)
				for s := past; s != 0; s &= s - 1 {
					matched[bits.TrailingZeros64(s)] += f
				}
			}
		}
	}
	if holey != 0 {
		matchLinear(hashes, matched, holey, func(h uint64) uint64 { return g.lookup(m, h) })
	}
}

// MatchTiers sets matched[e][m] to the number of leading blocks of hashes
// endpoint e holds in medium m, for every medium and every e <
// len(matched) (extra entries are left alone): Match once per medium, for
// scoring endpoints by what each tier holds. It allocates nothing. Cost:
// NumMedia Matches; a medium no endpoint holds the prompt's first block in
// costs one lookup per group (BenchmarkPreciseMatchTiers: 8 endpoints, a
// 1000-block prompt in 4 media, a few µs).
func (ix *PreciseIndex) MatchTiers(hashes []uint64, matched [][NumMedia]int) {
	s := ix.shape.Load()
	n := min(len(matched), s.n)
	var one [MaxEndpoints]int
	for g := range s.groups {
		lo := g * MaxEndpoints
		if lo >= n {
			break
		}
		hi := min(n, lo+MaxEndpoints)
		for m := range Medium(NumMedia) {
			part := one[:hi-lo]
			clear(part)
			if len(hashes) > 0 {
				s.groups[g].match(hashes, m, part, nil, false)
			}
			for e := range part {
				matched[lo+e][m] = part[e]
			}
		}
	}
}

// Owners returns the endpoints of group g (endpoints 64g … 64g+63; Groups)
// holding request key h in medium m, as a bitmask (bit i for endpoint
// 64g+i): one shard read lock, no allocation. 0 for an out-of-range g or
// m.
func (ix *PreciseIndex) Owners(h uint64, m Medium, g int) uint64 {
	s := ix.shape.Load()
	if m >= NumMedia || g < 0 || g >= len(s.groups) {
		return 0
	}
	if s.groups[g].bits[m].Load() == 0 {
		return 0
	}
	return s.groups[g].lookup(m, h)
}

// Holey returns the endpoints of group g (bit i for endpoint 64g+i) whose
// blocks in medium m are not known to be prefix-closed: they hold a block
// whose parent they do not hold there, a kids count saturated, or a Move
// is under way. The others hold, for any prompt, exactly its first Match
// blocks in m and none after: a block past them is held only by an
// endpoint of Holey. One atomic load; 0 for an out-of-range g or m.
func (ix *PreciseIndex) Holey(m Medium, g int) uint64 {
	s := ix.shape.Load()
	if m >= NumMedia || g < 0 || g >= len(s.groups) {
		return 0
	}
	return s.groups[g].holey[m].Load()
}

// lookup returns the owners of request key h in medium m.
func (g *preciseGroup) lookup(m Medium, h uint64) uint64 {
	s := g.shard(h)
	s.mu.RLock()
	v := s.owners[m][h]
	s.mu.RUnlock()
	return v
}

// matchBisect is Match for endpoints (in set) whose blocks are
// prefix-closed: it settles, by bisection, where each stops holding the
// prompt, after cutting the prompt at both sides of every hint (a length
// L: blocks L-1 and L; hints must be distinct, in (0, len(hashes))). Masks
// read in between are clamped between their neighbours', which only
// matters when updates run concurrently. It reports whether an endpoint of
// set holds the first block.
//
// The prompt's first and last blocks are read first, and the cuts only
// when some endpoint holds the one and not the other; with lead (the
// hints are a prefix every endpoint of an earlier group held) the cuts
// are read first, in order, and the first block only when the first cut
// is not held by all of set, the last only when the last cut is held by
// some: a prefix-closed endpoint holds every block before one it holds and
// none after one it lacks, so the answer is the same (Match: a pool
// sharing a system prompt then costs two lookups a group, not four).
func (g *preciseGroup) matchBisect(hashes []uint64, m Medium, matched []int, set uint64, hints []int, lead bool) bool {
	last := len(hashes) - 1
	// The cuts, in order: c_1 < c_2 < ... strictly inside (0, last).
	var cuts [2 * maxHints]int
	nc := 0
	for _, h := range hints {
		for _, c := range [2]int{h - 1, h} {
			if c > 0 && c < last && !slices.Contains(cuts[:nc], c) {
				cuts[nc] = c
				nc++
			}
		}
	}
	slices.Sort(cuts[:nc])
	// masks[i] is the mask at cuts[i], clamped between its neighbours'.
	var masks [2 * maxHints]uint64
	var m0, mN uint64
	if lead && nc > 0 {
		prev := set
		for i, c := range cuts[:nc] {
			if prev != 0 {
				prev &= g.lookup(m, hashes[c])
			}
			masks[i] = prev
		}
		m0 = masks[0]
		if m0 != set {
			m0 |= g.lookup(m, hashes[0]) & set
		}
		if m0 == 0 {
			return false
		}
		if masks[nc-1] != 0 {
			mN = g.lookup(m, hashes[last]) & masks[nc-1]
		}
		for i := range masks[:nc] {
			masks[i] |= mN
		}
	} else {
		m0 = g.lookup(m, hashes[0]) & set
		if m0 == 0 {
			return false
		}
		mN = m0
		if last > 0 {
			mN = g.lookup(m, hashes[last]) & m0
		}
		if m0 == mN {
			nc = 0 // every endpoint holding the first block holds the prompt
		}
		prev := m0
		for i, c := range cuts[:nc] {
			masks[i] = g.lookup(m, hashes[c])&prev | mN
			prev = masks[i]
		}
	}
	for s := mN; s != 0; s &= s - 1 {
		matched[bits.TrailingZeros64(s)] = len(hashes)
	}
	type span struct {
		lo, hi   int
		mlo, mhi uint64
	}
	var stack [64 + 2*maxHints]span // depth ≤ log2(len(hashes)) + 1, and the hints' spans
	k := 0
	lo, hi, mlo, mhi := 0, last, m0, mN
	// The spans between the cuts go on the stack, the first is bisected
	// now.
	for i := nc - 1; i >= 0; i-- {
		end, mend := last, mN
		if i+1 < nc {
			end, mend = cuts[i+1], masks[i+1]
		}
		stack[k] = span{cuts[i], end, masks[i], mend}
		k++
	}
	if nc > 0 {
		hi, mhi = cuts[0], masks[0]
	}
	for {
		for mlo != mhi {
			if hi == lo+1 {
				for s := mlo &^ mhi; s != 0; s &= s - 1 {
					matched[bits.TrailingZeros64(s)] = lo + 1
				}
				break
			}
			mid := lo + (hi-lo)/2
			mm := g.lookup(m, hashes[mid])&mlo | mhi
			stack[k] = span{mid, hi, mm, mhi} // [mid, hi] after [lo, mid]
			k++
			hi, mhi = mid, mm
		}
		if k == 0 {
			return true
		}
		k--
		lo, hi, mlo, mhi = stack[k].lo, stack[k].hi, stack[k].mlo, stack[k].mhi
	}
}

// Len returns the number of distinct blocks (request keys) endpoint e holds
// in medium m.
func (ix *PreciseIndex) Len(e int, m Medium) int {
	if ix.check(e, m) != nil {
		return 0
	}
	ep := ix.endpoint(e)
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return ep.blocks[m]
}

// Stats returns the index's counters.
func (ix *PreciseIndex) Stats() PreciseStats {
	return PreciseStats{
		StoredEvents:     ix.storedEvents.Load(),
		RemovedEvents:    ix.removedEvents.Load(),
		Clears:           ix.clears.Load(),
		UnknownParents:   ix.unknownParents.Load(),
		UnknownRemovals:  ix.unknownRemovals.Load(),
		UnresolvedStores: ix.unresolvedStores.Load(),
		Blocks:           ix.blocks.Load(),
	}
}

// EndpointStats returns endpoint e's counters and sizes (zero for an
// out-of-range e).
func (ix *PreciseIndex) EndpointStats(e int) PreciseEndpointStats {
	ep, _, ok := ix.at(e)
	if !ok {
		return PreciseEndpointStats{}
	}
	ep.mu.Lock()
	st := PreciseEndpointStats{EngineKeys: len(ep.eng), Orphans: len(ep.orphans), Capacity: ep.capacity}
	for m := range ep.tiers {
		st.MediumCapacity[m], st.MediumEvicted[m] = ep.tiers[m].capacity, ep.tiers[m].evicted
	}
	ep.mu.Unlock()
	st.Evicted, st.UnknownParents = ep.evicted.Load(), ep.unknownParents.Load()
	st.Joined, st.OrphansDropped = ep.joined.Load(), ep.orphansDropped.Load()
	st.UnresolvedStores = ep.unresolvedStores.Load()
	return st
}

// On returns a view of the index for medium m whose Match has the shape of
// Index.Match (the scheduler's MatchSource).
func (ix *PreciseIndex) On(m Medium) MediumView { return MediumView{ix: ix, m: m} }

// MediumView is PreciseIndex restricted to one medium.
type MediumView struct {
	ix *PreciseIndex
	m  Medium
}

// Match is PreciseIndex.Match on the view's medium.
func (v MediumView) Match(hashes []uint64, matched []int) { v.ix.Match(hashes, v.m, matched) }
