package prefix

import (
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
)

// growDocs are 8 chained documents of 8 blocks: their tokens, the engine
// keys and the request keys.
func growDocs() (toks [][]uint32, eng, req [][]uint64) {
	all := seq(16*8*8, 1)
	for d := range 8 {
		t := all[16*8*d : 16*8*(d+1)]
		toks = append(toks, t)
		eng = append(eng, preciseEngineKeys(t, 0))
		req = append(req, Hashes(nil, t, 16, 0))
	}
	return toks, eng, req
}

// TestPreciseGrowAgainstBuilt: an index grown in steps (1, 64, 65, 130,
// 150, 1000 endpoints: within a group, across the 64 boundary, several
// groups at once) answers every Match, Len and EndpointStats as an index
// built at 1,000 endpoints that was told the same events, which only name
// endpoints the grown index had at the time; the grown endpoints start
// empty and unbounded, the others keep what they held.
func TestPreciseGrowAgainstBuilt(t *testing.T) {
	toks, eng, req := growDocs()
	r := rand.New(rand.NewPCG(17, 64))
	grown, err := NewPreciseIndex(1, 16)
	if err != nil {
		t.Fatal(err)
	}
	built, _ := NewPreciseIndex(1000, 16)
	both := func(f func(ix *PreciseIndex)) { f(grown); f(built) }
	compare := func(stage int) {
		t.Helper()
		n := grown.Endpoints()
		a, b := make([]int, n), make([]int, n)
		for d := range req {
			for m := range Medium(3) {
				grown.Match(req[d], m, a)
				built.Match(req[d], m, b)
				if !slices.Equal(a, b) {
					t.Fatalf("stage %d doc %d medium %v: grown %v, built %v", stage, d, m, a, b)
				}
			}
		}
		for e := range n {
			for m := range Medium(3) {
				if grown.Len(e, m) != built.Len(e, m) {
					t.Fatalf("stage %d endpoint %d medium %v: Len %d, built %d", stage, e, m, grown.Len(e, m), built.Len(e, m))
				}
			}
			if g, b := grown.EndpointStats(e), built.EndpointStats(e); g != b {
				t.Fatalf("stage %d endpoint %d: %+v, built %+v", stage, e, g, b)
			}
		}
		if g, b := grown.Stats(), built.Stats(); g != b {
			t.Fatalf("stage %d: stats %+v, built %+v", stage, g, b)
		}
		checkPrecise(t, grown)
	}
	for stage, size := range []int{1, 64, 65, 130, 150, 1000} {
		if err := grown.Grow(size); err != nil {
			t.Fatal(err)
		}
		if grown.Endpoints() != size || grown.Groups() != (size+63)/64 {
			t.Fatalf("grown to %d: %d endpoints, %d groups", size, grown.Endpoints(), grown.Groups())
		}
		compare(stage) // the new endpoints hold nothing, the others what they held
		for range 400 {
			e := r.IntN(size)
			if r.IntN(2) == 0 {
				e = size - 1 - r.IntN(min(size, 3)) // the newest slots
			}
			d, from := r.IntN(8), r.IntN(8)
			m := Medium(r.IntN(3))
			switch r.IntN(10) {
			case 0:
				both(func(ix *PreciseIndex) { ix.Removed(e, m, eng[d][from:min(8, from+2)]) })
			case 1:
				both(func(ix *PreciseIndex) { ix.Cleared(e) })
			case 2:
				c := r.IntN(12)
				both(func(ix *PreciseIndex) { ix.SetCapacity(e, c) })
			case 3:
				both(func(ix *PreciseIndex) { ix.Routed(e, req[d]) })
			default:
				to := min(8, from+1+r.IntN(3))
				var parent uint64
				if from > 0 {
					parent = eng[d][from-1]
				}
				both(func(ix *PreciseIndex) {
					preciseStore(t, ix, e, m, eng[d][from:to], parent, from > 0, toks[d][16*from:16*to], 0)
				})
			}
		}
		compare(stage)
	}
	for _, bad := range []int{-1, MaxIndexEndpoints + 1} {
		if err := grown.Grow(bad); err == nil {
			t.Fatalf("Grow(%d) accepted", bad)
		}
	}
	if err := grown.Grow(10); err != nil || grown.Endpoints() != 1000 {
		t.Fatalf("Grow(10) of 1000: %v, %d endpoints", err, grown.Endpoints())
	}
}

