package simserver

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sim"
)

// ---------------------------------------------------------------------------
// A KV-event subscriber written from docs/PROTOCOLS.md §1 (not from the encoder):
// payloads are decoded generically; a batch may be an array [ts, events,
// dp_rank] or a map; an event an array (tag at index 0, fields by position,
// missing trailing fields = null) or a map (tag under "type"); hashes uint64,
// int64 or bin (last 8 bytes big-endian).

// subEvent is a decoded event, normalized.
type subEvent struct {
	typ       string
	fields    map[string]any // by field name; absent = null
	positions int            // array form: number of elements including the tag; map form: 0
}

// blockStoredFields and blockRemovedFields are the field orders of
// docs/PROTOCOLS.md §1.4 (position = index in the legacy array, 0 = tag).
var (
	blockStoredFields = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
		"medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
	blockRemovedFields = []string{"block_hashes", "medium", "group_idx"}
)

type subBatch struct {
	ts     float64
	events []subEvent
	dpRank any
}

func decodeBatch(t *testing.T, payload []byte) subBatch {
	t.Helper()
	var v any
	if err := msgpack.Unmarshal(payload, &v); err != nil {
		t.Fatalf("batch is not msgpack: %v", err)
	}
	var ts, events, rank any
	switch b := v.(type) {
	case []any:
		if len(b) < 2 {
			t.Fatalf("batch array of %d elements", len(b))
		}
		ts, events = b[0], b[1]
		if len(b) > 2 {
			rank = b[2]
		}
	case map[string]any:
		ts, events, rank = b["ts"], b["events"], b["data_parallel_rank"]
	default:
		t.Fatalf("batch is a %T", v)
	}
	var out subBatch
	switch f := ts.(type) {
	case float64:
		out.ts = f
	case float32:
		out.ts = float64(f)
	default:
		t.Fatalf("ts is a %T", ts)
	}
	out.dpRank = rank
	list, ok := events.([]any)
	if !ok {
		t.Fatalf("events is a %T", events)
	}
	for _, e := range list {
		out.events = append(out.events, decodeEvent(t, e))
	}
	return out
}

func decodeEvent(t *testing.T, v any) subEvent {
	t.Helper()
	ev := subEvent{fields: map[string]any{}}
	switch e := v.(type) {
	case []any:
		if len(e) == 0 {
			t.Fatal("empty event array")
		}
		ev.typ, _ = e[0].(string)
		ev.positions = len(e)
		var names []string
		switch ev.typ {
		case "BlockStored":
			names = blockStoredFields
		case "BlockRemoved":
			names = blockRemovedFields
		}
		for i, x := range e[1:] {
			if i < len(names) && x != nil {
				ev.fields[names[i]] = x
			}
		}
	case map[string]any:
		ev.typ, _ = e["type"].(string)
		for k, x := range e {
			if k != "type" && x != nil {
				ev.fields[k] = x
			}
		}
	default:
		t.Fatalf("event is a %T", v)
	}
	if ev.typ == "" {
		t.Fatalf("event without a tag: %v", v)
	}
	return ev
}

// asUint64 converts a msgpack number or bin hash per docs/PROTOCOLS.md §1.5.
func asUint64(t *testing.T, v any) uint64 {
	t.Helper()
	switch x := v.(type) {
	case uint8:
		return uint64(x)
	case uint16:
		return uint64(x)
	case uint32:
		return uint64(x)
	case uint64:
		return x
	case int8:
		return uint64(x)
	case int16:
		return uint64(x)
	case int32:
		return uint64(x)
	case int64:
		return uint64(x)
	case []byte:
		var b [8]byte
		if len(x) >= 8 {
			copy(b[:], x[len(x)-8:])
		} else {
			copy(b[8-len(x):], x)
		}
		return binary.BigEndian.Uint64(b[:])
	}
	t.Fatalf("not an integer or bin: %T %v", v, v)
	return 0
}

func asUints(t *testing.T, v any) []uint64 {
	t.Helper()
	list, ok := v.([]any)
	if !ok {
		t.Fatalf("not a list: %T", v)
	}
	out := make([]uint64, len(list))
	for i, x := range list {
		out[i] = asUint64(t, x)
	}
	return out
}

