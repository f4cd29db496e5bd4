package virtual

import (
	"errors"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/infergate/infergate/autoscale"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
)

// burstTrace is a quiet minute (1 req/s), a one-minute burst (12 req/s)
// and a quiet tail (0.5 req/s for 5 minutes): 1k-token prompts, 64 output
// tokens, arrival jitter from seed.
func burstTrace(seed uint64) []Request {
	rng := rand.New(rand.NewPCG(seed, 7))
	var reqs []Request
	add := func(from, to time.Duration, perS float64) {
		gap := time.Duration(float64(time.Second) / perS)
		for at := from; at < to; at += gap {
			j := time.Duration(rng.Int64N(int64(gap / 2)))
			reqs = append(reqs, Request{Arrival: at + j, Tokens: seqTokens(len(reqs)+1, 1000+rng.IntN(200)), MaxTokens: 64})
		}
	}
	add(0, time.Minute, 1)
	add(time.Minute, 2*time.Minute, 12)
	add(2*time.Minute, 7*time.Minute, 0.5)
	slices.SortStableFunc(reqs, func(a, b Request) int { return int(a.Arrival - b.Arrival) })
	return reqs
}

func runAutoscaled(t *testing.T, reqs []Request, a Autoscale, seed uint64) (*Fleet, []Result) {
	t.Helper()
	f, err := NewFleet(Config{Engines: a.Policy.Max, Engine: sim.Config{Seed: seed},
		Routing: sched.Config{Policy: sched.LeastRequest, Seed: seed}, Autoscale: &a})
	if err != nil {
		t.Fatal(err)
	}
	res, err := f.Run(reqs)
	if err != nil {
		t.Fatal(err)
	}
	return f, res
}

// TestAutoscaleFollowsBurst: the fleet starts engines for the burst, routes
// nothing to an engine before its start-up ends, scales down after the
// down window, and pays for less than the largest fleet all along.
func TestAutoscaleFollowsBurst(t *testing.T) {
	reqs := burstTrace(1)
	a := Autoscale{Policy: autoscale.Config{Min: 1, Max: 6, TargetInFlight: 4, DownWindow: time.Minute},
		Interval: 5 * time.Second, ColdStart: 20 * time.Second}
	f, res := runAutoscaled(t, reqs, a, 1)
	st := f.ScaleStats()
	if st.Started < 2 || st.PeakEngines < 3 || st.Stopped < 1 {
		t.Fatalf("started %d, peak %d, stopped %d: the burst should bring engines up and the tail take them down", st.Started, st.PeakEngines, st.Stopped)
	}
	if max := float64(a.Policy.Max) * f.Now().Seconds(); st.EngineSeconds >= 0.6*max || st.EngineSeconds < f.Now().Seconds() {
		t.Fatalf("engine-seconds %.0f: want between one engine's %.0f and 60%% of the largest fleet's %.0f", st.EngineSeconds, f.Now().Seconds(), max)
	}
	if st.Held != 0 || st.Dropped != 0 {
		t.Fatalf("held %d, dropped %d with one engine always up", st.Held, st.Dropped)
	}
	// Nothing is routed to an engine outside its ready window (engine 0 is
	// up from the start).
	for k, r := range res {
		if r.Err != nil {
			t.Fatalf("request %d: %v", k, r.Err)
		}
		if r.Engine == 0 {
			continue
		}
		ok := false
		for _, s := range st.Starts {
			if s.Engine == r.Engine && s.Ready <= r.Arrival && (s.Stop == 0 || r.Arrival < s.Stop) {
				ok = true
			}
		}
		if !ok {
			t.Fatalf("request %d at %v went to engine %d, not ready then (starts %+v)", k, r.Arrival, r.Engine, st.Starts)
		}
	}
	// Decisions every interval while there is work.
	if len(st.Timeline) < int(f.Now()/a.Interval)/2 {
		t.Fatalf("%d decisions over %v", len(st.Timeline), f.Now())
	}
	if u := f.Utilization(); u <= 0 || u > 1 {
		t.Fatalf("utilisation %v", u)
	}
}

