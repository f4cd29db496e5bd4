package gateway

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/infergate/infergate/sched"
)

// Publishing a built state (build.go): one atomic swap, then the changes it
// plans are applied to what outlives it (slots forgotten, gates resized,
// feeds started and stopped, endpoints retired once drained).

// commit publishes st (built from prev by build, with plan pl): the one
// swap of the state, then what the old and new states share is updated
// and the new loops started. It cannot fail. reloadMu is held.
func (g *Gateway) commit(st *state, pl *plan, prev *state) {
	for ep, spec := range pl.specs {
		ep.spec.Store(spec)
	}
	now := g.clock()
	for _, c := range pl.limits {
		c.Apply(now)
	}
	for _, gs := range pl.gates {
		if gs.early {
			gs.a.update(gs.eps, gs.limit, gs.cfg, gs.hold)
		}
	}

	// Kept indexes and policies grow before the swap: the state in force
	// names none of the new slots, and the new state's first pick finds
	// them.
	for _, op := range pl.grows {
		g.grow(st, pl, op)
	}
	// Then kept policies learn their pools' tiers: the prices of the new
	// slots, the kv_store's slot where it just moved.
	for _, op := range pl.tiers {
		op.policy.SetTiers(op.tiers)
	}

	g.state.Store(st)
	for old, p := range pl.succ {
		old.next.Store(p)
	}
	for _, a := range pl.gone {
		a.retire()
	}
	// A Drain that read the state in force before the swap has not
	// drained the new pools' gates.
	if g.draining.Load() {
		for _, p := range st.pools {
			p.gate.drain()
		}
	}

	for _, gs := range pl.gates {
		if !gs.early {
			gs.a.update(gs.eps, gs.limit, gs.cfg, gs.hold)
		}
	}
	g.setHooks(st)
	g.setAdapterGauge(st, prev)
	// Slots change hands with every KV feed whose appliers change held
	// (handover): no batch or reset of theirs runs from before their
	// appliers change until the slots are forgotten and bounded, so a
	// leaving engine's events all happen before its slot's forget, and an
	// arriving engine's — a new feed's (started below) or a kept feed's
	// given a new slot — all after it.
	held := pl.heldFeeds()
	for _, f := range held {
		f.mu.Lock()
	}
	for _, f := range pl.detach {
		f.appliers, f.targets = nil, nil
	}
	for f, fs := range pl.feedSets {
		if fs.changed {
			f.appliers, f.targets = fs.appliers, fs.targets
		}
	}
	if g.slotsHook != nil {
		g.slotsHook()
	}
	for _, op := range pl.slots {
		switch {
		case op.ix != nil && op.forget:
			op.ix.Forget(op.slot)
		case op.policy != nil && op.forget:
			op.policy.(sched.Forgetter).Forget(op.slot)
		}
		switch {
		case op.ix != nil && op.cap >= 0:
			op.ix.SetCapacity(op.slot, op.cap)
			if op.mcap != nil {
				setMediumCapacities(op.ix, op.slot, op.mcap)
			}
		case op.policy != nil && op.cap >= 0:
			if r, ok := op.policy.(sched.Resizer); ok {
				r.SetCapacity(op.slot, op.cap)
			}
		}
	}
	for _, f := range held {
		f.mu.Unlock()
	}
	// The peers' pins go with the policies and slots they were taken on.
	g.replicas.dropPins(st, pl)

	// Credentials refused eject (a new endpoint before it serves), new
	// ones accepted end an ejection the old ones caused.
	g.applyCredentials(st.endpoints, pl.creds, time.Now())

	for _, ep := range pl.added {
		g.startEndpoint(ep)
	}
	for _, start := range pl.start {
		start()
	}
	for _, l := range pl.stop {
		l.stop()
	}
	for _, ep := range pl.removed {
		ep.onDown.Store(nil)
		g.retire(ep, prev.feeds[ep])
	}
	g.gatesMu.Lock()
	g.retired = slices.DeleteFunc(g.retired, func(a *admission) bool { return a.active.Load() == 0 && a.waiting.Load() == 0 })
	g.retired = append(g.retired, pl.gone...)
	g.gatesMu.Unlock()
}