// TestPreciseGrowAcross64: the gateway's case. 64 endpoints, each e
// holding 1+e%8 blocks of a shared document (endpoint 10 all 8 of another
// one), capacities set; Grow(65) adds a second group whose endpoint 64
// starts empty: every Match of the 64 is what it was, endpoint 64 matches
// nothing until its own events, then what they stored.
func TestPreciseGrowAcross64(t *testing.T) {
	toks, eng, req := growDocs()
	ix, _ := NewPreciseIndex(64, 16)
	for e := range 64 {
		ix.SetCapacity(e, 100+e)
		k := 1 + e%8
		preciseStore(t, ix, e, MediumGPU, eng[0][:k], 0, false, toks[0][:16*k], 0)
	}
	preciseStore(t, ix, 10, MediumGPU, eng[1], 0, false, toks[1], 0)
	before := make([]int, 64)
	ix.Match(req[0], MediumGPU, before)
	if err := ix.Grow(65); err != nil {
		t.Fatal(err)
	}
	if ix.Endpoints() != 65 || ix.Groups() != 2 {
		t.Fatalf("%d endpoints, %d groups", ix.Endpoints(), ix.Groups())
	}
	after := make([]int, 65)
	after[64] = -1
	ix.Match(req[0], MediumGPU, after)
	if !slices.Equal(after[:64], before) || after[64] != 0 {
		t.Fatalf("after the grow: %v, before %v", after, before)
	}
	if got := ix.MatchEndpoint(req[1], MediumGPU, 10); got != 8 {
		t.Fatalf("endpoint 10 matches %d of its 8 blocks after the grow", got)
	}
	if st := ix.EndpointStats(64); st != (PreciseEndpointStats{}) || ix.EndpointStats(10).Capacity != 110 {
		t.Fatalf("endpoint 64: %+v; endpoint 10's capacity %d", st, ix.EndpointStats(10).Capacity)
	}
	preciseStore(t, ix, 64, MediumGPU, eng[2][:5], 0, false, toks[2][:5*16], 0)
	if got := ix.MatchEndpoint(req[2], MediumGPU, 64); got != 5 {
		t.Fatalf("endpoint 64 matches %d of the 5 blocks it stored", got)
	}
	if got := ix.MatchEndpoint(req[2], MediumGPU, 0); got != 0 {
		t.Fatalf("endpoint 0 (bit 0 of group 0) matches %d blocks endpoint 64 (bit 0 of group 1) stored", got)
	}
	checkPrecise(t, ix)
}

