package measure

import (
	"math"
	"testing"

	"github.com/infergate/infergate/data"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
)

// TestReferences: a run's reference rates are the pooled and infinite
// references of its requests, PooledCacheHitRate and
// trace.InfiniteCacheHitRate exactly when it has no warm-up and no
// failure; warm-up and failed requests are left out as HitRate leaves them
// out, warm-up requests still filling the caches.
func TestReferences(t *testing.T) {
	moon, err := trace.LoadMooncake(data.Embedded + data.Mooncake)
	if err != nil {
		t.Fatal(err)
	}
	recs := moon[:300]
	ec := sim.Config{Profile: sim.DefaultProfile()}.WithDefaults()
	capacity := 4 * ec.NumBlocks
	refs := NewReferences(recs, capacity, ec.BlockSize)
	run := make([]Record, len(recs))
	for i := range run {
		run[i] = Record{Index: i, Status: 200}
	}
	var s Summary
	refs.Apply(&s, run)
	if s.PooledHitRate == nil || *s.PooledHitRate != PooledCacheHitRate(recs, capacity, ec.BlockSize) {
		t.Errorf("pooled %v, want PooledCacheHitRate %v", s.PooledHitRate, PooledCacheHitRate(recs, capacity, ec.BlockSize))
	}
	if s.InfiniteHitRate == nil || math.Abs(*s.InfiniteHitRate-trace.InfiniteCacheHitRate(recs)) > 1e-12 {
		t.Errorf("infinite %v, want %v", s.InfiniteHitRate, trace.InfiniteCacheHitRate(recs))
	}
	if p, i := refs.All(); *p != *s.PooledHitRate || *i != *s.InfiniteHitRate {
		t.Errorf("All %v %v, want the run's", *p, *i)
	}

	// The first 100 requests warm up, request 150 failed: the rates count
	// requests 100..299 but 150, with hits computed on the whole replay.
	for i := range 100 {
		run[i].Warmup = true
	}
	run[150].Error = "boom"
	refs.Apply(&s, run)
	var prompt, hp, hi int
	inf := trace.InfiniteCacheHits(recs)
	for i := 100; i < 300; i++ {
		if i != 150 {
			n := len(recs[i].Tokens(nil))
			prompt += n
			hp += refs.Pooled[i]
			hi += inf[i]
		}
	}
	if want := float64(hp) / float64(prompt); *s.PooledHitRate != want {
		t.Errorf("pooled with warm-up %v, want %v", *s.PooledHitRate, want)
	}
	if want := float64(hi) / float64(prompt); *s.InfiniteHitRate != want {
		t.Errorf("infinite with warm-up %v, want %v", *s.InfiniteHitRate, want)
	}
	// The warm-up still warmed the caches: the measured requests hit more
	// than they would replayed alone.
	if alone := PooledCacheHitRate(recs[100:], capacity, ec.BlockSize); alone >= *s.PooledHitRate {
		t.Errorf("measured requests alone hit %v, after the warm-up %v: want more after", alone, *s.PooledHitRate)
	}

	// No capacity (a --target run): no pooled reference; no hash ids: no
	// infinite one.
	none := NewReferences([]trace.Record{{InputLength: 3, TokenIDs: []uint32{1, 2, 3}}}, 0, 16)
	p, i := none.Rates([]Record{{Index: 0}})
	if p != nil || i != nil {
		t.Errorf("no capacity, no hash ids: %v %v, want nil nil", p, i)
	}
	if p, i := (*References)(nil).Rates(run); p != nil || i != nil {
		t.Error("nil References gave rates")
	}
}

// BenchmarkPooledCacheHitRate is the pooled reference of the first 2,000
// Mooncake requests on 8 engines of the default profile.
func BenchmarkPooledCacheHitRate(b *testing.B) {
	moon, err := trace.LoadMooncake(data.Embedded + data.Mooncake)
	if err != nil {
		b.Fatal(err)
	}
	ec := sim.Config{Profile: sim.DefaultProfile()}.WithDefaults()
	for b.Loop() {
		PooledCacheHitRate(moon[:2000], 8*ec.NumBlocks, ec.BlockSize)
	}
}
