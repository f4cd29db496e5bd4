package kvstore

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/infergate/infergate/kvevents/kvevent"
)

// recorder collects a store's events and keeps the set of hashes they say
// are held.
type recorder struct {
	mu     sync.Mutex
	events []kvevent.Event
	held   map[uint64]bool
}

func newRecorder() *recorder { return &recorder{held: map[uint64]bool{}} }

func (r *recorder) fn(evs []kvevent.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range evs {
		e.BlockHashes = append([]uint64(nil), e.BlockHashes...)
		e.TokenIDs = append([]uint32(nil), e.TokenIDs...)
		r.events = append(r.events, e)
		for _, h := range e.BlockHashes {
			switch e.Type {
			case kvevent.BlockStored:
				r.held[h] = true
			case kvevent.BlockRemoved:
				delete(r.held, h)
			}
		}
	}
}

func (r *recorder) take() []kvevent.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.events
	r.events = nil
	return out
}

func nk(h uint64) string { return Key{Model: "m", Hash: h}.String() }

func metaItem(h uint64, size int64) Item { return Item{Key: nk(h), Meta: Meta{Size: size}} }

func mustPut(t *testing.T, s *Store, items ...Item) PutResult {
	t.Helper()
	res, err := s.Put(context.Background(), items)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func evSummary(evs []kvevent.Event) string {
	var b bytes.Buffer
	for _, e := range evs {
		if e.Medium != kvevent.MediumRemote {
			fmt.Fprintf(&b, "medium %q! ", e.Medium)
		}
		fmt.Fprintf(&b, "%s%v ", e.Type, e.BlockHashes)
	}
	return b.String()
}

func TestStoreLRUExactBounds(t *testing.T) {
	rec := newRecorder()
	one := Cost(nk(1), Meta{Size: 1000})
	s, err := New(Config{MemoryBytes: 3 * one, Events: rec.fn})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	mustPut(t, s, metaItem(1, 1000), metaItem(2, 1000), metaItem(3, 1000))
	if st := s.Stats(); st.MemoryBytes != 3*one || st.MemoryEntries != 3 {
		t.Fatalf("stats %+v, want exactly 3 entries of %d", st, one)
	}
	// Refresh 1: 2 is now the least recently used.
	if _, _, ok, _ := s.Get(context.Background(), nk(1), false); !ok {
		t.Fatal("1 not held")
	}
	mustPut(t, s, metaItem(4, 1000))
	if got, want := evSummary(rec.take()), "BlockStored[1] BlockStored[2] BlockStored[3] BlockRemoved[2] BlockStored[4] "; got != want {
		t.Fatalf("events %q, want %q", got, want)
	}
	if st := s.Stats(); st.MemoryBytes != 3*one || st.MemoryBytes > st.MemoryCapacity {
		t.Fatalf("stats %+v", st)
	}
	if n := s.Lookup([]string{nk(1), nk(3), nk(4), nk(2)}); n != 3 {
		t.Fatalf("lookup %d, want 3", n)
	}
	// A bigger metadata-only entry evicts as many as its declared size needs.
	mustPut(t, s, metaItem(5, 2*one-int64(len(nk(5)))))
	if got, want := evSummary(rec.take()), "BlockRemoved[3] BlockRemoved[1] BlockStored[5] "; got != want {
		t.Fatalf("events %q, want %q", got, want)
	}
	// Too big for the tier: refused, nothing changes.
	if _, err := s.Put(context.Background(), []Item{metaItem(6, 3*one)}); err == nil {
		t.Fatal("an entry over the memory tier was stored")
	}
	// Replacing a held key publishes nothing.
	if res := mustPut(t, s, metaItem(4, 10)); res.Replaced != 1 || res.Stored != 0 {
		t.Fatalf("replace: %+v", res)
	}
	if evs := rec.take(); len(evs) != 0 {
		t.Fatalf("replace published %s", evSummary(evs))
	}
	n, err := s.Delete(context.Background(), []string{nk(4), nk(99)})
	if err != nil || n != 1 {
		t.Fatalf("delete: %d %v", n, err)
	}
	if got := evSummary(rec.take()); got != "BlockRemoved[4] " {
		t.Fatalf("delete events %q", got)
	}
}

func TestStoreEventFields(t *testing.T) {
	rec := newRecorder()
	s, _ := New(Config{MemoryBytes: 1 << 20, Events: rec.fn, EventModel: "m"})
	defer s.Close()
	mustPut(t, s, Item{Key: Key{Model: "m", Adapter: "sql", Hash: 7}.String(),
		Meta: Meta{Size: 10, ParentHash: 6, HasParent: true, TokenIDs: []uint32{1, 2, 3, 4}}})
	mustPut(t, s, Item{Key: nk(8), Data: []byte("abc")})
	mustPut(t, s, Item{Key: Key{Model: "other", Hash: 9}.String(), Data: []byte("x")}) // not this stream's model
	mustPut(t, s, Item{Key: "opaque key", Data: []byte("x")})                          // no hash known
	evs := rec.take()
	if len(evs) != 2 {
		t.Fatalf("events %s", evSummary(evs))
	}
	e := evs[0]
	if e.Type != kvevent.BlockStored || e.BlockHashes[0] != 7 || !e.HasParent || e.ParentBlockHash != 6 ||
		len(e.TokenIDs) != 4 || e.BlockSize != 4 || e.LoRAName != "sql" || e.Medium != kvevent.MediumRemote {
		t.Fatalf("event %+v", e)
	}
	if e := evs[1]; e.HasParent || len(e.TokenIDs) != 0 || e.BlockSize != 0 || e.LoRAName != "" {
		t.Fatalf("event %+v", e)
	}
	// Bounds of a put.
	for _, it := range []Item{
		{Key: "", Meta: Meta{Size: 1}},
		{Key: nk(1), Meta: Meta{Size: -1}},
		{Key: nk(1), Meta: Meta{Size: 2}, Data: []byte("x")},
		{Key: nk(1), Meta: Meta{TokenIDs: make([]uint32, DefaultMaxTokenIDs+1)}},
		{Key: nk(1), Meta: Meta{Size: DefaultMaxObjectBytes + 1}},
		{Key: string(make([]byte, MaxKeyBytes+1)), Meta: Meta{Size: 1}},
	} {
		if _, err := s.Put(context.Background(), []Item{it}); err == nil {
			t.Errorf("put of %+v accepted", it.Meta)
		}
	}
}

func TestStoreDiskSpill(t *testing.T) {
	dir := t.TempDir()
	// A file of a previous run is wiped at start; another file is kept.
	os.WriteFile(filepath.Join(dir, "old.kvb"), []byte("x"), 0o600)
	os.WriteFile(filepath.Join(dir, "keep.txt"), []byte("x"), 0o600)
	rec := newRecorder()
	block := func(h uint64) []byte {
		b := make([]byte, 1<<20)
		r := rand.New(rand.NewPCG(h, 1))
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		return b
	}
	one := Cost(nk(1), Meta{Size: 1 << 20, TokenIDs: make([]uint32, 16)})
	s, err := New(Config{MemoryBytes: 2 * one, DiskDir: dir, DiskBytes: 3 * one, Events: rec.fn})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "old.kvb")); !os.IsNotExist(err) {
		t.Fatal("old tier file not wiped")
	}
	tok := func(h uint64) []uint32 {
		t := make([]uint32, 16)
		for i := range t {
			t[i] = uint32(h*100) + uint32(i)
		}
		return t
	}
	for h := uint64(1); h <= 5; h++ {
		mustPut(t, s, Item{Key: nk(h), Data: block(h), Meta: Meta{TokenIDs: tok(h)}})
	}
	st := s.Stats()
	if st.MemoryEntries != 2 || st.DiskEntries != 3 || st.MemoryBytes != 2*one || st.DiskBytes != 3*one || st.Spilled != 3 {
		t.Fatalf("stats %+v", st)
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.kvb"))
	if len(files) != 3 {
		t.Fatalf("%d tier files, want 3", len(files))
	}
	// Moves between tiers publish nothing.
	if got := evSummary(rec.take()); got != "BlockStored[1] BlockStored[2] BlockStored[3] BlockStored[4] BlockStored[5] " {
		t.Fatalf("events %q", got)
	}
	// 1 is on disk: read back, bytes and token ids intact, promoted.
	m, data, ok, err := s.Get(context.Background(), nk(1), true)
	if err != nil || !ok || !bytes.Equal(data, block(1)) || len(m.TokenIDs) != 16 || m.TokenIDs[3] != 103 {
		t.Fatalf("get 1 from disk: ok %v err %v, %d bytes, tokens %v", ok, err, len(data), m.TokenIDs)
	}
	st = s.Stats()
	if st.DiskHits != 1 || st.MemoryEntries != 2 || st.DiskEntries != 3 {
		t.Fatalf("after read-back %+v", st)
	}
	// Overflow the disk tier: its least recently used entry leaves the store.
	mustPut(t, s, Item{Key: nk(6), Data: block(6)})
	if got := evSummary(rec.take()); got != "BlockRemoved[2] BlockStored[6] " {
		t.Fatalf("events %q", got)
	}
	for h := uint64(1); h <= 6; h++ {
		_, data, ok, _ := s.Get(context.Background(), nk(h), true)
		if ok != (h != 2) || ok && !bytes.Equal(data, block(h)) {
			t.Fatalf("block %d: ok %v, equal %v", h, ok, bytes.Equal(data, block(h)))
		}
	}
	// A corrupt file is a miss and leaves the store.
	st = s.Stats()
	s.mu.Lock()
	var onDisk *entry
	for e := s.dsk.Front(); e != nil; e = e.Next() {
		onDisk = e.Value.(*entry)
	}
	s.mu.Unlock()
	os.WriteFile(s.disk.path(onDisk.key), []byte("garbage"), 0o600)
	if _, _, ok, _ := s.Get(context.Background(), onDisk.key, true); ok {
		t.Fatal("corrupt file served")
	}
	if s.Stats().DiskErrors != st.DiskErrors+1 || s.Held(onDisk.key) {
		t.Fatal("corrupt file not dropped")
	}
	s.Close()
	files, _ = filepath.Glob(filepath.Join(dir, "*.kvb"))
	if _, err := os.Stat(filepath.Join(dir, "keep.txt")); len(files) != 0 || err != nil {
		t.Fatalf("after close: %d tier files, keep.txt %v", len(files), err)
	}
}