// TestAutoscaleDeterministic: the same trace and seed give the same
// results and the same scaling, whatever else ran before.
func TestAutoscaleDeterministic(t *testing.T) {
	a := Autoscale{Policy: autoscale.Config{Min: 0, Max: 4, TargetInFlight: 4, DownWindow: 30 * time.Second, TTFTTarget: time.Second},
		Interval: 5 * time.Second, ColdStart: 15 * time.Second, Initial: -1}
	for seed := uint64(0); seed < 3; seed++ {
		f1, r1 := runAutoscaled(t, burstTrace(seed), a, seed)
		f2, r2 := runAutoscaled(t, burstTrace(seed), a, seed)
		if !reflect.DeepEqual(r1, r2) {
			t.Fatalf("seed %d: results differ between runs", seed)
		}
		if s1, s2 := f1.ScaleStats(), f2.ScaleStats(); !reflect.DeepEqual(s1, s2) {
			t.Fatalf("seed %d: scaling differs: %+v vs %+v", seed, s1, s2)
		}
	}
}

// TestAutoscaleFromZero: with no engine up, requests are held until the
// first engine's start-up ends; the first request's TTFT is the start-up
// plus its own prefill; none is lost without a hold TTL.
func TestAutoscaleFromZero(t *testing.T) {
	reqs := []Request{
		{Arrival: time.Second, Tokens: seqTokens(1, 2000), MaxTokens: 8},
		{Arrival: 2 * time.Second, Tokens: seqTokens(2, 500), MaxTokens: 8},
	}
	cold := 30 * time.Second
	a := Autoscale{Policy: autoscale.Config{Min: 0, Max: 2}, Interval: 15 * time.Second, ColdStart: cold}
	f, res := runAutoscaled(t, reqs, a, 0)
	st := f.ScaleStats()
	if st.Held != 2 || st.Dropped != 0 || st.Started != 1 {
		t.Fatalf("held %d, dropped %d, started %d: want 2, 0, 1", st.Held, st.Dropped, st.Started)
	}
	// The decision at 15 s (the first after the arrival at 1 s; the one
	// at 0 saw nothing) starts an engine, ready at 45 s.
	ready := 15*time.Second + cold
	if st.Starts[0].Ready != ready {
		t.Fatalf("ready at %v, want %v", st.Starts[0].Ready, ready)
	}
	alone, err := NewFleet(Config{Engines: 1})
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := alone.Run([]Request{{Arrival: 0, Tokens: seqTokens(1, 2000), MaxTokens: 8}})
	for k, r := range res {
		if r.Err != nil || r.Arrival != reqs[k].Arrival {
			t.Fatalf("request %d: err %v, arrival %v", k, r.Err, r.Arrival)
		}
	}
	if got, want := res[0].TTFT(), ready-reqs[0].Arrival+ref[0].TTFT(); got != want {
		t.Fatalf("first TTFT %v, want the wait for the engine (%v) + its own prefill (%v) = %v", got, ready-reqs[0].Arrival, ref[0].TTFT(), want)
	}
	if st.MaxHeldWait != ready-reqs[0].Arrival {
		t.Fatalf("longest hold %v", st.MaxHeldWait)
	}
}

// TestAutoscaleHoldTTL: a request held past the TTL fails with
// ErrHoldTimeout; one that arrives later is served.
func TestAutoscaleHoldTTL(t *testing.T) {
	reqs := []Request{
		{Arrival: time.Second, Tokens: seqTokens(1, 100), MaxTokens: 4},
		{Arrival: 40 * time.Second, Tokens: seqTokens(2, 100), MaxTokens: 4},
	}
	a := Autoscale{Policy: autoscale.Config{Min: 0, Max: 1}, Interval: 5 * time.Second, ColdStart: 30 * time.Second, HoldTTL: 10 * time.Second}
	f, res := runAutoscaled(t, reqs, a, 0)
	if !errors.Is(res[0].Err, ErrHoldTimeout) || res[0].Engine != -1 {
		t.Fatalf("request 0: %v on %d, want ErrHoldTimeout", res[0].Err, res[0].Engine)
	}
	if res[1].Err != nil {
		t.Fatalf("request 1: %v", res[1].Err)
	}
	if st := f.ScaleStats(); st.Dropped != 1 || st.Held != 1 { // request 1 finds the engine ready
		t.Fatalf("dropped %d, held %d", st.Dropped, st.Held)
	}
}

func TestAutoscaleConfigErrors(t *testing.T) {
	for name, cfg := range map[string]Config{
		"max above engines": {Engines: 2, Autoscale: &Autoscale{Policy: autoscale.Config{Max: 3}}},
		"bad policy":        {Engines: 2, Autoscale: &Autoscale{Policy: autoscale.Config{Max: 2, Min: 3}}},
		"replicas":          {Engines: 2, Replicas: 2, Autoscale: &Autoscale{Policy: autoscale.Config{Max: 2}}},
	} {
		if _, err := NewFleet(cfg); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}
