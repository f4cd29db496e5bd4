// Package lru is the recency order of infergate's bounded caches: an
// intrusive doubly linked list over a slice of nodes, addressed by int32
// node index, so that a full cache moves, evicts and reuses nodes without
// allocating. Each cache keeps its own lookup (the approximate prefix
// index's slot table in package prefix, the session table's map in package
// sched), its own node slice and its own payload, Node.Val.
package lru

// Node is one entry of a List's node slice: its neighbours (node indexes,
// -1 for none) and the cache's payload.
type Node[T any] struct {
	prev, next int32
	Val        T
}

// Prev returns the index of the next more recently used node, -1 at the
// head.
func (n *Node[T]) Prev() int32 { return n.prev }

// List orders the nodes of a slice the caller owns and passes to every
// call, from the most (Head) to the least (Tail) recently used. Call Init
// before use; a node is in the list from a push until its Unlink.
type List[T any] struct {
	head, tail int32
}

// Init empties the list.
func (l *List[T]) Init() { l.head, l.tail = -1, -1 }

// Head returns the most recently used node, -1 when empty.
func (l *List[T]) Head() int32 { return l.head }

// Tail returns the least recently used node, the next to evict; -1 when
// empty.
func (l *List[T]) Tail() int32 { return l.tail }

// MoveFront makes node i (in the list) the most recently used.
func (l *List[T]) MoveFront(nodes []Node[T], i int32) {
	if l.head == i {
		return
	}
	l.Unlink(nodes, i)
	l.PushFront(nodes, i)
}

// Unlink takes node i out of the list.
func (l *List[T]) Unlink(nodes []Node[T], i int32) {
	n := &nodes[i]
	if n.prev >= 0 {
		nodes[n.prev].next = n.next
	} else {
		l.head = n.next
	}
	if n.next >= 0 {
		nodes[n.next].prev = n.prev
	} else {
		l.tail = n.prev
	}
}

// PushFront puts node i (not in the list) at the head.
func (l *List[T]) PushFront(nodes []Node[T], i int32) { l.link(nodes, i, -1, l.head) }

// PushBack puts node i (not in the list) at the tail, the next to evict.
func (l *List[T]) PushBack(nodes []Node[T], i int32) { l.link(nodes, i, l.tail, -1) }

// link puts node i between prev and next, neighbours in the list (-1: the
// end).
func (l *List[T]) link(nodes []Node[T], i, prev, next int32) {
	nodes[i].prev, nodes[i].next = prev, next
	if prev >= 0 {
		nodes[prev].next = i
	} else {
		l.head = i
	}
	if next >= 0 {
		nodes[next].prev = i
	} else {
		l.tail = i
	}
}
