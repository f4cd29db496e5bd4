package prefix

import (
	"slices"
	"sync"
	"testing"
	"time"
)

// Scale of the 64x1M benchmarks: 64 endpoints of 15,625 blocks each, about
// 1,000,000 distinct blocks indexed in all, and 12k-token prompts (750 blocks
// of 16 tokens).
const (
	benchEndpoints = 64
	benchPerEP     = 1_000_000 / benchEndpoints
	benchTokens    = 12_000
	benchBlocks    = benchTokens / DefaultBlockSize
)

// fixture1M is a filled index of about 1,000,000 blocks over n endpoints
// (64, or 1,000 for the 1000x1M benchmarks) plus the prompts the benchmarks
// use.
type fixture1M struct {
	ix *Index
	n  int
	// typical: every endpoint holds its first 125 blocks (a shared system
	// prompt), endpoints 1-3 hold 400, endpoint 0 holds all 750.
	typical []uint64
	// staggered: endpoint e holds its first 750*(e+1)/n blocks, so every
	// endpoint has a different match length (the worst case for bisection;
	// at 1,000 endpoints, 750 lengths).
	staggered []uint64
	// filler are the prompts that fill the endpoints and are still held
	// (whole or, if partly evicted, a head) by one endpoint; cycling them
	// keeps the index's entries out of the CPU caches, as distinct requests
	// would.
	filler [][]uint64
	hit    [][]uint64 // prompts endpoint 0 holds (mostly-hit Insert)
	miss   [][]uint64 // 64 prompts, 48,000 blocks: each insert of one misses
	next   int        // insert counter kept across benchmark runs
}

// fixtures holds one fixture per benchmark family, built on first use, so that
// the Insert benchmarks do not disturb what the Match benchmarks check.
var fixtures sync.Map // string -> *fixture1M

// benchPrompt returns the block hashes of a 12k-token prompt whose tokens are
// seq(12000, start); distinct starts give chains that share no block.
func benchPrompt(start uint32) []uint64 {
	return Hashes(nil, seq(benchTokens, start), DefaultBlockSize, 0)
}

// getFixture1M returns the 64x1M fixture called name, building it on first use.
func getFixture1M(b *testing.B, name string) *fixture1M {
	return getFixture(b, name, benchEndpoints)
}

// getFixture returns the fixture called name of n endpoints holding about
// 1,000,000 blocks in all, building it on first use.
func getFixture(b *testing.B, name string, n int) *fixture1M {
	b.Helper()
	if f, ok := fixtures.Load(name); ok {
		return f.(*fixture1M)
	}
	perEP := 1_000_000 / n
	caps := make([]int, n)
	for i := range caps {
		caps[i] = perEP
	}
	ix, err := NewIndex(caps)
	if err != nil {
		b.Fatal(err)
	}
	f := &fixture1M{ix: ix, n: n}
	start := uint32(1_000_000_000)
	fresh := func() []uint64 {
		start += 20_000
		return benchPrompt(start)
	}
	// Fill every endpoint with distinct prompts (21*750 > 15,625).
	for e := range n {
		for range perEP/benchBlocks + 1 {
			p := fresh()
			ix.Insert(e, p)
			f.filler = append(f.filler, p)
		}
	}
	head := seq(2000, 7) // shared system prompt: 125 blocks
	f.typical = Hashes(nil, append(head, seq(benchTokens-2000, 3_000_000_000)...), DefaultBlockSize, 0)
	for e := range n {
		ix.Insert(e, f.typical[:125])
	}
	for e := 1; e < 4; e++ {
		ix.Insert(e, f.typical[:400])
	}
	ix.Insert(0, f.typical)
	f.staggered = fresh()
	for e := range n {
		ix.Insert(e, f.staggered[:benchBlocks*(e+1)/n])
	}
	for range 8 {
		if perEP < 10*benchBlocks {
			break // endpoint 0 could not hold them beside typical
		}
		p := fresh()
		ix.Insert(0, p)
		f.hit = append(f.hit, p)
	}
	for range 64 {
		f.miss = append(f.miss, fresh())
	}
	// Keep the fillers that are still (partly) held.
	m := make([]int, n)
	f.filler = slices.DeleteFunc(f.filler, func(p []uint64) bool {
		ix.Match(p, m)
		return slices.Max(m) == 0
	})
	fixtures.Store(name, f)
	return f
}

// timeOps runs op b.N times, timing each call, and reports the median and
// 99th percentile latency of the first 65,536 calls as p50-ns and p99-ns
// besides ns/op and allocs/op. The samples buffer is allocated before the timer starts.
func timeOps(b *testing.B, op func()) {
	samples := make([]time.Duration, 0, 1<<16)
	op()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		op()
		if len(samples) < cap(samples) {
			samples = append(samples, time.Since(t0))
		}
	}
	b.StopTimer()
	slices.Sort(samples)
	if len(samples) > 0 {
		b.ReportMetric(float64(samples[len(samples)/2]), "p50-ns")
		b.ReportMetric(float64(samples[len(samples)*99/100]), "p99-ns")
	}
}

// BenchmarkIndexMatch64x1M is the scoring path of one scheduling decision:
// Match of a 12k-token prompt (750 blocks) against 64 endpoints holding
// about 1,000,000 blocks in all.
func BenchmarkIndexMatch64x1M(b *testing.B) {
	benchMatch(b, getFixture1M(b, "match"))
}

// BenchmarkIndexMatch1000x1M is BenchmarkIndexMatch64x1M with 1,000
// endpoints of 1,000 blocks each (16 groups of owners tables); staggered has
// 750 different match lengths.
func BenchmarkIndexMatch1000x1M(b *testing.B) {
	benchMatch(b, getFixture(b, "match1000", 1000))
}

