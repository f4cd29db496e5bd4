package sim

import "github.com/infergate/infergate/internal/lru"

// hashLRU is a set of block hashes in recency order, bounded to capacity:
// the storage of a local tier (tierCache) and of the virtual fleet's remote
// store (RemoteStore). The recency list is internal/lru's; nodes are
// reused, so a full set evicts and inserts without allocating.
type hashLRU struct {
	capacity int
	index    map[uint64]int32
	nodes    []lru.Node[uint64]
	list     lru.List[uint64]
	free     []int32
}

func newHashLRU(capacity int) hashLRU {
	c := hashLRU{capacity: capacity, index: make(map[uint64]int32)}
	c.list.Init()
	return c
}

func (c *hashLRU) holds(h uint64) bool { _, ok := c.index[h]; return ok }

func (c *hashLRU) len() int { return len(c.index) }

func (c *hashLRU) full() bool { return len(c.index) >= c.capacity }

// touch makes h the most recently used, if held, and reports whether it is.
func (c *hashLRU) touch(h uint64) bool {
	i, ok := c.index[h]
	if ok {
		c.list.MoveFront(c.nodes, i)
	}
	return ok
}

// insert adds h, not held, as the most recently used; the caller evicts
// first when full.
func (c *hashLRU) insert(h uint64) {
	var i int32
	if n := len(c.free); n > 0 {
		i, c.free = c.free[n-1], c.free[:n-1]
	} else {
		i = int32(len(c.nodes))
		c.nodes = append(c.nodes, lru.Node[uint64]{})
	}
	c.nodes[i].Val = h
	c.list.PushFront(c.nodes, i)
	c.index[h] = i
}

// evict removes the least recently used hash and returns it; the set is
// not empty.
func (c *hashLRU) evict() uint64 {
	i := c.list.Tail()
	h := c.nodes[i].Val
	c.list.Unlink(c.nodes, i)
	delete(c.index, h)
	c.free = append(c.free, i)
	return h
}

// clear empties the set.
func (c *hashLRU) clear() {
	clear(c.index)
	c.nodes, c.free = c.nodes[:0], c.free[:0]
	c.list.Init()
}
