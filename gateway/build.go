package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"net/url"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/hftokenizer"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
)

// Building the state of a configuration, beside the one in force (the
// reload as a whole: reload.go): its endpoints, scrapes, pools, precise
// indexes and KV-event feeds, model list and keys. Nothing here is seen by
// a request until commit.go publishes it.

// build makes the state of cfg (defaulted and validated), reusing what prev
// (the state in force; nil at New) has of it, and the plan that publishes
// it. It changes nothing prev can see: new endpoints are probed (and their
// capacity discovered) here, everything shared waits for commit. An error
// refuses the configuration.
func (g *Gateway) build(ctx context.Context, cfg Config, prev *state) (*state, *plan, error) {
	if prev == nil {
		prev = &state{}
	}
	pl := &plan{specs: map[*endpoint]*endpointSpec{}, succ: map[*pool]*pool{}, feedSets: map[*kvFeed]feedSet{},
		creds: map[*endpoint]credentialsCheck{}}
	st := &state{cfg: cfg, pools: map[string]*pool{}, feeds: map[*endpoint]feeds{}, created: map[string]int64{}}

	specOf, err := g.buildEndpoints(ctx, cfg, prev, st, pl)
	if err != nil {
		return nil, nil, err
	}
	if err := g.buildScrapes(st, prev, specOf, pl); err != nil {
		return nil, nil, err
	}
	models, err := g.buildPools(cfg, prev, st, specOf, pl)
	if err != nil {
		return nil, nil, err
	}
	if err := g.buildKVFeeds(st, prev, specOf, pl); err != nil {
		return nil, nil, err
	}

	// The names served (models and aliases), GET /v1/models, then the
	// keys (whose lists are filtered from it).
	g.buildAdapters(st, cfg)
	if st.targets, err = buildTargets(st.pools, cfg.Aliases, st.adapters); err != nil {
		return nil, nil, err
	}
	if err := buildModelList(st, prev, models, cfg.Aliases); err != nil {
		return nil, nil, err
	}
	if st.keys, pl.limits, err = buildKeys(cfg, prev, st.targets, st.modelsBody, &g.keyUsage); err != nil {
		return nil, nil, err
	}
	if prev.pools != nil {
		pl.keysAdded, pl.keysRemoved, pl.keysChanged = auth.Changes(prev.keys.authRing(), st.keys.authRing())
		pl.authSwitched = (prev.keys == nil) != (st.keys == nil)
		pl.aliasesChanged = !reflect.DeepEqual(prev.cfg.Aliases, cfg.Aliases)
	}
	return st, pl, nil
}

// buildEndpoints makes st's endpoints, one per URL (the first entry's
// settings, the largest max_model_len): those prev has are kept, their
// spec remade in pl when their configuration or credentials changed; new
// ones are probed and their capacity discovered, maxDiscoveryProbes at a
// time. It records
// in pl the endpoints added, changed and removed, and returns the spec of
// an endpoint as the new state will have it.
func (g *Gateway) buildEndpoints(ctx context.Context, cfg Config, prev *state, st *state, pl *plan) (func(*endpoint) *endpointSpec, error) {
	var urls []string
	want := map[string]*EndpointConfig{}
	for _, ec := range cfg.Endpoints {
		base, _ := normalizeURL(ec.URL) // validated
		if w := want[base]; w != nil {
			w.MaxModelLen = max(w.MaxModelLen, ec.MaxModelLen)
			continue
		}
		w := ec
		w.URL, w.Model = base, ""
		want[base] = &w
		urls = append(urls, base)
	}
	inForce := map[string]*endpoint{}
	for _, ep := range prev.endpoints {
		inForce[ep.name] = ep
	}
	type job struct {
		ep     *endpoint
		header http.Header
		old    *endpointSpec // nil for a new endpoint
	}
	var jobs []job
	for _, base := range urls {
		// The credentials, api_key_env read now: a key rotated in the
		// environment applies at the reload.
		hdr, err := endpointHeader(*want[base], os.LookupEnv)
		if err != nil {
			return nil, fmt.Errorf("endpoint %s: %w", base, err)
		}
		ep := inForce[base]
		switch {
		case ep == nil:
			if ep, err = newEndpoint(base); err != nil {
				return nil, err
			}
			pl.added = append(pl.added, ep)
			jobs = append(jobs, job{ep: ep, header: hdr})
		case !reflect.DeepEqual(ep.spec.Load().cfg, *want[base]) || !sameHeader(ep.spec.Load().header, hdr):
			jobs = append(jobs, job{ep: ep, header: hdr, old: ep.spec.Load()})
			pl.changed = append(pl.changed, base)
		case ep.spec.Load().kvUnread || ep.spec.Load().lenUnread:
			// Its engine did not answer these reads when it was added:
			// read again (discover), its configuration unchanged.
			jobs = append(jobs, job{ep: ep, header: hdr, old: ep.spec.Load()})
		}
		st.endpoints = append(st.endpoints, ep)
	}
	// At most maxDiscoveryProbes endpoints at once, each read after read
	// on one connection: a reload of thousands of engines opens at most
	// maxDiscoveryProbes connections and starts as many goroutines, and
	// an engine that does not answer holds one worker for one
	// health_check_timeout (its first read; fleet.Unanswered stops the
	// rest) while the others go on.
	var mu sync.Mutex
	var wg sync.WaitGroup
	workers := make(chan struct{}, maxDiscoveryProbes)
	for _, j := range jobs {
		workers <- struct{}{} // freed within a health_check_timeout: the first read unanswered ends the job
		wg.Go(func() {
			defer func() { <-workers }()
			spec := g.baseSpec(j.ep, want[j.ep.name], j.header)
			var health error
			if j.old == nil {
				health = g.probeHealth(ctx, j.ep, spec) // a new endpoint's first health check
			}
			cc, checked := g.discover(ctx, j.ep, spec, want[j.ep.name], j.old, health)
			mu.Lock()
			if checked {
				pl.creds[j.ep] = cc
			}
			if j.old != nil {
				pl.specs[j.ep] = spec
			}
			mu.Unlock()
			if j.old == nil {
				j.ep.spec.Store(spec) // a new endpoint: nobody else sees it yet
				g.noteHealth(ctx, j.ep, spec, health)
			}
		})
	}
	wg.Wait()
	specOf := func(ep *endpoint) *endpointSpec {
		if s := pl.specs[ep]; s != nil {
			return s
		}
		return ep.spec.Load()
	}
	configured := map[*endpoint]bool{}
	for _, ep := range st.endpoints {
		configured[ep] = true
	}
	for _, ep := range prev.endpoints {
		if !configured[ep] {
			pl.removed = append(pl.removed, ep)
		}
	}
	return specOf, nil
}

