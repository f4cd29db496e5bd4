package virtual

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/trace"
)

// TestVirtualMooncakeFull replays the whole Mooncake conversation trace
// (12,031 requests, 145M prompt tokens, 59 minutes) on 16 engines of the
// default profile with the prefix policy in virtual time, and logs the wall
// time, hit rate and TTFT percentiles. It took 7.6 s on the 2-core dev host
// (54 s under the race detector, which is skipped: the virtual fleet runs no
// goroutines, so the detector has nothing to check there).
func TestVirtualMooncakeFull(t *testing.T) {
	if testing.Short() {
		t.Skip("full-trace virtual replay; skipped with -short")
	}
	if raceEnabled {
		t.Skip("full-trace virtual replay: single-goroutine, ~7x slower under the race detector")
	}
	recs, err := trace.LoadMooncake(mooncakePath)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	run, err := Replay(context.Background(), ReplayOptions{
		Policy:  sched.Prefix,
		Engines: 16,
		Records: recs,
		Seed:    1,
	})
	if err != nil {
		t.Fatal(err)
	}
	wall := time.Since(start)
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	s := run.Summary
	t.Logf("%d requests on 16 engines: wall %v (simulation %v), heap in use %d MiB", s.Requests, wall.Round(time.Millisecond), run.Wall.Round(time.Millisecond), ms.HeapInuse>>20)
	t.Logf("hit rate %.1f%% (ceiling %.1f%%), TTFT p50/p90/p99 %.0f/%.0f/%.0f ms, ITL p50/p99 %.1f/%.1f ms, util %.1f%%, preemptions %d, errors %d",
		s.HitRate*100, trace.InfiniteCacheHitRate(recs)*100, s.TTFT.P50, s.TTFT.P90, s.TTFT.P99, s.ITL.P50, s.ITL.P99,
		*s.MeanEngineUtilization*100, *s.Preemptions, s.Errors)
	if s.Requests != len(recs) || s.Errors != 0 {
		t.Errorf("%d requests, %d errors (first: %s)", s.Requests, s.Errors, s.FirstError)
	}
	if s.HitRate <= 0 || s.HitRate > trace.InfiniteCacheHitRate(recs) {
		t.Errorf("hit rate %.3f outside (0, ceiling]", s.HitRate)
	}
}

// BenchmarkVirtualMooncake replays the first 2,000 Mooncake requests on 16
// engines with the prefix policy (one op = one whole run).
func BenchmarkVirtualMooncake(b *testing.B) {
	recs, err := trace.LoadMooncake(mooncakePath)
	if err != nil {
		b.Fatal(err)
	}
	recs = recs[:2000]
	for b.Loop() {
		if _, err := Replay(context.Background(), ReplayOptions{Engines: 16, Records: recs, Seed: 1}); err != nil {
			b.Fatal(err)
		}
	}
}

// mooncakePath is the Mooncake conversation trace in the repository.
const mooncakePath = "../data/mooncake_conversation_trace.jsonl"
