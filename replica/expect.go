package replica

import (
	"slices"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/infergate/infergate/sched"
)

// Same-instant arrivals. Replicas behind a round-robin balancer that get
// requests within the exchange's delay of each other decide on one view:
// none has heard of the others' decisions yet, so each sends its share of
// a burst to the endpoints that look least loaded to it — the same ones —
// and they herd. On the first 2,000 Mooncake requests, whose timestamps
// are whole seconds (~9 arrive at one instant), three replicas had TTFT
// p90 9.9 s against one gateway's 6.6 s, the same at 1 and 10 ms of delay;
// delivering the peers' load credits instantly (an oracle) gave 6.4 s, and
// their prefix learns instantly 9.9 s: the loss is the load the peers put
// on at that instant, not affinity (README.md "Replicas").
//
// This is the stale-load problem of distributed dispatchers: dispatchers
// that take the least-loaded server on the same old view herd onto it
// (Mitzenmacher, "How useful is old information?", IEEE TPDS 11(1), 2000).
// Expect answers it with two measures, both idle without a live peer:
//
//   - Interpretation (Dahlin, "Interpreting stale load information", IEEE
//     TPDS 11(10), 2000, §3): the load the peers are expected to have sent
//     unseen is added to the view, water-filled onto the least-loaded
//     endpoints as a stream of arrivals that each joins the least-loaded
//     one would (waterFill). Its size comes from this replica's own
//     decisions the exchange has not delivered back to it yet (Unseen): a
//     Redis stream returns a replica's own entries to its reader, which
//     the peers read at about the same time, and behind a round-robin
//     front each replica gets about as many requests as the others, so
//     while k of its decisions are unseen by its peers each live peer has
//     about k that it has not seen. Each is counted at the mean size of
//     this replica's decisions, not its own unseen ones' sizes: Mooncake's
//     prompts run to 120k tokens, and one of them taken as what every
//     peer sent raised all eight endpoints by 50k tokens.
//   - Partition (the join-idle-queue idea: Lu et al., "Join-Idle-Queue",
//     Performance Evaluation 68(11), 2011, where each idle server reports
//     to one dispatcher so that dispatchers do not collide on it): each
//     replica marks its share of the pool Preferred, and pickers take a
//     preferred endpoint among those tied (sched.Endpoint.Preferred). The
//     interpretation raises the least-loaded endpoints to one level, so
//     they tie; replicas then spread over them instead of each drawing
//     from all. Shares are consistent across replicas whatever order their
//     configurations list endpoints in: the pool's endpoint URLs ordered by
//     hash, dealt round robin to the live replicas ordered by id.
//
// A better endpoint than the ties — a cache hit, a clearly shorter
// backlog — still wins on every replica: only ties change hands. Arrivals
// further apart than the exchange's delay find nothing unseen; a lone
// replica (no live peer) decides exactly as without replicas.

// Unseen is this replica's routing decisions that the exchange has not
// delivered back to it yet: sent (Sent), not yet echoed (Echo), younger
// than the age Load is given; and the mean load of its decisions. Safe for
// concurrent use; the zero value is ready.
type Unseen struct {
	mu   sync.Mutex
	ring [unseenCap]sentLearn
	head int // oldest entry
	n    int
	// meanPrompt and meanPending are the mean prompt and pending prefill
	// of this replica's decisions (tokens; an exponentially weighted mean
	// over about the last meanWeight decisions).
	meanPrompt, meanPending float64
	// last is when the latest decision was sent (the Sent clock; valid
	// when sent); echo is the exchange's delay, from Sent to Echo (an
	// exponentially weighted mean over about echoWeight echoes; 0 until
	// the first echo); burst is the share of decisions sent within echo
	// of the one before (over about burstWeight decisions). Stagger.
	last  time.Duration
	sent  bool
	echo  time.Duration
	burst float64
	// echoes are the last echo samples (a ring of tailWindow, ne
	// recorded in all); tail is their 90th percentile (nearest rank),
	// recomputed at each echo, 0 before tailMin samples: the turn's
	// deadline (Node.Turn).
	echoes [tailWindow]time.Duration
	ne     int
	tail   time.Duration
}

const (
	// unseenCap bounds the decisions remembered: a burst of more than
	// this many within one exchange delay counts as this many.
	unseenCap = 1024
	// meanWeight is the mean's window (decisions): 1/64 per decision.
	meanWeight = 64
	// echoWeight is the exchange delay's window (echoes): 1/8 per echo.
	echoWeight = 8
	// burstWeight is the burst share's window (decisions): 1/16 per
	// decision, so that a replica staggers within a few bursts.
	burstWeight = 16
	// tailWindow is the echoes the deadline's 90th percentile is taken
	// over; tailMin the fewest it is taken from (the mean before).
	tailWindow, tailMin = 32, 8
)

