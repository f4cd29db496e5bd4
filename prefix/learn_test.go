package prefix

import (
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
)

// TestLearnAgainstModel drives an index through Learns (queued), Inserts,
// Clears and Settles at random points, against the brute-force model that
// applies every learn at once: after a Settle every Match and Len equal the
// model's; between Settles, on an index whose capacities never evict, Match
// equals it too (the queue's overlay: a same-prefix request sees a learn
// before it is applied), and with evictions it is never below it.
func TestLearnAgainstModel(t *testing.T) {
	for _, tc := range []struct {
		name  string
		caps  []int
		evict bool
	}{
		{"no-eviction", []int{100000, 100000, 100000, 100000, 100000}, false},
		{"eviction", []int{1, 3, 8, 17, 40, 64}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for seed := range uint64(4) {
				r := rand.New(rand.NewPCG(seed, 17))
				ix, _ := NewIndex(tc.caps)
				model := newLRUModel(tc.caps)
				prompts := promptFamilies(r, 40, 80)
				got := make([]int, len(tc.caps))
				for step := range 2000 {
					p := prompts[r.IntN(len(prompts))]
					e := r.IntN(len(tc.caps))
					switch k := r.IntN(100); {
					case k == 0:
						ix.Clear(e)
						clear(model.held[e])
					case k < 5:
						ix.Insert(e, p)
						model.insert(e, p)
					case k < 15:
						ix.Settle()
						if ix.Queued() != 0 {
							t.Fatalf("step %d: %d learns queued after Settle", step, ix.Queued())
						}
						checkModel(t, step, ix, model, prompts[r.IntN(len(prompts))])
						continue
					default:
						ix.Learn(e, p)
						model.insert(e, p)
					}
					q := prompts[r.IntN(len(prompts))]
					ix.Match(q, got)
					for e := range tc.caps {
						want := model.match(q, e)
						if !tc.evict && got[e] != want || got[e] < want {
							t.Fatalf("step %d: endpoint %d matched %d (%d queued), model %d", step, e, got[e], ix.Queued(), want)
						}
					}
				}
				ix.Settle()
				for _, q := range prompts {
					checkModel(t, -1, ix, model, q)
				}
			}
		})
	}
}

// TestLearnQueueBounded: learns beyond the queue's bounds settle it on the
// caller's goroutine, and a prompt longer than the queue is inserted at
// once; nothing is lost either way.
func TestLearnQueueBounded(t *testing.T) {
	ix, _ := NewIndex([]int{1 << 20, 1 << 20})
	prompts := promptFamilies(rand.New(rand.NewPCG(3, 4)), 3*maxQueuedLearns, 40)
	for i, p := range prompts {
		ix.Learn(i%2, p)
		if q := ix.Queued(); q > maxQueuedLearns {
			t.Fatalf("%d learns queued, bound %d", q, maxQueuedLearns)
		}
	}
	long := Hashes(nil, seq(16*(maxQueuedBlocks+5), 7), 16, 0)
	ix.Learn(1, long)
	m := make([]int, 2)
	ix.Match(long, m)
	if m[1] != len(long) {
		t.Fatalf("a prompt longer than the queue: matched %d of %d", m[1], len(long))
	}
	for i, p := range prompts {
		ix.Match(p, m)
		if m[i%2] != len(p) {
			t.Fatalf("prompt %d: endpoint %d matched %d of %d", i, i%2, m[i%2], len(p))
		}
	}
}

// TestLearnNoAllocs: once the queue's arenas have grown, Learn, Match with
// learns queued and Settle allocate nothing.
func TestLearnNoAllocs(t *testing.T) {
	caps := make([]int, 64)
	for i := range caps {
		caps[i] = 20000
	}
	ix, _ := NewIndex(caps)
	prompts := promptFamilies(rand.New(rand.NewPCG(5, 6)), 64, 750)
	for i := range 400 {
		ix.Learn(i%64, prompts[i%len(prompts)])
		if i%8 == 7 {
			ix.Settle()
		}
	}
	m := make([]int, 64)
	i := 0
	if n := testing.AllocsPerRun(200, func() {
		i++
		ix.Learn(i%64, prompts[i%len(prompts)])
		ix.Match(prompts[(i+1)%len(prompts)], m)
		if i%8 == 0 {
			ix.Settle()
		}
	}); n != 0 {
		t.Errorf("Learn, Match and Settle allocate %.1f times", n)
	}
}