// TestStoreConcurrent runs puts, gets, lookups and deletes from many
// goroutines; the bounds hold and the event stream describes exactly what
// the store holds.
func TestStoreConcurrent(t *testing.T) {
	for _, withDisk := range []bool{false, true} {
		t.Run(fmt.Sprintf("disk=%v", withDisk), func(t *testing.T) {
			rec := newRecorder()
			cfg := Config{MemoryBytes: 20_000, Events: rec.fn}
			if withDisk {
				cfg.DiskDir, cfg.DiskBytes = t.TempDir(), 30_000
			}
			s, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			var wg sync.WaitGroup
			for g := range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(uint64(g), 2))
					ctx := context.Background()
					for range 400 {
						h := uint64(r.IntN(200))
						switch r.IntN(5) {
						case 0, 1:
							it := metaItem(h, int64(r.IntN(900)))
							if r.IntN(2) == 0 {
								it = Item{Key: nk(h), Data: make([]byte, r.IntN(900))}
							}
							if _, err := s.Put(ctx, []Item{it}); err != nil {
								t.Error(err)
							}
						case 2:
							s.Get(ctx, nk(h), true)
						case 3:
							s.Lookup([]string{nk(h), nk(h + 1)})
						case 4:
							s.Delete(ctx, []string{nk(h)})
						}
						if st := s.Stats(); st.MemoryBytes > st.MemoryCapacity || st.DiskBytes > cfg.DiskBytes {
							t.Errorf("bounds exceeded: %+v", st)
							return
						}
					}
				}()
			}
			wg.Wait()
			s.mu.Lock()
			defer s.mu.Unlock()
			var mem, dsk int64
			for e := s.mem.Front(); e != nil; e = e.Next() {
				mem += e.Value.(*entry).cost
			}
			for e := s.dsk.Front(); e != nil; e = e.Next() {
				dsk += e.Value.(*entry).cost
			}
			if mem != s.memB || dsk != s.dskB || s.mem.Len()+s.dsk.Len() != len(s.local) {
				t.Fatalf("accounting: mem %d/%d disk %d/%d, %d+%d entries vs %d", mem, s.memB, dsk, s.dskB, s.mem.Len(), s.dsk.Len(), len(s.local))
			}
			rec.mu.Lock()
			defer rec.mu.Unlock()
			if len(rec.held) != len(s.local) {
				t.Fatalf("events say %d held, store holds %d", len(rec.held), len(s.local))
			}
			for k := range s.local {
				if !rec.held[ParseKey(k).Hash] {
					t.Fatalf("%s held without an event", k)
				}
			}
		})
	}
}

