package blob

import (
	"errors"
	"fmt"

	"github.com/infergate/infergate/internal/lru"
)

// NumTiers is the number of tiers (the length of Plan.Bytes).
const NumTiers = int(numTiers)

// Tier is where a blob's bytes come from when an engine starts: the seam to
// the simulator's start-up model, whose weights source tiers are the remote
// object store, local NVMe, the host page cache and a peer (issue 20).
type Tier uint8

// Tiers, nearest first.
const (
	// TierLocal: in this node's cache, on its disk; Placement.Resident says
	// how much of it the host page cache holds.
	TierLocal Tier = iota
	// TierPeer: in a peer node's cache (Placement.Peer).
	TierPeer
	// TierRemote: only at the origin (a registry or object store).
	TierRemote
	numTiers
)

var tierNames = [numTiers]string{TierLocal: "local", TierPeer: "peer", TierRemote: "remote"}

func (t Tier) String() string {
	if t < numTiers {
		return tierNames[t]
	}
	return fmt.Sprintf("tier(%d)", t)
}

// Blob is one blob a manifest names: its digest, declared size (bytes) and
// media type.
type Blob struct {
	Digest    Digest
	Size      int64
	MediaType string
}

// Holder answers whether a cache holds a blob: an Index (this node's, or a
// virtual peer's in the simulator) or a live peer (Peer).
type Holder interface {
	Has(Digest) bool
}

// Placement says where one blob of a start-up will be read from.
type Placement struct {
	Blob
	Tier Tier
	// Peer is the index in Locate's peers of the first peer that holds the
	// blob (TierPeer only; -1 otherwise).
	Peer int
	// Resident is how many of the blob's bytes the host page cache holds
	// (TierLocal only, filled by artifact's Cache.Locate; an Index knows
	// nothing of page caches and leaves it 0).
	Resident int64
}

// Plan is where every blob of a manifest will come from.
type Plan struct {
	Blobs []Placement
	// Bytes is the sum of blob sizes by tier (bytes).
	Bytes [numTiers]int64
}

// TierBytes is Plan.Bytes[t].
func (p *Plan) TierBytes(t Tier) int64 {
	if t < numTiers {
		return p.Bytes[t]
	}
	return 0
}

// ResidentBytes is the sum of Placement.Resident (bytes the page cache holds).
func (p *Plan) ResidentBytes() int64 {
	var n int64
	for _, b := range p.Blobs {
		n += b.Resident
	}
	return n
}

// Locate places each blob: local when local holds it, else the first of
// peers that holds it, else remote. It is pure (Holders answer from memory or
// over the network, as the caller chose): the simulator calls it with
// virtual Indexes, the live cache with its own Index and Peer clients.
func Locate(blobs []Blob, local Holder, peers ...Holder) Plan {
	p := Plan{Blobs: make([]Placement, len(blobs))}
	for i, b := range blobs {
		pl := Placement{Blob: b, Tier: TierRemote, Peer: -1}
		if local != nil && local.Has(b.Digest) {
			pl.Tier = TierLocal
		} else {
			for j, h := range peers {
				if h != nil && h.Has(b.Digest) {
					pl.Tier, pl.Peer = TierPeer, j
					break
				}
			}
		}
		p.Blobs[i] = pl
		p.Bytes[pl.Tier] += b.Size
	}
	return p
}

// ErrNoSpace reports that a blob does not fit the budget even after evicting
// every unpinned blob.
var ErrNoSpace = errors.New("artifact: cache budget exhausted by pinned blobs")

// Index is the cache's accounting, a pure core (no I/O, no clock): which
// blobs it holds and reserves, their sizes, pins, and recency, within a byte
// budget. The disk cache (artifact.Cache) drives it and carries out its
// evictions;
// the simulator can drive the same code for a virtual node. Not safe for
// concurrent use; Cache serialises it.
//
// A blob is reserved from Reserve until Commit (fetched and verified) or
// Abort; a reserved blob counts against the budget and is never evicted. A
// present blob is evictable while its pin count is 0, least recently used
// (Touch, Pin, Commit) first.
type Index struct {
	budget      int64 // bytes; <= 0: unbounded
	used        int64 // present + reserved bytes
	pinnedBytes int64
	present     int
	nodes       []lru.Node[entry]
	list        lru.List[entry]
	free        []int32
	at          map[Digest]int32
}

type entry struct {
	digest   Digest
	size     int64
	pins     int32
	reserved bool
}

