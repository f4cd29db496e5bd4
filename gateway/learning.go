package gateway

import "github.com/infergate/infergate/sched"

// The routing policies' learning off the pick path: a decision of a policy
// with an approximate prefix index queues its update (sched.Settler,
// prefix.Index.Learn; the index's Match counts it at once), and one
// goroutine of the gateway applies the queues. A pick that finds that
// goroutine behind (settleBacklog notices waiting) settles on its own
// goroutine, as the pick path did before, so that the queues stay bounded.
// BenchmarkEPPDecision and sched.BenchmarkDecision64x1M measure the pick
// path (gateway/README.md "Performance").

// settleBacklog is the most policies waiting for the settler.
const settleBacklog = 64

// startSettler starts the goroutine that settles the policies' queued
// learning until Close.
func (g *Gateway) startSettler() {
	g.settles = make(chan sched.Settler, settleBacklog)
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		for {
			select {
			case <-g.loops.Done():
				return
			case s := <-g.settles:
				s.Settle()
			}
		}
	}()
}

// settleLater hands p's queued learning, if any, to the settler (or
// settles it here when the settler is behind or stopped).
func (g *Gateway) settleLater(p *pool) {
	var s sched.Settler
	if p.pd != nil {
		s = p.pd
	} else if ps, ok := p.policy.(sched.Settler); ok {
		s = ps
	}
	if s == nil || !s.Unsettled() {
		return
	}
	select {
	case g.settles <- s:
	default:
		s.Settle()
	}
}