// cacheMirror is the subscriber's view of one engine's prefix cache: a
// multiset of block hashes (vLLM does not de-duplicate identical blocks, and
// emits one BlockStored/BlockRemoved per physical block).
type cacheMirror struct {
	blocks              map[uint64]int
	stored, removed     int // events seen
	cleared             int
	firstBlocks         int // BlockStored with a null parent
	seed                uint64
	blockSize           int
	checkHashesFromToks bool
}

func newCacheMirror(blockSize int) *cacheMirror {
	return &cacheMirror{blocks: map[uint64]int{}, blockSize: blockSize, checkHashesFromToks: true}
}

// apply applies one event, checking it against the protocol and the engine's
// hashing (prefix.Hashes, chained from the parent or from the request's
// Extra, 0 without cache_salt).
func (m *cacheMirror) apply(t *testing.T, ev subEvent) {
	t.Helper()
	switch ev.typ {
	case "BlockStored":
		m.stored++
		hashes := asUints(t, ev.fields["block_hashes"])
		tokens := asUints(t, ev.fields["token_ids"])
		bs := int(asUint64(t, ev.fields["block_size"]))
		if bs != m.blockSize {
			t.Fatalf("block_size %d, want %d", bs, m.blockSize)
		}
		if len(hashes) == 0 || len(tokens) != len(hashes)*bs {
			t.Fatalf("BlockStored: %d hashes, %d tokens, block size %d", len(hashes), len(tokens), bs)
		}
		if med := ev.fields["medium"]; med != "GPU" {
			t.Fatalf("BlockStored medium %v", med)
		}
		if k := ev.fields["kv_cache_spec_kind"]; k != "full_attention" {
			t.Fatalf("BlockStored kv_cache_spec_kind %v", k)
		}
		if g, ok := ev.fields["group_idx"]; !ok || asUint64(t, g) != 0 {
			t.Fatalf("BlockStored group_idx %v", g)
		}
		if ek, ok := ev.fields["extra_keys"].([]any); !ok || len(ek) != len(hashes) {
			t.Fatalf("BlockStored extra_keys %v: want one entry per block", ev.fields["extra_keys"])
		}
		parent := m.seed
		if p, ok := ev.fields["parent_block_hash"]; ok {
			parent = asUint64(t, p)
			if m.blocks[parent] == 0 {
				t.Fatalf("BlockStored parent %#x is not a cached block", parent)
			}
		} else {
			m.firstBlocks++
		}
		if m.checkHashesFromToks {
			toks := make([]uint32, len(tokens))
			for i, x := range tokens {
				toks[i] = uint32(x)
			}
			if want := prefix.Hashes(nil, toks, bs, parent); fmt.Sprint(want) != fmt.Sprint(hashes) {
				t.Fatalf("BlockStored hashes %x do not chain from parent %#x over token_ids (want %x)", hashes, parent, want)
			}
		}
		for _, h := range hashes {
			m.blocks[h]++
		}
	case "BlockRemoved":
		m.removed++
		if med := ev.fields["medium"]; med != "GPU" {
			t.Fatalf("BlockRemoved medium %v", med)
		}
		for _, h := range asUints(t, ev.fields["block_hashes"]) {
			if m.blocks[h] == 0 {
				t.Fatalf("BlockRemoved of unknown hash %#x", h)
			}
			if m.blocks[h]--; m.blocks[h] == 0 {
				delete(m.blocks, h)
			}
		}
	case "AllBlocksCleared":
		m.cleared++
		clear(m.blocks)
	default:
		t.Fatalf("unknown event type %q", ev.typ)
	}
}

