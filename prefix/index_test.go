package prefix

import (
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
)

func TestIndexMatch(t *testing.T) {
	ix, err := NewIndex([]int{100, 100, 100})
	if err != nil {
		t.Fatal(err)
	}
	a := Hashes(nil, seq(160, 0), 16, 0) // 10 blocks
	b := append(append([]uint32{}, seq(80, 0)...), seq(80, 5000)...)
	hb := Hashes(nil, b, 16, 0) // shares 5 blocks with a
	ix.Insert(0, a)
	ix.Insert(1, hb)
	m := make([]int, 3)
	ix.Match(a, m)
	if m[0] != 10 || m[1] != 5 || m[2] != 0 {
		t.Fatalf("match a = %v, want [10 5 0]", m)
	}
	ix.Match(hb, m)
	if m[0] != 5 || m[1] != 10 || m[2] != 0 {
		t.Fatalf("match b = %v, want [5 10 0]", m)
	}
	ix.Match(nil, m)
	if m[0]+m[1]+m[2] != 0 {
		t.Fatalf("empty prompt matched %v", m)
	}
	// A hole in the chain stops the match even if later blocks are present.
	c := append([]uint64{}, a...)
	c[3] = 12345
	ix.Match(c, m)
	if m[0] != 3 {
		t.Fatalf("match with hole = %d, want 3", m[0])
	}
}

func TestIndexLRUEvictsTailFirst(t *testing.T) {
	ix, _ := NewIndex([]int{8})
	a := Hashes(nil, seq(16*6, 0), 16, 0)    // 6 blocks
	b := Hashes(nil, seq(16*4, 9000), 16, 0) // 4 more: 10 > 8, evict 2
	ix.Insert(0, a)
	ix.Insert(0, b)
	if ix.Len(0) != 8 {
		t.Fatalf("len %d, want 8", ix.Len(0))
	}
	m := make([]int, 1)
	ix.Match(a, m)
	if m[0] != 4 {
		t.Fatalf("after eviction a matches %d blocks, want 4 (tail evicted first)", m[0])
	}
	ix.Match(b, m)
	if m[0] != 4 {
		t.Fatalf("b matches %d, want 4", m[0])
	}
	// Re-touching a makes b's tail the oldest.
	ix.Insert(0, a)
	ix.Match(b, m)
	if m[0] != 2 {
		t.Fatalf("b matches %d after a re-inserted, want 2", m[0])
	}
}

func TestIndexEvictionKeepsOtherOwners(t *testing.T) {
	ix, _ := NewIndex([]int{2, 10})
	a := Hashes(nil, seq(32, 0), 16, 0)
	ix.Insert(0, a)
	ix.Insert(1, a)
	ix.Insert(0, Hashes(nil, seq(32, 777), 16, 0)) // endpoint 0 forgets a
	m := make([]int, 2)
	ix.Match(a, m)
	if m[0] != 0 || m[1] != 2 {
		t.Fatalf("match %v, want [0 2]", m)
	}
	ix.Clear(1)
	ix.Match(a, m)
	if m[1] != 0 || ix.Len(1) != 0 {
		t.Fatalf("after Clear: %v len %d", m, ix.Len(1))
	}
	if n := ix.distinct(); n != 2 {
		t.Fatalf("owners table leaked: %d entries, want 2", n)
	}
}

func TestIndexTooManyEndpoints(t *testing.T) {
	if _, err := NewIndex(make([]int, MaxIndexEndpoints+1)); err == nil {
		t.Fatal("want error")
	}
	caps := make([]int, MaxEndpoints)
	for i := range caps {
		caps[i] = 10
	}
	ix, err := NewIndex(caps)
	if err != nil {
		t.Fatal(err)
	}
	h := Hashes(nil, seq(32, 0), 16, 0)
	ix.Insert(63, h)
	m := make([]int, 64)
	ix.Match(h, m)
	if m[63] != 2 || m[0] != 0 {
		t.Fatalf("endpoint 63: %d", m[63])
	}
	ix.Insert(64, h) // ignored
	ix.Insert(-1, h)
}

