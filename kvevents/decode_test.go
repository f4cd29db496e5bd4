package kvevents

import (
	"bytes"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/infergate/infergate/prefix"
)

func TestDecodeBatchSimForms(t *testing.T) {
	evs := []Event{
		{Type: BlockStored, BlockHashes: []uint64{1 << 63, 5}, HasParent: true, ParentBlockHash: 42,
			TokenIDs: []uint32{1, 2, 3, 70000}, BlockSize: 2, LoRAName: "ad1", LoRAID: 1},
		{Type: BlockStored, BlockHashes: []uint64{9}, TokenIDs: []uint32{7, 8}, BlockSize: 2},
		{Type: BlockRemoved, BlockHashes: []uint64{5}},
		{Type: AllBlocksCleared},
		{Type: TierBlocksCleared},
		// An offload event of a lower tier: no token ids, no parent (vLLM's
		// OffloadingConnector), and its removal.
		{Type: BlockStored, BlockHashes: []uint64{9}, BlockSize: 2, Medium: MediumCPU},
		{Type: BlockRemoved, BlockHashes: []uint64{9}, Medium: MediumRemote},
	}
	want := Batch{TS: 1.5, DataParallelRank: 0, Events: []Event{
		{Type: BlockStored, BlockHashes: []uint64{1 << 63, 5}, HasParent: true, ParentBlockHash: 42,
			TokenIDs: []uint32{1, 2, 3, 70000}, BlockSize: 2, LoRAName: "ad1", LoRAID: 1, Medium: "GPU", GroupIdx: 0},
		{Type: BlockStored, BlockHashes: []uint64{9}, TokenIDs: []uint32{7, 8}, BlockSize: 2, Medium: "GPU", GroupIdx: 0},
		{Type: BlockRemoved, BlockHashes: []uint64{5}, Medium: "GPU", GroupIdx: -1},
		{Type: AllBlocksCleared, GroupIdx: -1},
		{Type: TierBlocksCleared, Medium: "GPU", GroupIdx: -1},
		{Type: BlockStored, BlockHashes: []uint64{9}, TokenIDs: []uint32{}, BlockSize: 2, Medium: "CPU", GroupIdx: 0},
		{Type: BlockRemoved, BlockHashes: []uint64{9}, Medium: "REMOTE", GroupIdx: -1},
	}}
	for _, enc := range []string{EncodingArray, EncodingMap} {
		got, err := DecodeBatch(AppendBatch(nil, 1.5, evs, 0, enc))
		if err != nil {
			t.Fatalf("%s: %v", enc, err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s:\n got %+v\nwant %+v", enc, got, want)
		}
	}
}

// kvMarshal encodes v with sorted map keys (so "type" comes last in events).
func kvMarshal(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.SetSortMapKeys(true)
	if err := enc.Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestDecodeBatchVariants(t *testing.T) {
	h32 := bytes.Repeat([]byte{0xee}, 24)
	h32 = append(h32, 1, 2, 3, 4, 5, 6, 7, 8)
	cases := []struct {
		name    string
		payload any
		want    Batch
	}{{
		name: "map batch, map events, bin and int64 hashes, unknown keys",
		payload: map[string]any{"ts": 2.0, "data_parallel_rank": int8(3), "extra": []any{1, 2}, "events": []any{
			map[string]any{"type": "BlockStored", "block_hashes": []any{h32, []byte{1, 2}, int64(-1)},
				"parent_block_hash": nil, "token_ids": []any{uint8(1), uint16(300), uint32(70000), int64(5), int8(7), 0},
				"block_size": uint64(2), "medium": "cpu", "lora_name": nil, "extra_keys": []any{[]any{"x", []any{"y", 1}}, nil, nil},
				"group_idx": nil, "future_field": map[string]any{"a": 1}},
			map[string]any{"block_hashes": []any{uint64(7)}, "type": "BlockRemoved"},
			map[string]any{"type": "SomethingNew", "x": 1},
		}},
		want: Batch{TS: 2, DataParallelRank: 3, Unknown: 1, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{0x0102030405060708, 0x0102, ^uint64(0)},
				TokenIDs: []uint32{1, 300, 70000, 5, 7, 0}, BlockSize: 2, Medium: "cpu", GroupIdx: -1},
			{Type: BlockRemoved, BlockHashes: []uint64{7}, GroupIdx: -1},
		}},
	}, {
		name: "array batch without rank, old 5-field BlockStored, extra positions, int ts",
		payload: []any{int64(1700000000), []any{
			[]any{"BlockStored", []any{uint64(11)}, uint64(10), []any{1, 2}, 2, nil},
			[]any{"BlockRemoved", []any{uint64(11)}, "GPU", 0, "future", []any{1}},
			[]any{"AllBlocksCleared", "future"},
			[]any{42, "not a tag"},
		}},
		want: Batch{TS: 1700000000, DataParallelRank: -1, Unknown: 1, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{11}, HasParent: true, ParentBlockHash: 10, TokenIDs: []uint32{1, 2}, BlockSize: 2, GroupIdx: -1},
			{Type: BlockRemoved, BlockHashes: []uint64{11}, Medium: "GPU", GroupIdx: 0},
			{Type: AllBlocksCleared, GroupIdx: -1},
		}},
	}, {
		name:    "empty events, null rank, trailing batch fields",
		payload: []any{1.0, []any{}, nil, "x"},
		want:    Batch{TS: 1, DataParallelRank: -1, Events: []Event{}},
	}, {
		name:    "long lora name",
		payload: []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{1}, 1, 3, nil, strings.Repeat("a", 100)}}},
		want: Batch{TS: 1, DataParallelRank: -1, Events: []Event{
			{Type: BlockStored, BlockHashes: []uint64{1}, TokenIDs: []uint32{1}, BlockSize: 1, LoRAID: 3, LoRAName: strings.Repeat("a", 100), GroupIdx: -1},
		}},
	}}
	for _, tc := range cases {
		got, err := DecodeBatch(kvMarshal(t, tc.payload))
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Fatalf("%s:\n got %+v\nwant %+v", tc.name, got, tc.want)
		}
	}

	deep := []any{"x"}
	for range 100 {
		deep = []any{deep}
	}
	for name, payload := range map[string][]byte{
		"empty":            nil,
		"not msgpack":      {0xc1},
		"truncated":        kvMarshal(t, []any{1.0, []any{[]any{"BlockRemoved", []any{1, 2, 3}}}})[:12],
		"batch scalar":     kvMarshal(t, 5),
		"short batch":      kvMarshal(t, []any{1.0}),
		"map w/o events":   kvMarshal(t, map[string]any{"ts": 1.0}),
		"ts string":        kvMarshal(t, []any{"x", []any{}}),
		"events map":       kvMarshal(t, []any{1.0, map[string]any{}}),
		"event scalar":     kvMarshal(t, []any{1.0, []any{7}}),
		"empty event":      kvMarshal(t, []any{1.0, []any{[]any{}}}),
		"hashes string":    kvMarshal(t, []any{1.0, []any{[]any{"BlockRemoved", "abc"}}}),
		"hash float":       kvMarshal(t, []any{1.0, []any{[]any{"BlockRemoved", []any{1.5}}}}),
		"hash null":        kvMarshal(t, []any{1.0, []any{[]any{"BlockRemoved", []any{nil}}}}),
		"negative token":   kvMarshal(t, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{-1}, 1}}}),
		"huge token":       kvMarshal(t, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{int64(1) << 40}, 1}}}),
		"medium int":       kvMarshal(t, []any{1.0, []any{[]any{"BlockRemoved", []any{1}, 5}}}),
		"block size str":   kvMarshal(t, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{1}, "16"}}}),
		"deep ignored":     kvMarshal(t, []any{1.0, []any{[]any{"BlockRemoved", []any{1}, "GPU", 0, deep}}}),
		"forged length":    {0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff},
		"forged bin hash":  {0x92, 0x01, 0x91, 0x92, 0xac, 'B', 'l', 'o', 'c', 'k', 'R', 'e', 'm', 'o', 'v', 'e', 'd', 0x91, 0xc6, 0xff, 0xff, 0xff, 0xff},
		"forged long name": {0x92, 0x01, 0x91, 0x91, 0xdb, 0x7f, 0xff, 0xff, 0xff},
	} {
		if b, err := DecodeBatch(payload); err == nil {
			t.Errorf("%s: decoded %+v, want an error", name, b)
		}
	}

	// Lengths claimed by skipped values cost nothing (found by the fuzzer: an
	// ext32 key of 808 MB made the msgpack decoder's Skip allocate 1 MB).
	for _, payload := range [][]byte{
		[]byte("\x88\xc90000"), // ext32 map key
		{0x92, 0x01, 0x91, 0x92, 0xa1, 'X', 0xdb, 0x7f, 0xff, 0xff, 0xff}, // str32 extra position
		{0x92, 0x01, 0x91, 0x92, 0xa1, 'X', 0xc6, 0x7f, 0xff, 0xff, 0xff}, // bin32 extra position
	} {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for range 10 {
			if _, err := DecodeBatch(payload); err == nil {
				t.Fatalf("% x decoded", payload)
			}
		}
		runtime.ReadMemStats(&after)
		if d := after.TotalAlloc - before.TotalAlloc; d > 64<<10 {
			t.Fatalf("% x: 10 decodes allocated %d bytes", payload, d)
		}
	}
}

