package replica

import (
	"math"
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
// replicas (a hostile or misconfigured one) has the excess ignored. Node
// keeps only the loads of endpoints its Target knows, so a Peers holds at
// most MaxPeers × the replica's own endpoints cells whatever its stream
// says.
const MaxPeers = 64

// Peers is the load every other replica reported, per endpoint URL, each
// counted for TTL after the peer was last heard from (the receiver's
// clock: no skew between replicas matters). A peer's load report replaces
// what it reported before; each of its learns adds the routed request
// (Routed) until its next report, which counts it itself: so a peer's
// decisions weigh on this replica's view within the exchange's delay, not
// the load interval's. A peer's messages must arrive in the order it sent
// them (one Redis stream; FIFO in virtual time). Update and Routed are
// called by the exchange's reader; Add is lock-free, for the request path.
// Times are durations since any fixed origin of the caller's clock.
type Peers struct {
	ttl   time.Duration
	mu    sync.Mutex
	peers map[string]*peerState // replica id → its state
	view  atomic.Pointer[peerView]
	// empty counts the view's URLs without cells (guarded by mu).
	empty int
}

type peerState struct {
	id    string
	at    atomic.Int64 // when last heard from (ns of the caller's clock)
	cells map[string]*cell
	// learnt is when a learn of the peer was last applied (ns of the
	// caller's clock; math.MinInt64 before the first): Node.Due.
	learnt atomic.Int64
	// reports counts the peer's load reports (Update), which mark the
	// cells they name with it. Guarded by Peers.mu.
	reports uint64
}

// cell is one peer's load of one endpoint.
type cell struct {
	peer                     *peerState
	inFlight, tokens, prefil atomic.Int64
	// report is the peer's last report (peerState.reports) that named
	// this cell. Guarded by Peers.mu.
	report uint64
}

// peerView is the index the request path reads without a lock: the
// cells by endpoint URL and the peers. Its map and peers slice are never
// written once published; a URL's cells are swapped whole (urlCells), so
// a peer's report that adds or drops one endpoint costs O(peers), not a
// rebuild of every peer's cells: a rebuild per change let a peer flapping
// one-entry reports (44 bytes each) between two endpoints cost the reader
// 5–7 ms and 1.2 MB per message at 64 peers × 1,000 endpoints
// (BenchmarkApplyFlappingLoad).
type peerView struct {
	byURL map[string]*urlCells
	peers []*peerState
}

// urlCells is the cells of one endpoint URL (never nil once published;
// empty when no peer has one, until compacted away).
type urlCells struct{ cells atomic.Pointer[[]*cell] }

// NewPeers returns an empty table whose loads count for ttl after their
// peer was last heard from (DefaultLoadTTL when ttl ≤ 0).
func NewPeers(ttl time.Duration) *Peers {
	if ttl <= 0 {
		ttl = DefaultLoadTTL
	}
	p := &Peers{ttl: ttl, peers: map[string]*peerState{}}
	p.view.Store(&peerView{byURL: map[string]*urlCells{}})
	return p
}

// peer returns id's state, created when new (false beyond MaxPeers live
// peers), with peers silent for TTL dropped first (their cells with
// them). Called with p.mu held.
func (p *Peers) peer(id string, now time.Duration) (ps *peerState, ok bool) {
	changed := false
	for k, q := range p.peers {
		if now-time.Duration(q.at.Load()) > p.ttl {
			for url, c := range q.cells {
				p.unlink(url, c)
			}
			delete(p.peers, k)
			changed = true
		}
	}
	if ps = p.peers[id]; ps == nil {
		if len(p.peers) < MaxPeers {
			ps = &peerState{id: id, cells: map[string]*cell{}}
			ps.learnt.Store(math.MinInt64)
			p.peers[id] = ps
			changed = true
		}
	}
	if changed {
		v := p.view.Load()
		nv := &peerView{byURL: v.byURL, peers: make([]*peerState, 0, len(p.peers))}
		for _, q := range p.peers {
			nv.peers = append(nv.peers, q)
		}
		p.view.Store(nv)
	}
	if ps == nil {
		return nil, false
	}
	ps.at.Store(int64(now))
	return ps, true
}

// cell returns ps's cell of url, created (and published) when new.
// Called with p.mu held.
func (p *Peers) cell(ps *peerState, url string) *cell {
	c := ps.cells[url]
	if c != nil {
		return c
	}
	c = &cell{peer: ps}
	ps.cells[url] = c
	v := p.view.Load()
	uc := v.byURL[url]
	if uc == nil {
		m := make(map[string]*urlCells, len(v.byURL)+1)
		for u, x := range v.byURL {
			m[u] = x
		}
		uc = new(urlCells)
		uc.cells.Store(new([]*cell))
		m[url] = uc
		p.view.Store(&peerView{byURL: m, peers: v.peers})
	} else if len(*uc.cells.Load()) == 0 {
		p.empty--
	}
	old := *uc.cells.Load()
	cs := append(make([]*cell, 0, len(old)+1), old...)
	cs = append(cs, c)
	uc.cells.Store(&cs)
	return c
}

// unlink removes cell c of url from the published view (its peer's map
// is the caller's); URLs left without cells are dropped from the view
// once they outnumber the others (and 64): a map copy per such drop
// would cost O(URLs) a message again. Called with p.mu held.
func (p *Peers) unlink(url string, c *cell) {
	c.inFlight.Store(0)
	c.tokens.Store(0)
	c.prefil.Store(0)
	v := p.view.Load()
	uc := v.byURL[url]
	if uc == nil {
		return
	}
	old := *uc.cells.Load()
	cs := make([]*cell, 0, len(old))
	for _, x := range old {
		if x != c {
			cs = append(cs, x)
		}
	}
	uc.cells.Store(&cs)
	if len(cs) > 0 {
		return
	}
	if p.empty++; p.empty <= 64 || p.empty <= len(v.byURL)-p.empty {
		return
	}
	m := make(map[string]*urlCells, len(v.byURL)-p.empty)
	for u, x := range v.byURL {
		if len(*x.cells.Load()) > 0 {
			m[u] = x
		}
	}
	p.empty = 0
	p.view.Store(&peerView{byURL: m, peers: v.peers})
}

// Update records replica id's load per endpoint, received at now; it
// replaces what id reported or was credited with (Routed) before. Peers
// not heard from for TTL are dropped; beyond MaxPeers live peers a new
// one is ignored (reported false).
func (p *Peers) Update(id string, now time.Duration, loads []LoadEntry) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	ps, ok := p.peer(id, now)
	if !ok {
		return false
	}
	// The cells this report names are marked with its number and the
	// others dropped: no set of the reported URLs per report (at 1,000
	// endpoints it was one map of 1,000 per report).
	ps.reports++
	for _, e := range loads {
		c := p.cell(ps, e.Endpoint)
		c.report = ps.reports
		c.inFlight.Store(e.InFlight)
		c.tokens.Store(e.InFlightTokens)
		c.prefil.Store(e.PendingPrefill)
	}
	for url, c := range ps.cells {
		if c.report != ps.reports {
			delete(ps.cells, url)
			p.unlink(url, c)
		}
	}
	return true
}

