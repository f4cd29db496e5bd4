package sim

import (
	"fmt"
	"testing"

	"github.com/infergate/infergate/kvevents/kvevent"
	"github.com/infergate/infergate/prefix"
)

// ---------------------------------------------------------------------------
// Engine (pure core); the events through the wire encoding, rebuilt by a
// subscriber, are in ../simserver/kvevents_test.go.

func TestEngineKVEventsStepDetails(t *testing.T) {
	e := NewEngine(Config{NumBlocks: 8, MaxNumBatchedTokens: 32, KVEvents: true})
	prompt := seqTokens(1, 40) // 2 full blocks + 8 tokens
	must(t, e.Add(&Request{ID: "a", Tokens: prompt, MaxTokens: 30}, 0))

	// Step 1: chunk of 32 tokens → blocks 0 and 1 registered in one BlockStored.
	r := e.Step(0)
	if len(r.Events) != 1 || r.Events[0].Type != kvevent.BlockStored || len(r.Events[0].BlockHashes) != 2 || r.Events[0].HasParent {
		t.Fatalf("step 1 events: %+v", r.Events)
	}
	h := prefix.Hashes(nil, prompt, 16, 0)
	if ev := r.Events[0]; ev.BlockHashes[0] != h[0] || ev.BlockHashes[1] != h[1] || len(ev.TokenIDs) != 32 || ev.BlockSize != 16 {
		t.Fatalf("step 1 BlockStored: %+v", ev)
	}
	// Step 2: the last 8 prompt tokens complete no block.
	if r = e.Step(0); len(r.Events) != 0 {
		t.Fatalf("step 2 events: %+v", r.Events)
	}
	// Decode until block 2 fills (prompt 40 + outputs; block 2 = tokens 32..47).
	var got []kvevent.Event
	for i := 0; i < 10 && len(got) == 0; i++ {
		got = r.Events
		r = e.Step(0)
		got = append(got, r.Events...)
	}
	if len(got) != 1 || !got[0].HasParent || got[0].ParentBlockHash != h[1] || len(got[0].BlockHashes) != 1 {
		t.Fatalf("block 2 store: %+v", got)
	}
	// A busy engine refuses a reset and records nothing.
	if e.ResetPrefixCache() || e.TakeKVEvents() != nil {
		t.Fatal("reset succeeded while a request holds blocks")
	}
	e.Abort("a")
	if !e.ResetPrefixCache() {
		t.Fatal("reset failed on an idle engine")
	}
	// The AllBlocksCleared of a reset made between steps rides on the next step.
	must(t, e.Add(&Request{ID: "b", Tokens: prompt, MaxTokens: 1}, 0))
	r = e.Step(0)
	if len(r.Events) != 2 || r.Events[0].Type != kvevent.AllBlocksCleared || r.Events[1].Type != kvevent.BlockStored || r.Events[1].HasParent {
		t.Fatalf("events after reset: %+v", r.Events)
	}

	// Disabled: no events at all.
	off := NewEngine(Config{NumBlocks: 8})
	must(t, off.Add(&Request{ID: "a", Tokens: prompt, MaxTokens: 1}, 0))
	for off.HasWork() {
		if r := off.Step(0); r.Events != nil {
			t.Fatal("events recorded with KVEvents off")
		}
	}
	if !off.ResetPrefixCache() || off.TakeKVEvents() != nil {
		t.Fatal("reset with KVEvents off")
	}
}

func TestEngineKVEventsEvictionOrder(t *testing.T) {
	// 4 blocks: request a fills 3, finishes; b needs 4 new blocks, evicting
	// a's cached blocks: BlockRemoved events come before b's BlockStored.
	e := NewEngine(Config{NumBlocks: 4, KVEvents: true})
	must(t, e.Add(&Request{ID: "a", Tokens: seqTokens(1, 48), MaxTokens: 1}, 0))
	r := e.Step(0)
	if len(r.Events) != 1 || len(r.Events[0].BlockHashes) != 3 {
		t.Fatalf("a: %+v", r.Events)
	}
	a := append([]uint64(nil), r.Events[0].BlockHashes...)
	must(t, e.Add(&Request{ID: "b", Tokens: seqTokens(1000, 63), MaxTokens: 1}, 0))
	r = e.Step(0)
	var removed []uint64
	for i, ev := range r.Events {
		switch ev.Type {
		case kvevent.BlockRemoved:
			removed = append(removed, ev.BlockHashes...)
		case kvevent.BlockStored:
			if i != len(r.Events)-1 {
				t.Fatalf("BlockStored before an eviction: %+v", r.Events)
			}
		}
	}
	// a freed its blocks tail first, so the LRU order evicts a's last block first.
	if fmt.Sprint(removed) != fmt.Sprint([]uint64{a[2], a[1], a[0]}) {
		t.Fatalf("removed %x, want a's blocks tail first %x", removed, a)
	}
}
