//go:build twin

package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/report"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
	"github.com/infergate/infergate/virtual"
)

// conversationTrace synthesizes a multi-turn trace in Mooncake's form:
// convs conversations of turns turns each, every prompt opening with a
// shared one-block system prompt (hash id 0); each turn repeats the previous
// turn's blocks and adds 1-3 new ones (the reply and the next message), the
// first turn has 3-10 blocks of its own. Conversations start in the first
// 30 s and turns follow 4-12 s apart; arrivals are then spread to be at
// least minGap apart, so that their order is unambiguous on the wire.
func conversationTrace(convs, turns int, minGap time.Duration, seed uint64) []trace.Record {
	rng := rand.New(rand.NewPCG(seed, 2))
	next := int64(1)
	var recs []trace.Record
	for range convs {
		ids := []int64{0}
		for range 3 + rng.IntN(8) {
			ids = append(ids, next)
			next++
		}
		at := time.Duration(rng.IntN(30_000)) * time.Millisecond
		for turn := range turns {
			if turn > 0 {
				at += time.Duration(4000+rng.IntN(8000)) * time.Millisecond
				for range 1 + rng.IntN(3) {
					ids = append(ids, next)
					next++
				}
			}
			recs = append(recs, trace.Record{
				Timestamp:    at,
				InputLength:  len(ids)*trace.MooncakeBlockTokens - rng.IntN(trace.MooncakeBlockTokens),
				OutputLength: 16 + rng.IntN(33),
				HashIDs:      slices.Clone(ids),
			})
		}
	}
	slices.SortStableFunc(recs, func(a, b trace.Record) int { return int(a.Timestamp - b.Timestamp) })
	for i := 1; i < len(recs); i++ {
		recs[i].Timestamp = max(recs[i].Timestamp, recs[i-1].Timestamp+minGap)
	}
	return recs
}

// Twin run settings: 24 conversations × 5 turns (120 requests, 0.8M prompt
// tokens, ~85 s of trace) on 4 engines of the default profile (70B on
// 4×H100: a cold 8k-token prefill takes ~1 s, a decode step ~20 ms), about
// a third loaded; the real-time fleet runs twinScale() times faster than
// real time (~9 s of wall time per run; ~18 s under the race detector).
const (
	twinConvs  = 24
	twinTurns  = 5
	twinGap    = 250 * time.Millisecond
	twinEngine = 4
	// twinMaxOffsetWall bounds the real world's wire overhead per request
	// (ms of wall time).
	twinMaxOffsetWall = 30
)

// twinScale is the real-time fleet's time scale: 10, or 5 under the race
// detector, which slows the wire path (JSON of ~50 KB token-id bodies) about
// fivefold: at 10 its jitter, ~10 ms of wall time, would be 100 ms of engine
// time, the per-request tolerance itself.
func twinScale() float64 {
	if raceEnabled {
		return 5
	}
	return 10
}

// twinMaxLag is the lag margin under which a real-time twin run is judged
// (engine time, p99 of the fleet's step lag and of the client's send lag):
// half the per-request TTFT tolerance, so that the lag alone cannot use it
// up. A run past it fell behind its time scale: its fidelity is reported,
// not judged (the test skips, naming the lags).
const twinMaxLag = 50 * time.Millisecond

// requireKeptUp skips t, reporting the run's lags, unless s (a real-time
// run) kept up with its time scale within margin; it logs the lags either
// way.
func requireKeptUp(t *testing.T, s measure.Summary, margin time.Duration) {
	t.Helper()
	s.CheckLag(margin)
	f, c := s.FleetLag, s.SendLag
	if f == nil || c == nil {
		t.Fatalf("%s: no lag measured (fleet %v, client %v)", s.Policy, f, c)
	}
	t.Logf("%s: lag p50/p99/max: fleet steps %.1f/%.1f/%.0f ms, client sends %.1f/%.1f/%.0f ms (engine time; margin %v at p99)",
		s.Policy, f.P50, f.P99, f.Max, c.P50, c.P99, c.Max, margin)
	if s.Behind {
		var w bytes.Buffer
		_, _ = report.Report{Runs: []measure.Summary{s}}.WriteLagWarnings(&w)
		t.Skipf("BEHIND: the real-time run fell behind its time scale, so its fidelity is not judged on this host: %s", w.String())
	}
}

// realRun replays recs through a real-time fleet behind the gateway over
// loopback and returns the per-request records and the run's Summary.
func realRun(t *testing.T, policy string, recs []trace.Record) ([]measure.Record, measure.Summary) {
	t.Helper()
	return realRunWith(t, policy, recs, sim.Config{})
}

