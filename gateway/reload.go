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
//     had endpoints at once, and never more than prefix.MaxIndexEndpoints
//     for a policy with an index); the indexes have whole groups of
//     prefix.MaxEndpoints slots (at least one), and a pool that outgrows
//     them grows them in place by whole groups (growOp, before the swap):
//     the endpoints that stay keep what the indexes hold for them, the
//     new ones start empty, and the kv_store's slot, the precise index's
//     last, moves to the new last with what it holds (README "Reload",
//     "What a reload keeps of the indexes"); a slot changes hands with the
//     KV feeds whose appliers change held (commit), so the leaving
//     engine's events all land before its forget and the arriving one's
//     after it;
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
// changed. A change of an endpoint's kv_events.tiers or of a kv_stores
// entry re-bounds the index's slots and tells the kept policy the pool's
// new tier prices (tierOp; a pool that gains or loses its tiers gets a new
// policy); the KV feeds stay unless their stream changed. An
// endpoint no longer configured is drained: it gets no new
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
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"reflect"
	"strings"
	"time"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/fleet"
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
	"adapters":        true,
	"kv_stores":       true,
	// discovery: its template and model apply at a reload; what is
	// watched is the caller's (cmd/infergate) to restart.
	"discovery": true,
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
	// stores are the KV-event feeds of the models' kv_stores, by model.
	stores map[string]*kvFeed
	keys   *keyring // nil: authentication off
	// targets are the pools a model name is served by: a model's own, an
	// alias's in fallback order (alias.go).
	targets map[string][]*pool
	// adapters are the LoRA adapters served, each with its base model
	// (adapters.go); targets has each one's base pool.
	adapters map[string]string
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
	grows    []growOp  // kept policies and precise indexes to grow, before the swap
	tiers    []tierOp  // kept policies told their pool's tiers, after the grows, before the swap
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

// feedSet is a KV feed's appliers and their targets; changed when they
// are not the feed's in force (a new feed, or a kept one that gains or
// loses a target).
type feedSet struct {
	appliers []*fleet.KVEventApplier
	targets  []feedTarget
	changed  bool
}

// heldFeeds are the KV feeds commit holds while slots change hands: those
// it detaches and those whose appliers change, each once.
func (pl *plan) heldFeeds() []*kvFeed {
	var held []*kvFeed
	seen := map[*kvFeed]bool{}
	hold := func(f *kvFeed) {
		if !seen[f] {
			seen[f] = true
			held = append(held, f)
		}
	}
	for _, f := range pl.detach {
		hold(f)
	}
	for f, fs := range pl.feedSets {
		if fs.changed {
			hold(f)
		}
	}
	return held
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
	// mcap, when set, is the slot's new per-medium bounds (ix only;
	// 0: unbounded).
	mcap *[prefix.NumMedia]int
}

// growOp grows a kept precise index (ix non-nil) or policy (policy
// non-nil) in place to n slots, before the state that uses them is
// published (growing only adds slots the state in force does not name).
// With from ≥ 0 (ix only) the kv_store of model's pool moves from slot
// from, the old last, to to, the new last (prefix.PreciseIndex.Move), its
// feed held meanwhile so that no batch lands on either slot.
type growOp struct {
	ix       *prefix.PreciseIndex
	policy   sched.Grower
	n        int
	from, to int
	model    string
}

// tierOp tells a kept policy its pool's new tiers (sched.TierSetter).
type tierOp struct {
	policy sched.TierSetter
	tiers  *sched.Tiers
}

// gateSet is an admission gate's configuration in the new state; early
// gates (new models) are configured before the state is published.
type gateSet struct {
	a     *admission
	eps   []*endpoint
	limit int
	cfg   AdmissionConfig
	hold  ScaleFromZeroConfig
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

// rebuildSoon asks the rebuilder for a rebuild of the state from the
// configuration in force (coalesced: one pending at most): when an
// endpoint's model list changed (adapters.go), and at an endpoint's first
// passed health check when its engine did not answer the reads of its KV
// capacity or context length when it was added (health.go).
func (g *Gateway) rebuildSoon() {
	select {
	case g.rebuildReq <- struct{}{}:
	default:
	}
}

// runRebuilds rebuilds the state each time rebuildSoon asked, until the
// gateway closes.
func (g *Gateway) runRebuilds() {
	g.wg.Go(func() {
		for {
			select {
			case <-g.loops.Done():
				return
			case <-g.rebuildReq:
			}
			if err := g.rebuildInForce(); err != nil {
				slog.Warn("gateway: state not rebuilt (LoRA adapters, engines' capacities); the state in force stays", "err", err)
			}
		}
	})
}

// rebuildInForce rebuilds the state from the configuration in force, so
// that the adapters the endpoints now list are routed and the capacities
// engines did not answer for are read (build reuses everything else: no
// other endpoint is probed again, pools keep their indexes, policies and
// queues). It is a reload of the same configuration, not
// counted as one; API keys are read again like at any reload.
func (g *Gateway) rebuildInForce() error {
	g.reloadMu.Lock()
	defer g.reloadMu.Unlock()
	switch {
	case g.loops.Err() != nil:
		return errors.New("gateway: closed")
	case g.draining.Load():
		return nil // shutting down: nothing new is routed
	}
	prev := g.state.Load()
	st, pl, err := g.build(g.loops, prev.cfg, prev)
	if err != nil {
		return err
	}
	g.commit(st, pl, prev)
	if !maps.Equal(prev.adapters, st.adapters) {
		slog.Info("gateway: LoRA adapters updated", "adapters", len(st.adapters))
	}
	return nil
}