// newEndpoint returns the endpoint of a base URL, its spec not yet set.
func newEndpoint(base string) (*endpoint, error) {
	ep := &endpoint{name: base, base: base, servedBy: []string{base}, done: make(chan struct{}), probeNow: make(chan struct{}, 1)}
	for kind := range apiKind(numPathKinds) {
		u, err := url.Parse(base + kind.path())
		if err != nil {
			return nil, fmt.Errorf("endpoint %s: %w", base, err)
		}
		ep.urls[kind] = u
	}
	ep.addr = endpointAddr(ep.urls[0]) // epp.go
	return ep, nil
}

// maxDiscoveryProbes bounds the endpoints a build probes at once (New's,
// a reload's new endpoints and those whose configuration or credentials
// changed), each with one read in flight (health, then KV capacity, then
// the model list): 64 connections. A build of 1,000 new endpoints runs
// ⌈1000/64⌉ = 16 waves of three round trips, and an engine that does not
// answer holds one worker for one health_check_timeout
// (gateway/README.md, "Health").
const maxDiscoveryProbes = 64

// baseSpec is the spec of ep's configuration w with header (its
// credentials and configured headers: endpointHeader) before discovery:
// the configured capacity and context length (0: to discover), the health
// path and the metrics page.
func (g *Gateway) baseSpec(ep *endpoint, w *EndpointConfig, header http.Header) *endpointSpec {
	s := &endpointSpec{cfg: *w, kvBlocks: w.KVBlocks, blockSize: w.BlockSize, maxModelLen: w.MaxModelLen,
		kind: w.Kind, healthPath: g.cfg.HealthCheckPath, kvEvents: w.KVEvents, header: header}
	if s.healthPath == "" {
		s.healthPath = w.Kind.Info().HealthPath
	}
	if mp := w.Kind.Info().MetricsPath; w.MetricsURL != "" {
		s.metricsURL = w.MetricsURL
	} else if mp != "" {
		s.metricsURL = ep.base + mp
	}
	return s
}

// discover completes s (baseSpec of ep's configuration w, not yet
// published): capacity and context length discovered from the engine where
// w has 0, unless old (the spec in force) has them discovered already. The
// engine's reads are sent with s.header, one after the other, and stop at
// the first the engine does not answer (fleet.Unanswered; prior is the
// error of the read made just before, the health probe of a new endpoint):
// the defaults stay; cc is what they told of the credentials, checked false when
// nothing did: a new endpoint's discovery reads (401/403: refused), and,
// when the credentials changed, GET /v1/models (which vLLM's --api-key
// guards) and the discovery reads again, sent with the new ones.
func (g *Gateway) discover(ctx context.Context, ep *endpoint, s *endpointSpec, w *EndpointConfig, old *endpointSpec, prior error) (cc credentialsCheck, checked bool) {
	header := s.header
	// With new credentials the reads are made again (those of the old
	// ones may have been refused), a failed one keeping what was known.
	newCreds := old != nil && !sameHeader(old.header, header)
	err := prior // the last read's
	if w.KVBlocks == 0 {
		// Values the engine did not answer for are read again (kvUnread).
		reuse := old != nil && old.cfg.KVBlocks == 0 && old.cfg.BlockSize == w.BlockSize && !old.kvUnread
		if reuse {
			s.kvBlocks, s.blockSize = old.kvBlocks, old.blockSize
		} else {
			s.kvBlocks, s.kvUnread = DefaultKVBlocks, true
		}
		if (!reuse || newCreds) && !fleet.Unanswered(err) {
			var c fleet.CacheConfig
			if c, err = g.prober.CacheConfig(ctx, ep.base, header); err == nil {
				s.kvBlocks, s.blockSize = c.NumGPUBlocks, c.BlockSize
			}
			s.kvUnread = s.kvUnread && fleet.Unanswered(err)
			cc.note(err)
			checked = true
		}
	}
	reuse := w.MaxModelLen == 0 && old != nil && old.cfg.MaxModelLen == 0 && !old.lenUnread
	switch {
	case reuse:
		s.maxModelLen = old.maxModelLen
	case w.MaxModelLen == 0:
		s.maxModelLen, s.lenUnread = DefaultMaxModelLen, true
	}
	if ((w.MaxModelLen == 0 && !reuse) || newCreds) && !fleet.Unanswered(err) {
		// GET /v1/models, which vLLM's --api-key guards: the check of new
		// credentials even when max_model_len is configured. A new
		// endpoint's list also tells its LoRA adapters (adapters.go;
		// nobody else sees the endpoint yet); with max_model_len
		// configured, its first refresh does.
		body, err := g.prober.ReadModels(ctx, ep.base, header)
		n := 0
		if err == nil {
			if l, perr := fleet.ParseModelList(body); perr == nil && old == nil {
				ep.models.Store(&l)
			}
			if n, err = fleet.ParseMaxModelLen(body); err != nil {
				err = fmt.Errorf("read %s%s: %w", ep.base, fleet.ModelsPath, err)
			}
		}
		if err == nil && w.MaxModelLen == 0 {
			s.maxModelLen = n
		}
		s.lenUnread = s.lenUnread && fleet.Unanswered(err)
		cc.note(err)
		cc.accepted = newCreds && err == nil
		checked = true
	}
	if cc.refused != 0 {
		cc.accepted = false
	}
	if old != nil && (old.kvUnread && !s.kvUnread || old.lenUnread && !s.lenUnread) {
		slog.Info("gateway: endpoint answered the reads it did not answer when added", "endpoint", ep.name,
			"kv_blocks", s.kvBlocks, "block_size", s.blockSize, "max_model_len", s.maxModelLen)
	}
	return cc, checked
}

