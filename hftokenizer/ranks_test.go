package hftokenizer

import (
	"math/rand/v2"
	"strings"
	"testing"
)

// tiktokenMerge is tiktoken's byte_pair_merge as its definition: join the
// adjacent parts whose concatenation has the lowest rank, the leftmost on a
// tie, until no concatenation is a token (tiktoken src/lib.rs); a word that
// is a token is that token.
func tiktokenMerge(ranks map[string]uint32, word string) []uint32 {
	if id, ok := ranks[word]; ok {
		return []uint32{id}
	}
	var parts []string
	for i := 0; i < len(word); i++ {
		parts = append(parts, word[i:i+1])
	}
	for {
		best, bestRank := -1, uint32(1<<31)
		for i := 0; i+1 < len(parts); i++ {
			if r, ok := ranks[parts[i]+parts[i+1]]; ok && r < bestRank {
				best, bestRank = i, r
			}
		}
		if best < 0 {
			break
		}
		parts = append(parts[:best], append([]string{parts[best] + parts[best+1]}, parts[best+2:]...)...)
	}
	ids := make([]uint32, len(parts))
	for i, p := range parts {
		ids[i] = ranks[p]
	}
	return ids
}

// TestFromRanksMergesAsTiktoken: on a small rank table whose tokens can be
// reached by several splits (and whose ranks disagree with the splits'
// order), every word merges as tiktoken's definition does.
func TestFromRanksMergesAsTiktoken(t *testing.T) {
	ranks := map[string]uint32{}
	for c := 0; c < 256; c++ {
		ranks[string([]byte{byte(c)})] = uint32(c)
	}
	r := rand.New(rand.NewPCG(3, 5))
	alphabet := "abcd "
	for len(ranks) < 256+400 {
		n := 2 + r.IntN(5)
		var b strings.Builder
		for range n {
			b.WriteByte(alphabet[r.IntN(len(alphabet))])
		}
		if _, ok := ranks[b.String()]; !ok {
			ranks[b.String()] = uint32(len(ranks))
		}
	}
	tok, err := FromRanks(ranks, `\S+|\s+`)
	if err != nil {
		t.Fatal(err)
	}
	for range 3000 {
		var b strings.Builder
		for range 1 + r.IntN(24) {
			b.WriteByte("abcd"[r.IntN(4)])
		}
		w := b.String()
		got, err := tok.Encode(w, true)
		if err != nil {
			t.Fatal(err)
		}
		if want := tiktokenMerge(ranks, w); !equal32(got, want) {
			t.Fatalf("%q: %v, tiktoken's rule %v", w, got, want)
		}
	}
}

func equal32(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestFromRanksRefuses: a table without every byte, with an empty token or
// with ids far past its size is an error.
func TestFromRanksRefuses(t *testing.T) {
	full := map[string]uint32{}
	for c := 0; c < 256; c++ {
		full[string([]byte{byte(c)})] = uint32(c)
	}
	for name, ranks := range map[string]map[string]uint32{
		"empty":   {},
		"no byte": {"a": 0},
		"blank":   merge(full, map[string]uint32{"": 300}),
		"far id":  merge(full, map[string]uint32{"ab": 1 << 30}),
	} {
		if _, err := FromRanks(ranks, `\S+`); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func merge(a, b map[string]uint32) map[string]uint32 {
	out := map[string]uint32{}
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] = v
	}
	return out
}
