package prefix

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
)

// checkPrecise checks every endpoint's internal consistency: counts, block
// table bits, holes and kids, eviction lists, capacity.
func checkPrecise(t testing.TB, ix *PreciseIndex) {
	t.Helper()
	checkPreciseOf(t, ix, nil)
}

// checkPreciseOf is checkPrecise of endpoints eps only (nil: all), the
// block tables and holey masks all the same: the others must be empty.
func checkPreciseOf(t testing.TB, ix *PreciseIndex, eps []int) {
	t.Helper()
	for e := range ix.Endpoints() {
		if eps != nil && !slices.Contains(eps, e) {
			continue
		}
		ep := ix.endpoint(e)
		ep.mu.Lock()
		err := ep.consistent(ix, e)
		ep.mu.Unlock()
		if err != nil {
			t.Fatalf("endpoint %d: %v", e, err)
		}
	}
	if err := ix.ownersConsistent(); err != nil {
		t.Fatal(err)
	}
}

// ownersConsistent checks the block tables the other way round: every bit
// set in group g's masks is an endpoint of g that holds the request key in
// that medium (no bit past the last endpoint, none left behind by a
// clear), and no entry has an empty mask; every group's bit counts are
// the bits its masks have set; and every group's holey masks are its
// endpoints' hole counts. No writer may run.
func (ix *PreciseIndex) ownersConsistent() error {
	for e := range ix.Endpoints() {
		o := ix.owner(e)
		for m := range ix.endpoint(e).holes {
			want := ix.endpoint(e).holes[m].Load() != 0 || ix.endpoint(e).saturated[m].Load()
			if have := o.g.holey[m].Load()&o.bit != 0; have != want {
				return fmt.Errorf("endpoint %d medium %v: holey bit %v, holes %d, saturated %v", e, Medium(m), have,
					ix.endpoint(e).holes[m].Load(), ix.endpoint(e).saturated[m].Load())
			}
		}
	}
	for g := range ix.Groups() {
		var set [NumMedia]int64
		for s := range ix.group(g).shards {
			for m, owners := range ix.group(g).shards[s].owners {
				for req, mask := range owners {
					set[m] += int64(bits.OnesCount64(mask))
					if mask == 0 {
						return fmt.Errorf("group %d medium %v: request key %x with no owner", g, Medium(m), req)
					}
					for b := mask; b != 0; b &= b - 1 {
						e := g*MaxEndpoints + bits.TrailingZeros64(b)
						if e >= ix.Endpoints() {
							return fmt.Errorf("group %d medium %v: request key %x owned by endpoint %d of %d", g, Medium(m), req, e, ix.Endpoints())
						}
						if ix.endpoint(e).held[req].c[m] == 0 {
							return fmt.Errorf("endpoint %d medium %v: bit set for request key %x it does not hold", e, Medium(m), req)
						}
					}
				}
			}
		}
		for m := range set {
			if have := ix.group(g).bits[m].Load(); have != set[m] {
				return fmt.Errorf("group %d medium %v: bit count %d, %d bits set", g, Medium(m), have, set[m])
			}
		}
	}
	return nil
}