// sentLearn is one decision in Unseen: its learn's timestamp (Msg.At)
// and when it was sent on the caller's clock.
type sentLearn struct {
	stamp int64
	at    time.Duration
}

// Sent records a decision this replica published: its learn's timestamp
// stamp (Msg.At, the sender's clock), now on the caller's clock, its
// prompt tokens and pending prefill (load.Ledger.Send's: the tokens not
// expected cached).
func (u *Unseen) Sent(stamp int64, now time.Duration, prompt, pending int64) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.n == unseenCap {
		u.head, u.n = (u.head+1)%unseenCap, u.n-1
	}
	u.ring[(u.head+u.n)%unseenCap] = sentLearn{stamp: stamp, at: now}
	u.n++
	if u.echo > 0 {
		x := 0.0
		if u.sent && now-u.last < u.echo {
			x = 1
		}
		u.burst += (x - u.burst) / burstWeight
	}
	u.last, u.sent = now, true
	if u.meanPrompt == 0 && u.meanPending == 0 {
		u.meanPrompt, u.meanPending = float64(prompt), float64(pending)
		return
	}
	u.meanPrompt += (float64(prompt) - u.meanPrompt) / meanWeight
	u.meanPending += (float64(pending) - u.meanPending) / meanWeight
}

// Seed gives a fresh Unseen (no echo measured yet) an estimate d of the
// exchange's delay, so that the fleet's first burst is staggered too
// (Stagger needs a delay; on the shared-prefix workload's 1,024 requests
// at one instant, the first burst is the whole run): live, twice the
// Redis round trip the exchange measured at connect
// (stream.Config.Connected: the learn's write, then the reader's read);
// in virtual time the modelled delay. A fresh replica also starts as if
// its decisions came in bursts: the share decays below staggerBurst within
// about 20 decisions spread in time (at most rank × 3 of d each, the price of
// not knowing yet), and a burst that opens the run is staggered from its
// first decision instead of from about its sixth. Echoes replace d as
// they come (an exponentially weighted mean); a measured delay is never
// overwritten.
func (u *Unseen) Seed(d time.Duration) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.echo > 0 || d <= 0 {
		return
	}
	u.echo, u.burst = d, 1
}

// Echo retires the decisions sent up to stamp, the timestamp of one of
// this replica's own learns read back from the exchange at now (the Sent
// clock): a replica's messages come back in the order it sent them, so
// the earlier ones were delivered too, or lost (a learn the queue dropped
// is retired with the next one echoed). The time the echoed learn took
// is a sample of the exchange's delay (Stagger's step).
func (u *Unseen) Echo(stamp int64, now time.Duration) {
	u.mu.Lock()
	defer u.mu.Unlock()
	var at time.Duration
	found := false
	for u.n > 0 && u.ring[u.head].stamp <= stamp {
		at, found = u.ring[u.head].at, true
		u.head, u.n = (u.head+1)%unseenCap, u.n-1
	}
	if !found || now < at {
		return
	}
	d := now - at
	u.echoes[u.ne%tailWindow] = d
	u.ne++
	if n := min(u.ne, tailWindow); n >= tailMin {
		var a [tailWindow]time.Duration
		s := a[:n]
		copy(s, u.echoes[:n])
		slices.Sort(s)
		u.tail = s[(n*9+9)/10-1] // nearest rank: the ⌈0.9 n⌉-th
	}
	if u.echo == 0 {
		u.echo = max(d, 1) // 0 means no sample yet
		return
	}
	u.echo = max(1, u.echo+(d-u.echo)/echoWeight)
}

// Load is the decisions not yet echoed as of now (the Sent clock), each
// counted at the mean decision's size: InFlight decisions, their prompt
// tokens (InFlightTokens) and pending prefill (PendingPrefill). Decisions
// sent before now − maxAge are forgotten first (an exchange that lost
// them: Redis down, a message dropped).
func (u *Unseen) Load(now, maxAge time.Duration) Load {
	u.mu.Lock()
	defer u.mu.Unlock()
	for u.n > 0 && now-u.ring[u.head].at > maxAge {
		u.head, u.n = (u.head+1)%unseenCap, u.n-1
	}
	n := float64(u.n)
	return Load{InFlight: int64(u.n), InFlightTokens: int64(n * u.meanPrompt), PendingPrefill: int64(n * u.meanPending)}
}

