package virtual

import (
	"testing"
	"time"

	"github.com/infergate/infergate/autoscale"
	"github.com/infergate/infergate/sim"
)

// TestNodeCachesTierChoice checks the virtual nodes' artifact caches: the
// first start on a cold node reads from the origin, a second engine on the
// node from the page cache the first filled, a start on another node from
// a peer (with Peers) or the origin; declared disk and warm states read from
// NVMe and the page cache; each priced exactly as the start-up model prices
// that source (the live engine's prices: sim.PlacementOf → StartupPhases).
func TestNodeCachesTierChoice(t *testing.T) {
	p := sim.DefaultProfile()
	model := func(src sim.WeightSource) time.Duration {
		ph, err := p.StartupPhases(sim.StartupInput{Source: src, ImageCached: true})
		if err != nil {
			t.Fatal(err)
		}
		return ph.Total()
	}
	blobs := ModelBlobs(p.Model, int64(p.WeightBytes()))
	for _, c := range []struct {
		state CacheState
		peers bool
		want  []sim.WeightSource // engines 0, 1 (node 0), 2 (node 1)
	}{
		{CacheCold, false, []sim.WeightSource{sim.SourceRemote, sim.SourcePageCache, sim.SourceRemote}},
		{CacheCold, true, []sim.WeightSource{sim.SourceRemote, sim.SourcePageCache, sim.SourcePeer}},
		{CacheDisk, false, []sim.WeightSource{sim.SourceNVMe, sim.SourcePageCache, sim.SourceNVMe}},
		{CacheWarm, false, []sim.WeightSource{sim.SourcePageCache, sim.SourcePageCache, sim.SourcePageCache}},
	} {
		nc, err := newNodeCaches(NodeCaches{Profile: p, Blobs: blobs, EnginesPerNode: 2, State: c.state, Peers: c.peers, ImageCached: true}, 4)
		if err != nil {
			t.Fatal(err)
		}
		for i, want := range c.want {
			ph, err := nc.start(i)
			if err != nil {
				t.Fatal(err)
			}
			if ph.Source != want || ph.Total() != model(want) {
				t.Errorf("%s peers=%v engine %d: %v from %s, want %v from %s", c.state, c.peers, i, ph.Total(), ph.Source, model(want), want)
			}
		}
		if got := nc.nodes[0].disk.Pins(blobs[0].Digest); got != 2 {
			t.Errorf("%s: node 0 pins %d, want 2 (two engines)", c.state, got)
		}
		nc.stop(0)
		nc.stop(1)
		nc.stop(1) // idempotent
		if got := nc.nodes[0].disk.Pins(blobs[0].Digest); got != 0 {
			t.Errorf("%s: node 0 pins %d after its engines stopped", c.state, got)
		}
	}
	// The image is pulled at a node's first start only.
	nc, err := newNodeCaches(NodeCaches{Profile: p, Blobs: blobs, EnginesPerNode: 2}, 2)
	if err != nil {
		t.Fatal(err)
	}
	first, _ := nc.start(0)
	second, _ := nc.start(1)
	if first.ImagePull <= 0 || second.ImagePull != 0 {
		t.Errorf("image pull %v then %v on one node: want a pull, then none", first.ImagePull, second.ImagePull)
	}
	// A node whose budget cannot hold the model streams it every time.
	nc, err = newNodeCaches(NodeCaches{Profile: p, Blobs: blobs, Budget: 1, ImageCached: true}, 2)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if ph, _ := nc.start(i); ph.Source != sim.SourceRemote {
			t.Errorf("engine %d on a node too small: %s, want remote", i, ph.Source)
		}
	}
	if _, err := newNodeCaches(NodeCaches{Profile: p, Blobs: blobs, Budget: 1, State: CacheDisk}, 1); err == nil {
		t.Error("a disk state whose model does not fit the budget accepted")
	}
	if _, err := newNodeCaches(NodeCaches{Profile: sim.Profiles()["tiny-llama-cpu-ollama"], Blobs: blobs}, 1); err == nil {
		t.Error("a profile without a start-up model accepted")
	}
	if s, err := ParseCacheState("disk"); err != nil || s != CacheDisk || s.String() != "disk" {
		t.Errorf("ParseCacheState(disk) = %v, %v", s, err)
	}
	if _, err := ParseCacheState("hot"); err == nil {
		t.Error("ParseCacheState(hot) accepted")
	}
}

// TestAutoscaleThroughNodeCaches runs an autoscaled fleet from zero on
// cold nodes of two engines each: the first start reads from the origin,
// later starts on a node that ran an engine from its page cache, and every
// start is counted by source.
func TestAutoscaleThroughNodeCaches(t *testing.T) {
	p := sim.DefaultProfile()
	a := Autoscale{Policy: autoscale.Config{Min: 0, Max: 4, TargetInFlight: 4, DownWindow: time.Minute},
		Interval: 5 * time.Second, Initial: -1,
		Caches: &NodeCaches{Profile: p, Blobs: ModelBlobs(p.Model, 1), EnginesPerNode: 2, ImageCached: true}}
	f, res := runAutoscaled(t, burstTrace(2), a, 2)
	st := f.ScaleStats()
	if st.Started < 2 || st.StartsBySource[string(sim.SourceRemote)] < 1 {
		t.Fatalf("started %d by source %v", st.Started, st.StartsBySource)
	}
	n := 0
	for _, k := range st.StartsBySource {
		n += k
	}
	if n != st.Started {
		t.Fatalf("starts by source %v sum to %d, started %d", st.StartsBySource, n, st.Started)
	}
	first := st.Starts[0]
	remote, _ := p.StartupPhases(sim.StartupInput{Source: sim.SourceRemote, ImageCached: true})
	if first.Ready-first.At != remote.Total() {
		t.Fatalf("first start took %v, want the remote tier's %v", first.Ready-first.At, remote.Total())
	}
	for k, r := range res {
		if r.Err != nil {
			t.Fatalf("request %d: %v", k, r.Err)
		}
	}
}
