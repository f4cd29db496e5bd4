package hftokenizer

import (
	"sync"
)

// bpe is the byte-level BPE model of a tokenizer.json (`"model": {"type":
// "BPE"}`), over raw bytes: vocabulary strings are mapped back from GPT-2's
// byte-to-unicode alphabet at load, so a pre-token's bytes are merged as they
// are, with no per-byte rune conversion on the hot path.
//
// The merge order is Hugging Face tokenizers' (tokenizers/src/models/bpe/
// word.rs, Word::merge_all, v0.21): repeatedly merge the adjacent pair of
// lowest merge rank, the leftmost on a tie, until no pair has a rank. With
// ignore_merges (model.rs, BPE::tokenize), a pre-token that is itself in the
// vocabulary is that one token, whatever the merges would make of it.
type bpe struct {
	vocab        map[string]uint32 // raw bytes → id
	merges       map[uint64]uint64 // left<<32|right → rank<<32|merged id
	byteID       [256]uint32       // single-byte token ids
	hasByte      [256]bool         // false: the byte has no token (dropped, as HF does without unk_token)
	ignoreMerges bool
	cache        wordCache
}

// mergeScratch holds one encode's working memory; pooled, so merging
// allocates nothing once warm.
type mergeScratch struct {
	ids  []uint32 // symbol id per position
	next []int32  // linked list of live symbols, -1 = none
	prev []int32
	heap []uint64 // min-heap of rank<<32|left position
}

var scratchPool = sync.Pool{New: func() any { return new(mergeScratch) }}

// appendWord appends the ids of one pre-token (raw bytes) to dst.
func (m *bpe) appendWord(dst []uint32, word string) []uint32 {
	if len(word) == 0 {
		return dst
	}
	if ids, ok := m.cache.get(word); ok {
		return append(dst, ids...)
	}
	if m.ignoreMerges {
		if id, ok := m.vocab[word]; ok {
			dst = append(dst, id)
			m.cache.put(word, dst[len(dst)-1:])
			return dst
		}
	}
	n0 := len(dst)
	if len(word) == 1 {
		if m.hasByte[word[0]] {
			dst = append(dst, m.byteID[word[0]])
		}
		return dst
	}
	s := scratchPool.Get().(*mergeScratch)
	dst = m.merge(dst, word, s)
	scratchPool.Put(s)
	m.cache.put(word, dst[n0:])
	return dst
}

// merge runs the BPE merges over word's bytes. Cost: O(n log n) for a word
// of n bytes (one heap entry per candidate pair, stale entries skipped on
// pop, as word.rs does), memory O(n) in s.
func (m *bpe) merge(dst []uint32, word string, s *mergeScratch) []uint32 {
	n := 0
	s.ids = s.ids[:0]
	for i := 0; i < len(word); i++ {
		if !m.hasByte[word[i]] {
			continue
		}
		s.ids = append(s.ids, m.byteID[word[i]])
		n++
	}
	if n == 0 {
		return dst
	}
	s.next = grow32(s.next, n)
	s.prev = grow32(s.prev, n)
	for i := 0; i < n; i++ {
		s.prev[i] = int32(i - 1)
		s.next[i] = int32(i + 1)
	}
	s.next[n-1] = -1
	h := s.heap[:0]
	for i := 0; i+1 < n; i++ {
		if rm, ok := m.merges[uint64(s.ids[i])<<32|uint64(s.ids[i+1])]; ok {
			h = heapPush(h, rm&^0xFFFFFFFF|uint64(i))
		}
	}
	for len(h) > 0 {
		var top uint64
		h, top = heapPop(h)
		pos := int32(top & 0xFFFFFFFF)
		rank := top >> 32
		nx := s.next[pos]
		if s.ids[pos] == deadSymbol || nx < 0 {
			continue
		}
		rm, ok := m.merges[uint64(s.ids[pos])<<32|uint64(s.ids[nx])]
		if !ok || rm>>32 != rank {
			continue // stale: a neighbour was merged since this pair was pushed
		}
		// Merge nx into pos.
		s.ids[pos] = uint32(rm)
		s.ids[nx] = deadSymbol
		nn := s.next[nx]
		s.next[pos] = nn
		if nn >= 0 {
			s.prev[nn] = pos
		}
		if p := s.prev[pos]; p >= 0 {
			if rm2, ok := m.merges[uint64(s.ids[p])<<32|uint64(s.ids[pos])]; ok {
				h = heapPush(h, rm2&^0xFFFFFFFF|uint64(p))
			}
		}
		if nn >= 0 {
			if rm2, ok := m.merges[uint64(s.ids[pos])<<32|uint64(s.ids[nn])]; ok {
				h = heapPush(h, rm2&^0xFFFFFFFF|uint64(pos))
			}
		}
	}
	s.heap = h
	for i := int32(0); i >= 0; i = s.next[i] {
		dst = append(dst, s.ids[i])
	}
	return dst
}

