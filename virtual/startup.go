package virtual

import (
	"errors"
	"fmt"
	"time"

	"github.com/infergate/infergate/artifact/blob"
	"github.com/infergate/infergate/sim"
)

// NodeCaches makes an autoscaled fleet's start-ups read through an
// artifact cache per node (Autoscale.Caches), as the live simulated engine
// does through artifact.Cache (simserver, StartupConfig.Weights): at each
// start the engine's node asks where the model's blobs are — its own
// cache's blob.Index (the same accounting as the live cache) and the page
// cache, then the other nodes' caches (Peers), else the origin
// (blob.Locate) — and sim.PlacementOf turns that into the start-up's tiers,
// priced by the profile's start-up model. Then the node holds the blobs
// (Index.Hold: fetched ones admitted, all pinned, evicting within Budget)
// and the page cache holds what the engine read; the engine releases its
// pins when it stops. So the first start on a cold node reads from the
// origin (or a peer), the later ones from the page cache.
type NodeCaches struct {
	// Profile is the engines' profile (its start-up model prices the
	// tiers; ErrNoStartupModel without one).
	Profile sim.GPUProfile
	// Blobs are the model's artifact: only their shares of the bytes
	// matter (the profile's WeightBytes is what a start-up moves).
	// ModelBlobs gives the usual one-blob artifact.
	Blobs []blob.Blob
	// EnginesPerNode: engine i runs on node i / EnginesPerNode (default
	// 1: a node per engine).
	EnginesPerNode int
	// State is every node's cache at time 0.
	State CacheState
	// Budget bounds each node's cache (bytes of Blobs; <= 0: unbounded).
	Budget int64
	// Peers: a node fetches a blob another node's cache holds from that
	// node (blob.TierPeer, sim.SourcePeer) rather than the origin.
	Peers bool
	// ImageCached: the engine image is on every node at time 0 (no
	// pull); a node pulls it at its first start otherwise, and keeps it.
	ImageCached bool
}

// CacheState is a node's artifact cache at time 0 (NodeCaches.State).
type CacheState uint8

// Cache states.
const (
	// CacheCold: the node holds nothing (weights from the origin or a
	// peer).
	CacheCold CacheState = iota
	// CacheDisk: the model is on the node's disk, not in its page cache
	// (weights from NVMe).
	CacheDisk
	// CacheWarm: on disk and in the page cache (weights from memory).
	CacheWarm
)

var cacheStates = [...]string{CacheCold: "cold", CacheDisk: "disk", CacheWarm: "warm"}

func (s CacheState) String() string {
	if int(s) < len(cacheStates) {
		return cacheStates[s]
	}
	return fmt.Sprintf("cache(%d)", s)
}

// ParseCacheState reads a CacheState by name (cold, disk, warm).
func ParseCacheState(v string) (CacheState, error) {
	for i, n := range cacheStates {
		if n == v {
			return CacheState(i), nil
		}
	}
	return 0, fmt.Errorf("cache state %q: want cold, disk or warm", v)
}

// ModelBlobs is a one-blob artifact of n bytes named after model (a
// virtual node's cache needs a digest; its size only shares the bytes).
func ModelBlobs(model string, n int64) []blob.Blob {
	return []blob.Blob{{Digest: blob.DigestOf([]byte("infergate-virtual-weights:" + model)), Size: max(n, 1)}}
}

// nodeCache is one virtual node's artifact cache: its disk (the live
// cache's Index) and the host page cache (an unbounded Index: what
// engines on the node have read).
type nodeCache struct {
	disk, page *blob.Index
	image      bool // the engine image is on the node
}

// nodeCaches is a fleet's per-node caches, and which engines hold pins.
type nodeCaches struct {
	cfg     NodeCaches
	nodes   []nodeCache
	holding []bool // by engine: its Hold succeeded, Release at stop
	peers   []blob.Holder
}