func sameMultiset(a, b map[uint64]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// ---------------------------------------------------------------------------
// Engine events through the encoding

func TestEngineKVEventsRebuildCache(t *testing.T) {
	// A tiny cache under a randomized workload with shared prefixes: stores,
	// evictions and preemptions. Applying each step's events, encoded and
	// decoded as a subscriber would, must reproduce the engine's cached set.
	for _, enc := range []string{kvevents.EncodingArray, kvevents.EncodingMap} {
		t.Run(enc, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(7, 11))
			e := sim.NewEngine(sim.Config{NumBlocks: 40, MaxNumBatchedTokens: 96, KVEvents: true})
			m := newCacheMirror(e.Config().BlockSize)
			prefixes := [][]uint32{seqTokens(100, 64), seqTokens(300, 48), seqTokens(500, 80)}
			var now time.Duration
			id := 0
			for step := 0; step < 3000; step++ {
				if rng.IntN(3) == 0 && id < 400 {
					p := prefixes[rng.IntN(len(prefixes))]
					toks := slices.Concat(p, seqTokens(10000+id*7, rng.IntN(60)+1))
					must(t, e.Add(&sim.Request{ID: fmt.Sprint(id), Tokens: toks, MaxTokens: rng.IntN(40) + 1}, now))
					id++
				}
				if !e.HasWork() {
					continue
				}
				r := e.Step(now)
				now += r.Duration
				payload := kvevents.AppendBatch(nil, now.Seconds(), r.Events, 0, enc)
				for _, ev := range decodeBatch(t, payload).events {
					m.apply(t, ev)
				}
				if got := e.CachedHashes(); !sameMultiset(m.blocks, got) {
					t.Fatalf("step %d: rebuilt cache has %d hashes, engine %d", step, len(m.blocks), len(got))
				}
			}
			for e.HasWork() {
				r := e.Step(now)
				now += r.Duration
				for _, ev := range decodeBatch(t, kvevents.AppendBatch(nil, 0, r.Events, 0, enc)).events {
					m.apply(t, ev)
				}
			}
			if !sameMultiset(m.blocks, e.CachedHashes()) {
				t.Fatal("rebuilt cache differs from the engine's after draining")
			}
			st := e.Stats()
			t.Logf("%d BlockStored, %d BlockRemoved, %d preemptions, %d cached blocks", m.stored, m.removed, st.Preemptions, len(m.blocks))
			if m.removed == 0 || st.Preemptions == 0 || m.stored == 0 {
				t.Fatalf("workload too gentle: %d removed, %d preemptions", m.removed, st.Preemptions)
			}
			if m.firstBlocks == 0 || m.firstBlocks == m.stored {
				t.Fatalf("want both first-block and chained stores; %d of %d have no parent", m.firstBlocks, m.stored)
			}

			// Reset: AllBlocksCleared, empty cache, then fresh first-block stores.
			if !e.ResetPrefixCache() {
				t.Fatal("ResetPrefixCache failed on an idle engine")
			}
			evs := e.TakeKVEvents()
			if len(evs) != 1 || evs[0].Type != kvevents.AllBlocksCleared {
				t.Fatalf("events after reset: %+v", evs)
			}
			if e.TakeKVEvents() != nil {
				t.Fatal("TakeKVEvents returned the events twice")
			}
			for _, ev := range decodeBatch(t, kvevents.AppendBatch(nil, 0, evs, 0, enc)).events {
				m.apply(t, ev)
			}
			if len(e.CachedHashes()) != 0 || len(m.blocks) != 0 {
				t.Fatal("cache not empty after reset")
			}
		})
	}
}

// ---------------------------------------------------------------------------
// Encoding