func FuzzDecodeBatch(f *testing.F) {
	evs := []Event{
		{Type: BlockStored, BlockHashes: []uint64{1 << 63, 5}, HasParent: true, ParentBlockHash: 42,
			TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 2, LoRAName: "ad1", LoRAID: 1},
		{Type: BlockRemoved, BlockHashes: []uint64{5}},
		{Type: AllBlocksCleared},
	}
	f.Add(AppendBatch(nil, 1.5, evs, 0, EncodingArray))
	f.Add(AppendBatch(nil, 1.5, evs, 0, EncodingMap))
	f.Add(kvMarshal(f, map[string]any{"ts": 2.0, "events": []any{
		map[string]any{"type": "BlockStored", "block_hashes": []any{[]byte{1, 2, 3}}, "token_ids": []any{1}, "block_size": 1},
	}}))
	// Attack shapes: a flood of stored blocks far over any capacity, chained
	// from a parent the subscriber never saw.
	flood := make([]Event, 150)
	for i := range flood {
		flood[i] = Event{Type: BlockStored, BlockHashes: []uint64{uint64(i) + 1000}, HasParent: true,
			ParentBlockHash: uint64(i) + 999, TokenIDs: make([]uint32, 16), BlockSize: 16}
	}
	f.Add(AppendBatch(nil, 3, flood, 0, EncodingArray))
	f.Fuzz(func(t *testing.T, payload []byte) {
		b, err := DecodeBatch(payload)
		if err != nil {
			return
		}
		for _, ev := range b.Events {
			if ev.Type < BlockStored || ev.Type > AllBlocksCleared || ev.BlockSize < 0 {
				t.Fatalf("decoded %+v", ev)
			}
		}
	})
}

