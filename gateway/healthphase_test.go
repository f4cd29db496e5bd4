package gateway

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
)

// TestHealthProbesSpread runs the health loops' schedule (probeWait, what
// healthLoop waits after each probe) for 1,000 endpoints started at one
// instant, on a virtual clock, for 10 intervals of 5 s, each probe taking
// between 0 and 1.9 s: every endpoint is probed exactly once per interval,
// its probes exactly one interval apart (the first within one), and no
// 5 ms window holds more than 7 probes, where one timer per endpoint
// started together probed all 1,000 in the same instant every interval.
func TestHealthProbesSpread(t *testing.T) {
	const n, interval = 1000, 5 * time.Second
	g := &Gateway{cfg: Config{HealthCheckInterval: interval}, phaseSeed: 0xcbf29ce484222325}
	start := time.Unix(1_765_000_000, 123_456_789)
	end := start.Add(10 * interval)
	windows := map[int64]int{}
	for i := range n {
		ep, err := newEndpoint(fmt.Sprintf("http://10.%d.%d.%d:8000", i>>16&255, i>>8&255, i&255))
		if err != nil {
			t.Fatal(err)
		}
		off := g.probePhase(ep)
		at := start.Add(g.probeWait(ep, start, time.Time{}, off))
		if d := at.Sub(start); d <= 0 || d > interval {
			t.Fatalf("%s: first probe %v after the loop's start, want within (0, %v]", ep.name, d, interval)
		}
		probes := 0
		var prev time.Time
		for ; at.Before(end); probes++ {
			if !prev.IsZero() && at.Sub(prev) != interval {
				t.Fatalf("%s: probes %v apart, want %v", ep.name, at.Sub(prev), interval)
			}
			windows[at.Sub(start).Milliseconds()/5]++
			took := time.Duration(i%20) * 100 * time.Millisecond // what the probe took
			prev, at = at, at.Add(took+g.probeWait(ep, at.Add(took), at, off))
		}
		if probes != 10 {
			t.Fatalf("%s: %d probes in 10 intervals, want 10", ep.name, probes)
		}
	}
	most := 0
	for _, c := range windows {
		most = max(most, c)
	}
	if most > 7 {
		t.Fatalf("a 5 ms window holds %d probes, want at most 7", most)
	}
	t.Logf("fullest 5 ms window: %d probes of %d endpoints", most, n)
}

// TestHealthProbeWaitHeld: while a pool the endpoint serves holds requests
// and it is not ready, the wait is the hold's probe_interval from the last
// probe's start (0 when that probe took longer), as before phases; ready,
// or before the loop's first probe, it is the phase's.
func TestHealthProbeWaitHeld(t *testing.T) {
	const interval, d = 5 * time.Second, 10 * time.Millisecond
	g := &Gateway{cfg: Config{HealthCheckInterval: interval}, phaseSeed: 1}
	ep, err := newEndpoint("http://10.0.0.1:8000")
	if err != nil {
		t.Fatal(err)
	}
	a := &admission{}
	a.heldNow.Store(1)
	a.probe.Store(int64(d))
	ep.gates.Store(&[]*admission{a})
	off := g.probePhase(ep)
	began := time.Unix(1_765_000_000, 0)
	phase := func(now time.Time) time.Duration { return fleet.UntilPhase(now, off, interval) }
	for _, c := range []struct {
		name       string
		now, began time.Time
		ready      bool
		want       time.Duration
	}{
		{"held, 3 ms after the probe's start", began.Add(3 * time.Millisecond), began, false, 7 * time.Millisecond},
		{"held, the probe took 12 ms", began.Add(12 * time.Millisecond), began, false, 0},
		{"held, before the first probe", began, time.Time{}, false, phase(began)},
		{"held but ready", began.Add(3 * time.Millisecond), began, true, phase(began.Add(3 * time.Millisecond))},
	} {
		ep.ready.Store(c.ready)
		if got := g.probeWait(ep, c.now, c.began, off); got != c.want {
			t.Errorf("%s: wait %v, want %v", c.name, got, c.want)
		}
	}
	a.heldNow.Store(0)
	ep.ready.Store(false)
	if got, want := g.probeWait(ep, began.Add(3*time.Millisecond), began, off), phase(began.Add(3*time.Millisecond)); got != want {
		t.Errorf("not held: wait %v, want the phase's %v", got, want)
	}
}

// TestHealthLoopsFollowPhase: the health loops of endpoints a reload adds
// wait for their own phase (probePhase), each its own: the waits the
// running loops schedule are recorded (probeWaitHook).
func TestHealthLoopsFollowPhase(t *testing.T) {
	const n, interval = 50, time.Hour // no periodic probe within the test
	cfg := eppBenchConfig("round-robin", 1, 1)
	cfg.HealthCheckInterval = interval
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	type wait struct {
		now  time.Time
		wait time.Duration
	}
	var mu sync.Mutex
	waits := map[*endpoint][]wait{}
	all := make(chan struct{})
	hook := func(ep *endpoint, now time.Time, w time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		waits[ep] = append(waits[ep], wait{now, w})
		if len(waits) == n {
			close(all)
		}
	}
	g.probeWaitHook.Store(&hook)
	next := eppBenchConfig("round-robin", n+1, 1)
	next.HealthCheckInterval = interval
	mustReload(t, g, next)
	select {
	case <-all:
	case <-time.After(time.Minute): // a guard against a hang, not a timing
		t.Fatal("the new endpoints' health loops scheduled no wait")
	}
	mu.Lock()
	defer mu.Unlock()
	phases := map[time.Duration]bool{}
	for ep, ws := range waits {
		if len(ws) != 1 {
			t.Fatalf("%s: %d waits scheduled, want 1 (no probe due within %v)", ep.name, len(ws), interval)
		}
		off := g.probePhase(ep)
		at := ws[0].now.Add(ws[0].wait).UnixNano()
		if ws[0].wait <= 0 || ws[0].wait > interval || at%int64(interval) != int64(off) {
			t.Fatalf("%s: first probe %v after %v, not at its phase %v", ep.name, ws[0].wait, ws[0].now, off)
		}
		phases[off] = true
	}
	if len(phases) < 2 {
		t.Fatalf("%d endpoints share one phase", n)
	}
}
