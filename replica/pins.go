package replica

import (
	"sync"
	"time"

	"github.com/infergate/infergate/sched"
)

// Peers' pins (routing.prefix.learn_on_finish behind replicas).
//
// A replica whose approximate index evicts in the engine's order pins each
// prompt it routes until the request ends (sched.Finisher). Its peers pin
// the prompt too when its learn arrives (sched.PeerFinisher's
// LearnPeerPinned) and release it when its finish arrives (ReleasePeer), so
// that every replica's index keeps every running request's blocks, as the
// engine does, and orders the rest by finish time. Touching at the finish
// alone, without the pins, left three replicas at 92% of one replica's hit
// rate on the first 2,000 Mooncake requests, pins at 98% (gateway/README.md
// "Replicas").
//
// A pin must be released exactly once, and a finish may never come: the
// peer was killed with the request in flight, the finish was dropped (the
// sender's queue full, Redis down, the stream trimmed before this replica
// read it). So the node keeps each peer's pins with their hashes and
// releases them itself when the peer falls silent (load_ttl after it was
// last heard from, as its load) or when a pin is older than the pin TTL
// (replicas.pin_ttl; a live peer's lost finish), and at most
// MaxPinnedHashes hashes in at most MaxPins pins are kept pinned (beyond
// either the oldest pin is released first). A finish whose pin is not found (its learn dropped, or
// read before this replica started) touches the prompt without a release,
// so it can never take away a pin of someone else's; a finish_ref (the
// learn named, no hashes) whose pin is not found has nothing to touch with
// and is counted (Counts.FinishesUnmatched).

// DefaultPinTTL is how long a peer's pin may wait for its finish before the
// node releases it (replicas.pin_ttl): longer than the requests a gateway
// serves, whose deadlines are minutes; a pin released early only makes its
// prompt evictable by routing order before it ends.
const DefaultPinTTL = 10 * time.Minute

// MaxPinnedHashes bounds the block hashes of peers' pins a node keeps (8
// bytes each: 8 MiB), about 1,200 Mooncake prompts of the mean length in
// flight on the peers.
const MaxPinnedHashes = 1 << 20

// MaxPins bounds the peers' pins a node keeps (beyond it the oldest pin is
// released first). MaxPinnedHashes alone let a flood of one-block prompts
// (a hostile or broken peer's learns, never finished) keep a million pins
// of about 244 bytes of table each (heap measured after 200,000 such
// learns: +46 MB), 30 times what the hashes' bound says; at MaxPins the
// table holds about 16 MB besides the hashes. 65,536 requests in flight on
// a pool's peers is far beyond what a fleet runs.
const MaxPins = 1 << 16

// Ended pins: a pin released without its finish (expired: its peer was
// silent for the load TTL, it outlived the pin TTL, or the table was
// full) keeps its hashes here, so that a finish_ref that comes after all
// (the peer was only slow: a stalled process, a loaded host) still touches
// the prompt as a finish with hashes would; the oldest are forgotten
// beyond maxEndedHashes hashes (2 MiB) or maxEnded pins. Live, on the 2-core
// host at load ~28, 12–37% of the peers' finishes came after their pin had
// expired as its peer's messages were held up for over a second
// (gateway/README.md "Replicas").
const (
	maxEndedHashes = 1 << 18
	maxEnded       = 4096
)

type pinKey struct {
	peer string
	l    sched.PeerFinisher
	slot int
	last uint64 // the prompt's last chained hash: names the whole prompt
	n    int
}

type pinEntry struct {
	key    pinKey
	hashes []uint64
	at     time.Duration // when pinned
	done   bool
}

// pinTable is a Node's peers' pins: by key (a finish finds its pin), and
// in pinning order (expiry). Guarded by mu: Apply (the reader) and Expire
// (the load reports' ticker) may run concurrently.
type pinTable struct {
	mu     sync.Mutex
	byKey  map[pinKey][]*pinEntry
	order  []*pinEntry // by pinning time; done entries skipped
	head   int
	hashes int                      // hashes held by the live entries
	live   int                      // entries not done
	heard  map[string]time.Duration // peers with pins: last heard from
	spare  [][]uint64
	// ended holds the hashes of pins expired without their finish, by key,
	// endedOrder their keys in expiry order from endedHead (a key whose
	// entry a finish took is skipped), endedHashes their hashes.
	ended       map[pinKey][]uint64
	endedOrder  []pinKey
	endedHead   int
	endedHashes int
	// expired is when Expire last ran.
	expired time.Duration
}

// heardFrom records that peer id was heard from at now (kept for peers
// with pins), and runs Expire when it is due (every quarter of the load
// TTL).
func (n *Node) heardFrom(id string, now time.Duration) {
	t := &n.pins
	t.mu.Lock()
	if _, ok := t.heard[id]; ok {
		t.heard[id] = now
	}
	due := len(t.heard) > 0 && now-t.expired >= n.Peers.ttl/4
	t.mu.Unlock()
	if due {
		n.Expire(now)
	}
}

