package sim

import (
	"runtime"
	"testing"
)

// TestEngineBytesBound: EngineBytes is at least what engines take on the
// heap once built, and not over twice it (an estimate, not a guess).
func TestEngineBytesBound(t *testing.T) {
	for _, n := range []int{1000, 20000} {
		cfg := Config{NumBlocks: n}
		var a, b runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&a)
		es := make([]*Engine, 8)
		for i := range es {
			es[i] = NewEngine(cfg)
		}
		runtime.GC()
		runtime.ReadMemStats(&b)
		runtime.KeepAlive(es)
		per := float64(int64(b.HeapAlloc)-int64(a.HeapAlloc)) / float64(len(es))
		if est := float64(EngineBytes(cfg)); est < per || est > 2*per {
			t.Errorf("%d blocks: estimate %.0f bytes, measured %.0f", n, est, per)
		}
	}
}