// TestIndexGroupsAgainstModel: a pool of 150 endpoints (three groups of
// owners tables: 64, 64 and 22) under random Inserts of chained prompts,
// their heads and mangled slices, and Clears, matches the linear definition
// for every endpoint; chained queries of chained inserts verify in one
// pass (no fallback) until misuse starts, which falls back per group.
func TestIndexGroupsAgainstModel(t *testing.T) {
	for seed := range uint64(2) {
		r := rand.New(rand.NewPCG(seed, 150))
		caps := make([]int, 150)
		for e := range caps {
			caps[e] = []int{1, 3, 8, 17, 40}[r.IntN(5)]
		}
		ix, err := NewIndex(caps)
		if err != nil {
			t.Fatal(err)
		}
		model := newLRUModel(caps)
		prompts := promptFamilies(r, 30, 60)
		got := make([]int, len(caps))
		for step := range 1200 {
			p := prompts[r.IntN(len(prompts))]
			e := r.IntN(len(caps))
			switch {
			case r.IntN(300) == 0:
				ix.Clear(e)
				clear(model.held[e])
			case step >= 900 && r.IntN(3) == 0: // misuse: a hole
				q := append([]uint64(nil), p...)
				q[r.IntN(len(q))] = r.Uint64N(50)
				ix.Insert(e, q)
				model.insert(e, q)
			case r.IntN(4) == 0:
				k := r.IntN(len(p) + 1)
				ix.Insert(e, p[:k])
				model.insert(e, p[:k])
			default:
				ix.Insert(e, p)
				model.insert(e, p)
			}
			q := prompts[r.IntN(len(prompts))]
			if r.IntN(3) == 0 {
				q = q[:r.IntN(len(q)+1)]
			}
			if step%100 == 0 {
				checkModel(t, step, ix, model, q) // Len and the owners tables too
			} else {
				ix.Match(q, got)
				for e := range caps {
					if want := model.match(q, e); got[e] != want {
						t.Fatalf("seed %d step %d: endpoint %d matched %d of %d blocks, model %d", seed, step, e, got[e], len(q), want)
					}
				}
			}
			if step == 899 && ix.linear.Load() != 0 {
				t.Fatalf("seed %d: %d Matches of chained prompts fell back to the linear scan", seed, ix.linear.Load())
			}
		}
		if ix.linear.Load() == 0 {
			t.Fatalf("seed %d: misuse never triggered the linear fallback", seed)
		}
	}
}

// TestIndexAgainstModel checks Match against a brute-force model over random
// inserts with eviction.
func TestIndexAgainstModel(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	const eps, capacity = 4, 40
	ix, _ := NewIndex([]int{capacity, capacity, capacity, capacity})
	type entry struct {
		h    uint64
		tick int
	}
	model := make([]map[uint64]int, eps) // hash -> last touch tick
	for i := range model {
		model[i] = map[uint64]int{}
	}
	tick := 0
	prompts := make([][]uint64, 12)
	for i := range prompts {
		base := seq(16*(2+r.IntN(10)), uint32(r.IntN(3))*1000) // few distinct heads, shared prefixes
		prompts[i] = Hashes(nil, base, 16, 0)
	}
	m := make([]int, eps)
	for step := 0; step < 2000; step++ {
		p := prompts[r.IntN(len(prompts))]
		e := r.IntN(eps)
		ix.Insert(e, p)
		for i := len(p) - 1; i >= 0; i-- {
			tick++
			model[e][p[i]] = tick
		}
		for len(model[e]) > capacity { // evict least recent
			var old entry
			old.tick = 1 << 62
			for h, tk := range model[e] {
				if tk < old.tick {
					old = entry{h, tk}
				}
			}
			delete(model[e], old.h)
		}
		q := prompts[r.IntN(len(prompts))]
		ix.Match(q, m)
		for e := range eps {
			want := 0
			for want < len(q) {
				if _, ok := model[e][q[want]]; !ok {
					break
				}
				want++
			}
			if m[e] != want {
				t.Fatalf("step %d endpoint %d: match %d, model %d", step, e, m[e], want)
			}
		}
	}
}