func (ep *preciseEndpoint) consistent(ix *PreciseIndex, e int) error {
	bit := ix.owner(e)
	// Lists: every engine key and orphan has exactly one linked node.
	linked := map[uint64]uint32{}
	for _, l := range []uint32{leafList, innerList} {
		prev := l
		for n := ep.nodes[l].next; n != l; prev, n = n, ep.nodes[n].next {
			if ep.nodes[n].prev != prev {
				return fmt.Errorf("list %d: node %d's prev %d, want %d", l, n, ep.nodes[n].prev, prev)
			}
			if _, dup := linked[ep.nodes[n].key]; dup {
				return fmt.Errorf("key %x linked twice", ep.nodes[n].key)
			}
			linked[ep.nodes[n].key] = n
			if len(linked) > len(ep.nodes) {
				return fmt.Errorf("list %d loops", l)
			}
		}
	}
	if len(linked) != len(ep.eng)+len(ep.orphans) {
		return fmt.Errorf("%d linked nodes, %d engine keys + %d orphans", len(linked), len(ep.eng), len(ep.orphans))
	}
	if ep.capacity > 0 && len(ep.eng)+len(ep.orphans) > ep.capacity {
		return fmt.Errorf("%d engine keys + %d orphans over capacity %d", len(ep.eng), len(ep.orphans), ep.capacity)
	}
	counts := map[uint64]mediaCounts{}
	synthetic := 0
	for h, ent := range ep.eng {
		if linked[h] != ent.node {
			return fmt.Errorf("engine key %x: node %d, linked %d", h, ent.node, linked[h])
		}
		if _, o := ep.orphans[h]; o {
			return fmt.Errorf("engine key %x is an orphan too", h)
		}
		if ent.n == 0 {
			return fmt.Errorf("engine key %x holds nothing", h)
		}
		if h == syntheticKey(ent.req) {
			synthetic++
		}
		c := counts[ent.req]
		for m := range Medium(NumMedia) {
			c[m] += uint16(ent.n.get(m))
		}
		counts[ent.req] = c
	}
	if synthetic != ep.synthetic {
		return fmt.Errorf("%d synthetic keys, counted %d", synthetic, ep.synthetic)
	}
	for h, o := range ep.orphans {
		if linked[h] != o.node || o.n == 0 {
			return fmt.Errorf("orphan %x: node %d linked %d, counts %v", h, o.node, linked[h], o.n)
		}
	}
	for m := range Medium(NumMedia) {
		if ep.saturated[m].Load() {
			continue
		}
		blocks, holes := 0, int64(0)
		kids := map[uint64]uint16{}
		for req, he := range ep.held {
			if he.c[m] != counts[req][m] {
				return fmt.Errorf("medium %v: request key %x counts %d, engine keys %d", m, req, he.c[m], counts[req][m])
			}
			owned := bit.g.lookup(m, req)&bit.bit != 0
			if owned != (he.c[m] > 0) {
				return fmt.Errorf("medium %v: request key %x count %d, bit %v", m, req, he.c[m], owned)
			}
			if he.c[m] == 0 {
				continue
			}
			blocks++
			if he.parent != rootParent {
				kids[he.parent]++
				if ep.held[he.parent].c[m] == 0 {
					holes++
				}
			}
		}
		for req, he := range ep.held {
			if he.kids[m] != kids[req] {
				return fmt.Errorf("medium %v: request key %x kids %d, held children %d", m, req, he.kids[m], kids[req])
			}
		}
		if blocks != ep.blocks[m] || holes != ep.holes[m].Load() {
			return fmt.Errorf("medium %v: %d blocks, %d holes; counted %d, %d", m, blocks, holes, ep.blocks[m], ep.holes[m].Load())
		}
	}
	if err := ep.consistentTiers(); err != nil {
		return err
	}
	// The engine key last stored under a request key is in the inner list
	// exactly while the key has held children.
	for req, he := range ep.held {
		ent, ok := ep.eng[he.eng]
		if he.eng == 0 || !ok || ent.req != req {
			continue
		}
		inner := false
		for n := ep.nodes[innerList].next; n != innerList; n = ep.nodes[n].next {
			if n == ent.node {
				inner = true
			}
		}
		if inner != (he.kids != (mediaCounts{})) {
			return fmt.Errorf("request key %x: kids %v, in the inner list %v", req, he.kids, inner)
		}
	}
	return nil
}

