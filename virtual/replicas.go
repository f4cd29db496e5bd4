package virtual

import (
	"errors"
	"slices"
	"strconv"
	"time"

	"github.com/infergate/infergate/load"
	"github.com/infergate/infergate/replica"
	"github.com/infergate/infergate/sched"
)

// Gateway replicas in virtual time (Config.Replicas): N gateways behind a
// round-robin (L4) front, each with its own policy — its own approximate
// prefix index, speculative entries and session table — and its own load
// ledgers, all in front
// of the same engines. With Config.ReplicaSync they exchange the messages
// of package replica, encoded and applied by the code the live gateway
// runs (replica.AppendLearn, AppendLoad, Node.Apply), each delivered
// Config.ReplicaDelay after it was sent:
//
//   - a learn per routing decision (endpoint name, the prompt's block
//     hashes), which every other replica's policy learns as if it had
//     routed the prompt (sched.PeerLearner);
//   - a finish per request that ended on an engine (its prompt's block
//     hashes), which every other replica's policy that learns on finish
//     releases (the pin its learn took) or touches (sched.PeerFinisher),
//     as the engine frees its blocks; a killed replica's pins are released
//     by its peers once it is silent for LoadTTL (replica.Node.Expire);
//   - a load report every LoadInterval (per endpoint: the replica's in
//     flight, in-flight tokens, prefill backlog), which every other
//     replica adds to its snapshot for LoadTTL.
//
// A replica whose decisions come in bursts holds each new arrival for its
// turn (replica.Node.Turn; unless ReplicaNoStagger), as the live gateway
// waits before its pick: until the delivery that brings it the learns of
// the replicas ranked before it (replica.Node.Due), at most until the
// turn's deadline. A held request counts its wait in its TTFT (its
// Arrival is unchanged) and fails with ErrReplicaKilled if its replica is
// killed meanwhile.
//
// The engines' precise index, where a policy uses one, is shared: every
// live replica subscribes to every engine's KV events and so holds the
// same one.

// ErrReplicaKilled is Result.Err of a request whose replica was killed
// while it was in flight (Config.KillAt).
var ErrReplicaKilled = errors.New("sim: gateway replica killed with the request in flight")

// DefaultLoadInterval is Config.LoadInterval's default, the live
// exchange's (stream.DefaultLoadInterval).
const DefaultLoadInterval = 200 * time.Millisecond

// rep is one gateway replica.
type rep struct {
	id      string
	policy  sched.Policy
	pd      *sched.PD         // its P/D decisions (Config.Prefill; policy is their decode profile)
	learner sched.PeerLearner // policy's, nil when it learns nothing
	ledgers []load.Ledger     // per engine: what this replica sent it
	snap    []sched.Endpoint
	node    *replica.Node // nil without ReplicaSync
	alive   bool
	stagger StaggerStats // its decisions' turns (ReplayResult.Stagger)
}

// StaggerStats counts a replica's staggered decisions (replica.Node.Turn):
// those released by the learns of the replicas ranked before it and by
// their deadline, and their total wait (virtual time).
type StaggerStats struct {
	Learns, Deadline int
	Wait             time.Duration
}

// exchange is the replicas' messages in transit and the exchange's
// timers.
type exchange struct {
	on       bool
	msgs     []vmsg // in delivery order (one delay: FIFO)
	nextLoad time.Duration
	killAt   time.Duration // never when none or done
	rr       int           // the front's round-robin counter
	// held are the requests their replica holds before deciding
	// (replica.Node.Turn), by deadline then arrival; releasing is set
	// while they are decided (arrive takes the replica chosen).
	held      []heldReq
	releasing bool
	buf       []byte
	entries   []replica.LoadEntry
}

// vmsg is a message in transit to replica to.
type vmsg struct {
	at time.Duration
	to int
	b  []byte
}

// next is the time of the exchange's next event (never: none).
func (x *exchange) next() time.Duration {
	t := x.killAt
	if !x.on {
		return t
	}
	t = min(t, x.nextLoad)
	if len(x.msgs) > 0 {
		t = min(t, x.msgs[0].at)
	}
	if len(x.held) > 0 {
		t = min(t, x.held[0].at)
	}
	return t
}

// heldReq is request k, arrived at from, held by its replica for turn
// (at most until at, the turn's deadline).
type heldReq struct {
	at, from time.Duration
	k        int
	turn     replica.Turn
}