// TestPreciseMove: the kv_store's slot, the last of a 64-slot index, moves
// to the last of the grown index (127) with everything it held — blocks in
// REMOTE and GPU, orphans, capacities, counters — and slot 63, given to a
// new endpoint, starts empty: it inherits nothing of the store. What the
// target slot held before is forgotten; the other endpoints are untouched.
func TestPreciseMove(t *testing.T) {
	toks, eng, req := growDocs()
	ix, _ := NewPreciseIndex(64, 16)
	ix.SetCapacity(63, 1000)
	ix.SetMediumCapacity(63, MediumRemote, 500)
	preciseStore(t, ix, 63, MediumRemote, eng[0], 0, false, toks[0], 0)
	preciseStore(t, ix, 63, MediumGPU, eng[1][:3], 0, false, toks[1][:48], 0)
	preciseStore(t, ix, 63, MediumRemote, eng[2][4:6], eng[2][3], true, toks[2][64:96], 0) // orphans
	preciseStore(t, ix, 10, MediumGPU, eng[0][:4], 0, false, toks[0][:64], 0)
	ix.Routed(63, req[2]) // explains the orphans, once an event chains from them
	want, wantStats := ix.EndpointStats(63), ix.Stats()
	if want.Orphans != 2 || want.UnknownParents != 1 {
		t.Fatalf("store before the move: %+v", want)
	}
	if err := ix.Grow(128); err != nil {
		t.Fatal(err)
	}
	preciseStore(t, ix, 127, MediumGPU, eng[3], 0, false, toks[3], 0) // forgotten by the move
	if err := ix.Move(63, 127); err != nil {
		t.Fatal(err)
	}
	if got := ix.EndpointStats(127); got != want {
		t.Fatalf("moved store: %+v, want %+v", got, want)
	}
	if got := ix.Stats(); got.Blocks != wantStats.Blocks {
		t.Fatalf("%d blocks after the move, %d before", got.Blocks, wantStats.Blocks)
	}
	for _, c := range []struct {
		e, doc int
		m      Medium
		want   int
	}{
		{127, 0, MediumRemote, 8}, {127, 1, MediumGPU, 3}, {127, 3, MediumGPU, 0},
		{63, 0, MediumRemote, 0}, {63, 1, MediumGPU, 0}, {10, 0, MediumGPU, 4},
	} {
		if got := ix.MatchEndpoint(req[c.doc], c.m, c.e); got != c.want {
			t.Fatalf("endpoint %d doc %d %v: matched %d, want %d", c.e, c.doc, c.m, got, c.want)
		}
	}
	if st := ix.EndpointStats(63); st != (PreciseEndpointStats{}) {
		t.Fatalf("slot 63 after the move: %+v", st)
	}
	for m := range Medium(NumMedia) {
		if ix.Len(63, m) != 0 {
			t.Fatalf("slot 63 holds %d blocks in %v", ix.Len(63, m), m)
		}
	}
	checkPrecise(t, ix)
	// The moved orphans and routed prompt join at the new slot: an event
	// chained from an orphan is explained by the prompt routed before.
	preciseStore(t, ix, 127, MediumRemote, eng[2][6:8], eng[2][5], true, toks[2][96:128], 0)
	if got := ix.MatchEndpoint(req[2], MediumRemote, 127); got != 8 || ix.EndpointStats(127).Joined != 1 {
		t.Fatalf("the moved orphans: matched %d of 8, %+v", got, ix.EndpointStats(127))
	}
	// A new endpoint at 63 starts from its own events only.
	preciseStore(t, ix, 63, MediumGPU, eng[4][:2], 0, false, toks[4][:32], 0)
	if ix.MatchEndpoint(req[4], MediumGPU, 63) != 2 || ix.MatchEndpoint(req[4], MediumGPU, 127) != 0 ||
		ix.MatchEndpoint(req[0], MediumRemote, 63) != 0 {
		t.Fatal("slot 63 and the store share blocks")
	}
	checkPrecise(t, ix)
	for _, c := range [][2]int{{5, 5}, {-1, 3}, {0, 128}, {128, 0}} {
		if err := ix.Move(c[0], c[1]); err == nil {
			t.Fatalf("Move(%d, %d) accepted", c[0], c[1])
		}
	}
}

// TestPreciseGrowConcurrent (run with -race): writers on endpoints of the
// first group and, as soon as they exist, of later ones, Match with a
// matched slice of the final size and MatchTiers, all while the index
// grows from 64 to 1,000 endpoints a few at a time and a mover hands a
// chain back and forth between two slots; afterwards every writer's final
// state is exactly what it stored and the tables are consistent.
func TestPreciseGrowConcurrent(t *testing.T) {
	const final = 1000
	toks := seq(16*64, 1)
	eng := preciseEngineKeys(toks, 0)
	req := Hashes(nil, toks, 16, 0)
	ix, _ := NewPreciseIndex(64, 16)
	preciseStore(t, ix, 40, MediumGPU, eng[:9], 0, false, toks[:9*16], 0)
	ids := []int{0, 63, 64, 65, 500, 999}
	var done atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the grower
		defer wg.Done()
		for n := 64; n < final; {
			n = min(final, n+7)
			if err := ix.Grow(n); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	wg.Add(1)
	go func() { // the mover: 40 <-> 41
		defer wg.Done()
		for k := range 200 {
			if err := ix.Move(40+k%2, 41-k%2); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	var readers sync.WaitGroup
	for range 2 {
		readers.Add(1)
		go func() {
			defer readers.Done()
			m := make([]int, final)
			tiers := make([][NumMedia]int, final)
			for !done.Load() {
				ix.Match(req, MediumGPU, m)
				for e, n := range m {
					if n < 0 || n > len(req) {
						t.Errorf("endpoint %d matched %d", e, n)
						return
					}
				}
				ix.MatchTiers(req, tiers)
				_ = ix.Groups()
			}
		}()
	}
	for k, e := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(k), 5))
			for range 300 {
				if e >= ix.Endpoints() {
					continue // not yet grown: calls would be ignored or refused
				}
				ix.Cleared(e)
				n := 1 + rng.IntN(len(eng))
				if err := ix.Stored(e, MediumGPU, eng[:n], 0, false, toks[:16*n], 0); err != nil {
					t.Error(err)
					return
				}
				ix.Removed(e, MediumGPU, eng[rng.IntN(n):n])
				ix.SetCapacity(e, 10+rng.IntN(50))
			}
		}()
	}
	wg.Wait()
	done.Store(true)
	readers.Wait()
	if ix.Endpoints() != final {
		t.Fatalf("%d endpoints", ix.Endpoints())
	}
	for k, e := range ids {
		ix.Cleared(e)
		preciseStore(t, ix, e, MediumGPU, eng[:k+1], 0, false, toks[:16*(k+1)], 0)
	}
	m := make([]int, final)
	ix.Match(req, MediumGPU, m)
	for k, e := range ids {
		if m[e] != k+1 {
			t.Fatalf("endpoint %d: matched %d, want %d", e, m[e], k+1)
		}
	}
	if m[40] != 9 || m[41] != 0 { // 200 moves: back at 40
		t.Fatalf("the moved chain: endpoint 40 matches %d, 41 %d", m[40], m[41])
	}
	checkPrecise(t, ix)
}

