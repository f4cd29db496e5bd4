package kvstore

import (
	"context"
	"testing"
	"time"

	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sim"
)

var _ sim.RemoteTier = (*EngineTier)(nil)

// TestRemoteSharedByEngines: two simulated engines share a real kvstore
// service as their remote tier: the first writes its blocks through
// (metadata-only, declared at the engine's block size, with token ids),
// the store publishes them, the second engine's mirror sees them and it
// serves the prompt from the remote tier.
func TestRemoteSharedByEngines(t *testing.T) {
	svc := startService(t, ServiceConfig{Store: Config{MemoryBytes: 1 << 40}, Model: "m"})
	ecfg := sim.Config{NumBlocks: 64}
	rc := EngineTierConfig{URL: "http://" + svc.Addr().String(), Events: "tcp://" + svc.Publisher().Addr().String(),
		EventsReplay: "tcp://" + svc.Publisher().ReplayAddr().String(), Model: "m", BlockBytes: int64(ecfg.BlockBytes())}
	r1, err := NewEngineTier(rc)
	if err != nil {
		t.Fatal(err)
	}
	defer r1.Close()
	r2, err := NewEngineTier(rc)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	c1, c2 := ecfg, ecfg
	c1.Tiers.Remote, c2.Tiers.Remote = r1, r2
	e1, e2 := sim.NewEngine(c1), sim.NewEngine(c2)
	prompt := make([]uint32, 16*10+1)
	for i := range prompt {
		prompt[i] = uint32(7 + i)
	}
	drain := func(e *sim.Engine) sim.Output {
		var now time.Duration
		var last sim.Output
		for e.HasWork() {
			res := e.Step(now)
			now += res.Duration
			if at, ok := e.NextLoad(); ok && res.Duration == 0 {
				now = at
			}
			for _, o := range res.Outputs {
				last = o
			}
		}
		return last
	}
	if err := e1.Add(&sim.Request{ID: "a", Tokens: prompt, MaxTokens: 1}, 0); err != nil {
		t.Fatal(err)
	}
	drain(e1)
	// The store holds the 10 full blocks, declared 10 × BlockBytes.
	deadline := time.Now().Add(wait)
	for r2.Stats().Held < 10 {
		if time.Now().After(deadline) {
			t.Fatalf("the second engine's mirror holds %d blocks; store %+v, writer %+v", r2.Stats().Held, svc.Stats(), r1.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// (plus each entry's key and token ids).
	if st, want := svc.Store.Stats(), 10*int64(ecfg.BlockBytes()); st.MemoryEntries != 10 || st.MemoryBytes < want || st.MemoryBytes > want+10*1024 {
		t.Fatalf("store stats %+v, want 10 entries of %d bytes", st, want/10)
	}
	if err := e2.Add(&sim.Request{ID: "a", Tokens: prompt, MaxTokens: 1}, 0); err != nil {
		t.Fatal(err)
	}
	if o := drain(e2); o.TierTokens[sim.TierRemote] != 160 || o.CachedTokens != 160 {
		t.Fatalf("second engine: %+v", o)
	}
	hashes := prefix.Hashes(nil, prompt, 16, sim.RootHash("", 0))
	if n, err := r1.client.Lookup(context.Background(), "m", "", hashes); err != nil || n != 10 {
		t.Fatalf("lookup: %d, %v", n, err)
	}
	if st := r1.Stats(); st.Sent != 10 || st.Dropped != 0 || st.Failed != 0 {
		t.Fatalf("writer: %+v", st)
	}
}
