package prefix

import (
	"math/rand/v2"
	"runtime"
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
	if len(ix.owners) != 2 {
		t.Fatalf("owners map leaked: %d entries, want 2", len(ix.owners))
	}
}

func TestIndexTooManyEndpoints(t *testing.T) {
	if _, err := NewIndex(make([]int, MaxEndpoints+1)); err == nil {
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
// entry and holds it to the bound stated in Index's doc comment.
func TestIndexBytesPerBlock(t *testing.T) {
	const n = 200_000
	hashes := Hashes(nil, seq(n*16, 0), 16, 0)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ix, _ := NewIndex([]int{n})
	ix.Insert(0, hashes)
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / n
	t.Logf("%.1f bytes per indexed block (%d blocks)", per, ix.Len(0))
	if per > 128 {
		t.Fatalf("%.1f bytes per indexed block, over the documented 128", per)
	}
	runtime.KeepAlive(ix)
}
