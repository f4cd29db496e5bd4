package prefix

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
)

// preciseEngineKeys stands for an engine's own block hashes of tokens: a hash space
// unrelated to the index's request keys (another seed), salted like a cache
// salt or vLLM's per-process NONE_HASH.
func preciseEngineKeys(tokens []uint32, salt uint64) []uint64 {
	return Hashes(nil, tokens, 16, 0x5eed^salt*0x9e3779b97f4a7c15)
}

func preciseStore(t testing.TB, ix *PreciseIndex, e int, m Medium, eng []uint64, parent uint64, hasParent bool, toks []uint32, seed uint64) {
	t.Helper()
	if err := ix.Stored(e, m, eng, parent, hasParent, toks, seed); err != nil {
		t.Fatal(err)
	}
}

func TestPreciseStoredChainsAcrossEvents(t *testing.T) {
	ix, err := NewPreciseIndex(3, 16)
	if err != nil {
		t.Fatal(err)
	}
	const seed = 77
	toks := seq(16*10, 1)
	eng := preciseEngineKeys(toks, 0)
	req := Hashes(nil, toks, 16, seed)

	// Endpoint 0 stores blocks 0-3, then 4-9 with parent block 3: like vLLM,
	// one event per request and step.
	preciseStore(t, ix, 0, MediumGPU, eng[:4], 0, false, toks[:64], seed)
	preciseStore(t, ix, 0, MediumGPU, eng[4:], eng[3], true, toks[64:], seed)
	// Endpoint 1 stores the first 5 blocks in three events.
	preciseStore(t, ix, 1, MediumGPU, eng[:1], 0, false, toks[:16], seed)
	preciseStore(t, ix, 1, MediumGPU, eng[1:3], eng[0], true, toks[16:48], seed)
	preciseStore(t, ix, 1, MediumGPU, eng[3:5], eng[2], true, toks[48:80], seed)

	m := make([]int, 3)
	ix.Match(req, MediumGPU, m)
	if fmt.Sprint(m) != "[10 5 0]" {
		t.Fatalf("match %v, want [10 5 0]", m)
	}
	// Another root seed (another model or adapter): no match.
	ix.Match(Hashes(nil, toks, 16, seed+1), MediumGPU, m)
	if fmt.Sprint(m) != "[0 0 0]" {
		t.Fatalf("match under another seed %v", m)
	}
	// A prompt diverging after block 6.
	other := append(append([]uint32{}, toks[:16*7]...), seq(16*3, 90000)...)
	ix.Match(Hashes(nil, other, 16, seed), MediumGPU, m)
	if fmt.Sprint(m) != "[7 5 0]" {
		t.Fatalf("diverging prompt: match %v, want [7 5 0]", m)
	}
	if ix.Len(0, MediumGPU) != 10 || ix.Len(1, MediumGPU) != 5 || ix.Len(2, MediumGPU) != 0 {
		t.Fatalf("lens %d %d %d", ix.Len(0, MediumGPU), ix.Len(1, MediumGPU), ix.Len(2, MediumGPU))
	}
	if st := ix.Stats(); st.StoredEvents != 5 || st.Blocks != 15 || st.UnknownParents != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestPreciseUnknownParentOrphans: an event whose parent the endpoint does
// not know is kept under its engine keys (orphans): not matched, but chained
// from, removed, and counted.
func TestPreciseUnknownParentOrphans(t *testing.T) {
	ix, _ := NewPreciseIndex(2, 16)
	toks := seq(16*4, 1)
	eng := preciseEngineKeys(toks, 0)
	// Endpoint 1 knows block 0; endpoint 0 does not.
	preciseStore(t, ix, 1, MediumGPU, eng[:1], 0, false, toks[:16], 0)
	preciseStore(t, ix, 0, MediumGPU, eng[1:3], eng[0], true, toks[16:48], 0)
	preciseStore(t, ix, 0, MediumGPU, eng[3:], eng[2], true, toks[48:], 0) // chained from an orphan
	st := ix.EndpointStats(0)
	if ix.Len(0, MediumGPU) != 0 || st.Orphans != 3 || st.UnknownParents != 1 || ix.Stats().StoredEvents != 3 {
		t.Fatalf("orphans: len %d, %+v, %+v", ix.Len(0, MediumGPU), st, ix.Stats())
	}
	ix.Removed(0, MediumGPU, eng[3:])
	if st := ix.EndpointStats(0); st.Orphans != 2 || ix.Stats().UnknownRemovals != 0 {
		t.Fatalf("after removing an orphan: %+v", st)
	}
	// A parent held in another medium is known: the engine key → request key
	// map is per endpoint, not per medium. The stored block's orphan entry
	// gives way to the real one.
	preciseStore(t, ix, 0, MediumCPU, eng[:1], 0, false, toks[:16], 0)
	preciseStore(t, ix, 0, MediumGPU, eng[1:], eng[0], true, toks[16:], 0)
	m := make([]int, 2)
	req := Hashes(nil, toks, 16, 0)
	ix.Match(req, MediumGPU, m)
	if m[0] != 0 || m[1] != 1 {
		t.Fatalf("GPU match %v: endpoint 0 lacks block 0 on GPU", m)
	}
	ix.Match(req[1:], MediumGPU, m) // blocks 1-3 by themselves
	if m[0] != 3 || ix.EndpointStats(0).Orphans != 0 {
		t.Fatalf("GPU match of blocks 1-3: %v, %+v", m, ix.EndpointStats(0))
	}
	checkPrecise(t, ix)
	// Bad arguments.
	if ix.Stored(0, MediumGPU, eng[:2], 0, false, toks[:16], 0) == nil {
		t.Fatal("token count mismatch accepted")
	}
	if ix.Stored(2, MediumGPU, eng[:1], 0, false, toks[:16], 0) == nil || ix.Stored(0, NumMedia, eng[:1], 0, false, toks[:16], 0) == nil {
		t.Fatal("bad endpoint or medium accepted")
	}
}

func TestPreciseRemoveAndClear(t *testing.T) {
	ix, _ := NewPreciseIndex(2, 16)
	toks := seq(16*6, 1)
	eng := preciseEngineKeys(toks, 0)
	req := Hashes(nil, toks, 16, 0)
	for e := range 2 {
		preciseStore(t, ix, e, MediumGPU, eng, 0, false, toks, 0)
	}
	// Evict block 2 of endpoint 0: the chain breaks there, later blocks stay.
	ix.Removed(0, MediumGPU, eng[2:3])
	m := make([]int, 2)
	ix.Match(req, MediumGPU, m)
	if fmt.Sprint(m) != "[2 6]" {
		t.Fatalf("after removing block 2: %v", m)
	}
	ix.Match(req[3:], MediumGPU, m)
	if m[0] != 3 {
		t.Fatalf("blocks 3-5 of endpoint 0: %d", m[0])
	}
	// Removing what is not held is counted and ignored.
	ix.Removed(0, MediumGPU, []uint64{eng[2], 12345})
	ix.Removed(0, MediumCPU, eng[:1])
	if st := ix.Stats(); st.UnknownRemovals != 3 || st.RemovedEvents != 3 {
		t.Fatalf("stats %+v", st)
	}
	// Block 2 stored again, chained from block 1.
	preciseStore(t, ix, 0, MediumGPU, eng[2:3], eng[1], true, toks[32:48], 0)
	ix.Match(req, MediumGPU, m)
	if m[0] != 6 {
		t.Fatalf("after re-store: %v", m)
	}
	ix.Cleared(1)
	ix.Match(req, MediumGPU, m)
	if fmt.Sprint(m) != "[6 0]" || ix.Len(1, MediumGPU) != 0 {
		t.Fatalf("after clearing 1: %v", m)
	}
	// After a clear the endpoint's engine keys are forgotten: a chained event
	// is kept as an orphan, not matched.
	preciseStore(t, ix, 1, MediumGPU, eng[1:2], eng[0], true, toks[16:32], 0)
	if st := ix.EndpointStats(1); ix.Len(1, MediumGPU) != 0 || st.Orphans != 1 || st.UnknownParents != 1 {
		t.Fatalf("chained store after clear: len %d, %+v", ix.Len(1, MediumGPU), st)
	}
	ix.Forget(0)
	ix.Match(req, MediumGPU, m)
	if fmt.Sprint(m) != "[0 0]" || ix.Stats().Blocks != 0 {
		t.Fatalf("after forgetting 0: %v, %+v", m, ix.Stats())
	}
	if d := ix.distinct(); d != 0 {
		t.Fatalf("block tables hold %d entries after clearing every endpoint", d)
	}
}

// distinct is the number of (group, medium, request key) owners entries.
func (ix *PreciseIndex) distinct() int {
	n := 0
	for g := range ix.Groups() {
		for s := range ix.group(g).shards {
			for md := range ix.group(g).shards[s].owners {
				n += len(ix.group(g).shards[s].owners[md])
			}
		}
	}
	return n
}

func TestPreciseDuplicatesAndSharedRequestKeys(t *testing.T) {
	ix, _ := NewPreciseIndex(1, 16)
	toks := seq(32, 1)
	a, b := preciseEngineKeys(toks, 1), preciseEngineKeys(toks, 2) // e.g. two cache salts
	req := Hashes(nil, toks, 16, 0)
	preciseStore(t, ix, 0, MediumGPU, a, 0, false, toks, 0)
	preciseStore(t, ix, 0, MediumGPU, a, 0, false, toks, 0) // vLLM duplicate blocks
	preciseStore(t, ix, 0, MediumGPU, b, 0, false, toks, 0)
	m := make([]int, 1)
	check := func(want int) {
		t.Helper()
		if ix.Match(req, MediumGPU, m); m[0] != want {
			t.Fatalf("match %d, want %d", m[0], want)
		}
	}
	check(2)
	ix.Removed(0, MediumGPU, a)
	check(2) // one copy of a left
	ix.Removed(0, MediumGPU, a)
	check(2) // b holds the same request keys
	ix.Removed(0, MediumGPU, b[1:])
	check(1)
	ix.Removed(0, MediumGPU, b[:1])
	check(0)
	if ix.Len(0, MediumGPU) != 0 || len(ix.endpoint(0).eng) != 0 || len(ix.endpoint(0).held) != 0 {
		t.Fatalf("state left: %d engine keys, %d request keys", len(ix.endpoint(0).eng), len(ix.endpoint(0).held))
	}
}

func TestPreciseMediaSeparate(t *testing.T) {
	ix, _ := NewPreciseIndex(2, 16)
	toks := seq(16*4, 1)
	eng := preciseEngineKeys(toks, 0)
	req := Hashes(nil, toks, 16, 0)
	preciseStore(t, ix, 0, MediumGPU, eng, 0, false, toks, 0)
	preciseStore(t, ix, 0, MediumCPU, eng[:2], 0, false, toks[:32], 0)
	preciseStore(t, ix, 1, MediumDisk, eng[:3], 0, false, toks[:48], 0)
	preciseStore(t, ix, 1, MediumOther, eng[:1], 0, false, toks[:16], 0)
	m := make([]int, 2)
	for md, want := range map[Medium]string{MediumGPU: "[4 0]", MediumCPU: "[2 0]", MediumDisk: "[0 3]", MediumOther: "[0 1]"} {
		if ix.Match(req, md, m); fmt.Sprint(m) != want {
			t.Errorf("%v: %v, want %s", md, m, want)
		}
	}
	ix.Removed(0, MediumGPU, eng[:1]) // GPU eviction; the CPU copy stays
	if ix.Match(req, MediumGPU, m); m[0] != 0 {
		t.Fatalf("GPU after eviction %v", m)
	}
	if ix.Match(req, MediumCPU, m); m[0] != 2 {
		t.Fatalf("CPU after GPU eviction %v", m)
	}
	ix.Cleared(0) // all media
	for md := range Medium(NumMedia) {
		if ix.Len(0, md) != 0 {
			t.Fatalf("%v not cleared", md)
		}
	}
	if ix.Len(1, MediumDisk) != 3 {
		t.Fatal("clearing 0 touched 1")
	}
	for name, want := range map[string]Medium{"": MediumGPU, "gpu": MediumGPU, "GPU": MediumGPU, "Cpu": MediumCPU, "disk": MediumDisk, "Remote": MediumRemote, "nvme": MediumOther} {
		if got, known := ParseMedium(name); got != want || known != (want != MediumOther) {
			t.Errorf("ParseMedium(%q) = %v, %v", name, got, known)
		}
	}
}

// TestPreciseClearedMedium: a TierBlocksCleared of the GPU tier forgets the
// endpoint's GPU blocks (orphans too) and keeps its CPU copies and the other
// endpoints' blocks; later events chain again.
func TestPreciseClearedMedium(t *testing.T) {
	ix, _ := NewPreciseIndex(2, 16)
	toks := seq(16*4, 1)
	eng := preciseEngineKeys(toks, 0)
	req := Hashes(nil, toks, 16, 0)
	preciseStore(t, ix, 0, MediumGPU, eng, 0, false, toks, 0)
	preciseStore(t, ix, 0, MediumCPU, eng[:2], 0, false, toks[:32], 0)
	preciseStore(t, ix, 1, MediumGPU, eng[:3], 0, false, toks[:48], 0)
	other := seq(16*2, 5000)
	otherEng := preciseEngineKeys(other, 0)
	preciseStore(t, ix, 0, MediumGPU, otherEng[1:], 0xdead, true, other[16:], 0) // an orphan
	if st := ix.EndpointStats(0); st.Orphans != 1 {
		t.Fatalf("orphans before the tier clear: %+v", st)
	}
	ix.ClearedMedium(0, MediumGPU)
	m := make([]int, 2)
	if ix.Match(req, MediumGPU, m); fmt.Sprint(m) != "[0 3]" {
		t.Fatalf("GPU after the tier clear: %v, want [0 3]", m)
	}
	if ix.Match(req, MediumCPU, m); fmt.Sprint(m) != "[2 0]" {
		t.Fatalf("CPU after the GPU tier clear: %v, want [2 0]", m)
	}
	if n := ix.Len(0, MediumGPU); n != 0 {
		t.Fatalf("endpoint 0 still holds %d GPU blocks", n)
	}
	if st := ix.EndpointStats(0); st.Orphans != 0 {
		t.Fatalf("orphans after the tier clear: %+v", st)
	}
	preciseStore(t, ix, 0, MediumGPU, eng[:2], 0, false, toks[:32], 0)
	preciseStore(t, ix, 0, MediumGPU, eng[2:], eng[1], true, toks[32:], 0)
	if ix.Match(req, MediumGPU, m); m[0] != 4 {
		t.Fatalf("GPU after storing again: %v", m)
	}
	ix.ClearedMedium(5, MediumGPU) // out of range: ignored
	ix.ClearedMedium(0, Medium(NumMedia))
}

func TestPreciseBadConstruction(t *testing.T) {
	if _, err := NewPreciseIndex(MaxIndexEndpoints+1, 16); err == nil {
		t.Fatalf("%d endpoints accepted", MaxIndexEndpoints+1)
	}
	if _, err := NewPreciseIndex(-1, 16); err == nil {
		t.Fatal("-1 endpoints accepted")
	}
	if _, err := NewPreciseIndex(1, 0); err == nil {
		t.Fatal("block size 0 accepted")
	}
	ix, _ := NewPreciseIndex(64, 16)
	toks := seq(16, 1)
	preciseStore(t, ix, 63, MediumGPU, preciseEngineKeys(toks, 0), 0, false, toks, 0)
	m := make([]int, 70)
	m[69] = -1
	ix.Match(Hashes(nil, toks, 16, 0), MediumGPU, m)
	if m[63] != 1 || m[69] != -1 {
		t.Fatalf("64 endpoints: %v", m)
	}
	ix.Removed(64, MediumGPU, nil)
	ix.Cleared(-1)
	if ix.Len(64, MediumGPU) != 0 {
		t.Fatal("out-of-range Len")
	}
}

// TestPreciseAgainstModel drives the index with random stores, evictions and
// clears on 5 endpoints and 2 media, over documents sharing prefixes and two
// engine salts (so engine keys differ where request keys agree), and checks
// every Match, Len and skip against a brute-force model that keeps, per
// (endpoint, medium), the multiset of engine keys held and recomputes request
// keys from each document's full token prefix. The second case puts the 5
// endpoints at the edges of three groups of 64 in an index of 130 (every
// other endpoint must match nothing, and MatchEndpoint must agree).
func TestPreciseAgainstModel(t *testing.T) {
	t.Run("5", func(t *testing.T) { testPreciseAgainstModel(t, 5, []int{0, 1, 2, 3, 4}) })
	t.Run("130", func(t *testing.T) { testPreciseAgainstModel(t, 130, []int{0, 63, 64, 127, 129}) })
}

// testPreciseAgainstModel is TestPreciseAgainstModel on an index of n
// endpoints, the model's endpoint k being ids[k].
func testPreciseAgainstModel(t *testing.T, n int, ids []int) {
	const (
		media  = 2
		blocks = 12
	)
	eps := len(ids)
	rng := rand.New(rand.NewPCG(1, 2))
	// Documents: three shared roots, each with a few tails.
	type doc struct {
		toks []uint32
		req  []uint64
		eng  [2][]uint64 // per salt
	}
	var docs []doc
	for r := range 3 {
		root := seq(16*4, uint32(1000*r))
		for tail := range 4 {
			toks := append(append([]uint32{}, root...), seq(16*(blocks-4), uint32(100000+1000*(4*r+tail)))...)
			d := doc{toks: toks, req: Hashes(nil, toks, 16, 9)}
			for s := range 2 {
				d.eng[s] = preciseEngineKeys(toks, uint64(s))
			}
			docs = append(docs, d)
		}
	}
	engToReq := map[uint64]uint64{}
	parentOf := map[uint64]uint64{} // request key -> parent request key (absent: root)
	for _, d := range docs {
		for i := 1; i < len(d.req); i++ {
			parentOf[d.req[i]] = d.req[i-1]
		}
	}
	bisected := 0
	for _, d := range docs {
		for s := range 2 {
			for i, h := range d.eng[s] {
				engToReq[h] = d.req[i]
			}
		}
	}
	held := make([][media]map[uint64]int, eps)    // engine key -> count
	orphans := make([][media]map[uint64]int, eps) // engine key -> count, parent unknown
	for e := range held {
		for md := range media {
			held[e][md] = map[uint64]int{}
			orphans[e][md] = map[uint64]int{}
		}
	}
	knows := func(e int, h uint64) bool {
		for md := range media {
			if held[e][md][h] > 0 {
				return true
			}
		}
		return false
	}
	ix, _ := NewPreciseIndex(n, 16)
	m := make([]int, n)
	for step := range 20000 {
		e, md := rng.IntN(eps), rng.IntN(media)
		switch op := rng.IntN(100); {
		case op < 55: // store blocks [from, to) of a document
			d := docs[rng.IntN(len(docs))]
			s := rng.IntN(2)
			from := rng.IntN(blocks)
			if rng.IntN(3) == 0 {
				from = 0
			}
			to := from + 1 + rng.IntN(blocks-from)
			var parent uint64
			if from > 0 {
				parent = d.eng[s][from-1]
			}
			err := ix.Stored(ids[e], Medium(md), d.eng[s][from:to], parent, from > 0, d.toks[16*from:16*to], 9)
			if err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			if from > 0 && !knows(e, parent) {
				// Kept as orphans (no prompt was routed, so no join): not
				// matched; blocks already known are held again.
				for _, h := range d.eng[s][from:to] {
					if knows(e, h) {
						held[e][md][h]++
					} else {
						orphans[e][md][h]++
					}
				}
				break
			}
			for _, h := range d.eng[s][from:to] {
				if !knows(e, h) {
					// An orphan's blocks, in every medium, join it.
					for omd := range media {
						if n := orphans[e][omd][h]; n > 0 {
							held[e][omd][h] += n
							delete(orphans[e][omd], h)
						}
					}
				}
				held[e][md][h]++
			}
		case op < 93: // evict some held engine keys (and a few unknown ones)
			var keys []uint64
			for h := range held[e][md] {
				if rng.IntN(4) == 0 {
					keys = append(keys, h)
				}
			}
			if rng.IntN(5) == 0 {
				keys = append(keys, rng.Uint64())
			}
			ix.Removed(ids[e], Medium(md), keys)
			for _, h := range keys {
				switch {
				case held[e][md][h] > 0:
					if held[e][md][h]--; held[e][md][h] == 0 {
						delete(held[e][md], h)
					}
				case orphans[e][md][h] > 0:
					if orphans[e][md][h]--; orphans[e][md][h] == 0 {
						delete(orphans[e][md], h)
					}
				}
			}
		case op < 95:
			ix.Cleared(ids[e])
			for md := range media {
				clear(held[e][md])
				clear(orphans[e][md])
			}
		}
		// Check a random document prefix on both media.
		d := docs[rng.IntN(len(docs))]
		q := d.req[:rng.IntN(blocks+1)]
		for md := range media {
			ix.Match(q, Medium(md), m)
			matched := 0
			for _, k := range m {
				if k > 0 {
					matched++
				}
			}
			for e := range eps {
				have := map[uint64]bool{}
				for h := range held[e][md] {
					have[engToReq[h]] = true
				}
				want := 0
				for want < len(q) && have[q[want]] {
					want++
				}
				if got := m[ids[e]]; got != want || ix.MatchEndpoint(q, Medium(md), ids[e]) != want {
					t.Fatalf("step %d medium %d endpoint %d: match %d (alone %d), model %d", step, md, ids[e], got, ix.MatchEndpoint(q, Medium(md), ids[e]), want)
				}
				if want > 0 {
					matched--
				}
				if ix.Len(ids[e], Medium(md)) != len(have) {
					t.Fatalf("step %d: Len %d, model %d", step, ix.Len(ids[e], Medium(md)), len(have))
				}
				holes := 0
				for k := range have {
					if p, ok := parentOf[k]; ok && !have[p] {
						holes++
					}
				}
				if got := ix.endpoint(ids[e]).holes[md].Load(); got != int64(holes) {
					t.Fatalf("step %d medium %d endpoint %d: %d holes counted, model %d", step, md, e, got, holes)
				}
				if holes == 0 && len(have) > 0 {
					bisected++
				}
			}
			if matched != 0 {
				t.Fatalf("step %d medium %d: %d endpoints outside the model matched: %v", step, md, matched, m)
			}
		}
	}
	st := ix.Stats()
	t.Logf("%+v; %d checks on prefix-closed, non-empty endpoints (bisected)", st, bisected)
	if bisected < 1000 {
		t.Fatalf("only %d checks took the bisection path", bisected)
	}
	if st.UnknownParents == 0 || st.UnknownRemovals == 0 || st.Blocks == 0 {
		t.Fatalf("workload missed a path: %+v", st)
	}
}

// TestPreciseConcurrent runs one writer per endpoint (stores, evictions,
// clears) against readers, then checks the final state; run with -race. The
// second case has 130 endpoints (three groups), writers on 8 of them at
// the groups' edges and readers matching all 130.
func TestPreciseConcurrent(t *testing.T) {
	t.Run("8", func(t *testing.T) { testPreciseConcurrent(t, 8, []int{0, 1, 2, 3, 4, 5, 6, 7}) })
	t.Run("130", func(t *testing.T) { testPreciseConcurrent(t, 130, []int{0, 1, 63, 64, 65, 127, 128, 129}) })
}

// testPreciseConcurrent is TestPreciseConcurrent on an index of n
// endpoints whose writers are ids.
func testPreciseConcurrent(t *testing.T, n int, ids []int) {
	eps := len(ids)
	ix, _ := NewPreciseIndex(n, 16)
	toks := seq(16*64, 1)
	eng := preciseEngineKeys(toks, 0)
	req := Hashes(nil, toks, 16, 0)
	stop := make(chan struct{})
	var readers sync.WaitGroup
	for range 2 {
		readers.Add(1)
		go func() {
			defer readers.Done()
			m := make([]int, n)
			for {
				select {
				case <-stop:
					return
				default:
				}
				ix.Match(req, MediumGPU, m)
				for e, n := range m {
					if n < 0 || n > len(req) {
						t.Errorf("endpoint %d matched %d", e, n)
					}
				}
				_ = ix.Stats()
			}
		}()
	}
	var writers sync.WaitGroup
	for k, e := range ids {
		writers.Add(1)
		go func() {
			defer writers.Done()
			rng := rand.New(rand.NewPCG(uint64(k), 3))
			for range 300 {
				ix.Cleared(e)
				n := 1 + rng.IntN(len(eng))
				if err := ix.Stored(e, MediumGPU, eng[:n], 0, false, toks[:16*n], 0); err != nil {
					t.Error(err)
					return
				}
				ix.Removed(e, MediumGPU, eng[rng.IntN(n):n])
			}
			// Final state: writer k holds the first k+1 blocks.
			ix.Cleared(e)
			if err := ix.Stored(e, MediumGPU, eng[:k+1], 0, false, toks[:16*(k+1)], 0); err != nil {
				t.Error(err)
			}
		}()
	}
	writers.Wait()
	close(stop)
	readers.Wait()
	m := make([]int, n)
	ix.Match(req, MediumGPU, m)
	for k, e := range ids {
		if m[e] != k+1 || ix.Len(e, MediumGPU) != k+1 {
			t.Fatalf("endpoint %d: match %d, len %d, want %d", e, m[e], ix.Len(e, MediumGPU), k+1)
		}
	}
	if st := ix.Stats(); st.Blocks != int64(eps*(eps+1)/2) {
		t.Fatalf("blocks %d", st.Blocks)
	}
	checkPrecise(t, ix)
}

// TestPreciseManyEndpoints: 1,000 endpoints (16 groups) sharing one
// chained prompt, endpoint e holding its first 1+e%50 blocks on the GPU
// and, for every third endpoint, its first 2+e%7 in CPU: matching every
// endpoint and each alone, MatchTiers, removal of a block in the middle
// (the endpoint is holey, matched linearly), Forget, ClearedMedium and
// Cleared, each touching its endpoint's group only, and no owners entry
// left once every endpoint is cleared.
func TestPreciseManyEndpoints(t *testing.T) {
	const n, blocks = 1000, 64
	ix, err := NewPreciseIndex(n, 16)
	if err != nil || ix.Groups() != 16 {
		t.Fatalf("%v, %d groups", err, ix.Groups())
	}
	toks := seq(16*blocks, 1)
	eng := preciseEngineKeys(toks, 0)
	req := Hashes(nil, toks, 16, 0)
	gpu := func(e int) int { return 1 + e%50 }
	cpu := func(e int) int {
		if e%3 != 0 {
			return 0
		}
		return min(1+e%50, 2+e%7) // offloaded copies of GPU blocks
	}
	for e := range n {
		preciseStore(t, ix, e, MediumGPU, eng[:gpu(e)], 0, false, toks[:16*gpu(e)], 0)
		if c := cpu(e); c > 0 {
			preciseStore(t, ix, e, MediumCPU, eng[:c], 0, false, nil, 0)
		}
	}
	checkPrecise(t, ix)
	want := make([]int, n)
	for e := range want {
		want[e] = gpu(e)
	}
	m := make([]int, n+3)
	m[n], m[n+2] = -1, -1
	tiers := make([][NumMedia]int, n)
	check := func(what string) {
		t.Helper()
		ix.Match(req, MediumGPU, m)
		ix.MatchTiers(req, tiers)
		for e := range n {
			if m[e] != want[e] || ix.MatchEndpoint(req, MediumGPU, e) != want[e] || tiers[e][MediumGPU] != want[e] {
				t.Fatalf("%s: endpoint %d matched %d (alone %d, tiers %d), want %d", what, e, m[e], ix.MatchEndpoint(req, MediumGPU, e), tiers[e][MediumGPU], want[e])
			}
		}
		if m[n] != -1 || m[n+2] != -1 {
			t.Fatalf("%s: entries past the endpoints written: %v", what, m[n:])
		}
		checkPrecise(t, ix)
	}
	check("stored")
	for e := range n {
		if tiers[e][MediumCPU] != cpu(e) || tiers[e][MediumDisk] != 0 {
			t.Fatalf("endpoint %d: tiers %v, want CPU %d", e, tiers[e], cpu(e))
		}
	}
	if st := ix.Stats(); st.Blocks != int64(sumOf(n, gpu)+sumOf(n, cpu)) {
		t.Fatalf("blocks %d, want %d", st.Blocks, sumOf(n, gpu)+sumOf(n, cpu))
	}

	// Endpoint 999 (bit 39 of group 15) loses block 5 of its 50: it holds
	// the first 5 and a hole.
	ix.Removed(999, MediumGPU, eng[5:6])
	want[999] = 5
	check("removed")
	if ix.endpoint(999).holes[MediumGPU].Load() != 1 || ix.Len(999, MediumGPU) != 49 {
		t.Fatalf("endpoint 999: %d holes, %d blocks", ix.endpoint(999).holes[MediumGPU].Load(), ix.Len(999, MediumGPU))
	}
	// Forget the first endpoint of group 1, Cleared the last of group 0,
	// ClearedMedium(CPU) of one in group 7: nobody else changes.
	ix.Forget(64)
	ix.Cleared(63)
	ix.ClearedMedium(450, MediumCPU)
	want[64], want[63] = 0, 0
	check("forgotten")
	for e := range n {
		wantCPU := cpu(e)
		if e == 450 || e == 63 || e == 64 {
			wantCPU = 0
		}
		if tiers[e][MediumCPU] != wantCPU {
			t.Fatalf("endpoint %d: CPU %d, want %d", e, tiers[e][MediumCPU], wantCPU)
		}
	}
	if ix.Len(450, MediumGPU) != gpu(450) {
		t.Fatalf("ClearedMedium(CPU) took endpoint 450's GPU blocks: %d", ix.Len(450, MediumGPU))
	}
	// A prompt nobody holds, and one only the last endpoint holds.
	other := seq(16*blocks, 50_000)
	ix.Match(Hashes(nil, other, 16, 0), MediumGPU, m)
	for e := range n {
		if m[e] != 0 {
			t.Fatalf("miss: endpoint %d matched %d", e, m[e])
		}
	}
	preciseStore(t, ix, n-1, MediumGPU, preciseEngineKeys(other, 0), 0, false, other, 0)
	ix.Match(Hashes(nil, other, 16, 0), MediumGPU, m)
	if m[n-1] != blocks || slices.Max(m[:n-1]) != 0 {
		t.Fatalf("last endpoint's prompt: %v", m[n-3:n])
	}
	for e := range n {
		ix.Cleared(e)
	}
	if d, st := ix.distinct(), ix.Stats(); d != 0 || st.Blocks != 0 {
		t.Fatalf("after clearing every endpoint: %d owners entries, %d blocks", d, st.Blocks)
	}
}

func sumOf(n int, f func(int) int) int {
	s := 0
	for e := range n {
		s += f(e)
	}
	return s
}

// TestPreciseIndexBytesPerBlock measures the heap cost per (endpoint, block)
// entry, 200,000 entries on one endpoint and spread over 64 and 1,000 (16
// groups; each endpoint its own chains, so one holder per block), and holds
// it to the bound stated in PreciseIndex's doc comment. The empty index's
// own cost (block tables, endpoints) is counted too.
func TestPreciseIndexBytesPerBlock(t *testing.T) {
	const n = 200_000
	toks := seq(n*16, 0)
	eng := preciseEngineKeys(toks, 0)
	for _, eps := range []int{1, 64, 1000} {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		ix, _ := NewPreciseIndex(eps, 16)
		// Events of 50 blocks each, chained within an endpoint's share.
		per := n / eps / 50 * 50
		for e := range eps {
			for i := e * per; i < (e+1)*per; i += 50 {
				var parent uint64
				if i > e*per {
					parent = eng[i-1]
				}
				preciseStore(t, ix, e, MediumGPU, eng[i:i+50], parent, i > e*per, toks[16*i:16*(i+50)], 0)
			}
			ix.endpoint(e).keys = nil // scratch, not per block
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		held := int(ix.Stats().Blocks)
		bytes := float64(after.HeapAlloc-before.HeapAlloc) / float64(held)
		t.Logf("%d endpoints: %.1f bytes per indexed block (%d blocks)", eps, bytes, held)
		if held != eps*per || bytes > 160 {
			t.Fatalf("%d endpoints: %.1f bytes per indexed block (%d blocks), over the documented 160", eps, bytes, held)
		}
		runtime.KeepAlive(ix)
	}
	runtime.KeepAlive(toks)
	runtime.KeepAlive(eng)
}

// preciseBenchFixture is a precise index of 64 (or 1,000: 16 groups)
// endpoints and about 1M distinct blocks, with 750-block (12k-token)
// prompts held as:
//   - typical: every endpoint holds its first 125 blocks (a shared system
//     prompt), endpoints 1-3 hold 400, endpoint 0 all 750 (as in the
//     approximate index's 64x1M benchmarks);
//   - staggered: endpoint e of N holds the first 750·(e+1)/N blocks;
//   - full: every endpoint holds all 750 (no endpoint drops out: the scan
//     runs to the end with 64 survivors, the worst case);
//   - miss: held by none;
//
// and unique filler chains up to 1M blocks.
type preciseBenchFixture struct {
	ix                             *PreciseIndex
	typical, staggered, full, miss []uint64
}

var (
	preciseBenchMu sync.Mutex
	preciseBenches = map[int]*preciseBenchFixture{}
)

// preciseBenchIndex returns the fixture of eps endpoints, built once.
func preciseBenchIndex(b *testing.B, eps int) preciseBenchFixture {
	preciseBenchMu.Lock()
	defer preciseBenchMu.Unlock()
	if f := preciseBenches[eps]; f != nil {
		return *f
	}
	var preciseBench preciseBenchFixture
	{
		const (
			total   = 1_000_000
			promptN = 750
			chunk   = 250
		)
		ix, _ := NewPreciseIndex(eps, 16)
		held := 0
		prompt := func(start uint32, blocks func(e int) int) []uint64 {
			toks := seq(promptN*16, start)
			eng := preciseEngineKeys(toks, 0)
			for e := range eps {
				if n := blocks(e); n > 0 {
					preciseStore(b, ix, e, MediumGPU, eng[:n], 0, false, toks[:16*n], 0)
				}
			}
			held += promptN
			return Hashes(nil, toks, 16, 0)
		}
		preciseBench.typical = prompt(1, func(e int) int {
			switch {
			case e == 0:
				return promptN
			case e <= 3:
				return 400
			}
			return 125
		})
		preciseBench.staggered = prompt(100_000, func(e int) int { return promptN * (e + 1) / eps })
		preciseBench.full = prompt(200_000, func(int) int { return promptN })
		preciseBench.miss = Hashes(nil, seq(promptN*16, 300_000), 16, 0)
		per := (total - held) / eps
		ftoks := make([]uint32, chunk*16)
		for e := range eps {
			for done := 0; done < per; done += chunk {
				n := min(chunk, per-done)
				for i := range ftoks[:16*n] {
					ftoks[i] = uint32(1_000_000 + e*per*16 + done*16 + i)
				}
				preciseStore(b, ix, e, MediumGPU, preciseEngineKeys(ftoks[:16*n], 7), 0, false, ftoks[:16*n], 0)
			}
		}
		preciseBench.ix = ix
	}
	preciseBenches[eps] = &preciseBench
	return preciseBench
}

// BenchmarkPreciseMatch64x1M matches 750-block prompts against 64 endpoints
// and 1M blocks (see preciseBenchFixture), one goroutine, then "parallel"
// (the staggered prompt from every P).
func BenchmarkPreciseMatch64x1M(b *testing.B) { benchPreciseMatch(b, 64) }

// BenchmarkPreciseMatch1000x1M is BenchmarkPreciseMatch64x1M with 1,000
// endpoints (16 groups of 64) holding the same 1M blocks.
func BenchmarkPreciseMatch1000x1M(b *testing.B) { benchPreciseMatch(b, 1000) }

func benchPreciseMatch(b *testing.B, eps int) {
	f := preciseBenchIndex(b, eps)
	distinct := f.ix.distinct()
	b.Logf("%d distinct blocks, %d (endpoint, block) entries", distinct, f.ix.Stats().Blocks)
	m := make([]int, eps)
	last := eps - 1
	for _, c := range []struct {
		name   string
		prompt []uint64
		check  func() bool
	}{
		{"typical", f.typical, func() bool { return m[0] == 750 && m[1] == 400 && m[last] == 125 }},
		{"staggered", f.staggered, func() bool { return m[0] == 750/eps && m[last] == 750 }},
		{"full", f.full, func() bool { return m[0] == 750 && m[last] == 750 }},
		{"miss", f.miss, func() bool { return m[0] == 0 && m[last] == 0 }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				f.ix.Match(c.prompt, MediumGPU, m)
			}
			if !c.check() {
				b.Fatalf("match %v", m)
			}
		})
	}
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			m := make([]int, eps)
			for pb.Next() {
				f.ix.Match(f.staggered, MediumGPU, m)
			}
		})
	})
}

