package sim

import (
	"time"

	"github.com/infergate/infergate/artifact/blob"
)

// The tier choice of a start-up that reads through the node's artifact
// cache (issue 20, item 2): one function turns where the cache found each
// blob of the engine's weights (a blob.Plan: this node's disk, and how much
// of it the host page cache holds; a peer node's cache; only the origin)
// into the bytes each weight source serves, and StartupPhases prices them.
// The live simulated engine (simserver, a Plan from artifact.Cache.Locate:
// the node's index, peers asked over HTTP, page-cache residency from
// mincore(2)) and the virtual fleet (virtual, a Plan from blob.Locate over a
// virtual node's blob.Index and page cache) call the same code.

// WeightsPlacement is how an engine's weight bytes split between the weight
// sources when it starts (PlacementOf). The bytes are the artifact's (a
// generated test file or a real model); StartupPhases prices each source's
// share of the profile's full WeightBytes, so a small artifact stands for the
// modelled model.
type WeightsPlacement struct {
	// Remote: only at the origin (blob.TierRemote): SourceRemote.
	Remote int64
	// Peer: in a peer node's cache (blob.TierPeer): SourcePeer.
	Peer int64
	// NVMe: on this node's disk, not in its page cache (blob.TierLocal
	// less Placement.Resident): SourceNVMe.
	NVMe int64
	// PageCache: in this node's page cache (Placement.Resident):
	// SourcePageCache.
	PageCache int64
}

// PlacementOf is the tier choice: the bytes of p per weight source. A
// local blob's resident bytes (clamped to [0, Size]) come from the page
// cache and the rest from NVMe; a peer's from SourcePeer (the peer's cache
// is read over the node's NICs, the bandwidth SourcePeer models); the rest
// from the remote store.
func PlacementOf(p *blob.Plan) WeightsPlacement {
	var w WeightsPlacement
	for i := range p.Blobs {
		b := &p.Blobs[i]
		switch b.Tier {
		case blob.TierLocal:
			res := min(max(b.Resident, 0), b.Size)
			w.PageCache += res
			w.NVMe += b.Size - res
		case blob.TierPeer:
			w.Peer += b.Size
		default:
			w.Remote += b.Size
		}
	}
	return w
}

// Total is the placement's bytes.
func (w WeightsPlacement) Total() int64 { return w.Remote + w.Peer + w.NVMe + w.PageCache }

// Source is the slowest source that serves any byte (remote, then NVMe,
// then page cache, then peer, as WeightSources orders them): the start-up's
// source of record in logs, metrics and reports. SourcePageCache for an
// empty placement.
func (w WeightsPlacement) Source() WeightSource {
	switch {
	case w.Remote > 0:
		return SourceRemote
	case w.NVMe > 0:
		return SourceNVMe
	case w.PageCache > 0:
		return SourcePageCache
	case w.Peer > 0:
		return SourcePeer
	}
	return SourcePageCache
}

// bytes returns the placement's bytes from src.
func (w WeightsPlacement) bytes(src WeightSource) int64 {
	switch src {
	case SourceRemote:
		return w.Remote
	case SourceNVMe:
		return w.NVMe
	case SourcePageCache:
		return w.PageCache
	case SourcePeer:
		return w.Peer
	}
	return 0
}

// placedReadTime is the weights phase of a start-up whose bytes split as w:
// each source serves its share of WeightBytes at min(its bandwidth, TP ×
// host_bandwidth), one source after the other (a loader reads its files in
// order; no overlap between sources is modelled). It returns the time and
// the effective bandwidth (bytes/s).
func (p GPUProfile) placedReadTime(w WeightsPlacement) (time.Duration, float64, error) {
	total := float64(w.Total())
	var d time.Duration
	for _, src := range WeightSources() {
		n := w.bytes(src)
		if n <= 0 {
			continue
		}
		bw, err := p.sourceBandwidth(src)
		if err != nil {
			return 0, 0, err
		}
		t, _ := p.readTime(bw)
		d += time.Duration(float64(t) * float64(n) / total)
	}
	if d <= 0 {
		return 0, 0, nil
	}
	return d, p.WeightBytes() / d.Seconds(), nil
}