// buildScrapes gives every endpoint of st its metrics scrape: prev's,
// kept while what it scrapes is the same, else a new one (started, and the
// old one stopped, at commit through pl).
func (g *Gateway) buildScrapes(st, prev *state, specOf func(*endpoint) *endpointSpec, pl *plan) error {
	for _, ep := range st.endpoints {
		spec, old := specOf(ep), prev.feeds[ep].scrape
		f := old
		if old == nil || spec.metricsURL == "" || g.cfg.ScrapeInterval < 0 || !old.scrapes(scrapeOf(ep, spec)) {
			var err error
			if f, err = g.newScrapeFeed(ep, spec); err != nil {
				return err
			}
			if old != nil {
				pl.stop = append(pl.stop, &old.loop)
			}
			if f != nil {
				pl.start = append(pl.start, func() { f.run(g) })
			}
		}
		st.feeds[ep] = feeds{scrape: f}
	}
	return nil
}

// buildPools makes st's pools, one per model in order of first appearance
// in cfg.Endpoints (buildPool), records in pl which succeed which and the
// models added and gone, and returns the models in that order.
func (g *Gateway) buildPools(cfg Config, prev *state, st *state, specOf func(*endpoint) *endpointSpec, pl *plan) ([]string, error) {
	routing := cfg.Routing
	routingChanged := prev.pools == nil || !reflect.DeepEqual(prev.cfg.Routing, routing)
	blockChanged := prev.pools == nil || prev.cfg.Routing.Prefix.BlockSize != routing.Prefix.BlockSize
	pl.policyReset = len(prev.pools) > 0 && routingChanged
	var models []string
	members := map[string][]*endpoint{}
	byBase := make(map[string]*endpoint, len(st.endpoints))
	for _, ep := range st.endpoints {
		byBase[ep.name] = ep
	}
	for _, ec := range cfg.Endpoints {
		base, _ := normalizeURL(ec.URL)
		if members[ec.Model] == nil {
			models = append(models, ec.Model)
		}
		members[ec.Model] = append(members[ec.Model], byBase[base])
	}
	if m := cfg.discoveredModel(); m != "" && members[m] == nil {
		models = append(models, m) // no engine discovered yet (or any more): a pool without endpoints
	}
	for _, model := range models {
		p, err := g.buildPool(model, members[model], prev.pools[model], cfg, routingChanged, blockChanged, specOf, st, pl)
		if err != nil {
			return nil, err
		}
		st.pools[model] = p
		if old := prev.pools[model]; old != nil {
			pl.succ[old] = p
		} else if prev.pools != nil {
			pl.modelsAdded = append(pl.modelsAdded, model)
		}
	}
	for model, p := range prev.pools {
		if st.pools[model] == nil {
			pl.gone = append(pl.gone, p.gate)
			pl.modelsGone = append(pl.modelsGone, model)
		}
	}
	slices.Sort(pl.modelsGone)
	return models, nil
}

