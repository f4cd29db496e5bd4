package prefix

import (
	"fmt"
	"slices"
	"sync/atomic"
)

// Growing a pool's index in place.
//
// A gateway pool's endpoints come and go (a configuration reload, a
// Kubernetes discovery change); an index made for its slots then needs
// more of them. Until 2026-12-05 the gateway made a new, empty index when
// a pool outgrew its groups of 64 slots, and a scale-up from 64 to 65 pods
// forgot what every engine's KV events had said (routing cold until their
// next events). Grow adds the slots to the index it has; Move hands one
// slot's state to another (the kv_store's slot, the last, moves when the
// index grows).

// Grow makes the index track endpoints endpoints (at most
// MaxIndexEndpoints), in place: endpoints 0 … Endpoints()-1 keep
// everything they hold (blocks, orphans, routed prompts, capacities,
// counters), the new ones start empty and unbounded, as NewPreciseIndex
// makes them. A count at most Endpoints() changes nothing; the index never
// shrinks (a slot no endpoint uses is forgotten with Forget).
//
// The groups already there are kept as they are: Grow allocates the new
// groups' block tables (64 shards of NumMedia empty maps each) and
// publishes a new group list with one atomic store, so it costs O(new
// groups), whatever the index holds, and takes no lock Match or a writer
// takes (BenchmarkPreciseGrow: a group added to an index of 1M blocks).
// A Match or writer that loaded the old list runs on the same groups and
// endpoints and answers for the old count; one that starts after Grow
// returns sees the new count. Concurrent Grows are serialised.
func (ix *PreciseIndex) Grow(endpoints int) error {
	if endpoints < 0 || endpoints > MaxIndexEndpoints {
		return fmt.Errorf("precise prefix index: grow to %d endpoints, want at most %d", endpoints, MaxIndexEndpoints)
	}
	ix.growMu.Lock()
	defer ix.growMu.Unlock()
	old := ix.shape.Load()
	if endpoints <= old.n {
		return nil
	}
	s := &preciseShape{n: endpoints, groups: slices.Clone(old.groups)}
	for len(s.groups)*MaxEndpoints < endpoints {
		s.groups = append(s.groups, newPreciseGroup())
	}
	for e := old.n; e < endpoints; e++ {
		// Not yet reachable: no call takes an endpoint at or past the
		// published count.
		ep, _ := s.endpoint(e)
		ep.reset()
	}
	ix.shape.Store(s)
	return nil
}