// BenchmarkDecodeBatch decodes a step's batch: one BlockStored of 32
// blocks (512 tokens) and 8 single-block BlockRemoved events.
func BenchmarkDecodeBatch(b *testing.B) {
	toks := kvTokens(1000, 512)
	evs := []Event{kvStore(toks, 0)}
	for i := range 8 {
		evs = append(evs, kvRemove(toks, i))
	}
	for _, enc := range []string{EncodingArray, EncodingMap} {
		payload := AppendBatch(nil, 1, evs, 0, enc)
		b.Run(enc, func(b *testing.B) {
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := DecodeBatch(payload); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func kvTokens(base, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(base + i)
	}
	return t
}

// kvStore returns a BlockStored of blocks [from, n) of toks (n = len(toks)
// / 16), with the engine hashes the simulator computes for the base model.
func kvStore(toks []uint32, from int) Event {
	h := prefix.Hashes(nil, toks, 16, 0)
	ev := Event{Type: BlockStored, BlockHashes: h[from:], TokenIDs: toks[16*from:], BlockSize: 16}
	if from > 0 {
		ev.ParentBlockHash, ev.HasParent = h[from-1], true
	}
	return ev
}

// kvRemove returns a BlockRemoved of the given blocks of toks.
func kvRemove(toks []uint32, blocks ...int) Event {
	h := prefix.Hashes(nil, toks, 16, 0)
	ev := Event{Type: BlockRemoved}
	for _, b := range blocks {
		ev.BlockHashes = append(ev.BlockHashes, h[b])
	}
	return ev
}
