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
// last decisions (Unseen) — a decision waits for the decisions of the
// replicas ranked before it, rank being this replica's among the live ones
// by id (Peers.rank). The replica ranked 0 decides at once, the one ranked
// 1 once the first one's decisions have reached it, and so on: within a
// burst each replica decides on the decisions of every replica ranked
// before it, and those ranked after it decide on its own — one gateway's
// sequential information, at the cost of the exchange's deliveries on
// requests whose TTFT is already queueing behind the burst. Expect then
// adds nothing: what it estimated is either seen or still to be decided.
// Arrivals spread in time find no burst and wait nothing; a lone replica
// never waits.
//
// A decision's turn (Turn, Due) comes when, for every live replica ranked
// before it, a learn of that replica has been applied (Node.Apply, which
// records when: Peers.learnt) at least one exchange delay (its mean)
// after the decision arrived — a learn the peer sent about when this
// decision arrived or later, so that its decisions of the burst up to
// then are in the view — on this replica's own clock, never comparing
// clocks across hosts; or at its deadline, rank × 3 of the 90th
// percentile of the exchange's last 32 measured delays after it arrived
// (at most MaxStagger), for a peer with nothing more in the burst or a
// learn later than that; or when its request ends.
//
// Until 2026-12-06 a learn applied since one delay *before* the decision
// arrived counted, and the deadline was rank × 5/4 of the delay: where a
// burst's arrivals are all at one instant that is the same turn, but
// where they are spread over a few milliseconds (live, the client sends a
// trace second's requests fractions of a millisecond apart) the first
// learn of the burst released every decision of the next rank, blind to
// the decisions the rank before took after it. Virtual time, the first
// 2,000 Mooncake requests on 8 engines, arrivals spread uniformly over S
// after their timestamps, exchange delay 1 ms, three replicas against one
// on TTFT p90 (mean of seeds 0–5; bench --virtual --replicas 1,3
// --replica-sync true --replica-delay 1ms --spread S): at S = 0 +1.3%
// either way; at 1, 2 and 5 ms +8.2%, +22.3%, +20.9% before and +8.6%,
// +7.2%, +15.8% since (with the max-score picker's margin for a
// replica's share, sched.PreferredTolerance: −0.9%, +4.2%, +7.5%,
// +8.8%). The deadline is a
// quantile, not the mean: live, on a loaded host whose messages took 5–11
// ms on average with a long tail, a deadline of 5/4 of the mean released
// 18% and 35% of replicas 1's and 2's staggered decisions before the
// learns they waited for had come (virtual time, on the same bursts, 0.1%:
// their peers did have decisions in the burst); 5/4 of the 90th
// percentile, 4% and 8% (gateway/README.md "Waking the turn"). The
// live gateway waits for the reader's notification of each applied learn
// and re-checks Due; virtual time releases a held request at the first
// delivery that makes it Due, so both charge the exchange's deliveries
// rather than a fixed worst-case time. Until 2026-12-05 every staggered
// decision waited its whole deadline: live, on a loaded host, replicas 1
// and 2 waited 9.3 and 17.6 ms of wall time on every decision where their
// peers' messages took a median under 1 ms (gateway/README.md "Staggered
// bursts").
//
// The exchange's delay is measured, not configured: the time this
// replica's own learns take to come back from the exchange (Unseen.Echo),
// which its peers read at about the same time.
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
	// staggerNum/staggerDen is the wait per rank in exchange delays
	// (their recent 90th percentile): 3 since 2026-12-06, when a turn
	// began to wait for a learn sent after the decision arrived (Turn);
	// 5/4 before, when a learn sent up to one delay earlier counted. A
	// turn now waits about one delay for the learn it needs where it
	// waited none, so a replica ranked before whose learn came late (a
	// turn released by its own deadline) released the next rank's turn
	// by deadline too. Virtual time, Mooncake, six seeds, TTFT p90 of
	// three replicas against one at 1 and 2 ms of spread: the old turn
	// +8.2% and +22.3%; the new one at 5/4 +11.0% and +16.3%, at 3 +8.6%
	// and +7.2%, at 5 no better (+8.2%, +7.4%).
	staggerNum, staggerDen = 3, 1
)

