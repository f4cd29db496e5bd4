package sim

import (
	"math"
	"testing"

	"github.com/infergate/infergate/artifact/blob"
)

// TestPlacementOf checks the tier choice: where the artifact cache found
// each blob → bytes per weight source, and its pricing by StartupPhases
// (one source's share of the full model's bytes at that source's rate).
func TestPlacementOf(t *testing.T) {
	d := func(s string) blob.Digest { return blob.DigestOf([]byte(s)) }
	plan := blob.Plan{Blobs: []blob.Placement{
		{Blob: blob.Blob{Digest: d("a"), Size: 100}, Tier: blob.TierLocal, Resident: 30, Peer: -1},
		{Blob: blob.Blob{Digest: d("b"), Size: 50}, Tier: blob.TierLocal, Resident: 80, Peer: -1}, // clamped to 50
		{Blob: blob.Blob{Digest: d("c"), Size: 200}, Tier: blob.TierPeer, Peer: 0},
		{Blob: blob.Blob{Digest: d("e"), Size: 650}, Tier: blob.TierRemote, Peer: -1},
	}}
	w := PlacementOf(&plan)
	if want := (WeightsPlacement{Remote: 650, Peer: 200, NVMe: 70, PageCache: 80}); w != want {
		t.Fatalf("PlacementOf = %+v, want %+v", w, want)
	}
	if w.Total() != 1000 || w.Source() != SourceRemote {
		t.Fatalf("total %d source %s", w.Total(), w.Source())
	}
	p := DefaultProfile()
	W := p.WeightBytes()
	ph, err := p.StartupPhases(StartupInput{Placement: &w, ImageCached: true, Source: SourcePeer})
	if err != nil {
		t.Fatal(err)
	}
	// remote 5 GB/s, peer 174 GB/s, NVMe 28 GB/s, page cache 40 GB/s (70B default; TestStartupPhases).
	want := 0.65*W/5e9 + 0.2*W/174e9 + 0.07*W/28e9 + 0.08*W/40e9
	if math.Abs(ph.WeightsLoad.Seconds()-want) > 1e-6*want || ph.Source != SourceRemote {
		t.Fatalf("weights %v source %s, want %.3fs remote", ph.WeightsLoad, ph.Source, want)
	}
	if math.Abs(ph.ReadBandwidth-W/want) > 1e-3*W/want {
		t.Fatalf("read bandwidth %v want %v", ph.ReadBandwidth, W/want)
	}
	// A placement all in one tier prices exactly as that source.
	for _, c := range []struct {
		w   WeightsPlacement
		src WeightSource
	}{{WeightsPlacement{Remote: 7}, SourceRemote}, {WeightsPlacement{NVMe: 7}, SourceNVMe},
		{WeightsPlacement{PageCache: 7}, SourcePageCache}, {WeightsPlacement{Peer: 7}, SourcePeer}} {
		got, err := p.StartupPhases(StartupInput{Placement: &c.w})
		if err != nil {
			t.Fatal(err)
		}
		ref, _ := p.StartupPhases(StartupInput{Source: c.src})
		if got.Source != c.src || math.Abs(float64(got.Total()-ref.Total())) > 1e3 {
			t.Errorf("%+v: %v from %s, want %v from %s", c.w, got.Total(), got.Source, ref.Total(), c.src)
		}
	}
	// An empty placement falls back to Source.
	empty := WeightsPlacement{}
	got, _ := p.StartupPhases(StartupInput{Placement: &empty, Source: SourceNVMe})
	if got.Source != SourceNVMe || empty.Source() != SourcePageCache {
		t.Errorf("empty placement: %s / %s", got.Source, empty.Source())
	}
	// A warm cache (page cache) against a cold node (remote, image to pull): the 2×.
	warm, _ := p.StartupPhases(StartupInput{Placement: &WeightsPlacement{PageCache: 1}, ImageCached: true})
	cold, _ := p.StartupPhases(StartupInput{Placement: &WeightsPlacement{Remote: 1}})
	if r := cold.Total().Seconds() / warm.Total().Seconds(); r < 2 {
		t.Errorf("cold %v / warm %v = %.2f, want >= 2", cold.Total(), warm.Total(), r)
	}
}
