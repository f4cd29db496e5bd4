package hftokenizer

import (
	"errors"
	"fmt"
)

// FromRanks returns a tokenizer for a tiktoken-style encoding: ranks maps
// every token's raw bytes to its rank, which is also its id (tiktoken's
// cl100k_base, o200k_base and the like: the `.tiktoken` files, or
// tiktoken-go's embedded tables), and pattern is the encoding's
// pre-tokenizer regex (matches and the text between them are words, as a
// `Split` with `"behavior": "Isolated"`; cl100k_base's is Llama-3's and runs
// on the allocation-free scanner, and TiktokenGoCl100k is that pattern as
// tiktoken-go matches it). There is no normalizer, no added token
// and no post-processor: Encode's addSpecial adds nothing, and special
// tokens in the text are encoded as text, as tiktoken's encode_ordinary.
//
// tiktoken merges a word by repeatedly joining the adjacent pair of parts
// whose concatenation has the lowest rank, the leftmost on a tie, until no
// concatenation is a token (tiktoken src/lib.rs byte_pair_merge; tiktoken-go
// codec/codec.go mergePairs, v0.10.0), after looking the whole word up
// first (a word that is a token is that token). The same merge order is
// this package's BPE (lowest merge rank, leftmost on a tie) with
// ignore_merges and one merge for every split of every token into two
// tokens, ranked by the token's rank: a pair may merge exactly when its
// concatenation is a token, and at that token's rank. Every byte must be a
// token (the BPE starts from single bytes).
//
// Built once per process (cl100k_base: 100,256 tokens, 233,378 merges, 22 MB retained with tiktoken-go's table;
// prefix.NewTokenizer measures it). Ids must fit 32 bits.
func FromRanks(ranks map[string]uint32, pattern string) (*Tokenizer, error) {
	if len(ranks) == 0 {
		return nil, errors.New("ranks: empty vocabulary")
	}
	split, err := newSplitter(pattern, true)
	if err != nil {
		return nil, err
	}
	t := &Tokenizer{steps: []preStep{{split: split}}}
	t.added, t.addedNorm = newAddedMatcher(nil), newAddedMatcher(nil)
	b := &t.model
	b.vocab = make(map[string]uint32, len(ranks))
	maxID := uint32(0)
	for tok, id := range ranks {
		if tok == "" {
			return nil, errors.New("ranks: empty token")
		}
		if id >= deadSymbol-1 {
			return nil, fmt.Errorf("ranks: id %d out of range", id)
		}
		b.vocab[tok] = id
		maxID = max(maxID, id)
	}
	if int(maxID) >= 2*len(ranks)+1024 {
		return nil, fmt.Errorf("ranks: id %d out of range for %d tokens", maxID, len(ranks))
	}
	for c := 0; c < 256; c++ {
		if b.byteID[c], b.hasByte[c] = b.vocab[string([]byte{byte(c)})]; !b.hasByte[c] {
			return nil, fmt.Errorf("ranks: byte %#x is not a token", c)
		}
	}
	b.ignoreMerges = true
	b.merges = make(map[uint64]uint64, 3*len(ranks))
	for tok, id := range b.vocab {
		for i := 1; i < len(tok); i++ {
			l, ok1 := b.vocab[tok[:i]]
			r, ok2 := b.vocab[tok[i:]]
			if ok1 && ok2 {
				b.merges[uint64(l)<<32|uint64(r)] = uint64(id)<<32 | uint64(id)
			}
		}
	}
	t.idToBytes = make([][]byte, maxID+1)
	t.special = make([]bool, maxID+1)
	for tok, id := range b.vocab {
		t.idToBytes[id] = []byte(tok)
	}
	t.addedByID = map[uint32]AddedToken{}
	return t, nil
}