// Routed credits replica id, heard from at now, with a request it routed
// to endpoint url: one in flight, prompt tokens in flight, pending of them
// in the prefill backlog, until id's next Update. false: id is beyond
// MaxPeers.
func (p *Peers) Routed(id, url string, now time.Duration, prompt, pending int64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	ps, ok := p.peer(id, now)
	if ok {
		c := p.cell(ps, url)
		// Saturating at the wire's bound on a count (maxCount, 2^40): a
		// peer that sends learns and never a load report would otherwise
		// grow a cell without bound, 2^40 tokens a learn, and wrap
		// int64 after 2^23 learns into a negative load that draws every
		// pick (the cells' only writers hold p.mu).
		saturate(&c.inFlight, 1)
		saturate(&c.tokens, prompt)
		saturate(&c.prefil, pending)
	}
	return ok
}

// Learnt records that a learn of replica id was applied at now (a
// staggered decision's turn: Node.Due); false: id is beyond MaxPeers.
func (p *Peers) Learnt(id string, now time.Duration) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	ps, ok := p.peer(id, now)
	if ok {
		ps.learnt.Store(int64(now))
	}
	return ok
}

// learntSince reports whether every peer heard from within TTL of now
// whose id is below self has had a learn applied at or after since
// (Learnt). It takes no lock and allocates nothing.
func (p *Peers) learntSince(self string, since, now time.Duration) bool {
	for _, ps := range p.view.Load().peers {
		if ps.id < self && now-time.Duration(ps.at.Load()) <= p.ttl && ps.learnt.Load() < int64(since) {
			return false
		}
	}
	return true
}

// saturate adds d (≥ 0) to v, at most to maxCount. Called with p.mu held.
func saturate(v *atomic.Int64, d int64) {
	v.Store(min(v.Load()+min(max(d, 0), maxCount), maxCount))
}