// consistentTiers checks the per-medium lists: a bounded medium lists
// every engine key held there exactly once, no more than its capacity, and
// the engine key last stored under a request key is among its inner blocks
// exactly while the key has held children there; an unbounded one keeps
// nothing. ep.mu is held.
func (ep *preciseEndpoint) consistentTiers() error {
	for m := range Medium(NumMedia) {
		t := &ep.tiers[m]
		if t.capacity == 0 {
			if t.nodes != nil {
				return fmt.Errorf("medium %v: unbounded with %d nodes", m, len(t.nodes))
			}
			continue
		}
		leaf, inner := tierLists(m)
		listed := map[uint64]uint32{}
		innerKeys := map[uint64]bool{}
		for _, l := range []uint32{leaf, inner} {
			prev := l
			for n := ep.nodes[l].next; n != l; prev, n = n, ep.nodes[n].next {
				if ep.nodes[n].prev != prev {
					return fmt.Errorf("medium %v list %d: node %d's prev %d, want %d", m, l, n, ep.nodes[n].prev, prev)
				}
				h := ep.nodes[n].key
				if _, dup := listed[h]; dup {
					return fmt.Errorf("medium %v: key %x listed twice", m, h)
				}
				listed[h] = n
				innerKeys[h] = l == inner
				if len(listed) > len(ep.nodes) {
					return fmt.Errorf("medium %v list %d loops", m, l)
				}
			}
		}
		want := 0
		for h, ent := range ep.eng {
			if ent.n.get(m) == 0 {
				continue
			}
			want++
			if n, ok := t.nodes[h]; !ok || listed[h] != n {
				return fmt.Errorf("medium %v: engine key %x node %d (%v), listed %d", m, h, n, ok, listed[h])
			}
		}
		if want != len(listed) || want != len(t.nodes) {
			return fmt.Errorf("medium %v: %d keys held, %d listed, %d nodes", m, want, len(listed), len(t.nodes))
		}
		if len(t.nodes) > t.capacity {
			return fmt.Errorf("medium %v: %d keys over capacity %d", m, len(t.nodes), t.capacity)
		}
		for req, he := range ep.held {
			if ent, ok := ep.eng[he.eng]; he.eng == 0 || !ok || ent.req != req || ent.n.get(m) == 0 {
				continue
			}
			if innerKeys[he.eng] != (he.kids[m] != 0) {
				return fmt.Errorf("medium %v: request key %x kids %d, inner %v", m, req, he.kids[m], innerKeys[he.eng])
			}
		}
	}
	return nil
}

// TestPreciseCapacityFlood is the attack: an endpoint whose events announce
// 150× its capacity in BlockStored events. Before the bound the heap grew by
// about 118 bytes per announced block (1.5M blocks: +178 MB); now the
// endpoint holds its capacity and the rest is evicted and counted.
func TestPreciseCapacityFlood(t *testing.T) {
	const capacity, mult = 2_000, 150
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ix, _ := NewPreciseIndex(1, 16)
	ix.SetCapacity(0, capacity)
	toks := make([]uint32, 16*50)
	var parent uint64
	for i := 0; i < capacity*mult; i += 50 {
		for k := range toks {
			toks[k] = uint32(i*16 + k)
		}
		eng := preciseEngineKeys(toks, uint64(i))
		// Chains of 1000 blocks in events of 50, as a flood of long prompts.
		preciseStore(t, ix, 0, MediumGPU, eng, parent, i%1000 != 0, toks, 0)
		parent = eng[len(eng)-1]
	}
	ix.endpoint(0).keys = nil
	runtime.GC()
	runtime.ReadMemStats(&after)
	grew := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	st := ix.EndpointStats(0)
	t.Logf("%d blocks announced, capacity %d: heap %+.1f MB, %d held, %d evicted", capacity*mult, capacity, float64(grew)/1e6, st.EngineKeys, st.Evicted)
	if st.EngineKeys != capacity || st.Evicted != capacity*(mult-1) || ix.Len(0, MediumGPU) != capacity {
		t.Fatalf("stats %+v, len %d", st, ix.Len(0, MediumGPU))
	}
	if grew > capacity*1024 {
		t.Fatalf("heap grew %d bytes for a capacity of %d blocks", grew, capacity)
	}
	// Leaves went first: the newest whole chains are intact (prefix-closed,
	// no hole), the held blocks are the last ones announced.
	if h := ix.endpoint(0).holes[MediumGPU].Load(); h != 0 {
		t.Fatalf("%d holes after evicting leaves first", h)
	}
	checkPrecise(t, ix)
	runtime.KeepAlive(ix)
}