func TestKVEventEncodingForms(t *testing.T) {
	stored := kvevents.Event{Type: kvevents.BlockStored, BlockHashes: []uint64{1 << 63, 5}, HasParent: true, ParentBlockHash: 42,
		TokenIDs: seqTokens(1, 4), BlockSize: 2}
	first := kvevents.Event{Type: kvevents.BlockStored, BlockHashes: []uint64{9}, TokenIDs: seqTokens(1, 2), BlockSize: 2}
	removed := kvevents.Event{Type: kvevents.BlockRemoved, BlockHashes: []uint64{5}}
	cleared := kvevents.Event{Type: kvevents.AllBlocksCleared}
	evs := []kvevents.Event{stored, first, removed, cleared}

	// Array form: positional, trailing defaults (sliding window; BlockRemoved
	// group_idx) omitted, fields without defaults present even when null.
	arr := kvevents.AppendBatch(nil, 1.5, evs, 0, kvevents.EncodingArray)
	var raw []any
	if err := msgpack.Unmarshal(arr, &raw); err != nil {
		t.Fatal(err)
	}
	if len(raw) != 3 || raw[0] != 1.5 || asUint64(t, raw[2]) != 0 {
		t.Fatalf("batch %v", raw)
	}
	list := raw[1].([]any)
	wantLens := []int{11, 11, 3, 1}
	for i, w := range wantLens {
		a, ok := list[i].([]any)
		if !ok || len(a) != w {
			t.Fatalf("event %d: %v, want an array of %d", i, list[i], w)
		}
	}
	if e := list[1].([]any); e[2] != nil || e[5] != nil || e[7] != nil || e[6] != "GPU" || e[10] != "full_attention" {
		t.Fatalf("first-block BlockStored %v", e)
	}
	if h := asUint64(t, list[0].([]any)[1].([]any)[0]); h != 1<<63 {
		t.Fatalf("hash above int64 decoded as %#x", h)
	}
	// Exact bytes of the small events (msgpack spec): ["BlockRemoved", [5], "GPU"], ["AllBlocksCleared"].
	wantRemoved := append(append([]byte{0x93, 0xac}, "BlockRemoved"...), 0x91, 0x05, 0xa3, 'G', 'P', 'U')
	wantCleared := append([]byte{0x91, 0xb0}, "AllBlocksCleared"...)
	if !bytes.Contains(arr, append(wantRemoved, wantCleared...)) {
		t.Fatalf("array encoding of BlockRemoved/AllBlocksCleared: % x", arr)
	}

	// Map form: tag under "type", keys by name, defaults omitted.
	mp := kvevents.AppendBatch(nil, 1.5, evs, 0, kvevents.EncodingMap)
	raw = nil
	if err := msgpack.Unmarshal(mp, &raw); err != nil {
		t.Fatal(err)
	}
	list = raw[1].([]any)
	keys := func(v any) string {
		m := v.(map[string]any)
		var ks []string
		for _, f := range append([]string{"type"}, blockStoredFields...) {
			if _, ok := m[f]; ok {
				ks = append(ks, f)
			}
		}
		if len(ks) != len(m) {
			t.Fatalf("unexpected keys in %v", m)
		}
		return strings.Join(ks, ",")
	}
	if k := keys(list[0]); k != "type,block_hashes,parent_block_hash,token_ids,block_size,lora_id,medium,lora_name,extra_keys,group_idx,kv_cache_spec_kind" {
		t.Fatalf("BlockStored keys %s", k)
	}
	if k := keys(list[2]); k != "type,block_hashes,medium" {
		t.Fatalf("BlockRemoved keys %s", k)
	}
	if k := keys(list[3]); k != "type" {
		t.Fatalf("AllBlocksCleared keys %s", k)
	}
	if m := list[1].(map[string]any); m["parent_block_hash"] != nil || m["type"] != "BlockStored" {
		t.Fatalf("first-block BlockStored %v", m)
	}
	// Both forms decode to the same events.
	a, b := decodeBatch(t, arr), decodeBatch(t, mp)
	for i := range a.events {
		a.events[i].positions = 0
	}
	if fmt.Sprint(a.events) != fmt.Sprint(b.events) {
		t.Fatalf("array and map forms differ:\n%v\n%v", a.events, b.events)
	}
}

// TestKVEventsConfigRejected: NewServer refuses a bad KV-event publisher
// configuration (kvevents.PublisherConfig.Validate; the rest of the
// configuration's checks are kvevents' TestPublisherConfig).
func TestKVEventsConfigRejected(t *testing.T) {
	if _, err := NewServer(ServerConfig{KVEvents: kvevents.PublisherConfig{Enable: true, Encoding: "xml"}}); err == nil {
		t.Error("NewServer accepted a bad kv events config")
	}
}

// ---------------------------------------------------------------------------
// ZeroMQ: publisher and a real Server over loopback