// hold queues request k, arrived at from, for turn, after the requests
// whose deadline is no later.
func (x *exchange) hold(k int, from time.Duration, turn replica.Turn) {
	i := len(x.held)
	for i > 0 && x.held[i-1].at > turn.Deadline {
		i--
	}
	x.held = slices.Insert(x.held, i, heldReq{at: turn.Deadline, from: from, k: k, turn: turn})
}

// wait reports whether rp holds a request arriving at t for its turn
// (replica.Node.Turn, not yet Due: the learns of the replicas ranked
// before it not delivered yet), and the turn; false without the exchange.
func (rp *rep) wait(t time.Duration) (replica.Turn, bool) {
	if rp.node == nil {
		return replica.Turn{}, false
	}
	turn, ok := rp.node.Turn(t)
	if !ok {
		return turn, false
	}
	if rp.node.Due(turn, t) == replica.Learnt {
		rp.stagger.Learns++
		return turn, false
	}
	return turn, true
}

// release decides the held requests whose turn has come at t
// (replica.Node.Due: the learns of the replicas ranked before them
// delivered, or their deadline), in order of deadline then arrival; those
// of a replica killed meanwhile fail with ErrReplicaKilled. It runs after
// the exchange's messages due at t, so a decision released at t sees
// them.
func (f *Fleet) release(t time.Duration) {
	x := &f.rx
	if len(x.held) == 0 {
		return
	}
	kept := 0
	for n := 0; n < len(x.held); n++ {
		h := x.held[n]
		rp := f.reps[f.owner[h.k]]
		if !rp.alive {
			f.res[h.k].Err = ErrReplicaKilled
			continue
		}
		why := rp.node.Due(h.turn, t)
		if why == replica.Waiting {
			x.held[kept] = h
			kept++
			continue
		}
		if why == replica.Learnt {
			rp.stagger.Learns++
		} else {
			rp.stagger.Deadline++
		}
		rp.stagger.Wait += t - h.from
		x.releasing = true
		f.arrive(h.k, &f.reqs[h.k], t)
		x.releasing = false
	}
	x.held = x.held[:kept]
}

// target resolves learns for a virtual replica: one model, endpoints by
// their snapshot names; with P/D, prefill learns to the prefill profile
// (as the gateway's replicaTarget).
type target struct {
	model            string
	learner, prefill sched.PeerLearner
	slots            map[string]int
	names            []string // by slot: Intern's strings
}

func (t *target) Intern(url []byte) (string, bool) {
	i, ok := t.slots[string(url)]
	if !ok {
		return "", false
	}
	return t.names[i], true
}

func (t *target) Resolve(model, endpoint string, role sched.Role) (sched.PeerLearner, int, bool) {
	i, ok := t.slots[endpoint]
	l := t.learner
	if role == sched.RolePrefill && t.prefill != nil {
		l = t.prefill
	}
	return l, i, ok && model == t.model
}

