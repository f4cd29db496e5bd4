package gguf

import (
	"fmt"
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Token types, as stored in tokenizer.ggml.token_type (llama.cpp's
// llama_token_type / gguf-py's TokenType).
const (
	TokenTypeNormal      int32 = 1
	TokenTypeUnknown     int32 = 2
	TokenTypeControl     int32 = 3
	TokenTypeUserDefined int32 = 4
	TokenTypeUnused      int32 = 5
	TokenTypeByte        int32 = 6
)

// Special tokens appended after the learned vocabulary, Llama-3 style. The
// chat template written by Modelfile uses them.
const (
	BeginOfText = "<|begin_of_text|>"
	EndOfText   = "<|end_of_text|>"
	StartHeader = "<|start_header_id|>"
	EndHeader   = "<|end_header_id|>"
	EndOfTurn   = "<|eot_id|>"
)

// SpecialTokens lists the control tokens in the order they are appended to
// the vocabulary.
var SpecialTokens = []string{BeginOfText, EndOfText, StartHeader, EndHeader, EndOfTurn}

// Vocab is a byte-level BPE vocabulary in the form GGUF stores it
// (tokenizer.ggml.model = "gpt2"): token strings are written in GPT-2's
// byte-to-unicode alphabet, merges are "left right" pairs in rank order.
//
// Layout: ids 0..255 are the single-byte tokens (id b is byte b), then the
// tokens created by merges in merge order, then SpecialTokens.
type Vocab struct {
	Tokens []string
	Types  []int32
	Merges []string

	ids   map[string]int
	ranks map[[2]string]int
}

// byteToRune is GPT-2's bytes_to_unicode table: printable Latin-1 bytes map
// to themselves, the other 68 bytes to U+0100 upwards, so every byte has a
// visible, non-space rune. Source: openai/gpt-2 src/encoder.py.
var byteToRune, runeToByte = func() ([256]rune, map[rune]byte) {
	var b2r [256]rune
	r2b := make(map[rune]byte, 256)
	n := 0
	for b := 0; b < 256; b++ {
		keep := (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)
		if keep {
			b2r[b] = rune(b)
		} else {
			b2r[b] = rune(256 + n)
			n++
		}
		r2b[b2r[b]] = byte(b)
	}
	return b2r, r2b
}()

// ByteToToken returns the vocabulary string of the single-byte token for b.
func ByteToToken(b byte) string { return string(byteToRune[b]) }

// bytesToSymbols maps raw bytes to byte-level symbols, one per byte.
func bytesToSymbols(s string) []string {
	out := make([]string, len(s))
	for i := 0; i < len(s); i++ {
		out[i] = string(byteToRune[s[i]])
	}
	return out
}

// Pretokenize splits text the way GPT-2's byte-level pre-tokenizer does,
// which is also what llama.cpp and Ollama use for tokenizer.ggml.pre =
// "default":
//
//	's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//
// Go's regexp has no look-ahead, so the pattern is implemented by hand.
// Concatenating the pieces gives back the input.
func Pretokenize(text string) []string {
	var out []string
	isL := unicode.IsLetter
	isN := unicode.IsNumber
	isS := unicode.IsSpace
	isO := func(r rune) bool { return !isS(r) && !isL(r) && !isN(r) }
	// run returns the end of the run of runes matching f starting at i.
	run := func(i int, f func(rune) bool) int {
		for i < len(text) {
			r, n := utf8.DecodeRuneInString(text[i:])
			if !f(r) {
				break
			}
			i += n
		}
		return i
	}
	i := 0
	for i < len(text) {
		rest := text[i:]
		if rest[0] == '\'' {
			matched := false
			for _, c := range []string{"'s", "'t", "'re", "'ve", "'m", "'ll", "'d"} {
				if strings.HasPrefix(rest, c) {
					out = append(out, c)
					i += len(c)
					matched = true
					break
				}
			}
			if matched {
				continue
			}
		}
		start := i
		j := i
		if rest[0] == ' ' && len(rest) > 1 {
			j = i + 1
		}
		r, _ := utf8.DecodeRuneInString(text[j:])
		switch {
		case isL(r):
			i = run(j, isL)
		case isN(r):
			i = run(j, isN)
		case isO(r):
			i = run(j, isO)
		default:
			// Whitespace: \s+(?!\S) takes the run but its last rune when a
			// non-space follows; a single space before a non-space falls to \s+.
			end := run(start, isS)
			if end < len(text) {
				_, last := utf8.DecodeLastRuneInString(text[start:end])
				if end-last > start {
					end -= last
				}
			}
			i = end
		}
		out = append(out, text[start:i])
	}
	return out
}

// TrainBPE learns a byte-level BPE vocabulary of (at most) vocabSize tokens
// from corpus: 256 byte tokens, merges, and SpecialTokens. Training is the
// textbook algorithm (Sennrich et al. 2016, as in GPT-2): pre-tokenize, count
// words, then repeatedly merge the most frequent adjacent pair. Ties are
// broken by the pair's strings, so the result is deterministic. Training stops
// early when no pair is left (every word is a single token).
func TrainBPE(corpus []byte, vocabSize int) (*Vocab, error) {
	minSize := 256 + len(SpecialTokens)
	if vocabSize < minSize {
		return nil, fmt.Errorf("gguf: vocab size %d below minimum %d", vocabSize, minSize)
	}
	counts := map[string]int{}
	for _, w := range Pretokenize(string(corpus)) {
		counts[w]++
	}
	type word struct {
		syms []string
		n    int
	}
	keys := make([]string, 0, len(counts))
	for w := range counts {
		keys = append(keys, w)
	}
	sort.Strings(keys)
	words := make([]word, len(keys))
	for i, k := range keys {
		words[i] = word{bytesToSymbols(k), counts[k]}
	}

	v := &Vocab{}
	for b := 0; b < 256; b++ {
		v.Tokens = append(v.Tokens, ByteToToken(byte(b)))
		v.Types = append(v.Types, TokenTypeNormal)
	}
	seen := make(map[string]bool, vocabSize)
	for _, t := range v.Tokens {
		seen[t] = true
	}
	target := vocabSize - len(SpecialTokens)
	for len(v.Tokens) < target {
		pairs := map[[2]string]int{}
		for _, w := range words {
			for k := 0; k+1 < len(w.syms); k++ {
				pairs[[2]string{w.syms[k], w.syms[k+1]}] += w.n
			}
		}
		if len(pairs) == 0 {
			break
		}
		var best [2]string
		bestN := 0
		for p, n := range pairs {
			if n > bestN || (n == bestN && (p[0] < best[0] || (p[0] == best[0] && p[1] < best[1]))) {
				best, bestN = p, n
			}
		}
		merged := best[0] + best[1]
		v.Merges = append(v.Merges, best[0]+" "+best[1])
		if !seen[merged] {
			seen[merged] = true
			v.Tokens = append(v.Tokens, merged)
			v.Types = append(v.Types, TokenTypeNormal)
		}
		for wi := range words {
			words[wi].syms = mergePair(words[wi].syms, best[0], best[1])
		}
	}
	for _, s := range SpecialTokens {
		v.Tokens = append(v.Tokens, s)
		v.Types = append(v.Types, TokenTypeControl)
	}
	v.index()
	return v, nil
}

// mergePair replaces every non-overlapping occurrence of (a, b), left to
// right, with a+b.
func mergePair(syms []string, a, b string) []string {
	out := syms[:0:0]
	for k := 0; k < len(syms); k++ {
		if k+1 < len(syms) && syms[k] == a && syms[k+1] == b {
			out = append(out, a+b)
			k++
			continue
		}
		out = append(out, syms[k])
	}
	return out
}

func (v *Vocab) index() {
	v.ids = make(map[string]int, len(v.Tokens))
	for i, t := range v.Tokens {
		if _, dup := v.ids[t]; !dup {
			v.ids[t] = i
		}
	}
	v.ranks = make(map[[2]string]int, len(v.Merges))
	for i, m := range v.Merges {
		l, r, _ := strings.Cut(m, " ")
		v.ranks[[2]string{l, r}] = i
	}
}

// ID returns the id of token s, or -1.
func (v *Vocab) ID(s string) int {
	if v.ids == nil {
		v.index()
	}
	if id, ok := v.ids[s]; ok {
		return id
	}
	return -1
}

// Encode tokenizes text (no special tokens are recognised or added) with the
// same algorithm llama.cpp and Ollama apply to a gpt2-model GGUF: pre-tokenize,
// map bytes to symbols, then repeatedly merge the lowest-ranked adjacent pair.
func (v *Vocab) Encode(text string) []int {
	if v.ids == nil {
		v.index()
	}
	var ids []int
	for _, piece := range Pretokenize(text) {
		syms := bytesToSymbols(piece)
		for len(syms) > 1 {
			bestRank, bestK := -1, -1
			for k := 0; k+1 < len(syms); k++ {
				if r, ok := v.ranks[[2]string{syms[k], syms[k+1]}]; ok && (bestRank < 0 || r < bestRank) {
					bestRank, bestK = r, k
				}
			}
			if bestK < 0 {
				break
			}
			syms = mergePair(syms, syms[bestK], syms[bestK+1])
		}
		for _, s := range syms {
			ids = append(ids, v.ids[s])
		}
	}
	return ids
}

// Tokenize is Encode for a rendered prompt, as engines tokenize one: the
// names of special (control) tokens in text become those tokens, the text
// between them is encoded, and addBOS prepends <|begin_of_text|>. With the
// default pre-tokenizer this matches Ollama's Go engine token for token.
func (v *Vocab) Tokenize(text string, addBOS bool) []int {
	var ids []int
	if addBOS {
		ids = append(ids, v.ID(BeginOfText))
	}
	for text != "" {
		at, which := len(text), ""
		for _, s := range SpecialTokens {
			if i := strings.Index(text, s); i >= 0 && (i < at || (i == at && len(s) > len(which))) {
				at, which = i, s
			}
		}
		ids = append(ids, v.Encode(text[:at])...)
		if which == "" {
			break
		}
		ids = append(ids, v.ID(which))
		text = text[at+len(which):]
	}
	return ids
}

// Decode turns ids back into text; special tokens decode to their names.
func (v *Vocab) Decode(ids []int) string {
	var b strings.Builder
	for _, id := range ids {
		if id < 0 || id >= len(v.Tokens) {
			continue
		}
		t := v.Tokens[id]
		if v.Types[id] == TokenTypeControl {
			b.WriteString(t)
			continue
		}
		for _, r := range t {
			b.WriteByte(runeToByte[r])
		}
	}
	return b.String()
}