// seqTokens returns n distinct tokens starting at base*1_000_000 (as
// ../sim/engine_test.go's, so the engine's events here match its tests').
func seqTokens(base, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(base*1_000_000 + i)
	}
	return t
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// vocabTokens returns n distinct token ids from base on (inside the model's vocabulary).
func vocabTokens(base, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(base + i)
	}
	return t
}

// zmqMsg is one received PUB message.
type zmqMsg struct {
	topic   string
	seq     uint64
	payload []byte
}

// subscribe runs a SUB socket (dialing ep, or binding it when bind) that
// subscribes to prefix and forwards messages until ctx ends.
func subscribe(t *testing.T, ctx context.Context, ep string, bind bool, prefix string) (<-chan zmqMsg, string) {
	t.Helper()
	sub := zmq4.NewSub(ctx)
	var err error
	if bind {
		err = sub.Listen(ep)
	} else {
		err = sub.Dial(ep)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, prefix); err != nil {
		t.Fatal(err)
	}
	addr := ""
	if bind {
		addr = sub.Addr().String()
	}
	ch := make(chan zmqMsg, 1<<16)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(ch)
		for {
			msg, err := sub.Recv()
			if err != nil {
				return
			}
			if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
				t.Errorf("PUB message of %d frames", len(msg.Frames))
				return
			}
			ch <- zmqMsg{string(msg.Frames[0]), binary.BigEndian.Uint64(msg.Frames[1]), msg.Frames[2]}
		}
	}()
	t.Cleanup(func() {
		_ = sub.Close()
		wg.Wait()
	})
	return ch, addr
}

// replayFrom asks a replay ROUTER at addr, with a DEALER socket, for every
// batch from start on; it returns them in order and checks the end marker.
func replayFrom(t *testing.T, addr string, start uint64) []zmqMsg {
	t.Helper()
	d := zmq4.NewDealer(context.Background())
	defer d.Close()
	if err := d.Dial("tcp://" + addr); err != nil {
		t.Fatal(err)
	}
	req := binary.BigEndian.AppendUint64(nil, start)
	if err := d.Send(zmq4.NewMsgFrom([]byte{}, req)); err != nil {
		t.Fatal(err)
	}
	var out []zmqMsg
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			msg, err := d.Recv()
			if err != nil {
				t.Errorf("replay recv: %v", err)
				return
			}
			if len(msg.Frames) != 3 || len(msg.Frames[0]) != 0 || len(msg.Frames[1]) != 8 {
				t.Errorf("replay reply of %d frames", len(msg.Frames))
				return
			}
			seq := binary.BigEndian.Uint64(msg.Frames[1])
			if seq == 0xFFFFFFFFFFFFFFFF {
				if len(msg.Frames[2]) != 0 {
					t.Error("end marker with a payload")
				}
				return
			}
			out = append(out, zmqMsg{seq: seq, payload: msg.Frames[2]})
		}
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("replay timed out")
	}
	return out
}

// waitSent waits until every batch queued on p has been handed to its PUB socket.
func waitSent(t *testing.T, p *kvevents.Publisher) {
	t.Helper()
	waitFor(t, "the publisher to send its queue", func() bool {
		n := p.NextSeq()
		st := p.Stats()
		return st.Published+st.Dropped == n
	})
}

