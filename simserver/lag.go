package simserver

import (
	"math/bits"
	"sync"
	"time"
)

// Step lag: how far a real-time Server falls behind its time scale.
//
// The driver (Server.drive) sleeps after each step until the wall-clock
// deadline start + (virtual end of the step)/TimeScale and then delivers the
// step's tokens. When the host cannot keep up (the step loop, the HTTP
// handlers, the gateway and the client share its CPUs), the deadline has
// already passed when the driver gets there: the step's tokens reach the
// client late, and every wall-clock measurement of the run (TTFT, ITL, E2E)
// carries that lateness times the time scale. The lag of a step is that
// lateness converted to engine time: (delivery − deadline) × TimeScale, 0
// when the step was on time. While the engine is busy, lag accumulates; when
// it goes idle its clock resynchronises with the wall clock, so lag never
// spans an idle period.
//
// A client-side latency error is bounded by the lag: a request's measured
// TTFT is the modelled one plus the lag at its first token minus the lag at
// its arrival, and an inter-token gap moves by the difference of two
// consecutive steps' lags. A run whose p99 step lag is a few milliseconds of
// engine time measures the modelled hardware; one whose lag reaches seconds
// measures the host.

// LagStats summarises the step lags of an engine or a fleet: how many steps
// were timed and their lag percentiles, all in engine time (wall lateness ×
// TimeScale). Percentiles come from a log-bucketed histogram (8 buckets per
// power of two) and are the upper edge of their bucket: at most 12.5% above
// the true value, never above Max. The zero LagStats means no step ran.
type LagStats struct {
	// Steps is the number of engine steps timed.
	Steps int64 `json:"steps"`
	// Late is the number of steps whose lag exceeded LateThreshold.
	Late int64 `json:"late_steps"`
	// P50, P99 and Max are the step lag's median, 99th percentile and
	// maximum (engine time).
	P50 time.Duration `json:"p50_ns"`
	P99 time.Duration `json:"p99_ns"`
	Max time.Duration `json:"max_ns"`
	// Mean is the mean step lag (engine time).
	Mean time.Duration `json:"mean_ns"`
}

// LateThreshold is the step lag above which LagStats counts a step as late
// (engine time): a tenth of a fast decode step.
const LateThreshold = time.Millisecond

// lagSubBuckets is the number of histogram buckets per power of two.
const lagSubBuckets = 8

// lagHistogram counts step lags (engine-time nanoseconds) in log buckets:
// values below lagSubBuckets have a bucket each, larger ones 8 per power of
// two (bucket width at most 1/8 of its lower edge). Safe for concurrent use.
type lagHistogram struct {
	mu     sync.Mutex
	counts [64 * lagSubBuckets]int64
	n      int64
	late   int64
	sum    float64 // ns
	max    time.Duration
}

// lagBucket is the bucket of d (d >= 0).
func lagBucket(d time.Duration) int {
	v := uint64(d)
	if v < lagSubBuckets {
		return int(v)
	}
	e := bits.Len64(v) - 1 // 2^e <= v < 2^(e+1), e >= 3
	sub := int(v>>(e-3)) & (lagSubBuckets - 1)
	return (e-2)*lagSubBuckets + sub
}

// lagBucketUpper is the largest value in bucket b.
func lagBucketUpper(b int) time.Duration {
	if b < lagSubBuckets {
		return time.Duration(b)
	}
	e := b/lagSubBuckets + 2
	sub := uint64(b % lagSubBuckets)
	lo := (lagSubBuckets + sub) << (e - 3)
	return time.Duration(lo + 1<<(e-3) - 1)
}

// observe records one step's lag (engine time; negative counts as 0).
func (h *lagHistogram) observe(d time.Duration) {
	d = max(d, 0)
	h.mu.Lock()
	h.counts[lagBucket(d)]++
	h.n++
	if d > LateThreshold {
		h.late++
	}
	h.sum += float64(d)
	h.max = max(h.max, d)
	h.mu.Unlock()
}

// addTo adds h's counts to dst (which must not be shared).
func (h *lagHistogram) addTo(dst *lagHistogram) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, c := range h.counts {
		dst.counts[i] += c
	}
	dst.n += h.n
	dst.late += h.late
	dst.sum += h.sum
	dst.max = max(dst.max, h.max)
}

// stats summarises h.
func (h *lagHistogram) stats() LagStats {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.n == 0 {
		return LagStats{}
	}
	return LagStats{
		Steps: h.n,
		Late:  h.late,
		P50:   h.quantile(0.50),
		P99:   h.quantile(0.99),
		Max:   h.max,
		Mean:  time.Duration(h.sum / float64(h.n)),
	}
}

// quantile is the upper edge of the bucket holding the q-th quantile (the
// ⌈q·n⌉-th smallest lag), capped at the maximum. h.mu must be held.
func (h *lagHistogram) quantile(q float64) time.Duration {
	rank := int64(q*float64(h.n) + 0.999999)
	rank = min(max(rank, 1), h.n)
	var seen int64
	for b, c := range h.counts {
		seen += c
		if seen >= rank {
			return min(lagBucketUpper(b), h.max)
		}
	}
	return h.max
}

// Lag returns the step lags of the server's driver since Start (zero before
// the first step); see LagStats.
func (s *Server) Lag() LagStats { return s.lag.stats() }

// Lag returns the step lags of every engine of the fleet pooled (one
// distribution over all their steps); see LagStats.
func (f *Fleet) Lag() LagStats {
	var all lagHistogram
	for _, s := range f.Servers {
		s.lag.addTo(&all)
	}
	return all.stats()
}
