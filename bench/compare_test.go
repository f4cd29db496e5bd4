package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/report"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
	"github.com/infergate/infergate/virtual"
)

const mooncakePath = "../data/mooncake_conversation_trace.jsonl"

// The end-to-end comparison replays the first e2eRequests Mooncake requests
// (102 s of trace) at e2eSpeedup, about 8.5 s of wall time per policy plus
// the tail: some 25 s in all under -race on two cores, a pace the host keeps
// up with (a saturated host makes the simulated engines lag, queues grow and
// the prefix policy starts trading affinity for load).
const (
	e2eRequests = 300
	e2eSpeedup  = 12
	// e2eKVBlocks (16-token blocks, 4.2M tokens) per engine holds the whole
	// window (4.3M prompt tokens across the fleet), as a pooled KV store like
	// Mooncake's would: hit rates then measure routing, not eviction. With
	// the profile's own capacity (~440k tokens per engine) blocks live about
	// 40 s at this load, shorter than most turn gaps of the trace.
	e2eKVBlocks = 1 << 18
)

// compareMooncake runs the end-to-end comparison: the first e2eRequests
// Mooncake requests through four simulated engines behind the gateway,
// once with prefix-aware routing and once round-robin, in real time. It
// checks what the host's speed cannot change — every request recorded,
// records for all, plausible measurements, cached tokens within the trace's
// ceiling, lags measured, no goroutine left — and returns the report and
// the per-request records. A run that fell behind its time scale
// (measure.Summary.Behind) may time requests out: its errors are logged,
// not judged.
func compareMooncake(t *testing.T) (report.Report, []trace.Record, []byte) {
	t.Helper()
	recs := mooncakeWindow(t)
	ceiling := trace.InfiniteCacheHitRate(recs)
	goroutines := liveGoroutines()

	var out, prog bytes.Buffer
	start := time.Now()
	rep, err := Compare(context.Background(), CompareOptions{
		Policies: []string{sched.Prefix, sched.RoundRobin},
		Engines:  4,
		Engine:   e2eEngine(),
		Records:  recs,
		Speedup:  e2eSpeedup,
		Seed:     1,
		Progress: &prog,
		Output:   &out,
	})
	if err != nil {
		t.Fatal(err)
	}
	var table bytes.Buffer
	_ = rep.WriteTable(&table)
	t.Logf("%d requests in %v wall; reuse ceiling %.1f%%\n%s%s", len(recs),
		time.Since(start).Round(time.Millisecond), 100*ceiling, prog.String(), table.String())

	if len(rep.Runs) != 2 {
		t.Fatalf("%d runs, want 2", len(rep.Runs))
	}
	px, rr := rep.Runs[0], rep.Runs[1]
	if px.Policy != sched.Prefix || rr.Policy != sched.RoundRobin {
		t.Fatalf("runs %q, %q", px.Policy, rr.Policy)
	}
	for _, s := range rep.Runs {
		switch {
		case s.Requests != e2eRequests:
			t.Errorf("%s: %d requests, want %d", s.Policy, s.Requests, e2eRequests)
		case s.Errors != 0 && s.Behind:
			// A fleet that fell behind its time scale runs its requests
			// past the wall-clock timeouts (a CI host at load 25 ran
			// this 8.5 s replay in 260 s, fleet lag p99 48 min of
			// engine time): reported, as the lag is, not judged.
			t.Logf("%s: %d errors on a host that fell behind its time scale (not judged); first: %s", s.Policy, s.Errors, s.FirstError)
		case s.Errors != 0:
			t.Errorf("%s: %d errors, want 0; first: %s", s.Policy, s.Errors, s.FirstError)
		}
		if u := s.MeanEngineUtilization; u == nil || *u <= 0 || *u > 1 {
			t.Errorf("%s: utilisation %v, want in (0, 1]", s.Policy, u)
		}
		if s.TTFT.P50 <= 0 || s.E2E.P50 < s.TTFT.P50 || s.OutputTokPerS <= 0 || s.PromptTokens == 0 {
			t.Errorf("%s: implausible measurements %+v", s.Policy, s)
		}
		// 16-token engine blocks can reuse a cut last 512-token block
		// too, so the engines may report slightly more than the
		// 512-token ceiling.
		if s.HitRate > ceiling+0.01 {
			t.Errorf("%s: hit rate %.4f above the trace's ceiling %.4f: cached tokens miscounted?", s.Policy, s.HitRate, ceiling)
		}
		// The lags are measured, and the run judged against the default
		// margin; whether it kept up is the host's business.
		if s.FleetLag == nil || s.FleetLag.Samples == 0 || s.SendLag == nil || s.SendLag.Samples != e2eRequests || s.MaxLagMs != float64(measure.DefaultMaxLag/time.Millisecond) {
			t.Errorf("%s: lag not measured: fleet %+v, client %+v, margin %v ms", s.Policy, s.FleetLag, s.SendLag, s.MaxLagMs)
		}
	}
	if n := strings.Count(out.String(), "\n"); n != 2*e2eRequests {
		t.Errorf("%d per-request records, want %d", n, 2*e2eRequests)
	}
	checkGoroutines(t, goroutines)
	return rep, recs, out.Bytes()
}

