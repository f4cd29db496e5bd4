package hftokenizer

import (
	"fmt"
	"strings"
)

// Token types of a GGUF vocabulary (tokenizer.ggml.token_type; llama.cpp
// include/llama.h, enum llama_token_type).
const (
	TokenNormal      = 1
	TokenUnknown     = 2
	TokenControl     = 3
	TokenUserDefined = 4
	TokenUnused      = 5
	TokenByte        = 6
)

// BPEVocab is a byte-level BPE tokenizer given as fields rather than as a
// tokenizer.json: what a GGUF file's tokenizer.ggml.* keys hold
// (LoadGGUF), or any source with the same parts.
type BPEVocab struct {
	// Tokens are the token strings by id: in GPT-2's byte-level alphabet,
	// but control and user-defined tokens, which are raw text.
	Tokens []string
	// Types are the token types by id (TokenNormal …); nil: all normal.
	// Control and user-defined tokens are matched in the text before
	// pre-tokenization, as added tokens are (llama.cpp's
	// tokenizer_st_partition); control tokens are special (Decode's
	// skipSpecial drops them).
	Types []int32
	// Merges are "left right" pairs by rank (lowest first).
	Merges []string
	// Patterns are the pre-tokenizer's regexes, applied in turn, each
	// splitting every piece into its matches and the text between them
	// (llama.cpp's unicode_regex_split; Hugging Face's Split, Isolated).
	Patterns []string
	// IgnoreMerges: a pre-token that is itself a token is that token.
	IgnoreMerges bool
	// Before and After are the ids Encode adds around a sequence when
	// asked (BOS with add_bos_token, EOS with add_eos_token).
	Before, After []uint32
	// ChatTemplate is the Jinja chat template ("": none); BOSToken and
	// EOSToken its bos_token and eos_token.
	ChatTemplate       string
	BOSToken, EOSToken string
}

// NewBPE builds a Tokenizer from v, with the same BPE model, added-token
// matching and decoding as Parse builds from a tokenizer.json; there is no
// normalizer (llama.cpp applies none to BPE vocabularies). A normal token
// outside the byte-level alphabet is an error; an unknown or unused one
// is left out of the vocabulary (llama.cpp never produces them from text).
func NewBPE(v BPEVocab) (*Tokenizer, error) {
	if v.Types != nil && len(v.Types) != len(v.Tokens) {
		return nil, fmt.Errorf("%d token types for %d tokens", len(v.Types), len(v.Tokens))
	}
	if uint64(len(v.Tokens)) >= uint64(deadSymbol-1) {
		return nil, fmt.Errorf("%d tokens: too many", len(v.Tokens))
	}
	t := &Tokenizer{}
	for _, p := range v.Patterns {
		s, err := newSplitter(p, true)
		if err != nil {
			return nil, err
		}
		s.keep = keepBoth
		t.steps = append(t.steps, preStep{split: s})
	}
	vocab := make(map[string]uint32, len(v.Tokens))
	var added []AddedToken
	for i, tok := range v.Tokens {
		typ := int32(TokenNormal)
		if v.Types != nil {
			typ = v.Types[i]
		}
		switch typ {
		case TokenControl, TokenUserDefined:
			if tok == "" {
				return nil, fmt.Errorf("token %d: empty %s token", i, map[int32]string{TokenControl: "control", TokenUserDefined: "user-defined"}[typ])
			}
			added = append(added, AddedToken{ID: uint32(i), Content: tok, Special: typ == TokenControl})
			continue
		}
		if _, ok := fromByteLevel(tok); !ok {
			if typ == TokenNormal {
				return nil, fmt.Errorf("token %d %q is not in the byte-level alphabet (not a byte-level BPE)", i, tok)
			}
			continue
		}
		vocab[tok] = uint32(i) // a repeated string: the last id, as llama.cpp's token_to_id
	}
	merge := func(i int) (string, string, error) {
		s := v.Merges[i]
		l, r, ok := strings.Cut(s, " ")
		if !ok || l == "" || r == "" || strings.IndexByte(r, ' ') >= 0 {
			return "", "", fmt.Errorf("merge %q is not \"left right\"", s)
		}
		return l, r, nil
	}
	if err := t.buildModel(vocab, len(v.Merges), merge, v.IgnoreMerges, added); err != nil {
		return nil, err
	}
	for _, id := range append(append([]uint32(nil), v.Before...), v.After...) {
		if int(id) >= len(v.Tokens) {
			return nil, fmt.Errorf("special id %d out of range (%d tokens)", id, len(v.Tokens))
		}
	}
	t.bos, t.eos = append([]uint32(nil), v.Before...), append([]uint32(nil), v.After...)
	t.added, t.addedNorm = newAddedMatcher(added), newAddedMatcher(nil)
	if v.ChatTemplate != "" {
		tpl, err := NewChatTemplate(v.ChatTemplate)
		if err != nil {
			return nil, err
		}
		tpl.BOS, tpl.EOS = v.BOSToken, v.EOSToken
		t.template = tpl
	}
	return t, nil
}
