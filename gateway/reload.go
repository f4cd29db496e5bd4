package gateway

// Configuration reload (README "Reload"): `infergate serve` re-reads its
// configuration on SIGHUP and calls Reload, which builds the new pools,
// endpoints and keys beside the ones in force and publishes them with one
// atomic pointer swap. A request reads the state once, when it arrives, and
// is served by that configuration to its end (its key, its model's pool),
// except that every pick is made in its model's newest pool
// (pool.latest). Nothing the request path reads is ever changed in place:
// what survives a reload survives as the same objects, handed from the old
// state to the new one.
//
// What survives, matched by URL (endpoints) and model (pools):
//   - an endpoint whose URL stays keeps its object: readiness, ejection and
//     outlier state, in-flight counts, learnt prefill rate; a changed
//     setting (kind, kv_blocks, kv_events, metrics_url, …) replaces its
//     spec;
//   - its metrics scrape and KV-event subscription keep running (with
//     what they learnt) unless their own settings changed;
//   - a pool's endpoints keep their slots, so the policy's approximate
//     index, its session table and the precise index keep what they hold
//     for them; a removed endpoint's slot is forgotten and given to the
//     next endpoint added (so a pool never needs more slots than it has
//     had endpoints at once, and never more than prefix.MaxEndpoints for a
//     policy with an index); the indexes are made with prefix.MaxEndpoints
//     slots to begin with, so that adding endpoints never rebuilds them;
//   - a model's admission gate (queue, admitted requests) and retry
//     budget;
//   - a key's rate-limit buckets, by key name (limits changed in place:
//     auth.LimitChange), so a reload never hands a key a fresh minute,
//     and its usage counters (keyUsageVecs.of);
//   - the Responses API's affinity (Gateway.affinity), which names the
//     endpoint object, not its slot: a removed endpoint's responses are
//     not found, never sent to the endpoint that took its slot.
//
// An endpoint's credentials are part of its spec (endpointHeader, with
// api_key_env read at each build): build reads GET /v1/models with changed
// ones, and commit ejects an endpoint that refused the credentials it is
// given and ends an ejection that changed credentials, accepted, make moot
// (applyCredentials).
//
// A change of routing builds new policies (their learnt state starts
// empty); the precise index is kept unless routing.prefix.block_size
// changed. An endpoint no longer configured is drained: it gets no new
// pick, its requests in flight finish, and its health loop and feeds stop
// after the last of them (at most response_header_timeout later).
//
// A configuration that is invalid, or that fails to build (a keys file
// that does not parse, a policy that cannot be made), is refused whole:
// nothing of it is applied, the state in force stays, and the failure is
// counted and logged. Settings that cannot change without a restart (the
// listen address, TLS, timeouts, …: everything not in reloadable) keep
// their value from start; Reload reports the ones the new configuration
// changed.

import (
	"context"
	"encoding/json"
	"errors"
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
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sched"
)

// reloadable are the top-level configuration keys a reload applies. Every
// other key keeps its value from start (keepUnreloadable); a section added
// to Config is not reloaded until it is listed here and built by build.
var reloadable = map[string]bool{
	"endpoints":       true,
	"routing":         true,
	"auth":            true,
	"admission":       true,
	"circuit_breaker": true,
	"aliases":         true,
}

// state is what a reload replaces: an immutable snapshot of the pools,
// endpoints and keys of one configuration, published whole (Gateway.state)
// and read by a request with one atomic load.
type state struct {
	// cfg is the effective configuration (defaulted; the settings that
	// cannot be reloaded are those of start).
	cfg   Config
	pools map[string]*pool
	// endpoints are the configured endpoints, one per URL, in
	// configuration order.
	endpoints []*endpoint
	feeds     map[*endpoint]feeds
	keys      *keyring // nil: authentication off
	// targets are the pools a model name is served by: a model's own, an
	// alias's in fallback order (alias.go).
	targets map[string][]*pool
	// modelsBody is GET /v1/models, modelBodies each entry of it;
	// created is each model's and alias's "created" (kept across
	// reloads).
	modelsBody  []byte
	modelBodies map[string][]byte
	created     map[string]int64
}