// grow grows the model to n endpoints, the new ones of capacity c.
func (m *lruModel) grow(n, c int) {
	for len(m.caps) < n {
		m.caps = append(m.caps, c)
		m.held = append(m.held, map[uint64]int{})
	}
}

// TestIndexGrowAgainstModel: the approximate index grown in place (from 1
// to 64, 65, 130 and 150 endpoints, the new ones of another capacity each
// time) answers as the LRU model of every endpoint it has: the endpoints
// that were there keep their blocks and LRU order, the new ones start
// empty, learns queued before a Grow are applied where they were queued.
func TestIndexGrowAgainstModel(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 150))
	ix, err := NewIndex([]int{5})
	if err != nil {
		t.Fatal(err)
	}
	model := newLRUModel([]int{5})
	prompts := promptFamilies(r, 30, 60)
	for stage, g := range []struct{ n, c int }{{1, 5}, {64, 17}, {65, 3}, {130, 40}, {150, 8}} {
		if err := ix.Grow(g.n, g.c); err != nil {
			t.Fatal(err)
		}
		model.grow(g.n, g.c)
		if ix.Endpoints() != g.n {
			t.Fatalf("grown to %d: %d endpoints", g.n, ix.Endpoints())
		}
		ix.Settle() // the learn queued before the Grow
		checkModel(t, stage, ix, model, prompts[0])
		for step := range 600 {
			p := prompts[r.IntN(len(prompts))]
			e := r.IntN(g.n)
			if r.IntN(2) == 0 {
				e = g.n - 1 - r.IntN(min(g.n, 3))
			}
			switch {
			case r.IntN(200) == 0:
				ix.Clear(e)
				clear(model.held[e])
			case r.IntN(3) == 0:
				ix.Learn(e, p) // queued: applied by a later Insert, Clear or Settle
				model.insert(e, p)
			default:
				ix.Insert(e, p)
				model.insert(e, p)
			}
			if step%50 == 0 {
				ix.Settle() // Match shows queued learns but not what they evict
				checkModel(t, stage*1000+step, ix, model, prompts[r.IntN(len(prompts))])
			}
		}
		ix.Settle()
		checkModel(t, stage*1000+999, ix, model, prompts[1])
		ix.Learn(g.n-1, prompts[2]) // still queued when the index grows
		model.insert(g.n-1, prompts[2])
	}
	if err := ix.Grow(MaxIndexEndpoints+1, 1); err == nil {
		t.Fatal("Grow past MaxIndexEndpoints accepted")
	}
}