func TestServerKVEventsOverZMQ(t *testing.T) {
	for _, tc := range []struct {
		enc  string
		bind bool // the simulator binds (tcp://*:0) or connects to a bound SUB
	}{{kvevents.EncodingArray, false}, {kvevents.EncodingMap, true}} {
		t.Run(tc.enc, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			const topic = "kv@127.0.0.1@" + testModel
			cfg := kvevents.PublisherConfig{Enable: true, Topic: topic, Encoding: tc.enc, ReplayEndpoint: "tcp://127.0.0.1:0"}
			var live <-chan zmqMsg
			if tc.bind {
				cfg.Endpoint = "tcp://*:0"
			} else {
				var addr string
				live, addr = subscribe(t, ctx, "tcp://127.0.0.1:0", true, "kv@")
				cfg.Endpoint = "tcp://" + addr
			}
			// 48 blocks of 16 tokens: the workload below evicts.
			s, ts := newTestServer(t, ServerConfig{Engine: sim.Config{NumBlocks: 48}, KVEvents: cfg})
			p := s.KVEventPublisher()
			if tc.bind {
				port := p.Addr().(*net.TCPAddr).Port
				live, _ = subscribe(t, ctx, fmt.Sprintf("tcp://127.0.0.1:%d", port), false, "kv@")
			}
			complete := func(toks []uint32, maxTokens int) {
				t.Helper()
				body := fmt.Sprintf(`{"model":%q,"prompt":%s,"max_tokens":%d}`, testModel, strings.ReplaceAll(fmt.Sprint(toks), " ", ","), maxTokens)
				r := post(t, ts, "/v1/completions", body)
				r.Body.Close()
				if r.StatusCode != http.StatusOK {
					t.Fatalf("completion: %d", r.StatusCode)
				}
			}
			// Slow joiner: repeat a warm-up request (new tokens each time, so it
			// stores blocks) until the subscriber receives a message.
			var first zmqMsg
		warm:
			for i := 0; ; i++ {
				complete(vocabTokens(50000+i*32, 32), 1)
				select {
				case first = <-live:
					break warm
				case <-time.After(50 * time.Millisecond):
				}
				if i > 400 {
					t.Fatal("no KV event reached the subscriber")
				}
			}

			// Workload: shared system prompts, concurrent requests, evictions.
			sys := [][]uint32{vocabTokens(1000, 100), vocabTokens(2000, 70)}
			var wg sync.WaitGroup
			for w := range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for j := range 8 {
						toks := slices.Concat(sys[(w+j)%2], vocabTokens(10000+w*1000+j*50, 20+(w*j)%40))
						complete(toks, 10+j)
					}
				}()
			}
			wg.Wait()
			waitSent(t, p)

			var want map[uint64]int
			if !s.withEngine(func(e *sim.Engine, _ time.Duration) { want = e.CachedHashes() }) {
				t.Fatal("withEngine")
			}
			// Everything from seq 0, through the replay socket.
			all := replayFrom(t, p.ReplayAddr().String(), 0)
			m := newCacheMirror(16)
			var lastTS float64
			for i, msg := range all {
				if msg.seq != uint64(i) {
					t.Fatalf("replay: batch %d has seq %d", i, msg.seq)
				}
				b := decodeBatch(t, msg.payload)
				if b.ts < lastTS || b.ts < float64(time.Now().Add(-time.Hour).Unix()) {
					t.Fatalf("batch %d ts %v (previous %v)", i, b.ts, lastTS)
				}
				lastTS = b.ts
				if asUint64(t, b.dpRank) != 0 || len(b.events) == 0 {
					t.Fatalf("batch %d: rank %v, %d events", i, b.dpRank, len(b.events))
				}
				for _, ev := range b.events {
					m.apply(t, ev)
				}
			}
			if !sameMultiset(m.blocks, want) {
				t.Fatalf("rebuilt cache (%d hashes) differs from the engine's (%d)", len(m.blocks), len(want))
			}
			if m.removed == 0 {
				t.Fatal("no BlockRemoved under a tiny cache")
			}
			t.Logf("%d batches: %d BlockStored, %d BlockRemoved, %d cached hashes", len(all), m.stored, m.removed, len(m.blocks))

			// Live stream: gap-free from the first message received, same
			// payloads as the replay buffer.
			msgs := []zmqMsg{first}
			for len(msgs) == 0 || msgs[len(msgs)-1].seq < uint64(len(all)-1) {
				select {
				case msg := <-live:
					msgs = append(msgs, msg)
				case <-time.After(30 * time.Second):
					t.Fatalf("live stream stalled after seq %d of %d", msgs[len(msgs)-1].seq, len(all)-1)
				}
			}
			for i, msg := range msgs {
				if msg.topic != topic || (i > 0 && msg.seq != msgs[i-1].seq+1) || !bytes.Equal(msg.payload, all[msg.seq].payload) {
					t.Fatalf("live message %d: topic %q seq %d", i, msg.topic, msg.seq)
				}
			}

			// Replay from the middle returns the tail only.
			if mid := uint64(len(all) / 2); len(replayFrom(t, p.ReplayAddr().String(), mid)) != len(all)-int(mid) {
				t.Fatal("replay from the middle")
			}

			// Reset the prefix cache: AllBlocksCleared, published at once.
			if !s.ResetPrefixCache() {
				t.Fatal("ResetPrefixCache failed on an idle server")
			}
			select {
			case msg := <-live:
				b := decodeBatch(t, msg.payload)
				if msg.seq != uint64(len(all)) || len(b.events) != 1 || b.events[0].typ != "AllBlocksCleared" {
					t.Fatalf("after reset: seq %d, events %v", msg.seq, b.events)
				}
				m.apply(t, b.events[0])
			case <-time.After(30 * time.Second):
				t.Fatal("no AllBlocksCleared")
			}
			s.withEngine(func(e *sim.Engine, _ time.Duration) { want = e.CachedHashes() })
			if len(want) != 0 || len(m.blocks) != 0 {
				t.Fatal("cache not empty after reset")
			}
			// The subscriber can read the batch before the publisher counts
			// it sent (the count follows the socket write).
			waitSent(t, p)
			if st := p.Stats(); st.Dropped != 0 || st.Published != uint64(len(all)+1) {
				t.Fatalf("publisher stats %+v", st)
			}
		})
	}
}

