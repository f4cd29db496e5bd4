package gateway

import (
	"context"
	"fmt"
	"testing"

	"github.com/infergate/infergate/internal/redistest"
)

// TestReplicasPDExchange: two serve replicas of one P/D pool (two
// prefill, two decode simulated engines, NIXL) on a real redis-server.
// A conversation's first turn, split on replica A, publishes D's and P's
// learns (replica.KindLearnPD); replica B applies them to its decode and
// prefill profiles, so the second turn, split on B, goes to the P that
// computed the shared system message and to the D that holds it. Four
// sessions: by chance alone B would match A's P and D in all of them 1
// time in 256.
func TestReplicasPDExchange(t *testing.T) {
	srv := redistest.Start(t, 0)
	f, cfg := startSimPD(t, 2, 2, "nixl")
	P, D := f.URLs[:2], f.URLs[2:]
	gws := make([]string, 2)
	gs := make([]*Gateway, 2)
	for i, id := range []string{"gw-a", "gw-b"} {
		c := cfg
		c.Replicas = ReplicasConfig{RedisURL: srv.URL(), Stream: "pd", ID: id}
		gs[i], gws[i] = startGateway(t, c)
	}
	waitFor(t, "both exchanges up", func() bool {
		return gs[0].replicas.x.Load().Up() && gs[1].replicas.x.Load().Up()
	})
	c := testClient(t)
	ctx := context.Background()
	counts := func(urls []string, name string) []float64 {
		out := make([]float64, len(urls))
		for i, u := range urls {
			out[i] = simValue(t, c, u, name)
		}
		return out
	}
	// which returns the one engine whose counter grew from before, -1 if
	// not exactly one.
	which := func(before, after []float64) int {
		got := -1
		for i := range before {
			if after[i] > before[i] {
				if got >= 0 {
					return -1
				}
				got = i
			}
		}
		return got
	}
	const served = "vllm:request_success_total"
	for s := range 4 {
		tag := fmt.Sprintf("sess%d", s)
		var ps, ds [2]int
		for turn, words := range []int{10, 300} {
			pb, db := counts(P, served), counts(D, served)
			a, err := chat(ctx, c, gws[turn], pdSimPrompt(tag, words, false))
			if err != nil || a.status != 200 || a.errMsg != "" || a.text == "" {
				t.Fatalf("session %d turn %d: %+v %v", s, turn, a, err)
			}
			waitFor(t, "the legs counted", func() bool {
				ps[turn], ds[turn] = which(pb, counts(P, served)), which(db, counts(D, served))
				return ps[turn] >= 0 && ds[turn] >= 0
			})
			if turn == 0 {
				// B has applied A's two learns of this turn (D's and P's).
				waitFor(t, "B applied A's learns", func() bool {
					return gs[1].replicas.node.Counts.Learns.Load() == uint64(2*(s+1))
				})
			}
		}
		if ps[1] != ps[0] || ds[1] != ds[0] {
			t.Fatalf("session %d: A split to P%d/D%d, B to P%d/D%d: B did not learn A's picks", s, ps[0], ds[0], ps[1], ds[1])
		}
	}
	// And A learnt B's: each replica applied the other's (2 per split turn).
	if n := gs[0].replicas.node.Counts.Learns.Load(); n != 8 {
		t.Fatalf("A applied %d learns of B, want 8", n)
	}
	if n := gs[0].replicas.node.Counts.Unknown.Load() + gs[1].replicas.node.Counts.Unknown.Load(); n != 0 {
		t.Fatalf("%d learns unknown", n)
	}
}
