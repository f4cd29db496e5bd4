package simserver

import (
	"time"

	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/sim"
)

// KV-cache events, published as vLLM does (docs/PROTOCOLS.md §1): the engine
// records them (sim.StepResult.Events, sim.Engine.TakeKVEvents; see
// ../sim/kvevents.go) and a Server publishes them with a kvevents.Publisher
// (vLLM's msgspec encoding over ZeroMQ, like its ZmqEventPublisher). See
// README.md "KV events" and ../kvevents/README.md.

// KVEventPublisher returns the server's KV-event publisher (for its
// addresses and counters), or nil when KV events are off.
func (s *Server) KVEventPublisher() *kvevents.Publisher { return s.kvpub }

// ResetPrefixCache resets the engine's prefix cache (sim.Engine.ResetPrefixCache,
// like vLLM's /reset_prefix_cache) and publishes the resulting
// AllBlocksCleared at once. It reports false when a request holds KV blocks
// or the server is not running.
func (s *Server) ResetPrefixCache() bool {
	ok := false
	ran := s.withEngine(func(e *sim.Engine, _ time.Duration) { ok = e.ResetPrefixCache() })
	return ran && ok
}

// engineCall is a function to run on the driver goroutine, which owns the engine.
type engineCall struct {
	f    func(e *sim.Engine, now time.Duration)
	done chan struct{}
}

// withEngine runs f on the driver goroutine between steps (or during a step's
// wall-clock wait, after the step's events were queued) and waits for it. It
// reports false, without running f, when the driver is not running.
func (s *Server) withEngine(f func(e *sim.Engine, now time.Duration)) bool {
	if !s.started.Load() {
		return false
	}
	c := &engineCall{f: f, done: make(chan struct{})}
	select {
	case s.control <- c:
		<-c.done
		return true
	case <-s.done:
		return false
	}
}

// runEngineCall runs c on the driver at simulated time now and publishes the
// KV events it caused.
func (s *Server) runEngineCall(e *sim.Engine, c *engineCall, now time.Duration) {
	defer close(c.done)
	c.f(e, now)
	s.kvEnqueue(s.kvEncode(e.TakeKVEvents(), now))
}

// kvEncode encodes the events of a step ending (or a call made) at simulated
// time at into a batch payload, or returns nil when there are none.
func (s *Server) kvEncode(events []kvevents.Event, at time.Duration) []byte {
	if s.kvpub == nil || len(events) == 0 {
		return nil
	}
	return s.kvpub.Encode(s.kvTS(at), events)
}

// kvEnqueue queues an encoded batch (if any) and returns nil.
func (s *Server) kvEnqueue(payload []byte) []byte {
	if payload != nil {
		s.kvpub.Enqueue(payload)
	}
	return nil
}

// kvTS is the batch timestamp of simulated time at: seconds since the Unix
// epoch on the simulated clock, which starts at the driver's wall-clock start
// (vLLM stamps batches with time.time()). At TimeScale 1 it follows the wall
// clock; faster servers run ahead of it, so stamps stay consistent with the
// simulated latencies the server reports.
func (s *Server) kvTS(at time.Duration) float64 {
	t0 := s.startWall.Load()
	return float64(t0/1e9) + float64(t0%1e9)/1e9 + at.Seconds()
}
