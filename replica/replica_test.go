package replica

import (
	"bytes"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
)

func TestLearnRoundTrip(t *testing.T) {
	hashes := []uint64{1, 2, 1 << 63, 0xdeadbeef}
	b := AppendLearn(nil, "gw-1", -5, "llama", "http://10.0.0.1:8000", 9000, 300, hashes)
	var m Msg
	if err := Decode(b, &m); err != nil {
		t.Fatal(err)
	}
	if m.Kind != KindLearn || m.ID != "gw-1" || m.At != -5 || m.Model != "llama" || m.Prompt != 9000 || m.Pending != 300 || m.Endpoint != "http://10.0.0.1:8000" || !slices.Equal(m.Hashes, hashes) {
		t.Fatalf("decoded %+v", m)
	}
	// 2 + (1+4) + 1 + (1+5) + (1+20) + 2 + 2 + 1 + 4×8 bytes.
	if len(b) != 72 {
		t.Errorf("learn of 4 hashes is %d bytes, want 72", len(b))
	}
}

// TestLearnPDRoundTrip: a P/D profile's learn carries its role; RoleBoth
// encodes as a plain learn, byte for byte.
func TestLearnPDRoundTrip(t *testing.T) {
	hashes := []uint64{3, 4}
	for _, role := range []sched.Role{sched.RolePrefill, sched.RoleDecode} {
		b := AppendLearnRole(nil, "gw-1", 9, "llama", "http://p:8000", role, 9000, 300, hashes)
		if b[1] != byte(KindLearnPD) {
			t.Fatalf("%v: kind byte %d", role, b[1])
		}
		var m Msg
		if err := Decode(b, &m); err != nil {
			t.Fatal(err)
		}
		if m.Kind != KindLearn || m.Role != role || m.Endpoint != "http://p:8000" || m.Prompt != 9000 || m.Pending != 300 || !slices.Equal(m.Hashes, hashes) {
			t.Fatalf("%v: decoded %+v", role, m)
		}
		// Decode resets the role of the next message.
		if err := Decode(AppendLearn(nil, "gw-1", 9, "llama", "http://p:8000", 1, 1, nil), &m); err != nil || m.Role != sched.RoleBoth {
			t.Fatalf("plain learn after a P/D one: role %v, %v", m.Role, err)
		}
	}
	plain := AppendLearn(nil, "a", 1, "m", "e", 5, 5, hashes)
	if !bytes.Equal(AppendLearnRole(nil, "a", 1, "m", "e", sched.RoleBoth, 5, 5, hashes), plain) ||
		!bytes.Equal(AppendLearnRole(nil, "a", 1, "m", "e", sched.Role(9), 5, 5, hashes), plain) {
		t.Fatal("RoleBoth (or an unknown role) is not the plain learn")
	}
}

func TestLoadRoundTrip(t *testing.T) {
	in := []LoadEntry{{"http://a", Load{3, 4000, 1200}}, {"http://b", Load{0, 0, 0}}, {"http://c", Load{-1, maxCount + 7, 1}}}
	b := AppendLoad(nil, "gw-2", 1e18, in)
	var m Msg
	if err := Decode(b, &m); err != nil {
		t.Fatal(err)
	}
	want := slices.Clone(in)
	want[2].Load = Load{0, maxCount, 1} // clamped
	if m.Kind != KindLoad || m.ID != "gw-2" || m.At != 1e18 || !slices.Equal(m.Loads, want) {
		t.Fatalf("decoded %+v", m)
	}
}

func TestEncodeBounds(t *testing.T) {
	long := strings.Repeat("x", 10_000)
	b := AppendLearn(nil, long, 0, long, long, 1, 1, make([]uint64, MaxHashes+10))
	var m Msg
	if err := Decode(b, &m); err != nil {
		t.Fatal(err)
	}
	if len(m.ID) != MaxID || len(m.Model) != MaxModel || len(m.Endpoint) != MaxEndpoint || len(m.Hashes) != MaxHashes {
		t.Fatalf("bounds: id %d model %d endpoint %d hashes %d", len(m.ID), len(m.Model), len(m.Endpoint), len(m.Hashes))
	}
	if len(b) > MaxMessage {
		t.Fatalf("largest learn %d bytes > MaxMessage", len(b))
	}
}