// newNodeCaches builds the caches of a fleet of n engines in cfg.State.
func newNodeCaches(cfg NodeCaches, n int) (*nodeCaches, error) {
	if len(cfg.Blobs) == 0 {
		return nil, errors.New("sim: node caches need the model's blobs")
	}
	if _, err := cfg.Profile.StartupPhases(sim.StartupInput{Source: sim.SourceRemote}); err != nil {
		return nil, fmt.Errorf("sim: node caches: %w", err)
	}
	if cfg.EnginesPerNode <= 0 {
		cfg.EnginesPerNode = 1
	}
	nc := &nodeCaches{cfg: cfg, holding: make([]bool, n)}
	for range (n + cfg.EnginesPerNode - 1) / cfg.EnginesPerNode {
		node := nodeCache{disk: blob.NewIndex(cfg.Budget), page: blob.NewIndex(0), image: cfg.ImageCached}
		if cfg.State >= CacheDisk {
			if _, err := node.disk.Hold(cfg.Blobs); err != nil {
				return nil, fmt.Errorf("sim: node caches: the model does not fit the budget: %w", err)
			}
			node.disk.Release(cfg.Blobs)
		}
		if cfg.State == CacheWarm {
			for _, b := range cfg.Blobs {
				node.page.Add(b.Digest, b.Size)
			}
		}
		nc.nodes = append(nc.nodes, node)
	}
	return nc, nil
}

// start is engine i's start-up through its node's cache: the tiers it
// reads from (the placement) and the modelled phases; the node then holds
// the blobs (pinned until stop) and its page cache what was read.
func (nc *nodeCaches) start(i int) (sim.StartupPhases, error) {
	k := i / nc.cfg.EnginesPerNode
	node := &nc.nodes[k]
	nc.peers = nc.peers[:0]
	if nc.cfg.Peers {
		for j := range nc.nodes {
			if j != k {
				nc.peers = append(nc.peers, nc.nodes[j].disk)
			}
		}
	}
	plan := blob.Locate(nc.cfg.Blobs, node.disk, nc.peers...)
	for j := range plan.Blobs {
		if p := &plan.Blobs[j]; p.Tier == blob.TierLocal && node.page.Has(p.Digest) {
			p.Resident = p.Size
		}
	}
	w := sim.PlacementOf(&plan)
	ph, err := nc.cfg.Profile.StartupPhases(sim.StartupInput{Placement: &w, ImageCached: node.image})
	if err != nil {
		return ph, err
	}
	node.image = true
	// A node whose budget the running engines pin entirely streams the
	// weights without keeping them (as a failed live acquire keeps
	// nothing pinned); the page cache still holds them.
	_, err = node.disk.Hold(nc.cfg.Blobs)
	nc.holding[i] = err == nil
	for _, b := range nc.cfg.Blobs {
		if !node.page.Has(b.Digest) {
			node.page.Add(b.Digest, b.Size)
		}
		node.page.Touch(b.Digest)
	}
	return ph, nil
}

// stop releases engine i's pins.
func (nc *nodeCaches) stop(i int) {
	if nc.holding[i] {
		nc.nodes[i/nc.cfg.EnginesPerNode].disk.Release(nc.cfg.Blobs)
		nc.holding[i] = false
	}
}

// startUpTime is engine i's start-up time at t: through the node caches
// when the fleet has them (its source counted), else Autoscale.StartUp
// or ColdStart.
func (f *Fleet) startUpTime(i int, t time.Duration) time.Duration {
	as := f.as
	if as.caches != nil {
		ph, err := as.caches.start(i)
		if err == nil { // checked at NewFleet: a bug guard
			if as.stats.StartsBySource == nil {
				as.stats.StartsBySource = map[string]int{}
			}
			as.stats.StartsBySource[string(ph.Source)]++
			return ph.Total()
		}
	}
	if as.cfg.StartUp != nil {
		return max(as.cfg.StartUp(i, t), 0)
	}
	return as.cfg.ColdStart
}
