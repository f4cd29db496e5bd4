package gateway

import (
	"context"
	"net/http"
	"sync"
	"testing"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/prefix"
)

// TestReloadShrinkGrowUnderLoad (run with -race): picks and KV-event
// batches of every engine (removed ones' included, whose feeds are
// detached) flow while reloads take a precise-prefix pool 64 → 65 → 60 →
// 66 → 63 → 130 → 64 endpoints; afterwards the prompt stored at endpoint
// 10 before the first reload still routes there, and one stored at
// endpoint 62 before it was removed (its slot vacated, then refilled by a
// new endpoint of the same URL) does not: the new engine holds nothing;
// a removed endpoint's detached feed stores nowhere.
func TestReloadShrinkGrowUnderLoad(t *testing.T) {
	const shared = 1024
	dead := deadKVAddr(t)
	config := func(n int) Config { return preciseKVConfig(n, dead) }
	g, err := New(context.Background(), config(64), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	waitKVStarted(t, g, nil)
	storeKV(kvFeedOf(g, 10), 1, growPrompt(1, shared), "")
	storeKV(kvFeedOf(g, 62), 2, growPrompt(2, shared), "")
	if got := growPick(t, g, growPrompt(2, shared+64)); got != growAddr(62) {
		t.Fatalf("before the reloads the prompt stored at endpoint 62 routed to %s", got)
	}
	feeds := make([]*kvFeed, 64)
	for i := range feeds {
		feeds[i] = kvFeedOf(g, i)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for k := 0; ; k++ {
			select {
			case <-stop:
				return
			default:
			}
			pk, ref := g.Pick(context.Background(), &PickRequest{Method: http.MethodPost, Path: pathCompletions,
				Header: http.Header{}, Body: growBody(growPrompt(100+k%7, 600))})
			if ref != nil {
				t.Errorf("refused during the reloads: %d %s", ref.Status, ref.Body)
				return
			}
			pk.Done()
		}
	}()
	go func() { // events of the first 64 engines, except 10's and 62's prompts
		defer wg.Done()
		for k := 0; ; k++ {
			select {
			case <-stop:
				return
			default:
			}
			e := k % 64
			if e == 10 {
				continue
			}
			if k%5 == 4 && e != 62 {
				feeds[e].KVBatch(uint64(k), &kvevents.Batch{Events: []kvevents.Event{{Type: kvevents.AllBlocksCleared}}})
				continue
			}
			storeKV(feeds[e], 200+k%11, growPrompt(200+k%11, 256), "")
		}
	}()
	for _, n := range []int{65, 60, 66, 63, 130, 64} {
		if err := g.Reload(config(n)); err != nil {
			t.Error(err)
			break
		}
	}
	close(stop)
	wg.Wait()
	if got := growPick(t, g, growPrompt(1, shared+64)); got != growAddr(10) {
		t.Fatalf("after the reloads the prompt stored at endpoint 10 routed to %s", got)
	}
	ix := g.PreciseIndex("m0")
	h := ix.Endpoints()
	if h != 192 {
		t.Fatalf("precise index of %d slots", h)
	}
	m := make([]int, h)
	hashes := func(s int) []uint64 {
		return prefix.Hashes(nil, growPrompt(s, shared), prefix.DefaultBlockSize, prefix.Seed("m0\x00"))
	}
	ix.Match(hashes(1), prefix.MediumGPU, m)
	if m[10] != shared/prefix.DefaultBlockSize {
		t.Fatalf("endpoint 10 matches %d blocks of its prompt, want %d", m[10], shared/prefix.DefaultBlockSize)
	}
	// The feed of endpoint 61 as it was before the reload that removed
	// it: detached, what it still hears lands nowhere.
	if kvFeedOf(g, 61) == feeds[61] {
		t.Fatal("endpoint 61 kept its feed through its removal")
	}
	storeKV(feeds[61], 3, growPrompt(3, shared), "")
	ix.Match(hashes(3), prefix.MediumGPU, m)
	for e, n := range m {
		if n != 0 {
			t.Fatalf("a removed endpoint's detached feed stored %d blocks at endpoint %d", n, e)
		}
	}
	ix.Match(hashes(2), prefix.MediumGPU, m)
	if m[62] != 0 {
		t.Fatalf("the new endpoint 62 matches %d blocks of the removed one's prompt", m[62])
	}
}