// Expect prepares snapshot eps, filled with this replica's and its peers'
// known load (Peers.Add), to be picked from at now (the Peers clock): it
// marks this replica's share of the endpoints Preferred and adds the load
// its live peers are expected to have routed unseen — as much each as
// this replica's own unseen decisions (Unseen.Load, forgotten after the
// peers' TTL) — water-filled onto the ready endpoints in each load field
// alone: requests in flight, prompt tokens in flight, prefill backlog
// (see "Same-instant arrivals" above). Without a live peer it only clears
// Preferred. It allocates only when the pool's endpoints or the live
// replicas change (the share is recomputed); otherwise it takes a few
// passes over eps per field (waterFill).
func (n *Node) Expect(eps []sched.Endpoint, now time.Duration) {
	rank, live := n.Peers.rank(n.ID, now)
	if live == 1 {
		for i := range eps {
			eps[i].Preferred = false
		}
		return
	}
	mine := n.share(eps, rank, live)
	for i := range eps {
		eps[i].Preferred = mine[i]
	}
	u := n.Unseen.Load(now, n.Peers.ttl)
	if u.InFlight == 0 || n.staggered(live) {
		// Staggered bursts: the peers ranked before this replica
		// decided one exchange delay or more ago (seen), those after
		// it will see its decisions (stagger.go): nothing to expect.
		return
	}
	peers := int64(live - 1)
	waterFill(eps, peers*u.InFlight, fieldInFlight)
	waterFill(eps, peers*u.InFlightTokens, fieldTokens)
	waterFill(eps, peers*u.PendingPrefill, fieldPrefill)
}

// share is a replica's share of a pool: the endpoints (by name) of the
// snapshot it was computed for, the live replicas and this one's rank
// among them, and whether each endpoint is this replica's.
type share struct {
	names      []string
	rank, live int
	mine       []bool
}

// share returns, per endpoint of eps, whether it is in the share of the
// replica of rank among live replicas: the endpoints ordered by the hash
// of their names (then the names), the j-th of them going to the replica
// of rank j mod live. Cached until the names, rank or live count change.
func (n *Node) share(eps []sched.Endpoint, rank, live int) []bool {
	if s := n.shared.Load(); s != nil && s.rank == rank && s.live == live && len(s.names) == len(eps) {
		same := true
		for i := range eps {
			if s.names[i] != eps[i].Name {
				same = false
				break
			}
		}
		if same {
			return s.mine
		}
	}
	s := &share{names: make([]string, len(eps)), rank: rank, live: live, mine: make([]bool, len(eps))}
	order := make([]int, len(eps))
	for i := range eps {
		s.names[i], order[i] = eps[i].Name, i
	}
	slices.SortFunc(order, func(a, b int) int {
		ha, hb := xxhash.Sum64String(s.names[a]), xxhash.Sum64String(s.names[b])
		switch {
		case ha < hb:
			return -1
		case ha > hb:
			return 1
		case s.names[a] < s.names[b]:
			return -1
		case s.names[a] > s.names[b]:
			return 1
		}
		return 0
	})
	for j, i := range order {
		s.mine[i] = j%live == rank
	}
	n.shared.Store(s)
	return s.mine
}

// The snapshot's load fields Expect fills (field).
const (
	fieldInFlight = iota
	fieldTokens
	fieldPrefill
)

// field returns e's load field f.
func field(e *sched.Endpoint, f int) *int {
	switch f {
	case fieldInFlight:
		return &e.InFlight
	case fieldTokens:
		return &e.InFlightTokens
	}
	return &e.PendingPrefillTokens
}

// waterFill spreads amount (≥ 0) of load over the ready endpoints of eps
// in their field f, as a stream of arrivals that each joins the
// least-loaded endpoint would: every ready endpoint below a level L is
// raised to L, the highest integer level whose fill Σ max(0, L − v_e) does
// not exceed amount (the remainder, less than the number of endpoints
// raised, is left out). Dahlin (IEEE TPDS 2000), §3.
//
// The level is found without sorting, as the fixed point of
// g(L) = ⌊(amount + Σ_{v_e < L} v_e) / |{e: v_e < L}|⌋ iterated down from
// L₀ = least + amount (above every endpoint that can be raised; g(L₀) ≤
// L₀, and g is monotone below it, so L only falls): at the fixed point the
// fill is at most amount and one more level would exceed it. Each pass is
// O(len(eps)); two or three passes in practice, at most len(eps).
func waterFill(eps []sched.Endpoint, amount int64, f int) {
	if amount <= 0 {
		return
	}
	lo, found := int64(0), false
	for i := range eps {
		if v := int64(*field(&eps[i], f)); eps[i].Ready && (!found || v < lo) {
			lo, found = v, true
		}
	}
	if !found {
		return
	}
	level := lo + amount
	for {
		var sum, k int64
		for i := range eps {
			if v := int64(*field(&eps[i], f)); eps[i].Ready && v < level {
				sum += v
				k++
			}
		}
		if k == 0 {
			return // level fell to the least: nothing to raise
		}
		next := (amount + sum) / k
		if next >= level {
			break
		}
		level = next
	}
	for i := range eps {
		if p := field(&eps[i], f); eps[i].Ready && int64(*p) < level {
			*p = int(level)
		}
	}
}