// deadSymbol marks a position merged into its left neighbour. No vocabulary
// has 2^32-1 tokens (ids are checked at load).
const deadSymbol = ^uint32(0)

func grow32(b []int32, n int) []int32 {
	if cap(b) < n {
		return make([]int32, n)
	}
	return b[:n]
}

func heapPush(h []uint64, v uint64) []uint64 {
	h = append(h, v)
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if h[p] <= v {
			break
		}
		h[i] = h[p]
		i = p
	}
	h[i] = v
	return h
}

func heapPop(h []uint64) ([]uint64, uint64) {
	top := h[0]
	last := h[len(h)-1]
	h = h[:len(h)-1]
	n := len(h)
	if n == 0 {
		return h, top
	}
	i := 0
	for {
		c := 2*i + 1
		if c >= n {
			break
		}
		if c+1 < n && h[c+1] < h[c] {
			c++
		}
		if h[c] >= last {
			break
		}
		h[i] = h[c]
		i = c
	}
	h[i] = last
	return h, top
}

// wordCache remembers the ids of recently merged pre-tokens, as Hugging Face
// tokenizers' BPE cache does (tokenizers/src/utils/cache.rs, v0.21): words
// of at most maxCachedWord bytes, and once a shard is full it takes no more
// (no eviction, so a hit costs one read lock and one map lookup). Bounded:
// at most cacheShards × cacheShardCap words.
type wordCache struct {
	shards [cacheShards]cacheShard
}

const (
	cacheShards   = 16
	cacheShardCap = 4096
	maxCachedWord = 256
)

type cacheShard struct {
	mu sync.RWMutex
	m  map[string][]uint32
	_  [40]byte // keep shards on separate cache lines
}

func shardOf(word string) int {
	// FNV-1a over at most the first and last 8 bytes: cheap and spread enough.
	h := uint32(2166136261)
	n := len(word)
	for i := 0; i < n && i < 8; i++ {
		h = (h ^ uint32(word[i])) * 16777619
	}
	for i := max(8, n-8); i < n; i++ {
		h = (h ^ uint32(word[i])) * 16777619
	}
	h ^= uint32(n)
	return int(h % cacheShards)
}

func (c *wordCache) get(word string) ([]uint32, bool) {
	if len(word) > maxCachedWord {
		return nil, false
	}
	sh := &c.shards[shardOf(word)]
	sh.mu.RLock()
	ids, ok := sh.m[word]
	sh.mu.RUnlock()
	return ids, ok
}

func (c *wordCache) put(word string, ids []uint32) {
	if len(word) > maxCachedWord {
		return
	}
	sh := &c.shards[shardOf(word)]
	sh.mu.Lock()
	if sh.m == nil {
		sh.m = make(map[string][]uint32, 256)
	}
	if len(sh.m) < cacheShardCap {
		if _, ok := sh.m[word]; !ok {
			sh.m[string([]byte(word))] = append([]uint32(nil), ids...)
		}
	}
	sh.mu.Unlock()
}