// TestLearnConcurrent runs Learn, Match, Settle, Insert and Clear from
// several goroutines (run it with -race); once they stop and the queue is
// settled, Match equals the linear definition over the index.
func TestLearnConcurrent(t *testing.T) {
	caps := []int{50, 200, 1000, 3000, 100, 700, 0, 64}
	ix, _ := NewIndex(caps)
	prompts := promptFamilies(rand.New(rand.NewPCG(8, 9)), 64, 300)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 2))
			m := make([]int, len(caps))
			for range 2000 {
				p := prompts[r.IntN(len(prompts))]
				switch r.IntN(20) {
				case 0:
					ix.Clear(r.IntN(len(caps)))
				case 1:
					ix.Insert(r.IntN(len(caps)), p)
				case 2, 3:
					ix.Settle()
				case 4, 5, 6, 7, 8, 9:
					ix.Learn(r.IntN(len(caps)), p)
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

func TestCommonPrefix(t *testing.T) {
	a := Hashes(nil, seq(16*40, 1), 16, 0)
	b := slices.Clone(a)
	for k := 0; k <= len(a); k++ {
		c := slices.Clone(b[:k])
		c = append(c, Hashes(nil, seq(16*(40-k), 999), 16, 0)...) // not a chain past k: only differing values matter here
		if k < len(a) {
			c[k] ^= 1
		}
		for j := k + 1; j < len(c); j++ {
			c[j] ^= 1 // every block after a difference differs, as chained hashes do
		}
		if got := commonPrefix(a, c); got != k {
			t.Fatalf("diverging at %d: commonPrefix %d", k, got)
		}
		if got := commonPrefix(a[:k], a); got != k {
			t.Fatalf("a prefix of %d: commonPrefix %d", k, got)
		}
	}
	if commonPrefix(nil, a) != 0 || commonPrefix(a, nil) != 0 {
		t.Fatal("empty")
	}
}

// TestLearnManyEndpoints: in a pool of more than 64 endpoints a queued
// learn counts at once for its endpoint (Match's pooled overlay), and Match
// allocates nothing with learns queued or not.
func TestLearnManyEndpoints(t *testing.T) {
	caps := make([]int, 1000)
	for e := range caps {
		caps[e] = 1000
	}
	ix, _ := NewIndex(caps)
	p := Hashes(nil, seq(16*40, 5), 16, 0)
	q := Hashes(nil, seq(16*50, 5), 16, 0) // p plus 10 more blocks
	ix.Insert(3, p[:10])
	ix.Learn(977, p)
	m := make([]int, 1000)
	ix.Match(q, m)
	if m[977] != 40 || m[3] != 10 || m[976] != 0 {
		t.Fatalf("queued: endpoint 977 matched %d (want 40), 3 matched %d (want 10), 976 %d", m[977], m[3], m[976])
	}
	ix.Settle()
	clear(m)
	ix.Match(q, m)
	if m[977] != 40 || m[3] != 10 {
		t.Fatalf("settled: endpoint 977 matched %d, 3 matched %d", m[977], m[3])
	}
	if raceEnabled {
		return // sync.Pool drops items under the race detector
	}
	ix.Learn(500, q)
	if n := testing.AllocsPerRun(50, func() { ix.Match(q, m) }); n != 0 {
		t.Fatalf("Match with a learn queued allocates %.0f times", n)
	}
	ix.Settle()
	if n := testing.AllocsPerRun(50, func() { ix.Match(q, m) }); n != 0 {
		t.Fatalf("Match allocates %.0f times", n)
	}
}

// TestPinnedBlocksOutliveEviction: a pinned prompt is not evicted while
// unpinned blocks remain, Release makes it the most recent, and when every
// block is pinned the one pinned longest ago goes first, the LRU never
// exceeding its capacity.
func TestPinnedBlocksOutliveEviction(t *testing.T) {
	seq := func(base uint64, n int) []uint64 {
		h := make([]uint64, n)
		for i := range h {
			h[i] = base + uint64(i)
		}
		return h
	}
	a, b, c, d := seq(100, 4), seq(200, 4), seq(300, 4), seq(400, 4)
	ix, err := NewIndex([]int{8})
	if err != nil {
		t.Fatal(err)
	}
	m := make([]int, 1)
	held := func(h []uint64) int { ix.Settle(); ix.Match(h, m); return m[0] }
	ix.LearnPinned(0, a) // a runs
	ix.Learn(0, b)
	ix.Learn(0, c) // evicts b, not the older but pinned a
	if held(a) != 4 || held(b) != 0 || held(c) != 4 {
		t.Fatalf("after c: a %d b %d c %d blocks, want 4 0 4", held(a), held(b), held(c))
	}
	ix.Release(0, a) // a ends: the most recent
	ix.Learn(0, d)   // evicts c
	if held(a) != 4 || held(c) != 0 || held(d) != 4 {
		t.Fatalf("after release: a %d c %d d %d blocks, want 4 0 4", held(a), held(c), held(d))
	}
	// Every block pinned: the longest-pinned go first (d's, then a's), tail first.
	ix.LearnPinned(0, d)
	ix.LearnPinned(0, a)
	ix.LearnPinned(0, b) // evicts d's 4 blocks
	if held(d) != 0 || held(a) != 4 || held(b) != 4 || ix.Len(0) != 8 {
		t.Fatalf("all pinned: d %d a %d b %d, %d held, want 0 4 4, 8", held(d), held(a), held(b), ix.Len(0))
	}
	ix.LearnPinned(0, seq(500, 2)) // evicts a's last 2 blocks
	if held(a) != 2 || ix.Len(0) != 8 {
		t.Fatalf("a %d blocks, %d held, want 2, 8", held(a), ix.Len(0))
	}
	// A release of blocks no longer held inserts them; of unpinned ones touches.
	ix.Release(0, d)
	ix.Release(0, c)
	if ix.Len(0) != 8 {
		t.Fatalf("%d held, want 8", ix.Len(0))
	}
}
