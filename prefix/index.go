package prefix

import (
	"fmt"
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/infergate/infergate/internal/lru"
)

// MaxEndpoints is the size of an endpoint group in both indexes (one bit
// each in a 64-bit owner mask per block): an Index and a PreciseIndex keep
// their endpoints in groups of MaxEndpoints, up to MaxIndexEndpoints.
const MaxEndpoints = 64

// MaxIndexEndpoints is the number of endpoints one Index or PreciseIndex
// can track: groups of MaxEndpoints, each with its own owners table.
const MaxIndexEndpoints = 1 << 14

// Index is the gateway's approximate prefix index: for every block hash it
// remembers which endpoints were sent a prompt containing that block, bounded
// per endpoint by an LRU of capacity blocks so that it forgets roughly when the
// engine's own KV cache would (an engine with C KV blocks cannot hold more
// than C distinct blocks). It learns only from routing decisions, not from the
// engines, hence "approximate"; the precise index fed by KV events is separate.
//
// # Layout and memory
//
// The owners table maps a block hash to the bitmask of endpoints holding it
// and to a digest of the prefix it ends (see Match). It is split into 64
// shards by the top bits of a mix of the hash, each an open-addressing Robin
// Hood table (backward-shift deletion, no tombstones, at most 7/8 full) of
// 24-byte slots. Every endpoint has an exact LRU: 24-byte nodes (hash, digest,
// links) in a slice that grows to capacity and is then reused, found through
// its own Robin Hood table of 8-byte slots (32-bit tag, node number; at most
// 7/8 full); Inserts share pooled update scratch (9 KiB per concurrent writer).
// TestIndexBytesPerBlock measures 66 bytes per (endpoint, block) entry for
// 200,000 blocks on one endpoint (24 node, 10.5 LRU slot, 31.5 owners slot),
// 68.3 for the same blocks spread over 64 endpoints and 68.4 over 1,000, and
// holds each under 80. Since tables double, the cost of a full LRU at other sizes ranges from
// about 61 to 97 bytes (the tables between 7/16 and 7/8 full); a block held
// by several endpoints pays the owners slot once.
// Memory is bounded by the capacities: an endpoint's LRU never exceeds its
// capacity and the owners table never holds more than the sum of the
// capacities. Clear keeps the endpoint's memory for reuse.
//
// # Locking
//
// Each endpoint's LRU has its own mutex and each owners shard its own
// RWMutex. Insert and Clear hold their endpoint's mutex throughout and take
// shard write locks one at a time (lock order: endpoint, then shard; no
// goroutine ever holds two shard locks), applying their owner updates in
// batches of up to 512 grouped by shard, so an Insert of n new blocks takes
// at most 64 shard locks per 256 blocks rather than 2n. Match takes only
// shard read locks, one lookup at a time, so Matches run in parallel with
// each other and with Inserts of other endpoints. A Match concurrent with an
// Insert or Clear is therefore not a snapshot: it may see some of that call's
// updates and not others. Without concurrent writers its result is exactly
// the linear definition below.
//
// # Match by bisection
//
// Match's answer for endpoint e is the number of leading blocks of the prompt
// that e holds (the linear definition). Hashes are chained (block i's hash
// identifies the whole prefix up to i) and Insert touches a prompt from its
// last block to its first, so whenever e holds block i of a prompt it holds
// blocks 0..i-1 too: the Insert that last touched block i touched them all
// afterwards, so they are fresher in e's LRU and are evicted after it, and
// Clear drops everything at once. Along a prompt, the set of endpoints
// holding block i therefore only shrinks as i grows, and each endpoint's
// matched length is where it leaves that set. Match finds those points by
// bisection: it compares the sets at the two ends of a range, stops if they
// are equal (nothing changes in between) and otherwise splits the range, so
// it costs O(d log n) lookups for d distinct match lengths among n blocks
// instead of n (2 lookups when one endpoint holds the whole prompt).
//
// The argument needs real chains, which the API cannot promise: a caller may
// Match a slice with a hole or Insert a slice that does not start at a root,
// and then the sets are not monotone. Both are caught, so the answer stays
// exact: every owners entry stores the digest (a sum of a non-linear mix of
// the hashes) of the prefix it ended in the Insert that created it, each LRU
// node the digest of the Insert that added it, and any later Insert touching
// the block with a different prefix digest marks the entry conflicting.
// Match accepts a bisection answer only if, at the last held block of each
// reported length, the entry's digest equals the digest of the query's own
// prefix up to there (one pass of arithmetic over the query, no lookups).
// That proves that every endpoint holding that block holds the query's whole
// prefix up to it: its last touch of the block came from an Insert of that
// same prefix, which touched the rest of it afterwards. Otherwise Match falls
// back to the linear scan. Only a 64-bit digest collision between two
// different prefixes could defeat the check; prompts made by Hashes never
// need the fallback (TestIndexBisectionAgainstModel), misuse always gets the
// linear answer (TestIndexNonChainAgainstModel).
//
// # More than 64 endpoints
//
// An owners entry's mask has one bit per endpoint, so the endpoints are
// kept in groups of MaxEndpoints (64): endpoint e is bit e%64 of group
// e/64, and every group has its own 64 shards of owners tables and its own
// LRUs. A pool of at most 64 endpoints is one group, exactly the layout
// above. In a larger pool a block held by endpoints of k groups has k owners
// entries (24 bytes each; TestIndexBytesPerBlock measures 1,000 endpoints),
// Insert, Clear and SetCapacity touch only their endpoint's group, and
// Match bisects every group whose owners hold the prompt's first block
// (one lookup for the others) and verifies the digests of all groups in
// one pass over the prompt (a pooled array of its prefix digests). Grow
// adds endpoints in place, keeping what the others hold.
type Index struct {
	// shape is the endpoints, in groups: endpoints 64g … 64g+63 in
	// groups[g]. Grow replaces it whole under growMu; every call loads it
	// once.
	shape  atomic.Pointer[indexShape]
	growMu sync.Mutex
	// linear counts Matches that fell back to the linear scan.
	linear atomic.Uint64
	// learn queues Learn's updates for Settle (learn.go).
	learn learnQueue
}