// buildPool makes model's pool of endpoints eps (configuration order),
// reusing old (the model's pool in force, or nil) where it can: its slots,
// its admission gate and retry budget, its precise index unless the block
// size changed, its policy unless routing changed (the slots that changed
// are told to forget or resize in pl).
func (g *Gateway) buildPool(model string, eps []*endpoint, old *pool, cfg Config, routingChanged, blockChanged bool,
	specOf func(*endpoint) *endpointSpec, st *state, pl *plan) (*pool, error) {
	p := &pool{model: model, blockSize: cfg.Routing.Prefix.BlockSize, seed: prefix.Seed(model + "\x00"),
		maxRequests: cfg.CircuitBreaker.MaxRequests, gate: g.newGate(model), budget: &retryBudget{},
		renderInFlight: new(atomic.Int32)}
	var forget []int
	if old == nil {
		p.endpoints = slices.Clone(eps)
	} else {
		// The calls in flight on old count against the new pool's
		// render_concurrency: a fresh count per reload let each reload
		// within render_timeout make render_concurrency more.
		p.gate, p.budget, p.renderInFlight = old.gate, old.budget, old.renderInFlight
		limit, _ := slotLimit(cfg.Routing)
		p.endpoints, forget = reslotted(old.endpoints, eps, limit)
	}
	reslot := func(i int) bool { return slices.Contains(forget, i) }
	live, pcap, mcap := p.size(specOf, st)

	// The precise index: every endpoint publishes KV events; the model's
	// kv_store, if any, feeds its last slot.
	// A discovered model's pool without engines yet (or any more) has the
	// precise index its template's engines will feed.
	k := cfg.Discovery.Kubernetes
	waiting := len(live) == 0 && k != nil && model == k.Endpoint.Model && k.Endpoint.KVEvents != nil
	if allKVEvents(p.endpoints, specOf) || waiting {
		if s, ok := cfg.KVStores[model]; ok {
			p.store = &s
		}
		if err := p.buildPrecise(old, pcap, mcap, blockChanged, reslot, pl); err != nil {
			return nil, err
		}
		p.precisePolicy = sched.UsesPrecise(cfg.Routing)
		p.tiers = p.buildTiers(specOf)
	}
	p.pcap, p.mcap = pcap, mcap
	p.buildRoles(cfg)
	p.peers = g.peersOf()
	if err := p.buildPolicy(old, g.replicaRouting(cfg.Routing), routingChanged, reslot, pl); err != nil {
		return nil, err
	}
	policyName := p.policy.Name()
	p.none = g.metrics.route(model, "", policyName)
	for i, ep := range p.endpoints {
		p.routes[i] = p.none
		if ep != vacant {
			p.routes[i] = g.metrics.route(model, ep.name, policyName)
			if p.tiers != nil {
				g.metrics.tiered(p.routes[i])
			}
		}
	}
	if p.policy.NeedsHashes() || p.precise != nil || p.pd != nil {
		tok, err := prefix.NewTokenizer()
		if err != nil {
			return nil, fmt.Errorf("gateway: %w", err)
		}
		if g.segments == nil { // under reloadMu
			g.segments = prefix.NewSegmentCache(tok, 0)
		}
		p.tokenizer, p.segments = tok, g.segments
		if p.hf, err = g.hfTokenizer(cfg.Tokenizers[model], ggufDialect(live, specOf)); err != nil {
			return nil, fmt.Errorf("gateway: tokenizers[%q]: %w", model, err)
		}
		p.engineRender, p.renderTimeout = cfg.Render[model] == RenderEngine, cfg.RenderTimeout
		p.renderMax = int32(cfg.RenderConcurrency)
		if p.engineRender {
			p.renderHits = g.render.lookups.WithLabelValues(model, "hit")
			p.renderMisses = g.render.lookups.WithLabelValues(model, "miss")
		}
	}
	tokLabel := cfg.Tokenizers[model]
	if p.engineRender {
		tokLabel = TokenizerEngine
	}
	g.metrics.poolTokenizer(model, tokLabel, p.hf != nil || p.engineRender, p.tokenizer != nil)
	pl.gates = append(pl.gates, gateSet{a: p.gate, eps: live, limit: cfg.CircuitBreaker.MaxRequests, cfg: cfg.Admission,
		hold: scaleFromZeroFor(cfg.ScaleFromZero, model), early: old == nil})
	return p, nil
}

// hfTokenizer returns the tokenizer at path, loading it the first time
// (reloads reuse it); nil for "". A GGUF file's embedded vocabulary is read
// as dialect's engine reads it (hftokenizer.LoadGGUF). Under reloadMu.
func (g *Gateway) hfTokenizer(path, dialect string) (*hftokenizer.Tokenizer, error) {
	if path == "" {
		return nil, nil
	}
	key := path + "\x00" + dialect
	if t, ok := g.hfTokenizers[key]; ok {
		return t, nil
	}
	var (
		t   *hftokenizer.Tokenizer
		err error
	)
	if st, serr := os.Stat(path); serr == nil && !st.IsDir() && hftokenizer.IsGGUF(path) {
		t, err = hftokenizer.LoadGGUF(path, hftokenizer.GGUFOptions{Dialect: dialect})
	} else {
		t, err = hftokenizer.Load(path)
	}
	if err != nil {
		return nil, err
	}
	if g.hfTokenizers == nil {
		g.hfTokenizers = map[string]*hftokenizer.Tokenizer{}
	}
	g.hfTokenizers[key] = t
	return t, nil
}

// ggufDialect is the GGUF reading of a pool's engines: Ollama's when every
// endpoint is kind ollama (its Go engine's or its llama.cpp runner's, by
// architecture; hftokenizer.DialectOllama), else llama.cpp's (llama-server,
// and what a GGUF means anywhere else).
func ggufDialect(eps []*endpoint, specOf func(*endpoint) *endpointSpec) string {
	for _, ep := range eps {
		if sp := specOf(ep); sp == nil || sp.kind != fleet.Ollama {
			return hftokenizer.DialectLlamaCpp
		}
	}
	if len(eps) == 0 {
		return hftokenizer.DialectLlamaCpp
	}
	return hftokenizer.DialectOllama
}

