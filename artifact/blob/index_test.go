package blob

import (
	"errors"
	"fmt"
	"slices"
	"testing"
)

func dg(i int) Digest { return DigestOf([]byte(fmt.Sprint("blob", i))) }

func TestIndexLRUAndPins(t *testing.T) {
	x := NewIndex(100)
	for i := range 4 { // 4 × 25 fills the budget
		if ev, err := x.Reserve(dg(i), 25); err != nil || len(ev) != 0 {
			t.Fatalf("reserve %d: %v %v", i, ev, err)
		}
		if !x.Commit(dg(i)) {
			t.Fatal("commit")
		}
		x.Unpin(dg(i))
	}
	if s := x.Stats(); s.Used != 100 || s.Blobs != 4 || s.Pinned != 0 {
		t.Fatalf("stats %+v", s)
	}
	x.Touch(dg(0)) // order now 0,3,2,1 (most recent first)
	if got, want := x.Order(), []Digest{dg(0), dg(3), dg(2), dg(1)}; !slices.Equal(got, want) {
		t.Fatalf("order %v want %v", got, want)
	}
	x.Pin(dg(1)) // the LRU blob is pinned: skipped
	ev, err := x.Reserve(dg(9), 40)
	if err != nil {
		t.Fatal(err)
	}
	if want := []Digest{dg(2), dg(3)}; !slices.Equal(ev, want) {
		t.Fatalf("evicted %v want %v", ev, want)
	}
	if s := x.Stats(); s.Used != 90 || s.Reserved != 1 || s.PinnedBlobs != 2 || s.Pinned != 65 {
		t.Fatalf("stats after reserve %+v", s)
	}
	// A reserved blob is not present and never evicted; the rest is pinned
	// except dg(0): 90 - 25 + 60 > 100, so no room.
	if x.Has(dg(9)) {
		t.Fatal("reserved blob reported present")
	}
	if _, err := x.Reserve(dg(10), 60); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("want ErrNoSpace, got %v", err)
	}
	if s := x.Stats(); s.Used != 90 {
		t.Fatalf("failed reserve changed the index: %+v", s)
	}
	x.Abort(dg(9))
	if _, ok := x.Size(dg(9)); ok || x.Stats().Used != 50 {
		t.Fatalf("abort left %+v", x.Stats())
	}
	if _, err := x.Reserve(dg(0), 1); err == nil {
		t.Fatal("reserving a held digest succeeded")
	}
	x.Unpin(dg(1))
	x.Unpin(dg(1)) // extra unpins are ignored
	if x.Pins(dg(1)) != 0 || x.Stats().Pinned != 0 {
		t.Fatalf("pins %d stats %+v", x.Pins(dg(1)), x.Stats())
	}
}

func TestIndexTrimAndAdd(t *testing.T) {
	x := NewIndex(50)
	for i := range 4 {
		x.Add(dg(i), 20) // most recent first
	}
	x.Add(dg(0), 20) // no-op
	x.Pin(dg(3))
	ev := x.Trim()
	if want := []Digest{dg(2), dg(1)}; !slices.Equal(ev, want) {
		t.Fatalf("trim %v want %v", ev, want)
	}
	if s := x.Stats(); s.Used != 40 || s.Blobs != 2 {
		t.Fatalf("stats %+v", s)
	}
	unbounded := NewIndex(0)
	if ev, err := unbounded.Reserve(dg(1), 1<<50); err != nil || ev != nil {
		t.Fatal(ev, err)
	}
}

type holderSet map[Digest]bool

func (h holderSet) Has(d Digest) bool { return h[d] }

func TestLocate(t *testing.T) {
	blobs := []Blob{{Digest: dg(1), Size: 10}, {Digest: dg(2), Size: 20}, {Digest: dg(3), Size: 40}}
	local := NewIndex(0)
	local.Add(dg(1), 10)
	p := Locate(blobs, local, holderSet{}, holderSet{dg(2): true, dg(1): true})
	if p.Bytes != [numTiers]int64{TierLocal: 10, TierPeer: 20, TierRemote: 40} {
		t.Fatalf("bytes %v", p.Bytes)
	}
	if p.Blobs[1].Tier != TierPeer || p.Blobs[1].Peer != 1 || p.Blobs[0].Peer != -1 || p.Blobs[2].Tier != TierRemote {
		t.Fatalf("placements %+v", p.Blobs)
	}
	if TierPeer.String() != "peer" || p.TierBytes(TierRemote) != 40 || p.TierBytes(9) != 0 {
		t.Fatal("tier names or TierBytes")
	}
}

// BenchmarkIndexReserveCommit is the accounting of one blob fetched into a
// full cache of 1,024 blobs: one eviction, a reservation, a commit. It is
// per blob fetched (seconds of I/O each), not per request.
func BenchmarkIndexReserveCommit(b *testing.B) {
	const n = 1024
	ds := make([]Digest, 2*n)
	for i := range ds {
		ds[i] = dg(i)
	}
	x := NewIndex(n)
	for i := n - 1; i >= 0; i-- {
		x.Add(ds[i], 1) // ds[0] least recent
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		d := ds[(n+i)%(2*n)]
		ev, err := x.Reserve(d, 1)
		if err != nil || len(ev) != 1 || ev[0] != ds[i%(2*n)] {
			b.Fatal(i, ev, err)
		}
		x.Commit(d)
		x.Unpin(d)
		i++
	}
}

// TestIndexReadThrough is the simulator's use: Locate prices a start-up,
// Hold records it, Release ends the engine; a later start finds its blobs
// local unless the budget evicted them.
func TestIndexReadThrough(t *testing.T) {
	node, peer := NewIndex(100), NewIndex(0)
	a := []Blob{{Digest: dg(1), Size: 40}, {Digest: dg(2), Size: 10}}
	b := []Blob{{Digest: dg(3), Size: 50}, {Digest: dg(2), Size: 10}}
	peer.Add(dg(3), 50)
	if p := Locate(a, node, peer); p.Bytes != [numTiers]int64{TierRemote: 50} {
		t.Fatalf("first start of a: %v", p.Bytes)
	}
	if ev, err := node.Hold(a); err != nil || ev != nil {
		t.Fatal(ev, err)
	}
	if p := Locate(b, node, peer); p.Bytes != [numTiers]int64{TierLocal: 10, TierPeer: 50} {
		t.Fatalf("b beside a: %v", p.Bytes)
	}
	if _, err := node.Hold(b); err != nil { // 40 + 10 + 50 = 100: fits
		t.Fatal(err)
	}
	c := []Blob{{Digest: dg(4), Size: 30}}
	if _, err := node.Hold(c); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("both engines running: %v", err)
	}
	node.Release(a) // a's engine stops: dg(1) unpinned, dg(2) still b's
	ev, err := node.Hold(c)
	if err != nil || !slices.Equal(ev, []Digest{dg(1)}) {
		t.Fatalf("evicted %v %v, want a's weights", ev, err)
	}
	if p := Locate(a, node); p.Bytes != [numTiers]int64{TierLocal: 10, TierRemote: 40} {
		t.Fatalf("a after eviction: %v", p.Bytes)
	}
	// A failed hold releases its pins.
	before := node.Stats()
	if _, err := node.Hold([]Blob{{Digest: dg(5), Size: 1}, {Digest: dg(6), Size: 1000}}); !errors.Is(err, ErrNoSpace) {
		t.Fatal(err)
	}
	if after := node.Stats(); after.Pinned != before.Pinned {
		t.Fatalf("failed hold left pins: %+v → %+v", before, after)
	}
}