// group is up to MaxEndpoints endpoints of an Index and their owners
// table; the endpoints at or past the index's Endpoints() are untouched
// until Grow initialises them.
type group struct {
	shards [numShards]ownerShard
	eps    [MaxEndpoints]endpoint
}

// indexShape is an Index's endpoints: n of them, in groups of MaxEndpoints
// (the last possibly part full). Grow publishes a new shape sharing every
// group of the old one, so a call that loaded the old shape works on the
// same endpoints and owners tables as one that loads the new.
type indexShape struct {
	groups []*group
	n      int
}

// endpoint returns endpoint e's group and state (0 <= e < s.n).
func (s *indexShape) endpoint(e int) (*group, *endpoint) {
	g := s.groups[e/MaxEndpoints]
	return g, &g.eps[e%MaxEndpoints]
}

// NewIndex returns an index over len(capacity) endpoints, endpoint e holding
// at most capacity[e] blocks (0 or less means 1). It returns an error if there
// are more than MaxIndexEndpoints endpoints.
func NewIndex(capacity []int) (*Index, error) {
	if len(capacity) > MaxIndexEndpoints {
		return nil, fmt.Errorf("prefix index: %d endpoints, at most %d per pool", len(capacity), MaxIndexEndpoints)
	}
	s := &indexShape{n: len(capacity), groups: make([]*group, (len(capacity)+MaxEndpoints-1)/MaxEndpoints)}
	for g := range s.groups {
		s.groups[g] = new(group)
	}
	for e, c := range capacity {
		_, ep := s.endpoint(e)
		ep.lru.init(int32(min(max(c, 1), maxLRU)))
		ep.capacity.Store(ep.lru.cap)
	}
	ix := &Index{}
	ix.shape.Store(s)
	return ix, nil
}

// Grow makes the index track endpoints endpoints (at most
// MaxIndexEndpoints), in place: endpoints 0 … Endpoints()-1 keep what they
// hold (blocks, pins, capacities), the new ones start empty, each holding
// at most capacity blocks (0 or less means 1; SetCapacity changes it), as
// NewIndex makes them. A count at most Endpoints() changes nothing; the
// index never shrinks (Clear forgets a slot no endpoint uses).
//
// Grow allocates the new groups (owners shards and LRUs, empty) and
// publishes the new group list with one atomic store: O(new groups),
// whatever the index holds, and no lock Match or a writer takes
// (BenchmarkIndexGrow). A call that loaded the old list runs on the same
// groups and answers for the old count. Concurrent Grows are serialised.
func (ix *Index) Grow(endpoints, capacity int) error {
	if endpoints < 0 || endpoints > MaxIndexEndpoints {
		return fmt.Errorf("prefix index: grow to %d endpoints, at most %d per pool", endpoints, MaxIndexEndpoints)
	}
	ix.growMu.Lock()
	defer ix.growMu.Unlock()
	old := ix.shape.Load()
	if endpoints <= old.n {
		return nil
	}
	s := &indexShape{n: endpoints, groups: slices.Clone(old.groups)}
	for len(s.groups)*MaxEndpoints < endpoints {
		s.groups = append(s.groups, new(group))
	}
	c := int32(min(max(capacity, 1), maxLRU))
	for e := old.n; e < endpoints; e++ {
		_, ep := s.endpoint(e) // not yet reachable by any call
		ep.lru.init(c)
		ep.capacity.Store(c)
	}
	ix.shape.Store(s)
	return nil
}

// Endpoints returns the number of endpoints the index tracks.
func (ix *Index) Endpoints() int { return ix.shape.Load().n }

// endpoint returns endpoint e's group and state, nil for an out-of-range e.
func (ix *Index) endpoint(e int) (*group, *endpoint) {
	s := ix.shape.Load()
	if e < 0 || e >= s.n {
		return nil, nil
	}
	return s.endpoint(e)
}

