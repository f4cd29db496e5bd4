package prefix

import (
	"unicode"
	"unicode/utf8"
)

// Exact tokenization through the segment cache.
//
// The precise index matches the engines' own blocks, so a prompt must be
// tokenized whole, as the engine tokenizes it — not segment by segment,
// whose ids differ at the boundaries (AppendTokens). Tokenizing a rendered
// 2 KB chat whole costs ~0.7 ms and ~2,500 allocations with the library's
// regexp-based splitter (gateway BenchmarkRequestPath/chat/precise-prefix),
// every request, though a conversation repeats all but its last turn.
//
// A byte-level BPE never merges across its pre-tokenizer's pieces: the
// codec splits the text with cl100k's pattern
//
//	(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//
// (tiktoken-go codec/cl100k_base.go, v0.10.0; tiktoken's cl100k_base) and
// merges within each piece. So the ids of a text are the ids of its chunks
// when every cut falls on a piece boundary, and a chunk that recurs (a
// system prompt with the header that follows it, an earlier turn) can be
// cached like a segment. A cut before position i is such a boundary when
// text[i-1] is '\n' and text[i] starts a letter, a digit or ASCII
// punctuation (not whitespace): no alternative can continue a piece past a
// newline into a non-space — the letter and digit alternatives exclude
// newlines, the punctuation one ends with [\r\n]*, \s*[\r\n]+ ends at its
// last newline, and \s+(?!\S) is only tried where \s*[\r\n]+ failed —
// and the piece that ends there ends the same way when the text stops
// there, since [\r\n]* and [\r\n]+ stop at either. A rendered chat has
// such a cut after every "<|end_header_id|>\n\n" whose message starts with
// a non-space. TestAppendExactAgainstEncode and FuzzAppendExact hold the
// result to Encode of the whole text.

// AppendExact appends to dst the ids Tokenizer.EncodePrefix(text,
// maxBytes) gives, tokenizing the text in chunks cut at pre-token
// boundaries (above), each through the cache, and reports whether it cut
// the text at maxBytes.
func (c *SegmentCache) AppendExact(dst []uint32, text string, maxBytes int) ([]uint32, bool) {
	text, cut := CutText(text, maxBytes)
	start := 0
	for i := 1; i < len(text); i++ {
		if text[i-1] != '\n' || !startsPiece(text[i:]) {
			continue
		}
		dst = c.appendSegment(dst, text[start:i])
		start = i
	}
	if start < len(text) {
		dst = c.appendSegment(dst, text[start:])
	}
	return dst, cut
}

// startsPiece reports whether s begins with a character that no
// pre-token piece ending in a newline can continue into: a letter, a
// number or ASCII punctuation.
func startsPiece(s string) bool {
	b := s[0]
	if b < utf8.RuneSelf {
		return b > ' ' && b < 0x7f
	}
	r, _ := utf8.DecodeRuneInString(s)
	return unicode.IsLetter(r) || unicode.IsNumber(r)
}
