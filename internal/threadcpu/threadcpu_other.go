//go:build !linux

// Package threadcpu reads the calling thread's CPU time; off Linux it does
// not measure.
package threadcpu

import "time"

// Now is 0 off Linux.
func Now() time.Duration { return 0 }

// Supported reports whether Now measures (Linux).
const Supported = false
