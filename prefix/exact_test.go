package prefix

import (
	"math/rand/v2"
	"strings"
	"testing"
)

// exactPieces are fragments that exercise the cut rule: newlines before
// letters, digits, punctuation, spaces and other whitespace, contractions,
// CRLF, non-ASCII letters and spaces, and the chat template's markers.
var exactPieces = []string{
	"\n", "\n\n", "\r\n", " ", "  ", "\t", "\u00a0", "\u3000", "\u2028", "\u0085",
	"Hello", "world", "'s", "'LL", "123", "4567", "?", "!!", "<|eot_id|>", "<|start_header_id|>",
	"user", "<|end_header_id|>", "é", "日本語", "٣", "_", "-", ".", "'", "\"", "{", "}",
}

// TestAppendExactAgainstEncode: tokenizing through AppendExact gives
// exactly the ids of encoding the whole text (EncodePrefix when cut), for
// rendered chats and for random concatenations of the fragments above, and
// a second pass (from the cache) gives them again.
func TestAppendExactAgainstEncode(t *testing.T) {
	tok, err := NewTokenizer()
	if err != nil {
		t.Fatal(err)
	}
	c := NewSegmentCache(tok, 0)
	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 12)
	texts := []string{
		"",
		"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" + sys + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
		"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n  leading spaces\n\n\nthree newlines\n \nspace line\n123 digits\n'quoted'\n",
	}
	r := rand.New(rand.NewPCG(11, 12))
	for range 400 {
		var b strings.Builder
		for range 1 + r.IntN(40) {
			b.WriteString(exactPieces[r.IntN(len(exactPieces))])
		}
		texts = append(texts, b.String())
	}
	for _, text := range texts {
		want := tok.Encode(text)
		for pass := range 2 {
			got, cut := c.AppendExact(nil, text, 0)
			if cut || !equalIDs(got, want) {
				t.Fatalf("pass %d, %q: %v (cut %v), Encode %v", pass, text, got, cut, want)
			}
		}
		if len(text) > 8 {
			limit := 1 + r.IntN(len(text)-1)
			want, wantCut := tok.EncodePrefix(text, limit)
			got, cut := c.AppendExact(nil, text, limit)
			if cut != wantCut || !equalIDs(got, want) {
				t.Fatalf("%q limit %d: %v (cut %v), EncodePrefix %v (cut %v)", text, limit, got, cut, want, wantCut)
			}
		}
	}
}

// FuzzAppendExact holds AppendExact to Encode of the whole text on any
// input (invalid UTF-8 included).
func FuzzAppendExact(f *testing.F) {
	for _, s := range []string{"a\nb", "x.\n<|y|>", " \n1", "\n\u00a0z", "é\nü\n\n'S", "a\r\nb", "\n\n\n", "a \n b\nc"} {
		f.Add(s)
	}
	tok, err := NewTokenizer()
	if err != nil {
		f.Fatal(err)
	}
	c := NewSegmentCache(tok, 1<<16)
	f.Fuzz(func(t *testing.T, text string) {
		if len(text) > 4096 {
			return
		}
		want := tok.Encode(text)
		got, _ := c.AppendExact(nil, text, 0)
		if !equalIDs(got, want) {
			t.Fatalf("%q: %v, Encode %v", text, got, want)
		}
	})
}

// BenchmarkAppendExactChat is the precise index's tokenization of a
// conversation's next turn: a rendered chat whose system prompt and earlier
// turns are cached chunks, against encoding it whole.
func BenchmarkAppendExactChat(b *testing.B) {
	tok, _ := NewTokenizer()
	sys := strings.Repeat("You are a careful assistant who answers in full sentences. ", 40)
	text := "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" + sys +
		"<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n" + strings.Repeat("An earlier turn of the conversation. ", 30) +
		"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nAn earlier answer.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat next?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
	b.Run("append-exact", func(b *testing.B) {
		c := NewSegmentCache(tok, 0)
		var dst []uint32
		b.ReportAllocs()
		for b.Loop() {
			dst, _ = c.AppendExact(dst[:0], text, 0)
		}
	})
	b.Run("encode-whole", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			tok.Encode(text)
		}
	})
}
