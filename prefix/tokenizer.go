package prefix

import (
	"fmt"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/tiktoken-go/tokenizer"
)

// Tokenizer turns text into token ids with a real byte-level BPE vocabulary
// (OpenAI's cl100k_base, embedded in github.com/tiktoken-go/tokenizer, so no
// download is needed). It is not the served model's own tokenizer: the
// gateway only needs token boundaries that are stable and prefix-preserving
// to hash blocks, and a real BPE gives realistic token counts (~4 characters
// per token of English). Safe for concurrent use.
type Tokenizer struct {
	codec tokenizer.Codec
}

var (
	sharedOnce sync.Once
	shared     *Tokenizer
	sharedErr  error
)

// NewTokenizer returns the process-wide cl100k_base tokenizer; loading the
// vocabulary costs ~100 ms once. It returns an error only if the embedded
// vocabulary cannot be loaded.
func NewTokenizer() (*Tokenizer, error) {
	sharedOnce.Do(func() {
		c, err := tokenizer.Get(tokenizer.Cl100kBase)
		if err != nil {
			sharedErr = fmt.Errorf("load cl100k_base tokenizer: %w", err)
			return
		}
		shared = &Tokenizer{codec: c}
	})
	return shared, sharedErr
}

// Encode returns the token ids of text. Invalid UTF-8 is encoded byte-wise
// rather than rejected, so Encode never fails on client input.
func (t *Tokenizer) Encode(text string) []uint32 {
	if text == "" {
		return nil
	}
	ids, _, err := t.codec.Encode(text)
	if err != nil {
		// Only invalid UTF-8 can fail: fall back to a lossless rendering.
		ids, _, _ = t.codec.Encode(strings.ToValidUTF8(text, "\uFFFD"))
	}
	out := make([]uint32, len(ids))
	for i, id := range ids {
		out[i] = uint32(id)
	}
	return out
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

// Decode returns the text of token ids; ids outside the vocabulary are
// skipped.
func (t *Tokenizer) Decode(ids []uint32) string {
	u := make([]uint, len(ids))
	for i, id := range ids {
		u[i] = uint(id)
	}
	s, err := t.codec.Decode(u)
	if err != nil {
		return ""
	}
	return s
}
