package prefix

import (
	"fmt"
	"math/bits"
	"sync"
)

// MaxEndpoints is the number of endpoints one Index can track (one bit each in
// a 64-bit mask per block).
const MaxEndpoints = 64

// Index is the gateway's approximate prefix index: for every block hash it
// remembers which endpoints were sent a prompt containing that block, bounded
// per endpoint by an LRU of capacity blocks so that it forgets roughly when the
// engine's own KV cache would (an engine with C KV blocks cannot hold more
// than C distinct blocks). It learns only from routing decisions, not from the
// engines, hence "approximate"; the precise index fed by KV events is separate.
//
// Memory: 57 bytes per (endpoint, block) entry measured for 200k blocks on
// one endpoint (map slots in the global table and the endpoint's LRU plus a
// 16-byte list node; TestIndexBytesPerBlock holds it under 128).
// Safe for concurrent use; one mutex, held for O(blocks) map operations.
type Index struct {
	mu     sync.Mutex
	owners map[uint64]uint64 // block hash -> bitmask of endpoints holding it
	lrus   []lru
}

// NewIndex returns an index over len(capacity) endpoints, endpoint e holding
// at most capacity[e] blocks (0 or less means 1). It returns an error if there
// are more than MaxEndpoints endpoints.
func NewIndex(capacity []int) (*Index, error) {
	if len(capacity) > MaxEndpoints {
		return nil, fmt.Errorf("prefix index: %d endpoints, at most %d per pool", len(capacity), MaxEndpoints)
	}
	ix := &Index{owners: make(map[uint64]uint64), lrus: make([]lru, len(capacity))}
	for e, c := range capacity {
		ix.lrus[e].init(max(c, 1))
	}
	return ix, nil
}

// Endpoints returns the number of endpoints the index tracks.
func (ix *Index) Endpoints() int { return len(ix.lrus) }

// Match sets matched[e] to the number of leading blocks of hashes that
// endpoint e is believed to hold, for every e < len(matched) (extra entries
// are left alone). It does not change recency. It allocates nothing.
func (ix *Index) Match(hashes []uint64, matched []int) {
	n := min(len(matched), len(ix.lrus))
	for e := range n {
		matched[e] = 0
	}
	if n == 0 || len(hashes) == 0 {
		return
	}
	alive := uint64(1)<<n - 1
	if n == 64 {
		alive = ^uint64(0)
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for i, h := range hashes {
		held := ix.owners[h] & alive
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

// Insert records that endpoint e now holds every block of hashes, making them
// its most recently used; the least recently used blocks beyond its capacity
// are forgotten. Blocks are touched from last to first, so the shared head of
// a prompt is the freshest and a prefix is forgotten tail-first, as vLLM frees
// a finished request's blocks in reverse order (vllm/v1/core/block_pool.py).
// An out-of-range e is ignored.
func (ix *Index) Insert(e int, hashes []uint64) {
	if e < 0 || e >= len(ix.lrus) {
		return
	}
	bit := uint64(1) << e
	ix.mu.Lock()
	defer ix.mu.Unlock()
	l := &ix.lrus[e]
	for i := len(hashes) - 1; i >= 0; i-- {
		h := hashes[i]
		if evicted, ok := l.touch(h); ok {
			if m := ix.owners[evicted] &^ bit; m == 0 {
				delete(ix.owners, evicted)
			} else {
				ix.owners[evicted] = m
			}
		}
		ix.owners[h] |= bit
	}
}

// Clear forgets every block of endpoint e (for example after the engine
// restarted or its cache was reset). An out-of-range e is ignored.
func (ix *Index) Clear(e int) {
	if e < 0 || e >= len(ix.lrus) {
		return
	}
	bit := uint64(1) << e
	ix.mu.Lock()
	defer ix.mu.Unlock()
	l := &ix.lrus[e]
	for h := range l.slot {
		if m := ix.owners[h] &^ bit; m == 0 {
			delete(ix.owners, h)
		} else {
			ix.owners[h] = m
		}
	}
	l.init(l.cap)
}

// Len returns the number of blocks endpoint e is believed to hold.
func (ix *Index) Len(e int) int {
	if e < 0 || e >= len(ix.lrus) {
		return 0
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return len(ix.lrus[e].slot)
}

// lru is a fixed-capacity LRU set of block hashes: an intrusive doubly linked
// list over a node slice (no allocation once full) plus a hash -> slot map.
type lru struct {
	cap        int
	slot       map[uint64]int32
	nodes      []lruNode
	head, tail int32 // most and least recently used; -1 when empty
}

type lruNode struct {
	hash       uint64
	prev, next int32
}

func (l *lru) init(capacity int) {
	l.cap = capacity
	l.slot = make(map[uint64]int32)
	l.nodes = l.nodes[:0]
	l.head, l.tail = -1, -1
}

// touch makes h the most recently used entry, inserting it if absent. If that
// pushed the set over capacity, it returns the evicted hash and true.
func (l *lru) touch(h uint64) (evicted uint64, ok bool) {
	if i, found := l.slot[h]; found {
		l.unlink(i)
		l.pushFront(i)
		return 0, false
	}
	var i int32
	if len(l.nodes) < l.cap {
		l.nodes = append(l.nodes, lruNode{})
		i = int32(len(l.nodes) - 1)
	} else {
		i = l.tail
		evicted, ok = l.nodes[i].hash, true
		delete(l.slot, evicted)
		l.unlink(i)
	}
	l.nodes[i].hash = h
	l.slot[h] = i
	l.pushFront(i)
	return evicted, ok
}

func (l *lru) unlink(i int32) {
	n := &l.nodes[i]
	if n.prev >= 0 {
		l.nodes[n.prev].next = n.next
	} else {
		l.head = n.next
	}
	if n.next >= 0 {
		l.nodes[n.next].prev = n.prev
	} else {
		l.tail = n.prev
	}
}

func (l *lru) pushFront(i int32) {
	n := &l.nodes[i]
	n.prev, n.next = -1, l.head
	if l.head >= 0 {
		l.nodes[l.head].prev = i
	}
	l.head = i
	if l.tail < 0 {
		l.tail = i
	}
}