// newReplicas builds f's replicas over snapshot template snap; replica 0
// gets f.policy, the others a policy built as it was, from pool.
func (f *Fleet) newReplicas(snap []sched.Endpoint, pool sched.Pool) error {
	cfg := &f.cfg
	n := max(cfg.Replicas, 1)
	slots := make(map[string]int, len(snap))
	names := make([]string, len(snap))
	for i := range snap {
		slots[snap[i].Name] = i
		names[i] = snap[i].Name
	}
	for r := range n {
		p, pd := f.policy, f.pd
		if r > 0 {
			// Each replica its own random streams (ReplicaSeed), as live
			// replicas seed theirs with their ids: with one seed, decision
			// n of every replica breaks its ties alike and they herd.
			routing := cfg.Routing
			routing.Seed = replica.Seed(routing.Seed, "replica-"+strconv.Itoa(r))
			var err error
			if pd != nil {
				if pd, err = sched.NewPD(routing, pool); err != nil {
					return err
				}
				p = pd.Decode()
			} else if p, err = sched.NewPolicy(routing, pool); err != nil {
				return err
			}
		}
		rp := &rep{id: "replica-" + strconv.Itoa(r), policy: p, pd: pd, ledgers: make([]load.Ledger, len(snap)),
			snap: append([]sched.Endpoint(nil), snap...), alive: true}
		rp.learner, _ = p.(sched.PeerLearner)
		if cfg.ReplicaSync && n > 1 {
			t := &target{model: cfg.Model, learner: rp.learner, slots: slots, names: names}
			if pd != nil {
				t.prefill, _ = pd.Prefill().(sched.PeerLearner)
			}
			rp.node = &replica.Node{ID: rp.id, Peers: replica.NewPeers(cfg.LoadTTL), Target: t, NoStagger: cfg.ReplicaNoStagger}
		}
		f.reps = append(f.reps, rp)
	}
	for _, rp := range f.reps {
		if rp.node == nil {
			continue
		}
		// Replicas up before the replay: live ones have heard each
		// other's load reports before traffic comes, and each seeds the
		// exchange's delay before its first echo (live, twice the Redis
		// round trip measured at connect; here the modelled delay), so
		// that a burst at the replay's first instant is staggered too.
		for _, q := range f.reps {
			if q != rp {
				rp.node.Peers.Update(q.id, 0, nil)
			}
		}
		rp.node.Unseen.Seed(cfg.ReplicaDelay)
	}
	if cfg.LoadInterval <= 0 {
		cfg.LoadInterval = DefaultLoadInterval
	}
	f.rx = exchange{on: cfg.ReplicaSync && n > 1, killAt: never}
	if cfg.KillAt > 0 {
		f.rx.killAt = cfg.KillAt
	}
	return nil
}

// front sends request k to the next live replica, round robin, and
// returns it.
func (f *Fleet) front(k int) *rep {
	n := len(f.reps)
	for range n {
		r := f.rx.rr % n
		f.rx.rr++
		if f.reps[r].alive {
			f.owner[k] = int32(r)
			return f.reps[r]
		}
	}
	f.owner[k] = 0 // unreachable: a kill leaves at least one
	return f.reps[0]
}

// ledger is request k's replica's ledger of engine e.
func (f *Fleet) ledger(k, e int) *load.Ledger { return &f.reps[f.owner[k]].ledgers[e] }

// fill sets rp's snapshot load from its ledgers, plus its peers' reports
// and what they are expected to have routed unseen (replica.Node.Expect,
// as the gateway's pickExcluding does).
func (rp *rep) fill(t time.Duration) {
	for i := range rp.snap {
		rp.ledgers[i].Fill(&rp.snap[i])
		if rp.node != nil {
			rp.node.Peers.Add(rp.snap[i].Name, t, &rp.snap[i])
		}
	}
	if rp.node != nil && rp.pd == nil { // P/D: no Expect, as the gateway's pickSplit
		rp.node.Expect(rp.snap, t)
	}
}

// learnt sends rp's decision d (an engine for the prompt of f.sreq) to
// its peers.
func (f *Fleet) learnt(rp *rep, d sched.Decision, t time.Duration) {
	if !f.rx.on || len(f.sreq.Hashes) == 0 {
		return
	}
	prompt := int64(f.sreq.PromptTokens)
	pending := max(1, prompt-int64(d.MatchedBlocks*f.blockSize)) // as load.Ledger.Send counts it
	b := replica.AppendLearn(nil, rp.id, int64(t), f.cfg.Model, rp.snap[d.Endpoint].Name, prompt, pending, f.sreq.Hashes)
	rp.node.Unseen.Sent(int64(t), t, prompt, pending)
	f.post(b, t)
}

// learntPD sends rp's P/D decision pdd for the prompt of f.sreq to its
// peers, as the gateway's pickSplit and runFlow publish it: D's pick
// (sched.RoleDecode; split: D reads the prompt from P and prefills
// nothing), counted as the decision (replica.Unseen), then P's
// (sched.RolePrefill) when split.
func (f *Fleet) learntPD(rp *rep, pdd sched.PDDecision, t time.Duration) {
	if !f.rx.on || len(f.sreq.Hashes) == 0 || pdd.Decode.Endpoint < 0 {
		return
	}
	prompt := int64(f.sreq.PromptTokens)
	split := pdd.Split && pdd.Prefill.Endpoint >= 0
	matched := int64(pdd.Decode.MatchedBlocks * f.blockSize)
	if split {
		matched = prompt
	}
	pending := max(1, prompt-matched) // as load.Ledger.Send counts it
	rp.node.Unseen.Sent(int64(t), t, prompt, pending)
	f.post(replica.AppendLearnRole(nil, rp.id, int64(t), f.cfg.Model, rp.snap[pdd.Decode.Endpoint].Name, sched.RoleDecode, prompt, pending, f.sreq.Hashes), t)
	if split {
		pending = max(1, prompt-int64(pdd.Prefill.MatchedBlocks*f.blockSize))
		f.post(replica.AppendLearnRole(nil, rp.id, int64(t), f.cfg.Model, rp.snap[pdd.Prefill.Endpoint].Name, sched.RolePrefill, prompt, pending, f.sreq.Hashes), t)
	}
}

