package sched

import (
	"math/rand/v2"
	"testing"

	"github.com/infergate/infergate/prefix"
)

// splitReference is Tiers.Split as it was before it skipped media and
// endpoints (commit 973bfe9): a full Match of the pool per lower medium,
// the remote store's included, and extend's walk for every endpoint below
// its cap (extendGroup with every endpoint allowed). The equivalence
// tests hold the fast Split to it.
// scratch is reused and returned.
func splitReference(t *Tiers, hashes []uint64, maxBlocks int, gpu []int, out [][NumTiers]int, scratch []int) []int {
	n := len(out)
	width := n
	if t.Remote >= n {
		width = t.Remote + 1
	}
	if cap(scratch) < width {
		scratch = make([]int, width)
	}
	m := scratch[:width]
	for md := prefix.MediumCPU; int(md) < NumTiers; md++ {
		t.Source.Match(hashes, md, m)
		remote := 0
		if t.Remote >= 0 && t.Remote < width {
			remote = m[t.Remote]
		}
		for e := range n {
			if md == prefix.MediumRemote {
				out[e][md] = remote
			} else {
				out[e][md] = m[e]
			}
		}
	}
	for e := range n {
		out[e][prefix.MediumGPU] = gpu[e]
		out[e] = SplitTiers(out[e], maxBlocks)
	}
	// extend's walk for every endpoint (no pruning mask): the walk
	// itself is unchanged, what Split skips around it is under test.
	for lo := 0; lo < n; lo += prefix.MaxEndpoints {
		t.extendGroup(hashes, out[lo:min(n, lo+prefix.MaxEndpoints)], lo/prefix.MaxEndpoints, maxBlocks, ^uint64(0))
	}
	return scratch
}

// tierOpsPool is the pool of the Split equivalence tests: 130 endpoints
// (three groups of the index, the last part full), the remote store in
// slot 130 (group 2), prompts of 24 blocks sharing their first 8.
const (
	tierOpsPool   = 130
	tierOpsBlocks = 24
)

// tierOpsPrompts returns the tests' four prompts and their request keys.
func tierOpsPrompts() (toks [][]uint32, hashes [][]uint64) {
	for p := range 4 {
		t := make([]uint32, 16*tierOpsBlocks+1)
		for i := range t {
			t[i] = uint32(7*i + 1)
			if i >= 16*8 {
				t[i] += uint32(100000 * (p + 1))
			}
		}
		toks = append(toks, t)
		hashes = append(hashes, prefix.Hashes(nil, t, 16, 0))
	}
	return toks, hashes
}

// applyTierOps drives ix with ops, 3 bytes an op: which endpoint (one of
// 12 spread over the three groups, or the remote store), which medium,
// which prompt, and a run of blocks [from, to) stored with tokens (from
// its parent: chained) or removed (making holes), with an occasional
// ClearedMedium, Cleared or Move.
func applyTierOps(t testing.TB, ix *prefix.PreciseIndex, ops []byte, engKeys [][]uint64, toks [][]uint32) {
	eps := [...]int{0, 1, 5, 63, 64, 65, 100, 127, 128, 129, 3, 70, tierOpsPool}
	for len(ops) >= 3 {
		a, b, c := ops[0], ops[1], ops[2]
		ops = ops[3:]
		e := eps[int(a)%len(eps)]
		md := prefix.Medium(int(a>>4) % NumTiers)
		if e == tierOpsPool {
			md = prefix.MediumRemote
		}
		p := int(b) % len(engKeys)
		from := int(b>>2) % tierOpsBlocks
		to := min(tierOpsBlocks, from+1+int(c)%tierOpsBlocks)
		switch c >> 5 {
		case 0, 1, 2, 3: // store [0, to) or, chained, [from, to)
			if c&16 != 0 {
				from = 0
			}
			parent := uint64(0)
			if from > 0 {
				parent = engKeys[p][from-1]
			}
			if err := ix.Stored(e, md, engKeys[p][from:to], parent, from > 0, toks[p][16*from:16*to], 0); err != nil {
				t.Fatal(err)
			}
		case 4, 5:
			ix.Removed(e, md, engKeys[p][from:to])
		case 6:
			ix.ClearedMedium(e, md)
		default:
			if a&1 == 0 {
				ix.Cleared(e)
			} else if other := eps[int(b)%(len(eps)-1)]; other != e && e != tierOpsPool {
				if err := ix.Move(e, other); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
}

// checkSplitEquivalent fills an index by ops and checks that Split gives,
// for every prompt, every cap and remote or none, the reference's
// TierBlocks.
func checkSplitEquivalent(t testing.TB, ops []byte) {
	toks, hashes := tierOpsPrompts()
	engKeys := make([][]uint64, len(toks))
	for p := range engKeys {
		engKeys[p] = make([]uint64, tierOpsBlocks)
		for i := range engKeys[p] {
			engKeys[p][i] = uint64(p*1000 + i + 1)
		}
	}
	ix, err := prefix.NewPreciseIndex(tierOpsPool+1, 16)
	if err != nil {
		t.Fatal(err)
	}
	applyTierOps(t, ix, ops, engKeys, toks)
	gpu := make([]int, tierOpsPool)
	got := make([][NumTiers]int, tierOpsPool)
	want := make([][NumTiers]int, tierOpsPool)
	var scratch []int
	for _, remote := range []int{-1, tierOpsPool} {
		tr := &Tiers{Source: ix, Remote: remote}
		for p, h := range hashes {
			ix.Match(h, prefix.MediumGPU, gpu)
			for _, maxBlocks := range []int{0, 1, 9, tierOpsBlocks - 1, tierOpsBlocks} {
				scratch = tr.Split(h, maxBlocks, gpu, got, scratch)
				splitReference(tr, h, maxBlocks, gpu, want, nil)
				for e := range got {
					if got[e] != want[e] {
						t.Fatalf("remote %d prompt %d cap %d endpoint %d: split %v, reference %v", remote, p, maxBlocks, e, got[e], want[e])
					}
				}
			}
		}
	}
}

// TestTiersSplitMatchesReference: Split skips media a group holds nothing
// in, the remote match when the pool has none, and the walk of endpoints
// prefix-closed in every lower medium; on random indexes (holes from
// removals and offloads past gaps, clears, moves, across three groups) it
// gives exactly the TierBlocks of the full computation.
func TestTiersSplitMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(19, 1000))
	for round := range 200 {
		ops := make([]byte, 3*(1+rng.IntN(120)))
		for i := range ops {
			ops[i] = byte(rng.Uint32())
		}
		if round%4 == 0 {
			for i := 2; i < len(ops); i += 3 {
				ops[i] &^= 0xc0 // stores only: mostly prefix-closed
			}
		}
		checkSplitEquivalent(t, ops)
	}
}

// FuzzTiersSplit is TestTiersSplitMatchesReference on fuzzed ops.
func FuzzTiersSplit(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{0x00, 0x00, 0x17, 0x10, 0x00, 0x17}) // GPU then host memory of endpoint 0
	f.Add([]byte{0x13, 0x00, 0x17, 0x13, 0x00, 0x82}) // host memory with a hole
	f.Add([]byte{0x0c, 0x40, 0x17, 0x10, 0x40, 0x17, 0x0c, 0x00, 0x83})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 600 {
			ops = ops[:600]
		}
		checkSplitEquivalent(t, ops)
	})
}