// TestPreciseEvictionOrder: a shared system prompt stays while cold
// conversations unwind from their tails, newest conversations kept.
func TestPreciseEvictionOrder(t *testing.T) {
	ix, _ := NewPreciseIndex(1, 16)
	sys := seq(16*4, 1)
	sysEng := preciseEngineKeys(sys, 0)
	preciseStore(t, ix, 0, MediumGPU, sysEng, 0, false, sys, 0)
	const convs, per = 10, 3
	req := make([][]uint64, convs)
	for c := range convs {
		toks := append(append([]uint32{}, sys...), seq(16*per, uint32(1000*(c+1)))...)
		eng := preciseEngineKeys(toks, 0)
		preciseStore(t, ix, 0, MediumGPU, eng[4:], sysEng[3], true, toks[64:], 0)
		req[c] = Hashes(nil, toks, 16, 0)
	}
	// 4 + 30 blocks; hold 4 + 3·3 + 2: the three newest conversations and
	// the first two blocks of the fourth newest survive.
	ix.SetCapacity(0, 4+3*per+2)
	checkPrecise(t, ix)
	m := make([]int, 1)
	for c := range convs {
		ix.Match(req[c], MediumGPU, m)
		want := 4
		switch {
		case c >= convs-3:
			want = 4 + per
		case c == convs-4:
			want = 4 + 2
		}
		if m[0] != want {
			t.Fatalf("conversation %d matches %d blocks, want %d", c, m[0], want)
		}
	}
	// A re-stored block counts as used: conversation 0, stored again,
	// survives the next evictions.
	toks := append(append([]uint32{}, sys...), seq(16*per, 1000)...)
	eng := preciseEngineKeys(toks, 0)
	preciseStore(t, ix, 0, MediumGPU, eng[4:], sysEng[3], true, toks[64:], 0)
	ix.Match(req[0], MediumGPU, m)
	if m[0] != 4+per {
		t.Fatalf("re-stored conversation matches %d", m[0])
	}
	if st := ix.EndpointStats(0); st.EngineKeys != 4+3*per+2 || st.Evicted == 0 {
		t.Fatalf("stats %+v", st)
	}
	checkPrecise(t, ix)
}

// TestPreciseBoundAgainstModel runs random stores (chained, orphaned,
// joined), removals, clears and capacity changes on small endpoints, and
// checks the internal invariants after every step.
func TestPreciseBoundAgainstModel(t *testing.T) {
	const eps, blocks = 3, 10
	rng := rand.New(rand.NewPCG(7, 8))
	type doc struct {
		toks []uint32
		req  []uint64
		eng  []uint64
	}
	var docs []doc
	for r := range 2 {
		root := seq(16*3, uint32(1000*r))
		for tail := range 4 {
			toks := append(append([]uint32{}, root...), seq(16*(blocks-3), uint32(100000+1000*(4*r+tail)))...)
			docs = append(docs, doc{toks: toks, req: Hashes(nil, toks, 16, 9), eng: preciseEngineKeys(toks, 0)})
		}
	}
	ix, _ := NewPreciseIndex(eps, 16)
	for e := range eps {
		ix.SetCapacity(e, 4+6*e)
	}
	for step := range 20000 {
		e, md := rng.IntN(eps), Medium(rng.IntN(2))
		d := docs[rng.IntN(len(docs))]
		switch op := rng.IntN(100); {
		case op < 50:
			from := rng.IntN(blocks)
			if rng.IntN(3) == 0 {
				from = 0
			}
			to := from + 1 + rng.IntN(blocks-from)
			var parent uint64
			if from > 0 {
				parent = d.eng[from-1]
			}
			if rng.IntN(4) == 0 {
				ix.Routed(e, d.req[:to+rng.IntN(blocks-to+1)])
			}
			if err := ix.Stored(e, md, d.eng[from:to], parent, from > 0, d.toks[16*from:16*to], 9); err != nil {
				t.Fatal(err)
			}
		case op < 90:
			var keys []uint64
			for _, h := range d.eng {
				if rng.IntN(3) == 0 {
					keys = append(keys, h)
				}
			}
			ix.Removed(e, md, keys)
		case op < 92:
			ix.Cleared(e)
		case op < 95:
			ix.SetCapacity(e, rng.IntN(3*blocks))
		}
		for e := range ix.Endpoints() {
			ep := ix.endpoint(e)
			ep.mu.Lock()
			err := ep.consistent(ix, e)
			ep.mu.Unlock()
			if err != nil {
				t.Fatalf("step %d: endpoint %d: %v", step, e, err)
			}
		}
	}
	var st PreciseEndpointStats
	for e := range eps {
		s := ix.EndpointStats(e)
		st.Evicted += s.Evicted
		st.Joined += s.Joined
		st.OrphansDropped += s.OrphansDropped
		st.UnknownParents += s.UnknownParents
	}
	t.Logf("%+v", st)
	if st.Evicted == 0 || st.Joined == 0 || st.OrphansDropped == 0 || st.UnknownParents == 0 {
		t.Fatalf("workload missed a path: %+v", st)
	}
}

