package plan

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
)

// TestRunRefusesOverMemory: a sweep whose estimate is over the limit is
// refused before any run, naming the figures; under it, it runs. Cheap:
// no engine is built for the refused sweep (4,096 engines of the default
// profile, the fleet that grew to 24 GB under -race).
func TestRunRefusesOverMemory(t *testing.T) {
	opts := Options{Records: burstTrace(4, time.Second), Engines: []int{1, MaxEngines},
		Policies: []string{sched.LeastRequest}, SLO: mustSLO(t, "ttft_p90=1s"), Workers: 2, MaxMemory: 1 << 30, NoReferences: true}
	_, err := Run(context.Background(), opts)
	if err == nil || !strings.Contains(err.Error(), "over the limit of 1.0 GiB") || !strings.Contains(err.Error(), "4096 engines") {
		t.Fatalf("err %v", err)
	}
	opts.Engines = []int{2}
	if _, err := Run(context.Background(), opts); err != nil {
		t.Fatalf("2 engines under 1 GiB: %v", err)
	}
	opts.MaxMemory = -1
	if _, err := Run(context.Background(), opts); err == nil || !strings.Contains(err.Error(), "memory limit") {
		t.Fatalf("negative limit: %v", err)
	}
}

// TestMemoryEstimate: workers × (engines × sim.EngineBytes + 97 bytes per
// prompt block), the index capped by the fleet's KV capacity.
func TestMemoryEstimate(t *testing.T) {
	cfg := sim.Config{NumBlocks: 1000, BlockSize: 16}
	recs := []trace.Record{{InputLength: 33}, {InputLength: 16}} // 3 + 1 blocks
	total, per, index := memoryEstimate(Options{Engine: cfg}, recs, 10, 3)
	if per != sim.EngineBytes(cfg) || index != 4*indexBytesPerBlock || total != 3*(10*per+index) {
		t.Fatalf("total %d, per engine %d, index %d", total, per, index)
	}
	cfg.NumBlocks = 1
	if _, _, index := memoryEstimate(Options{Engine: cfg}, recs, 2, 1); index != 2*indexBytesPerBlock {
		t.Fatalf("index %d: not capped by 2 engines × 1 block", index)
	}
	if DefaultMaxMemory() <= 0 {
		t.Fatal("no default limit")
	}
}

// TestMemoryEstimateSaturates: an engine config whose block pools add up
// past 2^63 bytes is over any limit. Before the estimate saturated, 16
// engines of 2^56 blocks (80 bytes each: 2^64 × 5, wrapping to 16 KiB
// each) were estimated at a few MiB and passed a 1 GiB limit, and the
// sweep went on to allocate the pools; 2^62 blocks wrapped EngineBytes
// itself.
func TestMemoryEstimateSaturates(t *testing.T) {
	recs := []trace.Record{{InputLength: 1 << 20}}
	for _, c := range []struct{ blocks, engines, workers int }{
		{1 << 56, 16, 1}, {1 << 56, 4096, 3}, {1 << 62, 1, 1}, {1<<63 - 1, 2, 2}, {1 << 40, MaxEngines, 1 << 20},
	} {
		opts := Options{Engine: sim.Config{NumBlocks: c.blocks, BlockSize: 16}}
		if err := checkMemory(opts, recs, c.engines, c.workers, 1<<30); err == nil {
			total, per, index := memoryEstimate(opts, recs, c.engines, c.workers)
			t.Errorf("%d blocks × %d engines × %d workers passed 1 GiB: estimated %d bytes (%d per engine, index %d)",
				c.blocks, c.engines, c.workers, total, per, index)
		}
	}
	if got := sim.EngineBytes(sim.Config{NumBlocks: 1 << 62, BlockSize: 16}); got <= 0 {
		t.Errorf("EngineBytes of 2^62 blocks: %d", got)
	}
}