// plan is what commit does to publish a built state: the changes to
// objects the state in force shares with the new one, which build must
// not make itself (a refused configuration changes nothing).
type plan struct {
	specs   map[*endpoint]*endpointSpec // new specs of endpoints that stay
	added   []*endpoint                 // new endpoints: health loops to start
	removed []*endpoint                 // endpoints no longer configured: to drain
	changed []string                    // endpoints whose spec changed (names)
	// creds are what build learnt of the credentials of new endpoints
	// and of endpoints whose credentials changed (applyCredentials).
	creds map[*endpoint]credentialsCheck

	start []func() // feeds to start
	stop  []*loop  // feeds replaced or no longer needed
	// feedSets are the appliers of every KV feed in the new state;
	// detach the feeds that stop or drain (no applier from the commit on).
	feedSets map[*kvFeed]feedSet
	detach   []*kvFeed
	slots    []slotOp  // per-slot updates of kept policies and precise indexes
	gates    []gateSet // admission gates to configure
	// limits are the key limit changes; keysAdded, keysRemoved,
	// keysChanged name the keys for the log.
	limits                              []auth.LimitChange
	keysAdded, keysRemoved, keysChanged []string
	// succ are the pools in force whose model stays, each with the pool
	// that replaces it; gone are the gates of models removed.
	succ           map[*pool]*pool
	gone           []*admission
	modelsAdded    []string
	modelsGone     []string
	policyReset    bool // routing changed: new policies
	authSwitched   bool // authentication was turned on or off
	aliasesChanged bool
}

// feedSet is a KV feed's appliers and their targets.
type feedSet struct {
	appliers []*fleet.KVEventApplier
	targets  []feedTarget
}

// slotOp updates slot of a kept policy (policy non-nil) or precise index
// (ix non-nil): forget what it holds (another endpoint takes it, or none),
// and/or set its capacity (cap ≥ 0).
type slotOp struct {
	policy sched.Policy
	ix     *prefix.PreciseIndex
	slot   int
	forget bool
	cap    int
}

// gateSet is an admission gate's configuration in the new state; early
// gates (new models) are configured before the state is published.
type gateSet struct {
	a     *admission
	eps   []*endpoint
	limit int
	cfg   AdmissionConfig
	early bool
}

// Reload applies cfg to the running gateway (see the package comment of
// reload.go and README "Reload"): keys, limits, endpoints, routing,
// admission and circuit-breaker settings take effect for the requests that
// arrive after it returns, without dropping any; settings that need a
// restart keep their value (logged). An invalid cfg is refused whole and
// the error returned; the configuration in force stays. Reloads are
// serialised; Reload after Close or during a shutdown is refused.
func (g *Gateway) Reload(cfg Config) error {
	return g.ReloadWith(func() (Config, error) { return cfg, nil })
}

// ReloadWith is Reload of the configuration load returns; a load error is a
// failed reload like an invalid configuration (counted, logged).
func (g *Gateway) ReloadWith(load func() (Config, error)) error {
	g.reloadMu.Lock()
	defer g.reloadMu.Unlock()
	if err := g.reload(load); err != nil {
		g.reloads.failed()
		slog.Error("gateway: configuration reload refused; the configuration in force stays", "err", err)
		return err
	}
	g.reloads.success.Inc()
	g.reloads.succeeded(time.Now())
	return nil
}