func benchMatch(b *testing.B, f *fixture1M) {
	n := f.n
	m := make([]int, n)
	b.Run("typical", func(b *testing.B) {
		timeOps(b, func() { f.ix.Match(f.typical, m) })
		if m[0] != benchBlocks || m[1] != 400 || m[n-1] != 125 {
			b.Fatalf("typical match %v", m)
		}
	})
	b.Run("cold", func(b *testing.B) {
		i := 0
		timeOps(b, func() {
			i++
			f.ix.Match(f.filler[i%len(f.filler)], m)
		})
		if slices.Max(m) == 0 {
			b.Fatal("cold: the prompt matched no endpoint")
		}
	})
	b.Run("staggered", func(b *testing.B) {
		timeOps(b, func() { f.ix.Match(f.staggered, m) })
		for e := range n {
			if want := benchBlocks * (e + 1) / n; m[e] != want {
				b.Fatalf("staggered: endpoint %d matched %d, want %d", e, m[e], want)
			}
		}
	})
}

// BenchmarkIndexInsert64x1M records a 750-block prompt on an endpoint whose
// LRU is full, in the 64x1M index: hit re-inserts prompts the endpoint holds
// (recency updates only), miss inserts prompts it has long forgotten (750
// evictions and 750 new blocks per op).
func BenchmarkIndexInsert64x1M(b *testing.B) {
	f := getFixture1M(b, "insert")
	b.Run("hit", func(b *testing.B) {
		timeOps(b, func() {
			f.next++
			f.ix.Insert(0, f.hit[f.next%len(f.hit)])
		})
	})
	b.Run("miss", func(b *testing.B) {
		timeOps(b, func() {
			f.next++
			f.ix.Insert(benchEndpoints-1, f.miss[f.next%len(f.miss)])
		})
	})
}

// BenchmarkIndexInsert is the learning step of a small, cache-resident
// fleet: 16 endpoints of 8,192 blocks, each op recording a 750-block prompt
// whose first half (a shared system prompt, one of 4) the endpoint usually
// holds and whose second half is new, evicting as much.
func BenchmarkIndexInsert(b *testing.B) {
	const eps = 16
	caps := make([]int, eps)
	for i := range caps {
		caps[i] = 8192
	}
	ix, _ := NewIndex(caps)
	prompts := make([][]uint64, 1024)
	for i := range prompts {
		toks := append(seq(benchTokens/2, uint32(i%4)*100_000), seq(benchTokens/2, uint32(i+1)*1_000_000)...)
		prompts[i] = Hashes(nil, toks, DefaultBlockSize, 0)
	}
	for i := range 4 * len(prompts) {
		ix.Insert(i%eps, prompts[i%len(prompts)])
	}
	i := 0
	timeOps(b, func() {
		i++
		ix.Insert(i%eps, prompts[i%len(prompts)])
	})
}

// BenchmarkPreciseMatchTiers is the scheduler's per-decision question for
// tier-aware scoring: how many leading blocks of a 1000-block prompt each
// of 8 endpoints holds in each medium (MatchTiers). tiered: endpoint e
// holds the first 1000·(e+1)/8 blocks on the GPU, twice that (capped) in
// CPU (offloaded without tokens), its CPU blocks on disk too for even e,
// and every endpoint the whole prompt in REMOTE, next to unrelated chains
// of 20k blocks per endpoint; gpu-only: the same GPU blocks, other media
// empty (the cost for an engine without tiers); match-gpu: Match on the GPU
// alone, for comparison.
func BenchmarkPreciseMatchTiers(b *testing.B) {
	const (
		eps     = 8
		promptN = 1000
		filler  = 20_000
	)
	build := func(tiered bool) (*PreciseIndex, []uint64) {
		ix, _ := NewPreciseIndex(eps, 16)
		toks := seq(promptN*16, 1)
		eng := preciseEngineKeys(toks, 0)
		for e := range eps {
			gpu := promptN * (e + 1) / eps
			cpu := min(promptN, 2*gpu)
			preciseStore(b, ix, e, MediumGPU, eng[:cpu], 0, false, toks[:16*cpu], 0)
			if tiered {
				preciseStore(b, ix, e, MediumCPU, eng[:cpu], 0, false, nil, 0)
				if e%2 == 0 {
					preciseStore(b, ix, e, MediumDisk, eng[:cpu], 0, false, nil, 0)
				}
				preciseStore(b, ix, e, MediumRemote, eng, 0, false, toks, 0)
			}
			ix.Removed(e, MediumGPU, eng[gpu:cpu])
			ftoks := seq(filler*16, uint32(1_000_000+e*filler*16))
			fe := preciseEngineKeys(ftoks, 7)
			for i := 0; i < filler; i += 250 {
				preciseStore(b, ix, e, MediumGPU, fe[i:i+250], 0, false, ftoks[16*i:16*(i+250)], 0)
			}
		}
		return ix, Hashes(nil, toks, 16, 0)
	}
	for _, tiered := range []bool{true, false} {
		ix, req := build(tiered)
		name := "tiered"
		if !tiered {
			name = "gpu-only"
		}
		m := make([][NumMedia]int, eps)
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				ix.MatchTiers(req, m)
			}
			want := [NumMedia]int{promptN * 8 / eps, 0, 0, 0, 0}
			if tiered {
				want = [NumMedia]int{promptN * 8 / eps, promptN, 0, promptN, 0}
			}
			if m[7] != want || m[0][MediumGPU] != promptN/eps {
				b.Fatalf("matched %v", m)
			}
		})
		if !tiered {
			g := make([]int, eps)
			b.Run("match-gpu", func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					ix.Match(req, MediumGPU, g)
				}
			})
		}
	}
}