// TestPreciseMatchHintsAgainstModel: with more than one group, Match cuts
// every group after the first holding the prompt at the lengths that group
// found (at most maxHints), then bisects. Endpoints of 5 groups hold random
// prefixes of one prompt, each group's lengths drawn from its own small
// set (so the hints are right for some groups, wrong or partial for
// others), some endpoints with a hole; every endpoint's match must be the
// leading blocks it holds. In odd rounds every endpoint holds a shared
// prefix too (a system prompt), so that the first group's hints are a
// lead (matchBisect reads the cuts first) in most of them.
func TestPreciseMatchHintsAgainstModel(t *testing.T) {
	const n, blocks = 300, 100
	rng := rand.New(rand.NewPCG(7, 8))
	toks := seq(16*blocks, 1)
	eng := preciseEngineKeys(toks, 0)
	req := Hashes(nil, toks, 16, 0)
	m := make([]int, n)
	leads := 0
	for round := range 80 {
		ix, _ := NewPreciseIndex(n, 16)
		want := make([]int, n)
		shared := 0
		if round%2 == 1 {
			shared = 1 + rng.IntN(blocks/2)
		}
		for g := range 5 {
			set := make([]int, 1+rng.IntN(6)) // 1-6 lengths: within or past maxHints
			for i := range set {
				set[i] = rng.IntN(blocks + 1)
			}
			for e := g * 64; e < min(n, (g+1)*64); e++ {
				k := set[rng.IntN(len(set))]
				if rng.IntN(4) == 0 {
					k = rng.IntN(blocks + 1)
				}
				k = max(k, shared)
				want[e] = k
				if k > 0 {
					preciseStore(t, ix, e, MediumGPU, eng[:k], 0, false, toks[:16*k], 0)
				}
				if k > 2 && rng.IntN(10) == 0 { // a hole: the endpoint is matched linearly
					hole := rng.IntN(k - 1)
					ix.Removed(e, MediumGPU, eng[hole:hole+1])
					want[e] = hole
				}
			}
		}
		for _, q := range [][]uint64{req, req[:1+rng.IntN(blocks)]} {
			if leadOf(want, len(q)) {
				leads++
			}
			ix.Match(q, MediumGPU, m)
			for e := range n {
				if w := min(want[e], len(q)); m[e] != w {
					t.Fatalf("round %d, %d-block query: endpoint %d matched %d, holds %d", round, len(q), e, m[e], w)
				}
			}
		}
	}
	if leads < 40 {
		t.Fatalf("%d queries had a lead: the cuts-first reading is barely tested", leads)
	}
}

// leadOf reports whether Match of a q-block query over endpoints holding
// want[e] leading blocks reads its later groups' cuts first: every endpoint
// of the first group holding the first block holds it, and some stops
// inside the query (a hint).
func leadOf(want []int, q int) bool {
	for lo := 0; lo < len(want); lo += MaxEndpoints {
		grp := want[lo:min(len(want), lo+MaxEndpoints)]
		if !slices.ContainsFunc(grp, func(k int) bool { return k > 0 }) {
			continue
		}
		return !slices.Contains(grp, 0) && slices.ContainsFunc(grp, func(k int) bool { return k < q })
	}
	return false
}