// reslotted returns the slots of a pool that had olds and now has eps: an
// endpoint keeps its own slot; the new ones take the free ones first
// (forgotten first), then new slots; trailing vacant slots are dropped. It
// also returns the sorted slots whose endpoint changed (to be forgotten by
// the index and the policy). Past limit slots (slotLimit: only a policy
// without per-slot state gets there) the vacant slots are removed and the
// endpoints renumbered.
func reslotted(olds, eps []*endpoint, limit int) (slots []*endpoint, forget []int) {
	slots = slices.Clone(olds)
	stays := map[*endpoint]bool{}
	for _, ep := range eps {
		stays[ep] = true
	}
	placed := map[*endpoint]bool{}
	for i, ep := range slots {
		switch {
		case ep == vacant:
		case stays[ep]:
			placed[ep] = true
		default:
			slots[i] = vacant
			forget = append(forget, i)
		}
	}
	free := 0
	for _, ep := range eps {
		if placed[ep] {
			continue
		}
		for free < len(slots) && slots[free] != vacant {
			free++
		}
		if free == len(slots) {
			slots = append(slots, vacant)
		}
		slots[free] = ep
		forget = append(forget, free)
	}
	for len(slots) > 0 && slots[len(slots)-1] == vacant {
		slots = slots[:len(slots)-1]
	}
	if len(slots) > limit {
		// Only a policy without per-slot state serves this many
		// (Validate): the slots may be renumbered. A renumbered slot
		// names another endpoint than before: forgotten too, or the
		// precise index (fed by every endpoint's KV events whatever
		// the policy) would credit one endpoint's blocks to another.
		slots = slices.DeleteFunc(slots, func(ep *endpoint) bool { return ep == vacant })
		for i, ep := range slots {
			if i >= len(olds) || olds[i] != ep {
				forget = append(forget, i)
			}
		}
	}
	slices.Sort(forget)
	return slots, slices.Compact(forget)
}

// size sets p's per-slot capacity (prompt blocks of p's block size), route
// and scrape slices, context length and scrape flag from its endpoints'
// specs, and returns the live endpoints and each slot's bound for the
// precise index (0 without KV events) and per medium (with
// kv_events.tiers: GPU kv_blocks, CPU and DISK their tiers' blocks; else
// none).
func (p *pool) size(specOf func(*endpoint) *endpointSpec, st *state) (live []*endpoint, pcap []int, mcap [][prefix.NumMedia]int) {
	n := len(p.endpoints)
	p.capacity, p.routes, p.scrapes = make([]int, n), make([]*routeMetrics, n), make([]*scrapeFeed, n)
	pcap, mcap = make([]int, n), make([][prefix.NumMedia]int, n)
	for i, ep := range p.endpoints {
		p.capacity[i] = 1
		if ep == vacant {
			continue
		}
		live = append(live, ep)
		spec := specOf(ep)
		gpu := max(1, spec.kvBlocks*spec.blockSize/p.blockSize)
		p.capacity[i] = gpu
		if spec.kvEvents != nil {
			// The engine's blocks in all its tiers bound what the index
			// holds of it (its events may announce more: lost removals,
			// a broken or hostile engine), and what the approximate index
			// remembers of it: a prefix its GPU evicted is still a hit
			// from its host or disk tier (as virtual.NewFleet sizes it).
			pcap[i] = gpu + spec.kvEvents.offloadBlocks()
			p.capacity[i] = gpu + spec.kvEvents.offloadBlocks()*spec.blockSize/p.blockSize
			if t := spec.kvEvents.Tiers; t != nil {
				mcap[i][prefix.MediumGPU] = gpu
				mcap[i][prefix.MediumCPU] = t.CPU.blocks()
				mcap[i][prefix.MediumDisk] = t.Disk.blocks()
			}
		}
		p.maxModelLen = max(p.maxModelLen, spec.maxModelLen) // a bound wherever the request goes
		p.scrapes[i] = st.feeds[ep].scrape
		p.scraped = p.scraped || p.scrapes[i] != nil
	}
	p.live = len(live)
	return live, pcap, mcap
}

// storeSlot is the slot of p's precise index its kv_store takes: the
// last (63 while the index has one group of 64). It is p's, not the
// index's: a reload that grows the index grows it before the pool is
// published, while the pool in force still names its own last slot.
func (p *pool) storeSlot() int { return p.preciseSlots - 1 }

// preciseSlots is the size of a new precise index for n endpoint slots and
// a kv_store (store): whole groups of prefix.MaxEndpoints (at least one),
// one slot more for the store, so that endpoints added later take free
// slots without a rebuild.
func preciseSlots(n int, store bool) int {
	if store {
		n++
	}
	return max((n+prefix.MaxEndpoints-1)/prefix.MaxEndpoints*prefix.MaxEndpoints, prefix.MaxEndpoints)
}

// setMediumCapacities sets slot's per-medium bounds in ix (0: unbounded).
func setMediumCapacities(ix *prefix.PreciseIndex, slot int, mcap *[prefix.NumMedia]int) {
	for m, n := range mcap {
		ix.SetMediumCapacity(slot, prefix.Medium(m), n)
	}
}

// storeBlocks is the capacity of p's kv_store (0 when it has none).
func (p *pool) storeBlocks() int {
	if p == nil || p.store == nil {
		return 0
	}
	return p.store.Blocks
}

