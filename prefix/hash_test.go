package prefix

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func seq(n int, start uint32) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = start + uint32(i)
	}
	return t
}

func TestHashesFullBlocksOnly(t *testing.T) {
	for _, tc := range []struct{ n, bs, want int }{{0, 16, 0}, {15, 16, 0}, {16, 16, 1}, {47, 16, 2}, {48, 16, 3}, {10, 1, 10}} {
		if got := len(Hashes(nil, seq(tc.n, 0), tc.bs, 0)); got != tc.want {
			t.Errorf("n=%d bs=%d: %d hashes, want %d", tc.n, tc.bs, got, tc.want)
		}
	}
}

func TestHashesChained(t *testing.T) {
	a := seq(64, 100)
	b := seq(64, 100)
	b[40] = 7 // differs in block 2
	ha, hb := Hashes(nil, a, 16, 0), Hashes(nil, b, 16, 0)
	for i := range 2 {
		if ha[i] != hb[i] {
			t.Fatalf("block %d differs before the change", i)
		}
	}
	for i := 2; i < 4; i++ {
		if ha[i] == hb[i] {
			t.Fatalf("block %d equal after the change: hashes are not chained", i)
		}
	}
	// Same block content at a different position must not collide (chaining).
	c := append(seq(16, 0), seq(16, 0)...)
	hc := Hashes(nil, c, 16, 0)
	if hc[0] == hc[1] {
		t.Fatal("equal blocks at different positions hash equal")
	}
	// A prefix's hashes are a prefix of the longer prompt's hashes.
	hp := Hashes(nil, a[:40], 16, 0)
	for i, h := range hp {
		if h != ha[i] {
			t.Fatalf("prefix hash %d differs", i)
		}
	}
}

func TestHashesSeed(t *testing.T) {
	a := seq(32, 5)
	if Hashes(nil, a, 16, Seed("m1"))[0] == Hashes(nil, a, 16, Seed("m2"))[0] {
		t.Fatal("different seeds gave equal hashes")
	}
	if Seed("") != 0 || Seed("x") == 0 {
		t.Fatal("Seed convention broken")
	}
}

func TestHashesLargeBlockAndAppend(t *testing.T) {
	a := seq(1024, 9)
	h1 := Hashes(nil, a, 512, 3)
	dst := make([]uint64, 1, 8)
	h2 := Hashes(dst, a, 512, 3)
	if len(h2) != 3 || h2[1] != h1[0] || h2[2] != h1[1] {
		t.Fatalf("append semantics broken: %v vs %v", h2, h1)
	}
}

func TestHashesAllocFree(t *testing.T) {
	a := seq(12000, 1)
	dst := make([]uint64, 0, 1000)
	if n := testing.AllocsPerRun(20, func() { dst = Hashes(dst[:0], a, 16, 1) }); n != 0 {
		t.Fatalf("Hashes allocates %.0f times", n)
	}
}

func BenchmarkHashes12kTokens(b *testing.B) {
	a := seq(12000, 1)
	dst := make([]uint64, 0, 1000)
	b.SetBytes(int64(len(a) * 4))
	b.ReportAllocs()
	for b.Loop() {
		dst = Hashes(dst[:0], a, 16, 1)
	}
}

func TestTokenizer(t *testing.T) {
	tk, err := NewTokenizer()
	if err != nil {
		t.Fatal(err)
	}
	ids := tk.Encode("Hello, world! Shall I compare thee to a summer's day?")
	if len(ids) < 8 || len(ids) > 20 {
		t.Fatalf("unexpected token count %d", len(ids))
	}
	if got := tk.Decode(ids); got != "Hello, world! Shall I compare thee to a summer's day?" {
		t.Fatalf("round trip: %q", got)
	}
	if tk.Encode("") != nil {
		t.Fatal("empty text should give no tokens")
	}
	// Invalid UTF-8 never fails.
	if len(tk.Encode("ok \xff\xfe bad")) == 0 {
		t.Fatal("invalid utf-8 gave no tokens")
	}
}

func TestEncodePrefix(t *testing.T) {
	tk, err := NewTokenizer()
	if err != nil {
		t.Fatal(err)
	}
	text := ""
	for len(text) < 10000 {
		text += "the quick brown fox jumps over the lazy dog. "
	}
	full := tk.Encode(text)
	ids, cut := tk.EncodePrefix(text, 5000)
	if !cut || len(ids) == 0 || len(ids) >= len(full) {
		t.Fatalf("cut %v, %d of %d tokens", cut, len(ids), len(full))
	}
	for i := range len(ids) - 2 {
		if ids[i] != full[i] {
			t.Fatalf("token %d differs from the full encoding", i)
		}
	}
	if ids, cut := tk.EncodePrefix("short", 5000); cut || len(ids) != 1 {
		t.Fatalf("short text: %v %v", ids, cut)
	}
	// No space to cut at: stays on a rune boundary.
	ids, _ = tk.EncodePrefix(strings.Repeat("é", 3000), 1001)
	if s := tk.Decode(ids); !utf8.ValidString(s) || len(s) > 1001 {
		t.Fatalf("cut split a rune or overran: %d bytes", len(s))
	}
}