// pin pins hashes on slot of l for peer id, heard at now; false when l
// does not pin (the caller then learns without a pin) or the table
// cannot take it.
func (n *Node) pin(id string, l sched.PeerLearner, slot int, hashes []uint64, now time.Duration) bool {
	f, ok := l.(sched.PeerFinisher)
	if !ok || len(hashes) == 0 || len(hashes) > MaxPinnedHashes || !f.PinsPeers() {
		return false
	}
	t := &n.pins
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.byKey == nil {
		t.byKey, t.heard = map[pinKey][]*pinEntry{}, map[string]time.Duration{}
	}
	if _, ok := t.heard[id]; !ok && len(t.heard) >= MaxPeers {
		return false
	}
	t.heard[id] = now
	for (t.hashes+len(hashes) > MaxPinnedHashes || t.live >= MaxPins) && t.head < len(t.order) {
		n.expireFront()
	}
	var h []uint64
	if k := len(t.spare); k > 0 {
		h, t.spare = t.spare[k-1][:0], t.spare[:k-1]
	}
	e := &pinEntry{key: pinKey{peer: id, l: f, slot: slot, last: hashes[len(hashes)-1], n: len(hashes)},
		hashes: append(h, hashes...), at: now}
	t.byKey[e.key] = append(t.byKey[e.key], e)
	t.order = append(t.order, e)
	t.hashes += len(hashes)
	t.live++
	f.LearnPeerPinned(slot, e.hashes)
	return true
}

// unpin releases the pin of peer id's prompt of blocks hashes, the last
// one last, on slot of f, if the table holds one, and reports whether it
// did (a finish's hashes, or a finish_ref's name of them: the same key).
func (n *Node) unpin(id string, f sched.PeerFinisher, slot int, last uint64, blocks int) bool {
	if blocks <= 0 {
		return false
	}
	t := &n.pins
	t.mu.Lock()
	defer t.mu.Unlock()
	k := pinKey{peer: id, l: f, slot: slot, last: last, n: blocks}
	es := t.byKey[k]
	if len(es) == 0 {
		return false
	}
	e := es[0]
	if len(es) == 1 {
		delete(t.byKey, k)
	} else {
		t.byKey[k] = es[1:]
	}
	n.release(e)
	t.compact()
	return true
}

// release releases e's pin (called with mu held; e is still in byKey
// unless the caller removed it).
func (n *Node) release(e *pinEntry) { n.releaseTo(e, false) }

// releaseTo releases e's pin and, with keep, keeps its hashes among the
// ended pins for a finish_ref that may still come (called with mu held).
func (n *Node) releaseTo(e *pinEntry, keep bool) {
	t := &n.pins
	e.key.l.ReleasePeer(e.key.slot, e.hashes)
	if h := t.retire(e); keep {
		t.keepEnded(e.key, h)
	} else {
		t.spare = append(t.spare, h)
	}
}

// retire marks e done, takes its hashes out of the count and returns them
// (called with mu held).
func (t *pinTable) retire(e *pinEntry) []uint64 {
	e.done = true
	t.hashes -= len(e.hashes)
	t.live--
	h := e.hashes
	e.hashes = nil
	return h
}

// unlink removes e from byKey (called with mu held).
func (t *pinTable) unlink(e *pinEntry) {
	es := t.byKey[e.key]
	for i, x := range es {
		if x == e {
			es = append(es[:i:i], es[i+1:]...)
			break
		}
	}
	if len(es) == 0 {
		delete(t.byKey, e.key)
	} else {
		t.byKey[e.key] = es
	}
}

// keepEnded keeps h, the hashes of k's pin expired without its finish,
// forgetting the oldest ended pins beyond the bounds (called with mu held).
func (t *pinTable) keepEnded(k pinKey, h []uint64) {
	if _, ok := t.ended[k]; ok || len(h) > maxEndedHashes {
		t.spare = append(t.spare, h) // the same prompt already kept: one finish touches it
		return
	}
	for (t.endedHashes+len(h) > maxEndedHashes || len(t.ended) >= maxEnded) && t.endedHead < len(t.endedOrder) {
		old := t.endedOrder[t.endedHead]
		t.endedOrder[t.endedHead] = pinKey{}
		t.endedHead++
		t.forgetEnded(old)
	}
	if t.ended == nil {
		t.ended = map[pinKey][]uint64{}
	}
	t.ended[k] = h
	t.endedHashes += len(h)
	if t.endedHead > 64 && 2*t.endedHead > len(t.endedOrder) {
		n := copy(t.endedOrder, t.endedOrder[t.endedHead:])
		clear(t.endedOrder[n:])
		t.endedOrder, t.endedHead = t.endedOrder[:n], 0
	}
	t.endedOrder = append(t.endedOrder, k)
}

// forgetEnded drops k's ended hashes, if kept (called with mu held).
func (t *pinTable) forgetEnded(k pinKey) {
	if h, ok := t.ended[k]; ok {
		delete(t.ended, k)
		t.endedHashes -= len(h)
		t.spare = append(t.spare, h)
	}
}

