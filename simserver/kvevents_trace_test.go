package simserver

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
)

const mooncakeTracePath = "../data/mooncake_conversation_trace.jsonl"

// TestKVEventsDuringTraceReplay replays the start of the real Mooncake
// conversation trace through one simulated engine with KV events on (array
// encoding, the simulator binding tcp://*:0) and a KV cache small enough to
// evict, then fetches every batch from sequence 0 through the replay socket
// and decodes it with the docs/PROTOCOLS.md subscriber of kvevents_test.go: every
// event must decode, sequence numbers must be gap-free, and replaying the
// stores and removals must rebuild exactly the engine's cached block set.
func TestKVEventsDuringTraceReplay(t *testing.T) {
	if testing.Short() {
		t.Skip("trace replay skipped in -short mode")
	}
	recs, err := trace.LoadMooncake(mooncakeTracePath)
	if err != nil {
		t.Fatal(err)
	}
	const numBlocks = 6000 // 96k tokens: the replay below evicts
	cfg := kvevents.PublisherConfig{Enable: true, Endpoint: "tcp://*:0", ReplayEndpoint: "tcp://127.0.0.1:0", Encoding: kvevents.EncodingArray, Topic: "kv@sim@" + testModel}
	s, ts := newTestServer(t, ServerConfig{Engine: sim.Config{Profile: sim.Llama8BH100(), NumBlocks: numBlocks}, Model: testModel, TimeScale: 1000, KVEvents: cfg})
	p := s.KVEventPublisher()

	// The first 80 records that fit, sent in arrival order four at a time.
	var sent int
	sem := make(chan struct{}, 4)
	var wg sync.WaitGroup
	for _, r := range recs {
		if sent == 80 {
			break
		}
		if r.InputLength+16 > numBlocks*sim.DefaultBlockSize/2 {
			continue
		}
		sent++
		toks := r.Tokens(nil)
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			var b strings.Builder
			fmt.Fprintf(&b, `{"model":%q,"max_tokens":16,"prompt":[`, testModel)
			for i, id := range toks {
				if i > 0 {
					b.WriteByte(',')
				}
				fmt.Fprint(&b, id)
			}
			b.WriteString("]}")
			resp := post(t, ts, "/v1/completions", b.String())
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("completion: status %d", resp.StatusCode)
			}
		}()
	}
	wg.Wait()
	waitSent(t, p)

	var want map[uint64]int
	if !s.withEngine(func(e *sim.Engine, _ time.Duration) { want = e.CachedHashes() }) {
		t.Fatal("withEngine")
	}
	all := replayFrom(t, p.ReplayAddr().String(), 0)
	m := newCacheMirror(sim.DefaultBlockSize)
	events := 0
	for i, msg := range all {
		if msg.seq != uint64(i) {
			t.Fatalf("batch %d has seq %d: gap", i, msg.seq)
		}
		for _, ev := range decodeBatch(t, msg.payload).events {
			m.apply(t, ev)
			events++
		}
	}
	if !sameMultiset(m.blocks, want) {
		t.Fatalf("cache rebuilt from %d events (%d hashes) differs from the engine's (%d hashes)", events, len(m.blocks), len(want))
	}
	if m.stored == 0 || m.removed == 0 {
		t.Fatalf("stored %d, removed %d: the replay should store and evict", m.stored, m.removed)
	}
	if st := p.Stats(); st.Dropped != 0 || st.Published != uint64(len(all)) {
		t.Fatalf("publisher stats %+v for %d batches", st, len(all))
	}
	t.Logf("%d requests, %d batches, %d events decoded: %d BlockStored, %d BlockRemoved, %d cached hashes",
		sent, len(all), events, m.stored, m.removed, len(m.blocks))
}
