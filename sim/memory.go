package sim

import "math"

// Memory a simulated engine holds whatever it serves: its block pool, one
// 32-byte block and one hash-index entry per KV block, preallocated by
// NewEngine. Measured with runtime.MemStats over 8 engines (Go 1.26,
// amd64, no -race): 62–73 bytes per block at 1,000 to 28,773 blocks
// (TestEngineBytesBound holds the estimate above it). Tiers, sequences
// and held KV grow with the work and are not counted.
const (
	engineBytesPerBlock = 80
	engineFixedBytes    = 16 << 10
)

// EngineBytes estimates the memory (bytes) one engine of cfg holds once
// built: cfg's NumBlocks (defaults applied) × 80 bytes + 16 KiB;
// math.MaxInt64 where that overflows (a profile with an absurd gpu_memory).
func EngineBytes(cfg Config) int64 {
	cfg = cfg.WithDefaults()
	if int64(cfg.NumBlocks) > (math.MaxInt64-engineFixedBytes)/engineBytesPerBlock {
		return math.MaxInt64
	}
	return int64(cfg.NumBlocks)*engineBytesPerBlock + engineFixedBytes
}
