package gateway

import (
	"time"

	"github.com/infergate/infergate/sched"
)

// The routing policies' learning off the pick path: a decision of a policy
// with an approximate prefix index queues its update (sched.Settler,
// prefix.Index.Learn; the index's Match counts it at once), and one
// goroutine of the gateway applies the queues. A pick that finds that
// goroutine behind (settleBacklog notices waiting) settles on its own
// goroutine, as the pick path did before, so that the queues stay bounded.
// BenchmarkEPPDecision and sched.BenchmarkDecision64x1M measure the pick
// path (gateway/README.md "Performance").

// settleBacklog is the most pools waiting for the settler. A pool waits
// at most once (pool.settleQueued): picks that find their pool already
// waiting add nothing, so the backlog fills only when more than this many
// pools wait, not when the settler's thread misses a few milliseconds of
// a core (a loaded host): until 2026-12-05 every pick queued its policy
// again, 64 picks filled the channel, and the following picks settled on
// their own goroutine (0.5–2% of BenchmarkEPPDecision's picks at load 6–8
// on 2 cores, the Pick p99's tail). The index's own bound still applies:
// a Learn that finds prefix.Index's queue full (256 learns) inserts on
// the pick's goroutine (prefix/learn.go).
const settleBacklog = 64

// settleDelay is how long the settler lets a pool's learns gather after
// the first one asks, and settleHurry the queued learns that end the wait
// early. Learns wait in the index's queue, which its Match counts at once
// (prefix/learn.go), so decisions are the same however late they settle;
// what the wait saves is a wake-up of the settler per pick. Until
// 2026-12-05 the settler settled as soon as a pick asked: at 1,000
// endpoints every pick of BenchmarkEPPDecision woke it (a futex wake on
// the pick's thread, 4 µs of its CPU at load 12 by pprof, and the
// settler's thread competing for a core with the next pick), which is
// what raised the benchmark's median after the settleQueued change
// (gateway/README.md "Performance"). settleHurry keeps the queue far from
// its bounds (prefix: 256 learns, 16,384 blocks; a Learn that finds it
// full inserts on the pick's goroutine): 8 learns of prompts up to 2,048
// blocks (32k tokens at 16 a block) fit.
const (
	settleDelay = time.Millisecond
	settleHurry = 8
)

// startSettler starts the goroutine that settles the policies' queued
// learning until Close: woken by the first pool that asks, it waits up to
// settleDelay (less when a pick finds settleHurry learns queued) unless
// that many are queued already, then settles that pool and every other
// pool that asked meanwhile. The wait is for a settler that keeps up: one
// that finds the queue deep when it wakes (many concurrent picks on few
// cores) settles at once, since every wait sends it back through the run
// queue behind the picks (epp TestManyStreams, 2,000 streams on 2 cores:
// 57 s with a wait on every wake, 25–30 s without).
func (g *Gateway) startSettler() {
	g.settles = make(chan *pool, settleBacklog)
	g.settleNow = make(chan struct{}, 1)
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		wait := time.NewTimer(settleDelay)
		wait.Stop()
		for {
			var p *pool
			select {
			case <-g.loops.Done():
				return
			case p = <-g.settles:
			}
			if p.settler().Queued() < settleHurry {
				wait.Reset(settleDelay)
				select {
				case <-g.loops.Done():
					return
				case <-wait.C:
				case <-g.settleNow:
					wait.Stop()
				}
			}
			for p != nil {
				// Cleared first: a learn queued from here on asks again.
				p.settleQueued.Store(false)
				p.settler().Settle()
				select {
				case p = <-g.settles:
				default:
					p = nil
				}
			}
		}
	}()
}

// settler is p's policy's learning queue (nil: it learns at once).
func (p *pool) settler() sched.Settler {
	if p.pd != nil {
		return p.pd
	}
	s, _ := p.policy.(sched.Settler)
	return s
}

// settleLater hands p's queued learning, if any, to the settler unless p
// already waits for it (or settles it here when settleBacklog pools wait),
// and hurries the settler when settleHurry learns are queued. After Close
// a pool left waiting is settled by the index's own bound only
// (prefix.Index.Learn inserts inline once its queue is full).
func (g *Gateway) settleLater(p *pool) {
	s := p.settler()
	if s == nil || !s.Unsettled() {
		return
	}
	if p.settleQueued.Load() || !p.settleQueued.CompareAndSwap(false, true) {
		if s.Queued() >= settleHurry {
			select {
			case g.settleNow <- struct{}{}:
			default:
			}
		}
		return
	}
	select {
	case g.settles <- p:
	default:
		p.settleQueued.Store(false)
		s.Settle()
	}
}

// learnFinished tells p's policy that endpoint slot i ended x's request
// (sched.Finisher): with routing.prefix.learn_on_finish the approximate
// index releases the pin the pick took on its prompt and touches it, queued
// for the settler, as the engine's LRU free queue takes a finished
// request's blocks (a pick that did not pin, its endpoint overfull, leaves
// the index as it is). Every pick that attempt or an EPP pick's Done follows
// calls it once, whatever the answer; a pick that took no slot is released
// at once (releasePick). When a reload replaced p since the pick, the pin
// is released in the pool in force if that pool kept p's policy (routing
// unchanged: the same index holds the pin) and slot i still names the same
// endpoint; otherwise the pin went with the policy or with the slot (Forget
// clears it), and releasing would teach another engine a prompt it never
// ran. Skipping a kept policy's pin would leave it for ever: a reload
// during in-flight requests pinned their blocks until the slot's next
// reset, and enough reloads under load left every block of the endpoint
// pinned, its LRU turned into first-pinned-first-out.
func (g *Gateway) learnFinished(p *pool, i int, x *exchange) {
	if g.replicas != nil {
		g.replicas.finished(p, i, &x.sreq) // the peers' pins (replicas.go), whatever this replica's reload did
	}
	if n := p.latest(); n != p {
		if n.policy != p.policy || n.pd != p.pd || i >= len(n.endpoints) || n.endpoints[i] != p.endpoints[i] {
			return
		}
		p = n
	}
	if releasePick(p, i, &x.sreq) {
		g.settleLater(p)
	}
}

// releasePick calls p's Finisher, if it learns on finish, for req on slot
// i, and reports whether it did.
func releasePick(p *pool, i int, req *sched.Request) bool {
	if len(req.Hashes) == 0 {
		return false
	}
	f := finisher(p)
	if f == nil {
		return false
	}
	f.Finished(i, req.Hashes, req.Pinned)
	return true
}

// finisher is p's Finisher (its P/D profiles', else its policy's) when
// it learns on finish, nil otherwise.
func finisher(p *pool) sched.Finisher {
	var f sched.Finisher
	if p.pd != nil {
		f = p.pd
	} else if pf, ok := p.policy.(sched.Finisher); ok {
		f = pf
	}
	if f == nil || !f.LearnsOnFinish() {
		return nil
	}
	return f
}