// lruModel is the brute-force definition of the index: per endpoint, the
// last touch tick of every block it holds, evicting the oldest beyond
// capacity; Match is the linear scan.
type lruModel struct {
	caps []int
	held []map[uint64]int
	tick int
}

func newLRUModel(caps []int) *lruModel {
	m := &lruModel{caps: caps, held: make([]map[uint64]int, len(caps))}
	for e := range m.held {
		m.held[e] = map[uint64]int{}
	}
	return m
}

func (m *lruModel) insert(e int, hashes []uint64) {
	for i := len(hashes) - 1; i >= 0; i-- {
		m.tick++
		m.held[e][hashes[i]] = m.tick
		if len(m.held[e]) > max(m.caps[e], 1) {
			oldest, ot := uint64(0), int(^uint(0)>>1)
			for h, tk := range m.held[e] {
				if tk < ot {
					oldest, ot = h, tk
				}
			}
			delete(m.held[e], oldest)
		}
	}
}

func (m *lruModel) match(hashes []uint64, e int) int {
	n := 0
	for n < len(hashes) {
		if _, ok := m.held[e][hashes[n]]; !ok {
			break
		}
		n++
	}
	return n
}

// distinct is the number of owners entries the index should have: the
// blocks some endpoint holds, counted once per group of MaxEndpoints
// endpoints holding them.
func (m *lruModel) distinct() int {
	type key struct {
		g int
		h uint64
	}
	all := map[key]bool{}
	for e, h := range m.held {
		for k := range h {
			all[key{e / MaxEndpoints, k}] = true
		}
	}
	return len(all)
}

// checkModel compares Match, Len and the owners table's size with the model.
func checkModel(t *testing.T, step int, ix *Index, model *lruModel, q []uint64) {
	t.Helper()
	got := make([]int, len(model.caps)+1)
	got[len(model.caps)] = -7 // beyond the endpoints: left alone
	ix.Match(q, got)
	for e := range model.caps {
		if want := model.match(q, e); got[e] != want {
			t.Fatalf("step %d: endpoint %d matched %d of %d blocks, model %d", step, e, got[e], len(q), want)
		}
		if ix.Len(e) != len(model.held[e]) {
			t.Fatalf("step %d: endpoint %d Len %d, model %d", step, e, ix.Len(e), len(model.held[e]))
		}
	}
	if got[len(model.caps)] != -7 {
		t.Fatalf("step %d: Match wrote past the endpoints", step)
	}
	if d, want := ix.distinct(), model.distinct(); d != want {
		t.Fatalf("step %d: %d blocks in the owners table, model %d", step, d, want)
	}
}

// promptFamilies returns chained prompts in a few families that share heads
// of different lengths, some longer than the capacities used with them.
func promptFamilies(r *rand.Rand, n, maxBlocks int) [][]uint64 {
	prompts := make([][]uint64, n)
	for i := range prompts {
		fam := uint32(r.IntN(4))
		shared := r.IntN(maxBlocks + 1)
		total := 1 + r.IntN(maxBlocks)
		toks := seq(16*total, fam*1_000_000)
		for j := 16 * shared; j < len(toks); j++ {
			toks[j] += uint32(i+1) * 10_000 // diverge after the shared head
		}
		prompts[i] = Hashes(nil, toks, 16, 0)
	}
	return prompts
}

