package gateway

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/internal/redistest"
	"github.com/infergate/infergate/simserver"
)

// TestReplicasShareFinish: two serve replicas of one cache-aware pool
// (learn_on_finish, the default) on a real redis-server. Every request
// replica A serves publishes its learn and, when its attempt ends, its
// finish; replica B pins each learn in its approximate index and releases
// it at the finish: once A's requests are answered B has applied every
// finish and holds none of A's pins.
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
		c.Replicas = ReplicasConfig{RedisURL: srv.URL(), Stream: "finish", ID: id}
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
}