func TestDecodeMalformed(t *testing.T) {
	good := AppendLearn(nil, "a", 1, "m", "e", 0, 0, []uint64{1, 2})
	cases := map[string][]byte{
		"empty":       nil,
		"version":     append([]byte{9}, good[1:]...),
		"kind":        append([]byte{Version, 7}, good[2:]...),
		"truncated":   good[:len(good)-1],
		"trailing":    append(slices.Clone(good), 0),
		"huge count":  append(AppendLearn(nil, "a", 1, "m", "e", 0, 0, nil)[:len(AppendLearn(nil, "a", 1, "m", "e", 0, 0, nil))-1], 0xff, 0xff, 0xff, 0xff, 0x0f),
		"no id":       AppendLearn(nil, "", 1, "m", "e", 0, 0, nil),
		"too big":     make([]byte, MaxMessage+1),
		"long string": append([]byte{Version, byte(KindLoad), 0xff, 0x01}, bytes.Repeat([]byte{'a'}, 255)...),
		"no role":     {Version, byte(KindLearnPD), 1, 'a', 0},
		"role both":   append([]byte{Version, byte(KindLearnPD), 1, 'a', 2, 0}, good[5:]...),
		"role 3":      append([]byte{Version, byte(KindLearnPD), 1, 'a', 2, 3}, good[5:]...),
	}
	for name, b := range cases {
		var m Msg
		if err := Decode(b, &m); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err %v, want ErrMalformed", name, err)
		}
	}
}

// FuzzDecode: no panic, and a message that decodes re-encodes to the same
// bytes (the format has one encoding per message) within the bounds.
func FuzzDecode(f *testing.F) {
	f.Add(AppendLearn(nil, "gw", 7, "m", "http://e", 100, 50, []uint64{1, 2, 3}))
	f.Add(AppendLoad(nil, "gw", -7, []LoadEntry{{"http://e", Load{1, 2, 3}}}))
	f.Add([]byte{Version, byte(KindLoad), 1, 'a', 0, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add(AppendLearnRole(nil, "gw", 7, "m", "http://p", sched.RolePrefill, 100, 50, []uint64{1, 2, 3}))
	f.Add([]byte{Version, byte(KindLearnPD), 1, 'a', 0, 9})
	f.Add(AppendFinish(nil, "gw", 7, "m", "http://e", []uint64{1, 2, 3}))
	f.Add([]byte{Version, byte(KindFinish), 1, 'a', 0, 1, 'm', 1, 'e', 0xff, 0xff, 0x03})
	f.Add(AppendFinishRef(nil, "gw", 7, "m", "http://e", []uint64{1, 2, 3}))
	f.Add([]byte{Version, byte(KindFinishRef), 1, 'a', 0, 1, 'm', 1, 'e', 0, 1, 2, 3, 4, 5, 6, 7, 8})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m Msg
		if err := Decode(b, &m); err != nil {
			return
		}
		if len(m.Hashes) > MaxHashes || len(m.Loads) > MaxLoadEntries || len(m.Hashes)*8 > len(b) || len(m.Loads)*4 > len(b) {
			t.Fatalf("decoded beyond bounds: %d hashes, %d loads from %d bytes", len(m.Hashes), len(m.Loads), len(b))
		}
		var again []byte
		switch m.Kind {
		case KindLearn:
			again = AppendLearnRole(nil, m.ID, m.At, m.Model, m.Endpoint, m.Role, m.Prompt, m.Pending, m.Hashes)
		case KindLoad:
			again = AppendLoad(nil, m.ID, m.At, m.Loads)
		case KindFinish:
			again = AppendFinish(nil, m.ID, m.At, m.Model, m.Endpoint, m.Hashes)
			if m.Blocks > 0 { // a finish_ref
				if len(m.Hashes) != 0 || m.Blocks > MaxHashes || b[1] != byte(KindFinishRef) {
					t.Fatalf("finish_ref of %d blocks with %d hashes, kind %d", m.Blocks, len(m.Hashes), b[1])
				}
				again = appendFinishRef(nil, m.ID, m.At, m.Model, m.Endpoint, m.Blocks, m.Last)
			}
			if m.Prompt != 0 || m.Pending != 0 || len(m.Loads) != 0 {
				t.Fatalf("finish with learn or load fields: %+v", m)
			}
		}
		if m.Kind != KindFinish && (m.Blocks != 0 || m.Last != 0) {
			t.Fatalf("%s with a finish_ref's name: %+v", m.Kind, m)
		}
		if !bytes.Equal(again, b) {
			// Varints have non-minimal encodings Uvarint accepts; the
			// re-encoding must decode to the same message.
			var m2 Msg
			if err := Decode(again, &m2); err != nil || m2.ID != m.ID || m2.At != m.At || m2.Blocks != m.Blocks || m2.Last != m.Last || m2.Role != m.Role || m2.Prompt != m.Prompt || m2.Pending != m.Pending || !slices.Equal(m2.Hashes, m.Hashes) || !slices.Equal(m2.Loads, m.Loads) {
				t.Fatalf("re-encoding differs: %v %+v vs %+v", err, m2, m)
			}
		}
	})
}