// buildPrecise gives p its precise prefix index: old's, unless the block
// size changed, its changed slots forgotten or re-bounded through pl, and
// grown in place (pl.grows) when the pool needs more slots than it has —
// whole groups of prefix.MaxEndpoints, the kv_store's included — so that
// the endpoints that stay keep what their engines' events said, whatever
// the pool's size (until 2026-12-05 a pool that outgrew its index got a
// new, empty one). Else a new one of preciseSlots slots bounded by pcap and
// mcap. The kv_store's slot is the index's last, bounded by its blocks: it
// moves to the new last slot when the index grows (the store's state with
// it, prefix.PreciseIndex.Move, while its stream stays), and is forgotten
// when the store's stream changes or goes.
func (p *pool) buildPrecise(old *pool, pcap []int, mcap [][prefix.NumMedia]int, blockChanged bool, reslot func(int) bool, pl *plan) error {
	n := len(p.endpoints)
	slots := preciseSlots(n, p.store != nil)
	if slots > prefix.MaxIndexEndpoints {
		what := fmt.Sprintf("%d endpoint slots", n)
		if p.store != nil {
			what += " and one for its kv_store"
		}
		return fmt.Errorf("precise prefix index for model %q: %s, at most %d in all", p.model, what, prefix.MaxIndexEndpoints)
	}
	if old != nil && old.precise != nil && !blockChanged {
		p.precise = old.precise
		size := max(old.preciseSlots, slots)
		p.preciseSlots = size
		oldSS, ss := old.preciseSlots-1, size-1
		move := ss != oldSS && old.store != nil && p.store != nil && old.store.stream() == p.store.stream()
		if size > old.preciseSlots {
			op := growOp{ix: p.precise, n: size, from: -1, model: p.model}
			if move {
				op.from, op.to, op.model = oldSS, ss, p.model
			}
			pl.grows = append(pl.grows, op)
		}
		for i := range max(n, len(old.endpoints)) {
			switch {
			case i >= n || p.endpoints[i] == vacant:
				if reslot(i) {
					pl.slots = append(pl.slots, slotOp{ix: p.precise, slot: i, forget: true, cap: -1})
				}
			case reslot(i) || i >= len(old.pcap) || pcap[i] != old.pcap[i] || i >= len(old.mcap) || mcap[i] != old.mcap[i]:
				m := mcap[i]
				pl.slots = append(pl.slots, slotOp{ix: p.precise, slot: i, forget: reslot(i), cap: pcap[i], mcap: &m})
			}
		}
		// The old store's slot, when the store goes or does not move with
		// it (an endpoint that took it had it forgotten and bounded above).
		if old.store != nil && !move && (p.store == nil || ss != oldSS) && (oldSS >= n || p.endpoints[oldSS] == vacant) {
			pl.slots = append(pl.slots, slotOp{ix: p.precise, slot: oldSS, forget: true, cap: 0})
		}
		switch {
		case p.store != nil && !move && (old.store == nil || old.store.stream() != p.store.stream()):
			pl.slots = append(pl.slots, slotOp{ix: p.precise, slot: ss, forget: true, cap: p.store.Blocks})
		case p.store != nil && (move || old.storeBlocks() != p.store.Blocks):
			pl.slots = append(pl.slots, slotOp{ix: p.precise, slot: ss, cap: p.store.Blocks})
		}
		return nil
	}
	p.preciseSlots = slots
	var err error
	if p.precise, err = prefix.NewPreciseIndex(slots, p.blockSize); err != nil {
		return fmt.Errorf("precise prefix index for model %q: %w", p.model, err)
	}
	for i := range n {
		p.precise.SetCapacity(i, pcap[i])
		if mcap[i] != ([prefix.NumMedia]int{}) {
			setMediumCapacities(p.precise, i, &mcap[i])
		}
	}
	if p.store != nil {
		p.precise.SetCapacity(p.storeSlot(), p.store.Blocks)
	}
	return nil
}

// buildTiers is what p's policy is told of its endpoints' tiers (nil when
// no endpoint has kv_events.tiers and the model has no kv_store): the
// precise index per medium, the store's slot, and each endpoint's load
// cost per tier, block_bytes / bandwidth seconds a block plus a latency
// (0 where a tier has no bandwidth: unpriced).
func (p *pool) buildTiers(specOf func(*endpoint) *endpointSpec) *sched.Tiers {
	tiered := p.store != nil
	for _, ep := range p.endpoints {
		if ep != vacant && specOf(ep).kvEvents.Tiers != nil {
			tiered = true
		}
	}
	if !tiered {
		return nil
	}
	n := len(p.endpoints)
	t := &sched.Tiers{Source: p.precise, Remote: -1,
		LoadSeconds: make([][sched.NumTiers]float64, n), Latency: make([][sched.NumTiers]float64, n)}
	if p.store != nil {
		t.Remote = p.storeSlot()
	}
	for i, ep := range p.endpoints {
		if ep == vacant {
			continue
		}
		kt := specOf(ep).kvEvents.Tiers
		price := func(m prefix.Medium, blockBytes, bw float64, lat time.Duration) {
			if bw > 0 && blockBytes > 0 {
				t.LoadSeconds[i][m] = blockBytes / bw
			}
			t.Latency[i][m] = lat.Seconds()
		}
		if kt != nil {
			for _, c := range []struct {
				m prefix.Medium
				c *KVTierConfig
			}{{prefix.MediumCPU, kt.CPU}, {prefix.MediumDisk, kt.Disk}} {
				if c.c != nil && c.c.Blocks > 0 {
					price(c.m, kt.BlockBytes, c.c.Bandwidth, c.c.Latency)
				}
			}
		}
		if s := p.store; s != nil {
			bb, bw, lat := s.BlockBytes, s.Bandwidth, s.Latency
			if kt != nil && kt.BlockBytes > 0 {
				bb = kt.BlockBytes
			}
			if kt != nil && kt.Remote != nil {
				bw, lat = kt.Remote.Bandwidth, kt.Remote.Latency
			}
			price(prefix.MediumRemote, bb, bw, lat)
		}
	}
	return t
}