// TestPreciseJoinAfterRestart is the gateway restart without a replay
// socket: the engine holds a conversation's earlier turns, whose events the
// index never saw. Each later turn's event chains from blocks it does not
// know. Before joins, every one was dropped and the conversation matched 0
// blocks for ever; now the turn's prompt, routed to the endpoint, explains
// the event, and the next turn matches everything the engine holds.
func TestPreciseJoinAfterRestart(t *testing.T) {
	ix, _ := NewPreciseIndex(2, 16)
	const seed = 5
	m := make([]int, 2)
	// Turn 1 (before the restart): 93 blocks cached on endpoint 1.
	conv := seq(16*93, 1)
	for turn := 2; turn <= 4; turn++ {
		prev := len(conv) / 16
		conv = append(conv, seq(16*47, uint32(100000*turn))...)
		req := Hashes(nil, conv, 16, seed)
		eng := preciseEngineKeys(conv, 0)
		ix.Match(req, MediumGPU, m)
		t.Logf("turn %d: predicted %d cached tokens on the engine, which holds %d", turn, m[1]*16, prev*16)
		if turn > 2 && m[1] != prev {
			t.Fatalf("turn %d: matched %d blocks, the engine holds %d", turn, m[1], prev)
		}
		// Routed to endpoint 1, which computes the new blocks.
		ix.Routed(1, req)
		preciseStore(t, ix, 1, MediumGPU, eng[prev:], eng[prev-1], true, conv[16*prev:], seed)
		ix.Match(req, MediumGPU, m)
		if m[1] != len(req) || m[0] != 0 {
			t.Fatalf("turn %d: after its event, matched %v of %d", turn, m, len(req))
		}
	}
	st := ix.EndpointStats(1)
	if st.UnknownParents != 1 || st.Joined != 1 || st.Orphans != 0 {
		t.Fatalf("stats %+v", st)
	}
	// The engine evicts the block the event chained from: the chain breaks
	// there, as the engine's own prefix lookup would.
	eng := preciseEngineKeys(conv, 0)
	ix.Removed(1, MediumGPU, eng[92:93])
	ix.Match(Hashes(nil, conv, 16, seed), MediumGPU, m)
	if m[1] != 92 {
		t.Fatalf("after removing block 92: matched %d", m[1])
	}
	// Real events for the blocks held under synthetic keys replace them.
	preciseStore(t, ix, 1, MediumGPU, eng[:93], 0, false, conv[:16*93], seed)
	ep := ix.endpoint(1)
	if ep.synthetic != 0 {
		t.Fatalf("%d synthetic keys left after the real events", ep.synthetic)
	}
	ix.Match(Hashes(nil, conv, 16, seed), MediumGPU, m)
	if m[1] != len(conv)/16 {
		t.Fatalf("matched %d", m[1])
	}
	checkPrecise(t, ix)
}

