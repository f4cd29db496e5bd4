package prefix

import "sync"

// Orphans and joins.
//
// A BlockStored event chains its first block from a parent engine key. When
// the index does not know that key on the endpoint — the gateway started
// after the engine cached the parent and the engine has no replay socket, a
// batch was lost, the parent was evicted here — the event's request keys
// cannot be computed: they hash the whole prefix, and the index has only the
// parent's opaque engine hash. llm-d's indexer skips such events
// (kvevents/pool.go: "Failed to get request key for parent block"), and so
// did this index; then a conversation that continues on the engine after a
// gateway restart stays invisible for ever, since each turn's event chains
// from the previous turn's blocks, which were skipped too.
//
// Instead, the blocks are kept under the engine's own hashes, as orphans:
// engine key → parent engine key and counts per medium, no request key, so
// not matched, but chained from by later events, removed by BlockRemoved,
// and bounded with the rest (precise_evict.go). They are joined to request
// keys by the prompts the gateway routes (Routed): each endpoint remembers
// the request keys of the last few prompts sent to it. An event whose parent
// is unknown or an orphan is most likely the engine computing the uncached
// part of one of them: if for some recent prompt r and block j the event's
// first block, chained from r[j-1], has request key r[j] (and so do the
// event's other blocks that fall inside the prompt), the engine held the
// prompt's blocks 0..j-1 when it stored the event (a prefix hit always
// covers a prefix). The index then holds r[0..j-1] on the endpoint: the
// orphan chain ending at the parent under its blocks' real request keys
// (found by position, walking up the orphans' parent links), the engine key
// above the chain (the parent itself, when it was unknown) under its own,
// and the blocks before that — whose engine keys were never seen — under
// synthetic engine keys (syntheticKey), replaced by the real ones whenever a
// real event stores those request keys. The event's blocks are then stored
// chained from r[j-1].
//
// Limits: a synthetic entry cannot be removed by the engine's events (the
// engine key is not known); it leaves with a reset, by eviction, or when a
// real event stores its request key. A join is a match of the event's
// tokens to a routed prompt's at the same block position; an engine serving
// the same 16-token blocks at the same offset after another prefix for a
// request the gateway did not route could be credited with the routed
// prompt's prefix. The search is bounded (joinBudget hashes per event), the
// exact tail (the event ends at the prompt's last full block) tried first.

// Bounds of the joins.
const (
	// routedSlots is how many recently routed prompts an endpoint keeps.
	routedSlots = 8
	// maxRoutedBlocks bounds the blocks kept of one routed prompt (256k
	// tokens of 16).
	maxRoutedBlocks = 1 << 14
	// joinBudget bounds the one-block hashes tried per event.
	joinBudget = 1 << 12
)

// orphanEntry is an engine key kept without a request key.
type orphanEntry struct {
	parent uint64 // the engine key it was chained from
	n      engCounts
	node   uint32
}

// joinState is an endpoint's orphans and routed prompts.
type joinState struct {
	orphans   map[uint64]orphanEntry // engine key -> parent, counts (ep.mu)
	synthetic int                    // synthetic engine keys in ep.eng (ep.mu)
	chain     []uint64               // scratch: an orphan chain (ep.mu)
	routed    routedPrompts
}

// routedPrompts is a ring of the request keys of prompts routed to an
// endpoint, newest at next. Its own mutex: the request path takes it alone.
type routedPrompts struct {
	mu   sync.Mutex
	next int
	bufs [routedSlots][]uint64
}

func (ep *preciseEndpoint) resetOrphans() {
	ep.orphans = make(map[uint64]orphanEntry)
	ep.synthetic = 0
}

func (ep *preciseEndpoint) forgetRouted() {
	r := &ep.routed
	r.mu.Lock()
	for i := range r.bufs {
		r.bufs[i] = r.bufs[i][:0]
	}
	r.mu.Unlock()
}

// Routed records that a prompt with request keys hashes (Hashes under the
// prompt's seed) was sent to endpoint e, so that the endpoint's events for
// it can be joined even when their parent blocks are unknown. It copies
// hashes (at most 16384 of them) into a buffer it reuses, so it allocates
// only when a prompt is longer than any the slot held before. Safe for
// concurrent use; it does not wait for event application.
func (ix *PreciseIndex) Routed(e int, hashes []uint64) {
	ep, _, ok := ix.at(e)
	if !ok || len(hashes) < 2 {
		return
	}
	r := &ep.routed
	r.mu.Lock()
	r.next = (r.next + 1) % routedSlots
	r.bufs[r.next] = append(r.bufs[r.next][:0], hashes[:min(len(hashes), maxRoutedBlocks)]...)
	r.mu.Unlock()
}

// syntheticKey is the engine key the index gives a block it knows an
// endpoint holds but whose engine key it never saw: a fixed function of the
// request key that real engine keys (hashes) hit with probability 2^-64.
func syntheticKey(req uint64) uint64 { return (req ^ 0x5a17c0de0f1a7e11) * 0x9e3779b97f4a7c15 }

// dropSynthetic drops the synthetic engine key of req in medium m, now
// that a real one holds it there (it keeps what the synthetic key holds in
// other media). ep.mu is held.
func (ix *PreciseIndex) dropSynthetic(ep *preciseEndpoint, bit owner, m Medium, req uint64) {
	s := syntheticKey(req)
	if ent, ok := ep.eng[s]; ok && ent.req == req && ent.n.get(m) > 0 {
		ix.dropIn(ep, bit, m, s, ent)
	}
}

