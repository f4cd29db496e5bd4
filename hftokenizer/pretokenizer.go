package hftokenizer

import (
	"errors"
	"fmt"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2/v2"
)

// splitter cuts normalized text into pre-tokens: the words the BPE model
// merges separately. It is the tokenizer.json `Split` pre-tokenizer with
// `"behavior": "Isolated"` (every match a word, the text between matches a
// word too), or the `ByteLevel` pre-tokenizer with `"use_regex": true` (the
// same with GPT-2's pattern).
//
// Patterns are compiled with regexp2 (a backtracking engine with .NET
// syntax: the lookahead `(?!\S)` these patterns use, which Go's regexp
// lacks). Its cost is a []rune copy of the text and a match object per
// pre-token; the patterns of the GPT-4/Llama-3 family and Qwen2's are
// therefore recognised and run by a hand-written scanner (scanFamily) that
// allocates nothing and is checked against regexp2 by FuzzScannerMatchesRegexp.
type splitter struct {
	re         *regexp2.Regexp // nil: no regex (split nothing)
	fast       bool            // run scanFamily instead of re
	maxDigits  int             // scanFamily: \p{N}{1,maxDigits}; 0 = \p{N}+
	tiktokenGo bool            // scanFamily with tiktokenGoEnd's two differences (FromRanks, TiktokenGoCl100k)
	keep       keepMode        // which pieces become words
}

// keepMode is what a Split keeps of its text: the matches and the text
// between them, only the matches, or only the text between them.
type keepMode uint8

const (
	keepBoth keepMode = iota
	keepMatches
	keepGaps
)

// Patterns recognised by the scanner. llama3Pattern is Meta-Llama-3's and
// cl100k_base's; qwen2Pattern is Qwen2's, Qwen2.5's and Qwen3's (digits one
// by one).
const (
	llama3Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	qwen2Pattern  = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// gpt2Pattern is the ByteLevel pre-tokenizer's own (tokenizers/src/
	// pre_tokenizers/byte_level.rs, v0.21).
	gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// TiktokenGoCl100k, given to FromRanks as the pattern, is cl100k_base's
// pattern (llama3Pattern) as tiktoken-go v0.10.0 matches it, which differs
// from the pattern in two places (tiktokenGoEnd). Only the scanner runs it.
const TiktokenGoCl100k = "tiktoken-go:cl100k_base"

// RegexTimeout bounds one regexp2 scan of a pre-tokenizer pattern that the
// scanner does not cover (a safety net against pathological backtracking on
// hostile input): past it Encode returns ErrRegexTimeout.
const RegexTimeout = 2 * time.Second

// ErrRegexTimeout is returned (wrapped) when a pre-tokenizer pattern's match
// ran past RegexTimeout or its backtracking stack limit.
var ErrRegexTimeout = errors.New("hftokenizer: pre-tokenizer pattern exceeded its match budget")

func newSplitter(pattern string, allowFast bool) (*splitter, error) {
	s := &splitter{}
	if allowFast {
		switch pattern {
		case llama3Pattern:
			s.fast, s.maxDigits = true, 3
		case qwen2Pattern:
			s.fast, s.maxDigits = true, 1
		case TiktokenGoCl100k:
			s.fast, s.maxDigits, s.tiktokenGo = true, 3, true
			pattern = llama3Pattern
		}
	}
	re, err := regexp2.Compile(pattern, regexp2.None)
	if err != nil {
		return nil, fmt.Errorf("pre-tokenizer pattern %q: %w", pattern, err)
	}
	re.MatchTimeout = RegexTimeout
	s.re = re
	return s, nil
}

// split calls fn for each pre-token of text, in order; the pre-tokens cover
// text exactly. fn gets byte offsets into text.
func (s *splitter) split(text string, fn func(start, end int)) error {
	if s.fast {
		scanFamily(text, s.maxDigits, fn)
		return nil
	}
	return s.splitRegexp(text, fn)
}

func (s *splitter) splitRegexp(text string, fn func(start, end int)) error {
	if text == "" {
		return nil
	}
	idx, err := s.re.FindAllStringIndex(text, -1)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrRegexTimeout, err)
	}
	prev := 0
	for _, m := range idx {
		if m[0] == m[1] {
			continue
		}
		if m[0] > prev {
			fn(prev, m[0])
		}
		fn(m[0], m[1])
		prev = m[1]
	}
	if prev < len(text) {
		fn(prev, len(text))
	}
	return nil
}

// scanFamily splits text as the Llama-3/cl100k pattern (maxDigits 3) or
// Qwen2's (maxDigits 1) does, maxDigits 0 meaning \p{N}+:
//
//	(?i:'s|'t|'re|'ve|'m|'ll|'d) | [^\r\n\p{L}\p{N}]?\p{L}+ | \p{N}{1,maxDigits}
//	| ?[^\s\p{L}\p{N}]+[\r\n]* | \s*[\r\n]+ | \s+(?!\S) | \s+
//
// with the backtracking engine's leftmost-first alternation: at each
// position the first alternative that matches wins. \s is .NET's and
// Oniguruma's Unicode White_Space (unicode.IsSpace); invalid UTF-8 bytes are
// one U+FFFD each (a symbol, so "punctuation" here), as regexp2 decodes them.
func scanFamily(text string, maxDigits int, fn func(start, end int)) {
	i := 0
	n := len(text)
	for i < n {
		end := scanOne(text, i, maxDigits)
		fn(i, end)
		i = end
	}
}

type class uint8

const (
	clLetter class = iota
	clNumber
	clSpace // \s other than \r and \n
	clNewline
	clOther
)

