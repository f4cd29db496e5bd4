package replica

import "time"

// Staggered bursts. Requests that reach different replicas at one instant
// are decided on one view, whatever each replica expects of the others
// (Expect): none can know which endpoints the others take at that very
// instant. Dynamo's router replicas and Ray's LLM ingress replicas publish
// each decision's booking to their peers and accept this window (Dynamo's
// maintainers call it the selection-to-booking race:
// ai-dynamo/dynamo#10388, "Replica synchronization cannot close that
// selection-to-booking window"; ray-project/ray#65010 measures the herding
// it leaves on bursty load). On the first 2,000 Mooncake requests, whose
// timestamps are whole seconds (~9 arrive at one instant), it cost three
// replicas 23% of TTFT p90 against one gateway with Expect, 50% without.
//
// Stagger closes the window by taking turns, with no message of its own:
// while this replica's decisions come in bursts — most of them sent
// within one exchange delay of the one before, a share measured over its
// last decisions (Unseen) — a decision waits rank × the exchange's delay
// before it is taken, rank being this replica's among the live ones by
// id (Peers.rank). The replica ranked 0 decides at once, the one ranked 1
// after the first one's decisions have reached it, and so on: within a
// burst each replica decides on the decisions of every replica ranked
// before it, and those ranked after it decide on its own — one gateway's
// sequential information, at a cost of at most (replicas − 1) exchange
// delays (1–10 ms on a LAN; capped at MaxStagger) on requests whose TTFT
// is already queueing behind the burst. Expect then adds nothing: what it
// estimated is either seen or still to be decided. Arrivals spread in time
// find no burst and wait nothing; a lone replica never waits.
//
// The exchange's delay is measured, not configured: the time this
// replica's own learns take to come back from the exchange (Unseen.Echo),
// which its peers read at about the same time; the wait is 5/4 of it per
// rank, so that the learns of the replica ranked before have arrived.
//
// A burst that gives each replica at most one request is not detected
// (no replica sees two of its own decisions close together); Expect's
// shares still spread such ties.

// MaxStagger bounds a decision's wait in a burst (Stagger), whatever the
// number of replicas or the exchange's delay.
const MaxStagger = 50 * time.Millisecond

const (
	// staggerBurst is the share of a replica's decisions sent within one
	// exchange delay of the one before above which its decisions are
	// staggered: on the Mooncake trace's whole-second timestamps about
	// 2/3 are (3 of each replica's ~3 a second), with arrivals spread
	// over their second under 1%.
	staggerBurst = 0.25
	// staggerMargin is the wait per rank in exchange delays, as a
	// fraction num/den.
	staggerNum, staggerDen = 5, 4
)

// Stagger is how long a decision of this replica arriving at now (the
// Peers clock) waits before it is taken: rank × 5/4 of the exchange's
// measured delay while its decisions come in bursts and other replicas
// are live, at most MaxStagger; 0 otherwise (and always with NoStagger).
// Lock-free but for Unseen's mutex; allocation-free.
func (n *Node) Stagger(now time.Duration) time.Duration {
	if n.NoStagger {
		return 0
	}
	rank, live := n.Peers.rank(n.ID, now)
	if live == 1 || rank == 0 {
		return 0
	}
	step, bursty := n.Unseen.bursty()
	if !bursty {
		return 0
	}
	return min(MaxStagger, time.Duration(rank)*step*staggerNum/staggerDen)
}

// staggered reports whether this replica's decisions are staggered now,
// live replicas (itself included) being live: Expect then estimates
// nothing.
func (n *Node) staggered(live int) bool {
	if n.NoStagger || live == 1 {
		return false
	}
	_, bursty := n.Unseen.bursty()
	return bursty
}

// bursty returns the exchange's measured delay and whether this
// replica's decisions come in bursts (staggerBurst) with a delay known.
func (u *Unseen) bursty() (time.Duration, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.echo, u.echo > 0 && u.burst >= staggerBurst
}