// tiersOf is p's tiers (nil for a nil pool).
func (p *pool) tiersOf() *sched.Tiers {
	if p == nil {
		return nil
	}
	return p.tiers
}

// sameTiers reports whether a and b tell a policy the same.
func sameTiers(a, b *sched.Tiers) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Source == b.Source && a.Remote == b.Remote &&
		slices.Equal(a.LoadSeconds, b.LoadSeconds) && slices.Equal(a.Latency, b.Latency)
}

// buildPolicy gives p its routing policy: old's, kept unless routing
// changed, it scores with a precise index that is not the one it was
// built with, or the pool gained or lost its tiers (its changed slots
// forgotten or resized through pl, grown in place through pl.grows when
// the pool has more slots than it: sched.Grower, and told the pool's
// tiers through pl.tiers when they changed — an endpoint joined or left,
// the kv_store's slot moved, a tier's prices changed: sched.TierSetter);
// else a new one with n slots rounded up to a multiple of
// prefix.MaxEndpoints (at least 64), so that endpoints added later take
// free ones without growing it. Until 2026-12-05 a pool with tiers got a
// new policy at every change of its endpoint count (its approximate
// index, pins and sessions lost).
func (p *pool) buildPolicy(old *pool, routing sched.Config, routingChanged bool, reslot func(int) bool, pl *plan) error {
	n := len(p.endpoints)
	// Whole groups of the approximate index (prefix.Index), so that
	// endpoints added later take free slots without growing it.
	slots := max((n+prefix.MaxEndpoints-1)/prefix.MaxEndpoints*prefix.MaxEndpoints, prefix.MaxEndpoints)
	keep := old != nil && !routingChanged &&
		(p.precise == old.precise || !sched.UsesPrecise(routing)) && (p.tiers == nil) == (old.tiers == nil) &&
		(p.roles != nil) == (old.pd != nil)
	if keep && slots > old.policySlots {
		_, keep = old.policy.(sched.Grower)
		if old.pd != nil {
			_, grows := old.pd.Prefill().(sched.Grower)
			keep = keep && grows
		}
	}
	retier := !sameTiers(p.tiers, old.tiersOf())
	if keep && retier {
		_, keep = old.policy.(sched.TierSetter)
		if old.pd != nil {
			_, sets := old.pd.Prefill().(sched.TierSetter)
			keep = keep && sets
		}
	}
	if !keep {
		p.policySlots = slots
		capacity := make([]int, p.policySlots)
		for i := range capacity {
			capacity[i] = 1
		}
		copy(capacity, p.capacity)
		sp := sched.Pool{Capacity: capacity}
		if p.precise != nil {
			sp.Precise = p.precise.On(prefix.MediumGPU)
			// The monotonic clock, for profiles that age what they learn
			// (sched.ProfileConfig.SpeculativeTTL).
			start := time.Now()
			sp.Now = func() time.Duration { return time.Since(start) }
		}
		sp.Tiers = p.tiers
		if p.roles != nil { // a P/D pool: the decode profile is its policy
			pd, err := sched.NewPD(routing, sp)
			if err != nil {
				return fmt.Errorf("routing P/D for model %q: %w", p.model, err)
			}
			p.pd, p.policy = pd, pd.Decode()
			return nil
		}
		var err error
		if p.policy, err = sched.NewPolicy(routing, sp); err != nil {
			return fmt.Errorf("routing policy for model %q: %w", p.model, err)
		}
		return nil
	}
	p.policy, p.policySlots, p.pd = old.policy, max(old.policySlots, slots), old.pd
	if retier {
		pl.tiers = append(pl.tiers, tierOp{policy: p.policy.(sched.TierSetter), tiers: p.tiers})
		if p.pd != nil {
			pl.tiers = append(pl.tiers, tierOp{policy: p.pd.Prefill().(sched.TierSetter), tiers: p.tiers})
		}
	}
	if p.policySlots > old.policySlots {
		pl.grows = append(pl.grows, growOp{policy: p.policy.(sched.Grower), n: p.policySlots, from: -1, model: p.model})
		if p.pd != nil {
			pl.grows = append(pl.grows, growOp{policy: p.pd.Prefill().(sched.Grower), n: p.policySlots, from: -1, model: p.model})
		}
	}
	p.slotOps(p.policy, old, reslot, pl)
	if p.pd != nil {
		p.slotOps(p.pd.Prefill(), old, reslot, pl)
	}
	return nil
}

// slotOps records in pl what kept policy of p must forget or resize of the
// slots that changed since old.
func (p *pool) slotOps(policy sched.Policy, old *pool, reslot func(int) bool, pl *plan) {
	n := len(p.endpoints)
	_, forgets := policy.(sched.Forgetter)
	_, resizes := policy.(sched.Resizer)
	for i := range max(n, len(old.endpoints)) {
		switch {
		case i >= n || p.endpoints[i] == vacant:
			if reslot(i) && forgets {
				pl.slots = append(pl.slots, slotOp{policy: policy, slot: i, forget: true, cap: -1})
			}
		case reslot(i) || i >= len(old.capacity) || p.capacity[i] != old.capacity[i]:
			if forgets || resizes {
				c := -1
				if resizes {
					c = p.capacity[i]
				}
				pl.slots = append(pl.slots, slotOp{policy: policy, slot: i, forget: reslot(i) && forgets, cap: c})
			}
		}
	}
}

