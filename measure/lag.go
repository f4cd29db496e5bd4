package measure

import (
	"slices"
	"time"
)

// DefaultMaxLag is the lag margin of a real-time run (engine time): a run
// whose simulated fleet delivered 1% of its steps more than this late
// against its time scale (Summary.FleetLag p99), or whose client sent 1% of
// its requests more than this late against their schedule (SendLag p99), is
// Behind. A real-time run's latencies then measure the host rather than the
// modelled hardware: a request's TTFT moves by up to the lag, an inter-token
// gap by the difference of two steps' lags.
//
// 100 ms is the per-request TTFT resolution the real-time twin checks hold
// the fleet to (bench/twin_test.go: max(15%, 100 ms)), 4-7 decode steps of
// the built-in profiles, and about a tenth of a cold 8k-token prefill on the
// default one. On a quiet 2-core host the first 300 Mooncake requests on 8
// engines at 10× stay under it (fleet p99 38 ms); 2,000 requests, or other
// processes on the cores, put the fleet seconds behind (bench/README.md,
// "Lag").
const DefaultMaxLag = 100 * time.Millisecond

// Lag is how far a real-time run fell behind its schedule, in ms of engine
// time (wall lateness × the time scale).
type Lag struct {
	// Samples is the number of engine steps (FleetLag) or requests
	// (SendLag) measured.
	Samples int64 `json:"samples"`
	// P50, P99 and Max are the lag's median, 99th percentile and maximum
	// (ms, engine time).
	P50 float64 `json:"p50_ms"`
	P99 float64 `json:"p99_ms"`
	Max float64 `json:"max_ms"`
}

// sendLag summarises the SendLagMs of recs; nil when none has one (a closed
// loop).
func sendLag(recs []Record) *Lag {
	var xs []float64
	for i := range recs {
		if l := recs[i].SendLagMs; l != nil {
			xs = append(xs, *l)
		}
	}
	if len(xs) == 0 {
		return nil
	}
	slices.Sort(xs)
	return &Lag{Samples: int64(len(xs)), P50: Percentile(xs, 50), P99: Percentile(xs, 99), Max: xs[len(xs)-1]}
}

// CheckLag judges s against margin (engine time; 0 means DefaultMaxLag):
// it records the margin in MaxLagMs and sets Behind when FleetLag's or
// SendLag's p99 exceeds it. A run with neither (a virtual run) is never
// behind.
func (s *Summary) CheckLag(margin time.Duration) {
	if margin <= 0 {
		margin = DefaultMaxLag
	}
	s.MaxLagMs = float64(margin) / float64(time.Millisecond)
	s.Behind = false
	for _, l := range []*Lag{s.FleetLag, s.SendLag} {
		if l != nil && l.P99 > s.MaxLagMs {
			s.Behind = true
		}
	}
}

// LagP99 is the larger of the run's fleet and send lag p99 (ms) and whether
// either is known.
func (s Summary) LagP99() (float64, bool) {
	var p99 float64
	known := false
	for _, l := range []*Lag{s.FleetLag, s.SendLag} {
		if l != nil {
			p99, known = max(p99, l.P99), true
		}
	}
	return p99, known
}
