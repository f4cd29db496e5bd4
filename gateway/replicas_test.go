package gateway

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/replica"
)

func TestReplicasConfig(t *testing.T) {
	off := ReplicasConfig{}.withDefaults()
	if off.enabled() || off.Stream != "" || len(off.validate()) != 0 {
		t.Fatalf("off: %+v", off)
	}
	on := ReplicasConfig{RedisURL: "redis://127.0.0.1:6379"}.withDefaults()
	if on.Stream == "" || on.ID == "" || on.LoadInterval != 200*time.Millisecond || on.LoadTTL != replica.DefaultLoadTTL ||
		on.MaxLen != 10000 || on.Queue != 4096 || on.Replay == nil || !*on.Replay || len(on.validate()) != 0 {
		t.Fatalf("defaults: %+v %v", on, on.validate())
	}
	for name, c := range map[string]ReplicasConfig{
		"url":      {RedisURL: "http://x"},
		"id":       {RedisURL: "redis://x:1", ID: strings.Repeat("x", 200)},
		"interval": {RedisURL: "redis://x:1", LoadInterval: -time.Second},
		"ttl":      {RedisURL: "redis://x:1", LoadInterval: time.Second, LoadTTL: time.Second},
		"max_len":  {RedisURL: "redis://x:1", MaxLen: 5},
		"queue":    {RedisURL: "redis://x:1", Queue: -1},
	} {
		errs := c.withDefaults().validate()
		if len(errs) != 1 || !strings.Contains(errs[0].Error(), "replicas.") {
			t.Errorf("%s: %v", name, errs)
		}
	}
}

// TestReplicasRedisDown: a gateway whose exchange's Redis is unreachable
// starts and routes on its own view; the exchange reports down.
func TestReplicasRedisDown(t *testing.T) {
	cfg := Config{HealthCheckPath: healthCheckOff, Endpoints: []EndpointConfig{{URL: "http://127.0.0.1:9", Model: "m", KVBlocks: 1000}},
		Replicas: ReplicasConfig{RedisURL: "redis://127.0.0.1:1", ID: "gw-x"}}
	reg := prometheus.NewRegistry()
	g, err := New(context.Background(), cfg, reg)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if g.peersOf() == nil {
		t.Fatal("exchange configured but no peers table")
	}
	p := g.state.Load().pools["m"]
	if p.peers == nil {
		t.Fatal("pool does not read the peers' load")
	}
	// The routing seed is mixed with the replica id.
	if r := g.replicaRouting(g.cfg.Routing); r.Seed != replica.Seed(0, "gw-x") {
		t.Fatalf("seed %d", r.Seed)
	}
	deadline := time.Now().Add(60 * time.Second)
	for g.replicas.x.Load() == nil || g.replicas.x.Load().Counts.Errors.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no failed Redis call counted")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if g.replicas.x.Load().Up() {
		t.Fatal("exchange up without Redis")
	}
	// A peer's load (as the reader would apply it) adds to the snapshot.
	g.replicas.peers.Update("gw-y", clock(time.Now()), []replica.LoadEntry{{Endpoint: p.endpoints[0].name, Load: replica.Load{InFlight: 3, InFlightTokens: 30, PendingPrefill: 20}}})
	sp := p.snapshot()
	defer p.release(sp)
	if e := (*sp)[0]; e.InFlight != 3 || e.InFlightTokens != 30 || e.PendingPrefillTokens != 20 {
		t.Fatalf("snapshot %+v", e)
	}
}
