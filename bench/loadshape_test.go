package bench

import (
	"bytes"
	"context"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/report"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
	"github.com/infergate/infergate/virtual"
)

func TestRetime(t *testing.T) {
	recs := make([]trace.Record, 20000)
	for i := range recs {
		recs[i] = trace.Record{Timestamp: time.Hour, InputLength: i + 1, OutputLength: i % 7, HashIDs: []int64{int64(i)}}
	}
	for _, rate := range []float64{0.5, 4, 100} {
		a, err := Retime(recs, rate, 1)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := Retime(recs, rate, 1)
		if !slices.EqualFunc(a, b, func(x, y trace.Record) bool { return x.Timestamp == y.Timestamp }) {
			t.Errorf("rate %v: same seed, different arrivals", rate)
		}
		if a[0].Timestamp != 0 {
			t.Errorf("rate %v: first arrival %v, want 0", rate, a[0].Timestamp)
		}
		for i := range a {
			if a[i].InputLength != recs[i].InputLength || a[i].OutputLength != recs[i].OutputLength || a[i].HashIDs[0] != recs[i].HashIDs[0] {
				t.Fatalf("rate %v: record %d changed content or order", rate, i)
			}
			if i > 0 && a[i].Timestamp < a[i-1].Timestamp {
				t.Fatalf("rate %v: arrivals out of order at %d", rate, i)
			}
		}
		mean := a[len(a)-1].Timestamp.Seconds() / float64(len(a)-1)
		if math.Abs(mean*rate-1) > 0.03 {
			t.Errorf("rate %v: mean inter-arrival %.4gs, want ≈ %.4gs", rate, mean, 1/rate)
		}
	}
	if recs[5].Timestamp != time.Hour {
		t.Error("Retime modified its input")
	}
	c, _ := Retime(recs, 4, 2)
	if c[10].Timestamp == 0 || slices.EqualFunc(c[:10], recs[:10], func(x, y trace.Record) bool { return x.Timestamp == y.Timestamp }) {
		t.Error("seed 2 did not re-time")
	}
	for _, bad := range []float64{0, -1, math.Inf(1), math.NaN()} {
		if _, err := Retime(recs, bad, 1); err == nil {
			t.Errorf("rate %v accepted", bad)
		}
	}
}

// countingHandler tracks the most requests in flight at once.
type countingHandler struct {
	h           http.Handler
	active, max atomic.Int64
}

func (c *countingHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := c.active.Add(1)
	defer c.active.Add(-1)
	for m := c.max.Load(); n > m && !c.max.CompareAndSwap(m, n); m = c.max.Load() {
	}
	c.h.ServeHTTP(w, r)
}

