package hftokenizer

import (
	"sync"
	"sync/atomic"
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
// of at most maxCachedWord bytes, in cacheShards shards of at most
// cacheShardCap words (65,536 in all). Unlike tokenizers' cache, which takes
// no more words once full (a gateway that runs for days would then keep the
// first 65,536 words it met, however cold), a full shard evicts by CLOCK
// (second chance; Corbató 1968, as in most page caches): every hit sets its
// word's reference bit, and a new word replaces the first word the clock
// hand finds without one, clearing the bits it passes. A word hit at least
// once per turn of the hand stays; a flood of one-off words only replaces
// words not hit since the hand last passed. A hit is a read lock, a map
// lookup and, when the bit is not yet set, one atomic store: no allocation.
type wordCache struct {
	shards [cacheShards]cacheShard
}

const (
	cacheShards   = 16
	cacheShardCap = 4096
	maxCachedWord = 256
)

type cacheShard struct {
	mu    sync.RWMutex
	m     map[string]int32 // word → index in slots
	slots []cacheSlot      // at most cacheShardCap
	hand  int              // the clock hand: the next slot to consider
	_     [16]byte         // keep shards on separate cache lines
}

// cacheSlot is one cached word. word and ids are written under the shard's
// write lock only, and never reused in place (a hit's caller reads ids
// after the read lock is released); ref is set by hits under the read lock.
type cacheSlot struct {
	word string
	ids  []uint32
	ref  atomic.Bool
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
	i, ok := sh.m[word]
	var ids []uint32
	if ok {
		sl := &sh.slots[i]
		ids = sl.ids
		if !sl.ref.Load() {
			sl.ref.Store(true)
		}
	}
	sh.mu.RUnlock()
	return ids, ok
}

func (c *wordCache) put(word string, ids []uint32) {
	if len(word) > maxCachedWord {
		return
	}
	sh := &c.shards[shardOf(word)]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.m == nil {
		sh.m = make(map[string]int32, 256)
	}
	if _, ok := sh.m[word]; ok {
		return
	}
	key, own := string([]byte(word)), append([]uint32(nil), ids...)
	if len(sh.slots) < cacheShardCap {
		sh.m[key] = int32(len(sh.slots))
		sh.slots = append(sh.slots, cacheSlot{word: key, ids: own})
		return
	}
	// Full: at most one turn clears every bit, so the second finds a slot.
	for {
		sl := &sh.slots[sh.hand]
		i := sh.hand
		if sh.hand++; sh.hand == len(sh.slots) {
			sh.hand = 0
		}
		if sl.ref.Load() {
			sl.ref.Store(false)
			continue
		}
		delete(sh.m, sl.word)
		sl.word, sl.ids = key, own
		sh.m[key] = int32(i)
		return
	}
}