// finishedPeers sends the end of request k on engine i, whose prompt has
// hashes h, to its replica's peers, as the gateway's learnFinished
// publishes it: they release the pin its learn took and touch the prompt
// as the engine's free queue takes its blocks (sched.PeerFinisher). A
// plain pool names the learn (replica.AppendFinishRef), a P/D pool, whose
// profiles never pin, sends the hashes (replica.AppendFinish).
func (f *Fleet) finishedPeers(k, i int, h []uint64, t time.Duration) {
	if !f.rx.on {
		return
	}
	rp := f.reps[f.owner[k]]
	appendFinish := replica.AppendFinishRef
	if rp.pd != nil {
		appendFinish = replica.AppendFinish
	}
	f.post(appendFinish(nil, rp.id, int64(t), f.cfg.Model, rp.snap[i].Name, h), t)
}

// post puts b in transit to every live replica, its sender included: a
// Redis stream returns a replica's own entries to its reader, which tells
// it that its peers have read them too (replica.Unseen).
func (f *Fleet) post(b []byte, t time.Duration) {
	for j, rp := range f.reps {
		if rp.alive {
			f.rx.msgs = append(f.rx.msgs, vmsg{at: t + f.cfg.ReplicaDelay, to: j, b: b})
		}
	}
}

// exchange runs the exchange's events due at t: messages delivered (and
// applied by their replica's Node), load reports sent, the kill.
func (f *Fleet) exchange(t time.Duration) {
	x := &f.rx
	if x.on {
		k := 0
		for ; k < len(x.msgs) && x.msgs[k].at <= t; k++ {
			m := x.msgs[k]
			if rp := f.reps[m.to]; rp.alive {
				_, _ = rp.node.Apply(m.b, t) // our own encoding: never malformed
			}
			x.msgs[k].b = nil
		}
		x.msgs = x.msgs[k:]
		if len(x.msgs) == 0 {
			x.msgs = x.msgs[:0:0] // let the drained backing array go
		}
		if x.nextLoad <= t {
			for _, rp := range f.reps {
				if !rp.alive {
					continue
				}
				rp.node.Expire(t) // peers' pins whose finish never came (a killed replica's)
				x.entries = x.entries[:0]
				for i := range rp.ledgers {
					l := &rp.ledgers[i]
					x.entries = append(x.entries, replica.LoadEntry{Endpoint: rp.snap[i].Name,
						Load: replica.Load{InFlight: l.InFlight(), InFlightTokens: l.InFlightTokens(), PendingPrefill: l.PendingPrefill()}})
				}
				f.post(replica.AppendLoad(nil, rp.id, int64(t), x.entries), t)
			}
			x.nextLoad = t + f.cfg.LoadInterval
		}
	}
	if x.killAt <= t {
		x.killAt = never
		f.kill(f.cfg.KillReplica)
	}
}

// kill stops replica r: the requests it holds end with ErrReplicaKilled
// and are aborted on their engines (the gateway's connections to them
// close); its load and messages stop.
func (f *Fleet) kill(r int) {
	f.reps[r].alive = false
	for k := range f.open {
		if !f.open[k] || int(f.owner[k]) != r {
			continue
		}
		f.open[k] = false
		res := &f.res[k]
		res.Err = ErrReplicaKilled
		id := strconv.Itoa(f.base + k)
		f.engines[res.Engine].e.Abort(id)
		if res.Prefill >= 0 && res.Prefill != res.Engine {
			// A split request: its prefill leg (or the KV P holds for D)
			// ends too.
			f.engines[res.Prefill].e.Abort(id)
		}
		f.shares[k].Finish()
	}
}
