package sched

import (
	"testing"

	"github.com/infergate/infergate/prefix"
)

// BenchmarkDecisionPrecise1000x1M is BenchmarkDecision64x1M's precise-prefix
// cases among 1,000 endpoints: the precise index (16 groups of 64) and the
// approximate one (the tiered profile's prefix ×0.5 scorer; precise-prefix
// without tiers has none since 2026-12-06) each hold 1,000,000 blocks,
// 1,000 per endpoint in distinct 750-block prompts, every endpoint the
// prompt's first 2,000 tokens (125 blocks), one endpoint all of it, and for
// tiered the next endpoint a copy in host memory. Load varies as in
// BenchmarkDecision1000. Each decision must find the prompt's owner (it
// fails otherwise), so the index's groups past the first are read.
func BenchmarkDecisionPrecise1000x1M(b *testing.B) {
	const n, perEndpoint = 1000, 1_000_000 / 1000
	ix, _ := prefix.NewIndex(caps(n, perEndpoint))
	px, err := prefix.NewPreciseIndex(n, 16)
	if err != nil {
		b.Fatal(err)
	}
	var engineKey uint64
	storeIn := func(e int, m prefix.Medium, toks []uint32) {
		keys := make([]uint64, len(toks)/16)
		for i := range keys {
			engineKey++
			keys[i] = engineKey
		}
		if err := px.Stored(e, m, keys, 0, false, toks, 0); err != nil {
			b.Fatal(err)
		}
	}
	for e := range n {
		// Fill each endpoint with distinct 750-block prompts.
		for k := 0; k < perEndpoint/750+1; k++ {
			toks := tokens(12000, uint32(e*1000+k)*20000+1_000_000_000)
			ix.Insert(e, prefix.Hashes(nil, toks, 16, 0))
			storeIn(e, prefix.MediumGPU, toks)
		}
	}
	reqs := make([]*Request, 64)
	owner := func(i int) int { return i * n / len(reqs) }
	for i := range reqs {
		toks := append(tokens(2000, 0), tokens(10000, uint32(i+1)*100000)...)
		reqs[i] = req(toks)
		for e := range n {
			ix.Insert(e, reqs[i].Hashes[:125])
			storeIn(e, prefix.MediumGPU, toks[:2000])
		}
		ix.Insert(owner(i), reqs[i].Hashes)
		storeIn(owner(i), prefix.MediumGPU, toks)
		storeIn((owner(i)+1)%n, prefix.MediumCPU, toks) // the next endpoint has it in host memory
	}
	b.Logf("approximate index: %d blocks on endpoint 0; precise index: %+v (%d groups)", ix.Len(0), px.Stats(), px.Groups())
	eps := ready(n)
	for i := range eps {
		eps[i].InFlight = i % 5
		eps[i].InFlightTokens = (i % 11) * 3000
		eps[i].PendingPrefillTokens = (i % 7) * 1000
	}
	for _, tc := range []struct {
		name   string
		tiered bool
		learn  learnMode
	}{
		{"precise-prefix/decide", false, learnOff},
		{"precise-prefix/pick", false, learnQueued},
		{"precise-prefix/tiered", true, learnOff},
	} {
		b.Run(tc.name, func(b *testing.B) {
			pool := Pool{Capacity: caps(n, perEndpoint), Precise: px.On(prefix.MediumGPU)}
			if tc.tiered {
				// GPU, host memory (the next endpoint's copy), no remote.
				t := &Tiers{Source: px, Remote: -1, LoadSeconds: make([][NumTiers]float64, n), Latency: make([][NumTiers]float64, n)}
				for e := range n {
					t.LoadSeconds[e] = [NumTiers]float64{0, 26e-6, 187e-6, 120e-6}
				}
				pool.Tiers = t
			}
			p := newProfileT(b, Config{Policy: PrecisePrefix}, pool)
			// Share the filled approximate index with the prefix scorer.
			for _, ws := range p.scorers {
				if ps, ok := ws.Scorer.(*prefixScorer); ok {
					ps.ix, p.approx = ix, ix
				}
			}
			if tc.learn == learnOff {
				p.learners = nil
			}
			benchPicks(b, p, tc.learn, func(i int) {
				r := reqs[i%len(reqs)]
				if d := p.Pick(r, eps); d.MatchedBlocks < 125 {
					b.Fatalf("request %d: matched %d blocks at endpoint %d", i%len(reqs), d.MatchedBlocks, d.Endpoint)
				}
			})
			ix.Settle()
		})
	}
	// The tiered pick's Tiers.Split alone (host memory past the GPU's
	// match, no disk, no remote tier), and splitReference, the full
	// computation it replaced, on the same index and GPU matches.
	gpu := make([][]int, len(reqs))
	for i, r := range reqs {
		gpu[i] = make([]int, n)
		px.Match(r.Hashes, prefix.MediumGPU, gpu[i])
	}
	tr := &Tiers{Source: px, Remote: -1}
	for _, sc := range []struct {
		name  string
		split func(hashes []uint64, maxBlocks int, gpu []int, out [][NumTiers]int, scratch []int) []int
	}{
		{"tiers-split", tr.Split},
		{"tiers-split-full", func(h []uint64, mb int, g []int, out [][NumTiers]int, s []int) []int {
			return splitReference(tr, h, mb, g, out, s)
		}},
	} {
		b.Run(sc.name, func(b *testing.B) {
			out := make([][NumTiers]int, n)
			var scratch []int
			benchDecisions(b, nil, func(i int) {
				r := reqs[i%len(reqs)]
				scratch = sc.split(r.Hashes, len(r.Hashes)-1, gpu[i%len(reqs)], out, scratch)
				if k := out[(owner(i%len(reqs))+1)%n][prefix.MediumCPU]; k != len(r.Hashes)-1-125 {
					b.Fatalf("request %d: host memory of the owner's neighbour supplies %d blocks", i%len(reqs), k)
				}
			})
		})
	}
}