// setHooks gives every endpoint of st the gates it wakes and the hooks it
// runs when it leaves rotation (the pools' policies forget its slot, its KV
// feed resynchronises).
func (g *Gateway) setHooks(st *state) {
	gates := map[*endpoint][]*admission{}
	hooks := map[*endpoint][]func(){}
	for _, model := range slices.Sorted(maps.Keys(st.pools)) {
		p := st.pools[model]
		f, forgets := p.policy.(sched.Forgetter)
		peers := g.replicas != nil && g.replicas.node != nil // peers' pins to drop with a forgotten slot
		var pf sched.Forgetter
		if p.pd != nil {
			pf, _ = p.pd.Prefill().(sched.Forgetter)
		}
		for i, ep := range p.endpoints {
			if ep == vacant {
				continue
			}
			gates[ep] = append(gates[ep], p.gate)
			if forgets {
				hooks[ep] = append(hooks[ep], func() { f.Forget(i) })
				if fin, ok := f.(sched.PeerFinisher); ok && peers {
					hooks[ep] = append(hooks[ep], func() { g.replicas.dropSlot(fin, i) })
				}
			}
			if pf != nil {
				hooks[ep] = append(hooks[ep], func() { pf.Forget(i) })
				if fin, ok := pf.(sched.PeerFinisher); ok && peers {
					hooks[ep] = append(hooks[ep], func() { g.replicas.dropSlot(fin, i) })
				}
			}
		}
	}
	for _, ep := range st.endpoints {
		if f := st.feeds[ep].kv; f != nil {
			hooks[ep] = append(hooks[ep], f.onDown)
		}
		gs, hs := gates[ep], hooks[ep]
		ep.gates.Store(&gs)
		ep.onDown.Store(&hs)
	}
}

// startEndpoint starts ep's health loop and its model list's refresh
// (adapters.go).
func (g *Gateway) startEndpoint(ep *endpoint) {
	ctx, cancel := context.WithCancel(g.loops)
	ep.stop = cancel
	g.wg.Go(func() {
		defer close(ep.done)
		g.healthLoop(ctx, ep)
	})
	g.wg.Go(func() { g.modelsLoop(ctx, ep) })
}

// drainPoll is how often a removed endpoint's in-flight count is read.
const drainPoll = 50 * time.Millisecond

// retire drains ep, which a reload removed: it gets no new pick (no pool in
// force has it), and once its requests in flight have finished, or after
// response_header_timeout (the longest an engine may take to answer),
// its health loop and feeds stop.
func (g *Gateway) retire(ep *endpoint, f feeds) {
	g.wg.Go(func() {
		t := time.NewTicker(drainPoll)
		defer t.Stop()
		bound := time.NewTimer(g.cfg.ResponseHeaderTimeout)
		defer bound.Stop()
	wait:
		for ep.ledger.InFlight() > 0 {
			select {
			case <-g.loops.Done():
				break wait
			case <-bound.C:
				slog.Warn("gateway: removed endpoint still has requests in flight; its health checks stop now",
					"endpoint", ep.name, "in_flight", ep.ledger.InFlight(), "waited", g.cfg.ResponseHeaderTimeout)
				break wait
			case <-t.C:
			}
		}
		ep.stop()
		if f.scrape != nil {
			f.scrape.stop()
		}
		if f.kv != nil {
			f.kv.stop()
		}
		slog.Info("gateway: removed endpoint drained", "endpoint", ep.name)
	})
}

// oldGates returns the admission gates of models removed by reloads.
func (g *Gateway) oldGates() []*admission {
	g.gatesMu.Lock()
	defer g.gatesMu.Unlock()
	return slices.Clone(g.retired)
}

// grow applies op (commit, before the swap). A kv_store that moves does so
// with its feed held: no batch is applied meanwhile, and the next goes to
// the new slot (its applier is set here; the feed loop sets it again).
func (g *Gateway) grow(st *state, pl *plan, op growOp) {
	var err error
	switch {
	case op.policy != nil:
		err = op.policy.Grow(op.n)
	case op.from < 0:
		err = op.ix.Grow(op.n)
	default:
		f := st.stores[op.model]
		if f != nil {
			f.mu.Lock()
		}
		if err = op.ix.Grow(op.n); err == nil {
			err = op.ix.Move(op.from, op.to)
		}
		if f != nil {
			if fs, ok := pl.feedSets[f]; ok {
				f.appliers, f.targets = fs.appliers, fs.targets
			}
			f.mu.Unlock()
		}
	}
	if err != nil {
		// build checked the sizes (at most prefix.MaxIndexEndpoints):
		// not reached.
		slog.Error("gateway: growing an index at a reload failed", "model", op.model, "err", err)
	}
}
