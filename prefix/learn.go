package prefix

import (
	"sync"
	"sync/atomic"
)

// Learning off the pick path.
//
// Insert of a routed prompt touches one LRU entry per block (a 12k-token
// prompt: 750 blocks, 20–55 µs; sched.BenchmarkDecision64x1M), more than the
// rest of a decision together. Learn instead queues the prompt's hashes — a
// copy into a reusable arena, no allocation once the arena has grown — and
// Settle applies the queue, in order, as Insert would have: the gateway
// settles on its own goroutine (gateway/README.md "Performance"), the
// virtual fleet after every decision, so that virtual time decides exactly
// as with Insert inline.
//
// What a same-prefix request sees meanwhile: Match adds the queue to the
// index's answer. For each queued learn (endpoint e, hashes p) it takes the
// query's common prefix with p — by bisection, since hashes are chained (an
// equal hash at block i means equal blocks 0..i) — and reports e holding at
// least that many leading blocks, which is what Match gives once the learn
// is applied: the next turn of a session whose previous turn is still queued
// goes home. The queue cannot show what its learns would evict, so until
// Settle an evicted block may still count for its old holder, as a Match
// concurrent with an Insert may see part of it.
//
// Bounds: at most maxQueuedBlocks hashes (8 bytes each) and maxQueuedLearns
// learns wait; a Learn that finds the queue full settles it and inserts its
// own prompt on the caller's goroutine (a settler that cannot keep up costs
// the pick path what Insert did, and what was queued before), and a prompt
// longer than the whole queue is inserted at once. The queue's two arenas
// grow to at most 2 × maxQueuedBlocks × 8 bytes (256 KiB) per index.

const (
	// maxQueuedBlocks bounds the block hashes waiting in one arena.
	maxQueuedBlocks = 1 << 14
	// maxQueuedLearns bounds the learns waiting, so that Match's overlay
	// compares at most this many prompts.
	maxQueuedLearns = 256
)

// learnQueue is an Index's queue of learns not yet applied: Learn appends
// to active; Settle swaps active for the empty applying arena, inserts
// applying's learns without holding mu, then empties it. Match reads both
// under mu. One settler at a time (settling).
type learnQueue struct {
	queued   atomic.Int32 // learns in active and applying: 0 lets Match skip the overlay
	mu       sync.Mutex
	active   learnArena
	applying learnArena
	settling sync.Mutex
}

// learnArena holds learns back to back: entry k's hashes are
// hashes[learns[k].off:][:learns[k].n].
type learnArena struct {
	hashes []uint64
	learns []queuedLearn
}

type queuedLearn struct {
	e      int32
	off, n int32
	op     learnOp
}

// learnOp is what a queued learn does to its blocks (insertOp).
type learnOp uint8

const (
	opTouch   learnOp = iota // Learn, Insert: most recently used
	opPin                    // LearnPinned: held and not evictable until released
	opRelease                // Release: one pin fewer; unpinned, most recently used
)

func (a *learnArena) reset() {
	a.hashes = a.hashes[:0]
	a.learns = a.learns[:0]
}

// Learn records, as Insert, that endpoint e now holds every block of
// hashes (chained, as Hashes makes them), but queues the update for Settle
// instead of applying it: Match counts queued learns at once (the overlay
// above). It copies hashes, so the caller may reuse them. An out-of-range e
// or empty hashes are ignored. It allocates nothing once the queue's arenas
// have grown to the load.
func (ix *Index) Learn(e int, hashes []uint64) { ix.queue(e, hashes, opTouch) }

// LearnPinned is Learn for a request that is to run on e: its blocks are
// also pinned, as an engine pins a running request's blocks (vLLM's
// block_pool.py keeps blocks with a reference out of its free queue), so
// that e's LRU does not evict them until Release takes the pin away. Every
// LearnPinned must be followed by one Release of the same hashes on e,
// whatever becomes of the request; a pin never released only makes its
// block the last to be evicted, and when every block of e is pinned the
// one pinned longest ago goes first (e never holds more than its
// capacity). On an index whose picks pin, only a request that pinned may
// Release (sched's Request.Pinned records it): a Release for a prompt
// learnt unpinned would take a pin another running request holds on a
// shared block.
func (ix *Index) LearnPinned(e int, hashes []uint64) { ix.queue(e, hashes, opPin) }

