package hftokenizer

import (
	"unicode"
	"unicode/utf8"
)

// AddedToken is one entry of tokenizer.json's "added_tokens": a string cut
// out of the text before normalization and pre-tokenization and mapped to
// its id directly (tokenizers/src/tokenizer/added_vocabulary.rs, v0.21).
type AddedToken struct {
	ID         uint32 `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"` // match only as a whole word
	LStrip     bool   `json:"lstrip"`      // the match swallows whitespace on its left
	RStrip     bool   `json:"rstrip"`      // the match swallows whitespace on its right
	Normalized bool   `json:"normalized"`  // matched in the normalized text, not the raw one
	Special    bool   `json:"special"`     // skipped by Decode with skipSpecial
}

// addedMatcher finds added tokens in text: leftmost, then longest, as the
// Aho-Corasick LeftmostLongest automaton of added_vocabulary.rs does. A trie
// with sorted edges; first[b] says whether any token starts with byte b, so
// text without a token's first byte costs one table lookup a byte.
type addedMatcher struct {
	nodes []trieNode
	first [256]bool
	toks  []AddedToken
}

type trieNode struct {
	keys []byte
	kids []int32
	tok  int32 // index into toks + 1; 0 = no token ends here
}

func newAddedMatcher(toks []AddedToken) *addedMatcher {
	m := &addedMatcher{nodes: []trieNode{{}}}
	for _, t := range toks {
		if t.Content == "" {
			continue
		}
		m.toks = append(m.toks, t)
		m.first[t.Content[0]] = true
		n := int32(0)
		for i := 0; i < len(t.Content); i++ {
			n = m.child(n, t.Content[i])
		}
		m.nodes[n].tok = int32(len(m.toks))
	}
	return m
}

func (m *addedMatcher) child(n int32, b byte) int32 {
	nd := &m.nodes[n]
	for i, k := range nd.keys {
		if k == b {
			return nd.kids[i]
		}
	}
	m.nodes = append(m.nodes, trieNode{})
	c := int32(len(m.nodes) - 1)
	nd = &m.nodes[n]
	nd.keys = append(nd.keys, b)
	nd.kids = append(nd.kids, c)
	return c
}

func (m *addedMatcher) empty() bool { return len(m.toks) == 0 }

// longestAt returns the token index + 1 of the longest token that text[i:]
// starts with, and its length; 0 if none.
func (m *addedMatcher) longestAt(text string, i int) (tok int32, n int) {
	nd := int32(0)
	for j := i; j < len(text); j++ {
		node := &m.nodes[nd]
		next := int32(-1)
		for k, b := range node.keys {
			if b == text[j] {
				next = node.kids[k]
				break
			}
		}
		if next < 0 {
			break
		}
		nd = next
		if t := m.nodes[nd].tok; t != 0 {
			tok, n = t, j+1-i
		}
	}
	return tok, n
}

// next finds the first added token in text at or after from. It returns the
// span the token takes in text (with the whitespace an lstrip/rstrip token
// swallows, never reaching before from) and the token; ok is false if none.
func (m *addedMatcher) next(text string, from int) (start, end int, tok *AddedToken, ok bool) {
	for i := from; i < len(text); i++ {
		if !m.first[text[i]] {
			continue
		}
		t, n := m.longestAt(text, i)
		if t == 0 {
			continue
		}
		at := &m.toks[t-1]
		s, e := i, i+n
		if at.SingleWord && (isWordBefore(text, s) || isWordAfter(text, e)) {
			continue
		}
		if at.LStrip {
			for s > from {
				r, w := utf8.DecodeLastRuneInString(text[from:s])
				if !unicode.IsSpace(r) {
					break
				}
				s -= w
			}
		}
		if at.RStrip {
			for e < len(text) {
				r, w := utf8.DecodeRuneInString(text[e:])
				if !unicode.IsSpace(r) {
					break
				}
				e += w
			}
		}
		return s, e, at, true
	}
	return 0, 0, nil, false
}

func isWordRune(r rune) bool { return r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) }

func isWordBefore(text string, i int) bool {
	if i == 0 {
		return false
	}
	r, _ := utf8.DecodeLastRuneInString(text[:i])
	return isWordRune(r)
}

func isWordAfter(text string, i int) bool {
	if i >= len(text) {
		return false
	}
	r, _ := utf8.DecodeRuneInString(text[i:])
	return isWordRune(r)
}