// NewIndex is an empty index with a budget in bytes (<= 0: unbounded).
func NewIndex(budget int64) *Index {
	x := &Index{budget: budget, at: make(map[Digest]int32)}
	x.list.Init()
	return x
}

// IndexStats is a snapshot of an Index.
type IndexStats struct {
	Budget      int64 `json:"budget_bytes"` // <= 0: unbounded
	Used        int64 `json:"used_bytes"`   // present + reserved
	Pinned      int64 `json:"pinned_bytes"` // of pinned blobs
	Blobs       int   `json:"blobs"`        // present
	Reserved    int   `json:"reserved"`     // being fetched
	PinnedBlobs int   `json:"pinned_blobs"`
}

// Stats is the index's totals.
func (x *Index) Stats() IndexStats {
	s := IndexStats{Budget: x.budget, Used: x.used, Pinned: x.pinnedBytes, Blobs: x.present}
	for _, i := range x.at {
		e := &x.nodes[i].Val
		if e.reserved {
			s.Reserved++
		}
		if e.pins > 0 {
			s.PinnedBlobs++
		}
	}
	return s
}

// Has reports whether d is present (fetched and committed).
func (x *Index) Has(d Digest) bool {
	i, ok := x.at[d]
	return ok && !x.nodes[i].Val.reserved
}

// Size is d's size and whether it is present or reserved.
func (x *Index) Size(d Digest) (int64, bool) {
	i, ok := x.at[d]
	if !ok {
		return 0, false
	}
	return x.nodes[i].Val.size, true
}

// Pins is d's pin count.
func (x *Index) Pins(d Digest) int32 {
	if i, ok := x.at[d]; ok {
		return x.nodes[i].Val.pins
	}
	return 0
}

func (x *Index) insert(d Digest, size int64, back bool) int32 {
	var i int32
	if n := len(x.free); n > 0 {
		i, x.free = x.free[n-1], x.free[:n-1]
	} else {
		x.nodes = append(x.nodes, lru.Node[entry]{})
		i = int32(len(x.nodes) - 1)
	}
	x.nodes[i].Val = entry{digest: d, size: size}
	if back {
		x.list.PushBack(x.nodes, i)
	} else {
		x.list.PushFront(x.nodes, i)
	}
	x.at[d] = i
	x.used += size
	return i
}

// Add records a present blob found at start-up, as the least recently used
// so far: add blobs most recently used first. It is a no-op for a known
// digest, and never evicts: a cache found over budget sheds at the next
// Reserve, or at Trim.
func (x *Index) Add(d Digest, size int64) {
	if _, ok := x.at[d]; ok {
		return
	}
	x.insert(d, size, true)
	x.present++
}

// Reserve makes room for a blob about to be fetched, reserves it, and pins
// it once (for the fetch's caller; Unpin when done). It returns the present
// blobs evicted to make room, least recently used first, which the caller
// must delete. When the blob does not fit even after evicting every unpinned
// blob, nothing changes and the error wraps ErrNoSpace. Reserving a digest
// already present or reserved is an error.
func (x *Index) Reserve(d Digest, size int64) ([]Digest, error) {
	if size < 0 {
		return nil, fmt.Errorf("artifact: negative size %d", size)
	}
	if _, ok := x.at[d]; ok {
		return nil, fmt.Errorf("artifact: %s already held", d.Short())
	}
	victims, err := x.victims(size)
	if err != nil {
		return nil, err
	}
	for _, v := range victims {
		x.Remove(v)
	}
	i := x.insert(d, size, false)
	x.nodes[i].Val.reserved = true
	x.pin(i)
	return victims, nil
}

// victims lists the unpinned present blobs, least recently used first, whose
// eviction makes need more bytes fit the budget.
func (x *Index) victims(need int64) ([]Digest, error) {
	if x.budget <= 0 || x.used+need <= x.budget {
		return nil, nil
	}
	over := x.used + need - x.budget
	var out []Digest
	for i := x.list.Tail(); i >= 0 && over > 0; i = x.nodes[i].Prev() {
		e := &x.nodes[i].Val
		if e.pins > 0 || e.reserved {
			continue
		}
		out = append(out, e.digest)
		over -= e.size
	}
	if over > 0 {
		return nil, fmt.Errorf("%w: need %d bytes, budget %d, used %d, pinned %d", ErrNoSpace, need, x.budget, x.used, x.pinnedBytes)
	}
	return out, nil
}