// storeOrphans keeps the blocks engineHashes, chained from engine key
// parent, as orphans of ep in medium m. A block already held with a request
// key is held again under it. ep.mu is held.
func (ix *PreciseIndex) storeOrphans(ep *preciseEndpoint, bit owner, m Medium, parent uint64, engineHashes []uint64) {
	ep.touch(parent)
	prev := parent
	for _, h := range engineHashes {
		if ent, ok := ep.eng[h]; ok {
			ix.hold(ep, bit, m, h, ent.req, ep.held[ent.req].parent)
			prev = h
			continue
		}
		o, ok := ep.orphans[h]
		if !ok {
			o = orphanEntry{parent: prev, node: ep.newNode(h)}
		}
		if c := o.n.get(m); c < maxEngCount {
			o.n = o.n.set(m, c+1)
		}
		ep.orphans[h] = o
		ep.touch(h)
		prev = h
	}
}

// removeOrphan takes one block of orphan engine key h away in medium m; it
// reports whether h was an orphan held there. ep.mu is held.
func (ep *preciseEndpoint) removeOrphan(m Medium, h uint64) bool {
	o, ok := ep.orphans[h]
	if !ok || o.n.get(m) == 0 {
		return false
	}
	o.n = o.n.set(m, o.n.get(m)-1)
	if o.n == 0 {
		delete(ep.orphans, h)
		ep.freeNode(o.node)
	} else {
		ep.orphans[h] = o
	}
	return true
}

// join looks for a prompt routed to ep that explains a Stored event whose
// parent engine key is unknown or an orphan (see the top of this file). On
// success ep holds the prompt's blocks before the event, parent among them,
// and join returns parent's request key. ep.mu is held.
func (ix *PreciseIndex) join(ep *preciseEndpoint, bit owner, m Medium, parent uint64, engineHashes []uint64, tokens []uint32) (uint64, bool) {
	if len(engineHashes) == 0 {
		return 0, false
	}
	bs := ix.blockSize
	r := &ep.routed
	r.mu.Lock()
	defer r.mu.Unlock()
	budget := joinBudget
	var one [1]uint64
	first := func(seed uint64) uint64 { return Hashes(one[:0], tokens[:bs], bs, seed)[0] }
	for k := range routedSlots {
		p := r.bufs[(r.next-k+routedSlots)%routedSlots]
		n := len(p)
		found := -1
		tail := n - len(engineHashes)
		if tail >= 1 && budget > 0 {
			budget--
			if first(p[tail-1]) == p[tail] {
				found = tail
			}
		}
		for j := n - 1; found < 0 && j >= 1 && budget > 0; j-- {
			if j == tail {
				continue
			}
			budget--
			if first(p[j-1]) == p[j] {
				found = j
			}
		}
		if found < 0 {
			continue
		}
		keys := Hashes(ep.keys[:0], tokens, bs, p[found-1])
		ep.keys = keys
		ok := true
		for t := 0; t < len(keys) && found+t < n; t++ {
			ok = ok && keys[t] == p[found+t]
		}
		if ok && ix.adopt(ep, bit, m, parent, p[:found]) {
			ep.joined.Add(1)
			return p[found-1], true
		}
	}
	return 0, false
}

// adopt makes ep hold the prompt blocks prefix (request keys; the last one is
// engine key parent's) in medium m: the orphan chain ending at parent under
// their request keys, the engine key above it under its own, the blocks
// before under synthetic keys. It reports false, changing nothing, when the
// chain does not fit the prompt. ep.mu is held.
func (ix *PreciseIndex) adopt(ep *preciseEndpoint, bit owner, m Medium, parent uint64, prefix []uint64) bool {
	j := len(prefix)
	chain := ep.chain[:0]
	key := parent
	for {
		o, ok := ep.orphans[key]
		if !ok {
			break
		}
		chain = append(chain, key)
		if len(chain) >= j {
			ep.chain = chain
			return false // the chain reaches back past the prompt's first block
		}
		key = o.parent
	}
	ep.chain = chain
	L := len(chain)
	above := key // the engine key of block j-L-1
	if ent, ok := ep.eng[above]; ok && ent.req != prefix[j-L-1] {
		return false
	}
	for i, req := range prefix {
		parentReq := rootParent
		if i > 0 {
			parentReq = prefix[i-1]
		}
		switch {
		case i >= j-L: // an orphan
			h := chain[j-1-i]
			o := ep.orphans[h]
			delete(ep.orphans, h)
			ep.freeNode(o.node)
			for md := range Medium(NumMedia) {
				for range o.n.get(md) {
					ix.hold(ep, bit, md, h, req, parentReq)
				}
			}
		case i == j-L-1: // the engine key above the chain
			if ent, ok := ep.eng[above]; !ok || ent.n.get(m) == 0 {
				ix.hold(ep, bit, m, above, req, parentReq)
			}
		default: // never seen: a synthetic engine key
			if ep.held[req].c[m] == 0 {
				s := syntheticKey(req)
				_, had := ep.eng[s]
				ix.hold(ep, bit, m, s, req, parentReq)
				if _, has := ep.eng[s]; has && !had {
					ep.synthetic++
				}
			}
		}
	}
	return true
}
