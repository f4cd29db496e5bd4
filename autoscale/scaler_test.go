package autoscale

import (
	"strings"
	"testing"
	"time"
)

func TestRecommend(t *testing.T) {
	c := Config{Min: 0, Max: 8, TargetInFlight: 10, TTFTTarget: time.Second}
	for _, tc := range []struct {
		name string
		s    Signals
		want int
		why  Reason
	}{
		{"idle pool scales to min 0", Signals{}, 0, ReasonMin},
		{"a held request wants one", Signals{Queued: 1}, 1, ReasonLoad},
		{"arrivals alone activate", Signals{ArrivalRate: 0.1}, 1, ReasonActivation},
		{"load over target", Signals{Ready: 2, InFlight: 31}, 4, ReasonLoad},
		{"load exactly at target", Signals{Ready: 3, InFlight: 30}, 3, ReasonLoad},
		{"queued counts as load", Signals{Ready: 1, InFlight: 10, Queued: 15}, 3, ReasonLoad},
		{"capped at max", Signals{Ready: 8, InFlight: 1000}, 8, ReasonMax},
		{"kv saturation adds one", Signals{Ready: 2, InFlight: 5, KVUtil: 0.85}, 3, ReasonSaturated},
		{"queue saturation adds one", Signals{Ready: 2, InFlight: 12, Waiting: 10}, 3, ReasonSaturated},
		{"saturation waits for starting engines", Signals{Ready: 2, Starting: 1, InFlight: 5, KVUtil: 0.9}, 1, ReasonLoad},
		{"ttft over target adds one", Signals{Ready: 2, InFlight: 5, TTFT: 2 * time.Second}, 3, ReasonTTFT},
		{"ttft waits for starting engines", Signals{Ready: 2, Starting: 2, InFlight: 5, TTFT: 2 * time.Second}, 1, ReasonLoad},
	} {
		got, why := c.Recommend(tc.s)
		if got != tc.want || why != tc.why {
			t.Errorf("%s: Recommend(%+v) = %d (%v), want %d (%v)", tc.name, tc.s, got, why, tc.want, tc.why)
		}
	}
	rc := Config{Max: 8, TargetRate: 2}
	if got, why := rc.Recommend(Signals{Ready: 1, ArrivalRate: 5}); got != 3 || why != ReasonRate {
		t.Errorf("rate rule: %d (%v), want 3 (rate)", got, why)
	}
	if got, why := (Config{Max: 8, TargetInFlight: -1, TargetRate: 2}).Recommend(Signals{Ready: 1, InFlight: 100, ArrivalRate: 3}); got != 2 || why != ReasonRate {
		t.Errorf("load rule off: %d (%v), want 2 (rate)", got, why)
	}
	if c, _, err := ParseConfig("max=4,target=off,rate=3"); err != nil || c.TargetInFlight >= 0 {
		t.Errorf("target=off: %+v %v", c, err)
	}
	if got, _ := (Config{Min: 2, Max: 8}).Recommend(Signals{}); got != 2 {
		t.Errorf("min 2 idle: %d", got)
	}
}

// step is one call of a Scaler table test: at t with the pool running
// ready (+ starting) engines and load in flight, Decide must answer want.
type step struct {
	t        time.Duration
	ready    int
	starting int
	load     int
	want     int
}

func runSteps(t *testing.T, name string, c Config, steps []step) {
	t.Helper()
	s, err := New(c)
	if err != nil {
		t.Fatal(err)
	}
	for i, st := range steps {
		d := s.Decide(st.t, Signals{Ready: st.ready, Starting: st.starting, InFlight: st.load})
		if d.Desired != st.want {
			t.Fatalf("%s step %d at %v (ready %d, starting %d, load %d): desired %d (recommended %d, %v), want %d",
				name, i, st.t, st.ready, st.starting, st.load, d.Desired, d.Recommended, d.Reason, st.want)
		}
	}
}

func TestScalerUpFastDownSlow(t *testing.T) {
	s := time.Second
	c := Config{Min: 0, Max: 16, TargetInFlight: 10}
	runSteps(t, "up fast, down slow", c, []step{
		{0, 1, 0, 5, 1},
		// A burst: 60 in flight wants 6; up at once (no up window), by
		// at most max(2×, +4) of the count 15 s ago (1 → 5).
		{15 * s, 1, 0, 60, 5},
		// Cold-start aware: the 4 starting engines count; 15 s later the
		// base is 5, so 6 is allowed.
		{30 * s, 1, 4, 60, 6},
		// Load drops: the 5-minute down window keeps 6.
		{45 * s, 6, 0, 10, 6},
		{200 * s, 6, 0, 10, 6},
		{329 * s, 6, 0, 10, 6},
		// 300 s after the last recommendation of 6 (at 30 s): down to the
		// highest of the window, 1.
		{331 * s, 6, 0, 10, 1},
	})
}

func TestScalerScaleToZeroAndBack(t *testing.T) {
	s := time.Second
	c := Config{Min: 0, Max: 4, TargetInFlight: 8, DownWindow: 60 * s}
	runSteps(t, "min 0", c, []step{
		{0, 2, 0, 9, 2},
		{10 * s, 2, 0, 0, 2},
		{59 * s, 2, 0, 0, 2},
		{61 * s, 2, 0, 0, 0}, // 60 s after the last recommendation of 2: zero
		{100 * s, 0, 0, 0, 0},
		// A request held for an engine: activation, from zero.
		{101 * s, 0, 0, 1, 1},
		// Starting: no more for the same request.
		{102 * s, 0, 1, 1, 1},
	})
	// Min 1 never goes to zero.
	runSteps(t, "min 1", Config{Min: 1, Max: 4, DownWindow: 10 * s}, []step{
		{0, 1, 0, 0, 1}, {100 * s, 1, 0, 0, 1},
	})
}

