package gateway

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/prefix"
)

// newScraper sets up the metrics scrape of every endpoint whose kind has a
// metrics page (nil scraper when none, or scraping is disabled).
func (g *Gateway) newScraper() error {
	if g.cfg.ScrapeInterval < 0 {
		return nil
	}
	var eps []fleet.Endpoint
	for _, ep := range g.endpoints {
		if ep.metricsURL == "" {
			continue
		}
		ep.scrapeIdx = len(eps)
		eps = append(eps, fleet.Endpoint{URL: ep.base, Kind: ep.kind, MetricsURL: ep.metricsURL})
	}
	if len(eps) == 0 {
		return nil
	}
	s, err := fleet.NewScraper(eps, fleet.ScrapeConfig{Interval: g.cfg.ScrapeInterval, Timeout: min(g.cfg.ScrapeInterval, g.cfg.HealthCheckTimeout)})
	if err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	g.scraper = s
	return nil
}

// allKVEvents reports whether every endpoint publishes KV events.
func allKVEvents(eps []*endpoint) bool {
	for _, ep := range eps {
		if ep.kvEvents == nil {
			return false
		}
	}
	return len(eps) > 0
}

// kvSubscription is one engine's KV-event stream, applied to the precise
// index of every pool the engine serves.
type kvSubscription struct {
	ep       *endpoint
	sub      *fleet.KVEventSubscriber
	appliers []*fleet.KVEventApplier
}

// fanout applies a stream to several pools' indexes.
type fanout []*fleet.KVEventApplier

func (f fanout) KVBatch(seq uint64, b *fleet.KVEventBatch) {
	for _, a := range f {
		a.KVBatch(seq, b)
	}
}

func (f fanout) KVReset(r fleet.KVResetReason) {
	for _, a := range f {
		a.KVReset(r)
	}
}

// subscribeKVEvents starts one subscriber per endpoint that publishes KV
// events and feeds at least one pool's precise index; they stop with ctx.
func (g *Gateway) subscribeKVEvents(ctx context.Context) error {
	byEP := map[*endpoint]*kvSubscription{}
	for _, p := range g.pools {
		if p.precise == nil {
			continue
		}
		for i, ep := range p.endpoints {
			s := byEP[ep]
			if s == nil {
				sub, err := fleet.NewKVEventSubscriber(fleet.KVEventSubscriberConfig{
					Endpoint: ep.kvEvents.Endpoint, ReplayEndpoint: ep.kvEvents.ReplayEndpoint, Topic: ep.kvEvents.Topic})
				if err != nil {
					return fmt.Errorf("gateway: kv_events of %s: %w", ep.name, err)
				}
				s = &kvSubscription{ep: ep, sub: sub}
				byEP[ep] = s
			}
			s.appliers = append(s.appliers, fleet.NewKVEventApplier(p.precise, i, fleet.KVSeeds(p.model)))
		}
	}
	for _, ep := range g.endpoints {
		s := byEP[ep]
		if s == nil {
			continue
		}
		g.kvSubs = append(g.kvSubs, *s)
		g.wg.Go(func() {
			if err := s.sub.Run(ctx, fanout(s.appliers)); err != nil && ctx.Err() == nil {
				slog.Error("gateway: KV-event subscription ended", "endpoint", s.ep.name, "err", err)
			}
		})
	}
	return nil
}

// PreciseIndex returns the precise prefix index of model's pool (nil when
// its endpoints publish no KV events or the model is unknown). For tests
// and diagnostics.
func (g *Gateway) PreciseIndex(model string) *prefix.PreciseIndex {
	if p := g.pools[model]; p != nil {
		return p.precise
	}
	return nil
}

// preciseMatch returns the leading blocks of hashes the precise index says
// endpoint e holds on its GPU (a full match over the pool; no allocation).
func (p *pool) preciseMatch(hashes []uint64, e int) int {
	var buf [prefix.MaxEndpoints]int
	m := buf[:min(len(p.endpoints), prefix.MaxEndpoints)]
	p.precise.Match(hashes, prefix.MediumGPU, m)
	if e < 0 || e >= len(m) {
		return 0
	}
	return m[e]
}

// Policy returns the name of the routing policy in use (the configured one,
// or the default chosen for the endpoints).
func (g *Gateway) Policy() string { return g.cfg.Routing.Policy }