// Match sets matched[e] to the number of leading blocks of hashes that
// endpoint e is believed to hold, for every e < len(matched) (extra entries
// are left alone), learns queued for Settle included (learn.go). It does
// not change recency. It allocates nothing.
func (ix *Index) Match(hashes []uint64, matched []int) {
	s := ix.shape.Load()
	n := min(len(matched), s.n)
	// The queue first: a learn Settle applies after this read is in the
	// index when match reads it, so none is missed by both. The queue's
	// answer is the few (endpoint, length) pairs it raises, not an array
	// over every endpoint: until 2026-12-05 a Match of a pool of more than
	// 64 endpoints with learns queued cleared and then maxed a pooled array
	// of all of them (two passes over 1,000 at BenchmarkEPPDecision's
	// scale), though a queued learn shares the prompt's prefix rarely.
	var held [2 * maxQueuedLearns]heldPrefix
	nh := 0
	if len(hashes) > 0 {
		nh = ix.learn.overlay(hashes, n, &held)
	}
	ix.match(s, hashes, matched)
	for _, h := range held[:nh] {
		matched[h.e] = max(matched[h.e], int(h.k))
	}
}

// match is Match of the index alone, of shape sh.
func (ix *Index) match(sh *indexShape, hashes []uint64, matched []int) {
	n := min(len(matched), sh.n)
	matched = matched[:n]
	for e := range matched {
		matched[e] = 0
	}
	if n == 0 || len(hashes) == 0 {
		return
	}
	if len(sh.groups) == 1 {
		// At most 64 endpoints: one group, verified with one running sum.
		g := sh.groups[0]
		s := bisection{hashes: hashes, matched: matched}
		if g.bisect(&s) && !s.verify() {
			ix.linear.Add(1)
			matchLinear(hashes, matched, alive(n), g.owners)
		}
		return
	}
	var d *prefixDigests
	var hints [maxHints]int
	nh := 0
	for gi := range sh.groups {
		lo := gi * MaxEndpoints
		if lo >= n {
			break
		}
		hi := min(n, lo+MaxEndpoints)
		g := sh.groups[gi]
		s := bisection{hashes: hashes, matched: matched[lo:hi], hints: hints[:nh]}
		if !g.bisect(&s) {
			continue
		}
		if nh == 0 && s.nchecks <= maxHints {
			for _, c := range s.checks[:s.nchecks] {
				hints[nh] = c.pos
				nh++
			}
		}
		if d == nil {
			d = digestPool.Get().(*prefixDigests)
			d.reset(hashes)
		}
		if !s.verifyWith(d) {
			ix.linear.Add(1)
			matchLinear(hashes, matched[lo:hi], alive(hi-lo), g.owners)
		}
	}
	if d != nil {
		d.hashes = nil
		digestPool.Put(d)
	}
}

// alive is the mask of endpoints 0..n-1 of a group (n ≤ 64).
func alive(n int) uint64 { return ^uint64(0) >> (64 - n) }

// bisect runs the bisection of s.hashes over group g for the endpoints of
// s.matched (at most 64, which it sets), and reports whether any endpoint
// holds the first block (false: nothing to verify, s.matched all 0).
func (g *group) bisect(s *bisection) bool {
	hashes := s.hashes
	m0, d0 := g.lookup(hashes[0])
	m0 &= alive(len(s.matched))
	if m0 == 0 {
		return false
	}
	last := len(hashes) - 1
	if last > 0 {
		mN, dN := g.lookup(hashes[last])
		mN &= m0
		s.split(g, 0, m0, d0, last, mN)
		if mN != 0 {
			s.end(last, mN, dN)
		}
	} else {
		s.end(0, m0, d0)
	}
	return true
}

// prefixDigests is the digest of every prefix of a query, computed as far as
// asked (Match over several groups verifies each group's checks against
// it); pooled.
type prefixDigests struct {
	hashes []uint64
	sums   []uint64 // sums[i]: digest of hashes[:i+1] (|1 not applied)
}

func (d *prefixDigests) reset(hashes []uint64) {
	d.hashes, d.sums = hashes, d.sums[:0]
}

// at returns the digest of hashes[:pos+1], odd as stored.
func (d *prefixDigests) at(pos int) uint64 {
	for i := len(d.sums); i <= pos; i++ {
		var prev uint64
		if i > 0 {
			prev = d.sums[i-1]
		}
		d.sums = append(d.sums, prev+digestMix(d.hashes[i]))
	}
	return d.sums[pos] | 1
}

var digestPool = sync.Pool{New: func() any { return new(prefixDigests) }}

// bisection is Match's state; it lives on Match's stack.
// The index is passed to split, not kept here: lookup's receiver escapes
// (sync.RWMutex), and a field here would drag matched to the heap with it.
type bisection struct {
	hashes  []uint64
	matched []int
	// checks lists, in increasing pos, the last held block of every
	// reported length and the digest its owners entry had when read.
	checks  [MaxEndpoints]check
	nchecks int
	// hints are ends found in an earlier group of the same Match
	// (increasing; nil for a pool of one group).
	hints []int
}

