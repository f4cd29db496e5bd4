package plan

import (
	"bufio"
	"bytes"
	"fmt"
	"math"
	"os"
	"strconv"

	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
)

// indexBytesPerBlock bounds the approximate prefix index's memory per
// (endpoint, block) entry: 61–97 bytes as its tables fill (prefix.Index's
// "Layout and memory", TestIndexBytesPerBlock).
const indexBytesPerBlock = 97

// fallbackMaxMemory is DefaultMaxMemory where the machine's memory cannot
// be read: 8 GiB.
const fallbackMaxMemory = 8 << 30

// DefaultMaxMemory is Options.MaxMemory's default: half the machine's
// memory (MemTotal of /proc/meminfo; the other half is the garbage
// collector's headroom, GOGC=100 lets the heap reach twice what is live,
// and the rest of the machine's), else 8 GiB.
func DefaultMaxMemory() int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return fallbackMaxMemory
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := bytes.Fields(sc.Bytes())
		if len(f) >= 2 && string(f[0]) == "MemTotal:" {
			if kb, err := strconv.ParseInt(string(f[1]), 10, 64); err == nil && kb > 0 {
				return kb << 10 / 2
			}
		}
	}
	return fallbackMaxMemory
}

// memoryEstimate is Run's up-front estimate of a sweep's peak live memory
// (bytes): workers runs at once, each of at most largest engines (every
// engine's preallocated KV block pool, sim.EngineBytes) and an approximate
// prefix index of at most one entry per prompt block of recs (in engine
// blocks; a block routed to several endpoints over the trace counts once
// per request), capped by what the fleet's capacities let it hold. The
// trace, results and each engine's tiers and queues, which grow with the
// work, are not counted.
func memoryEstimate(opts Options, recs []trace.Record, largest, workers int) (total, perEngine, index int64) {
	cfg := opts.Engine.WithDefaults()
	perEngine = sim.EngineBytes(cfg)
	var blocks int64
	for _, r := range recs {
		blocks += int64((r.InputLength + cfg.BlockSize - 1) / cfg.BlockSize)
	}
	blocks = min(blocks, satMul(int64(largest), int64(cfg.NumBlocks)))
	index = satMul(blocks, indexBytesPerBlock)
	return satMul(int64(workers), satAdd(satMul(int64(largest), perEngine), index)), perEngine, index
}

// satMul is a×b for a, b ≥ 0, math.MaxInt64 where it overflows: the
// estimate of a profile with an absurd gpu_memory must stay over any limit
// (a wrapped product, negative or small, passed the check and the sweep
// then tried to allocate its 2^56-block pools).
func satMul(a, b int64) int64 {
	if a <= 0 || b <= 0 {
		return 0
	}
	if a > math.MaxInt64/b {
		return math.MaxInt64
	}
	return a * b
}

// satAdd is a+b for a, b ≥ 0, math.MaxInt64 where it overflows.
func satAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// checkMemory refuses a sweep whose estimate is over limit.
func checkMemory(opts Options, recs []trace.Record, largest, workers int, limit int64) error {
	total, perEngine, index := memoryEstimate(opts, recs, largest, workers)
	if total <= limit {
		return nil
	}
	return fmt.Errorf("plan: the sweep needs about %.1f GiB (%d runs at once × (%d engines × %.1f MiB of KV block pool + %.1f MiB of prefix index)), "+
		"over the limit of %.1f GiB (--max-memory-gib; default half the machine's memory): sweep fewer engines, fewer --workers or fewer --requests, or raise the limit",
		gib(total), workers, largest, float64(perEngine)/(1<<20), float64(index)/(1<<20), gib(limit))
}

func gib(b int64) float64 { return float64(b) / (1 << 30) }
