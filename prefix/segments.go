package prefix

import (
	"container/list"
	"sync"

	"github.com/cespare/xxhash/v2"
)

// SegmentCache tokenizes prompts given as segments (a chat's rendered
// messages, see openai.AppendChatSegments), remembering the tokens of
// recent segments: a system prompt or an earlier turn that every request of
// a conversation repeats is tokenized once, not per request. Tokenizing
// segment by segment gives different ids than tokenizing their
// concatenation only at segment boundaries, and always the same ids for the
// same segments — which is what routing needs: equal prompt prefixes hash
// to equal blocks.
//
// Memory is bounded by maxTokens cached token ids (4 bytes each) plus
// about 100 bytes per entry, and the short segments' table (below). Safe
// for concurrent use; one mutex, held for a map lookup and a list move per
// segment (tokenizing runs outside it).
//
// Segments shorter than MinCachedSegment bytes — a chat template's fixed
// pieces (the begin-of-text marker, the assistant header that ends every
// rendered chat), a role header with a short recurring turn — go to a
// direct-mapped table of shortSlots entries keyed by their text (a hit
// compares the text itself): no list, no map, no allocation on a hit, and a
// distinct segment only overwrites one slot. Tokenizing such a segment costs
// 6–15 µs and 40–140 allocations with the library's regexp-based splitter
// (three per chat request before this table; BenchmarkSegmentCacheChat),
// a hit a hash and a compare. The table holds at most shortSlots × (256
// bytes + their ids), about 1.3 MB at worst.
type SegmentCache struct {
	tok       *Tokenizer
	maxTokens int
	mu        sync.Mutex
	entries   map[uint64]*list.Element
	lru       list.List // of *segment, most recent first
	held      int       // token ids cached
	hits      uint64
	misses    uint64
	short     [shortSlots]shortSegment
}

// shortSlots is the size of the short segments' table (a power of two).
const shortSlots = 1024

// shortSegment is a short segment's text and ids (no ids: an empty slot),
// in buffers of the slot's own that the next segment to take the slot
// reuses: a miss allocates nothing once the slot's buffers have grown
// (two allocations per distinct user turn before, a tenth of a chat's
// pick: gateway/README.md "Endpoint picker"). They are read and written
// under the cache's mutex only: a hit copies the ids out.
type shortSegment struct {
	text []byte
	ids  []uint32
}

type segment struct {
	key    uint64
	length int // bytes, to make a hash collision less likely to matter
	ids    []uint32
}

// MinCachedSegment is the smallest segment (bytes) worth caching; shorter
// ones are tokenized each time.
const MinCachedSegment = 256

// NewSegmentCache returns a cache over tok holding at most maxTokens token
// ids (≤ 0: 4,000,000, i.e. 16 MB).
func NewSegmentCache(tok *Tokenizer, maxTokens int) *SegmentCache {
	if maxTokens <= 0 {
		maxTokens = 4_000_000
	}
	return &SegmentCache{tok: tok, maxTokens: maxTokens, entries: make(map[uint64]*list.Element)}
}

// AppendTokens appends the tokens of segs, in order, to dst, reading at most
// maxBytes bytes of them (≤ 0: no limit; the segment that crosses the limit
// is cut as EncodePrefix cuts) and reports whether it cut.
func (c *SegmentCache) AppendTokens(dst []uint32, segs []string, maxBytes int) ([]uint32, bool) {
	used := 0
	for _, s := range segs {
		if maxBytes > 0 && used+len(s) > maxBytes {
			ids, _ := c.tok.EncodePrefix(s, maxBytes-used)
			return append(dst, ids...), true
		}
		used += len(s)
		dst = c.appendSegment(dst, s)
	}
	return dst, false
}

// appendSegment appends the ids of s to dst, through the short segments'
// table or the cache.
func (c *SegmentCache) appendSegment(dst []uint32, s string) []uint32 {
	if len(s) < MinCachedSegment {
		return c.appendShort(dst, s)
	}
	return append(dst, c.segmentTokens(s)...)
}

// segmentTokens returns the ids of s, of at least MinCachedSegment bytes
// (shared with the cache: not to be modified).
func (c *SegmentCache) segmentTokens(s string) []uint32 {
	key := xxhash.Sum64String(s)
	c.mu.Lock()
	if e, ok := c.entries[key]; ok {
		if seg := e.Value.(*segment); seg.length == len(s) {
			c.lru.MoveToFront(e)
			c.hits++
			c.mu.Unlock()
			return seg.ids
		}
	}
	c.misses++
	c.mu.Unlock()
	ids := c.tok.Encode(s)
	if len(ids) > c.maxTokens/8 {
		return ids // too big to be worth a slot
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.entries[key]; ok { // another request cached it meanwhile: replace
		c.held -= len(e.Value.(*segment).ids)
		c.lru.Remove(e)
		delete(c.entries, key)
	}
	c.entries[key] = c.lru.PushFront(&segment{key: key, length: len(s), ids: ids})
	c.held += len(ids)
	for c.held > c.maxTokens {
		last := c.lru.Back()
		seg := last.Value.(*segment)
		c.lru.Remove(last)
		delete(c.entries, seg.key)
		c.held -= len(seg.ids)
	}
	return ids
}

// appendShort is appendSegment for a segment shorter than
// MinCachedSegment, through the direct-mapped table.
func (c *SegmentCache) appendShort(dst []uint32, s string) []uint32 {
	if s == "" {
		return dst
	}
	slot := &c.short[xxhash.Sum64String(s)&(shortSlots-1)]
	c.mu.Lock()
	if len(slot.ids) > 0 && string(slot.text) == s {
		dst = append(dst, slot.ids...)
		c.mu.Unlock()
		return dst
	}
	c.mu.Unlock()
	n := len(dst)
	dst = c.tok.Append(dst, s)
	if len(dst) == n {
		return dst
	}
	c.mu.Lock()
	// s may be on the caller's reused buffer (openai.AppendChatSegmentsIn):
	// copied into the slot's own.
	slot.text, slot.ids = append(slot.text[:0], s...), append(slot.ids[:0], dst[n:]...)
	c.mu.Unlock()
	return dst
}

// Stats returns the cache's hits and misses (segments of at least
// MinCachedSegment bytes) and the token ids it holds.
func (c *SegmentCache) Stats() (hits, misses uint64, tokens int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.hits, c.misses, c.held
}