// maxHints is the most ends of an earlier group a Match passes on as hints:
// a few (a shared system prompt's end, the prompt's end) save most lookups;
// many different ends (every endpoint its own length) are no pattern, and a
// cut at a hint that is not this group's boundary costs up to two lookups.
const maxHints = 4

// mid is where split cuts (lo, hi): at a hinted end h, or just after it,
// when one lies inside (a boundary an earlier group of the same Match found:
// its endpoints left the prompt there, as a shared system prompt's end, so
// this group's likely do too, and cutting at h and h+1 settles it in two
// lookups), else halfway. Any cut inside gives the same answer.
func (s *bisection) mid(lo, hi int) int {
	for _, h := range s.hints {
		switch {
		case h > lo && h < hi:
			return h
		case h+1 > lo && h+1 < hi:
			return h + 1
		}
	}
	return lo + (hi-lo)/2
}

type check struct {
	pos int
	dig uint64
}

// split settles the endpoints that hold block lo of the prompt (mlo, its
// entry's digest dlo) but not block hi (mhi, a subset of mlo): each gets the
// length at which it stops holding. The masks split reads in between are
// clamped to lie between their neighbours', which only matters if a
// concurrent Insert or Clear changed them during the Match.
//
// It is iterative: an explicit stack holds the right halves still to
// settle, left halves first, so checks stay in increasing pos.
func (s *bisection) split(g *group, lo int, mlo, dlo uint64, hi int, mhi uint64) {
	type span struct {
		lo       int
		mlo, dlo uint64
		hi       int
		mhi      uint64
	}
	var stack [64]span // depth ≤ log2(len(hashes)) + 1
	n := 0
	for {
		for mlo != mhi {
			if hi == lo+1 {
				// mlo &^ mhi is a subset of the raw mask read at lo: anything
				// clamped in came from a mask at or after hi.
				s.end(lo, mlo&^mhi, dlo)
				break
			}
			mid := s.mid(lo, hi)
			raw, d := g.lookup(s.hashes[mid])
			mm := raw&mlo | mhi
			stack[n] = span{mid, mm, d, hi, mhi} // settle [mid, hi] after [lo, mid]
			n++
			hi, mhi = mid, mm
		}
		if n == 0 {
			return
		}
		n--
		sp := stack[n]
		lo, mlo, dlo, hi, mhi = sp.lo, sp.mlo, sp.dlo, sp.hi, sp.mhi
	}
}

// end reports that the endpoints in set hold blocks 0..pos and not pos+1, as
// read at pos with digest dig, pending verify.
func (s *bisection) end(pos int, set, dig uint64) {
	for ; set != 0; set &= set - 1 {
		s.matched[bits.TrailingZeros64(set)] = pos + 1
	}
	s.checks[s.nchecks] = check{pos, dig}
	s.nchecks++
}

// verify reports whether every reported length is proven: the digest of the
// query's prefix up to each checked position equals the one its entry stores.
func (s *bisection) verify() bool {
	var sum uint64
	j := 0
	for _, c := range s.checks[:s.nchecks] {
		for ; j <= c.pos; j++ {
			sum += digestMix(s.hashes[j])
		}
		if c.dig != sum|1 {
			return false
		}
	}
	return true
}

// verifyWith is verify against d's digests of the same query.
func (s *bisection) verifyWith(d *prefixDigests) bool {
	for _, c := range s.checks[:s.nchecks] {
		if c.dig != d.at(c.pos) {
			return false
		}
	}
	return true
}

// matchLinear is the definition of Match, for the Index and the
// PreciseIndex alike: one lookup per block until no endpoint of alive is
// left. owners(h) is the mask of endpoints holding block h; matched[e] is
// set for every endpoint e of alive.
func matchLinear(hashes []uint64, matched []int, alive uint64, owners func(h uint64) uint64) {
	for i, h := range hashes {
		held := owners(h) & alive
		for dropped := alive &^ held; dropped != 0; dropped &= dropped - 1 {
			matched[bits.TrailingZeros64(dropped)] = i
		}
		alive = held
		if alive == 0 {
			return
		}
	}
	for ; alive != 0; alive &= alive - 1 {
		matched[bits.TrailingZeros64(alive)] = len(hashes)
	}
}

// owners returns block h's owners mask in group g (0 if absent).
func (g *group) owners(h uint64) uint64 {
	mask, _ := g.lookup(h)
	return mask
}

// lookup returns block h's owners mask and prefix digest in group g (0, 0
// if absent).
func (g *group) lookup(h uint64) (mask, dig uint64) {
	m := mix(h)
	sh := &g.shards[m>>(64-shardBits)]
	sh.mu.RLock()
	mask, dig = sh.get(h, m)
	sh.mu.RUnlock()
	return mask, dig
}