// Move hands endpoint from's state to endpoint to (both < Endpoints(),
// distinct): to then holds what from held — its blocks in every medium
// (their owner bits moved from from's group to to's), its orphans, the
// prompts routed to it, its capacities and its counters — and from is
// empty and unbounded, as Grow makes a new endpoint. What to held before
// is forgotten, as by Forget. The gateway moves a pool's kv_store this way
// when the store's slot, the index's last, moves because the index grew.
//
// Cost: two owner-table updates per (block, medium) from holds, in runs of
// moveRun keys of one shard under that shard's write lock (one side's at
// a time), after bucketing the keys by shard (8 bytes a block, for the
// while), the endpoints' mutexes held throughout (writers of from and to
// wait; BenchmarkPreciseMove: about half a second for 1M blocks). A concurrent Match may see a block
// under either endpoint or both, never under neither; the caller stops
// from's and to's event streams meanwhile (a Stored for from during a Move
// lands after it, on the emptied from).
func (ix *PreciseIndex) Move(from, to int) error {
	src, sbit, ok1 := ix.at(from)
	dst, dbit, ok2 := ix.at(to)
	if !ok1 || !ok2 || from == to {
		return fmt.Errorf("precise prefix index: move endpoint %d to %d of %d", from, to, ix.Endpoints())
	}
	// Two endpoints' mutexes, lower endpoint first (other writers take one).
	first, second := src, dst
	if to < from {
		first, second = dst, src
	}
	first.mu.Lock()
	defer first.mu.Unlock()
	second.mu.Lock()
	defer second.mu.Unlock()
	defer syncHoley(src, sbit)
	defer syncHoley(dst, dbit)

	dst.forgetRouted()
	ix.clearLocked(dst, dbit)
	// While the bits move (in map order: neither side is prefix-closed
	// meanwhile) both endpoints are marked holey, so that a Match scans
	// them linearly and finds at most what each holds, never a run past a
	// gap. Each new bit is set before the old one goes: a Match sees a
	// block under either endpoint or both, never under neither.
	var srcSaturated [NumMedia]bool
	for m := range Medium(NumMedia) {
		srcSaturated[m] = src.saturated[m].Load()
		dst.saturated[m].Store(true)
		src.saturated[m].Store(true)
	}
	syncHoley(dst, dbit)
	syncHoley(src, sbit)
	moveBits(src, sbit, dbit)
	for m := range src.holes {
		dst.holes[m].Store(src.holes[m].Load())
		dst.saturated[m].Store(srcSaturated[m])
	}
	dst.eng, dst.held, dst.blocks, dst.keys = src.eng, src.held, src.blocks, src.keys
	dst.evictState = src.evictState
	dst.orphans, dst.synthetic, dst.chain = src.orphans, src.synthetic, src.chain
	src.routed.mu.Lock()
	dst.routed.mu.Lock()
	dst.routed.next, dst.routed.bufs = src.routed.next, src.routed.bufs
	src.routed.next, src.routed.bufs = 0, [routedSlots][]uint64{}
	dst.routed.mu.Unlock()
	src.routed.mu.Unlock()
	for _, c := range [][2]*atomic.Uint64{
		{&dst.evicted, &src.evicted}, {&dst.unknownParents, &src.unknownParents}, {&dst.joined, &src.joined},
		{&dst.orphansDropped, &src.orphansDropped}, {&dst.unresolvedStores, &src.unresolvedStores},
	} {
		c[0].Store(c[1].Swap(0))
	}

	// from: a new endpoint's state (reset keeps bounds: drop them first).
	src.eng, src.held, src.keys, src.chain = nil, nil, nil, nil
	src.evictState = evictState{}
	src.reset()
	return nil
}

// moveRun is how many owner-table updates Move makes under one shard lock:
// a Match waits at most that many map updates for the lock.
const moveRun = 256

// moveBits sets, for every request key src holds in each medium, bit to in
// that medium's owner table and clears bit from: the keys bucketed by
// medium and shard, then each bucket in runs of moveRun keys, to's bit set
// for a run before from's is cleared. src.mu is held.
func moveBits(src *preciseEndpoint, from, to owner) {
	var buckets [NumMedia][preciseShards][]uint64
	for req, h := range src.held {
		for m, k := range h.c {
			if k > 0 {
				b := &buckets[m][req>>58]
				*b = append(*b, req)
			}
		}
	}
	for m := range buckets {
		for sh := range buckets[m] {
			keys := buckets[m][sh]
			for len(keys) > 0 {
				run := keys[:min(len(keys), moveRun)]
				keys = keys[len(run):]
				// The groups' bit counts rise before bits are set and
				// fall after they are cleared (preciseGroup.bits).
				d := &to.g.shards[sh]
				d.mu.Lock()
				for _, req := range run {
					if v := d.owners[m][req]; v&to.bit == 0 {
						to.g.bits[m].Add(1)
						d.owners[m][req] = v | to.bit
					}
				}
				d.mu.Unlock()
				o := &from.g.shards[sh]
				o.mu.Lock()
				for _, req := range run {
					if v, ok := o.owners[m][req]; ok && v&from.bit != 0 {
						if v &^= from.bit; v == 0 {
							delete(o.owners[m], req)
						} else {
							o.owners[m][req] = v
						}
						from.g.bits[m].Add(-1)
					}
				}
				o.mu.Unlock()
			}
		}
	}
}