// mooncakeWindow is the first e2eRequests records of the Mooncake trace.
func mooncakeWindow(t *testing.T) []trace.Record {
	t.Helper()
	recs, err := trace.LoadMooncake(mooncakePath)
	if err != nil {
		t.Fatal(err)
	}
	return recs[:e2eRequests]
}

// e2eEngine is the engine of the end-to-end comparison: Llama-3.1-8B on
// one H100 with e2eKVBlocks of KV cache.
func e2eEngine() sim.Config {
	return sim.Config{Profile: sim.Llama8BH100(), NumBlocks: e2eKVBlocks}
}

// TestCompareMooncake is the end-to-end check of the real-time path (see
// compareMooncake). Whether prefix routing beats round-robin there depends
// on the host keeping up with the time scale (a saturated host makes the
// engines lag, queues grow and the prefix policy trades affinity for load):
// TestCompareMooncakeVirtual asserts it on the same requests in virtual
// time, TestTwinCompareMooncake (-tags twin) in real time when the fleet
// kept up.
func TestCompareMooncake(t *testing.T) {
	if testing.Short() {
		t.Skip("end-to-end replay; skipped with -short")
	}
	compareMooncake(t)
}

// TestCompareMooncakeVirtual is the routing check of the end-to-end
// comparison, on the same requests, engines and seed in virtual time
// (deterministic: no wall clock).
//
// The first 300 requests are a cold start: they can reuse only 8.1% of their
// prompt tokens (trace.InfiniteCacheHitRate), 3.8 points of it the system
// prompt every request begins with, which round-robin hits as well; the rest
// is 21 conversation continuations, a few of 13-20k tokens dominating the
// token-weighted rate. Whether round-robin sends a continuation where its
// previous turn went depends on the order in which requests sharing a
// 1-second trace timestamp arrive (round-robin measured 3.8-6.2% in real
// time, 5.8% in exact trace order, up to 6.7% in shuffled orders), and the
// prefix policy rightly sends a continuation elsewhere when its engine is
// overloaded (prefix measured 6.8-8.1%). A fixed ratio of hit rates, such as
// 1.5x, is therefore not robust on this window. The test asserts what is:
// prefix routing beats round-robin's hit rate, computes fewer prefill
// tokens and serves at least 2/3 of the continuations and 1.5x as many as
// round-robin from cache (19-21 against round-robin's 1-10 measured in real
// time; in a model with shuffled arrivals and 10% load diversions either
// check fails in about 1 run of 1000).
func TestCompareMooncakeVirtual(t *testing.T) {
	recs := mooncakeWindow(t)
	ceiling := trace.InfiniteCacheHitRate(recs)
	runs := map[string]virtual.ReplayResult{}
	hits := map[string]int{}
	for _, p := range []string{sched.Prefix, sched.RoundRobin} {
		run, err := virtual.Replay(context.Background(), virtual.ReplayOptions{Policy: p, Engines: 4, Engine: e2eEngine(), Records: recs, Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		if s := run.Summary; s.Requests != e2eRequests || s.Errors != 0 || s.HitRate > ceiling+0.01 {
			t.Errorf("%s: %d requests, %d errors, hit rate %.4f (ceiling %.4f)", p, s.Requests, s.Errors, s.HitRate, ceiling)
		}
		runs[p], hits[p] = run, countContinuationHits(run.Records)
	}
	px, rr := runs[sched.Prefix].Summary, runs[sched.RoundRobin].Summary
	possible := continuations(recs)
	t.Logf("hit rate prefix %.1f%%, round-robin %.1f%% (ceiling %.1f%%); continuations served from cache: prefix %d, round-robin %d, of %d",
		100*px.HitRate, 100*rr.HitRate, 100*ceiling, hits[sched.Prefix], hits[sched.RoundRobin], possible)
	checkRouting(t, px, rr, hits[sched.Prefix], hits[sched.RoundRobin], possible)
}

// checkRouting asserts the end-to-end comparison's routing claims (see
// TestCompareMooncakeVirtual): prefix's hit rate above round-robin's, fewer
// prefill tokens computed, and at least 2/3 of the possible continuations
// and 1.5x round-robin's served from cache.
func checkRouting(t *testing.T, px, rr measure.Summary, pxHits, rrHits, possible int) {
	t.Helper()
	if px.HitRate <= rr.HitRate {
		t.Errorf("prefix hit rate %.4f is not above round-robin's %.4f", px.HitRate, rr.HitRate)
	}
	if 3*pxHits < 2*possible || 2*pxHits < 3*rrHits {
		t.Errorf("continuations served from cache: prefix %d, round-robin %d, of %d; want prefix >= 2/3 of them and >= 1.5 x round-robin",
			pxHits, rrHits, possible)
	}
	if px.PrefillTokensComputed >= rr.PrefillTokensComputed {
		t.Errorf("prefix computed %d prefill tokens, round-robin %d", px.PrefillTokensComputed, rr.PrefillTokensComputed)
	}
}

// checkGoroutines fails t if more goroutines run than before, once those
// that are ending have had up to 10 s to go. A closed zmq4 PUB socket can
// leave its writer goroutine waiting forever (go-zeromq/zmq4 v0.17.0
// pub.go pubMWriter.run checks closed only after a wake-up that Close's
// Signal may precede); those are not ours and are not counted.
func checkGoroutines(t *testing.T, before int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for liveGoroutines() > before && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := liveGoroutines(); n > before {
		buf := make([]byte, 1<<20)
		t.Errorf("%d goroutines after Compare, %d before:\n%s", n, before, buf[:runtime.Stack(buf, true)])
	}
}

// liveGoroutines counts goroutines, less zmq4's leaked PUB writers.
func liveGoroutines() int {
	buf := make([]byte, 4<<20)
	stacks := string(buf[:runtime.Stack(buf, true)])
	return runtime.NumGoroutine() - strings.Count(stacks, "zmq4.(*pubMWriter).run")
}

func TestCompareOptionErrors(t *testing.T) {
	recs := []trace.Record{{InputLength: 1, OutputLength: 1, HashIDs: []int64{0}}}
	if _, err := Compare(context.Background(), CompareOptions{Records: recs, Speedup: -1}); err == nil {
		t.Error("negative speedup: want an error")
	}
	if _, err := Compare(context.Background(), CompareOptions{Records: recs, Engines: -2}); err == nil {
		t.Error("negative engines: want an error")
	}
	rep, err := Compare(context.Background(), CompareOptions{Records: recs, Engines: 1, Policies: []string{"no-such-policy"}, Speedup: 100})
	if err == nil || !strings.Contains(err.Error(), "no-such-policy") || len(rep.Runs) != 0 {
		t.Errorf("unknown policy: %v, %+v", err, rep)
	}
}

// continuations counts the records that can reuse more than the shared
// system-prompt block: their second block id appeared in an earlier record.
func continuations(recs []trace.Record) int {
	seen := map[int64]bool{}
	n := 0
	for _, r := range recs {
		if len(r.HashIDs) > 1 && seen[r.HashIDs[1]] {
			n++
		}
		for _, id := range r.HashIDs {
			seen[id] = true
		}
	}
	return n
}

// continuationHits counts, per policy, the successful requests of a JSONL
// record stream whose cached tokens go beyond the shared 512-token
// system-prompt block.
func continuationHits(t *testing.T, jsonl []byte) map[string]int {
	t.Helper()
	byPolicy := map[string][]measure.Record{}
	dec := json.NewDecoder(bytes.NewReader(jsonl))
	for dec.More() {
		var r measure.Record
		if err := dec.Decode(&r); err != nil {
			t.Fatalf("per-request records: %v", err)
		}
		byPolicy[r.Policy] = append(byPolicy[r.Policy], r)
	}
	hits := map[string]int{}
	for p, recs := range byPolicy {
		hits[p] = countContinuationHits(recs)
	}
	return hits
}

// countContinuationHits counts the successful records whose cached tokens
// go beyond the shared 512-token system-prompt block.
func countContinuationHits(recs []measure.Record) int {
	n := 0
	for _, r := range recs {
		if r.Error == "" && r.CachedTokens > trace.MooncakeBlockTokens {
			n++
		}
	}
	return n
}

// TestCompareSmall runs the whole Compare path on a tiny synthetic trace:
// two policies, two engines, requests that share prefixes. Requests are 1 s
// of trace (100 ms of wall time) apart, so that a request reaches its
// engine after the earlier one it shares blocks with even when the host
// delays a goroutine by tens of milliseconds.
func TestCompareSmall(t *testing.T) {
	var recs []trace.Record
	for i := range 8 {
		recs = append(recs, trace.Record{
			Timestamp:    time.Duration(i) * time.Second,
			InputLength:  1100,
			OutputLength: 3,
			HashIDs:      []int64{0, int64(1 + i%2), int64(10 + i)},
		})
	}
	goroutines := liveGoroutines()
	var out bytes.Buffer
	rep, err := Compare(context.Background(), CompareOptions{
		Policies: []string{sched.Prefix, sched.RoundRobin},
		Engines:  2,
		Engine:   sim.Config{Profile: sim.Llama8BH100()},
		Records:  recs,
		Requests: 6,
		Speedup:  10,
		Model:    "m",
		Output:   &out,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 2 || rep.Runs[0].Policy != sched.Prefix || rep.Runs[1].Policy != sched.RoundRobin {
		t.Fatalf("runs %+v", rep.Runs)
	}
	for _, s := range rep.Runs {
		if s.Requests != 6 || s.Errors != 0 || s.OutputTokens != 18 || s.PromptTokens != 6*1100 || s.MeanEngineUtilization == nil {
			t.Errorf("%s: %+v", s.Policy, s)
		}
		// Every step and every send is timed against the schedule.
		if s.FleetLag == nil || s.FleetLag.Samples < 6 || s.SendLag == nil || s.SendLag.Samples != 6 || s.MaxLagMs != float64(measure.DefaultMaxLag/time.Millisecond) {
			t.Errorf("%s: lags fleet %+v, client %+v, margin %v ms", s.Policy, s.FleetLag, s.SendLag, s.MaxLagMs)
		}
	}
	// Every request after the first two shares 1024 tokens with an earlier
	// one; prefix routing finds them all.
	if px := rep.Runs[0]; px.CachedTokens < 4*1024 {
		t.Errorf("prefix cached %d tokens, want >= %d", px.CachedTokens, 4*1024)
	}
	if n := strings.Count(out.String(), "\n"); n != 12 {
		t.Errorf("%d per-request records, want 12", n)
	}
	// Each record names the engine that served it (the gateway's
	// X-Infergate-Endpoint); round-robin spreads them over both.
	served := map[string]map[string]int{}
	for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		var r measure.Record
		if err := json.Unmarshal([]byte(l), &r); err != nil || !strings.HasPrefix(r.Endpoint, "http://127.0.0.1:") {
			t.Fatalf("record %s: endpoint %q (%v)", l, r.Endpoint, err)
		}
		if served[r.Policy] == nil {
			served[r.Policy] = map[string]int{}
		}
		served[r.Policy][r.Endpoint]++
	}
	if rr := served[sched.RoundRobin]; len(rr) != 2 {
		t.Errorf("round-robin records name %v, want both engines", rr)
	}
	checkGoroutines(t, goroutines)
}