// touchEnded touches, on slot of f, the prompt of peer id's pin of
// blocks hashes ending in last that expired before its finish came, if
// its hashes are still kept, and reports whether it did (a finish_ref's
// fallback: FinishPeer with the hashes the pin kept).
func (n *Node) touchEnded(id string, f sched.PeerFinisher, slot int, last uint64, blocks int) bool {
	t := &n.pins
	t.mu.Lock()
	defer t.mu.Unlock()
	k := pinKey{peer: id, l: f, slot: slot, last: last, n: blocks}
	h, ok := t.ended[k]
	if !ok {
		return false
	}
	f.FinishPeer(slot, h)
	t.forgetEnded(k)
	return true
}

// expireFront releases the oldest live pin, its finish never seen
// (called with mu held).
func (n *Node) expireFront() {
	t := &n.pins
	for t.head < len(t.order) && t.order[t.head].done {
		t.head++
	}
	if t.head == len(t.order) {
		return
	}
	e := t.order[t.head]
	t.head++
	n.drop(e)
	n.Counts.PinsExpired.Add(1)
}

// drop removes e from byKey and releases it, its finish never seen: its
// hashes are kept among the ended pins (called with mu held).
func (n *Node) drop(e *pinEntry) {
	n.pins.unlink(e)
	n.releaseTo(e, true)
}

// compact drops the done entries at the front of order and, when most of
// it is done (a long request's pin ahead of many ended ones), the rest, so
// that order holds O(live pins) entries (called with mu held).
func (t *pinTable) compact() {
	for t.head < len(t.order) && t.order[t.head].done {
		t.order[t.head] = nil
		t.head++
	}
	if len(t.order)-t.head > 2*t.live+64 {
		k := 0
		for _, e := range t.order[t.head:] {
			if !e.done {
				t.order[k] = e
				k++
			}
		}
		clear(t.order[k:])
		t.order, t.head = t.order[:k], 0
	} else if t.head > 64 && t.head*2 > len(t.order) {
		t.order = t.order[:copy(t.order, t.order[t.head:])]
		t.head = 0
	}
	if t.hashes == 0 {
		clear(t.order[:t.head])
		t.order, t.head = t.order[:0], 0
	}
}

// Expire releases, at now, the peers' pins whose finish has not come:
// every pin of a peer not heard from for the load TTL (Peers; a dead
// replica's requests end with it) and every pin older than PinTTL
// (DefaultPinTTL when 0; a live peer's dropped finish). The gateway calls
// it with each load report, virtual time at each load interval, and Apply
// every quarter of the load TTL as messages come. It returns the pins
// released.
func (n *Node) Expire(now time.Duration) int {
	ttl := n.PinTTL
	if ttl <= 0 {
		ttl = DefaultPinTTL
	}
	t := &n.pins
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expired = now
	released := 0
	dead := false
	for _, at := range t.heard {
		dead = dead || now-at > n.Peers.ttl
	}
	if dead {
		for i := t.head; i < len(t.order); i++ {
			if e := t.order[i]; !e.done && now-t.heard[e.key.peer] > n.Peers.ttl {
				n.drop(e)
				released++
			}
		}
		for id, at := range t.heard {
			if now-at > n.Peers.ttl {
				delete(t.heard, id)
			}
		}
	}
	for t.head < len(t.order) {
		e := t.order[t.head]
		if !e.done && now-e.at <= ttl {
			break
		}
		if !e.done {
			n.drop(e)
			released++
		}
		t.order[t.head] = nil
		t.head++
	}
	t.compact()
	n.Counts.PinsExpired.Add(uint64(released))
	return released
}

// Pinned returns the peers' pins held and their hashes.
func (n *Node) Pinned() (pins, hashes int) {
	t := &n.pins
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, es := range t.byKey {
		pins += len(es)
	}
	return pins, t.hashes
}

// DropPins drops, without releasing them, the peers' pins for which keep
// reports false, and returns how many it dropped. The gateway calls it when
// a pin's release would reach the wrong state: the policy that holds it was
// replaced by a reload (releasing there is pointless, and the pin table
// would keep the old policy's whole index alive until the pin TTL), or its
// slot was forgotten (the forget cleared the slot's pins; a later release
// there would take away a pin of the slot's next engine or of a relearnt
// prompt). O(pins held); reloads and ejections only.
func (n *Node) DropPins(keep func(f sched.PeerFinisher, slot int) bool) int {
	t := &n.pins
	t.mu.Lock()
	defer t.mu.Unlock()
	dropped := 0
	for i := t.head; i < len(t.order); i++ {
		e := t.order[i]
		if e.done || keep(e.key.l, e.key.slot) {
			continue
		}
		t.unlink(e)
		t.spare = append(t.spare, t.retire(e))
		e.key.l = nil // the policy is not kept alive by a dropped pin
		dropped++
	}
	for i := t.endedHead; i < len(t.endedOrder); i++ {
		if k := t.endedOrder[i]; k.l != nil && !keep(k.l, k.slot) {
			t.forgetEnded(k)
			t.endedOrder[i] = pinKey{} // nor kept alive here: skipped when reached
		}
	}
	t.compact()
	n.Counts.PinsDropped.Add(uint64(dropped))
	return dropped
}