// TestIndexGrowConcurrent (run with -race): Insert, Learn, Settle, Clear,
// SetCapacity and Match (with a matched slice of the final size) from
// several goroutines while the index grows from 8 to 1,000 endpoints;
// afterwards Match is the linear scan of the owners tables.
func TestIndexGrowConcurrent(t *testing.T) {
	const final = 1000
	ix, _ := NewIndex(make([]int, 8))
	prompts := promptFamilies(rand.New(rand.NewPCG(8, 9)), 64, 300)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for n := 8; n < final; {
			n = min(final, n+13)
			if err := ix.Grow(n, 200); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 1))
			m := make([]int, final)
			for range 1500 {
				p := prompts[r.IntN(len(prompts))]
				e := r.IntN(ix.Endpoints())
				switch r.IntN(12) {
				case 0:
					ix.Clear(e)
				case 1:
					ix.SetCapacity(e, 100+r.IntN(500))
				case 2, 3:
					ix.Insert(e, p)
				case 4, 5:
					ix.Learn(e, p)
				case 6:
					ix.Settle()
				default:
					ix.Match(p, m)
					for e, n := range m {
						if n < 0 || n > len(p) {
							t.Errorf("endpoint %d matched %d of %d", e, n, len(p))
							return
						}
					}
				}
			}
		}()
	}
	wg.Wait()
	ix.Settle()
	if ix.Endpoints() != final {
		t.Fatalf("%d endpoints", ix.Endpoints())
	}
	m, lin := make([]int, final), make([]int, final)
	sh := ix.shape.Load()
	for _, p := range prompts {
		ix.Match(p, m)
		clear(lin)
		for g, grp := range sh.groups {
			lo, hi := g*MaxEndpoints, min(final, (g+1)*MaxEndpoints)
			matchLinear(p, lin[lo:hi], alive(hi-lo), grp.owners)
		}
		if !slices.Equal(m, lin) {
			t.Fatalf("after the writers stopped: match %v, linear %v", m, lin)
		}
	}
}

// BenchmarkPreciseGrow is what a reload that takes a pool past its slots
// costs the precise index: Grow by one group of 64 of an index of 64
// endpoints holding 1M blocks (preciseBenchIndex; 64→128, 128→192, …, the
// grown groups dropped every 255 Grows by putting the first shape back).
// The blocks held do not enter: Grow allocates the new group and publishes
// the list. Match and writers are never blocked by it.
func BenchmarkPreciseGrow(b *testing.B) {
	ix := preciseBenchIndex(b, 64).ix
	base := ix.shape.Load()
	defer ix.shape.Store(base)
	timeOps(b, func() {
		n := ix.Endpoints() + MaxEndpoints
		if n > MaxIndexEndpoints {
			ix.shape.Store(base)
			n = base.n + MaxEndpoints
		}
		if err := ix.Grow(n); err != nil {
			b.Fatal(err)
		}
	})
}

// BenchmarkIndexGrow is BenchmarkPreciseGrow for the approximate index:
// Grow by one group of an index of 64 endpoints holding 1M blocks
// (getFixture1M).
func BenchmarkIndexGrow(b *testing.B) {
	ix := getFixture1M(b, "grow").ix
	base := ix.shape.Load()
	defer ix.shape.Store(base)
	timeOps(b, func() {
		n := ix.Endpoints() + MaxEndpoints
		if n > MaxIndexEndpoints {
			ix.shape.Store(base)
			n = base.n + MaxEndpoints
		}
		if err := ix.Grow(n, 1000); err != nil {
			b.Fatal(err)
		}
	})
}

var (
	moveBenchOnce sync.Once
	moveBenchIx   *PreciseIndex
)

// BenchmarkPreciseMove is the kv_store's move when its pool's precise index
// grows from 64 to 128 slots: Move of an endpoint holding 1M blocks in
// REMOTE (chains of 250 blocks) from slot 63 to 127 and back, one Move per
// op. The store's feed waits for it; a Match meanwhile takes each shard's
// read lock between two of the Move's bit updates.
func BenchmarkPreciseMove(b *testing.B) {
	moveBenchOnce.Do(func() {
		ix, _ := NewPreciseIndex(128, 16)
		toks := make([]uint32, 250*16)
		for c := range 4000 {
			for i := range toks {
				toks[i] = uint32(c*len(toks) + i)
			}
			preciseStore(b, ix, 63, MediumRemote, preciseEngineKeys(toks, 3), 0, false, toks, 0)
		}
		moveBenchIx = ix
	})
	ix := moveBenchIx
	from, to := 63, 127
	if ix.Len(from, MediumRemote) == 0 {
		from, to = to, from
	}
	if n := ix.Len(from, MediumRemote); n != 1_000_000 {
		b.Fatalf("%d blocks", n)
	}
	timeOps(b, func() {
		if err := ix.Move(from, to); err != nil {
			b.Fatal(err)
		}
		from, to = to, from
	})
}