// Trim evicts unpinned blobs, least recently used first, until the index is
// within budget, and returns them (to delete).
func (x *Index) Trim() []Digest {
	if x.budget <= 0 || x.used <= x.budget {
		return nil
	}
	var out []Digest
	for i := x.list.Tail(); i >= 0 && x.used > x.budget; {
		prev := x.nodes[i].Prev()
		if e := &x.nodes[i].Val; e.pins == 0 && !e.reserved {
			out = append(out, e.digest)
			x.Remove(e.digest)
		}
		i = prev
	}
	return out
}

// Commit marks a reserved blob present (fetched and verified) and most
// recently used. It returns false when d is not reserved.
func (x *Index) Commit(d Digest) bool {
	i, ok := x.at[d]
	if !ok || !x.nodes[i].Val.reserved {
		return false
	}
	x.nodes[i].Val.reserved = false
	x.present++
	x.list.MoveFront(x.nodes, i)
	return true
}

// Abort drops a reserved blob (its fetch failed), pins and all.
func (x *Index) Abort(d Digest) {
	if i, ok := x.at[d]; ok && x.nodes[i].Val.reserved {
		x.Remove(d)
	}
}

// Remove forgets d (evicted, deleted, or found corrupt), pins and all.
func (x *Index) Remove(d Digest) {
	i, ok := x.at[d]
	if !ok {
		return
	}
	e := &x.nodes[i].Val
	x.used -= e.size
	if e.pins > 0 {
		x.pinnedBytes -= e.size
	}
	if !e.reserved {
		x.present--
	}
	x.list.Unlink(x.nodes, i)
	delete(x.at, d)
	*e = entry{}
	x.free = append(x.free, i)
}

// Touch makes d the most recently used.
func (x *Index) Touch(d Digest) {
	if i, ok := x.at[d]; ok {
		x.list.MoveFront(x.nodes, i)
	}
}

// Pin takes a reference on a present or reserved blob, which keeps it from
// eviction, and makes it the most recently used. It returns false for an
// unknown digest.
func (x *Index) Pin(d Digest) bool {
	i, ok := x.at[d]
	if !ok {
		return false
	}
	x.pin(i)
	x.list.MoveFront(x.nodes, i)
	return true
}

func (x *Index) pin(i int32) {
	e := &x.nodes[i].Val
	if e.pins == 0 {
		x.pinnedBytes += e.size
	}
	e.pins++
}

// Unpin drops a reference taken by Pin or Reserve.
func (x *Index) Unpin(d Digest) {
	i, ok := x.at[d]
	if !ok {
		return
	}
	e := &x.nodes[i].Val
	if e.pins == 0 {
		return
	}
	e.pins--
	if e.pins == 0 {
		x.pinnedBytes -= e.size
	}
}

// Order lists the held digests from most to least recently used (for
// listings and tests).
func (x *Index) Order() []Digest {
	out := make([]Digest, 0, len(x.at))
	for i := x.list.Tail(); i >= 0; i = x.nodes[i].Prev() {
		out = append(out, x.nodes[i].Val.digest)
	}
	for l, r := 0, len(out)-1; l < r; l, r = l+1, r-1 {
		out[l], out[r] = out[r], out[l]
	}
	return out
}

// Hold is what a virtual node does when an engine starts on it (the
// simulator's read-through): every blob present is pinned, every blob
// missing is admitted present and pinned (its bytes arrived during the
// start-up Locate priced), evicting unpinned blobs least recently used first;
// the evicted are returned. On ErrNoSpace the pins taken are released (blobs
// admitted before the failure stay, unpinned, as a failed live acquire
// keeps what it fetched). Release undoes the pins when the engine stops. The
// live Cache does the same through Acquire and Lease.
func (x *Index) Hold(blobs []Blob) ([]Digest, error) {
	var evicted []Digest
	for i, b := range blobs {
		if _, ok := x.at[b.Digest]; ok {
			x.Pin(b.Digest)
			continue
		}
		ev, err := x.Reserve(b.Digest, b.Size)
		if err != nil {
			x.Release(blobs[:i])
			return nil, err
		}
		x.Commit(b.Digest)
		evicted = append(evicted, ev...)
	}
	return evicted, nil
}

// Release drops one pin of each blob (Hold's).
func (x *Index) Release(blobs []Blob) {
	for _, b := range blobs {
		x.Unpin(b.Digest)
	}
}
