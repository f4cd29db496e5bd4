package prefix

import (
	"fmt"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/infergate/infergate/hftokenizer"
	"github.com/tiktoken-go/tokenizer"
)

// Tokenizer turns text into token ids with a real byte-level BPE vocabulary
// (OpenAI's cl100k_base, embedded in github.com/tiktoken-go/tokenizer, so no
// download is needed). It is not the served model's own tokenizer: the
// gateway only needs token boundaries that are stable and prefix-preserving
// to hash blocks, and a real BPE gives realistic token counts (~4 characters
// per token of English). Safe for concurrent use.
//
// The ids are tiktoken-go's cl100k_base ids (v0.10.0: its Codec.Encode, the
// regexp2 pre-tokenizer and rank merges), which engines and the simulator
// hash; since 2026-12-05 they are computed by hftokenizer's BPE core from the
// same ranks (hftokenizer.FromRanks: the allocation-free scanner for
// cl100k's pattern, the word cache), 10–30× faster per token and without
// tiktoken-go's per-piece allocations. tiktoken-go stays the reference:
// TestTokenizerMatchesTiktoken and FuzzTokenizerMatchesTiktoken hold the two
// equal.
type Tokenizer struct {
	bpe    *hftokenizer.Tokenizer
	pieces []string // id → the token's raw bytes ("" for an id without one)
}

var (
	sharedOnce sync.Once
	shared     *Tokenizer
	sharedErr  error
)

// NewTokenizer returns the process-wide cl100k_base tokenizer; building it
// from tiktoken-go's embedded ranks costs ~0.3 s of CPU once. It returns an
// error only if the embedded vocabulary cannot be loaded.
func NewTokenizer() (*Tokenizer, error) {
	sharedOnce.Do(func() {
		shared, sharedErr = newCl100k()
	})
	return shared, sharedErr
}

// newCl100k reads cl100k_base's ranks out of tiktoken-go (its Decode of each
// id is the token's raw bytes; the table is unexported) and builds the BPE.
func newCl100k() (*Tokenizer, error) {
	c, err := tokenizer.Get(tokenizer.Cl100kBase)
	if err != nil {
		return nil, fmt.Errorf("load cl100k_base tokenizer: %w", err)
	}
	ranks := make(map[string]uint32, cl100kTokens)
	pieces := make([]string, cl100kTokens)
	for id := range pieces {
		s, err := c.Decode([]uint{uint(id)})
		if err != nil || s == "" {
			continue // an id without a token
		}
		ranks[s], pieces[id] = uint32(id), s
	}
	bpe, err := hftokenizer.FromRanks(ranks, hftokenizer.TiktokenGoCl100k)
	if err != nil {
		return nil, fmt.Errorf("cl100k_base tokenizer: %w", err)
	}
	return &Tokenizer{bpe: bpe, pieces: pieces}, nil
}

// cl100kTokens is one past cl100k_base's largest ordinary id (100,255; the
// special tokens from 100,257 on are not encoded from text).
const cl100kTokens = 100256

// Encode returns the token ids of text. Invalid UTF-8 is encoded as
// tiktoken-go encodes it, each invalid byte as U+FFFD (regexp2 reads the
// text as runes), rather than rejected, so Encode never fails on client
// input.
func (t *Tokenizer) Encode(text string) []uint32 {
	if text == "" {
		return nil
	}
	return t.Append(make([]uint32, 0, len(text)/3+4), text)
}

// Append is Encode appending to dst; it allocates nothing beyond dst's
// growth once the word cache holds the text's words.
func (t *Tokenizer) Append(dst []uint32, text string) []uint32 {
	if !utf8.ValidString(text) {
		text = string([]rune(text)) // one U+FFFD per invalid byte, as regexp2 sees it
	}
	// The error is only a regexp2 timeout, and cl100k's pattern runs on the
	// scanner, not regexp2.
	dst, _ = t.bpe.Append(dst, text, false)
	return dst
}

// EncodePrefix encodes at most the first maxBytes bytes of text and reports
// whether it cut the text. The cut is moved back to the last ASCII space or
// newline within the final 1 KiB (else to a rune boundary), so it does not
// split a word and the tokens are those of the full text's prefix except
// possibly the last few. BPE tokenizers need memory many times the input
// size, so the gateway tokenizes only as much of a prompt as routing can use.
func (t *Tokenizer) EncodePrefix(text string, maxBytes int) (ids []uint32, cut bool) {
	text, cut = CutText(text, maxBytes)
	return t.Encode(text), cut
}

// CutText returns at most the first maxBytes bytes of text (all of it for
// maxBytes <= 0) and whether it cut: at the last ASCII space or newline
// within the final 1 KiB, else at a rune boundary (EncodePrefix).
func CutText(text string, maxBytes int) (string, bool) {
	if maxBytes <= 0 || len(text) <= maxBytes {
		return text, false
	}
	end := maxBytes
	if i := strings.LastIndexAny(text[max(0, end-1024):end], " \n"); i >= 0 {
		end = max(0, end-1024) + i
	} else {
		for end > 0 && !utf8.RuneStart(text[end]) {
			end--
		}
	}
	return text[:end], true
}

// Decode returns the text of token ids, their raw bytes concatenated
// (possibly invalid UTF-8 where a multi-byte character's tokens are cut);
// "" if any id is outside the vocabulary (as tiktoken-go's Decode).
func (t *Tokenizer) Decode(ids []uint32) string {
	var b strings.Builder
	for _, id := range ids {
		if int(id) >= len(t.pieces) || t.pieces[id] == "" {
			return ""
		}
		b.WriteString(t.pieces[id])
	}
	return b.String()
}