// Stagger is the longest a decision of this replica arriving at now (the
// Peers clock) waits before it is taken, its turn's deadline (Turn): rank
// × 3 of the exchange's measured delay (the 90th percentile of the last
// 32 echoes; their mean before 8) while its decisions come in
// bursts and other replicas are live, at most MaxStagger; 0 otherwise
// (and always with NoStagger). Lock-free but for Unseen's mutex;
// allocation-free.
func (n *Node) Stagger(now time.Duration) time.Duration {
	t, ok := n.Turn(now)
	if !ok {
		return 0
	}
	return t.Deadline - now
}

// Turn is a staggered decision's wait (Node.Turn, Node.Due): times on
// the Peers clock.
type Turn struct {
	// Since is the earliest a learn of a replica ranked before this one
	// may have been applied to count for this decision: one exchange
	// delay (its mean) after the decision arrived, so that the learn was
	// sent about when it arrived or later — that replica's decisions up
	// to then are in the view.
	Since time.Duration
	// Deadline is when the decision is taken whatever has arrived: rank
	// × 3 of the exchange's delay (its recent 90th percentile) after it
	// arrived, at most MaxStagger.
	Deadline time.Duration
}

// Release is why a staggered decision was taken (Node.Due).
type Release uint8

const (
	// Waiting: not yet; the decision waits for a learn or its deadline.
	Waiting Release = iota
	// Learnt: every live replica ranked before this one has a learn
	// applied since Turn.Since.
	Learnt
	// Deadline: Turn.Deadline passed first.
	Deadline
)

// String names r as the gateway's metric labels it: "waiting",
// "learns", "deadline".
func (r Release) String() string {
	switch r {
	case Learnt:
		return "learns"
	case Deadline:
		return "deadline"
	}
	return "waiting"
}

// Turn returns the wait of a decision of this replica arriving at now
// (the Peers clock), and false when it does not wait: no other replica
// live, this replica ranked 0, its decisions not in bursts, no delay
// measured yet, or NoStagger. A decision that waits is taken when Due
// says so. Lock-free but for Unseen's mutex; allocation-free.
func (n *Node) Turn(now time.Duration) (Turn, bool) {
	if n.NoStagger {
		return Turn{}, false
	}
	rank, live := n.Peers.rank(n.ID, now)
	if live == 1 || rank == 0 {
		return Turn{}, false
	}
	step, deadline, bursty := n.Unseen.turnSteps()
	if !bursty {
		return Turn{}, false
	}
	wait := min(MaxStagger, time.Duration(rank)*deadline*staggerNum/staggerDen)
	return Turn{Since: now + step, Deadline: now + wait}, true
}

// Due reports whether the decision waiting for turn t is taken at now
// (the Peers clock), and why: Learnt when every replica live at now and
// ranked before this one (by id) has had a learn applied (Node.Apply) at
// or after t.Since; else Deadline once now reaches t.Deadline; else
// Waiting. Lock-free; allocation-free; O(live peers).
func (n *Node) Due(t Turn, now time.Duration) Release {
	if n.Peers.learntSince(n.ID, t.Since, now) {
		return Learnt
	}
	if now >= t.Deadline {
		return Deadline
	}
	return Waiting
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

// turnSteps returns, under one lock, what Turn needs: bursty's delay
// and answer, and the exchange's delay a turn's deadline is made of: the
// 90th percentile of the last echoes (Unseen.tail), the mean until there
// are enough of them (a seeded replica: Seed).
func (u *Unseen) turnSteps() (mean, deadline time.Duration, bursty bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	mean, deadline = u.echo, u.echo
	if u.tail > 0 {
		deadline = u.tail
	}
	return mean, deadline, u.echo > 0 && u.burst >= staggerBurst
}