func TestPeersTTL(t *testing.T) {
	p := NewPeers(time.Second)
	p.Update("b", 0, []LoadEntry{{"u1", Load{2, 100, 50}}, {"u2", Load{1, 10, 0}}})
	p.Update("c", 500*time.Millisecond, []LoadEntry{{"u1", Load{3, 30, 30}}})
	var e sched.Endpoint
	e.InFlight = 1
	p.Add("u1", 900*time.Millisecond, &e)
	if e.InFlight != 6 || e.InFlightTokens != 130 || e.PendingPrefillTokens != 80 {
		t.Fatalf("sum %+v", e)
	}
	if got := p.Sum("u1", 1200*time.Millisecond); got != (Load{3, 30, 30}) {
		t.Fatalf("after b's TTL: %+v", got)
	}
	if p.Live(1200*time.Millisecond) != 1 || p.Live(2*time.Second) != 0 {
		t.Fatalf("live %d %d", p.Live(1200*time.Millisecond), p.Live(2*time.Second))
	}
	// A newer report replaces the older.
	p.Update("c", 1600*time.Millisecond, []LoadEntry{{"u1", Load{1, 1, 1}}})
	if got := p.Sum("u1", 1600*time.Millisecond); got != (Load{1, 1, 1}) {
		t.Fatalf("replaced: %+v", got)
	}
	if n := testing.AllocsPerRun(100, func() { p.Add("u1", 1600*time.Millisecond, &e) }); n != 0 {
		t.Errorf("Add allocates %v", n)
	}
}

func TestPeersBounded(t *testing.T) {
	p := NewPeers(time.Second)
	for i := range MaxPeers {
		if !p.Update(strings.Repeat("x", i+1), 0, nil) {
			t.Fatalf("peer %d refused", i)
		}
	}
	if p.Update("one more", 0, nil) {
		t.Fatal("peer beyond MaxPeers accepted")
	}
	if p.Routed("yet another", "u", 0, 1, 1) {
		t.Fatal("learn of a peer beyond MaxPeers credited")
	}
	if !p.Update("one more", 2*time.Second, nil) { // the others expired
		t.Fatal("peer refused after the others expired")
	}
}

type target struct {
	l     *recorder
	slots map[string]int
}

func (t target) Intern(url []byte) (string, bool) {
	for s := range t.slots {
		if s == string(url) {
			return s, true
		}
	}
	return "", false
}

func (t target) Resolve(model, endpoint string, _ sched.Role) (sched.PeerLearner, int, bool) {
	i, ok := t.slots[endpoint]
	return t.l, i, ok && model == "m"
}

type recorder struct{ got map[int][][]uint64 }

func (r *recorder) LearnPeer(i int, h []uint64) { r.got[i] = append(r.got[i], slices.Clone(h)) }

func TestNodeApply(t *testing.T) {
	rec := &recorder{got: map[int][][]uint64{}}
	n := &Node{ID: "a", Peers: NewPeers(0), Target: target{rec, map[string]int{"http://e0": 0, "http://e1": 1}}}
	apply := func(b []byte) {
		t.Helper()
		if _, err := n.Apply(b, 0); err != nil {
			t.Fatal(err)
		}
	}
	apply(AppendLearn(nil, "b", 0, "m", "http://e1", 32, 20, []uint64{5, 6}))
	apply(AppendLearn(nil, "a", 0, "m", "http://e0", 16, 16, []uint64{7})) // own
	apply(AppendLearn(nil, "b", 0, "m", "http://e9", 16, 16, []uint64{7})) // unknown endpoint
	apply(AppendLearn(nil, "b", 0, "x", "http://e0", 16, 16, []uint64{7})) // unknown model
	if got := n.Peers.Sum("http://e1", 0); got != (Load{1, 32, 20}) {
		t.Fatalf("learn credited %+v", got)
	}
	apply(AppendLoad(nil, "b", 0, []LoadEntry{{"http://e0", Load{1, 2, 3}}, {"http://unknown", Load{9, 9, 9}}}))
	if got := n.Peers.Sum("http://unknown", 0); got != (Load{}) {
		t.Fatalf("an unknown endpoint's load kept: %+v", got)
	}
	if got := n.Peers.Sum("http://e1", 0); got != (Load{}) {
		t.Fatalf("report did not replace the credit: %+v", got)
	}
	if _, err := n.Apply([]byte{1, 2, 3}, 0); !errors.Is(err, ErrMalformed) {
		t.Fatalf("malformed: %v", err)
	}
	if len(rec.got[1]) != 1 || !slices.Equal(rec.got[1][0], []uint64{5, 6}) || len(rec.got[0]) != 0 {
		t.Fatalf("learnt %v", rec.got)
	}
	c := &n.Counts
	if c.Learns.Load() != 1 || c.Own.Load() != 1 || c.Unknown.Load() != 2 || c.Loads.Load() != 1 || c.Malformed.Load() != 1 {
		t.Fatalf("counts learns %d own %d unknown %d loads %d malformed %d", c.Learns.Load(), c.Own.Load(), c.Unknown.Load(), c.Loads.Load(), c.Malformed.Load())
	}
	if got := n.Peers.Sum("http://e0", 0); got != (Load{1, 2, 3}) {
		t.Fatalf("peer load %+v", got)
	}
}

