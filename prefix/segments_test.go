package prefix

import (
	"strings"
	"testing"
	"unsafe"

	"github.com/cespare/xxhash/v2"
)

func TestSegmentCache(t *testing.T) {
	tok, err := NewTokenizer()
	if err != nil {
		t.Fatal(err)
	}
	c := NewSegmentCache(tok, 2000)
	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 20)
	segs := []string{"<|begin_of_text|>", "<|start_header_id|>system<|end_header_id|>\n\n" + sys + "<|eot_id|>", "short", "<|start_header_id|>assistant<|end_header_id|>\n\n"}
	first, cut := c.AppendTokens(nil, segs, 0)
	if cut {
		t.Fatal("cut without a limit")
	}
	// Per segment: equal to tokenizing each segment alone.
	var want []uint32
	for _, s := range segs {
		want = append(want, tok.Encode(s)...)
	}
	if !equalIDs(first, want) {
		t.Fatalf("cached tokenization differs from per-segment tokenization")
	}
	again, _ := c.AppendTokens(nil, segs, 0)
	if !equalIDs(first, again) {
		t.Fatal("second tokenization differs")
	}
	hits, misses, held := c.Stats()
	if hits != 1 || misses != 1 || held == 0 {
		t.Fatalf("stats: %d hits, %d misses, %d tokens (want 1, 1, >0)", hits, misses, held)
	}
	// Bounded: many distinct long segments never hold more than maxTokens.
	for i := range 50 {
		c.AppendTokens(nil, []string{strings.Repeat("word"+string(rune('a'+i%26)), 100) + strings.Repeat("x", i)}, 0)
		if _, _, held := c.Stats(); held > 2000 {
			t.Fatalf("cache holds %d tokens, bound 2000", held)
		}
	}
	// A byte limit cuts inside the segment that crosses it.
	cutIDs, cut := c.AppendTokens(nil, segs, 100)
	if !cut || len(cutIDs) >= len(first) {
		t.Fatalf("limit 100 bytes: cut=%v, %d of %d ids", cut, len(cutIDs), len(first))
	}
}

func equalIDs(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func BenchmarkSegmentCacheChat(b *testing.B) {
	tok, _ := NewTokenizer()
	c := NewSegmentCache(tok, 0)
	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 40)
	segs := []string{"<|begin_of_text|>", sys, strings.Repeat("An earlier turn of the conversation. ", 30), "What next?", "<|start_header_id|>assistant<|end_header_id|>\n\n"}
	var dst []uint32
	b.ReportAllocs()
	for b.Loop() {
		dst, _ = c.AppendTokens(dst[:0], segs, 0)
	}
}

// TestSegmentCacheShort: segments shorter than MinCachedSegment are served
// from the direct-mapped table with the ids the tokenizer gives, a distinct
// segment in the same slot replaces the one there (and both stay right), and
// a hit allocates nothing.
func TestSegmentCacheShort(t *testing.T) {
	tok, err := NewTokenizer()
	if err != nil {
		t.Fatal(err)
	}
	c := NewSegmentCache(tok, 0)
	segs := []string{"<|begin_of_text|>", "<|start_header_id|>assistant<|end_header_id|>\n\n", "short", "é and ü", ""}
	for range 2 {
		for _, s := range segs {
			if got, want := c.appendSegment(nil, s), tok.Encode(s); !equalIDs(got, want) {
				t.Fatalf("%q: %v, tokenizer %v", s, got, want)
			}
		}
	}
	// Many more distinct short segments than slots: every answer is still
	// the tokenizer's.
	for i := range 3 * shortSlots {
		s := "turn " + strings.Repeat("x", i%7) + string(rune('a'+i%26)) + strings.Repeat("y", i/26%40)
		if got, want := c.appendSegment([]uint32{7}, s), append([]uint32{7}, tok.Encode(s)...); !equalIDs(got, want) {
			t.Fatalf("%q: %v, tokenizer %v", s, got, want)
		}
	}
	s := "<|begin_of_text|>"
	dst := c.appendSegment(make([]uint32, 0, 64), s)
	if n := testing.AllocsPerRun(100, func() { dst = c.appendSegment(dst[:0], s) }); n != 0 {
		t.Fatalf("a short segment's hit allocates %.0f times", n)
	}
	// A miss into a slot whose buffers have grown allocates only what
	// the tokenizer does.
	slot := func(s string) uint64 { return xxhash.Sum64String(s) & (shortSlots - 1) }
	a, b := "turn aaaa", "turn b"
	for slot(b) != slot(a) {
		b += "b"
	}
	dst = c.appendSegment(dst[:0], a)
	dst = c.appendSegment(dst[:0], b)
	next := []string{a, b}
	i := 0
	miss := testing.AllocsPerRun(100, func() { i++; dst = c.appendSegment(dst[:0], next[i%2]) })
	tokOnly := testing.AllocsPerRun(100, func() { i++; dst = tok.Append(dst[:0], next[i%2]) })
	if miss > tokOnly {
		t.Fatalf("a short segment's miss allocates %.0f times, its tokenization %.0f", miss, tokOnly)
	}
	if got, want := c.appendSegment(nil, a), tok.Encode(a); !equalIDs(got, want) {
		t.Fatalf("%q after its slot's reuse: %v, tokenizer %v", a, got, want)
	}
}

// TestSegmentCacheCopiesShortSegments: a segment passed on a buffer the
// caller reuses (openai.AppendChatSegmentsIn) is not kept: the short
// table stores its own copy, so the buffer's next contents do not change
// what the segment's text finds.
func TestSegmentCacheCopiesShortSegments(t *testing.T) {
	tok, err := NewTokenizer()
	if err != nil {
		t.Fatal(err)
	}
	c := NewSegmentCache(tok, 2000)
	buf := []byte("<|start_header_id|>user<|end_header_id|>\n\nhello there<|eot_id|>")
	seg := unsafe.String(&buf[0], len(buf))
	want := tok.Encode(string(buf))
	if got, _ := c.AppendTokens(nil, []string{seg}, 0); !equalIDs(got, want) {
		t.Fatal("first tokenization differs")
	}
	other := "<|start_header_id|>user<|end_header_id|>\n\nworld again<|eot_id|>"
	if copy(buf, other) != len(other) || len(other) != len(buf) { // the caller's next request
		t.Fatal("test texts of different lengths")
	}
	if got, _ := c.AppendTokens(nil, []string{"<|start_header_id|>user<|end_header_id|>\n\nhello there<|eot_id|>"}, 0); !equalIDs(got, want) {
		t.Fatal("the cached segment changed with the caller's buffer")
	}
	if got, _ := c.AppendTokens(nil, []string{seg}, 0); !equalIDs(got, tok.Encode(other)) {
		t.Fatal("the buffer's new text tokenized as the old")
	}
	// A stale text on the buffer would answer a later segment that hashes
	// to its slot and reads the same there: no slot may point into it.
	for i := range c.short {
		if p := unsafe.SliceData(c.short[i].text); p != nil && uintptr(unsafe.Pointer(p)) >= uintptr(unsafe.Pointer(&buf[0])) &&
			uintptr(unsafe.Pointer(p)) < uintptr(unsafe.Pointer(&buf[0]))+uintptr(len(buf)) {
			t.Fatalf("short slot %d keeps the caller's buffer", i)
		}
	}
}