// classAt returns the class and width of the rune at i (n > i).
func classAt(text string, i int) (class, int) {
	c := text[i]
	if c < utf8.RuneSelf {
		return asciiClass[c], 1
	}
	r, w := utf8.DecodeRuneInString(text[i:])
	switch {
	case unicode.IsLetter(r):
		return clLetter, w
	case unicode.IsNumber(r):
		return clNumber, w
	case unicode.IsSpace(r):
		return clSpace, w
	}
	return clOther, w
}

var asciiClass = func() (t [128]class) {
	for c := 0; c < 128; c++ {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z':
			t[c] = clLetter
		case c >= '0' && c <= '9':
			t[c] = clNumber
		case c == '\r' || c == '\n':
			t[c] = clNewline
		case c == ' ' || c == '\t' || c == '\v' || c == '\f':
			t[c] = clSpace
		default:
			t[c] = clOther
		}
	}
	return t
}()

func lowerASCII(c byte) byte {
	if c >= 'A' && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

// scanOne returns the end of the pre-token that starts at i.
func scanOne(text string, i, maxDigits int) int {
	n := len(text)
	// (?i:'s|'t|'re|'ve|'m|'ll|'d)
	if text[i] == '\'' && i+1 < n {
		c1 := lowerASCII(text[i+1])
		switch c1 {
		case 's', 't', 'm', 'd':
			return i + 2
		case 'r', 'v', 'l':
			if i+2 < n {
				c2 := lowerASCII(text[i+2])
				if (c1 == 'r' || c1 == 'v') && c2 == 'e' || c1 == 'l' && c2 == 'l' {
					return i + 3
				}
			}
		}
	}
	c0, w0 := classAt(text, i)
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if c0 == clLetter {
		return scanWhile(text, i+w0, clLetter)
	}
	if (c0 == clSpace || c0 == clOther) && i+w0 < n {
		if c1, w1 := classAt(text, i+w0); c1 == clLetter {
			return scanWhile(text, i+w0+w1, clLetter)
		}
	}
	// \p{N}{1,maxDigits}
	if c0 == clNumber {
		j := i + w0
		for k := 1; j < n && (maxDigits == 0 || k < maxDigits); k++ {
			c, w := classAt(text, j)
			if c != clNumber {
				break
			}
			j += w
		}
		return j
	}
	// ' ?[^\s\p{L}\p{N}]+[\r\n]*'
	j := i
	if text[i] == ' ' && i+1 < n {
		if c1, _ := classAt(text, i+1); c1 == clOther {
			j = i + 1
		}
	}
	if c, _ := classAt(text, j); c == clOther {
		j = scanWhile(text, j, clOther)
		for j < n && (text[j] == '\r' || text[j] == '\n') {
			j++
		}
		return j
	}
	// Whitespace from here on: c0 is clSpace or clNewline.
	runEnd := i
	lastNL := -1
	for runEnd < n {
		c, w := classAt(text, runEnd)
		if c == clNewline {
			lastNL = runEnd
		} else if c != clSpace {
			break
		}
		runEnd += w
	}
	// \s*[\r\n]+
	if lastNL >= 0 {
		return lastNL + 1
	}
	// \s+(?!\S): the run, less its last rune when a non-space follows.
	if runEnd == n {
		return runEnd
	}
	_, lw := utf8.DecodeLastRuneInString(text[i:runEnd])
	if runEnd-lw > i {
		return runEnd - lw
	}
	// \s+
	return runEnd
}

// tiktokenGoEnd is where tiktoken-go v0.10.0 ends the cl100k_base pre-token
// that starts at i, given scanOne's end e (maxDigits 3). tiktoken-go runs
// the pattern through regexp2's generated matcher (codec/regexp.gen.go,
// splitRegexp_3_Execute), which differs from the pattern's meaning, and from
// regexp2's interpreter, in two places here and a third in
// Tokenizer.appendTiktokenGo (its matcher puts DEL, U+007F, in none of the sets,
// so it is dropped and ends the pre-token before it):
//
//   - `\s*[\r\n]+` backtracks its `\s*` to the *first* `\r` or `\n` of the
//     whitespace run (helpers.IndexOfAny2, where backtracking gives the run
//     back from its end), so the pre-token ends after the first run of
//     consecutive `\r`/`\n`, not the last: " \n  \n    #" is " \n", "  \n",
//     "   ", " #" (the pattern: " \n  \n", "   ", " #").
//   - `(?i:'s|'t|…)` is the set [STstſ] after the apostrophe: "'ſ" (U+017F,
//     which folds to s) is a contraction.
//
// The ids the gateway and the simulator hash have been tiktoken-go's, so
// the cl100k_base tokenizer keeps them (prefix.Tokenizer).
func tiktokenGoEnd(text string, i, e int) int {
	if text[i] == '\'' && i+2 < len(text) && text[i+1] == 0xC5 && text[i+2] == 0xBF {
		return i + 3 // 'ſ
	}
	j := i
	for ; j < e; j++ {
		c := text[j]
		if c == '\r' || c == '\n' {
			break
		}
	}
	if j == e {
		return e // no newline in the pre-token
	}
	// A newline in the pre-token: it is `\s*[\r\n]+` if the pre-token is
	// all whitespace (the other alternatives hold a letter, a digit or a
	// symbol before any newline they end with).
	for k := i; k < j; {
		if c, w := classAt(text, k); c != clSpace {
			return e
		} else {
			k += w
		}
	}
	for j < e && (text[j] == '\r' || text[j] == '\n') {
		j++
	}
	return j
}

func scanWhile(text string, j int, want class) int {
	for j < len(text) {
		c, w := classAt(text, j)
		if c != want {
			break
		}
		j += w
	}
	return j
}