func TestServerKVEventsCloseWithoutLeaks(t *testing.T) {
	before, _ := liveGoroutines()
	s, err := NewServer(ServerConfig{TimeScale: 1000, KVEvents: kvevents.PublisherConfig{Enable: true, Endpoint: "tcp://*:0", ReplayEndpoint: "tcp://127.0.0.1:0"}})
	if err != nil {
		t.Fatal(err)
	}
	s.Close() // never started: the publisher still closes
	if s.ResetPrefixCache() {
		t.Fatal("reset on a closed server")
	}
	s, err = NewServer(ServerConfig{TimeScale: 1000, KVEvents: kvevents.PublisherConfig{Enable: true, Endpoint: "tcp://*:0"}})
	if err != nil {
		t.Fatal(err)
	}
	s.Start()
	if !s.ResetPrefixCache() {
		t.Fatal("reset on an idle server")
	}
	waitSent(t, s.KVEventPublisher())
	s.Close()
	waitNoLeak(t, before)
}

// liveGoroutines counts goroutines, leaving out the one go-zeromq/zmq4
// v0.17.0 leaks per PUB socket: socket.Close never closes the socket's
// pubMWriter, whose run goroutine waits on a condition variable forever.
func liveGoroutines() (int, string) {
	buf := make([]byte, 4<<20)
	all := string(buf[:runtime.Stack(buf, true)])
	n := 0
	var kept []string
	for _, g := range strings.Split(all, "\n\n") {
		if strings.Contains(g, "zmq4.(*pubMWriter).run") {
			continue
		}
		n++
		kept = append(kept, g)
	}
	return n, strings.Join(kept, "\n\n")
}

func waitNoLeak(t *testing.T, before int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		n, stacks := liveGoroutines()
		if n <= before {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines, want <= %d:\n%s", n, before, stacks)
		}
	}
}

// infergate_sim_kv_event_batches_total counts the batches queued for
// publishing: a subscriber that applied as many has every event of the
// responses it has seen.
func TestKVEventBatchesMetric(t *testing.T) {
	s, ts := newTestServer(t, ServerConfig{KVEvents: kvevents.PublisherConfig{Enable: true, Endpoint: "tcp://127.0.0.1:0", Bind: true}})
	chatUsage(t, ts, []openai.Message{{Role: "user", Content: textContent(strings.Repeat("hello there ", 40))}}, 4)
	m := gatherOne(t, s, "infergate_sim_kv_event_batches_total")
	if m == nil || len(m.Metric) != 1 {
		t.Fatalf("metric: %v", m)
	}
	if got, want := m.Metric[0].GetCounter().GetValue(), float64(s.KVEventPublisher().NextSeq()); got != want || got < 1 {
		t.Fatalf("batches %v, publisher's next sequence number %v", got, want)
	}
}
