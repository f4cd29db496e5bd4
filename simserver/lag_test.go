package simserver

import (
	"math"
	"testing"
	"time"
)

// TestLagHistogram: percentiles are the upper edge of their bucket (at
// most 12.5% above the value, never above the maximum), counts and mean
// exact, and pooling adds distributions.
func TestLagHistogram(t *testing.T) {
	var h lagHistogram
	if st := h.stats(); st != (LagStats{}) {
		t.Fatalf("empty: %+v", st)
	}
	// 98 steps on time, one 3 ms late, one 2 s late.
	for range 98 {
		h.observe(0)
	}
	h.observe(3 * time.Millisecond)
	h.observe(2 * time.Second)
	h.observe(-time.Second) // counts as on time
	st := h.stats()
	if st.Steps != 101 || st.Late != 2 || st.P50 != 0 || st.Max != 2*time.Second {
		t.Errorf("stats %+v: want 101 steps, 2 late, p50 0, max 2s", st)
	}
	if st.P99 < 3*time.Millisecond || float64(st.P99) > 1.125*float64(3*time.Millisecond) {
		t.Errorf("p99 %v: want 3ms within its bucket (+12.5%%)", st.P99)
	}
	if want := (2*time.Second + 3*time.Millisecond) / 101; st.Mean != want {
		t.Errorf("mean %v, want %v", st.Mean, want)
	}
	var all lagHistogram
	h.addTo(&all)
	h.addTo(&all)
	if p := all.stats(); p.Steps != 202 || p.Late != 4 || p.Max != 2*time.Second || p.P99 != st.P99 {
		t.Errorf("pooled twice: %+v", p)
	}

	// Every value lands in a bucket whose upper edge is within 12.5% above it.
	for _, v := range []time.Duration{1, 7, 8, 9, 15, 16, 17, 1000, 1023, 1024, 1 << 40, math.MaxInt64} {
		b := lagBucket(v)
		up := lagBucketUpper(b)
		if up < v || float64(up-v) > 0.125*float64(v) {
			t.Errorf("value %d: bucket %d, upper edge %d", v, b, up)
		}
		if b > 0 && lagBucketUpper(b-1) >= v {
			t.Errorf("value %d: bucket %d, but the previous bucket reaches %d", v, b, lagBucketUpper(b-1))
		}
	}
}

// TestServerLagWhenBehind: a server asked to run 10⁹ times faster than the
// hardware it models cannot keep up; every step is delivered late by at
// least the wall time since the driver started, so each lag is at least
// that time × 10⁹ of engine time — whatever the host's load.
func TestServerLagWhenBehind(t *testing.T) {
	s, ts := newTestServer(t, ServerConfig{TimeScale: 1e9})
	if st := s.Lag(); st.Steps != 0 {
		t.Fatalf("before any request: %+v", st)
	}
	events, done := readStream(t, post(t, ts, "/v1/completions", `{"model":"`+testModel+`","prompt":[1,2,3],"stream":true,"max_tokens":5}`))
	if !done || len(events) != 5 {
		t.Fatalf("%d events, done %v", len(events), done)
	}
	st := s.Lag()
	if st.Steps < 5 || st.Late != st.Steps || st.P50 < time.Second || st.P99 < st.P50 || st.Max < st.P99 {
		t.Errorf("lag %+v: want >= 5 steps, every one late by >= 1 s of engine time", st)
	}
	f := &Fleet{Servers: []*Server{s, s}}
	if fl := f.Lag(); fl.Steps != 2*st.Steps || fl.Max != st.Max {
		t.Errorf("fleet of the same server twice: %+v, server %+v", fl, st)
	}
}