// Release ends a LearnPinned of the same hashes on e: each block loses a
// pin, and the blocks are touched from the prompt's last to its first, so
// that, unpinned, the prompt's head is the freshest, as vLLM frees a
// finished request's blocks tail first to the recent end of its free queue
// (block_pool.py free_blocks). A block without a pin is touched; one that
// e no longer holds is inserted. Queued like Learn.
func (ix *Index) Release(e int, hashes []uint64) { ix.queue(e, hashes, opRelease) }

func (ix *Index) queue(e int, hashes []uint64, op learnOp) {
	if e < 0 || e >= ix.Endpoints() || len(hashes) == 0 {
		return
	}
	if len(hashes) > maxQueuedBlocks {
		ix.Settle()
		ix.insertOp(e, hashes, op) // after the queue: order kept
		return
	}
	q := &ix.learn
	q.mu.Lock()
	a := &q.active
	if len(a.hashes)+len(hashes) <= maxQueuedBlocks && len(a.learns) < maxQueuedLearns {
		off := len(a.hashes)
		a.hashes = append(a.hashes, hashes...)
		a.learns = append(a.learns, queuedLearn{e: int32(e), off: int32(off), n: int32(len(hashes)), op: op})
		q.queued.Add(1)
		q.mu.Unlock()
		return
	}
	q.mu.Unlock()
	// Full: the settler is behind. Apply the queue and this learn here,
	// once (retrying to queue could lose the race for the freed room to
	// other callers again and again).
	ix.Settle()
	ix.insertOp(e, hashes, op)
}

// Queued returns the number of learns waiting for Settle.
func (ix *Index) Queued() int { return int(ix.learn.queued.Load()) }

// Settle applies every queued learn, in the order they were queued, as
// Insert. Insert, Clear, SetCapacity and Len settle first, so that they act
// after every learn queued before them. Safe for concurrent use; one
// Settle runs at a time, and Learns and Matches proceed while it applies.
func (ix *Index) Settle() {
	q := &ix.learn
	if q.queued.Load() == 0 {
		return
	}
	q.settling.Lock()
	defer q.settling.Unlock()
	q.mu.Lock()
	// applying is empty here: only a settler fills it, and it empties it
	// before letting the next one in.
	q.active, q.applying = q.applying, q.active
	a := q.applying
	q.mu.Unlock()
	for _, l := range a.learns {
		ix.insertOp(int(l.e), a.hashes[l.off:l.off+l.n], l.op)
	}
	q.mu.Lock()
	q.applying.reset()
	q.queued.Add(-int32(len(a.learns)))
	q.mu.Unlock()
}

// heldPrefix is one queued learn's answer to a Match: endpoint e holds at
// least the query's first k blocks.
type heldPrefix struct{ e, k int32 }

// overlay writes into held, for every queued learn of an endpoint e < n
// that shares a prefix with hashes, that endpoint and the prefix's length
// in blocks, and returns how many it wrote (0 when nothing is queued). It
// reads both arenas, so held needs room for twice maxQueuedLearns.
func (q *learnQueue) overlay(hashes []uint64, n int, held *[2 * maxQueuedLearns]heldPrefix) int {
	if q.queued.Load() == 0 {
		return 0
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	nh := 0
	for _, a := range [2]*learnArena{&q.applying, &q.active} {
		for _, l := range a.learns {
			if int(l.e) >= n {
				continue
			}
			if k := commonPrefix(hashes, a.hashes[l.off:l.off+l.n]); k > 0 && nh < len(held) {
				held[nh] = heldPrefix{e: l.e, k: int32(k)}
				nh++
			}
		}
	}
	return nh
}

// commonPrefix returns the number of leading blocks two chained hash lists
// share: the last position where they agree, by bisection (an equal hash
// at block i means equal blocks 0..i).
func commonPrefix(a, b []uint64) int {
	n := min(len(a), len(b))
	if n == 0 || a[0] != b[0] {
		return 0
	}
	if a[n-1] == b[n-1] {
		return n
	}
	lo, hi := 0, n-1 // a[lo] == b[lo], a[hi] != b[hi]
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if a[mid] == b[mid] {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo + 1
}
