package gateway

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/infergate/infergate/fleet"
)

// healthLoop checks ep every health_check_interval until ctx is done, at
// the endpoint's phase (probePhase: the loops of a pool built or reloaded
// at one moment do not all probe in the same instant); every
// scale_from_zero.probe_interval instead while ep is not ready and a pool
// it serves holds requests, and at once when one begins to (coldstart.go),
// so a held request is dispatched within that interval of the endpoint's
// readiness.
func (g *Gateway) healthLoop(ctx context.Context, ep *endpoint) {
	offset := g.probePhase(ep)
	t := time.NewTimer(g.probeWait(ep, time.Now(), time.Time{}, offset))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-ep.probeNow:
			if _, held := ep.holding(); !held || ep.ready.Load() {
				continue // nothing waits for it: the timer runs on
			}
		}
		began := time.Now()
		g.checkHealth(ctx, ep)
		t.Reset(g.probeWait(ep, time.Now(), began, offset))
	}
}

// probePhase is ep's health-check phase: its offset within
// health_check_interval (fleet.PhaseOffset of its name, seeded per
// gateway replica), in [0, interval).
func (g *Gateway) probePhase(ep *endpoint) time.Duration {
	return fleet.PhaseOffset(g.phaseSeed, "health", ep.name, g.cfg.HealthCheckInterval)
}

// probeWait is how long ep's health loop waits at now, after a probe that
// began at began (zero: before the loop's first), for its next probe: to
// the endpoint's next phase instant at least half an interval after began
// (fleet.NextPhase), so consecutive probes start exactly one interval apart and an endpoint
// that fails is seen within health_check_interval plus the failing probe's
// health_check_timeout; while ep is not ready and a pool it serves holds
// requests, scale_from_zero.probe_interval d from the last probe's start.
func (g *Gateway) probeWait(ep *endpoint, now, began time.Time, offset time.Duration) time.Duration {
	next := fleet.NextPhase(now, began, offset, g.cfg.HealthCheckInterval)
	if d, held := ep.holding(); held && !ep.ready.Load() && !began.IsZero() {
		// A fixed cadence from each probe's start: a probe slowed by a
		// loaded host or a slow engine does not stretch the period, so
		// readiness is seen within d (plus one probe's round trip).
		next = max(min(g.cfg.HealthCheckInterval, d)-now.Sub(began), 0)
	}
	if h := g.probeWaitHook.Load(); h != nil {
		(*h)(ep, now, next)
	}
	return next
}

// rediscoverEvery bounds how often an endpoint's passed health checks ask
// for the reads its engine did not answer when it was added: each such
// rebuild holds the reload lock up to one health_check_timeout.
const rediscoverEvery = 30 * time.Second

// errAsleep fails the health check of an engine in vLLM's sleep mode.
var errAsleep = errors.New("the engine is asleep (vLLM sleep mode: vllm:engine_sleep_state awake 0, /is_sleeping true)")

// checkAwake fails an engine whose latest metrics page says it is asleep
// (fleet.Load.Asleep) unless its /is_sleeping, asked now, says it woke
// since: a sleeping vLLM answers /health 200 but must get no traffic, and
// a wake-up (scale_from_zero wake.kind engine) is seen at the next probe,
// not the next scrape. An engine that has no /is_sleeping (404) stays
// asleep until a page says otherwise.
func (g *Gateway) checkAwake(ctx context.Context, ep *endpoint, spec *endpointSpec) error {
	st := g.state.Load()
	if st == nil { // New's first probes: nothing scraped yet
		return nil
	}
	f := st.feeds[ep].scrape
	if f == nil {
		return nil
	}
	if l, _, ok := f.latest(time.Now()); !ok || !l.Asleep {
		return nil
	}
	if asleep, err := g.prober.IsSleeping(ctx, ep.base, spec.header); err == nil && !asleep {
		return nil
	}
	return errAsleep
}

// checkHealth probes the endpoint once and updates its readiness: a failed
// probe takes it out of rotation, a successful one restores it unless an
// ejection is still running. path healthCheckOff skips the probe.
func (g *Gateway) checkHealth(ctx context.Context, ep *endpoint) {
	spec := ep.spec.Load()
	g.noteHealth(ctx, ep, spec, g.probeHealth(ctx, ep, spec))
}

// probeHealth is one health check of ep under spec (its health path and
// credentials): the probe (none with path healthCheckOff), then the sleep
// state (checkAwake).
func (g *Gateway) probeHealth(ctx context.Context, ep *endpoint, spec *endpointSpec) error {
	var err error
	if spec.healthPath != healthCheckOff {
		err = g.prober.Health(ctx, ep.name, ep.base+spec.healthPath, spec.header)
	}
	if err == nil {
		err = g.checkAwake(ctx, ep, spec)
	}
	return err
}

// noteHealth updates ep's readiness with the outcome err of a health check
// made under spec, unless the gateway is shutting down (ctx done) or a
// reload replaced ep's spec meanwhile.
func (g *Gateway) noteHealth(ctx context.Context, ep *endpoint, spec *endpointSpec, err error) {
	ok := err == nil
	if ctx.Err() != nil {
		return // shutting down: leave the state as it was
	}
	if ep.spec.Load() != spec {
		return // a reload changed what it probes (its credentials, its path) meanwhile: the next probe tells
	}
	if st := authStatus(0); errors.As(err, &st) && g.engineAuthFailures != nil {
		g.engineAuthFailures.WithLabelValues(ep.name, authSourceHealth).Inc()
	}
	if ok {
		ep.probeFailures.Store(0)
		if now := time.Now().UnixNano(); (spec.kvUnread || spec.lenUnread) && spec.healthPath != healthCheckOff &&
			now-ep.rediscoveredAt.Load() >= int64(rediscoverEvery) && spec.rediscoverAsked.CompareAndSwap(false, true) {
			// The engine answers now (its health check, not one that is
			// off): read what it did not tell when it
			// was added (its KV capacity, its context length), so that
			// routing's index and the context check are its own, not
			// the defaults (a rebuild of the configuration in force,
			// coalesced; once per spec and at most once per
			// rediscoverEvery for an engine that answers its health
			// check and keeps not answering those reads).
			ep.rediscoveredAt.Store(now)
			g.rebuildSoon()
		}
	} else if n := ep.probeFailures.Add(1); g.cfg.HealthCheckAbortAfter > 0 && n >= int64(g.cfg.HealthCheckAbortAfter) {
		if a := ep.waits.AbortAll(); a > 0 {
			slog.Warn("gateway: endpoint failed its health checks; requests waiting for its answer aborted and retried elsewhere",
				"endpoint", ep.name, "failed_probes", n, "aborted", a, "err", err)
		}
	}
	if ok && time.Now().UnixNano() < ep.ejectedUntil.Load() {
		return
	}
	switch was := ep.setReady(ok); {
	case !ok && !ep.wentDown.Swap(true):
		slog.Warn("gateway: endpoint failed its health check; out of rotation", "endpoint", ep.name, "path", spec.healthPath, "err", err)
	case !was && ok && ep.wentDown.Swap(false):
		slog.Info("gateway: endpoint healthy again; back in rotation", "endpoint", ep.name)
	}
}
