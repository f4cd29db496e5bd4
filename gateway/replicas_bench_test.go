package gateway

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/infergate/infergate/replica"
	"github.com/infergate/infergate/sched"
)

// BenchmarkReplicaReceive is the exchange's receive path on the
// replica's reader goroutine, from the entry's field as go-redis returns
// it (a string) to the message applied: the copy to bytes
// (replica/stream's reader), replicas.apply — replica.Decode, the lag
// observed, Node.Apply — and, for a learn, the endpoint resolved by URL in
// the configuration in force (replicaTarget.Resolve), the approximate
// index of a cache-aware pool taught the prompt's 857 blocks (the
// Mooncake mean, 13.7k tokens) and the peer credited; for a load report,
// every endpoint's entry checked against the configuration
// (replicaTarget.Known) and the peer's loads replaced (Peers.Update).
// The learn names the pool's last endpoint (Resolve scans the pool's
// slots). go-redis's own parsing of the XREAD reply is not included.
func BenchmarkReplicaReceive(b *testing.B) {
	for _, n := range []int{64, 1000} {
		cfg := eppBenchConfig(sched.CacheAware, n, 1)
		cfg.Replicas = ReplicasConfig{RedisURL: "redis://127.0.0.1:1", ID: "gw-a"} // unreachable: apply is called directly
		g, err := New(context.Background(), cfg, nil)
		if err != nil {
			b.Fatal(err)
		}
		p := g.state.Load().pools["m0"]
		hashes := make([]uint64, 857)
		for i := range hashes {
			hashes[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
		}
		learn := string(replica.AppendLearn(nil, "gw-b", time.Now().UnixNano(), "m0", p.endpoints[n-1].name, 13720, 9000, hashes))
		entries := make([]replica.LoadEntry, n)
		for i := range entries {
			entries[i] = replica.LoadEntry{Endpoint: p.endpoints[i].name, Load: replica.Load{InFlight: int64(i % 7), InFlightTokens: int64(i * 1000), PendingPrefill: int64(i * 300)}}
		}
		load := string(replica.AppendLoad(nil, "gw-b", time.Now().UnixNano(), entries))
		r := g.replicas
		b.Run("learn/endpoints="+strconv.Itoa(n), func(b *testing.B) {
			before := r.node.Counts.Learns.Load()
			b.ReportAllocs()
			for b.Loop() {
				r.apply([]byte(learn), false)
			}
			if r.node.Counts.Learns.Load() == before {
				b.Fatal("no learn applied")
			}
		})
		b.Run("load/endpoints="+strconv.Itoa(n), func(b *testing.B) {
			before := r.node.Counts.Loads.Load()
			b.ReportAllocs()
			for b.Loop() {
				r.apply([]byte(load), false)
			}
			if r.node.Counts.Loads.Load() == before {
				b.Fatal("no load applied")
			}
			if got := r.peers.Sum(p.endpoints[n-1].name, clock(time.Now())); got != entries[n-1].Load {
				b.Fatalf("peer's load of the last endpoint %+v, want %+v", got, entries[n-1].Load)
			}
		})
		g.Close()
	}
}

// BenchmarkReplicaResolve: a peer's learn of one block applied to a pool
// of 64 or 16,384 endpoints (cache-aware's most), naming its last endpoint
// or one it lacks (what a hostile writer to the stream chooses): the
// slot's lookup must not grow with the pool.
func BenchmarkReplicaResolve(b *testing.B) {
	for _, n := range []int{64, 16384} {
		cfg := eppBenchConfig(sched.CacheAware, n, 1)
		cfg.Replicas = ReplicasConfig{RedisURL: "redis://127.0.0.1:1", ID: "gw-a"} // unreachable: apply is called directly
		g, err := New(context.Background(), cfg, nil)
		if err != nil {
			b.Fatal(err)
		}
		p := g.state.Load().pools["m0"]
		for _, c := range []struct{ what, name string }{{"last", p.endpoints[n-1].name}, {"unknown", "http://unknown:1"}} {
			learn := string(replica.AppendLearn(nil, "gw-b", time.Now().UnixNano(), "m0", c.name, 0, 0, []uint64{1}))
			b.Run(c.what+"/endpoints="+strconv.Itoa(n), func(b *testing.B) {
				for b.Loop() {
					g.replicas.apply([]byte(learn), false)
				}
			})
		}
		g.Close()
	}
}