func TestRemoteIndex(t *testing.T) {
	rec := newRecorder()
	s, _ := New(Config{MemoryBytes: 3 * Cost(nk(1), Meta{Size: 100}), Events: rec.fn, MaxRemoteKeys: 3})
	defer s.Close()
	s.RemoteStored(nk(1), 100)
	mustPut(t, s, metaItem(1, 100)) // already held: replaced, no event
	s.RemoteStored(nk(2), 100)
	s.RemoteRemoved(nk(1)) // still local
	s.RemoteRemoved(nk(2))
	s.RemoteReplace(map[string]int64{nk(3): 1, nk(4): 1, "x": 1, nk(5): 1}) // one over the bound
	evs := rec.take()
	if got := evSummary(evs[:3]); got != "BlockStored[1] BlockStored[2] BlockRemoved[2] " || len(evs) < 5 || len(evs) > 6 {
		t.Fatalf("events %s", evSummary(evs))
	}
	for _, e := range evs[3:] { // 3 of 3, 4, 5 and "x" (map order; "x" has no hash)
		if e.Type != kvevent.BlockStored || e.BlockHashes[0] < 3 || e.BlockHashes[0] > 5 {
			t.Fatalf("events %s", evSummary(evs))
		}
	}
	if st := s.Stats(); st.RemoteKeys != 3 || st.RemoteIndexFull != 1 {
		t.Fatalf("stats %+v", st)
	}
	s.RemoteReplace(map[string]int64{})
	for _, e := range rec.take() {
		if e.Type != kvevent.BlockRemoved {
			t.Fatalf("replace by nothing: %s", evSummary([]kvevent.Event{e}))
		}
	}
	if s.RemoteKeys() != 0 || !s.Held(nk(1)) {
		t.Fatal("remote index not emptied, or local entry lost")
	}
}

