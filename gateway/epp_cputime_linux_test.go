package gateway

import (
	"syscall"
	"time"
	"unsafe"
)

// clockThreadCPUTime is Linux's CLOCK_THREAD_CPUTIME_ID (uapi
// linux/time.h): the calling thread's CPU time from the scheduler's
// nanosecond runtime accounting.
const clockThreadCPUTime = 3

// threadCPU is the calling thread's CPU time (clock_gettime
// CLOCK_THREAD_CPUTIME_ID): unlike the wall clock it does not count the
// time the thread waited for a core, so a decision's cost reads the same on
// a loaded machine. The caller locks its OS thread.
func threadCPU() time.Duration {
	var ts syscall.Timespec
	if _, _, e := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTime, uintptr(unsafe.Pointer(&ts)), 0); e != 0 {
		return 0
	}
	return time.Duration(ts.Nano())
}