// TestIndexBisectionAgainstModel drives several endpoints with small,
// unequal capacities (eviction-heavy, prompts longer than capacity) through
// random Inserts of whole prompts and their heads and occasional Clears, and
// checks every Match against the linear definition. Chained prompts must
// never need the linear fallback.
func TestIndexBisectionAgainstModel(t *testing.T) {
	for seed := range uint64(8) {
		r := rand.New(rand.NewPCG(seed, 99))
		caps := []int{1, 3, 8, 17, 40, 64, 0}[:2+r.IntN(6)]
		ix, _ := NewIndex(caps)
		model := newLRUModel(caps)
		prompts := promptFamilies(r, 40, 80)
		for step := range 3000 {
			p := prompts[r.IntN(len(prompts))]
			switch e := r.IntN(len(caps)); {
			case r.IntN(200) == 0:
				ix.Clear(e)
				clear(model.held[e])
			case r.IntN(4) == 0:
				k := r.IntN(len(p) + 1)
				ix.Insert(e, p[:k])
				model.insert(e, p[:k])
			default:
				ix.Insert(e, p)
				model.insert(e, p)
			}
			q := prompts[r.IntN(len(prompts))]
			if r.IntN(3) == 0 {
				q = q[:r.IntN(len(q)+1)]
			}
			checkModel(t, step, ix, model, q)
		}
		if n := ix.linear.Load(); n != 0 {
			t.Fatalf("seed %d: %d Matches of chained prompts fell back to the linear scan", seed, n)
		}
	}
}

// TestIndexNonChainAgainstModel misuses the API: it Inserts slices that are
// not chains from a root (suffixes, shuffles, duplicates, unrelated values)
// and Matches slices with holes, shuffles and duplicates, where prefix
// closure does not hold; Match must still equal the linear definition.
func TestIndexNonChainAgainstModel(t *testing.T) {
	mangle := func(r *rand.Rand, p []uint64) []uint64 {
		q := append([]uint64(nil), p...)
		if len(q) == 0 {
			return q
		}
		switch r.IntN(5) {
		case 0: // a suffix
			return q[r.IntN(len(q)):]
		case 1: // a hole
			q[r.IntN(len(q))] = r.Uint64N(50)
		case 2: // a shuffle
			r.Shuffle(len(q), func(i, j int) { q[i], q[j] = q[j], q[i] })
		case 3: // a duplicate
			i, j := r.IntN(len(q)), r.IntN(len(q))
			q[i] = q[j]
		case 4: // two blocks swapped
			i, j := r.IntN(len(q)), r.IntN(len(q))
			q[i], q[j] = q[j], q[i]
		}
		return q
	}
	for seed := range uint64(8) {
		r := rand.New(rand.NewPCG(seed, 7))
		caps := []int{2, 9, 30, 64}
		ix, _ := NewIndex(caps)
		model := newLRUModel(caps)
		prompts := promptFamilies(r, 30, 40)
		for step := range 3000 {
			p := prompts[r.IntN(len(prompts))]
			if r.IntN(3) == 0 {
				p = mangle(r, p)
			}
			e := r.IntN(len(caps))
			ix.Insert(e, p)
			model.insert(e, p)
			q := prompts[r.IntN(len(prompts))]
			if r.IntN(2) == 0 {
				q = mangle(r, q)
			}
			checkModel(t, step, ix, model, q)
		}
		if ix.linear.Load() == 0 {
			t.Fatalf("seed %d: misuse never triggered the linear fallback", seed)
		}
	}
}

// TestIndexMatchHoleFallsBack pins the case the bisection cannot see: a
// query with a hole whose later blocks are held. Match must stop at the hole.
func TestIndexMatchHoleFallsBack(t *testing.T) {
	ix, _ := NewIndex([]int{100, 100})
	a := Hashes(nil, seq(16*40, 0), 16, 0)
	ix.Insert(0, a)
	ix.Insert(1, a[:20])
	q := append([]uint64{}, a...)
	q[30] = 1
	m := make([]int, 2)
	ix.Match(q, m)
	if m[0] != 30 || m[1] != 20 {
		t.Fatalf("match %v, want [30 20]", m)
	}
	if ix.linear.Load() != 1 {
		t.Fatalf("%d linear fallbacks, want 1", ix.linear.Load())
	}
	// A suffix inserted on its own is held without its head.
	ix.Insert(1, a[35:])
	ix.Match(a, m)
	if m[0] != 40 || m[1] != 20 {
		t.Fatalf("match after suffix insert %v, want [40 20]", m)
	}
}