// realRunWith is realRun with engines of configuration eng.
func realRunWith(t *testing.T, policy string, recs []trace.Record, eng sim.Config, remote ...sim.TierSize) ([]measure.Record, measure.Summary) {
	t.Helper()
	var out bytes.Buffer
	rep, err := Compare(context.Background(), CompareOptions{
		Policies: []string{policy},
		Engines:  twinEngine,
		Engine:   eng,
		Remote:   first(remote),
		Records:  recs,
		Speedup:  twinScale(),
		Seed:     1,
		Output:   &out,
	})
	if err != nil {
		t.Fatal(err)
	}
	var got []measure.Record
	sc := bufio.NewScanner(&out)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var r measure.Record
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatal(err)
		}
		got = append(got, r)
	}
	if len(got) != len(recs) || len(rep.Runs) != 1 {
		t.Fatalf("%d records, %d runs from the real-time run, want %d, 1", len(got), len(rep.Runs), len(recs))
	}
	return got, rep.Runs[0]
}

func virtualRun(t *testing.T, policy string, recs []trace.Record) virtual.ReplayResult {
	t.Helper()
	return virtualRunWith(t, policy, recs, sim.Config{})
}

func virtualRunWith(t *testing.T, policy string, recs []trace.Record, eng sim.Config, remote ...sim.TierSize) virtual.ReplayResult {
	t.Helper()
	run, err := virtual.Replay(context.Background(), virtual.ReplayOptions{
		Policy: policy, Engines: twinEngine, Engine: eng, Remote: first(remote), Records: recs, Seed: 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	return run
}

// TestTwinRealVirtual runs the same trace through the real-time world
// (simserver.StartFleet engines behind the real gateway, bench.Replay over
// loopback, time scale 10; 5 under the race detector) and through
// virtual.Fleet, and checks that the two agree.
//
// The real client measures TTFT from sending the request, so real TTFTs carry
// the wire overhead (HTTP and JSON decoding in the gateway and the engine) times the time scale; the virtual world has none. The offset is
// estimated as the median real−virtual TTFT difference under round-robin and
// must be under 30 ms of wall time (measured ~2 ms without and ~10 ms with
// the race detector on a loaded 2-core host).
//
// Round-robin, where routing is identical in both worlds (arrivals are at
// least 250 ms apart, 25-50 ms of wall time, so they reach the gateway in trace
// order): per request, |real − offset − virtual| must be within
// max(15%, 100 ms) of the virtual TTFT for at least 90% of requests (120/120
// measured, with and without the race detector; max |Δ| 45-64 ms), and within 1.2 s
// for all: a request that reaches a real engine a few milliseconds late can
// miss the start of a step and wait for the whole step, which may be a long
// prefill (a cold 8k-token chunk takes ~1.05 s). Prompt, cached and output
// tokens must agree exactly.
//
// Prefix: in-flight counts can legitimately differ at a decision (a request
// finishing around another's arrival), so routing may differ; the runs must
// agree in aggregate: hit rate within 2 points, TTFT p50 and p90 (real minus
// the offset) within max(20%, 100 ms).
//
// Wall-clock fidelity depends on the host keeping up, so this test runs
// only with -tags twin (.ci/run runs it as its own step, without the race
// detector) and judges a real-time run only if it kept up with its time
// scale (twinMaxLag); otherwise it skips and reports the lags. Token counts
// and errors are checked either way.
func TestTwinRealVirtual(t *testing.T) {
	if testing.Short() {
		t.Skip("real-time replays; skipped with -short")
	}
	recs := conversationTrace(twinConvs, twinTurns, twinGap, 1)

	real, realSum := realRun(t, sched.RoundRobin, recs)
	virt := virtualRun(t, sched.RoundRobin, recs)
	deltas := make([]float64, len(recs))
	for i := range recs {
		r, v := real[i], virt.Records[i]
		if r.Error != "" || v.Error != "" {
			t.Fatalf("request %d: real error %q, virtual error %q", i, r.Error, v.Error)
		}
		deltas[i] = r.TTFTMs - v.TTFTMs
	}
	requireKeptUp(t, realSum, twinMaxLag)
	sorted := slices.Sorted(slices.Values(deltas))
	offset := measure.Percentile(sorted, 50)
	var (
		within, tokMismatch int
		maxAbs, sumAbs      float64
	)
	for i := range recs {
		r, v := real[i], virt.Records[i]
		d := math.Abs(deltas[i] - offset)
		maxAbs = max(maxAbs, d)
		sumAbs += d
		if d <= max(0.15*v.TTFTMs, 100) {
			within++
		}
		if d > 1200 {
			t.Errorf("request %d: real TTFT %.0f ms (offset %.0f), virtual %.0f ms", i, r.TTFTMs, offset, v.TTFTMs)
		}
		if r.CachedTokens != v.CachedTokens || r.PromptTokens != v.PromptTokens || r.OutputTokens != v.OutputTokens {
			tokMismatch++
		}
	}
	if tokMismatch > 0 {
		t.Errorf("%d requests differ in prompt, cached or output tokens", tokMismatch)
	}
	rs, vs := measure.Summarize("real", real), virt.Summary
	t.Logf("round-robin: TTFT real−virtual ms: p1 %.0f p50 (offset) %.0f p99 %.0f; after the offset mean |Δ| %.1f, max |Δ| %.0f; %d/%d within max(15%%, 100 ms)",
		sorted[0], offset, measure.Percentile(sorted, 99), sumAbs/float64(len(recs)), maxAbs, within, len(recs))
	t.Logf("round-robin: hit rate real %.1f%% virtual %.1f%%; TTFT p50/p90 real %.0f/%.0f virtual %.0f/%.0f ms; ITL p50 real %.1f virtual %.1f ms",
		rs.HitRate*100, vs.HitRate*100, rs.TTFT.P50, rs.TTFT.P90, vs.TTFT.P50, vs.TTFT.P90, rs.ITL.P50, vs.ITL.P50)
	if maxOffset := twinMaxOffsetWall * twinScale(); offset < 0 || offset > maxOffset {
		t.Errorf("real−virtual TTFT offset %.0f ms, want within [0, %v] ms", offset, maxOffset)
	}
	if within < len(recs)*9/10 {
		t.Errorf("only %d of %d TTFTs within max(15%%, 100 ms)", within, len(recs))
	}

	real, realSum = realRun(t, sched.Prefix, recs)
	virt = virtualRun(t, sched.Prefix, recs)
	rs, vs = measure.Summarize("real", real), virt.Summary
	if rs.Errors+vs.Errors > 0 {
		t.Fatalf("errors: real %q, virtual %q", rs.FirstError, vs.FirstError)
	}
	requireKeptUp(t, realSum, twinMaxLag)
	t.Logf("prefix: hit rate real %.1f%% virtual %.1f%%; TTFT p50/p90/p99 real %.0f/%.0f/%.0f virtual %.0f/%.0f/%.0f ms",
		rs.HitRate*100, vs.HitRate*100, rs.TTFT.P50, rs.TTFT.P90, rs.TTFT.P99, vs.TTFT.P50, vs.TTFT.P90, vs.TTFT.P99)
	if math.Abs(rs.HitRate-vs.HitRate) > 0.02 {
		t.Errorf("prefix hit rate: real %.1f%%, virtual %.1f%%", rs.HitRate*100, vs.HitRate*100)
	}
	for _, q := range []struct {
		name string
		r, v float64
	}{{"p50", rs.TTFT.P50 - offset, vs.TTFT.P50}, {"p90", rs.TTFT.P90 - offset, vs.TTFT.P90}} {
		if math.Abs(q.r-q.v) > max(0.2*q.v, 100) {
			t.Errorf("prefix TTFT %s: real %.0f ms (less the offset), virtual %.0f ms", q.name, q.r, q.v)
		}
	}
}

// TestTwinCompareMooncake is the routing check of the end-to-end comparison
// (TestCompareMooncakeVirtual) in real time: the same claims on the
// real-time runs of compareMooncake, judged only when both kept up with
// their time scale (DefaultMaxLag: a lagging fleet grows queues and the
// prefix policy rightly trades affinity for load).
func TestTwinCompareMooncake(t *testing.T) {
	rep, recs, jsonl := compareMooncake(t)
	px, rr := rep.Runs[0], rep.Runs[1]
	hits := continuationHits(t, jsonl)
	possible := continuations(recs)
	t.Logf("continuations served from cache: prefix %d, round-robin %d, of %d", hits[px.Policy], hits[rr.Policy], possible)
	requireKeptUp(t, px, measure.DefaultMaxLag)
	requireKeptUp(t, rr, measure.DefaultMaxLag)
	checkRouting(t, px, rr, hits[px.Policy], hits[rr.Policy], possible)
}

// TestTwinTiers is TestTwinRealVirtual's round-robin check with KV tiers:
// engines whose GPU cache holds about one conversation (so later turns
// load their prefix from the host tier, the request waiting for its load
// while others run, the real-time driver sleeping until the load ends or a
// request arrives) serve the same cached tokens per request in both worlds,
// and their TTFTs agree as TestTwinRealVirtual's do.
func TestTwinTiers(t *testing.T) {
	if testing.Short() {
		t.Skip("real-time replays; skipped with -short")
	}
	recs := conversationTrace(twinConvs, twinTurns, twinGap, 3)
	eng := sim.Config{NumBlocks: 2048} // 32k tokens: a few conversations
	eng.Tiers.Host = sim.TierSize{Multiple: 16}
	real, realSum := realRunWith(t, sched.RoundRobin, recs, eng)
	virt := virtualRunWith(t, sched.RoundRobin, recs, eng)
	var host, deltas []float64
	tokMismatch := 0
	for i := range recs {
		r, v := real[i], virt.Records[i]
		if r.Error != "" || v.Error != "" {
			t.Fatalf("request %d: real error %q, virtual error %q", i, r.Error, v.Error)
		}
		if r.CachedTokens != v.CachedTokens || r.PromptTokens != v.PromptTokens || r.OutputTokens != v.OutputTokens {
			tokMismatch++
		}
		if v.TierTokens != nil {
			host = append(host, float64(v.TierTokens[sim.TierHost]))
		}
		deltas = append(deltas, r.TTFTMs-v.TTFTMs)
	}
	loaded := 0.0
	for _, h := range host {
		loaded += h
	}
	if loaded == 0 {
		t.Fatal("no request loaded from the host tier: the test exercises nothing")
	}
	requireKeptUp(t, realSum, twinMaxLag)
	if tokMismatch > 0 {
		t.Errorf("%d requests differ in prompt, cached or output tokens", tokMismatch)
	}
	sorted := slices.Sorted(slices.Values(deltas))
	offset := measure.Percentile(sorted, 50)
	within := 0
	for i := range recs {
		if d := math.Abs(deltas[i] - offset); d <= max(0.15*virt.Records[i].TTFTMs, 100) {
			within++
		}
	}
	t.Logf("tiers, round-robin: %.0f tokens loaded from host memory; TTFT real−virtual p50 (offset) %.0f ms; %d/%d within max(15%%, 100 ms)",
		loaded, offset, within, len(recs))
	if maxOffset := twinMaxOffsetWall * twinScale(); offset < 0 || offset > maxOffset {
		t.Errorf("real−virtual TTFT offset %.0f ms, want within [0, %v] ms", offset, maxOffset)
	}
	if within < len(recs)*9/10 {
		t.Errorf("only %d of %d TTFTs within max(15%%, 100 ms)", within, len(recs))
	}
}

func first(s []sim.TierSize) sim.TierSize {
	if len(s) == 0 {
		return sim.TierSize{}
	}
	return s[0]
}

// TestTwinTiersRemote is TestTwinTiers with the fleet's shared remote store
// instead of host tiers: round-robin sends a conversation's turns to other
// engines, which load its prefix from the store. The engines of the
// real-time fleet write to the store concurrently, so a request may find a
// block another engine stored a moment earlier or later than in virtual
// time: cached tokens must agree for 90% of the requests, TTFTs as in
// TestTwinTiers.
func TestTwinTiersRemote(t *testing.T) {
	if testing.Short() {
		t.Skip("real-time replays; skipped with -short")
	}
	recs := conversationTrace(twinConvs, twinTurns, twinGap, 4)
	eng := sim.Config{NumBlocks: 2048}
	remote := sim.TierSize{Multiple: 32}
	real, realSum := realRunWith(t, sched.RoundRobin, recs, eng, remote)
	virt := virtualRunWith(t, sched.RoundRobin, recs, eng, remote)
	var deltas []float64
	same, loaded := 0, 0.0
	for i := range recs {
		r, v := real[i], virt.Records[i]
		if r.Error != "" || v.Error != "" {
			t.Fatalf("request %d: real error %q, virtual error %q", i, r.Error, v.Error)
		}
		if r.CachedTokens == v.CachedTokens && r.PromptTokens == v.PromptTokens && r.OutputTokens == v.OutputTokens {
			same++
		}
		if v.TierTokens != nil {
			loaded += float64(v.TierTokens[sim.TierRemote])
		}
		deltas = append(deltas, r.TTFTMs-v.TTFTMs)
	}
	if loaded == 0 {
		t.Fatal("no request loaded from the remote store: the test exercises nothing")
	}
	t.Logf("remote store: %.0f tokens loaded from it in virtual time; %d/%d requests with the same tokens in both worlds", loaded, same, len(recs))
	requireKeptUp(t, realSum, twinMaxLag)
	sorted := slices.Sorted(slices.Values(deltas))
	offset := measure.Percentile(sorted, 50)
	within := 0
	for i := range recs {
		if d := math.Abs(deltas[i] - offset); d <= max(0.15*virt.Records[i].TTFTMs, 100) {
			within++
		}
	}
	t.Logf("remote store, round-robin: TTFT offset %.0f ms; %d/%d within max(15%%, 100 ms)", offset, within, len(recs))
	if same < len(recs)*9/10 {
		t.Errorf("only %d of %d requests agree on prompt, cached and output tokens", same, len(recs))
	}
	if maxOffset := twinMaxOffsetWall * twinScale(); offset < 0 || offset > maxOffset {
		t.Errorf("real−virtual TTFT offset %.0f ms, want within [0, %v] ms", offset, maxOffset)
	}
	if within < len(recs)*9/10 {
		t.Errorf("only %d of %d TTFTs within max(15%%, 100 ms)", within, len(recs))
	}
}