// TestProfileLearnPeer: a learn applied to a cache-aware policy makes it
// route the prompt where the peer sent it.
func TestProfileLearnPeer(t *testing.T) {
	pol, err := sched.NewPolicy(sched.Config{}, sched.Pool{Capacity: []int{1000, 1000, 1000}})
	if err != nil {
		t.Fatal(err)
	}
	l, ok := pol.(sched.PeerLearner)
	if !ok {
		t.Fatal("cache-aware is not a PeerLearner")
	}
	hashes := make([]uint64, 64)
	for i := range hashes {
		hashes[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
	}
	l.LearnPeer(2, hashes)
	eps := []sched.Endpoint{{Ready: true}, {Ready: true}, {Ready: true}}
	d := pol.Pick(&sched.Request{Hashes: hashes, PromptTokens: 64 * 16}, eps)
	if d.Endpoint != 2 || d.MatchedBlocks != 64 {
		t.Fatalf("picked %d with %d blocks matched, want 2 with 64", d.Endpoint, d.MatchedBlocks)
	}
	if _, ok := sched.Policy(mustPolicy(t, sched.RoundRobin)).(sched.PeerLearner); ok {
		t.Error("round-robin claims to learn")
	}
}

func mustPolicy(t *testing.T, name string) sched.Policy {
	p, err := sched.NewPolicy(sched.Config{Policy: name}, sched.Pool{Capacity: []int{1, 1}})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// BenchmarkAppendLearn: the request path's cost of a decision's learn
// (a 13.7k-token prompt, the Mooncake mean: 857 blocks).
func BenchmarkAppendLearn(b *testing.B) {
	hashes := make([]uint64, 857)
	b.ReportAllocs()
	for b.Loop() {
		_ = AppendLearn(nil, "gw-1", 1, "meta-llama/Llama-3.1-70B-Instruct", "http://10.0.0.1:8000", 13720, 9000, hashes)
	}
}

// BenchmarkPeersAdd: the request path's cost per endpoint of a snapshot
// with two peers' loads.
func BenchmarkPeersAdd(b *testing.B) {
	p := NewPeers(time.Hour)
	var loads []LoadEntry
	for i := range 64 {
		loads = append(loads, LoadEntry{Endpoint: "http://10.0.0." + strings.Repeat("1", i%8+1) + ":" + string(rune('a'+i%26)), Load: Load{1, 2, 3}})
	}
	p.Update("b", 0, loads)
	p.Update("c", 0, loads)
	var e sched.Endpoint
	b.ReportAllocs()
	for b.Loop() {
		p.Add(loads[7].Endpoint, 0, &e)
	}
}

// BenchmarkNodeApplyLearn: a peer's learn applied to a cache-aware policy
// (857 blocks), on the exchange's reader.
func BenchmarkNodeApplyLearn(b *testing.B) {
	pol, _ := sched.NewPolicy(sched.Config{}, sched.Pool{Capacity: []int{100000, 100000}})
	n := &Node{ID: "a", Peers: NewPeers(0), Target: polTarget{pol.(sched.PeerLearner)}}
	hashes := make([]uint64, 857)
	for i := range hashes {
		hashes[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	msg := AppendLearn(nil, "b", 1, "m", "http://e", 13720, 9000, hashes)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := n.Apply(msg, 0); err != nil {
			b.Fatal(err)
		}
	}
}

type polTarget struct{ l sched.PeerLearner }

func (t polTarget) Resolve(string, string, sched.Role) (sched.PeerLearner, int, bool) {
	return t.l, 1, true
}
func (polTarget) Intern(url []byte) (string, bool) { return string(url), true }

// TestDecodeRoleByte: the P/D learn's one extra byte, well formed, decodes
// (the malformed cases above differ from it only in that byte).
func TestDecodeRoleByte(t *testing.T) {
	good := AppendLearn(nil, "a", 1, "m", "e", 0, 0, []uint64{1, 2})
	b := append([]byte{Version, byte(KindLearnPD), 1, 'a', 2, byte(sched.RoleDecode)}, good[5:]...)
	var m Msg
	if err := Decode(b, &m); err != nil || m.Role != sched.RoleDecode || !slices.Equal(m.Hashes, []uint64{1, 2}) {
		t.Fatalf("%v %+v", err, m)
	}
}