// TestOwnerTableAgainstMap checks the Robin Hood owners table against a map
// under random adds and removes, including keys that collide in their home
// slot and growth from empty.
func TestOwnerTableAgainstMap(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	var tb ownerTable
	want := map[uint64]uint64{}
	keys := make([]uint64, 3000)
	for i := range keys {
		keys[i] = r.Uint64()
		if i%3 == 0 {
			keys[i] = uint64(i) // small, structured keys
		}
	}
	for step := range 200_000 {
		k := keys[r.IntN(len(keys))]
		bit := uint64(1) << r.IntN(3)
		if r.IntN(2) == 0 {
			tb.add(k, bit, 1)
			want[k] |= bit
		} else {
			tb.remove(k, bit)
			if want[k] &^= bit; want[k] == 0 {
				delete(want, k)
			}
		}
		if step%1000 == 0 || step > 199_000 {
			if tb.n != len(want) {
				t.Fatalf("step %d: %d entries, want %d", step, tb.n, len(want))
			}
			for _, k := range keys {
				if got, _ := tb.get(k, mix(k)); got != want[k] {
					t.Fatalf("step %d: key %x mask %b, want %b", step, k, got, want[k])
				}
			}
		}
	}
}

// TestIndexNoAllocs holds Match to zero allocations and Insert and Clear to
// zero once the endpoint's LRU is full.
func TestIndexNoAllocs(t *testing.T) {
	caps := make([]int, 64)
	for i := range caps {
		caps[i] = 2000
	}
	ix, _ := NewIndex(caps)
	r := rand.New(rand.NewPCG(5, 6))
	prompts := promptFamilies(r, 64, 750)
	for i := range 400 {
		ix.Insert(i%64, prompts[i%len(prompts)])
	}
	m := make([]int, 64)
	i := 0
	if n := testing.AllocsPerRun(200, func() {
		i++
		ix.Match(prompts[i%len(prompts)], m)
	}); n != 0 {
		t.Errorf("Match allocates %.1f times", n)
	}
	if n := testing.AllocsPerRun(200, func() {
		i++
		ix.Insert(i%64, prompts[i%len(prompts)])
	}); n != 0 {
		t.Errorf("steady-state Insert allocates %.1f times", n)
	}
	if n := testing.AllocsPerRun(20, func() {
		i++
		ix.Clear(i % 64)
		ix.Insert(i%64, prompts[i%len(prompts)])
	}); n != 0 {
		t.Errorf("Clear and refill allocate %.1f times", n)
	}
}