// Insert records that endpoint e now holds every block of hashes, making them
// its most recently used; the least recently used blocks beyond its capacity
// are forgotten. Blocks are touched from last to first, so the shared head of
// a prompt is the freshest and a prefix is forgotten tail-first, as vLLM frees
// a finished request's blocks in reverse order (vllm/v1/core/block_pool.py).
// An out-of-range e is ignored. Once e's LRU is full it allocates nothing.
// Learns queued before it are applied first (Settle).
func (ix *Index) Insert(e int, hashes []uint64) {
	ix.Settle()
	ix.insert(e, hashes)
}

// insert is Insert without settling the queue.
func (ix *Index) insert(e int, hashes []uint64) { ix.insertOp(e, hashes, opTouch) }

// insertOp applies one learn of hashes to e: op opTouch makes every block
// the most recently used (a pinned block stays pinned), opPin adds a pin
// (a pinned block leaves the LRU order: it is evicted only when e holds
// nothing else), opRelease takes one away (a block left without pins, or
// that had none, becomes the most recently used). Blocks go from last to
// first. A block e lacks is added, evicting once e
// holds its capacity the least recently used unpinned block or, when every
// block is pinned, the block pinned longest ago (a request queued so long,
// or a pin whose Release was missed): e never holds more than its
// capacity.
func (ix *Index) insertOp(e int, hashes []uint64, op learnOp) {
	g, ep := ix.endpoint(e)
	if ep == nil || len(hashes) == 0 {
		return
	}
	var sum uint64 // digest of hashes[:i+1]
	for _, h := range hashes {
		sum += digestMix(h)
	}
	bit := uint64(1) << (e % MaxEndpoints)
	ep.mu.Lock()
	defer ep.mu.Unlock()
	b := batchPool.Get().(*opBatch)
	defer batchPool.Put(b)
	l := &ep.lru
	for i := len(hashes) - 1; i >= 0; i-- {
		if b.n > len(b.ops)-2 {
			g.flush(b, bit)
		}
		if (len(hashes)-1-i)%prefetchRun == 0 {
			b.sink += l.prefetch(hashes[max(i+1-prefetchRun, 0) : i+1])
		}
		h := hashes[i]
		dig := sum | 1
		sum -= digestMix(h)
		m := mix(h)
		_, node := l.find(h, m)
		if node >= 0 {
			l.touch(node, op)
			if l.nodes[node].Val.dig != dig {
				b.add(h, opConflict)
			}
			continue
		}
		if l.full() {
			old, from := l.order.Tail(), &l.order
			if old < 0 {
				old, from = l.pinned.Tail(), &l.pinned
			}
			ev := l.nodes[old].Val.hash
			b.add(ev, opRemove)
			from.Unlink(l.nodes, old)
			l.remove(ev)
			l.nodes[old].Val = blockEntry{hash: h, dig: dig}
			l.put(m, old)
			node = old
		} else {
			l.grow()
			node = int32(len(l.nodes))
			l.nodes = append(l.nodes, lru.Node[blockEntry]{Val: blockEntry{hash: h, dig: dig}})
			l.put(m, node)
		}
		if op == opPin {
			l.nodes[node].Val.pins = 1
			l.pinned.PushFront(l.nodes, node)
		} else {
			l.order.PushFront(l.nodes, node)
		}
		b.add(h, dig)
	}
	g.flush(b, bit)
}

// Clear forgets every block of endpoint e (for example after the engine
// restarted or its cache was reset), queued learns included. An
// out-of-range e is ignored.
func (ix *Index) Clear(e int) {
	g, ep := ix.endpoint(e)
	if ep == nil {
		return
	}
	ix.Settle()
	ep.mu.Lock()
	defer ep.mu.Unlock()
	g.clearLocked(ep, uint64(1)<<(e%MaxEndpoints))
}

// clearLocked is Clear with ep's mutex held; bit is ep's owner bit in g.
func (g *group) clearLocked(ep *endpoint, bit uint64) {
	if len(ep.lru.nodes) == 0 {
		return
	}
	b := batchPool.Get().(*opBatch)
	defer batchPool.Put(b)
	for i := range ep.lru.nodes {
		b.add(ep.lru.nodes[i].Val.hash, opRemove)
		if b.n == len(b.ops) {
			g.flush(b, bit)
		}
	}
	g.flush(b, bit)
	ep.lru.reset()
}

// SetCapacity changes the most blocks endpoint e holds (0 or less means
// 1), as NewIndex's capacity[e]: the gateway calls it when a configuration
// reload gives the endpoint's slot a new engine or a changed kv_blocks. A
// larger capacity keeps what e holds; a capacity below what e holds now
// forgets all of it (Clear), which is always safe for a cache index (a
// missed prefix hit, never a wrong one). An out-of-range e is ignored.
func (ix *Index) SetCapacity(e, capacity int) {
	g, ep := ix.endpoint(e)
	if ep == nil {
		return
	}
	c := int32(min(max(capacity, 1), maxLRU))
	ix.Settle()
	ep.mu.Lock()
	defer ep.mu.Unlock()
	if int32(len(ep.lru.nodes)) > c {
		g.clearLocked(ep, uint64(1)<<(e%MaxEndpoints))
	}
	ep.lru.cap = c
	ep.capacity.Store(c)
}