// TestPreciseJoinOrphanChain: events arrive whose prompts the gateway did
// not route (another gateway replica, a client of the engine): kept as an
// orphan chain; a later routed turn chained from it joins the whole chain
// under its request keys, engine keys and all.
func TestPreciseJoinOrphanChain(t *testing.T) {
	ix, _ := NewPreciseIndex(1, 16)
	conv := seq(16*40, 1) // blocks 0-9 cached before the gateway started
	eng := preciseEngineKeys(conv, 0)
	preciseStore(t, ix, 0, MediumGPU, eng[10:20], eng[9], true, conv[160:320], 0)
	preciseStore(t, ix, 0, MediumGPU, eng[20:30], eng[19], true, conv[320:480], 0)
	if st := ix.EndpointStats(0); st.Orphans != 20 || st.UnknownParents != 1 || st.Joined != 0 {
		t.Fatalf("stats %+v", st)
	}
	req := Hashes(nil, conv, 16, 0)
	ix.Routed(0, req)
	preciseStore(t, ix, 0, MediumGPU, eng[30:], eng[29], true, conv[480:], 0)
	m := make([]int, 1)
	ix.Match(req, MediumGPU, m)
	st := ix.EndpointStats(0)
	if m[0] != 40 || st.Orphans != 0 || st.Joined != 1 || ix.endpoint(0).synthetic != 9 {
		t.Fatalf("matched %d, %+v, %d synthetic", m[0], st, ix.endpoint(0).synthetic)
	}
	// The joined orphans kept their engine keys: the engine's removals work.
	ix.Removed(0, MediumGPU, eng[15:16])
	ix.Match(req, MediumGPU, m)
	if m[0] != 15 {
		t.Fatalf("after removing block 15: %d", m[0])
	}
	checkPrecise(t, ix)
	// A prompt that does not explain the event joins nothing.
	ix2, _ := NewPreciseIndex(1, 16)
	ix2.Routed(0, Hashes(nil, seq(16*40, 7), 16, 0))
	preciseStore(t, ix2, 0, MediumGPU, eng[30:], eng[29], true, conv[480:], 0)
	if st := ix2.EndpointStats(0); st.Joined != 0 || st.Orphans != 10 {
		t.Fatalf("unrelated prompt joined: %+v", st)
	}
}

// BenchmarkPreciseStored applies a step's BlockStored event (32 blocks,
// chained from the previous step) to an endpoint of 100k held blocks at its
// capacity, so that every event also evicts 32 blocks.
func BenchmarkPreciseStored(b *testing.B) {
	for _, bounded := range []bool{false, true} {
		b.Run(fmt.Sprintf("bounded=%v", bounded), func(b *testing.B) {
			ix, _ := NewPreciseIndex(1, 16)
			if bounded {
				ix.SetCapacity(0, 100_000)
			}
			toks := make([]uint32, 16*32)
			var parent uint64
			i := 0
			store := func() {
				for k := range toks {
					toks[k] = uint32(i*16 + k)
				}
				eng := preciseEngineKeys(toks, uint64(i))
				if err := ix.Stored(0, MediumGPU, eng, parent, i%1024 != 0, toks, 0); err != nil {
					b.Fatal(err)
				}
				parent = eng[len(eng)-1]
				i += 32
			}
			for i < 100_000 {
				store()
			}
			b.ReportAllocs()
			for b.Loop() {
				store()
			}
		})
	}
}

