package gateway

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"

	"github.com/prometheus/client_golang/prometheus"

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
		eps = append(eps, fleet.Endpoint{URL: ep.base, Kind: ep.kind, MetricsURL: ep.metricsURL, Header: ep.header})
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
	models   []string // the pool of each applier
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

// setupKVEvents makes one subscriber per endpoint that publishes KV events
// and feeds at least one pool's precise index, and registers their metrics
// on reg. It runs before the health checks start, because it adds to the
// endpoints' onDown hooks: an endpoint that leaves rotation (a failed health
// check, an ejection) has its blocks forgotten in every precise index at
// once and its stream resynchronised (fleet.KVEventSubscriber.Resync). An
// engine that restarted in place publishes nothing until it serves, so
// without this the first requests after its return would be routed on the
// blocks of its previous life.
func (g *Gateway) setupKVEvents(reg prometheus.Registerer) error {
	byEP := map[*endpoint]*kvSubscription{}
	for _, model := range slices.Sorted(maps.Keys(g.pools)) {
		p := g.pools[model]
		if p.precise == nil {
			continue
		}
		for i, ep := range p.endpoints {
			s := byEP[ep]
			if s == nil {
				kc := ep.kvEvents
				sub, err := fleet.NewKVEventSubscriber(fleet.KVEventSubscriberConfig{
					Endpoint: kc.Endpoint, ReplayEndpoint: kc.ReplayEndpoint, Topic: kc.Topic,
					MaxMessageBytes: kc.MaxMessageBytes})
				if err != nil {
					return fmt.Errorf("gateway: kv_events of %s: %w", ep.name, err)
				}
				s = &kvSubscription{ep: ep, sub: sub}
				byEP[ep] = s
			}
			s.appliers = append(s.appliers, fleet.NewKVEventApplier(p.precise, i, fleet.KVSeeds(p.model)))
			s.models = append(s.models, model)
		}
	}
	for _, ep := range g.endpoints {
		s := byEP[ep]
		if s == nil {
			continue
		}
		g.kvSubs = append(g.kvSubs, *s)
		ep.onDown = append(ep.onDown, func() {
			for _, a := range s.appliers {
				a.Forget()
			}
			s.sub.Resync()
		})
	}
	if len(g.kvSubs) == 0 {
		return nil
	}
	if err := reg.Register(newKVCollector(g.kvSubs)); err != nil {
		return fmt.Errorf("gateway: register KV-event metrics: %w", err)
	}
	return nil
}

// startKVEvents runs the subscribers until ctx is done.
func (g *Gateway) startKVEvents(ctx context.Context) {
	for i := range g.kvSubs {
		s := &g.kvSubs[i]
		g.wg.Go(func() {
			if err := s.sub.Run(ctx, fanout(s.appliers)); err != nil && ctx.Err() == nil {
				slog.Error("gateway: KV-event subscription ended", "endpoint", s.ep.name, "err", err)
			}
		})
	}
}

// kvCollector exposes the KV-event subscribers' and appliers' counters at
// scrape time (they are atomics the event path maintains anyway).
type kvCollector struct {
	subs                          []kvSubscription
	batches, resets, dropped      *prometheus.Desc
	stored, unknownParent, joined *prometheus.Desc
	orphansDropped, evicted       *prometheus.Desc
}

func newKVCollector(subs []kvSubscription) *kvCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("infergate_kv_events_"+name, help, labels, nil)
	}
	return &kvCollector{
		subs:    subs,
		batches: d("batches_total", "KV-event batches applied to the precise index (live and replayed; batches).", "endpoint"),
		resets: d("resets_total", "Times the endpoint's KV-event state was forgotten: subscription start, lost batches, "+
			"publisher restart, undecodable batch, resync after leaving rotation, failed session.", "endpoint"),
		dropped: d("dropped_connections_total", "KV-event connections dropped for misbehaving peers: reason=oversized "+
			"(a frame or message over kv_events.max_message_bytes, or over 16 frames), panic (a recovered panic).", "endpoint", "reason"),
		stored: d("stored_events_total", "BlockStored events applied (events).", "model", "endpoint"),
		unknownParent: d("unknown_parent_events_total", "BlockStored events whose parent block the index did not know: "+
			"kept as orphans under the engine's block hashes, or joined to a routed prompt (events).", "model", "endpoint"),
		joined: d("orphans_joined_total", "BlockStored events with an unknown or orphan parent joined to a prompt routed "+
			"to the endpoint (the prompt's earlier blocks are then held too; events).", "model", "endpoint"),
		orphansDropped: d("orphan_blocks_dropped_total", "Orphan blocks (parent unknown) evicted or reset before a routed "+
			"prompt joined them: what the index lost of the engine's cache (blocks).", "model", "endpoint"),
		evicted: d("evicted_blocks_total", "Blocks the precise index evicted because the endpoint's events announced more "+
			"than its KV capacity, kv_blocks + kv_events.offload_blocks (blocks).", "model", "endpoint"),
	}
}

// Describe implements prometheus.Collector.
func (c *kvCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.batches, c.resets, c.dropped, c.stored, c.unknownParent, c.joined, c.orphansDropped, c.evicted} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *kvCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	for _, s := range c.subs {
		st := s.sub.Stats()
		counter(c.batches, st.Batches, s.ep.name)
		counter(c.resets, st.Resets, s.ep.name)
		counter(c.dropped, st.Oversized, s.ep.name, "oversized")
		counter(c.dropped, st.Panics, s.ep.name, "panic")
		for i, a := range s.appliers {
			as := a.Stats()
			counter(c.stored, as.Stored, s.models[i], s.ep.name)
			counter(c.unknownParent, as.UnknownParents, s.models[i], s.ep.name)
			counter(c.joined, as.Joined, s.models[i], s.ep.name)
			counter(c.orphansDropped, as.OrphansDropped, s.models[i], s.ep.name)
			counter(c.evicted, as.Evicted, s.models[i], s.ep.name)
		}
	}
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
