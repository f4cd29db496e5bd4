package sched

import (
	"sync"
	"time"
	"unsafe"
)

// Speculative entries: the precise index's blind spot after a decision.
//
// The precise index learns an endpoint's blocks from the engine's KV events,
// which the engine publishes after the step that computed them: after the
// request's queueing and its whole prefill, plus the events' delivery. Until
// then the index says the chosen endpoint holds nothing of the prompt, so
// (1) the next request sharing the prompt's new prefix — a burst on a new
// system prompt or document, a follow-up turn sent the instant its reply
// arrived — gets no affinity from the precise scorer and scatters or piles
// by load alone, and (2) Decision.MatchedBlocks is 0, so the gateway counts
// the whole prompt as prefill backlog on the endpoint (its cost scorer's
// input) although the engine will take the shared part from its cache.
// Measured on SGLang's shared-prefix workload (1,024 requests at t = 0, 8
// engines, virtual time): every precise-prefix decision matched 0 blocks,
// and the per-engine request counts spread from 96 to 176 (cache-aware: 128
// each), TTFT p99 4.4–5.4 s against 3.9 s (sched/README.md, "precise-prefix's
// p99").
//
// A speculative overlay closes the gap: each decision's prompt counts as
// held by the chosen endpoint for SpeculativeTTL after the decision, and
// the overlay's match is max(precise, speculative) per endpoint. Once the
// events land the precise match covers the prompt and the entry adds
// nothing; an entry whose events never come (the request failed before its
// prefill, the engine evicted the blocks at once) stops counting at the
// TTL. This is llm-d's speculative indexing (llm-d/llm-d-inference-scheduler
// pkg/plugins/scorer/precise_prefix_cache.go: `speculativeIndexing`,
// `speculativeTTL` default 2s, entries written to the index in PreRequest
// and evicted at the TTL) and what SGLang's cache-aware router does with
// every decision (sgl-router src/router.rs: `tree.insert(&text,
// &selected_url)` on route), bounded here in time because the events, not
// the decisions, are the truth.
//
// The entries are kept in one ring of the last specSlots decisions (not per
// endpoint, so a match costs the same at any pool size): a match compares
// the prompt's first block hash with each live entry's, and bisects the
// common run only where they agree (block hashes are chained, so the
// prompts agree on a leading run and differ after it). Per decision that is
// specSlots comparisons plus log2(prompt blocks) per entry that shares the
// prompt's first block.
//
// Memory is bounded by blocks, not by decisions: the entries' hashes live
// in one arena of at most specArena hashes (2 MiB) per profile, each entry
// an (offset, length) into it. The arena is written as a ring (an entry
// that would cross its end starts at 0, the tail left unused), and an entry
// whose hashes a later write has reached is dropped. With slots of their
// own, 1,024 prompts of 4,096 blocks kept 32 MiB per profile for good.
// While the last specSlots prompts total under specArena − specMaxBlocks
// blocks (256 blocks, 4k tokens of 16, each on average) every slot stays
// live and the decisions are those of per-slot storage; a burst of longer
// prompts keeps the most recent ones that fit. The arena grows to the
// blocks it has held and no further, so a decision allocates nothing once
// it is full or once the ring has turned (TestSpeculativeAllocFree).

// Bounds of the speculative overlay.
const (
	// specSlots is how many recent decisions the overlay keeps.
	specSlots = 1024
	// specMaxBlocks bounds the blocks kept of one prompt (64k tokens of 16).
	specMaxBlocks = 1 << 12
	// specArena bounds the hashes the overlay keeps in all (256 Ki, 2 MiB).
	specArena = 1 << 18
)

// DefaultSpeculativeTTL is the built-in precise-prefix profile's
// ProfileConfig.SpeculativeTTL: llm-d's speculativeTTL default (sched/README.md,
// "precise-prefix's p99", for 2 s against 10 s).
const DefaultSpeculativeTTL = 2 * time.Second

// specEntry is one decision's prompt on its endpoint.
type specEntry struct {
	endpoint int           // -1: empty
	first    uint64        // the first hash, kept inline for the scan
	at       time.Duration // when it was decided (Pool.Now)
	pos      uint64        // where its hashes start in the arena, counted in hashes written since creation
	n        int           // how many hashes it keeps (≤ specMaxBlocks)
}

// speculative is a MatchSource over src (the precise index) that also
// counts the prompts of recent decisions as held by their endpoints, and
// the Learner that records them. Safe for concurrent use.
type speculative struct {
	src MatchSource
	ttl time.Duration
	now func() time.Duration // nil: entries expire only by being overwritten

	mu      sync.Mutex
	next    int
	entries [specSlots]specEntry
	// arena holds the entries' hashes: entry en's are
	// arena[en.pos%specArena:][:en.n] while en.pos+specArena ≥ written.
	arena   []uint64
	written uint64 // hashes written (and skipped at a wrap) since creation
}