func TestScalerColdStartNoOverscale(t *testing.T) {
	// Saturated engines want one more; while it starts (a 90 s cold
	// start, decisions every 15 s) the policy must not add more for the
	// same saturation.
	c := Config{Max: 10, TargetInFlight: 100, ColdStart: 90 * time.Second}
	sc, err := New(c)
	if err != nil {
		t.Fatal(err)
	}
	sat := Signals{Ready: 2, InFlight: 50, KVUtil: 0.95}
	if d := sc.Decide(0, sat); d.Desired != 3 || d.Reason != ReasonSaturated {
		t.Fatalf("saturated: %+v, want 3 (saturated)", d)
	}
	sat.Starting = 1
	for ts := 15 * time.Second; ts < 90*time.Second; ts += 15 * time.Second {
		if d := sc.Decide(ts, sat); d.Desired != 3 {
			t.Fatalf("at %v with one starting: desired %d, want 3", ts, d.Desired)
		}
	}
	// Ready, still saturated: one more.
	sat.Ready, sat.Starting = 3, 0
	if d := sc.Decide(90*time.Second, sat); d.Desired != 4 {
		t.Fatalf("after the start, saturated: %d, want 4", d.Desired)
	}
}

func TestScalerWindowsAndLimits(t *testing.T) {
	s := time.Second
	// An up window of 30 s: a spike must last 30 s to be followed.
	runSteps(t, "up window", Config{Max: 20, TargetInFlight: 1, UpWindow: 30 * s, DownWindow: -1}, []step{
		{0, 2, 0, 2, 2},
		{10 * s, 2, 0, 10, 2},
		{40 * s, 2, 0, 10, 6}, // rate limit: 2 → max(4, 6)
		{60 * s, 6, 0, 10, 10},
	})
	// Down by at most 50% per 15 s.
	runSteps(t, "down percent", Config{Max: 20, TargetInFlight: 1, DownWindow: -1, DownPercent: 50}, []step{
		{0, 16, 0, 16, 16},
		{1 * s, 16, 0, 0, 8},
		{2 * s, 8, 0, 0, 8}, // still within 15 s of 16: 16 → at least 8
		{17 * s, 8, 0, 0, 4},
	})
}

func TestScalerTimeGoesBackwards(t *testing.T) {
	sc, _ := New(Config{Max: 4})
	sc.Decide(10*time.Second, Signals{Ready: 1, InFlight: 1})
	if d := sc.Decide(5*time.Second, Signals{Ready: 1, InFlight: 1}); d.Desired != 1 {
		t.Fatalf("desired %d", d.Desired)
	}
}

func TestScalerHistoryBounded(t *testing.T) {
	sc, _ := New(Config{Max: 4, DownWindow: time.Hour})
	for i := range 3 * maxHistory {
		sc.Decide(time.Duration(i)*time.Millisecond, Signals{Ready: 1, InFlight: i % 50})
	}
	if sc.recs.size > maxHistory || sc.decisions.size > maxHistory {
		t.Fatalf("history %d, %d", sc.recs.size, sc.decisions.size)
	}
}

func TestRateWindow(t *testing.T) {
	w := NewRateWindow(10 * time.Second)
	if r := w.Observe(0, 0); r != 0 {
		t.Fatalf("first sample: %v", r)
	}
	if r := w.Observe(5*time.Second, 10); r != 2 {
		t.Fatalf("10 in 5 s: %v", r)
	}
	w.Observe(10*time.Second, 20)
	if r := w.Observe(20*time.Second, 20); r != 0 {
		t.Fatalf("nothing in the last 10 s: %v", r)
	}
	if r := w.Observe(25*time.Second, 50); r != 3 {
		t.Fatalf("30 over the 10 s window: %v", r)
	}
}

func TestParseConfig(t *testing.T) {
	c, rest, err := ParseConfig("min=0,max=8,target=12,cold_start=90s,down_window=0s,interval=5s")
	if err != nil {
		t.Fatal(err)
	}
	if c.Min != 0 || c.Max != 8 || c.TargetInFlight != 12 || c.ColdStart != 90*time.Second || c.DownWindow >= 0 ||
		len(rest) != 1 || rest[0] != "interval=5s" {
		t.Fatalf("%+v %q", c, rest)
	}
	for spec, want := range map[string]string{
		"":                "empty",
		"min=0":           "max is required",
		"max=0":           "max 0",
		"min=3,max=2":     "min 3",
		"max=4,target=-1": "positive",
		"max=4,max=5":     "twice",
		"max":             "key=value",
		"max=4,ttft=2":    "ttft=2",
		"max=4,kv=1.5":    "kv threshold",
	} {
		if _, _, err := ParseConfig(spec); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseConfig(%q) = %v, want an error with %q", spec, err, want)
		}
	}
}

func BenchmarkDecide(b *testing.B) {
	sc, _ := New(Config{Max: 64})
	b.ReportAllocs()
	sc.Decide(0, Signals{}) // the history's one allocation
	for i := 0; b.Loop(); i++ {
		sc.Decide(time.Duration(i)*time.Second, Signals{Ready: 4, InFlight: i % 200, KVUtil: 0.5})
	}
}