// buildKVFeeds gives every endpoint that feeds a precise index its KV-event
// subscription (kept when its kv_events did not change) and its appliers,
// one per pool.
func (g *Gateway) buildKVFeeds(st, prev *state, specOf func(*endpoint) *endpointSpec, pl *plan) error {
	targets := map[*endpoint][]feedTarget{}
	for _, model := range slices.Sorted(maps.Keys(st.pools)) {
		p := st.pools[model]
		if p.precise == nil {
			continue
		}
		for i, ep := range p.endpoints {
			if ep != vacant {
				targets[ep] = append(targets[ep], feedTarget{ix: p.precise, slot: i, model: model})
			}
		}
	}
	for _, ep := range st.endpoints {
		old := prev.feeds[ep].kv
		ts := targets[ep]
		if len(ts) == 0 {
			if old != nil {
				pl.stop, pl.detach = append(pl.stop, &old.loop), append(pl.detach, old)
			}
			continue
		}
		kc := specOf(ep).kvEvents
		f := old
		if old == nil || old.cfg != streamOf(kc) {
			var err error
			if f, err = newKVFeed(ep.name, kc); err != nil {
				return err
			}
			if old != nil {
				pl.stop, pl.detach = append(pl.stop, &old.loop), append(pl.detach, old)
			}
			pl.start = append(pl.start, func() { f.run(g) })
		}
		// Appliers: a kept feed keeps its own for the same index and slot
		// (their counters go on).
		var oldAs []*fleet.KVEventApplier
		var oldTs []feedTarget
		if f == old {
			oldAs, oldTs = old.current()
		}
		as := make([]*fleet.KVEventApplier, len(ts))
		for k, t := range ts {
			if j := slices.Index(oldTs, t); j >= 0 {
				as[k] = oldAs[j]
			} else {
				as[k] = fleet.NewKVEventApplier(t.ix, t.slot, fleet.KVSeeds(t.model))
			}
		}
		pl.feedSets[f] = feedSet{appliers: as, targets: ts, changed: f != old || !slices.Equal(ts, oldTs)}
		fe := st.feeds[ep]
		fe.kv = f
		st.feeds[ep] = fe
	}
	for _, ep := range pl.removed {
		if old := prev.feeds[ep].kv; old != nil {
			pl.detach = append(pl.detach, old) // stopped by the drain
		}
	}
	return g.buildStoreFeeds(st, prev, pl)
}

// buildStoreFeeds gives every pool with a kv_store (and a precise index)
// the subscription to the store's events (kept while its stream is the
// same) and its applier, which puts them in the store's slot.
func (g *Gateway) buildStoreFeeds(st, prev *state, pl *plan) error {
	st.stores = map[string]*kvFeed{}
	for _, model := range slices.Sorted(maps.Keys(st.pools)) {
		p := st.pools[model]
		if p.precise == nil || p.store == nil {
			continue
		}
		kc := p.store.stream()
		old := prev.stores[model]
		f := old
		if old == nil || old.cfg != kc {
			var err error
			if f, err = newKVFeed(p.store.Endpoint, &kc); err != nil {
				return fmt.Errorf("kv_stores[%q]: %w", model, err)
			}
			if old != nil {
				pl.stop, pl.detach = append(pl.stop, &old.loop), append(pl.detach, old)
			}
			pl.start = append(pl.start, func() { f.run(g) })
		}
		t := feedTarget{ix: p.precise, slot: p.storeSlot(), model: model}
		var a *fleet.KVEventApplier
		if f == old {
			if as, ts := old.current(); len(ts) == 1 && ts[0] == t {
				a = as[0]
			}
		}
		changed := a == nil
		if changed {
			a = fleet.NewStoreEventApplier(t.ix, t.slot, fleet.KVSeeds(model))
		}
		pl.feedSets[f] = feedSet{appliers: []*fleet.KVEventApplier{a}, targets: []feedTarget{t}, changed: changed}
		st.stores[model] = f
	}
	for model, old := range prev.stores {
		if st.stores[model] == nil {
			pl.stop, pl.detach = append(pl.stop, &old.loop), append(pl.detach, old)
		}
	}
	return nil
}

// buildModelList sets st's GET /v1/models answers: the list (models in
// order, then aliases and adapters, sorted by id) and each model's own, keeping the
// creation times prev gave them.
func buildModelList(st, prev *state, models []string, aliases map[string][]string) error {
	list := openai.ModelList{Object: openai.ObjectList, Data: make([]openai.Model, len(models))}
	now := time.Now().Unix()
	for i, model := range models {
		created, ok := prev.created[model]
		if !ok {
			created = now
		}
		st.created[model] = created
		list.Data[i] = openai.Model{ID: model, Object: openai.ObjectModel, Created: created, OwnedBy: "infergate", Root: model}
	}
	list.Data = append(list.Data, aliasModels(aliases, st.created, prev.created, now)...)
	list.Data = append(list.Data, adapterModels(st.adapters, st.created, prev.created, now)...)
	slices.SortFunc(list.Data, func(a, b openai.Model) int { return strings.Compare(a.ID, b.ID) })
	st.modelBodies = make(map[string][]byte, len(list.Data))
	for _, m := range list.Data {
		b, err := json.Marshal(m)
		if err != nil {
			return fmt.Errorf("gateway: encode model %q: %w", m.ID, err)
		}
		st.modelBodies[m.ID] = b
	}
	var err error
	if st.modelsBody, err = json.Marshal(list); err != nil {
		return fmt.Errorf("gateway: encode model list: %w", err)
	}
	return nil
}