func TestReplayClosedLoop(t *testing.T) {
	h := &countingHandler{h: &fakeEngine{firstDelay: 20 * time.Millisecond, tokenDelay: time.Millisecond}}
	srv := httptest.NewServer(h)
	defer srv.Close()
	var recs []trace.Record
	for i := range 9 {
		// Timestamps an hour apart: a closed loop ignores them.
		recs = append(recs, trace.Record{Timestamp: time.Duration(i) * time.Hour, InputLength: 600, OutputLength: 2, HashIDs: []int64{int64(i), 1}})
	}
	var out bytes.Buffer
	got, err := Replay(context.Background(), ReplayOptions{
		Target: srv.URL, Model: "m", Records: recs, APIKey: "k",
		Concurrency: 3, Warmup: measure.Warmup{Requests: 3}, Output: &out,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 9 || h.max.Load() > 3 || h.max.Load() < 2 {
		t.Fatalf("%d records, at most %d in flight; want 9, ≤ 3", len(got), h.max.Load())
	}
	warm := 0
	for i, r := range got {
		if r.Error != "" || r.Index != i {
			t.Errorf("record %d: %+v", i, r)
		}
		if r.Warmup {
			warm++
		}
	}
	if warm != 3 || strings.Count(out.String(), `"warmup":true`) != 3 {
		t.Errorf("%d warm-up records, %d in the output; want 3", warm, strings.Count(out.String(), `"warmup":true`))
	}
	if s := measure.Summarize("c", got); s.Requests != 6 || s.WarmupRequests != 3 {
		t.Errorf("summary: %d measured, %d warm-up", s.Requests, s.WarmupRequests)
	}
}

func TestReplaySessions(t *testing.T) {
	h := &countingHandler{h: &fakeEngine{firstDelay: 10 * time.Millisecond, tokenDelay: time.Millisecond}}
	srv := httptest.NewServer(h)
	defer srv.Close()
	const think = 30 * time.Millisecond
	var sessions []trace.Session
	for s := range 3 {
		var turns []trace.Record
		for k := range 3 {
			turns = append(turns, trace.Record{InputLength: 600 + k, OutputLength: 2, HashIDs: []int64{int64(s), int64(k)}})
		}
		sessions = append(sessions, trace.Session{Start: 0, ThinkTime: think, Turns: turns})
	}
	got, err := Replay(context.Background(), ReplayOptions{
		Target: srv.URL, Model: "m", Sessions: sessions, Concurrency: 1, APIKey: "k",
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 9 || h.max.Load() != 1 {
		t.Fatalf("%d records, %d in flight at most; want 9, 1", len(got), h.max.Load())
	}
	thinkMs := float64(think) / float64(time.Millisecond)
	for i := 1; i < len(got); i++ {
		prev, r := got[i-1], got[i]
		if r.Error != "" || r.Index != i {
			t.Fatalf("record %d: %+v", i, r)
		}
		end := prev.ArrivalMs + prev.E2EMs
		if i%3 != 0 {
			end += thinkMs // the next turn of the same session
		}
		if r.ArrivalMs < end-1 { // 1 ms slack for clock reads
			t.Errorf("turn %d sent at %.1f ms, before %.1f ms", i, r.ArrivalMs, end)
		}
	}
	// Unbounded: all three sessions at once, still turn after turn.
	h.max.Store(0)
	got, err = Replay(context.Background(), ReplayOptions{Target: srv.URL, Model: "m", Sessions: sessions, APIKey: "k", Requests: 7})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 7 || h.max.Load() < 2 || h.max.Load() > 3 {
		t.Errorf("%d records, %d in flight at most; want 7, 2..3", len(got), h.max.Load())
	}
}

func TestVirtualRateSweep(t *testing.T) {
	var recs []trace.Record
	for i := range 60 {
		recs = append(recs, trace.Record{InputLength: 1100, OutputLength: 16, HashIDs: []int64{0, int64(1 + i%4), int64(10 + i)}})
	}
	var rep report.Report
	for _, rate := range []float64{1, 50} {
		rt, err := Retime(recs, rate, 1)
		if err != nil {
			t.Fatal(err)
		}
		run, err := virtual.Replay(context.Background(), virtual.ReplayOptions{Policy: sched.Prefix, Engines: 2,
			Engine: sim.Config{Profile: sim.Llama8BH100()}, Records: rt, Seed: 1, RateRPS: rate, Warmup: measure.Warmup{Requests: 10}})
		if err != nil {
			t.Fatal(err)
		}
		if s := run.Summary; s.Requests != 50 || s.WarmupRequests != 10 || s.Errors != 0 || s.RateRPS != rate {
			t.Fatalf("rate %v: %+v", rate, s)
		}
		rep.Runs = append(rep.Runs, run.Summary)
	}
	// More load, longer queues: TTFT grows with the rate.
	if lo, hi := rep.Runs[0].TTFT.P90, rep.Runs[1].TTFT.P90; !(hi > lo) {
		t.Errorf("TTFT p90 %.1f ms at 50 req/s, not above %.1f ms at 1 req/s", hi, lo)
	}
	var tab bytes.Buffer
	if err := rep.WriteTable(&tab); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(tab.String(), "\n")
	if !strings.Contains(lines[0], "rate") || !strings.Contains(lines[2], " 50 ") {
		t.Errorf("table:\n%s", tab.String())
	}
}

func TestSpread(t *testing.T) {
	var recs []trace.Record
	for i := range 100 {
		recs = append(recs, trace.Record{Timestamp: time.Duration(i/10) * time.Second, InputLength: i})
	}
	out, err := Spread(recs, time.Second, 1)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[time.Duration]bool{}
	for i, r := range out {
		if i > 0 && r.Timestamp < out[i-1].Timestamp {
			t.Fatalf("out of order at %d", i)
		}
		orig := time.Duration(r.InputLength/10) * time.Second
		if r.Timestamp < orig || r.Timestamp >= orig+time.Second {
			t.Fatalf("record %d moved to %v, outside [%v, +1s)", r.InputLength, r.Timestamp, orig)
		}
		seen[r.Timestamp] = true
	}
	if len(seen) != 100 || recs[5].Timestamp != 0 {
		t.Fatalf("%d distinct arrivals; input modified: %v", len(seen), recs[5].Timestamp != 0)
	}
	if _, err := Spread(recs, 0, 1); err == nil {
		t.Fatal("spread 0 accepted")
	}
}