// TestIndexConcurrent runs Match, Insert, Clear and Len from several
// goroutines (run it with -race). Concurrent Matches are not snapshots, so
// it checks only bounds; once the writers stop, Match must again equal the
// linear definition, which it checks against a linear scan of the index.
func TestIndexConcurrent(t *testing.T) {
	caps := []int{50, 200, 1000, 3000, 100, 700, 0, 64}
	ix, _ := NewIndex(caps)
	prompts := promptFamilies(rand.New(rand.NewPCG(8, 9)), 64, 300)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 1))
			m := make([]int, len(caps))
			for range 2000 {
				p := prompts[r.IntN(len(prompts))]
				switch r.IntN(10) {
				case 0:
					ix.Clear(r.IntN(len(caps)))
				case 1, 2, 3:
					ix.Insert(r.IntN(len(caps)), p)
				case 4:
					_ = ix.Len(r.IntN(len(caps)))
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
	m, lin := make([]int, len(caps)), make([]int, len(caps))
	for _, p := range prompts {
		ix.Match(p, m)
		clear(lin)
		matchLinear(p, lin, 1<<len(caps)-1, ix.shape.Load().groups[0].owners)
		if !slices.Equal(m, lin) {
			t.Fatalf("after the writers stopped: match %v, linear %v", m, lin)
		}
	}
}

func BenchmarkIndexMatch(b *testing.B) {
	caps := make([]int, 16)
	for i := range caps {
		caps[i] = 60000
	}
	ix, _ := NewIndex(caps)
	h := Hashes(nil, seq(12000, 1), 16, 0)
	for e := range 16 {
		ix.Insert(e, h[:len(h)*e/16])
	}
	m := make([]int, 16)
	b.ReportAllocs()
	for b.Loop() {
		ix.Match(h, m)
	}
}

// TestIndexBytesPerBlock measures the index's heap cost per (endpoint, block)
// entry, 200,000 entries on one endpoint and spread over 64 and 1,000 (16
// groups), and holds it to
// the bound stated in Index's doc comment.
func TestIndexBytesPerBlock(t *testing.T) {
	const n = 200_000
	for _, eps := range []int{1, 64, 1000} {
		hashes := Hashes(nil, seq(n*16, 0), 16, 0)
		caps := make([]int, eps)
		for e := range caps {
			caps[e] = n / eps
		}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		ix, _ := NewIndex(caps)
		for e := range eps {
			ix.Insert(e, hashes[e*n/eps:(e+1)*n/eps])
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		held := 0
		for e := range eps {
			held += ix.Len(e)
		}
		per := float64(after.HeapAlloc-before.HeapAlloc) / float64(held)
		t.Logf("%d endpoints: %.1f bytes per indexed block (%d blocks)", eps, per, held)
		if held != n || per > 80 {
			t.Fatalf("%d endpoints: %.1f bytes per indexed block (%d blocks), over the documented 80", eps, per, held)
		}
		runtime.KeepAlive(ix)
		runtime.KeepAlive(hashes) // else its 8 bytes per block, freed, are subtracted
	}
}

// TestIndexSetCapacity: a larger capacity keeps the endpoint's blocks and
// lets it hold more; a smaller one than it holds forgets them (and only
// its own), and the new bound holds from then on.
func TestIndexSetCapacity(t *testing.T) {
	ix, _ := NewIndex([]int{4, 100})
	a := Hashes(nil, seq(16*4, 0), 16, 0)    // 4 blocks: full
	b := Hashes(nil, seq(16*4, 9000), 16, 0) // 4 more
	ix.Insert(0, a)
	ix.Insert(1, a)
	ix.SetCapacity(0, 8)
	ix.Insert(0, b)
	m := make([]int, 2)
	if ix.Match(a, m); m[0] != 4 || ix.Len(0) != 8 {
		t.Fatalf("after growing to 8: a matches %d, len %d; want 4, 8", m[0], ix.Len(0))
	}
	ix.SetCapacity(0, 2)
	if ix.Match(a, m); m[0] != 0 || m[1] != 4 || ix.Len(0) != 0 {
		t.Fatalf("after shrinking below what it held: a matches %v, len %d; want [0 4], 0", m, ix.Len(0))
	}
	ix.Insert(0, b)
	if ix.Len(0) != 2 {
		t.Fatalf("len %d after inserting 4 blocks at capacity 2", ix.Len(0))
	}
	ix.SetCapacity(5, 10) // out of range: ignored
	ix.SetCapacity(-1, 10)
}

// TestCapacity: Capacity follows NewIndex, SetCapacity and Grow, without
// waiting for an endpoint's lock.
func TestCapacity(t *testing.T) {
	ix, err := NewIndex([]int{8, 0})
	if err != nil {
		t.Fatal(err)
	}
	if ix.Capacity(0) != 8 || ix.Capacity(1) != 1 || ix.Capacity(2) != 0 || ix.Capacity(-1) != 0 {
		t.Fatalf("capacities %d %d %d %d, want 8 1 0 0", ix.Capacity(0), ix.Capacity(1), ix.Capacity(2), ix.Capacity(-1))
	}
	ix.SetCapacity(0, 20)
	if err := ix.Grow(3, 5); err != nil {
		t.Fatal(err)
	}
	if ix.Capacity(0) != 20 || ix.Capacity(2) != 5 {
		t.Fatalf("after SetCapacity and Grow: %d %d, want 20 5", ix.Capacity(0), ix.Capacity(2))
	}
	_, ep := ix.endpoint(0)
	ep.mu.Lock() // as Settle holds it while applying a learn
	defer ep.mu.Unlock()
	if ix.Capacity(0) != 20 {
		t.Fatal("Capacity under the endpoint's lock")
	}
}
