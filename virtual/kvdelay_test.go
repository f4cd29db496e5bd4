package virtual

import (
	"slices"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
)

// TestKVEventDelay: with Config.KVEventDelay the precise index hears a
// step's KV events that long after the step: a request arriving just after
// its predecessor's first token finds the shared prefix on the engine (a
// cache hit) while the index does not know it yet, and one arriving after
// the delay finds it known. Without a delay the index knows it at once.
func TestKVEventDelay(t *testing.T) {
	const delay = 10 * time.Second
	shared := seqTokens(1, 1024) // 64 blocks of 16
	reqsAt := func(second, third time.Duration) []Request {
		return []Request{
			{Arrival: 0, Tokens: slices.Concat(shared, seqTokens(2, 40)), MaxTokens: 2},
			{Arrival: second, Tokens: slices.Concat(shared, seqTokens(3, 40)), MaxTokens: 2},
			{Arrival: third, Tokens: slices.Concat(shared, seqTokens(4, 40)), MaxTokens: 2},
		}
	}
	run := func(d time.Duration, reqs []Request) []Result {
		t.Helper()
		f, err := NewFleet(Config{Engines: 1, Engine: sim.Config{}, TrackPrecise: true, KVEventDelay: d,
			Routing: sched.Config{Policy: sched.RoundRobin}})
		must(t, err)
		res, err := f.Run(reqs)
		must(t, err)
		for i := range res {
			if res[i].Err != nil {
				t.Fatalf("delay %v: request %d: %v", d, i, res[i].Err)
			}
		}
		return res
	}
	// The first request's first token, hence its prefill's end.
	first := run(0, reqsAt(time.Hour, 2*time.Hour))[0].FirstToken
	soon, late := first+time.Millisecond, first+delay+time.Second

	res := run(0, reqsAt(soon, late))
	if res[1].CachedTokens < 1024 || res[1].PreciseMatchedBlocks != 64 {
		t.Fatalf("no delay: cached %d, precise match %d blocks; want ≥ 1024 cached, 64 blocks known", res[1].CachedTokens, res[1].PreciseMatchedBlocks)
	}
	res = run(delay, reqsAt(soon, late))
	if res[1].CachedTokens < 1024 || res[1].PreciseMatchedBlocks != 0 {
		t.Fatalf("delay %v, right after: cached %d, precise match %d blocks; want ≥ 1024 cached, none known yet", delay, res[1].CachedTokens, res[1].PreciseMatchedBlocks)
	}
	if res[2].PreciseMatchedBlocks != 64 {
		t.Fatalf("delay %v, after it: precise match %d blocks, want 64", delay, res[2].PreciseMatchedBlocks)
	}
}
