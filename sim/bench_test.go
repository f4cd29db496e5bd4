package sim

import (
	"fmt"
	"testing"
)

// BenchmarkStepDecode measures a steady decode step of batch sequences with
// new requests replacing finished ones (one op = one engine step).
func BenchmarkStepDecode(b *testing.B) {
	for _, batch := range []int{16, 256} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			e := NewEngine(Config{})
			ids := make([]string, 1<<16)
			for i := range ids {
				ids[i] = fmt.Sprintf("r%d", i)
			}
			system := seqTokens(0, 1024)
			prompts := make([][]uint32, 64)
			for i := range prompts {
				prompts[i] = concat(system, seqTokens(1+i, 512))
			}
			next := 0
			add := func() {
				must(b, e.Add(&Request{ID: ids[next%len(ids)], Tokens: prompts[next%len(prompts)], MaxTokens: 256}, 0))
				next++
			}
			for range batch {
				add()
			}
			for range 300 { // warm up past the first prefills and finishes
				for _, o := range e.Step(0).Outputs {
					if o.Finished {
						add()
					}
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				for _, o := range e.Step(0).Outputs {
					if o.Finished {
						add()
					}
				}
			}
		})
	}
}

// BenchmarkAdmitHit measures Add plus admission of a 2k-token prompt whose
// first 1.5k tokens are cached, and its release (one op = one request).
func BenchmarkAdmitHit(b *testing.B) {
	e := NewEngine(Config{})
	prompt := concat(seqTokens(0, 1536), seqTokens(1, 512))
	must(b, e.Add(&Request{ID: "warm", Tokens: prompt, MaxTokens: 1}, 0))
	for e.HasWork() {
		e.Step(0)
	}
	r := &Request{ID: "x", Tokens: prompt, MaxTokens: 1}
	b.ReportAllocs()
	for b.Loop() {
		must(b, e.Add(r, 0))
		if out := e.Step(0).Outputs; len(out) != 1 || out[0].CachedTokens != 2032 {
			b.Fatalf("outputs %+v", out)
		}
	}
}

// BenchmarkPoolLookupAllocate measures the block pool alone: a 128-block
// prefix lookup with touch, 32 new blocks (evicting), and release (one op = one
// such admission and release).
func BenchmarkPoolLookupAllocate(b *testing.B) {
	const n = 4096
	p := newBlockPool(n)
	hashes := make([]uint64, 128)
	ids := p.allocate(nil, 128)
	for i, id := range ids {
		hashes[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
		p.register(id, hashes[i])
	}
	p.release(ids)
	hit := make([]int32, 0, 128)
	held := make([]int32, 0, 160)
	b.ReportAllocs()
	for b.Loop() {
		hit = hit[:0]
		for _, h := range hashes {
			id := p.lookup(h)
			if id == noBlock {
				b.Fatal("miss")
			}
			hit = append(hit, id)
		}
		p.touch(hit)
		held = append(held[:0], hit...)
		held = p.allocate(held, 32)
		p.release(held)
	}
}
