package gateway

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/internal/redistest"
	"github.com/infergate/infergate/replica"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/simserver"
	"github.com/redis/go-redis/v9"
)

// TestReplicasShareFinish: two serve replicas of one cache-aware pool
// (learn_on_finish, the default) on a real redis-server. Every request
// replica A serves publishes its learn and, when its attempt ends, its
// finish; replica B pins each learn in its approximate index and releases
// it at the finish: once A's requests are answered B has applied every
// finish and holds none of A's pins. A's finishes name their learn (wire
// kind 5, finish_ref) and each found its pin on B; B, configured with
// replicas.finish_hashes, sends its finish with the hashes (kind 4).
func TestReplicasShareFinish(t *testing.T) {
	srv := redistest.Start(t, 0)
	f, err := simserver.StartFleet(2, simserver.ServerConfig{Model: "m", TimeScale: 1000})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	cfg := Config{EjectDuration: 5 * time.Minute, HealthCheckPath: "-"}
	for _, u := range f.URLs {
		cfg.Endpoints = append(cfg.Endpoints, EndpointConfig{URL: u, Model: "m", KVBlocks: f.KVBlocks(), BlockSize: f.BlockSize(), Kind: fleet.Sim})
	}
	gs := make([]*Gateway, 2)
	gws := make([]string, 2)
	for i, id := range []string{"gw-a", "gw-b"} {
		c := cfg
		c.Replicas = ReplicasConfig{RedisURL: srv.URL(), Stream: "finish", ID: id, FinishHashes: id == "gw-b"}
		gs[i], gws[i] = startGateway(t, c)
	}
	waitFor(t, "both exchanges up", func() bool {
		return gs[0].replicas.x.Load().Up() && gs[1].replicas.x.Load().Up()
	})
	c := testClient(t)
	const n = 6
	for s := range n {
		a, err := chat(context.Background(), c, gws[0], pdSimPrompt(fmt.Sprintf("fin%d", s), 20, s%2 == 1))
		if err != nil || a.status != 200 || a.errMsg != "" {
			t.Fatalf("request %d: %+v %v", s, a, err)
		}
	}
	b := gs[1].replicas.node
	waitFor(t, "B applied A's learns and finishes", func() bool {
		return b.Counts.Learns.Load() == n && b.Counts.Finishes.Load() == n
	})
	if pins, hashes := b.Pinned(); pins != 0 || hashes != 0 {
		t.Fatalf("B holds %d of A's pins (%d hashes) after every finish", pins, hashes)
	}
	if e := b.Counts.PinsExpired.Load(); e != 0 {
		t.Fatalf("%d pins released without their finish", e)
	}
	if u := b.Counts.Unknown.Load(); u != 0 {
		t.Fatalf("%d messages unknown", u)
	}
	if u := b.Counts.FinishesUnmatched.Load(); u != 0 {
		t.Fatalf("%d of A's finishes found no pin", u)
	}
	// One request through B: A applies its finish of kind 4.
	if a, err := chat(context.Background(), c, gws[1], pdSimPrompt("finb", 20, false)); err != nil || a.status != 200 || a.errMsg != "" {
		t.Fatalf("request via B: %+v %v", a, err)
	}
	waitFor(t, "A applied B's finish", func() bool { return gs[0].replicas.node.Counts.Finishes.Load() == 1 })
	if p, _ := gs[0].replicas.node.Pinned(); p != 0 || gs[0].replicas.node.Counts.FinishesUnmatched.Load() != 0 {
		t.Fatalf("A holds %d of B's pins, %d unmatched", p, gs[0].replicas.node.Counts.FinishesUnmatched.Load())
	}
	opt, err := redis.ParseURL(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	rc := redis.NewClient(opt)
	defer rc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	es, err := rc.XRange(ctx, "finish", "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]int{}
	for _, e := range es {
		v, _ := e.Values["m"].(string)
		var m replica.Msg
		if err := replica.Decode([]byte(v), &m); err != nil || m.Kind != replica.KindFinish {
			continue
		}
		kinds[fmt.Sprint(m.ID, " kind ", v[1], " hashes ", len(m.Hashes) > 0)]++
	}
	if want := map[string]int{"gw-a kind 5 hashes false": n, "gw-b kind 4 hashes true": 1}; fmt.Sprint(kinds) != fmt.Sprint(want) {
		t.Fatalf("finishes on the stream %v, want %v", kinds, want)
	}
}

// TestReplicaPinsFollowReload: the peers' pins this replica holds go with
// what they were taken on. A removed endpoint's slot is forgotten and its
// pins dropped (a later finish there only touches); an ejected endpoint's
// likewise; a reload that replaces the policy drops all of them, so the
// old policy's index is not kept alive by the pin table; the others stay
// until their finish.
func TestReplicaPinsFollowReload(t *testing.T) {
	cfg := eppBenchConfig(sched.CacheAware, 4, 1)
	cfg.Replicas = ReplicasConfig{RedisURL: "redis://127.0.0.1:1", ID: "gw-a"} // unreachable: messages applied directly
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	n := g.replicas.node
	names := make([]string, 4)
	for i, ep := range g.state.Load().pools["m0"].endpoints {
		names[i] = ep.name
	}
	learn := func(name string, h uint64) {
		t.Helper()
		if _, err := n.Apply(replica.AppendLearn(nil, "gw-b", 0, "m0", name, 32, 32, []uint64{h, h + 1}), 0); err != nil {
			t.Fatal(err)
		}
	}
	for i, name := range names {
		learn(name, uint64(10*i))
	}
	if p, _ := n.Pinned(); p != 4 {
		t.Fatalf("%d pins, want 4", p)
	}

	cfg.Endpoints = cfg.Endpoints[1:] // slot 0's endpoint removed
	if err := g.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if p, hs := n.Pinned(); p != 3 || hs != 6 || n.Counts.PinsDropped.Load() != 1 {
		t.Fatalf("after the removal: %d pins of %d hashes, %d dropped; want 3 of 6, 1", p, hs, n.Counts.PinsDropped.Load())
	}

	st := g.state.Load()
	var ejected *endpoint
	for _, ep := range st.pools["m0"].endpoints {
		if ep.name == names[1] {
			ejected = ep
		}
	}
	ejected.setReady(true)
	ejected.setReady(false) // its onDown hooks: the slot forgotten
	if p, _ := n.Pinned(); p != 2 || n.Counts.PinsDropped.Load() != 2 {
		t.Fatalf("after the ejection: %d pins, %d dropped; want 2, 2", p, n.Counts.PinsDropped.Load())
	}

	cfg.Routing.Seed++ // routing changed: a new policy
	if err := g.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	if p, hs := n.Pinned(); p != 0 || hs != 0 || n.Counts.PinsDropped.Load() != 4 {
		t.Fatalf("after the new policy: %d pins of %d hashes, %d dropped; want 0, 4", p, hs, n.Counts.PinsDropped.Load())
	}
	if e := n.Counts.PinsExpired.Load(); e != 0 {
		t.Fatalf("%d pins released by expiry", e)
	}
	// The new policy pins again.
	learn(names[2], 100)
	if p, _ := n.Pinned(); p != 1 {
		t.Fatalf("%d pins on the new policy, want 1", p)
	}
}