// Add adds to e's load fields (InFlight, InFlightTokens,
// PendingPrefillTokens) the loads of endpoint url of the peers heard from
// within TTL of now. It takes no lock and allocates nothing.
func (p *Peers) Add(url string, now time.Duration, e *sched.Endpoint) {
	uc := p.view.Load().byURL[url]
	if uc == nil {
		return
	}
	for _, c := range *uc.cells.Load() {
		if now-time.Duration(c.peer.at.Load()) <= p.ttl {
			e.InFlight += int(c.inFlight.Load())
			e.InFlightTokens += int(c.tokens.Load())
			e.PendingPrefillTokens += int(c.prefil.Load())
		}
	}
}

// Sum is the load of url of the peers heard from within TTL of now.
func (p *Peers) Sum(url string, now time.Duration) Load {
	var e sched.Endpoint
	p.Add(url, now, &e)
	return Load{int64(e.InFlight), int64(e.InFlightTokens), int64(e.PendingPrefillTokens)}
}

// Live is the number of peers heard from within TTL of now.
func (p *Peers) Live(now time.Duration) int {
	n := 0
	for _, ps := range p.view.Load().peers {
		if now-time.Duration(ps.at.Load()) <= p.ttl {
			n++
		}
	}
	return n
}

// rank returns the number of live replicas, self and the peers heard
// from within TTL of now, and the rank of self among them by id (0 for the
// least). It takes no lock and allocates nothing.
func (p *Peers) rank(self string, now time.Duration) (rank, live int) {
	live = 1
	for _, ps := range p.view.Load().peers {
		if now-time.Duration(ps.at.Load()) <= p.ttl && ps.id != self {
			live++
			if ps.id < self {
				rank++
			}
		}
	}
	return rank, live
}

// Seed is the routing seed (sched.Config.Seed) of replica id for a
// configured seed: each replica draws its tie-breaks from its own streams.
// Replicas sharing one seed draw alike at their n-th decisions and, on
// ties (a cold prompt, equal loads), herd onto the same endpoint.
func Seed(seed uint64, id string) uint64 {
	h := uint64(0xcbf29ce484222325) // FNV-1a, 64-bit
	for i := 0; i < len(id); i++ {
		h = (h ^ uint64(id[i])) * 0x100000001b3
	}
	if s := seed ^ h; s != 0 {
		return s
	}
	return 1
}

// Target resolves a learn message to this replica's policy: the policy
// of model's pool (nil when it learns nothing: no approximate index) and
// the slot of endpoint (its URL) in it; ok false when this replica has no
// such pool or endpoint (the learn is then neither learnt nor credited).
// role is Msg.Role: for a P/D pool (sched.PD) the profile whose pick the
// learn was — the prefill profile's for RolePrefill, the decode profile's
// for RoleDecode and for RoleBoth (a peer that serves the model whole:
// its endpoint computed the prompt, as D does a request it keeps whole);
// a pool without P/D learns every role alike (the endpoint holds the
// prompt's blocks either way).
type Target interface {
	Resolve(model, endpoint string, role sched.Role) (l sched.PeerLearner, slot int, ok bool)
	// Interner's Intern reports whether an endpoint URL is one of this
	// replica's, and gives this replica's own string of it: load report
	// entries for others are dropped, and those of its own decode without
	// a string each (a report of 1,000 endpoints cost 1,007 allocations
	// before, gateway/README.md "Replicas").
	Interner
}

// Counts are a Node's message counters (monotonic).
type Counts struct {
	// Applied learn, load and finish messages; Own: this replica's, skipped;
	// Unknown: learns for a pool or endpoint this replica does not have;
	// Malformed: refused by Decode; PeersFull: loads of a peer beyond
	// MaxPeers.
	Learns, Loads, Finishes, Own, Unknown, Malformed, PeersFull atomic.Uint64
	// PinsExpired counts peers' pins released without their finish (the
	// peer fell silent, the pin outlived PinTTL, or the table was full).
	PinsExpired atomic.Uint64
	// PinsDropped counts peers' pins dropped unreleased (DropPins): their
	// policy replaced by a reload, or their slot forgotten.
	PinsDropped atomic.Uint64
	// FinishesUnmatched counts finish_ref messages (a finish naming its
	// learn, no hashes; counted in Finishes too) whose pin a profile that
	// learns on finish did not hold, nor its hashes among the pins expired
	// lately: the learn lost or read before this replica started, its pin
	// expired long before or never taken (a P/D profile): nothing was
	// touched.
	FinishesUnmatched atomic.Uint64
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
	// Unseen is this replica's decisions the exchange has not delivered
	// back to it yet (Expect): the publisher calls Unseen.Sent with each
	// learn it publishes, Apply retires them as they come back.
	Unseen Unseen
	// NoStagger turns off the staggered decisions of bursts (Stagger):
	// every replica then decides at once, on Expect's estimate.
	NoStagger bool
	// PinTTL bounds how long a peer's pin waits for its finish (Expire;
	// DefaultPinTTL when 0).
	PinTTL time.Duration
	shared atomic.Pointer[share] // Expect's share of the pool, cached
	msg    Msg
	pins   pinTable
}

