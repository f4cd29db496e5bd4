package fleet

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// TestUntilPhase: the wait lands on the phase (Unix time ≡ offset modulo
// period), strictly after now and at most one period later, for any now
// (before 1970 included), offset (negative, beyond period) and period.
func TestUntilPhase(t *testing.T) {
	for _, c := range []struct {
		now            int64 // Unix ns
		offset, period time.Duration
		want           time.Duration
	}{
		{now: 0, offset: 0, period: 5, want: 5}, // on the phase: the next one
		{now: 1, offset: 0, period: 5, want: 4},
		{now: 12, offset: 3, period: 5, want: 1},
		{now: 13, offset: 3, period: 5, want: 5},
		{now: 14, offset: 3, period: 5, want: 4},
		{now: 14, offset: 8, period: 5, want: 4},  // offset taken modulo period
		{now: 14, offset: -2, period: 5, want: 4}, // -2 ≡ 3
		{now: -1, offset: 0, period: 5, want: 1},
		{now: -7, offset: 1, period: 5, want: 3},
		// A period past 2⁶² ns (the longest durations YAML takes): no
		// overflow to a negative wait.
		{now: 10, offset: 0, period: math.MaxInt64, want: math.MaxInt64 - 10},
		{now: 10, offset: math.MaxInt64 - 1, period: math.MaxInt64, want: math.MaxInt64 - 11},
	} {
		if got := UntilPhase(time.Unix(0, c.now), c.offset, c.period); got != c.want {
			t.Errorf("UntilPhase(%d, %d, %d) = %d, want %d", c.now, c.offset, c.period, got, c.want)
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 100_000 {
		period := time.Duration(1 + r.Int64N(int64(time.Hour)))
		offset := time.Duration(r.Int64N(int64(3*period))) - period
		now := time.Unix(0, r.Int64()-r.Int64())
		w := UntilPhase(now, offset, period)
		if w <= 0 || w > period {
			t.Fatalf("UntilPhase(%v, %v, %v) = %v: not in (0, period]", now.UnixNano(), offset, period, w)
		}
		at := now.UnixNano() + int64(w)
		if ((at-int64(offset))%int64(period)+int64(period))%int64(period) != 0 {
			t.Fatalf("UntilPhase(%v, %v, %v) = %v: %d is not on the phase", now.UnixNano(), offset, period, w, at)
		}
	}
}

// fleetNames are n endpoint names as a large fleet has them.
func fleetNames(n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("http://10.%d.%d.%d:8000", i>>16&255, i>>8&255, i&255)
	}
	return names
}

// TestPhaseOffsetSpread: 1,000 endpoints' phases within a 5 s period, for
// three seeds: every one in [0, period); each tenth of the period holds
// 100 ± 35 of them and no 5 ms window (1/1000 of it) more than 7, where
// one timer per endpoint started together put all 1,000 in one instant.
// Deterministic: the phase is a hash of the name.
func TestPhaseOffsetSpread(t *testing.T) {
	const n, period = 1000, 5 * time.Second
	names := fleetNames(n)
	for _, seed := range []uint64{0, 0xcbf29ce484222325, 0x9e3779b97f4a7c15} {
		var tenths [10]int
		windows := map[int64]int{}
		most := 0
		for _, name := range names {
			off := PhaseOffset(seed, "health", name, period)
			if off < 0 || off >= period {
				t.Fatalf("seed %d %s: offset %v outside [0, %v)", seed, name, off, period)
			}
			tenths[off*10/period]++
			w := int64(off / (period / 1000))
			windows[w]++
			most = max(most, windows[w])
		}
		for i, c := range tenths {
			if c < 65 || c > 135 {
				t.Errorf("seed %d: tenth %d of the period holds %d of %d phases (want 100 ± 35): %v", seed, i, c, n, tenths)
			}
		}
		if most > 7 {
			t.Errorf("seed %d: a 5 ms window holds %d phases (want at most 7)", seed, most)
		}
		t.Logf("seed %d: tenths %v, fullest 5 ms window %d", seed, tenths, most)
	}
}

// TestPhaseOffsetKeys: the offset is a function of seed, kind and name
// alone; another seed (another gateway replica), kind (another loop of the
// same endpoint) or name moves it.
func TestPhaseOffsetKeys(t *testing.T) {
	const period = 5 * time.Second
	a := PhaseOffset(7, "health", "http://10.0.0.1:8000", period)
	if b := PhaseOffset(7, "health", "http://10.0.0.1:8000", period); b != a {
		t.Fatalf("same inputs, offsets %v and %v", a, b)
	}
	for _, c := range []struct {
		seed       uint64
		kind, name string
	}{
		{8, "health", "http://10.0.0.1:8000"},
		{7, "scrape", "http://10.0.0.1:8000"},
		{7, "health", "http://10.0.0.2:8000"},
	} {
		if b := PhaseOffset(c.seed, c.kind, c.name, period); b == a {
			t.Errorf("PhaseOffset(%d, %q, %q) = %v, the same as (7, health, http://10.0.0.1:8000)", c.seed, c.kind, c.name, b)
		}
	}
	if o := PhaseOffset(7, "health", "x", 0); o != 0 {
		t.Errorf("period 0: offset %v, want 0", o)
	}
}

// TestScraperRunPhased: with a Phase, Run still scrapes at once (the
// first round does not wait for the phase: an hour here), and returns when
// its context ends.
func TestScraperRunPhased(t *testing.T) {
	page := readPage(t, "vllm.txt")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(page) }))
	defer srv.Close()
	s, err := NewScraper([]Target{{URL: srv.URL, Kind: VLLM}},
		ScrapeConfig{Interval: time.Hour, Timeout: 10 * time.Second, Phase: PhaseOffset(HostSeed(), "scrape", srv.URL, time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()
	for guard := time.Now().Add(time.Minute); ; time.Sleep(time.Millisecond) { // a guard against a hang, not a timing
		if _, _, ok := s.Latest(0); ok {
			break
		}
		if time.Now().After(guard) {
			t.Fatalf("no first round: %v", s.Err(0))
		}
	}
	cancel()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("Run did not return when its context ended")
	}
}

// TestNextPhase: the next phase instant at least half a period after the
// last run's start: a timer that fired a hair before its instant (the wall
// clock slewed) does not make the next run due at once; a run that
// overran the period goes to the next instant after now.
func TestNextPhase(t *testing.T) {
	const period, offset = 10 * time.Second, 3 * time.Second
	phase := time.Unix(1_765_000_003, 0) // Unix time ≡ 3 s (mod 10 s)
	for _, c := range []struct {
		name      string
		now, last time.Time
		want      time.Duration
	}{
		{"first run", phase.Add(-time.Second), time.Time{}, time.Second},
		{"on time, 1 s run", phase.Add(time.Second), phase, 9 * time.Second},
		{"fired 1 µs early", phase.Add(-time.Microsecond), phase.Add(-time.Microsecond), period + time.Microsecond},
		{"run of 7 s", phase.Add(7 * time.Second), phase, 3 * time.Second},
		{"run of 12 s", phase.Add(12 * time.Second), phase, 8 * time.Second},
	} {
		if got := NextPhase(c.now, c.last, offset, period); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
	// The longest period a duration holds: half of it plus up to one more
	// would overflow; the wait is the longest, not negative.
	now := time.Unix(0, 10)
	if got := NextPhase(now, now, 0, math.MaxInt64); got != math.MaxInt64-10 {
		t.Errorf("period MaxInt64, offset 0: %v, want MaxInt64 − 10 ns", got)
	}
	// The phase exactly half a period after the last run: the next one is
	// a period and a half away, past what a duration holds.
	if got := NextPhase(now, now, 10+math.MaxInt64/2, math.MaxInt64); got != math.MaxInt64 {
		t.Errorf("period MaxInt64, 1.5 periods away: %v, want MaxInt64", got)
	}
}