// reload loads, checks, builds and commits a configuration (reloadMu held).
func (g *Gateway) reload(load func() (Config, error)) error {
	switch {
	case g.loops.Err() != nil:
		return errors.New("gateway: closed")
	case g.draining.Load():
		return errors.New("gateway: shutting down")
	}
	cfg, err := load()
	if err != nil {
		return err
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	prev := g.state.Load()
	kept := keepUnreloadable(&cfg, prev.cfg)
	if len(kept) > 0 {
		if err := cfg.Validate(); err != nil {
			return fmt.Errorf("with %s kept as at start (a restart changes them): %w", strings.Join(kept, ", "), err)
		}
	}
	st, pl, err := g.build(g.loops, cfg, prev)
	if err != nil {
		return err
	}
	g.commit(st, pl, prev)
	attrs := []any{"endpoints", len(st.endpoints), "models", len(st.pools)}
	for _, f := range []struct {
		key  string
		list []string
	}{
		{"endpoints_added", names(pl.added)}, {"endpoints_removed", names(pl.removed)}, {"endpoints_changed", pl.changed},
		{"models_added", pl.modelsAdded}, {"models_removed", pl.modelsGone},
		{"keys_added", pl.keysAdded}, {"keys_removed", pl.keysRemoved}, {"keys_changed", pl.keysChanged},
	} {
		if len(f.list) > 0 {
			attrs = append(attrs, f.key, strings.Join(f.list, ","))
		}
	}
	if pl.policyReset {
		attrs = append(attrs, "policy", st.cfg.Routing.Policy, "policy_state", "reset")
	}
	if pl.aliasesChanged {
		attrs = append(attrs, "aliases", "changed")
	}
	slog.Info("gateway: configuration reloaded", attrs...)
	if len(kept) > 0 {
		slog.Warn("gateway: configuration reload: settings that need a restart were changed and are not applied",
			"settings", strings.Join(kept, ","))
	}
	if pl.authSwitched {
		slog.Warn("gateway: configuration reload turned authentication " + map[bool]string{true: "on", false: "off"}[st.keys != nil])
	}
	if pl.authSwitched || prev.cfg.Auth.ProtectMetrics != st.cfg.Auth.ProtectMetrics {
		warnOpenUsage(st)
	}
	return nil
}

// warnOpenUsage warns when API keys are on and /metrics and
// /dashboard/state.json are not protected: anyone who reaches the gateway
// reads the keys' names and each key's usage (infergate_key_*_total{key}).
// Open is the default so that a Prometheus without a key can scrape; the
// warning makes the exposure a choice.
func warnOpenUsage(st *state) {
	if st.keys != nil && !st.cfg.Auth.ProtectMetrics {
		slog.Warn("gateway: API keys are on and /metrics and /dashboard/state.json are open: key names and per-key usage " +
			"are readable without a key; set auth.protect_metrics to require one")
	}
}

func names(eps []*endpoint) []string {
	out := make([]string, len(eps))
	for i, ep := range eps {
		out[i] = ep.name
	}
	return out
}

// keepUnreloadable sets every top-level key of cfg that is not reloadable
// to its value in old, and returns the YAML names of those that differed.
func keepUnreloadable(cfg *Config, old Config) []string {
	var kept []string
	var walk func(dst, src reflect.Value)
	walk = func(dst, src reflect.Value) {
		t := dst.Type()
		for i := range t.NumField() {
			f := t.Field(i)
			if !f.IsExported() {
				continue
			}
			name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
			if opts == "inline" {
				walk(dst.Field(i), src.Field(i))
				continue
			}
			if reloadable[name] {
				continue
			}
			if !reflect.DeepEqual(dst.Field(i).Interface(), src.Field(i).Interface()) {
				kept = append(kept, name)
				dst.Field(i).Set(src.Field(i))
			}
		}
	}
	walk(reflect.ValueOf(cfg).Elem(), reflect.ValueOf(old))
	return kept
}

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

	// Endpoints: one per URL, the first entry's settings, the largest
	// max_model_len.
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
			return nil, nil, fmt.Errorf("endpoint %s: %w", base, err)
		}
		ep := inForce[base]
		switch {
		case ep == nil:
			if ep, err = newEndpoint(base); err != nil {
				return nil, nil, err
			}
			pl.added = append(pl.added, ep)
			jobs = append(jobs, job{ep: ep, header: hdr})
		case !reflect.DeepEqual(ep.spec.Load().cfg, *want[base]) || !sameHeader(ep.spec.Load().header, hdr):
			jobs = append(jobs, job{ep: ep, header: hdr, old: ep.spec.Load()})
			pl.changed = append(pl.changed, base)
		}
		st.endpoints = append(st.endpoints, ep)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, j := range jobs {
		wg.Go(func() {
			spec, cc, checked := g.makeSpec(ctx, j.ep, want[j.ep.name], j.header, j.old)
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
				g.checkHealth(ctx, j.ep)
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

	// Scrapes: kept while what they scrape is the same.
	for _, ep := range st.endpoints {
		spec, old := specOf(ep), prev.feeds[ep].scrape
		f := old
		if old == nil || spec.metricsURL == "" || g.cfg.ScrapeInterval < 0 || !old.scrapes(scrapeOf(ep, spec)) {
			var err error
			if f, err = g.newScrapeFeed(ep, spec); err != nil {
				return nil, nil, err
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

	// Pools, in order of first appearance.
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
	for _, model := range models {
		p, err := g.buildPool(model, members[model], prev.pools[model], cfg, routingChanged, blockChanged, specOf, st, pl)
		if err != nil {
			return nil, nil, err
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

	if err := g.buildKVFeeds(st, prev, specOf, pl); err != nil {
		return nil, nil, err
	}

	// The names served (models and aliases), GET /v1/models, then the
	// keys (whose lists are filtered from it).
	var err error
	if st.targets, err = buildTargets(st.pools, cfg.Aliases); err != nil {
		return nil, nil, err
	}
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
	list.Data = append(list.Data, aliasModels(cfg.Aliases, st.created, prev.created, now)...)
	slices.SortFunc(list.Data, func(a, b openai.Model) int { return strings.Compare(a.ID, b.ID) })
	st.modelBodies = make(map[string][]byte, len(list.Data))
	for _, m := range list.Data {
		b, err := json.Marshal(m)
		if err != nil {
			return nil, nil, fmt.Errorf("gateway: encode model %q: %w", m.ID, err)
		}
		st.modelBodies[m.ID] = b
	}
	if st.modelsBody, err = json.Marshal(list); err != nil {
		return nil, nil, fmt.Errorf("gateway: encode model list: %w", err)
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

// newEndpoint returns the endpoint of a base URL, its spec not yet set.
func newEndpoint(base string) (*endpoint, error) {
	ep := &endpoint{name: base, base: base, servedBy: []string{base}, done: make(chan struct{})}
	for kind := range apiKind(numPathKinds) {
		u, err := url.Parse(base + kind.path())
		if err != nil {
			return nil, fmt.Errorf("endpoint %s: %w", base, err)
		}
		ep.urls[kind] = u
	}
	return ep, nil
}

// makeSpec is the spec of ep's configuration w with header (its
// credentials and configured headers: endpointHeader): capacity and context
// length discovered from the engine where w has 0, unless old (the spec in
// force) has them discovered already. The engine's reads are sent with
// header; cc is what they told of it, checked false when nothing did: a
// new endpoint's discovery reads (401/403: refused), and, when the
// credentials changed, GET /v1/models (which vLLM's --api-key guards) and
// the discovery reads again, sent with the new ones.
func (g *Gateway) makeSpec(ctx context.Context, ep *endpoint, w *EndpointConfig, header http.Header, old *endpointSpec) (s *endpointSpec, cc credentialsCheck, checked bool) {
	s = &endpointSpec{cfg: *w, kvBlocks: w.KVBlocks, blockSize: w.BlockSize, maxModelLen: w.MaxModelLen,
		kind: w.Kind, healthPath: g.cfg.HealthCheckPath, kvEvents: w.KVEvents, header: header}
	if s.healthPath == "" {
		s.healthPath = w.Kind.Info().HealthPath
	}
	if mp := w.Kind.Info().MetricsPath; w.MetricsURL != "" {
		s.metricsURL = w.MetricsURL
	} else if mp != "" {
		s.metricsURL = ep.base + mp
	}
	// With new credentials the reads are made again (those of the old
	// ones may have been refused), a failed one keeping what was known.
	newCreds := old != nil && !sameHeader(old.header, header)
	if w.KVBlocks == 0 {
		reuse := old != nil && old.cfg.KVBlocks == 0 && old.cfg.BlockSize == w.BlockSize
		if reuse {
			s.kvBlocks, s.blockSize = old.kvBlocks, old.blockSize
		} else {
			s.kvBlocks = DefaultKVBlocks
		}
		if !reuse || newCreds {
			c, err := g.fetchCacheConfig(ctx, ep.base, header)
			if err == nil {
				s.kvBlocks, s.blockSize = c.numGPUBlocks, c.blockSize
			}
			cc.note(err)
			checked = true
		}
	}
	reuse := w.MaxModelLen == 0 && old != nil && old.cfg.MaxModelLen == 0
	switch {
	case reuse:
		s.maxModelLen = old.maxModelLen
	case w.MaxModelLen == 0:
		s.maxModelLen = DefaultMaxModelLen
	}
	if (w.MaxModelLen == 0 && !reuse) || newCreds {
		// GET /v1/models, which vLLM's --api-key guards: the check of new
		// credentials even when max_model_len is configured.
		n, err := g.fetchMaxModelLen(ctx, ep.base, header)
		if err == nil && w.MaxModelLen == 0 {
			s.maxModelLen = n
		}
		cc.note(err)
		cc.accepted = newCreds && err == nil
		checked = true
	}
	if cc.refused != 0 {
		cc.accepted = false
	}
	return s, cc, checked
}

// buildPool makes model's pool of endpoints eps (configuration order),
// reusing old (the model's pool in force, or nil) where it can.
func (g *Gateway) buildPool(model string, eps []*endpoint, old *pool, cfg Config, routingChanged, blockChanged bool,
	specOf func(*endpoint) *endpointSpec, st *state, pl *plan) (*pool, error) {
	block := cfg.Routing.Prefix.BlockSize
	p := &pool{model: model, blockSize: block, seed: prefix.Seed(model + "\x00"),
		maxRequests: cfg.CircuitBreaker.MaxRequests, gate: g.newGate(model), budget: &retryBudget{}}

	// Slots: an endpoint keeps its own; the new ones take the free ones
	// first (forgotten first), then new slots.
	var forget []int
	if old == nil {
		p.endpoints = slices.Clone(eps)
	} else {
		p.gate, p.budget = old.gate, old.budget
		p.endpoints = slices.Clone(old.endpoints)
		stays := map[*endpoint]bool{}
		for _, ep := range eps {
			stays[ep] = true
		}
		placed := map[*endpoint]bool{}
		for i, ep := range p.endpoints {
			switch {
			case ep == vacant:
			case stays[ep]:
				placed[ep] = true
			default:
				p.endpoints[i] = vacant
				forget = append(forget, i)
			}
		}
		free := 0
		for _, ep := range eps {
			if placed[ep] {
				continue
			}
			for free < len(p.endpoints) && p.endpoints[free] != vacant {
				free++
			}
			if free == len(p.endpoints) {
				p.endpoints = append(p.endpoints, vacant)
			}
			p.endpoints[free] = ep
			forget = append(forget, free)
		}
		for len(p.endpoints) > 0 && p.endpoints[len(p.endpoints)-1] == vacant {
			p.endpoints = p.endpoints[:len(p.endpoints)-1]
		}
		if len(p.endpoints) > prefix.MaxEndpoints {
			// Only a policy without per-slot state serves this many
			// (Validate): the slots may be renumbered.
			p.endpoints = slices.DeleteFunc(p.endpoints, func(ep *endpoint) bool { return ep == vacant })
		}
		slices.Sort(forget)
		forget = slices.Compact(forget)
	}
	n := len(p.endpoints)
	p.capacity, p.routes, p.scrapes = make([]int, n), make([]*routeMetrics, n), make([]*scrapeFeed, n)
	pcap := make([]int, n)
	var live []*endpoint
	for i, ep := range p.endpoints {
		p.capacity[i] = 1
		if ep == vacant {
			continue
		}
		live = append(live, ep)
		spec := specOf(ep)
		p.capacity[i] = max(1, spec.kvBlocks*spec.blockSize/block)
		if spec.kvEvents != nil {
			// The engine's blocks in all its tiers bound what the index
			// holds of it (its events may announce more: lost removals,
			// a broken or hostile engine).
			pcap[i] = p.capacity[i] + spec.kvEvents.OffloadBlocks
		}
		p.maxModelLen = max(p.maxModelLen, spec.maxModelLen) // a bound wherever the request goes
		p.scrapes[i] = st.feeds[ep].scrape
		p.scraped = p.scraped || p.scrapes[i] != nil
	}
	p.live = len(live)
	reslot := func(i int) bool { return slices.Contains(forget, i) }

	// The precise index: every endpoint publishes KV events.
	if allKVEvents(p.endpoints, specOf) {
		if old != nil && old.precise != nil && !blockChanged {
			p.precise = old.precise
			for i := range max(n, len(old.endpoints)) {
				switch {
				case i >= n || p.endpoints[i] == vacant:
					if reslot(i) {
						pl.slots = append(pl.slots, slotOp{ix: p.precise, slot: i, forget: true, cap: -1})
					}
				case reslot(i) || i >= len(old.pcap) || pcap[i] != old.pcap[i]:
					pl.slots = append(pl.slots, slotOp{ix: p.precise, slot: i, forget: reslot(i), cap: pcap[i]})
				}
			}
		} else {
			if n > prefix.MaxEndpoints {
				return nil, fmt.Errorf("precise prefix index for model %q: %d endpoints, at most %d", model, n, prefix.MaxEndpoints)
			}
			var err error
			if p.precise, err = prefix.NewPreciseIndex(prefix.MaxEndpoints, block); err != nil {
				return nil, fmt.Errorf("precise prefix index for model %q: %w", model, err)
			}
			for i := range n {
				p.precise.SetCapacity(i, pcap[i])
			}
		}
		p.precisePolicy = sched.UsesPrecise(cfg.Routing)
	}
	p.pcap = pcap

	// The policy: kept unless routing changed, or it scores with a
	// precise index that is not the one it was built with.
	keep := old != nil && !routingChanged && n <= old.policySlots &&
		(p.precise == old.precise || !sched.UsesPrecise(cfg.Routing))
	if keep {
		p.policy, p.policySlots = old.policy, old.policySlots
		_, forgets := p.policy.(sched.Forgetter)
		_, resizes := p.policy.(sched.Resizer)
		for i := range max(n, len(old.endpoints)) {
			switch {
			case i >= n || p.endpoints[i] == vacant:
				if reslot(i) && forgets {
					pl.slots = append(pl.slots, slotOp{policy: p.policy, slot: i, forget: true, cap: -1})
				}
			case reslot(i) || i >= len(old.capacity) || p.capacity[i] != old.capacity[i]:
				if forgets || resizes {
					c := -1
					if resizes {
						c = p.capacity[i]
					}
					pl.slots = append(pl.slots, slotOp{policy: p.policy, slot: i, forget: reslot(i) && forgets, cap: c})
				}
			}
		}
	} else {
		// Built with prefix.MaxEndpoints slots: endpoints added later
		// take free ones without a rebuild.
		p.policySlots = max(n, prefix.MaxEndpoints)
		capacity := make([]int, p.policySlots)
		for i := range capacity {
			capacity[i] = 1
		}
		copy(capacity, p.capacity)
		sp := sched.Pool{Capacity: capacity}
		if p.precise != nil {
			sp.Precise = p.precise.On(prefix.MediumGPU)
		}
		var err error
		if p.policy, err = sched.NewPolicy(cfg.Routing, sp); err != nil {
			return nil, fmt.Errorf("routing policy for model %q: %w", model, err)
		}
	}
	policyName := p.policy.Name()
	p.none = g.metrics.route(model, "", policyName)
	for i, ep := range p.endpoints {
		p.routes[i] = p.none
		if ep != vacant {
			p.routes[i] = g.metrics.route(model, ep.name, policyName)
		}
	}
	if p.policy.NeedsHashes() || p.precise != nil {
		tok, err := prefix.NewTokenizer()
		if err != nil {
			return nil, fmt.Errorf("gateway: %w", err)
		}
		if g.segments == nil { // under reloadMu
			g.segments = prefix.NewSegmentCache(tok, 0)
		}
		p.tokenizer, p.segments = tok, g.segments
	}
	pl.gates = append(pl.gates, gateSet{a: p.gate, eps: live, limit: cfg.CircuitBreaker.MaxRequests, cfg: cfg.Admission, early: old == nil})
	return p, nil
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
		if old == nil || !reflect.DeepEqual(old.cfg, *kc) {
			var err error
			if f, err = newKVFeed(ep, kc); err != nil {
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
		pl.feedSets[f] = feedSet{appliers: as, targets: ts}
		fe := st.feeds[ep]
		fe.kv = f
		st.feeds[ep] = fe
	}
	for _, ep := range pl.removed {
		if old := prev.feeds[ep].kv; old != nil {
			pl.detach = append(pl.detach, old) // stopped by the drain
		}
	}
	return nil
}

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
			gs.a.update(gs.eps, gs.limit, gs.cfg)
		}
	}

	g.state.Store(st)
	for old, p := range pl.succ {
		old.next.Store(p)
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
			gs.a.update(gs.eps, gs.limit, gs.cfg)
		}
	}
	g.setHooks(st)
	// The feeds' appliers change before the slots they leave are
	// forgotten: setAppliers waits for a batch in progress.
	for _, f := range pl.detach {
		f.setAppliers(nil, nil)
	}
	for f, fs := range pl.feedSets {
		f.setAppliers(fs.appliers, fs.targets)
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
		case op.policy != nil && op.cap >= 0:
			if r, ok := op.policy.(sched.Resizer); ok {
				r.SetCapacity(op.slot, op.cap)
			}
		}
	}

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
		for i, ep := range p.endpoints {
			if ep == vacant {
				continue
			}
			gates[ep] = append(gates[ep], p.gate)
			if forgets {
				hooks[ep] = append(hooks[ep], func() { f.Forget(i) })
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

// startEndpoint starts ep's health loop.
func (g *Gateway) startEndpoint(ep *endpoint) {
	ctx, cancel := context.WithCancel(g.loops)
	ep.stop = cancel
	g.wg.Go(func() {
		defer close(ep.done)
		g.healthLoop(ctx, ep)
	})
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

// reloadMetrics count reloads, as Prometheus and Alertmanager name theirs.
type reloadMetrics struct {
	success, failure prometheus.Counter
	lastSuccess      prometheus.Gauge // unix seconds
	lastOK           prometheus.Gauge // 1 or 0
}

func newReloadMetrics(reg prometheus.Registerer) (*reloadMetrics, error) {
	total := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "config_reloads_total",
		Help: "Configuration reloads (SIGHUP) by result: success, or failure (the new configuration was refused; the one in force stays)."},
		[]string{"result"})
	m := &reloadMetrics{
		success: total.WithLabelValues("success"),
		failure: total.WithLabelValues("failure"),
		lastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "infergate", Name: "config_last_reload_success_timestamp_seconds",
			Help: "When the configuration in force was loaded: at start or by the last successful reload (unix seconds)."}),
		lastOK: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "infergate", Name: "config_last_reload_successful",
			Help: "1 if the last configuration load (start or reload) succeeded, 0 if the last reload was refused."}),
	}
	for _, c := range []prometheus.Collector{total, m.lastSuccess, m.lastOK} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("gateway: register reload metrics: %w", err)
		}
	}
	return m, nil
}

// succeeded records a successful load at now (start or reload). A start is
// not counted in config_reloads_total.
func (m *reloadMetrics) succeeded(now time.Time) {
	m.lastSuccess.Set(float64(now.UnixNano()) / 1e9)
	m.lastOK.Set(1)
}

func (m *reloadMetrics) failed() {
	m.failure.Inc()
	m.lastOK.Set(0)
}