// Apply decodes message b, received at now (the Peers clock), and applies
// it unless it is this replica's own (whose learn retires its decision
// from Unseen): a learn teaches the resolved
// policy's approximate index and speculative entries (sched.PeerLearner)
// and credits the sender
// with the request in Peers (Routed), a finish touches the prompt in the
// indexes that learn on finish (sched.PeerFinisher), a load replaces the
// sender's entry in Peers. It returns the decoded message (valid until the
// next Apply) and an error wrapping ErrMalformed for a bad one.
func (n *Node) Apply(b []byte, now time.Duration) (*Msg, error) {
	m := &n.msg
	if err := decodeInterned(b, m, n.Target); err != nil {
		n.Counts.Malformed.Add(1)
		return nil, err
	}
	if m.ID == n.ID {
		n.Counts.Own.Add(1)
		if m.Kind == KindLearn {
			n.Unseen.Echo(m.At, now)
		}
		return m, nil
	}
	n.heardFrom(m.ID, now)
	switch m.Kind {
	case KindLearn:
		// Any learn of the peer, of a pool this replica has or not: a
		// decision of it that a staggered one waits for (Node.Due).
		n.Peers.Learnt(m.ID, now)
		l, slot, ok := n.Target.Resolve(m.Model, m.Endpoint, m.Role)
		if !ok {
			n.Counts.Unknown.Add(1)
			return m, nil
		}
		if l != nil && !n.pin(m.ID, l, slot, m.Hashes, now) {
			l.LearnPeer(slot, m.Hashes)
		}
		n.Counts.Learns.Add(1)
		if m.Prompt > 0 && !n.Peers.Routed(m.ID, m.Endpoint, now, m.Prompt, m.Pending) {
			n.Counts.PeersFull.Add(1)
		}
	case KindFinish:
		n.finish(m)
	case KindLoad:
		// m.Loads holds only this replica's endpoints (decodeInterned).
		if !n.Peers.Update(m.ID, now, m.Loads) {
			n.Counts.PeersFull.Add(1)
			return m, nil
		}
		n.Counts.Loads.Add(1)
	}
	return m, nil
}

// finish applies a peer's finish: the pool's profiles that learn on
// finish release the pin its learn took here (pins.go) or, without one,
// touch its prompt on the endpoint (sched.PeerFinisher); the decode
// profile and, for a P/D pool, the prefill profile too, as the sender's
// sched.PD.Finished releases it in both (one engine's cache, which both
// indexes model). The sender's load is left to its next report.
func (n *Node) finish(m *Msg) {
	d, slot, ok := n.Target.Resolve(m.Model, m.Endpoint, sched.RoleDecode)
	if !ok {
		n.Counts.Unknown.Add(1)
		return
	}
	p, pslot, pok := n.Target.Resolve(m.Model, m.Endpoint, sched.RolePrefill)
	matched := true
	if f, ok := d.(sched.PeerFinisher); ok {
		matched = n.finishOne(m, f, slot)
	}
	if f, ok := p.(sched.PeerFinisher); ok && pok && (d == nil || p != d) {
		matched = n.finishOne(m, f, pslot) && matched
	}
	n.Counts.Finishes.Add(1)
	if !matched {
		n.Counts.FinishesUnmatched.Add(1)
	}
}

// finishOne applies finish m to f's slot: the pin its learn took released
// (the prompt touched with the pin's hashes) or, without a pin, the
// prompt touched with the finish's own hashes; false for a finish_ref
// (no hashes) whose pin is not held here, which has nothing to touch.
func (n *Node) finishOne(m *Msg, f sched.PeerFinisher, slot int) bool {
	last, blocks := m.Last, m.Blocks
	if len(m.Hashes) > 0 {
		last, blocks = m.Hashes[len(m.Hashes)-1], len(m.Hashes)
	}
	if f.PinsPeers() && n.unpin(m.ID, f, slot, last, blocks) {
		return true
	}
	if len(m.Hashes) == 0 {
		// A finish_ref: the hashes of its pin if it expired before the
		// finish came (pins.go, ended pins).
		return m.Blocks == 0 || n.touchEnded(m.ID, f, slot, last, blocks)
	}
	f.FinishPeer(slot, m.Hashes)
	return true
}