// Capacity returns the most blocks endpoint e holds (NewIndex's
// capacity[e], or SetCapacity's), 0 for an out-of-range e. It takes no
// lock: an atomic read, safe on the pick path while Settle applies learns.
func (ix *Index) Capacity(e int) int {
	_, ep := ix.endpoint(e)
	if ep == nil {
		return 0
	}
	return int(ep.capacity.Load())
}

// Len returns the number of blocks endpoint e is believed to hold, once
// the queued learns are applied (it settles them).
func (ix *Index) Len(e int) int {
	_, ep := ix.endpoint(e)
	if ep == nil {
		return 0
	}
	ix.Settle()
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return len(ep.lru.nodes)
}

// distinct returns the number of owners entries: the blocks held by at
// least one endpoint, a block counted once per group that holds it.
func (ix *Index) distinct() int {
	n := 0
	for _, g := range ix.shape.Load().groups {
		for i := range g.shards {
			sh := &g.shards[i]
			sh.mu.RLock()
			n += sh.n
			sh.mu.RUnlock()
		}
	}
	return n
}

// flush applies b's pending owner updates for the endpoint with bit bit,
// visiting each shard once, in the order they were queued within a shard (all
// updates of one hash fall in one shard, so the result is as if applied one
// by one).
func (g *group) flush(b *opBatch, bit uint64) {
	if b.n == 0 {
		return
	}
	var head, tail [numShards]int16
	for i := range head {
		head[i] = -1
	}
	for i := int16(0); i < int16(b.n); i++ {
		s := mix(b.ops[i].key) >> (64 - shardBits)
		b.next[i] = -1
		if t := tail[s]; head[s] >= 0 {
			b.next[t] = i
		} else {
			head[s] = i
		}
		tail[s] = i
	}
	for s, i := range head {
		if i < 0 {
			continue
		}
		sh := &g.shards[s]
		sh.mu.Lock()
		if len(sh.slots) > 0 {
			// Load every op's home slot first, so that their cache misses
			// overlap instead of queueing behind each probe loop.
			end := uint64(len(sh.slots) - 1)
			for j := i; j >= 0; j = b.next[j] {
				b.sink += sh.slots[sh.pos(mix(b.ops[j].key))&end].mask
			}
		}
		for ; i >= 0; i = b.next[i] {
			op := b.ops[i]
			switch op.dig {
			case opRemove:
				sh.remove(op.key, bit)
			case opConflict:
				sh.conflict(op.key)
			default:
				sh.add(op.key, bit, op.dig)
			}
		}
		sh.mu.Unlock()
	}
	b.n = 0
}

// mix spreads a block hash over 64 bits for table positions: the top
// shardBits pick the owners shard, the next bits the slot; an LRU table uses
// the top bits for the slot and the top 32 as the tag.
func mix(h uint64) uint64 {
	return (h ^ h>>32) * 0x9e3779b97f4a7c15
}

// digestMix is the non-linear mix summed into prefix digests (splitmix64's
// finalizer), so that different sets of hashes do not sum alike by structure.
func digestMix(h uint64) uint64 {
	h = (h ^ h>>30) * 0xbf58476d1ce4e5b9
	h = (h ^ h>>27) * 0x94d049bb133111eb
	return h ^ h>>31
}

const (
	shardBits = 6
	numShards = 1 << shardBits
	// maxLRU bounds an endpoint's capacity so that node numbers fit the
	// 32-bit half of an LRU slot.
	maxLRU = 1 << 30
)

// ownerShard is one shard of the owners table, padded to whole cache lines so
// that neighbouring shards' locks do not share one.
type ownerShard struct {
	ownerTable
	_ [128 - unsafe.Sizeof(ownerTable{})%128]byte
}

type ownerTable struct {
	mu    sync.RWMutex
	slots []ownerSlot // power-of-two length; mask 0 marks an empty slot
	n     int
	shift uint // 64 - log2(len(slots))
}

type ownerSlot struct {
	key  uint64
	mask uint64 // endpoints holding key; never 0 in a used slot
	dig  uint64 // digest of the prefix key ends (odd), 0 if conflicting
}

// pos returns the home slot of a hash whose mix is m (the bits after the
// shard bits).
func (t *ownerTable) pos(m uint64) uint64 { return m << shardBits >> t.shift }

// dist returns how far slot p's entry s sits from its home.
func (t *ownerTable) dist(p uint64, s *ownerSlot) uint64 {
	return (p - t.pos(mix(s.key))) & uint64(len(t.slots)-1)
}

// The table is Robin Hood hashed: an entry never sits farther from its home
// than the entries before it in its probe run would allow them, so a lookup
// stops at the first entry closer to its home than the key would be, and a
// deletion shifts the run back only up to the first entry at its home.

// get returns key's mask and digest (0, 0 if absent); m is mix(key).
func (t *ownerTable) get(key, m uint64) (mask, dig uint64) {
	if t.n == 0 {
		return 0, 0
	}
	end := uint64(len(t.slots) - 1)
	p := t.pos(m)
	for d := uint64(0); ; d++ {
		s := &t.slots[p]
		if s.mask == 0 {
			return 0, 0
		}
		if s.key == key {
			return s.mask, s.dig
		}
		if t.dist(p, s) < d {
			return 0, 0
		}
		p = (p + 1) & end
	}
}

