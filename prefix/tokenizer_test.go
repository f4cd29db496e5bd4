package prefix

import (
	"encoding/json"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/infergate/infergate/data"
	"github.com/tiktoken-go/tokenizer"
)

// tiktokenIDs is the reference: tiktoken-go v0.10.0's cl100k_base Encode,
// what Tokenizer.Encode computed until 2026-12-05.
func tiktokenIDs(tb testing.TB, text string) []uint32 {
	tb.Helper()
	c, err := tokenizer.Get(tokenizer.Cl100kBase)
	if err != nil {
		tb.Fatal(err)
	}
	ids, _, err := c.Encode(text)
	if err != nil {
		tb.Fatalf("tiktoken-go: %q: %v", text, err)
	}
	out := make([]uint32, len(ids))
	for i, id := range ids {
		out[i] = uint32(id)
	}
	return out
}

// tokenizerCorpus is every text the equality test encodes: the sonnets
// (whole, and cut into 400 pieces), the MT-bench questions (each line
// whole), the 27 texts of hftokenizer's reference corpus (code, prose in
// several scripts, numbers, whitespace), and 2,000 random concatenations of
// fragments that stress the pre-tokenizer (Unicode whitespace, digits,
// contractions in both cases, CRLF, marks, emoji, invalid UTF-8).
func tokenizerCorpus(t *testing.T) []string {
	t.Helper()
	var texts []string
	sonnet, err := data.ReadFile(data.Sonnet)
	if err != nil {
		t.Fatal(err)
	}
	texts = append(texts, string(sonnet))
	for i := 0; i < len(sonnet); i += len(sonnet)/400 + 1 {
		texts = append(texts, string(sonnet[i:min(len(sonnet), i+len(sonnet)/200)]))
	}
	mt, err := data.ReadFile(data.MTBench)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(mt), "\n") {
		var q struct {
			Turns []string `json:"turns"`
		}
		if json.Unmarshal([]byte(line), &q) == nil {
			texts = append(texts, q.Turns...)
		}
		texts = append(texts, line)
	}
	raw, err := os.ReadFile("../hftokenizer/testdata/corpus.json")
	if err != nil {
		t.Fatal(err)
	}
	var corpus struct {
		Texts []struct{ Text string } `json:"texts"`
	}
	if err := json.Unmarshal(raw, &corpus); err != nil {
		t.Fatal(err)
	}
	for _, c := range corpus.Texts {
		texts = append(texts, c.Text)
	}
	pieces := append(append([]string{}, exactPieces...),
		"'S", "'Re", "'ve", "'D", "'m ", "don't", "I'LL", "  \n", " \r\n\r\n", "\t\t", "1234567", "٣٤٥", "½", "x²",
		"😀", "👩‍👩‍👧", "ñ", "n\u0303", "\xff", "\xc3", "\xe2\x82", "a\x80b", "...", "?!", "<|endoftext|>", "<|fim_prefix|>",
		"  x", "\u200b", "\ufeff", "Ω", "ǅ", "ß", "İ", "ﬁ", "한국어", "ไทย", "עברית", "$1,000.00", "3.14159", "0x1F",
		"func main() {", "\tif x {\n", "```go\n", "# Title\n", "- item\n", "http://example.com/a?b=c", "C++", "e-mail",
		"'ſ", "'ſt", "\x7f", " \x7f", "  \x7f", "!\x7f!", " \n  \n    #", "\n \r\n\t\n", "\u0085\n")
	r := rand.New(rand.NewPCG(19, 17))
	for range 2000 {
		var b strings.Builder
		for range 1 + r.IntN(60) {
			b.WriteString(pieces[r.IntN(len(pieces))])
		}
		texts = append(texts, b.String())
	}
	return texts
}

// TestTokenizerMatchesTiktoken: the ids are tiktoken-go's, token for
// token, on the corpus above (a second pass reads the word cache).
func TestTokenizerMatchesTiktoken(t *testing.T) {
	tok, err := NewTokenizer()
	if err != nil {
		t.Fatal(err)
	}
	texts := tokenizerCorpus(t)
	n := 0
	for pass := range 2 {
		for _, text := range texts {
			want := tiktokenIDs(t, text)
			got := tok.Encode(text)
			if !equalIDs(got, want) {
				t.Fatalf("pass %d, %q:\n got %v\nwant %v", pass, text, got, want)
			}
			n += len(want)
		}
	}
	t.Logf("%d texts, %d ids equal", 2*len(texts), n)
}

// TestTokenizerDecode: Decode gives the raw bytes back (a whole text
// round-trips) and "" for an id outside the vocabulary, as tiktoken-go's.
func TestTokenizerDecode(t *testing.T) {
	tok, err := NewTokenizer()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"Hello, world!", "日本語 and 😀", "  x\n\n1234"} {
		if got := tok.Decode(tok.Encode(s)); got != s {
			t.Fatalf("Decode(Encode(%q)) = %q", s, got)
		}
	}
	if got := tok.Decode([]uint32{9906, 100257}); got != "" {
		t.Fatalf("Decode with a special id = %q, want \"\"", got)
	}
}

// FuzzTokenizerMatchesTiktoken holds Encode to tiktoken-go's cl100k_base on
// any input, invalid UTF-8 included.
func FuzzTokenizerMatchesTiktoken(f *testing.F) {
	for _, s := range []string{"Hello world", "I'LL don't", "  \n\n x", "1234567 ٣٤٥", "a\xffb\xc3", "😀👩‍👩‍👧", "\r\n\t \u00a0\u3000z", "<|endoftext|>"} {
		f.Add(s)
	}
	tok, err := NewTokenizer()
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, text string) {
		if len(text) > 4096 {
			return
		}
		if got, want := tok.Encode(text), tiktokenIDs(t, text); !equalIDs(got, want) {
			t.Fatalf("%q:\n got %v\nwant %v", text, got, want)
		}
	})
}

// BenchmarkTokenizer12k is a 12k-token prompt (the sonnets) through
// Encode, warm (the words cached), against tiktoken-go's Encode of the same
// text, the implementation until 2026-12-05.
func BenchmarkTokenizer12k(b *testing.B) {
	tok, _ := NewTokenizer()
	sonnet, _ := data.ReadFile(data.Sonnet)
	text := string(sonnet)
	for len(tok.Encode(text)) < 12000 {
		text += text
	}
	text = text[:len(text)*12000/len(tok.Encode(text))]
	n := len(tok.Encode(text))
	b.Run("hftokenizer", func(b *testing.B) {
		dst := tok.Append(nil, text)
		b.ReportAllocs()
		for b.Loop() {
			dst = tok.Append(dst[:0], text)
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/token")
	})
	b.Run("tiktoken-go", func(b *testing.B) {
		c, _ := tokenizer.Get(tokenizer.Cl100kBase)
		b.ReportAllocs()
		for b.Loop() {
			_, _, _ = c.Encode(text)
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/token")
	})
}

// BenchmarkNewTokenizer is building the cl100k_base tokenizer from
// tiktoken-go's ranks (done once per process), and the heap it keeps.
func BenchmarkNewTokenizer(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if _, err := newCl100k(); err != nil {
			b.Fatal(err)
		}
	}
}
