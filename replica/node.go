package replica

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/infergate/infergate/sched"
)

// DefaultLoadTTL is how long a peer's load counts after it was received
// (Peers): three of the default 200 ms load intervals (stream.Config) and
// a margin, so one late or lost message does not drop a live peer's load
// while a dead replica's vanishes within a second.
const DefaultLoadTTL = time.Second

// MaxPeers bounds the peers whose load is kept: a stream that names more
// replicas (a hostile or misconfigured one) has the excess ignored.
const MaxPeers = 256

// Peers is the load every other replica reported, per endpoint URL, each
// counted for TTL after it was received (the receiver's clock: no skew
// between replicas matters). Update is called by the exchange's reader;
// Add is lock-free (an immutable view swapped on each update), for the
// request path. Times are durations since any fixed origin of the
// caller's clock.
type Peers struct {
	ttl  time.Duration
	mu   sync.Mutex
	last map[string]peerLoad // replica id → its latest load
	view atomic.Pointer[peerView]
}

type peerLoad struct {
	at    time.Duration
	loads []LoadEntry
}

// peerView is an immutable index of last: endpoint URL → every peer's
// load of it, stamped with its receipt time.
type peerView struct {
	byURL map[string][]stamped
	at    []time.Duration // receipt times, one per peer
}

type stamped struct {
	at time.Duration
	Load
}

// NewPeers returns an empty table whose loads count for ttl after receipt
// (DefaultLoadTTL when ttl ≤ 0).
func NewPeers(ttl time.Duration) *Peers {
	if ttl <= 0 {
		ttl = DefaultLoadTTL
	}
	p := &Peers{ttl: ttl, last: map[string]peerLoad{}}
	p.view.Store(&peerView{})
	return p
}

// Update records replica id's load per endpoint, received at now; it
// replaces what id reported before. Peers not heard from for TTL are
// dropped; beyond MaxPeers live peers a new one is ignored (reported
// false).
func (p *Peers) Update(id string, now time.Duration, loads []LoadEntry) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, l := range p.last {
		if now-l.at > p.ttl {
			delete(p.last, k)
		}
	}
	if _, ok := p.last[id]; !ok && len(p.last) >= MaxPeers {
		return false
	}
	p.last[id] = peerLoad{at: now, loads: append([]LoadEntry(nil), loads...)}
	v := &peerView{byURL: make(map[string][]stamped, len(loads))}
	for _, l := range p.last {
		v.at = append(v.at, l.at)
		for _, e := range l.loads {
			v.byURL[e.Endpoint] = append(v.byURL[e.Endpoint], stamped{at: l.at, Load: e.Load})
		}
	}
	p.view.Store(v)
	return true
}

// Add adds to e's load fields (InFlight, InFlightTokens,
// PendingPrefillTokens) the loads that peers received within TTL of now
// reported for endpoint url. It allocates nothing.
func (p *Peers) Add(url string, now time.Duration, e *sched.Endpoint) {
	for _, s := range p.view.Load().byURL[url] {
		if now-s.at <= p.ttl {
			e.InFlight += int(s.InFlight)
			e.InFlightTokens += int(s.InFlightTokens)
			e.PendingPrefillTokens += int(s.PendingPrefill)
		}
	}
}

// Sum is the load peers received within TTL of now reported for url.
func (p *Peers) Sum(url string, now time.Duration) Load {
	var e sched.Endpoint
	p.Add(url, now, &e)
	return Load{int64(e.InFlight), int64(e.InFlightTokens), int64(e.PendingPrefillTokens)}
}

// Live is the number of peers heard from within TTL of now.
func (p *Peers) Live(now time.Duration) int {
	n := 0
	for _, at := range p.view.Load().at {
		if now-at <= p.ttl {
			n++
		}
	}
	return n
}

// Target resolves a learn message to this replica's policy: the policy
// of model's pool and the slot of endpoint (its URL) in it; ok false when
// this replica has no such pool or endpoint, or its policy learns nothing
// (no approximate index).
type Target interface {
	Resolve(model, endpoint string) (l sched.PeerLearner, slot int, ok bool)
}

// Counts are a Node's message counters (monotonic).
type Counts struct {
	// Applied learn and load messages; Own: this replica's, skipped;
	// Unknown: learns for a pool or endpoint this replica does not have;
	// Malformed: refused by Decode; PeersFull: loads of a peer beyond
	// MaxPeers.
	Learns, Loads, Own, Unknown, Malformed, PeersFull atomic.Uint64
}

// Node is one replica's side of the exchange: it applies its peers'
// messages to its policies (Target) and load table (Peers). The same
// Apply runs live (package replica/stream's reader) and in virtual time.
// Apply is safe for concurrent use with Pick and Peers.Add, not with
// itself (the one reader calls it).
type Node struct {
	// ID is this replica's id; its own messages are skipped.
	ID     string
	Peers  *Peers
	Target Target
	Counts Counts
	msg    Msg
}

// Apply decodes message b, received at now (the Peers clock), and applies
// it unless it is this replica's own: a learn teaches the resolved
// policy's approximate index (sched.PeerLearner), a load replaces the
// sender's entry in Peers. It returns the decoded message (valid until the
// next Apply) and an error wrapping ErrMalformed for a bad one.
func (n *Node) Apply(b []byte, now time.Duration) (*Msg, error) {
	m := &n.msg
	if err := Decode(b, m); err != nil {
		n.Counts.Malformed.Add(1)
		return nil, err
	}
	if m.ID == n.ID {
		n.Counts.Own.Add(1)
		return m, nil
	}
	switch m.Kind {
	case KindLearn:
		l, slot, ok := n.Target.Resolve(m.Model, m.Endpoint)
		if !ok {
			n.Counts.Unknown.Add(1)
			return m, nil
		}
		l.LearnPeer(slot, m.Hashes)
		n.Counts.Learns.Add(1)
	case KindLoad:
		if !n.Peers.Update(m.ID, now, m.Loads) {
			n.Counts.PeersFull.Add(1)
			return m, nil
		}
		n.Counts.Loads.Add(1)
	}
	return m, nil
}
