package gateway

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
)

// feeds are what an endpoint's engine tells the gateway besides its
// answers: its metrics page (scraped) and its KV events (subscribed). Each
// runs on its own goroutine from the reload that starts it to the one that
// stops it (its configuration changed, or its endpoint was removed) or
// Close; a reload that changes neither keeps it running, with what it
// learnt.
type feeds struct {
	scrape *scrapeFeed // nil: not scraped
	kv     *kvFeed     // nil: no KV events feed a precise index
}

// loop is the lifetime of a feed's goroutine.
type loop struct {
	stop context.CancelFunc // nil until started
	done chan struct{}      // closed when the goroutine has returned
}

// start runs f on a goroutine of g's until stop is called or g is closed.
func (l *loop) start(g *Gateway, f func(ctx context.Context)) {
	ctx, cancel := context.WithCancel(g.loops)
	l.stop, l.done = cancel, make(chan struct{})
	g.wg.Go(func() {
		defer close(l.done)
		f(ctx)
	})
}

// scrapeFeed is one endpoint's metrics scrape: a fleet.Scraper of that
// endpoint alone (index 0).
type scrapeFeed struct {
	loop
	s    *fleet.Scraper
	from fleet.Target // what it scrapes, to tell at a reload whether it changed
}

// newScrapeFeed returns the scrape of an endpoint whose kind has a metrics
// page (nil when it has none, or scraping is disabled); not started.
func (g *Gateway) newScrapeFeed(ep *endpoint, spec *endpointSpec) (*scrapeFeed, error) {
	if g.cfg.ScrapeInterval < 0 || spec.metricsURL == "" {
		return nil, nil
	}
	from := scrapeOf(ep, spec)
	// At the endpoint's phase after the first scrape: a fleet added at
	// once is not scraped at once every scrape_interval.
	s, err := fleet.NewScraper([]fleet.Target{from},
		fleet.ScrapeConfig{Interval: g.cfg.ScrapeInterval, Timeout: min(g.cfg.ScrapeInterval, g.cfg.HealthCheckTimeout),
			Phase: fleet.PhaseOffset(g.phaseSeed, "scrape", ep.name, g.cfg.ScrapeInterval)})
	if err != nil {
		return nil, fmt.Errorf("gateway: %w", err)
	}
	return &scrapeFeed{s: s, from: from}, nil
}

func (f *scrapeFeed) run(g *Gateway) { f.start(g, f.s.Run) }

// scrapeOf is what an endpoint's scrape reads under spec: its metrics page,
// with its credentials and configured headers.
func scrapeOf(ep *endpoint, spec *endpointSpec) fleet.Target {
	return fleet.Target{URL: ep.base, Kind: spec.kind, MetricsURL: spec.metricsURL, Header: spec.header}
}

// scrapes reports whether f scrapes what e says (a reload keeps it then).
func (f *scrapeFeed) scrapes(e fleet.Target) bool {
	return f.from.URL == e.URL && f.from.Kind == e.Kind && f.from.MetricsURL == e.MetricsURL && sameHeader(f.from.Header, e.Header)
}

// latest is the endpoint's latest scraped load at now (ok false when there
// is none, or it is stale); a nil feed has none.
func (f *scrapeFeed) latest(now time.Time) (fleet.Load, time.Time, bool) {
	if f == nil {
		return fleet.Load{}, time.Time{}, false
	}
	return f.s.LatestAt(0, now)
}

// allKVEvents reports whether every endpoint publishes KV events.
func allKVEvents(eps []*endpoint, specs func(*endpoint) *endpointSpec) bool {
	n := 0
	for _, ep := range eps {
		if ep == vacant {
			continue
		}
		if specs(ep).kvEvents == nil {
			return false
		}
		n++
	}
	return n > 0
}

// kvFeed is one engine's KV-event stream, applied to the precise index of
// every pool the engine serves (one applier per pool: its index and the
// endpoint's slot in it).
type kvFeed struct {
	loop
	name string         // the endpoint's name, or the kv_store's address
	cfg  KVEventsConfig // what it subscribes to (streamOf), to tell at a reload whether it changed
	sub  *kvevents.Subscriber

	// mu is held while a batch, a reset or onDown's forget is applied,
	// and by a reload's commit while it changes the appliers and hands
	// slots over (commit.go): every write of the feed to a slot is then
	// before the slot's forget or after it, never across.
	mu       sync.Mutex
	appliers []*fleet.KVEventApplier
	targets  []feedTarget // of each applier

	// forgetHook, set by tests (nil otherwise), is called by onDown with
	// the appliers it forgets in hand, before it forgets them.
	forgetHook func()
}

// feedTarget is where an applier puts a stream's blocks: endpoint slot of
// the precise index ix, model's pool.
type feedTarget struct {
	ix    *prefix.PreciseIndex
	slot  int
	model string
}

// streamOf is the part of kc a subscription depends on: a reload that
// changes only the rest (capacities, tiers) keeps the feed and what it
// learnt.
func streamOf(kc *KVEventsConfig) KVEventsConfig {
	return KVEventsConfig{Endpoint: kc.Endpoint, ReplayEndpoint: kc.ReplayEndpoint, Topic: kc.Topic, MaxMessageBytes: kc.MaxMessageBytes}
}

// newKVFeed returns the subscription to the KV events kc locates (an
// endpoint's kv_events, a kv_store's stream), named name; not started.
func newKVFeed(name string, kc *KVEventsConfig) (*kvFeed, error) {
	sub, err := kvevents.NewSubscriber(kvevents.SubscriberConfig{
		Endpoint: kc.Endpoint, ReplayEndpoint: kc.ReplayEndpoint, Topic: kc.Topic,
		MaxMessageBytes: kc.MaxMessageBytes})
	if err != nil {
		return nil, fmt.Errorf("gateway: kv_events of %s: %w", name, err)
	}
	return &kvFeed{name: name, cfg: streamOf(kc), sub: sub}, nil
}

