package sim

import (
	"slices"
	"testing"

	"github.com/infergate/infergate/prefix"
)

// freeOrder lists the free queue from head (next evicted) to tail.
func freeOrder(p *blockPool) []int32 {
	var ids []int32
	for id := p.head; id != noBlock; id = p.blocks[id].next {
		ids = append(ids, id)
	}
	return ids
}

// checkPool verifies the pool's internal invariants.
func checkPool(t *testing.T, p *blockPool) {
	t.Helper()
	free := freeOrder(p)
	if len(free) != p.numFree {
		t.Fatalf("free queue has %d blocks, numFree = %d", len(free), p.numFree)
	}
	for i := range p.blocks {
		b := &p.blocks[i]
		if b.ref < 0 {
			t.Fatalf("block %d: ref %d", i, b.ref)
		}
		if (b.ref == 0) != b.free {
			t.Fatalf("block %d: ref %d but free=%v", i, b.ref, b.free)
		}
	}
	indexed := 0
	for h, id := range p.index {
		if tail := p.blocks[id].dupPrev; p.blocks[tail].dupNext != noBlock {
			t.Fatalf("chain of %x: head's dupPrev %d is not the tail", h, tail)
		}
		for ; id != noBlock; id = p.blocks[id].dupNext {
			if !p.blocks[id].cached || p.blocks[id].hash != h {
				t.Fatalf("block %d in chain of %x: cached=%v hash=%x", id, h, p.blocks[id].cached, p.blocks[id].hash)
			}
			indexed++
		}
	}
	cached := 0
	for i := range p.blocks {
		if p.blocks[i].cached {
			cached++
		}
	}
	if cached != indexed {
		t.Fatalf("%d cached blocks, %d reachable from the index", cached, indexed)
	}
}

func TestBlockPoolAllocateReleaseLRU(t *testing.T) {
	p := newBlockPool(4)
	a := p.allocate(nil, 2) // blocks 0, 1
	if !slices.Equal(a, []int32{0, 1}) || p.numFree != 2 || p.used() != 2 {
		t.Fatalf("allocate: got %v, free %d", a, p.numFree)
	}
	p.register(0, 100)
	p.register(1, 101)
	b := p.allocate(nil, 1) // block 2
	p.register(2, 200)
	checkPool(t, p)

	// Release a in reverse (tail first): queue becomes 3, 1, 0.
	p.release([]int32{1, 0})
	if got := freeOrder(p); !slices.Equal(got, []int32{3, 1, 0}) {
		t.Fatalf("free order %v, want [3 1 0]", got)
	}
	// Released blocks keep their hashes.
	if p.lookup(100) != 0 || p.lookup(101) != 1 {
		t.Fatal("released blocks lost their hashes")
	}
	// A hit on a free block takes it off the queue; a second holder adds a ref.
	p.touch([]int32{0})
	p.touch([]int32{0})
	if p.blocks[0].ref != 2 || slices.Contains(freeOrder(p), 0) {
		t.Fatalf("touch: ref %d, free %v", p.blocks[0].ref, freeOrder(p))
	}
	p.release([]int32{0})
	if p.blocks[0].free {
		t.Fatal("block with ref 1 is in the free queue")
	}
	checkPool(t, p)

	// Allocation takes the LRU head (3, never hashed), then 1, evicting 101.
	c := p.allocate(nil, 2)
	if !slices.Equal(c, []int32{3, 1}) {
		t.Fatalf("allocate order %v, want [3 1]", c)
	}
	if p.lookup(101) != noBlock {
		t.Fatal("evicted block still found")
	}
	if p.lookup(100) != 0 || p.lookup(200) != 2 {
		t.Fatal("held blocks must stay cached")
	}
	p.release(b)
	p.release(c)
	p.release([]int32{0})
	if p.numFree != 4 || p.used() != 0 {
		t.Fatalf("all released: free %d", p.numFree)
	}
	checkPool(t, p)
}

func TestBlockPoolDuplicateHashes(t *testing.T) {
	// Two requests computing the same block concurrently both register it
	// (vLLM does not de-duplicate); lookup finds the first, and evicting it
	// leaves the other findable.
	p := newBlockPool(3)
	ids := p.allocate(nil, 2)
	p.register(ids[0], 7)
	p.register(ids[1], 7)
	if p.lookup(7) != ids[0] {
		t.Fatal("lookup must return the first registered block")
	}
	p.release([]int32{ids[0]})
	p.release([]int32{ids[1]})
	got := p.allocate(nil, 2) // block 2 (never used), then ids[0]
	if got[1] != ids[0] || p.lookup(7) != ids[1] {
		t.Fatalf("after evicting %d lookup gives %d, want %d", ids[0], p.lookup(7), ids[1])
	}
	checkPool(t, p)
}

func TestBlockPoolChainRemoval(t *testing.T) {
	// Evict the middle, the tail and the head of a chain of equal hashes.
	for _, order := range [][]int32{{1, 2, 0, 3}, {3, 0, 2, 1}, {0, 1, 2, 3}} {
		p := newBlockPool(4)
		ids := p.allocate(nil, 4)
		for _, id := range ids {
			p.register(id, 5)
		}
		checkPool(t, p)
		remaining := slices.Clone(ids)
		for _, id := range order {
			p.evict(id)
			remaining = slices.DeleteFunc(remaining, func(x int32) bool { return x == id })
			checkPool(t, p)
			want := int32(noBlock)
			if len(remaining) > 0 {
				want = remaining[0]
			}
			if got := p.lookup(5); got != want {
				t.Fatalf("order %v: after evicting %d lookup = %d, want %d", order, id, got, want)
			}
		}
	}
}

func TestIncrementalHashesMatchWholeSequence(t *testing.T) {
	e := NewEngine(Config{NumBlocks: 64})
	prompt := seqTokens(1, 37)
	if err := e.Add(&Request{ID: "a", Tokens: prompt, MaxTokens: 60, Extra: 9}, 0); err != nil {
		t.Fatal(err)
	}
	s := e.byID["a"]
	for e.HasWork() {
		e.Step(0)
		if len(s.hashes) > 0 {
			want := prefix.Hashes(nil, s.tokens[:len(s.hashes)*16], 16, 9)
			if !slices.Equal(s.hashes, want) {
				t.Fatalf("incremental hashes differ from whole-sequence hashes")
			}
		}
	}
	if len(s.hashes) != (37+60)/16 {
		t.Fatalf("got %d hashes, want %d", len(s.hashes), (37+60)/16)
	}
	// Chaining: different Extra changes every hash.
	other := prefix.Hashes(nil, s.tokens[:64], 16, 10)
	for i, h := range other {
		if h == s.hashes[i] {
			t.Fatalf("block %d hash independent of Extra", i)
		}
	}
}
