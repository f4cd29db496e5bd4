package gateway

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
)

// TestPrecisePoolOver64Endpoints: a precise-prefix pool of 130 endpoints
// (three groups of 64 in the precise index) routes on what the engines'
// KV events say they hold. The engines are in-process fakes: each
// endpoint's KV subscription dials an address nothing listens on (it
// retries in the background and never resets what it learnt), and the
// test hands its feed the batches an engine would publish. A prompt stored
// by endpoint e (0, 63, 64, 100, 129: the edges of the groups) goes to e,
// its follow-up too; once e reports AllBlocksCleared its index entry is
// gone; a kv_store's pool of as many endpoints takes the index's last
// slot (191 of 192).
func TestPrecisePoolOver64Endpoints(t *testing.T) {
	const n = 130
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "tcp://" + l.Addr().String()
	l.Close()
	cfg := eppBenchConfig(sched.PrecisePrefix, n, 1)
	for i := range cfg.Endpoints {
		cfg.Endpoints[i].KVEvents = &KVEventsConfig{Endpoint: dead}
	}
	g, err := New(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	ix := g.PreciseIndex("m0")
	if ix == nil || ix.Endpoints() != 192 || ix.Groups() != 3 {
		t.Fatalf("precise index %v", ix)
	}
	// Each subscription resets its appliers once when it starts; what is
	// fed after that stays.
	for i := range n {
		for deadline := time.Now().Add(30 * time.Second); kvFeedOf(g, i).sub.Stats().Resets == 0; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("endpoint %d: the subscription never started", i)
			}
		}
	}
	const shared, total = 1024, 1100 // tokens stored by the engine, and of the prompt
	prompt := func(s, tokens int) []uint32 {
		out := make([]uint32, tokens)
		for k := range out {
			out[k] = uint32(1000 + s*7919 + k)
		}
		return out
	}
	body := func(toks []uint32) []byte {
		b := []byte(`{"model":"m0","max_tokens":8,"prompt":[`)
		for k, v := range toks {
			if k > 0 {
				b = append(b, ',')
			}
			b = fmt.Append(b, v)
		}
		return append(b, "]}"...)
	}
	pick := func(toks []uint32) string {
		t.Helper()
		pk, ref := g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathCompletions, Header: http.Header{}, Body: body(toks)})
		if ref != nil {
			t.Fatalf("refused: %d %s", ref.Status, ref.Body)
		}
		defer pk.Done()
		return pk.Destinations()[0]
	}
	url := func(i int) string { return fmt.Sprintf("10.%d.%d.%d:8000", i>>16&255, i>>8&255, i&255) }
	for s, e := range []int{0, 63, 64, 100, 129} {
		toks := prompt(s, shared)
		eng := make([]uint64, shared/prefix.DefaultBlockSize)
		for k := range eng {
			eng[k] = uint64(s)<<32 | uint64(k+1) // the engine's own block hashes
		}
		kvFeedOf(g, e).KVBatch(1, &kvevents.Batch{Events: []kvevents.Event{{Type: kvevents.BlockStored,
			BlockHashes: eng, TokenIDs: toks, BlockSize: prefix.DefaultBlockSize}}})
		if got := ix.MatchEndpoint(prefix.Hashes(nil, toks, prefix.DefaultBlockSize, prefix.Seed("m0\x00")), prefix.MediumGPU, e); got != len(eng) {
			t.Fatalf("endpoint %d: the index holds %d of the %d stored blocks", e, got, len(eng))
		}
		for turn := range 2 {
			if got := pick(prompt(s, total+turn*16)); got != url(e) {
				t.Fatalf("prompt %d, turn %d: routed to %s, the KV events put its %d tokens on %s", s, turn, got, shared, url(e))
			}
		}
		kvFeedOf(g, e).KVBatch(2, &kvevents.Batch{Events: []kvevents.Event{{Type: kvevents.AllBlocksCleared}}})
		if ix.Len(e, prefix.MediumGPU) != 0 {
			t.Fatalf("endpoint %d holds %d blocks after AllBlocksCleared", e, ix.Len(e, prefix.MediumGPU))
		}
	}

	// With a kv_store the pool of 130 takes slot 191 for the store.
	store := cfg
	store.KVStores = map[string]KVStoreConfig{"m0": {Endpoint: dead, Blocks: 1000}}
	gs, err := New(context.Background(), store, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer gs.Close()
	if p := gs.state.Load().pools["m0"]; p.tiers == nil || p.tiers.Remote != 191 || p.precise.EndpointStats(191).Capacity != 1000 {
		t.Fatalf("kv_store slot: tiers %+v, capacity %d", p.tiers, p.precise.EndpointStats(191).Capacity)
	}
}