// run subscribes until the feed is stopped or g closed.
func (f *kvFeed) run(g *Gateway) {
	f.start(g, func(ctx context.Context) {
		if err := f.sub.Run(ctx, f); err != nil && ctx.Err() == nil {
			slog.Error("gateway: KV-event subscription ended", "endpoint", f.name, "err", err)
		}
	})
}

// current returns the appliers and their targets.
func (f *kvFeed) current() ([]*fleet.KVEventApplier, []feedTarget) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.appliers, f.targets
}

// KVBatch implements kvevents.Handler: the batch goes to every pool's
// index.
func (f *kvFeed) KVBatch(seq uint64, b *kvevents.Batch) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, a := range f.appliers {
		a.KVBatch(seq, b)
	}
}

// KVReset implements kvevents.Handler.
func (f *kvFeed) KVReset(r kvevents.ResetReason) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, a := range f.appliers {
		a.KVReset(r)
	}
}

// onDown is the hook of an endpoint that leaves rotation (a failed health
// check, an ejection): its blocks are forgotten in every precise index at
// once and its stream resynchronised (kvevents.Subscriber.Resync). An
// engine that restarted in place publishes nothing until it serves, so
// without this the first requests after its return would be routed on the
// blocks of its previous life. The forget holds the feed's lock, as a
// batch does: a hook that runs after a reload detached the feed (a removed
// endpoint going down while its slot is given to another) forgets nothing.
// Until 2026-12-05 it read the appliers, then forgot without the lock, and
// such a forget could erase the new endpoint's first events.
func (f *kvFeed) onDown() {
	f.mu.Lock()
	if f.forgetHook != nil {
		f.forgetHook()
	}
	for _, a := range f.appliers {
		a.Forget()
	}
	f.mu.Unlock()
	f.sub.Resync()
}

// kvCollector exposes the KV-event subscribers' and appliers' counters at
// scrape time (they are atomics the event path maintains anyway), for the
// feeds of the configuration in force.
type kvCollector struct {
	g                             *Gateway
	batches, resets, dropped      *prometheus.Desc
	stored, unknownParent, joined *prometheus.Desc
	orphansDropped, evicted       *prometheus.Desc
}

func newKVCollector(g *Gateway) *kvCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("infergate_kv_events_"+name, help, labels, nil)
	}
	return &kvCollector{
		g:       g,
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
	st := c.g.state.Load()
	if st == nil {
		return
	}
	fs := make([]*kvFeed, 0, len(st.endpoints)+len(st.stores))
	for _, ep := range st.endpoints {
		if f := st.feeds[ep].kv; f != nil {
			fs = append(fs, f)
		}
	}
	for _, model := range slices.Sorted(maps.Keys(st.stores)) {
		fs = append(fs, st.stores[model]) // endpoint: the store's address
	}
	for _, f := range fs {
		name := f.name
		ss := f.sub.Stats()
		counter(c.batches, ss.Batches, name)
		counter(c.resets, ss.Resets, name)
		counter(c.dropped, ss.Oversized, name, "oversized")
		counter(c.dropped, ss.Panics, name, "panic")
		appliers, targets := f.current()
		for i, a := range appliers {
			as, model := a.Stats(), targets[i].model
			counter(c.stored, as.Stored, model, name)
			counter(c.unknownParent, as.UnknownParents, model, name)
			counter(c.joined, as.Joined, model, name)
			counter(c.orphansDropped, as.OrphansDropped, model, name)
			counter(c.evicted, as.Evicted, model, name)
		}
	}
}

// PreciseIndex returns the precise prefix index of model's pool (nil when
// its endpoints publish no KV events or the model is unknown). For tests
// and diagnostics.
func (g *Gateway) PreciseIndex(model string) *prefix.PreciseIndex {
	if p := g.state.Load().pools[model]; p != nil {
		return p.precise
	}
	return nil
}

// preciseMatch returns the leading blocks of hashes the precise index says
// endpoint e holds on its GPU (a match over e's group of 64; no
// allocation).
func (p *pool) preciseMatch(hashes []uint64, e int) int {
	if e < 0 || e >= len(p.endpoints) {
		return 0
	}
	return p.precise.MatchEndpoint(hashes, prefix.MediumGPU, e)
}

// preciseTiers is the blocks of hashes endpoint e would take from each
// tier (sched.SplitTiers of the precise index's per-medium matches, the
// remote tier's from the kv_store's slot) for a prompt of promptTokens.
func (p *pool) preciseTiers(hashes []uint64, e, promptTokens int) [sched.NumTiers]int {
	var m [sched.NumTiers]int
	for t := range m {
		switch {
		case t != int(prefix.MediumRemote):
			m[t] = p.precise.MatchEndpoint(hashes, prefix.Medium(t), e)
		case p.store != nil:
			m[t] = p.precise.MatchEndpoint(hashes, prefix.MediumRemote, p.storeSlot())
		}
	}
	maxBlocks := len(hashes)
	if promptTokens > 0 {
		maxBlocks = max(0, (promptTokens-1)/max(1, p.blockSize))
	}
	return sched.SplitTiers(m, maxBlocks)
}

// Policy returns the name of the routing policy in use (the configured one,
// or the default chosen for the endpoints).
func (g *Gateway) Policy() string { return g.state.Load().cfg.Routing.Policy }
