package replica

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/infergate/infergate/sched"
)

func TestFinishRoundTrip(t *testing.T) {
	hashes := []uint64{1, 2, 1 << 63, 0xdeadbeef}
	b := AppendFinish(nil, "gw-1", -5, "llama", "http://10.0.0.1:8000", hashes)
	var m Msg
	if err := Decode(b, &m); err != nil {
		t.Fatal(err)
	}
	if m.Kind != KindFinish || m.ID != "gw-1" || m.At != -5 || m.Model != "llama" || m.Endpoint != "http://10.0.0.1:8000" || m.Prompt != 0 || !slices.Equal(m.Hashes, hashes) {
		t.Fatalf("decoded %+v", m)
	}
	// The learn's 72 bytes less its two counts (prompt, pending: 2 + 2).
	if len(b) != 68 {
		t.Errorf("finish of 4 hashes is %d bytes, want 68", len(b))
	}
	for _, bad := range [][]byte{b[:len(b)-1], append(slices.Clone(b), 0)} {
		if err := Decode(bad, &m); !errors.Is(err, ErrMalformed) {
			t.Errorf("%d bytes: %v, want ErrMalformed", len(bad), err)
		}
	}
	// A learn decoded after a finish has its counts again, and the other
	// way round a finish has none.
	if err := Decode(AppendLearn(nil, "a", 1, "m", "e", 7, 3, nil), &m); err != nil || m.Prompt != 7 {
		t.Fatal(err, m.Prompt)
	}
	if err := Decode(b, &m); err != nil || m.Prompt != 0 || m.Pending != 0 {
		t.Fatal(err, m.Prompt, m.Pending)
	}
}