// FuzzPreciseIndex interprets its input as operations on a 2-endpoint
// index with small capacities — stores (rooted, chained, from unknown
// parents, without tokens as an offloading connector sends them) in three
// media, removals, routed prompts, clears of all media or one, capacity
// changes overall and per medium — and checks the internal invariants after
// each, and every fuzzed endpoint's Match of a document against the
// linear definition read from the owners masks. The index has 130
// endpoints (three groups of 64); the ops go to endpoints 0 and 64 (the
// first of two groups), then 63 and 129 (the last of a full group and of a
// partial one), alternating every 4 ops. The index is made with 64 and
// grown to 100, then 130 (a new group, then more of the last one: Grow),
// and every 17th op moves an endpoint's state to another fuzzed endpoint
// (Move, as the gateway moves a kv_store's slot). The seeds are the attack
// shapes: a flood of stores far over capacity, orphan chains, joins.
func FuzzPreciseIndex(f *testing.F) {
	f.Add(seqBytes(0x00, 200))                  // a flood of rooted stores
	f.Add(seqBytes(0x41, 200))                  // chained stores from unknown parents
	f.Add([]byte{0x83, 0x41, 0x42, 0x43, 0x05}) // route, orphan events, join
	f.Add([]byte{0xc2, 0x00, 0x01, 0x02, 0x60, 0xe0, 0x01})
	toks := seq(16*8*8, 1)
	docs := make([][]uint64, 8)
	reqs := make([][]uint64, 8)
	for d := range docs {
		docs[d] = preciseEngineKeys(toks[16*8*d:16*8*(d+1)], 0)
		reqs[d] = Hashes(nil, toks[16*8*d:16*8*(d+1)], 16, 0)
	}
	fuzzEps := [4]int{0, 64, 63, 129}
	f.Fuzz(func(t *testing.T, ops []byte) {
		ix, _ := NewPreciseIndex(64, 16)
		for _, n := range []int{100, 130} {
			if err := ix.Grow(n); err != nil {
				t.Fatal(err)
			}
		}
		ix.SetCapacity(0, 5)
		ix.SetCapacity(64, 12)
		ix.SetMediumCapacity(64, MediumCPU, 4)
		ix.SetCapacity(63, 7)
		ix.SetCapacity(129, 12)
		ix.SetMediumCapacity(129, MediumGPU, 6)
		m, floor, past := make([]int, 130), make([]int, 130), make([]int, 130)
		for i, op := range ops {
			e, d, from := fuzzEps[int(op>>7)+2*(i>>2&1)], int(op>>3)&7, int(op&7)
			md := Medium(i / 2 % 3) // GPU, GPU, CPU, CPU, DISK, DISK, ...
			switch {
			case i%17 == 16:
				to := fuzzEps[(slices.Index(fuzzEps[:], e)+1+int(op&1))%len(fuzzEps)]
				if err := ix.Move(e, to); err != nil {
					t.Fatal(err)
				}
			case i%7 == 6:
				ix.Removed(e, Medium(op&1), docs[d][from:min(8, from+2)])
			case op&0x60 == 0x60 && i%5 == 4:
				ix.Cleared(e)
			case op&0x60 == 0x40 && i%5 == 4:
				ix.ClearedMedium(e, md)
			case i%11 == 10:
				ix.SetCapacity(e, int(op&15))
			case i%13 == 12:
				ix.SetMediumCapacity(e, md, int(op&7))
			case op&0x80 != 0 && i%3 == 0:
				ix.Routed(e, reqs[d])
			case i%4 == 3: // an offload: no tokens, no parent
				if err := ix.Stored(e, md, docs[d][from:min(8, from+3)], 0, false, nil, 0); err != nil {
					t.Fatal(err)
				}
			default:
				to := min(8, from+1+int(op>>6&1)*3)
				var parent uint64
				if from > 0 {
					parent = docs[d][from-1]
				}
				if err := ix.Stored(e, md, docs[d][from:to], parent, from > 0, toks[16*(8*d+from):16*(8*d+to)], 0); err != nil {
					t.Fatal(err)
				}
			}
			checkPreciseOf(t, ix, fuzzEps[:])
			for md := range Medium(3) {
				ix.Match(reqs[d], md, m)
				for _, e := range fuzzEps {
					o := ix.owner(e)
					want := 0
					for want < len(reqs[d]) && ix.Owners(reqs[d][want], md, e/MaxEndpoints)&o.bit != 0 {
						want++
					}
					if m[e] != want || ix.MatchEndpoint(reqs[d], md, e) != want {
						t.Fatalf("op %d: endpoint %d medium %v: match %d (alone %d), linear %d", i, e, md, m[e], ix.MatchEndpoint(reqs[d], md, e), want)
					}
				}
				// MatchPast: exact past each endpoint's floor, at most the
				// floor below it (floors from the op, up to the whole prompt).
				for k, e := range fuzzEps {
					floor[e] = (int(op) + 3*k + i) % (len(reqs[d]) + 2)
				}
				ix.MatchPast(reqs[d], md, floor, past)
				for _, e := range fuzzEps {
					if (m[e] > floor[e] && past[e] != m[e]) || (m[e] <= floor[e] && past[e] > floor[e]) {
						t.Fatalf("op %d: endpoint %d medium %v: match %d, past floor %d %d", i, e, md, m[e], floor[e], past[e])
					}
				}
			}
		}
	})
}

func seqBytes(b byte, n int) []byte {
	out := make([]byte, n)
	for i := range out {
		out[i] = b + byte(i)
	}
	return out
}

// owner returns endpoint e's group and bit (0 <= e < Endpoints()).
func (ix *PreciseIndex) owner(e int) owner {
	_, o, _ := ix.at(e)
	return o
}