// find returns key's slot position, or -1 if absent.
func (t *ownerTable) find(key uint64) int {
	if t.n == 0 {
		return -1
	}
	end := uint64(len(t.slots) - 1)
	p := t.pos(mix(key))
	for d := uint64(0); ; d++ {
		s := &t.slots[p]
		if s.mask == 0 {
			return -1
		}
		if s.key == key {
			return int(p)
		}
		if t.dist(p, s) < d {
			return -1
		}
		p = (p + 1) & end
	}
}

// add sets bit in key's mask; a new entry takes digest dig, an existing one
// with another digest becomes conflicting.
func (t *ownerTable) add(key, bit, dig uint64) {
	if (t.n+1)*8 > len(t.slots)*7 {
		t.grow()
	}
	end := uint64(len(t.slots) - 1)
	p := t.pos(mix(key))
	for d := uint64(0); ; d++ {
		s := &t.slots[p]
		if s.mask == 0 {
			*s = ownerSlot{key: key, mask: bit, dig: dig}
			t.n++
			return
		}
		if s.key == key {
			s.mask |= bit
			if s.dig != dig {
				s.dig = 0
			}
			return
		}
		if sd := t.dist(p, s); sd < d {
			// key is absent; it takes this slot and the resident moves on.
			old := *s
			*s = ownerSlot{key: key, mask: bit, dig: dig}
			t.n++
			t.push(old, (p+1)&end, sd+1)
			return
		}
		p = (p + 1) & end
	}
}

// push places absent entry e, probing from slot p at distance d from its
// home, displacing entries nearer their homes.
func (t *ownerTable) push(e ownerSlot, p, d uint64) {
	end := uint64(len(t.slots) - 1)
	for ; ; p, d = (p+1)&end, d+1 {
		s := &t.slots[p]
		if s.mask == 0 {
			*s = e
			return
		}
		if sd := t.dist(p, s); sd < d {
			e, *s = *s, e
			d = sd
		}
	}
}

func (t *ownerTable) conflict(key uint64) {
	if p := t.find(key); p >= 0 {
		t.slots[p].dig = 0
	}
}

// remove clears bit from key's mask and deletes the entry when no endpoint
// is left (no tombstones).
func (t *ownerTable) remove(key, bit uint64) {
	i := t.find(key)
	if i < 0 {
		return
	}
	p := uint64(i)
	if t.slots[p].mask &^= bit; t.slots[p].mask != 0 {
		return
	}
	t.n--
	end := uint64(len(t.slots) - 1)
	for {
		q := (p + 1) & end
		s := &t.slots[q]
		if s.mask == 0 || t.dist(q, s) == 0 {
			t.slots[p] = ownerSlot{}
			return
		}
		t.slots[p] = *s
		p = q
	}
}

func (t *ownerTable) grow() {
	size := max(2*len(t.slots), 16)
	old := t.slots
	t.slots = make([]ownerSlot, size)
	t.shift = uint(64 - bits.TrailingZeros(uint(size)))
	for _, s := range old {
		if s.mask != 0 {
			t.push(s, t.pos(mix(s.key)), 0)
		}
	}
}

// endpoint is one endpoint's LRU and scratch, padded like ownerShard.
type endpoint struct {
	endpointState
	_ [128 - unsafe.Sizeof(endpointState{})%128]byte
}

type endpointState struct {
	mu  sync.Mutex
	lru blockLRU
	// capacity is lru.cap, written with it (under mu) and read without
	// mu by Capacity: the pick path asks it, and must not wait for mu,
	// which Settle holds while it applies a long learn.
	capacity atomic.Int32
}

// opBatch queues owner updates of one endpoint for flush. Inserts and
// Clears take one from batchPool for their duration (empty again when they
// return), so the 9 KiB of scratch scale with the concurrent writers, not
// with the endpoints (it was one per endpoint until 2026-12-05: 9 MB at
// 1,000 endpoints).
var batchPool = sync.Pool{New: func() any { return new(opBatch) }}

type opBatch struct {
	n    int
	sink uint64 // prefetching loads' results, kept so they are not elided
	ops  [512]ownerOp
	next [512]int16 // per-shard chains built by flush
}

// ownerOp is an owner update: add with digest dig (odd), or one of:
const (
	opConflict = 0 // mark the entry conflicting
	opRemove   = 2 // clear the endpoint's bit
)

type ownerOp struct{ key, dig uint64 }

func (b *opBatch) add(key, dig uint64) {
	b.ops[b.n] = ownerOp{key, dig}
	b.n++
}

