package sim

import (
	"errors"
	"math"
	"testing"
	"time"
)

// TestStartupPhases checks the start-up model's figures for the 70B
// default against the formulas (sim/startup.go) and the ordering of the
// source tiers, and prints the table sim/README.md quotes
// (go test -run TestStartupPhases -v ./sim).
func TestStartupPhases(t *testing.T) {
	p := DefaultProfile()
	w := p.WeightBytes() // 141.2e9
	near := func(got time.Duration, want float64) bool {
		return math.Abs(got.Seconds()-want) < 1e-6*want+1e-9
	}
	cases := []struct {
		in       StartupInput
		pull, wl float64 // seconds
	}{
		{StartupInput{Source: SourceRemote}, 10e9 / 200e6, w / 5e9},
		{StartupInput{Source: SourceRemote, ImageCached: true}, 0, w / 5e9},
		{StartupInput{Source: SourceNVMe, ImageCached: true}, 0, w / 28e9},      // disk_bandwidth
		{StartupInput{Source: SourcePageCache, ImageCached: true}, 0, w / 40e9}, // startup.page_cache_bandwidth
		{StartupInput{Source: SourcePeer, ImageCached: true}, 0, w / 174e9},     // kv_transfer_bandwidth, under PCIe's 4 × 50
		{StartupInput{Source: SourcePageCache, ImageCached: false}, 10e9 / 200e6, w / 40e9},
	}
	prev := time.Duration(math.MaxInt64)
	for i, c := range cases {
		ph, err := p.StartupPhases(c.in)
		if err != nil {
			t.Fatal(err)
		}
		if !near(ph.ImagePull, c.pull) || !near(ph.WeightsLoad, c.wl) || ph.WarmUp != 60*time.Second {
			t.Errorf("%+v: got pull %v weights %v warm-up %v, want %.3fs %.3fs 60s", c.in, ph.ImagePull, ph.WeightsLoad, ph.WarmUp, c.pull, c.wl)
		}
		if ph.Total() != ph.ImagePull+ph.WeightsLoad+ph.WarmUp {
			t.Errorf("Total %v is not the sum of the phases", ph.Total())
		}
		if i >= 1 && i <= 4 { // image cached, sources slowest first
			if ph.Total() >= prev {
				t.Errorf("%s: total %v not below the slower source's %v", c.in.Source, ph.Total(), prev)
			}
			prev = ph.Total()
		}
		t.Logf("%-10s image cached %-5v: pull %6.1fs  weights %6.2fs (%5.1f GB/s)  warm-up %4.0fs  total %6.1fs",
			c.in.Source, c.in.ImageCached, ph.ImagePull.Seconds(), ph.WeightsLoad.Seconds(), ph.ReadBandwidth/1e9,
			ph.WarmUp.Seconds(), ph.Total().Seconds())
	}

	// Wake-ups: level 1 over PCIe from host memory, level 2 a weights
	// read from the source; both far below a cold start from it.
	w1, err := p.WakeTime(SleepWeight, "")
	if err != nil || !near(w1, w/(4*50e9)) {
		t.Errorf("WakeTime(1) = %v, %v; want %.3fs", w1, err, w/(4*50e9))
	}
	w2, err := p.WakeTime(SleepAll, SourcePageCache)
	if err != nil || !near(w2, w/40e9) {
		t.Errorf("WakeTime(2, page cache) = %v, %v; want %.3fs", w2, err, w/40e9)
	}
	cold, _ := p.StartupPhases(StartupInput{Source: SourcePageCache, ImageCached: true})
	t.Logf("wake-up from level 1 %.2fs, level 2 (page cache) %.2fs; cold start from the page cache %.1fs (%.0fx, %.0fx)",
		w1.Seconds(), w2.Seconds(), cold.Total().Seconds(), cold.Total().Seconds()/w1.Seconds(), cold.Total().Seconds()/w2.Seconds())
	if !(w1 < w2 && w2 < cold.Total()) {
		t.Errorf("want wake(1) %v < wake(2) %v < cold start %v", w1, w2, cold.Total())
	}
	if d, err := p.WakeTime(Awake, ""); d != 0 || err != nil {
		t.Errorf("WakeTime(awake) = %v, %v", d, err)
	}
	if _, err := p.WakeTime(3, ""); err == nil {
		t.Error("WakeTime(3): want an error")
	}
}

// TestStartupModelRequired checks that a profile without a start-up
// section is refused, not timed as instant, and that every built-in GPU
// profile has one.
func TestStartupModelRequired(t *testing.T) {
	p := DefaultProfile()
	p.Startup = StartupProfile{}
	if _, err := p.StartupPhases(StartupInput{Source: SourceRemote}); !errors.Is(err, ErrNoStartupModel) {
		t.Errorf("no startup section: err %v, want ErrNoStartupModel", err)
	}
	if _, err := p.StartupPhases(StartupInput{Source: "tape"}); err == nil {
		t.Error("unknown source: want an error")
	}
	for name, prof := range Profiles() {
		if prof.GPUFLOPS < 100e12 {
			continue // the CPU profile (Ollama on one core) models no GPU start-up
		}
		for _, src := range WeightSources() {
			ph, err := prof.StartupPhases(StartupInput{Source: src})
			if err != nil || ph.Total() <= 0 {
				t.Errorf("%s from %s: %v, %v", name, src, ph.Total(), err)
			}
		}
	}
	for _, s := range []string{"remote", "nvme", "page_cache", "peer"} {
		if _, err := ParseWeightSource(s); err != nil {
			t.Error(err)
		}
	}
	if _, err := ParseWeightSource("disk"); err == nil {
		t.Error(`ParseWeightSource("disk"): want an error`)
	}
}

// TestStartupValidate checks that a malformed start-up section names its key.
func TestStartupValidate(t *testing.T) {
	p := DefaultProfile()
	p.Startup.ImagePullBandwidth = 0
	if err := p.Validate(); err == nil {
		t.Error("image_bytes without image_pull_bandwidth: want an error")
	}
	p = DefaultProfile()
	p.Startup.WarmUp = -time.Second
	if err := p.Validate(); err == nil {
		t.Error("negative warm_up: want an error")
	}
}
