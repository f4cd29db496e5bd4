// Package threadcpu reads the calling thread's CPU time, for benchmarks
// that report a decision's own cost: unlike the wall clock it does not
// count the time the thread waited for a core, so it reads the same on a
// loaded machine (gateway.BenchmarkEPPDecision, sched.BenchmarkDecision*).
// The caller locks its OS thread (runtime.LockOSThread) around the two
// reads.
package threadcpu

import (
	"time"

	"golang.org/x/sys/unix"
)

// Now is the calling thread's CPU time (clock_gettime
// CLOCK_THREAD_CPUTIME_ID: the scheduler's nanosecond runtime
// accounting); 0 if the clock cannot be read.
func Now() time.Duration {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts) != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// Supported reports whether Now measures (Linux).
const Supported = true