// blockLRU is a fixed-capacity LRU set of block hashes: an intrusive doubly linked
// list over a node slice (no allocation once full) plus an open-addressing
// table of slots, each the top 32 bits of the hash's mix (a tag) over the
// node number plus one (0 marks an empty slot).
type blockLRU struct {
	cap   int32
	nodes []lru.Node[blockEntry]
	order lru.List[blockEntry] // most to least recently used, unpinned nodes
	// pinned holds the pinned nodes (LearnPinned), most to least recently
	// pinned: evicted from only when order is empty.
	pinned lru.List[blockEntry]
	slots  []uint64
	shift  uint // 64 - log2(len(slots))
}

type blockEntry struct {
	hash uint64
	dig  uint64 // prefix digest of the Insert that added it
	// pins counts the LearnPinned not yet released; a pinned node is not
	// in the order list.
	pins int32
}

func (l *blockLRU) init(capacity int32) {
	l.cap = capacity
	l.order.Init()
	l.pinned.Init()
}

// reset empties the set, keeping its memory for reuse.
func (l *blockLRU) reset() {
	l.nodes = l.nodes[:0]
	clear(l.slots)
	l.order.Init()
	l.pinned.Init()
}

func (l *blockLRU) full() bool { return int32(len(l.nodes)) == l.cap }

// touch applies op to node i, which the LRU holds (insertOp).
func (l *blockLRU) touch(i int32, op learnOp) {
	v := &l.nodes[i].Val
	switch {
	case op == opPin:
		if v.pins == 0 {
			l.order.Unlink(l.nodes, i)
			l.pinned.PushFront(l.nodes, i)
		}
		v.pins++
	case v.pins == 0:
		l.order.MoveFront(l.nodes, i)
	case op == opRelease:
		if v.pins--; v.pins == 0 {
			l.pinned.Unlink(l.nodes, i)
			l.order.PushFront(l.nodes, i)
		}
	}
}

// The slot table is Robin Hood hashed like ownerTable; a slot's home is its
// top bits, as the tag is the mix's top 32 bits.

// find returns h's slot position and node, or -1 if absent. m is mix(h).
func (l *blockLRU) find(h, m uint64) (uint64, int32) {
	if len(l.slots) == 0 {
		return 0, -1
	}
	end := uint64(len(l.slots) - 1)
	tag := m >> 32
	p := m >> l.shift
	for d := uint64(0); ; d++ {
		s := l.slots[p]
		if s == 0 {
			return p, -1
		}
		if s>>32 == tag {
			if i := int32(uint32(s)) - 1; l.nodes[i].Val.hash == h {
				return p, i
			}
		}
		if (p-s>>l.shift)&end < d {
			return p, -1
		}
		p = (p + 1) & end
	}
}

// put adds a slot for node i, whose hash (absent) has mix m.
func (l *blockLRU) put(m uint64, i int32) {
	end := uint64(len(l.slots) - 1)
	e := m>>32<<32 | uint64(i+1)
	for p, d := m>>l.shift, uint64(0); ; p, d = (p+1)&end, d+1 {
		s := l.slots[p]
		if s == 0 {
			l.slots[p] = e
			return
		}
		if sd := (p - s>>l.shift) & end; sd < d {
			l.slots[p], e, d = e, s, sd
		}
	}
}

// prefetchRun is how many blocks ahead Insert loads LRU slots.
const prefetchRun = 32

// prefetch loads the home slots of hashes and, if the set is full, of as
// many least recently used entries (the next victims), so that the cache
// misses of the next len(hashes) touches overlap. Its result only keeps the
// loads from being elided.
func (l *blockLRU) prefetch(hashes []uint64) uint64 {
	if len(l.slots) == 0 {
		return 0
	}
	var sink uint64
	for _, h := range hashes {
		sink += l.slots[mix(h)>>l.shift]
	}
	if l.full() {
		v := l.order.Tail()
		for range hashes {
			if v < 0 {
				break
			}
			n := &l.nodes[v]
			sink += l.slots[mix(n.Val.hash)>>l.shift]
			v = n.Prev()
		}
	}
	return sink
}

// remove deletes h's slot (h must be present).
func (l *blockLRU) remove(h uint64) {
	p, _ := l.find(h, mix(h))
	end := uint64(len(l.slots) - 1)
	for {
		q := (p + 1) & end
		s := l.slots[q]
		if s == 0 || s>>l.shift == q {
			l.slots[p] = 0
			return
		}
		l.slots[p] = s
		p = q
	}
}

// grow makes room for one more node: it enlarges the node slice (doubling,
// up to capacity) and the slot table (keeping it at most 7/8 full).
func (l *blockLRU) grow() {
	n := len(l.nodes)
	if n == cap(l.nodes) {
		nodes := make([]lru.Node[blockEntry], n, min(max(2*n, 16), int(l.cap)))
		copy(nodes, l.nodes)
		l.nodes = nodes
	}
	if (n+1)*8 <= len(l.slots)*7 {
		return
	}
	size := max(2*len(l.slots), 16)
	l.slots = make([]uint64, size)
	l.shift = uint(64 - bits.TrailingZeros(uint(size)))
	for i := range l.nodes {
		l.put(mix(l.nodes[i].Val.hash), int32(i))
	}
}
