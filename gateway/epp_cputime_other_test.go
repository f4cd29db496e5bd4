//go:build !linux

package gateway

import "time"

// threadCPU is not measured off Linux (0).
func threadCPU() time.Duration { return 0 }