func TestParseKey(t *testing.T) {
	for _, c := range []struct {
		key  string
		want KeyInfo
	}{
		{Key{Model: "m", Hash: 0xabc}.String(), KeyInfo{Key: Key{Model: "m", Hash: 0xabc}, Hashed: true, Native: true}},
		{Key{Model: "org/m", Adapter: "a", Hash: ^uint64(0)}.String(), KeyInfo{Key: Key{Model: "org/m", Adapter: "a", Hash: ^uint64(0)}, Hashed: true, Native: true}},
		{"meta-llama/Llama-3.1-8B@1@0@1a2b@bfloat16", KeyInfo{Key: Key{Model: "meta-llama/Llama-3.1-8B", Hash: 0x1a2b}, Hashed: true}},
		{"m@2@1@-1@half@tag%v", KeyInfo{Key: Key{Model: "m", Hash: ^uint64(0)}, Hashed: true}},
		{"m@1@0@00112233445566778899aabbccddeeff@half@3", KeyInfo{Key: Key{Model: "m", Hash: 0x8899aabbccddeeff}, Hashed: true}},
		{"vllm@m@1@0@ff@half", KeyInfo{Key: Key{Model: "m", Hash: 0xff}, Hashed: true}},
		{"vllm@m@1@0@ff", KeyInfo{Key: Key{Model: "m", Hash: 0xff}, Hashed: true}},
		{"m@1@0@xyz@half", KeyInfo{}},
		{"opaque", KeyInfo{}},
		{"", KeyInfo{}},
		{"@@@@", KeyInfo{}},
	} {
		if got := ParseKey(c.key); got != c.want {
			t.Errorf("ParseKey(%q) = %+v, want %+v", c.key, got, c.want)
		}
	}
	if s := (Key{Model: "m", Hash: 1}).String(); s != "m@1@0@0000000000000001@kv" {
		t.Errorf("native key %q", s)
	}
}

func FuzzParseKey(f *testing.F) {
	f.Add("m@1@0@ab@half")
	f.Add(Key{Model: "m", Adapter: "x", Hash: 5}.String())
	f.Fuzz(func(t *testing.T, s string) {
		ki := ParseKey(s)
		if ki.Native && ki.Hashed {
			if k := (Key{Model: ki.Model, Adapter: ki.Adapter, Hash: ki.Hash}); k.Validate() == nil && ParseKey(k.String()) != ki {
				t.Fatalf("round trip of %q", s)
			}
		}
	})
}
