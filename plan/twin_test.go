//go:build twin

package plan

import (
	"bytes"
	"context"
	"math"
	"runtime/debug"
	"testing"
	"time"

	"github.com/infergate/infergate/bench"
	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/report"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/trace"
)

// Twin check settings: one configuration run both ways. The workload is
// trace.SharedPrefix with 8 groups × 24 prompts (192 requests), each an
// 8,192-token shared system prompt plus an 8,192-token question of its own
// and 32 output tokens, Poisson arrivals at 2.5 requests/s (83 s of trace);
// 4 engines of the default profile (70B on 4×H100: the uncached 8k tokens
// take ~1 s to prefill) with the prefix policy, seed 1. The fleet is ~77%
// utilised, so TTFT p50 is ~2.9 s of engine time, mostly queueing and
// prefill: the wire overhead (a few ms of wall time per request, ~10 under
// the race detector) times the time scale is a small fraction of it, and
// nothing is subtracted from the real TTFTs.
const (
	twinGroups   = 8
	twinPerGroup = 24
	twinSysTok   = 8192
	twinQTok     = 8192
	twinOutTok   = 32
	twinRate     = 2.5
	twinEngines  = 4
)

// twinScale is the real-time fleet's time scale: 8 (~11 s of wall time), or
// 3 under the race detector (~30 s), which slows the wire path and the
// gateway several-fold and makes the real fleet lag slightly. Measured
// real−virtual TTFT p50 on a 2-core host: +1.0% at scale 4 and +1.1-1.7% at
// 8 without the race detector; +3.0-3.7% at 3 and +4.2-4.7% at 4 with it.
// Hit rates differ by −0.52 points in every run (47.14% against 47.66%).
func twinScale() float64 {
	if raceBuild() {
		return 3
	}
	return 8
}

// raceBuild reports whether the test binary was built with -race (the
// binary's build settings record it; package plan has no build-tagged
// constant of its own).
func raceBuild() bool {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return false
	}
	for _, s := range bi.Settings {
		if s.Key == "-race" {
			return s.Value == "true"
		}
	}
	return false
}

// TestTwinBenchPlan is the twin check: the same configuration through
// `bench` (bench.Compare: a real-time simulated fleet, simserver.StartFleet, behind
// the real gateway over loopback HTTP, at twinScale) and through `plan`
// (Run with one row — the same engines, policy and seed — which replays it
// in virtual time with virtual.Replay). The two must agree: hit rate
// within 2 percentage points, TTFT p50 within 10% of the virtual p50, and no
// errors on either side.
//
// Wall-clock fidelity depends on the host keeping up, so this test runs
// only with -tags twin (.ci/run runs it as its own step) and judges the
// real-time run only if it kept up with its time scale (p99 fleet step lag
// and client send lag within measure.DefaultMaxLag, 100 ms of engine time, a
// thirtieth of the TTFT p50 compared); otherwise it skips, reporting the
// lags. Errors are checked either way.
func TestTwinBenchPlan(t *testing.T) {
	if testing.Short() {
		t.Skip("real-time replay; skipped with -short")
	}
	recs, err := trace.SharedPrefix(trace.SharedPrefixOptions{
		Groups: twinGroups, PromptsPerGroup: twinPerGroup,
		SystemPromptTokens: twinSysTok, QuestionTokens: twinQTok, OutputTokens: twinOutTok,
		Rate: twinRate, Seed: 1,
	})
	if err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	rep, err := bench.Compare(context.Background(), bench.CompareOptions{
		Policies: []string{sched.Prefix}, Engines: twinEngines, Records: recs,
		Speedup: twinScale(), Seed: 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	realWall := time.Since(start)

	slo, err := ParseSLO("ttft_p90=10s") // any SLO: only the row's summary is compared
	if err != nil {
		t.Fatal(err)
	}
	res, err := Run(context.Background(), Options{
		Records: recs, Engines: []int{twinEngines}, Policies: []string{sched.Prefix},
		SLO: slo, Seed: 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 1 || len(res.Rows) != 1 {
		t.Fatalf("%d bench runs, %d plan rows; want 1 each", len(rep.Runs), len(res.Rows))
	}
	rs, vs := rep.Runs[0], res.Rows[0].Summary

	util := func(u *float64) float64 {
		if u == nil {
			return math.NaN()
		}
		return *u * 100
	}
	t.Logf("%d requests over %v of trace; %d engines, policy %s, time scale %v (race detector %v)",
		len(recs), (recs[len(recs)-1].Timestamp - recs[0].Timestamp).Round(time.Millisecond), twinEngines, sched.Prefix, twinScale(), raceBuild())
	t.Logf("bench (real, wall %.1fs): %d errors, hit rate %.2f%%, TTFT p50/p90 %.0f/%.0f ms, utilisation %.1f%%",
		realWall.Seconds(), rs.Errors, rs.HitRate*100, rs.TTFT.P50, rs.TTFT.P90, util(rs.MeanEngineUtilization))
	t.Logf("plan (virtual, wall %.2fs): %d errors, hit rate %.2f%%, TTFT p50/p90 %.0f/%.0f ms, utilisation %.1f%%",
		res.WallS, vs.Errors, vs.HitRate*100, vs.TTFT.P50, vs.TTFT.P90, util(vs.MeanEngineUtilization))
	t.Logf("real − virtual: hit rate %+.2f points, TTFT p50 %+.1f%%",
		(rs.HitRate-vs.HitRate)*100, (rs.TTFT.P50-vs.TTFT.P50)/vs.TTFT.P50*100)

	if rs.Errors+vs.Errors > 0 {
		t.Fatalf("errors: bench %d (%q), plan %d (%q)", rs.Errors, rs.FirstError, vs.Errors, vs.FirstError)
	}
	if f, c := rs.FleetLag, rs.SendLag; f == nil || c == nil {
		t.Fatalf("bench run without lag measurements: fleet %v, client %v", f, c)
	} else {
		t.Logf("bench lag p50/p99/max: fleet steps %.1f/%.1f/%.0f ms, client sends %.1f/%.1f/%.0f ms (engine time; margin %v at p99)",
			f.P50, f.P99, f.Max, c.P50, c.P99, c.Max, measure.DefaultMaxLag)
	}
	if rs.Behind {
		var w bytes.Buffer
		_, _ = report.Report{Runs: []measure.Summary{rs}}.WriteLagWarnings(&w)
		t.Skipf("BEHIND: the real-time run fell behind its time scale, so its fidelity is not judged on this host: %s", w.String())
	}
	if math.Abs(rs.HitRate-vs.HitRate) > 0.02 {
		t.Errorf("hit rate: bench %.2f%%, plan %.2f%%: more than 2 points apart", rs.HitRate*100, vs.HitRate*100)
	}
	if math.Abs(rs.TTFT.P50-vs.TTFT.P50) > 0.10*vs.TTFT.P50 {
		t.Errorf("TTFT p50: bench %.0f ms, plan %.0f ms: more than 10%% apart", rs.TTFT.P50, vs.TTFT.P50)
	}
}