// live reports whether en's hashes are still in the arena. Callers hold mu.
func (s *speculative) live(en *specEntry) bool {
	return en.endpoint >= 0 && en.n > 0 && s.written <= en.pos+specArena
}

// hashes is en's block hashes in the arena (valid while live). Callers
// hold mu.
func (s *speculative) hashes(en *specEntry) []uint64 {
	p := int(en.pos % specArena)
	return s.arena[p : p+en.n]
}

// heldBytes is the memory the overlay's hashes and slots hold.
func (s *speculative) heldBytes() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return cap(s.arena)*8 + int(unsafe.Sizeof(s.entries))
}

func newSpeculative(src MatchSource, ttl time.Duration, now func() time.Duration) *speculative {
	s := &speculative{src: src, ttl: ttl, now: now}
	for i := range s.entries {
		s.entries[i].endpoint = -1
	}
	return s
}

// Match implements MatchSource: matched[e] is the larger of what src says
// endpoint e holds and the longest leading run of hashes a live entry of e
// shares.
func (s *speculative) Match(hashes []uint64, matched []int) {
	s.src.Match(hashes, matched)
	if len(hashes) == 0 {
		return
	}
	var t time.Duration
	if s.now != nil {
		t = s.now()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.entries {
		en := &s.entries[i]
		e := en.endpoint
		if en.first != hashes[0] || e >= len(matched) || !s.live(en) {
			continue
		}
		if s.now != nil && t-en.at >= s.ttl {
			continue
		}
		if n := commonRun(s.hashes(en), hashes, matched[e]); n > matched[e] {
			matched[e] = n
		}
	}
}

// commonRun is the length of the leading run a and b share, given that
// they share their first block, when it is longer than floor (else floor):
// chained block hashes agree on a prefix and differ after it, so one
// comparison tells whether the run exceeds floor, and bisection finds it.
func commonRun(a, b []uint64, floor int) int {
	hi := min(len(a), len(b)) // the run is ≤ hi
	if floor >= hi || a[max(floor, 1)-1] != b[max(floor, 1)-1] || (floor > 0 && a[floor] != b[floor]) {
		return floor
	}
	if a[hi-1] == b[hi-1] {
		return hi
	}
	// Invariant: a[lo-1] == b[lo-1], a[hi-1] != b[hi-1].
	lo := floor + 1
	for hi-lo > 1 {
		mid := int(uint(lo+hi) >> 1)
		if a[mid-1] == b[mid-1] {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}

// Learn implements Learner: the decision's prompt counts as held by the
// chosen endpoint from now until the TTL.
func (s *speculative) Learn(c *Cycle, chosen int) { s.hold(chosen, c.Req.Hashes) }

// hold counts prompt h (its block hashes, the first specMaxBlocks kept) as
// held by endpoint chosen from now until the TTL: this profile's decision
// (Learn) or a peer replica's (Profile.LearnPeer; its TTL counts from when
// it is heard). Peers' picks share the one ring with this replica's: with
// R replicas it turns over R times as fast, and entries are written over
// before the TTL once the fleet's picks of one TTL exceed specSlots or
// their prompts specArena (about 300 prompts of ~860 blocks, ~150 picks/s
// at a 2 s TTL); the match then falls back to the index's for them.
func (s *speculative) hold(chosen int, h []uint64) {
	if len(h) == 0 || chosen < 0 {
		return
	}
	var t time.Duration
	if s.now != nil {
		t = s.now()
	}
	n := min(len(h), specMaxBlocks)
	s.mu.Lock()
	p := int(s.written % specArena)
	if p+n > specArena { // wrap: the entry starts at 0, the tail unused
		s.written += uint64(specArena - p)
		p = 0
	}
	if p+n > len(s.arena) {
		s.grow(p + n)
	}
	copy(s.arena[p:p+n], h)
	en := &s.entries[s.next]
	s.next = (s.next + 1) % specSlots
	en.endpoint, en.first, en.at = chosen, h[0], t
	en.pos, en.n = s.written, n
	s.written += uint64(n)
	s.mu.Unlock()
}

// grow makes the arena at least n hashes long (n ≤ specArena), doubling
// its capacity up to specArena. Callers hold mu.
func (s *speculative) grow(n int) {
	if n <= cap(s.arena) {
		s.arena = s.arena[:n]
		return
	}
	a := make([]uint64, n, min(max(2*cap(s.arena), n, 1024), specArena))
	copy(a, s.arena)
	s.arena = a
}

// forget drops the entries of endpoint e (it left rotation: its engine may
// have restarted).
func (s *speculative) forget(e int) {
	s.mu.Lock()
	for i := range s.entries {
		if s.entries[i].endpoint == e {
			s.entries[i].endpoint = -1
			s.entries[i].n = 0
		}
	}
	s.mu.Unlock()
}
