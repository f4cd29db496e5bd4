package fleet

import (
	"hash/fnv"
	"math"
	"os"
	"time"
)

// Phases of periodic work (health probes, metrics scrapes, model-list
// reads): each endpoint's runs at a fixed offset within the period, so that
// a fleet configured, started or reloaded at one moment is not read in one
// burst every period for ever. This is Prometheus' scheme (scrape/target.go
// Target.offset: the target's FNV-64a hash XOR a per-server offsetSeed,
// modulo the interval, the schedule pinned to absolute time): the offset is
// a hash of the endpoint's name, deterministic for a given seed, so it
// survives reloads and restarts; the seed differs per gateway replica
// (HostSeed), so replicas probing the same engines do not probe it in step.
// Kubernetes' kubelet spreads its probers by a random first sleep within
// the period (pkg/kubelet/prober/worker.go run), Envoy by optional
// initial_jitter and interval_jitter (off by default); a schedule pinned to
// absolute time needs no per-period jitter: its runs are exactly one period
// apart and cannot drift into step.

// HostSeed is the phase seed of this process: the FNV-64a hash of the
// host name (a pod's name under Kubernetes, so each replica of a
// Deployment has its own), as Prometheus seeds its scrape offsets with its
// host name and external labels. An unreadable host name gives the hash of
// "".
func HostSeed() uint64 {
	h, _ := os.Hostname()
	f := fnv.New64a()
	_, _ = f.Write([]byte(h))
	return f.Sum64()
}

// PhaseOffset is the offset within period, in [0, period), at which the
// periodic work kind (e.g. "health") of the endpoint name runs: FNV-64a of
// kind and name, XOR seed, modulo period. kind keeps one endpoint's
// different loops from sharing a phase. 0 when period is not positive.
func PhaseOffset(seed uint64, kind, name string, period time.Duration) time.Duration {
	if period <= 0 {
		return 0
	}
	f := fnv.New64a()
	_, _ = f.Write([]byte(kind))
	_, _ = f.Write([]byte{0})
	_, _ = f.Write([]byte(name))
	return time.Duration((f.Sum64() ^ seed) % uint64(period))
}

// UntilPhase is the wait from now to the next instant t after now (strictly)
// whose Unix time in nanoseconds is offset modulo period: in (0, period].
// A loop that waits it after each run runs exactly once per period, at its
// phase, whatever each run took (a run longer than period skips the
// instants it covered). period must be positive; offset is taken modulo it.
func UntilPhase(now time.Time, offset, period time.Duration) time.Duration {
	p := int64(period)
	// Both residues in [0, p), their difference in (−p, p): no sum of
	// periods that could overflow for a period past 2⁶² ns.
	o, n := int64(offset)%p, now.UnixNano()%p
	if o < 0 {
		o += p
	}
	if n < 0 {
		n += p
	}
	next := o - n
	if next <= 0 {
		next += p
	}
	return time.Duration(next)
}

// NextPhase is the wait from now to a periodic run's next phase instant
// (UntilPhase) that is at least half a period after last, the start of the
// run before (zero: none). The wall clock that phases are read on may be
// slewed against the monotonic clock timers run on, so a timer set for a
// phase instant can fire a hair before it reads as reached; without the
// half period the run after it would be due at once, two runs in a row.
func NextPhase(now, last time.Time, offset, period time.Duration) time.Duration {
	from := now
	if half := last.Add(period / 2); !last.IsZero() && half.After(now) {
		from = half
	}
	d, u := from.Sub(now), UntilPhase(from, offset, period)
	if d > math.MaxInt64-u { // a period past 6·10¹⁸ ns: the longest wait, not an overflow
		return math.MaxInt64
	}
	return d + u
}