// TestFinishRefRoundTrip: a finish_ref names its learn in a few bytes
// whatever the prompt's length (the count and last hash after the learn's
// MaxHashes cut), decodes as a finish without hashes, and is malformed
// with no blocks, too many, truncated or trailing bytes. A decoder that
// knows kinds 1–4 only (main before it) refuses kind 5 as an unknown kind.
func TestFinishRefRoundTrip(t *testing.T) {
	hashes := make([]uint64, MaxHashes+10)
	for i := range hashes {
		hashes[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	b := AppendFinishRef(nil, "gw-1", -5, "llama", "http://10.0.0.1:8000", hashes)
	var m Msg
	if err := Decode(b, &m); err != nil {
		t.Fatal(err)
	}
	if m.Kind != KindFinish || m.ID != "gw-1" || m.At != -5 || m.Model != "llama" || m.Endpoint != "http://10.0.0.1:8000" ||
		len(m.Hashes) != 0 || m.Blocks != MaxHashes || m.Last != hashes[MaxHashes-1] {
		t.Fatalf("decoded %+v", m)
	}
	if b[1] != byte(KindFinishRef) || len(b) > 60 {
		t.Errorf("kind %d, %d bytes; want kind 5 in at most 60 bytes", b[1], len(b))
	}
	// Its name is the pin's key of the learn: a learn decoded from the same
	// hashes ends in the same hash, with as many.
	var l Msg
	if err := Decode(AppendLearn(nil, "gw-1", 1, "llama", "e", 1, 1, hashes), &l); err != nil || len(l.Hashes) != m.Blocks || l.Hashes[len(l.Hashes)-1] != m.Last {
		t.Fatalf("learn of %d hashes does not match the ref %d, %x: %v", len(l.Hashes), m.Blocks, m.Last, err)
	}
	// A message decoded after it has no name.
	if err := Decode(AppendFinish(nil, "a", 1, "m", "e", []uint64{4}), &m); err != nil || m.Blocks != 0 || m.Last != 0 {
		t.Fatal(err, m.Blocks, m.Last)
	}
	bad := map[string][]byte{
		"truncated": b[:len(b)-1],
		"trailing":  append(slices.Clone(b), 0),
		"no blocks": appendFinishRef(nil, "a", 1, "m", "e", 0, 7),
		"too many":  appendFinishRef(nil, "a", 1, "m", "e", MaxHashes+1, 7),
		"no last":   appendFinishRef(nil, "a", 1, "m", "e", 3, 7)[:13],
		"empty id":  appendFinishRef(nil, "", 1, "m", "e", 3, 7),
	}
	for name, c := range bad {
		if err := Decode(c, &m); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v, want ErrMalformed", name, err)
		}
	}
	// An old decoder's view: the kind byte is one it never knew.
	if k := Kind(b[1]); k == KindLearn || k == KindLoad || k == KindLearnPD || k == KindFinish {
		t.Fatalf("finish_ref reuses kind %d", k)
	}
}

// TestPeerFinishRef: a finish_ref releases the pin its learn took, with
// the hashes the pin kept (the prompt touched as a finish's); one whose
// pin is not held here (a second finish, a learn never received, a
// profile that does not pin) touches nothing and is counted unmatched.
func TestPeerFinishRef(t *testing.T) {
	rec := &finRec{pins: true}
	n := &Node{ID: "a", Peers: NewPeers(time.Second), Target: finTarget{rec}}
	h := []uint64{5, 6}
	learn := AppendLearn(nil, "b", 0, "m", "http://e1", 32, 32, h)
	ref := AppendFinishRef(nil, "b", 0, "m", "http://e1", h)
	applyAll(t, n, 0, learn, ref, ref,
		AppendFinishRef(nil, "b", 0, "m", "http://e1", []uint64{5, 7}), // another prompt: no pin
		AppendFinishRef(nil, "c", 0, "m", "http://e1", h),              // another peer's: no pin
		AppendFinishRef(nil, "a", 0, "m", "http://e1", h),              // own
		AppendFinishRef(nil, "b", 0, "m", "http://e9", h))              // unknown endpoint
	if want := []string{"pin 1 [5 6]", "release 1 [5 6]"}; !slices.Equal(rec.ops, want) {
		t.Fatalf("ops %q, want %q", rec.ops, want)
	}
	c := &n.Counts
	if c.Finishes.Load() != 4 || c.FinishesUnmatched.Load() != 3 || c.Own.Load() != 1 || c.Unknown.Load() != 1 {
		t.Fatalf("finishes %d unmatched %d own %d unknown %d", c.Finishes.Load(), c.FinishesUnmatched.Load(), c.Own.Load(), c.Unknown.Load())
	}
	if p, hs := n.Pinned(); p != 0 || hs != 0 {
		t.Fatalf("%d pins of %d hashes left", p, hs)
	}
	// A full finish matches the same pin, and a finish_ref the pin a full
	// learn took: the two finishes are interchangeable on the receiver.
	rec.ops = nil
	applyAll(t, n, 0, learn, learn, AppendFinish(nil, "b", 0, "m", "http://e1", h), ref)
	if want := []string{"pin 1 [5 6]", "pin 1 [5 6]", "release 1 [5 6]", "release 1 [5 6]"}; !slices.Equal(rec.ops, want) {
		t.Fatalf("mixed ops %q, want %q", rec.ops, want)
	}

	// A profile that does not pin learns, and has nothing to touch with.
	rec2 := &finRec{}
	n2 := &Node{ID: "a", Peers: NewPeers(time.Second), Target: finTarget{rec2}}
	applyAll(t, n2, 0, learn, ref)
	if want := []string{"learn 1 [5 6]"}; !slices.Equal(rec2.ops, want) {
		t.Fatalf("unpinned ops %q, want %q", rec2.ops, want)
	}
	if n2.Counts.FinishesUnmatched.Load() != 1 {
		t.Fatalf("unmatched %d, want 1", n2.Counts.FinishesUnmatched.Load())
	}
}

// TestFinishRefAfterExpiry: a pin expired before its finish_ref came (the
// peer silent for the load TTL: a stalled process) keeps its hashes, and
// the finish_ref touches the prompt with them, as a finish with hashes
// would; once, and not after DropPins forgot the slot. Ended pins are
// bounded.
func TestFinishRefAfterExpiry(t *testing.T) {
	rec := &finRec{pins: true}
	n := &Node{ID: "a", Peers: NewPeers(time.Second), Target: finTarget{rec}}
	h := []uint64{5, 6}
	applyAll(t, n, 0, AppendLearn(nil, "b", 0, "m", "http://e1", 32, 32, h))
	if got := n.Expire(2 * time.Second); got != 1 {
		t.Fatalf("expired %d pins, want 1", got)
	}
	ref := AppendFinishRef(nil, "b", 0, "m", "http://e1", h)
	applyAll(t, n, 2*time.Second, ref, ref)
	if want := []string{"pin 1 [5 6]", "release 1 [5 6]", "touch 1 [5 6]"}; !slices.Equal(rec.ops, want) {
		t.Fatalf("ops %q, want %q", rec.ops, want)
	}
	if u := n.Counts.FinishesUnmatched.Load(); u != 1 {
		t.Fatalf("unmatched %d, want 1 (the second finish)", u)
	}
	// DropPins forgets the ended pins of what it drops.
	rec.ops = nil
	applyAll(t, n, 3*time.Second, AppendLearn(nil, "b", 0, "m", "http://e1", 32, 32, h))
	n.Expire(5 * time.Second)
	n.DropPins(func(sched.PeerFinisher, int) bool { return false })
	applyAll(t, n, 5*time.Second, ref)
	if want := []string{"pin 1 [5 6]", "release 1 [5 6]"}; !slices.Equal(rec.ops, want) {
		t.Fatalf("after DropPins: ops %q, want %q", rec.ops, want)
	}
	// Bounded: many expired pins keep at most maxEnded of them.
	for i := range maxEnded + 100 {
		applyAll(t, n, 6*time.Second, AppendLearn(nil, "b", 0, "m", "http://e1", 32, 32, []uint64{1 << 40, uint64(i)}))
	}
	n.Expire(8 * time.Second)
	n.pins.mu.Lock()
	kept, hashes := len(n.pins.ended), n.pins.endedHashes
	n.pins.mu.Unlock()
	if kept != maxEnded || hashes != 2*maxEnded {
		t.Fatalf("%d ended pins of %d hashes kept, want %d of %d", kept, hashes, maxEnded, 2*maxEnded)
	}
}

// finRec records a PeerFinisher's calls in order.
type finRec struct {
	pins bool
	ops  []string
}

func (r *finRec) LearnPeer(i int, h []uint64)       { r.op("learn ", i, h) }
func (r *finRec) PinsPeers() bool                   { return r.pins }
func (r *finRec) LearnPeerPinned(i int, h []uint64) { r.op("pin ", i, h) }
func (r *finRec) ReleasePeer(i int, h []uint64)     { r.op("release ", i, h) }
func (r *finRec) FinishPeer(i int, h []uint64)      { r.op("touch ", i, h) }

func (r *finRec) op(what string, i int, h []uint64) {
	if len(h) > 8 {
		r.ops = append(r.ops, fmt.Sprint(what, i, " n=", len(h), " last=", h[len(h)-1]))
		return
	}
	r.ops = append(r.ops, fmt.Sprint(what, i, " ", h))
}

type finTarget struct{ l *finRec }

func (t finTarget) Resolve(model, endpoint string, _ sched.Role) (sched.PeerLearner, int, bool) {
	if model != "m" || endpoint != "http://e1" {
		return nil, 0, false
	}
	return t.l, 1, true
}
func (finTarget) Intern(url []byte) (string, bool) { return string(url), true }

func applyAll(t *testing.T, n *Node, now time.Duration, msgs ...[]byte) {
	t.Helper()
	for _, b := range msgs {
		if _, err := n.Apply(b, now); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPeerFinishPairs: a peer's learn pins, its finish releases that pin
// once; a finish without a pin here (its learn never came, or a second
// finish) only touches; identical prompts in flight pin and release
// twice; this replica's own messages do nothing.
func TestPeerFinishPairs(t *testing.T) {
	rec := &finRec{pins: true}
	n := &Node{ID: "a", Peers: NewPeers(time.Second), Target: finTarget{rec}}
	h := []uint64{5, 6}
	learn := AppendLearn(nil, "b", 0, "m", "http://e1", 32, 32, h)
	fin := AppendFinish(nil, "b", 0, "m", "http://e1", h)
	applyAll(t, n, 0, learn, learn, fin, fin, fin,
		AppendFinish(nil, "b", 0, "m", "http://e1", []uint64{5, 7}), // another prompt: no pin of its own
		AppendLearn(nil, "a", 0, "m", "http://e1", 32, 32, h),       // own
		AppendFinish(nil, "a", 0, "m", "http://e1", h),
		AppendFinish(nil, "b", 0, "m", "http://e9", h)) // unknown endpoint
	want := []string{"pin 1 [5 6]", "pin 1 [5 6]", "release 1 [5 6]", "release 1 [5 6]", "touch 1 [5 6]", "touch 1 [5 7]"}
	if !slices.Equal(rec.ops, want) {
		t.Fatalf("ops %q, want %q", rec.ops, want)
	}
	if p, hs := n.Pinned(); p != 0 || hs != 0 {
		t.Fatalf("%d pins of %d hashes left", p, hs)
	}
	c := &n.Counts
	if c.Finishes.Load() != 4 || c.Own.Load() != 2 || c.Unknown.Load() != 1 || c.PinsExpired.Load() != 0 {
		t.Fatalf("finishes %d own %d unknown %d expired %d", c.Finishes.Load(), c.Own.Load(), c.Unknown.Load(), c.PinsExpired.Load())
	}

	// A policy that does not pin (learn_on_finish off, a P/D profile)
	// learns and touches.
	rec2 := &finRec{}
	n2 := &Node{ID: "a", Peers: NewPeers(time.Second), Target: finTarget{rec2}}
	applyAll(t, n2, 0, learn, fin)
	if want := []string{"learn 1 [5 6]", "touch 1 [5 6]"}; !slices.Equal(rec2.ops, want) {
		t.Fatalf("unpinned ops %q, want %q", rec2.ops, want)
	}
}

// TestPeerPinsExpire: pins whose finish never comes are released by the
// node: a peer's once it is silent for the load TTL (killed), a live
// peer's once they outlive PinTTL (a dropped finish); a finish after that
// only touches.
func TestPeerPinsExpire(t *testing.T) {
	rec := &finRec{pins: true}
	n := &Node{ID: "a", Peers: NewPeers(time.Second), Target: finTarget{rec}, PinTTL: 10 * time.Second}
	applyAll(t, n, 0, AppendLearn(nil, "b", 0, "m", "http://e1", 32, 32, []uint64{1}))
	applyAll(t, n, 0, AppendLearn(nil, "c", 0, "m", "http://e1", 32, 32, []uint64{2}))
	// c keeps reporting, b falls silent.
	for at := 250 * time.Millisecond; at <= 1500*time.Millisecond; at += 250 * time.Millisecond {
		applyAll(t, n, at, AppendLoad(nil, "c", 0, nil))
		n.Expire(at)
	}
	if want := []string{"pin 1 [1]", "pin 1 [2]", "release 1 [1]"}; !slices.Equal(rec.ops, want) {
		t.Fatalf("after b fell silent: ops %q, want %q", rec.ops, want)
	}
	if p, hs := n.Pinned(); p != 1 || hs != 1 {
		t.Fatalf("%d pins of %d hashes, want c's one", p, hs)
	}
	// c's pin outlives PinTTL: released as c's messages come, without a
	// call to Expire.
	for at := 2 * time.Second; at <= 11*time.Second; at += 250 * time.Millisecond {
		applyAll(t, n, at, AppendLoad(nil, "c", 0, nil))
	}
	if want := []string{"pin 1 [1]", "pin 1 [2]", "release 1 [1]", "release 1 [2]"}; !slices.Equal(rec.ops, want) {
		t.Fatalf("after PinTTL: ops %q, want %q", rec.ops, want)
	}
	if got := n.Counts.PinsExpired.Load(); got != 2 {
		t.Fatalf("%d pins expired, want 2", got)
	}
	applyAll(t, n, 11*time.Second, AppendFinish(nil, "c", 0, "m", "http://e1", []uint64{2}))
	if got := rec.ops[len(rec.ops)-1]; got != "touch 1 [2]" {
		t.Fatalf("a finish after its pin expired: %q, want a touch", got)
	}
}

// TestPeerPinsBounded: at most MaxPinnedHashes hashes stay pinned; the
// oldest pin is released first.
func TestPeerPinsBounded(t *testing.T) {
	rec := &finRec{pins: true}
	n := &Node{ID: "a", Peers: NewPeers(time.Second), Target: finTarget{rec}}
	big := make([]uint64, MaxHashes) // the longest learn
	fit := MaxPinnedHashes / MaxHashes
	for k := range fit + 1 {
		big[len(big)-1] = uint64(k) // distinct prompts
		applyAll(t, n, 0, AppendLearn(nil, "b", 0, "m", "http://e1", 32, 32, big))
	}
	if p, hs := n.Pinned(); p != fit || hs != MaxPinnedHashes {
		t.Fatalf("%d pins of %d hashes, want %d of %d", p, hs, fit, MaxPinnedHashes)
	}
	if want := "release 1 n=65536 last=0"; rec.ops[fit] != want {
		t.Fatalf("op %d: %q, want the oldest pin's release %q", fit, rec.ops[fit], want)
	}
	if got := n.Counts.PinsExpired.Load(); got != 1 {
		t.Fatalf("%d expired, want 1", got)
	}
}

// TestPeerPinHoldsPrompt: with the real cache-aware index, a peer's
// running request's prompt survives later prompts that overflow the
// endpoint's capacity, as the engine keeps a running request's blocks;
// once the peer's finish came it is evicted by later prompts as usual.
func TestPeerPinHoldsPrompt(t *testing.T) {
	blocks := func(seed, n int) []uint64 {
		h := make([]uint64, n)
		for i := range h {
			h[i] = uint64(seed)<<32 | uint64(i+1)
		}
		return h
	}
	run := func(finishFirst bool) int {
		pol, err := sched.NewPolicy(sched.Config{}, sched.Pool{Capacity: []int{64, 64}})
		if err != nil {
			t.Fatal(err)
		}
		l := pol.(sched.PeerLearner)
		n := &Node{ID: "a", Peers: NewPeers(time.Second), Target: polTarget{l}}
		a := blocks(1, 32)
		applyAll(t, n, 0, AppendLearn(nil, "b", 0, "m", "http://e", 512, 512, a))
		if finishFirst {
			applyAll(t, n, 0, AppendFinish(nil, "b", 0, "m", "http://e", a))
		}
		for k := range 4 { // 4 × 32 other blocks, each ended: 2 × the capacity
			h := blocks(k+2, 32)
			applyAll(t, n, 0, AppendLearn(nil, "c", 0, "m", "http://e", 512, 512, h), AppendFinish(nil, "c", 0, "m", "http://e", h))
		}
		eps := []sched.Endpoint{{Ready: true}, {Ready: true}}
		return pol.Pick(&sched.Request{Hashes: a, PromptTokens: 32 * 16}, eps).MatchedBlocks
	}
	if got := run(false); got != 32 {
		t.Fatalf("running peer request's prompt: %d blocks matched, want 32 (pinned)", got)
	}
	if got := run(true); got != 0 {
		t.Fatalf("ended peer request's prompt: %d blocks matched, want 0 (evicted)", got)
	}
}

// BenchmarkNodeApplyFinish: a peer's learn and its finish (857 blocks,
// the Mooncake mean) applied to a cache-aware policy that learns on
// finish: pinned, then released.
func BenchmarkNodeApplyFinish(b *testing.B) {
	pol, _ := sched.NewPolicy(sched.Config{}, sched.Pool{Capacity: []int{100000, 100000}})
	n := &Node{ID: "a", Peers: NewPeers(time.Hour), Target: polTarget{pol.(sched.PeerLearner)}}
	hashes := make([]uint64, 857)
	for i := range hashes {
		hashes[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	learn := AppendLearn(nil, "b", 1, "m", "http://e", 13720, 9000, hashes)
	for _, c := range []struct {
		name string
		fin  []byte
	}{{"hashes", AppendFinish(nil, "b", 1, "m", "http://e", hashes)}, {"ref", AppendFinishRef(nil, "b", 1, "m", "http://e", hashes)}} {
		b.Run(c.name, func(b *testing.B) { benchApplyFinish(b, n, learn, c.fin) })
	}
}

func benchApplyFinish(b *testing.B, n *Node, learn, fin []byte) {
	b.SetBytes(int64(len(learn) + len(fin)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := n.Apply(learn, 0); err != nil {
			b.Fatal(err)
		}
		if _, err := n.Apply(fin, 0); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkAppendFinish: the cost of a request's finish message (857
// blocks), on the request's end.
func BenchmarkAppendFinish(b *testing.B) {
	hashes := make([]uint64, 857)
	for _, c := range []struct {
		name string
		f    func(dst []byte, id string, at int64, model, endpoint string, hashes []uint64) []byte
	}{{"hashes", AppendFinish}, {"ref", AppendFinishRef}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_ = c.f(nil, "gw-1", 1, "meta-llama/Llama-3.1-70B-Instruct", "http://10.0.0.1:8000", hashes)
			}
		})
	}
}

// TestPeerPinsCompact: a long request's pin ahead of many that ended
// does not keep their entries: the table holds O(live pins).
func TestPeerPinsCompact(t *testing.T) {
	rec := &finRec{pins: true}
	n := &Node{ID: "a", Peers: NewPeers(time.Hour), Target: finTarget{rec}}
	applyAll(t, n, 0, AppendLearn(nil, "b", 0, "m", "http://e1", 32, 32, []uint64{1})) // never ends
	for k := range 10_000 {
		h := []uint64{2, uint64(k + 3)}
		applyAll(t, n, 0, AppendLearn(nil, "b", 0, "m", "http://e1", 32, 32, h), AppendFinish(nil, "b", 0, "m", "http://e1", h))
		rec.ops = rec.ops[:0]
	}
	if p, _ := n.Pinned(); p != 1 {
		t.Fatalf("%d pins, want the long one", p)
	}
	if got := len(n.pins.order) - n.pins.head; got > 2+64 {
		t.Fatalf("%d entries kept for 1 live pin", got)
	}
}

// TestPeerPinsCountBounded: a flood of one-block learns that never finish
// (a hostile or broken peer) keeps at most MaxPins pins, the oldest
// released first: MaxPinnedHashes alone let a million such pins (about
// 244 bytes of table each) stay.
func TestPeerPinsCountBounded(t *testing.T) {
	rec := &finRec{pins: true}
	n := &Node{ID: "a", Peers: NewPeers(time.Hour), Target: finTarget{rec}}
	const extra = 16
	var b []byte
	for k := range MaxPins + extra {
		b = AppendLearn(b[:0], "b", 0, "m", "http://e1", 32, 32, []uint64{uint64(k)})
		if _, err := n.Apply(b, 0); err != nil {
			t.Fatal(err)
		}
		if k == MaxPins {
			if want := "release 1 [0]"; rec.ops[len(rec.ops)-2] != want {
				t.Fatalf("pin %d: op %q, want the oldest pin's release %q", k, rec.ops[len(rec.ops)-2], want)
			}
		}
		if len(rec.ops) > 4 {
			rec.ops = rec.ops[:0]
		}
	}
	if p, hs := n.Pinned(); p != MaxPins || hs != MaxPins {
		t.Fatalf("%d pins of %d hashes, want %d", p, hs, MaxPins)
	}
	if got := n.Counts.PinsExpired.Load(); got != extra {
		t.Fatalf("%d expired, want %d", got, extra)
	}
}

// slotsTarget resolves http://e1 and http://e2 of model m to slots 1 and 2
// of one recorder.
type slotsTarget struct{ l *finRec }

func (t slotsTarget) Resolve(model, endpoint string, _ sched.Role) (sched.PeerLearner, int, bool) {
	switch {
	case model != "m":
		return nil, 0, false
	case endpoint == "http://e1":
		return t.l, 1, true
	case endpoint == "http://e2":
		return t.l, 2, true
	}
	return nil, 0, false
}
func (slotsTarget) Intern(url []byte) (string, bool) { return string(url), true }

// TestDropPins: pins dropped because their slot was forgotten (or their
// policy replaced) are never released, neither by their finish, which
// only touches, nor by expiry; the others are untouched.
func TestDropPins(t *testing.T) {
	rec := &finRec{pins: true}
	n := &Node{ID: "a", Peers: NewPeers(time.Second), Target: slotsTarget{rec}, PinTTL: 10 * time.Second}
	applyAll(t, n, 0,
		AppendLearn(nil, "b", 0, "m", "http://e1", 32, 32, []uint64{1}),
		AppendLearn(nil, "b", 0, "m", "http://e2", 32, 32, []uint64{2}),
		AppendLearn(nil, "c", 0, "m", "http://e1", 32, 32, []uint64{3, 4}))
	if got := n.DropPins(func(f sched.PeerFinisher, slot int) bool { return f != rec || slot != 1 }); got != 2 {
		t.Fatalf("dropped %d pins, want slot 1's 2", got)
	}
	if p, hs := n.Pinned(); p != 1 || hs != 1 {
		t.Fatalf("%d pins of %d hashes left, want slot 2's one", p, hs)
	}
	applyAll(t, n, 0,
		AppendFinish(nil, "b", 0, "m", "http://e1", []uint64{1}),
		AppendFinish(nil, "c", 0, "m", "http://e1", []uint64{3, 4}),
		AppendFinish(nil, "b", 0, "m", "http://e2", []uint64{2}))
	want := []string{"pin 1 [1]", "pin 2 [2]", "pin 1 [3 4]", "touch 1 [1]", "touch 1 [3 4]", "release 2 [2]"}
	if !slices.Equal(rec.ops, want) {
		t.Fatalf("ops %q, want %q", rec.ops, want)
	}
	// Nothing left to expire, and a drop of everything finds nothing.
	if got := n.Expire(time.Hour); got != 0 {
		t.Fatalf("%d pins expired after the drop", got)
	}
	if got := n.DropPins(func(sched.PeerFinisher, int) bool { return false }); got != 0 {
		t.Fatalf("dropped %d more", got)
	}
	if n.Counts.PinsDropped.Load() != 2 || n.Counts.PinsExpired.Load() != 0 {
		t.Fatalf("dropped %d expired %d", n.Counts.PinsDropped.Load(), n.Counts.PinsExpired.Load())
	}
	if p, hs := n.Pinned(); p != 0 || hs != 0 {
		t.Fatalf("%d pins of %d hashes left", p, hs)
	}
}
