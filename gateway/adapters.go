package gateway

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/sched"
)

// LoRA adapters behind the gateway. An engine that serves a base model can
// serve LoRA adapters of it (vLLM --enable-lora --lora-modules, or loaded
// at run time with /v1/load_lora_adapter); a request names the adapter as
// its model. The gateway learns which adapter runs on which base model
// from configuration,
//
//	adapters:
//	  meta-llama/Llama-3.1-8B-Instruct: [sql-lora, chat-lora]
//
// and from each endpoint's GET /v1/models, where vLLM lists every adapter
// with its base model as `parent` (fleet.ModelList; read when the endpoint
// is added and every models_refresh_interval after). A request for an
// adapter is served by its base model's pool:
//
//   - the body is sent unchanged (the engine needs the adapter's name; an
//     alias's model splice is not made), and metrics name the base model;
//   - the candidates are the pool's endpoints that list the adapter in
//     their model list, or all of them where the list is unknown
//     (sched.Endpoint.Models; a hard constraint the gateway applies for
//     every policy, ruleOut);
//   - sched.Request.Adapter names it, so the lora scorer and the
//     adapter-capacity filter weigh the adapters each engine has running
//     or waiting (vllm:lora_requests_info, scraped: Endpoint.Adapters and
//     MaxAdapters = max_lora);
//   - its prompt is hashed from the root seed prefix.Seed(adapter + "\x00"
//     + cache_salt), not the base model's, so neither prefix index ever
//     matches an adapter's blocks for the base model or another adapter:
//     vLLM puts the adapter in every block hash's extra keys
//     (vllm/v1/core/kv_cache_utils.py generate_block_hash_extra_keys →
//     _gen_lora_extra_hash_keys: the adapter's lora_int_id in early V1
//     versions, its lora_name since), and the precise index keys
//     an engine's blocks by the lora_name of its KV events the same way
//     (fleet.KVSeeds).
//
// A model name that is neither configured, nor an alias, nor an adapter is
// 404 model_not_found as before. An adapter named like a configured model
// is that model's (a pool of its own, as before adapters were known; it
// still scores residency, pool.adapter). GET /v1/models lists the adapters
// with their parent. When an endpoint's list changes (an adapter loaded or
// unloaded), the state is rebuilt from the configuration in force, as a
// reload with nothing changed would (rebuildInForce): pools, indexes and
// queues are kept.

// maxAdapterNames bounds the adapters configured per base model.
const maxAdapterNames = fleet.MaxListedModels

// validateAdapters checks adapters against the configured models and
// aliases.
func (c Config) validateAdapters() []error {
	var errs []error
	models := map[string]bool{}
	for _, e := range c.Endpoints {
		models[e.Model] = true
	}
	if m := c.discoveredModel(); m != "" {
		models[m] = true
	}
	seen := map[string]string{}
	for _, base := range slices.Sorted(maps.Keys(c.Adapters)) {
		names := c.Adapters[base]
		at := fmt.Sprintf("adapters[%q]", base)
		switch {
		case !models[base]:
			errs = append(errs, fmt.Errorf("%s: model %q is served by no endpoint (adapters are listed under their base model)", at, base))
		case len(names) == 0 || len(names) > maxAdapterNames:
			errs = append(errs, fmt.Errorf("%s: want 1 to %d adapters, got %d", at, maxAdapterNames, len(names)))
		}
		for _, a := range names {
			switch {
			case a == "" || len(a) > fleet.MaxModelIDBytes:
				errs = append(errs, fmt.Errorf("%s: an adapter name must be 1 to %d bytes", at, fleet.MaxModelIDBytes))
			case models[a]:
				errs = append(errs, fmt.Errorf("%s: %q is a configured model; an adapter needs a name of its own", at, a))
			case c.Aliases[a] != nil:
				errs = append(errs, fmt.Errorf("%s: %q is an alias; an adapter needs a name of its own", at, a))
			case seen[a] != "":
				errs = append(errs, fmt.Errorf("%s: adapter %q is also listed under %q", at, a, seen[a]))
			}
			if seen[a] == "" {
				seen[a] = base
			}
		}
	}
	return errs
}

// buildAdapters sets st.adapters (adapter → base model: cfg's, then those
// the pools' endpoints list with a pool's model as parent, first model in
// name order winning a name two claim) and each pool's served (per slot,
// the names its engine lists: sched.Endpoint.Models) and adapter. Names of
// configured models and aliases are never adapters. It reads the model
// lists the endpoints last read (endpoint.models).
func (g *Gateway) buildAdapters(st *state, cfg Config) {
	st.adapters = map[string]string{}
	taken := func(name string) bool {
		return st.pools[name] != nil || cfg.Aliases[name] != nil || st.adapters[name] != ""
	}
	for _, base := range slices.Sorted(maps.Keys(cfg.Adapters)) {
		if st.pools[base] == nil {
			continue // validated; defensive
		}
		for _, a := range cfg.Adapters[base] {
			if !taken(a) {
				st.adapters[a] = base
			}
		}
	}
	for _, model := range slices.Sorted(maps.Keys(st.pools)) {
		p := st.pools[model]
		p.adapter, p.served = "", nil
		for _, ep := range p.endpoints {
			l := listOf(ep)
			if l == nil {
				continue
			}
			for _, a := range l.Adapters {
				switch {
				case a.Name == model:
					p.adapter = model // an adapter configured as a model of its own
				case a.Parent == model && !taken(a.Name):
					st.adapters[a.Name] = model
				}
			}
		}
	}
	// Each pool's engines' served names, where the pool has adapters, and
	// its placement counters (resolved once: the pick path does no label
	// lookup).
	has := map[string]bool{}
	for _, base := range st.adapters {
		has[base] = true
	}
	for model, p := range st.pools {
		if has[model] || p.adapter != "" {
			for k, name := range placements {
				p.loraPicks[k] = g.metrics.loraPicks.WithLabelValues(model, name)
			}
		}
		if !has[model] {
			continue
		}
		p.served = make([][]string, len(p.endpoints))
		for i, ep := range p.endpoints {
			l := listOf(ep)
			if l == nil {
				continue // unknown: every adapter of the pool
			}
			names := []string{model}
			for _, m := range l.IDs {
				if st.adapters[m] == model {
					names = append(names, m)
				}
			}
			slices.Sort(names) // searched by serves and sched's model filter
			p.served[i] = slices.Compact(names)
		}
	}
}

// listOf is the model list ep last read, nil when none was read (or ep is
// a vacant slot).
func listOf(ep *endpoint) *fleet.ModelList {
	if ep == vacant {
		return nil
	}
	return ep.models.Load()
}

// adapterModels are the /v1/models entries of st's adapters: root the
// adapter, parent its base model, created as the model list keeps it
// (created, prev) or now.
func adapterModels(adapters map[string]string, created, prev map[string]int64, now int64) []openai.Model {
	out := make([]openai.Model, 0, len(adapters))
	for a, base := range adapters {
		c, ok := prev[a]
		if !ok {
			c = now
		}
		created[a] = c
		out = append(out, openai.Model{ID: a, Object: openai.ObjectModel, Created: c, OwnedBy: "infergate", Root: a, Parent: &base})
	}
	return out
}

// adapterOn is the adapter x's request runs under on pool p: the model the
// client sent when it is an adapter of p's model, p's own model when that
// is an adapter configured as a model of its own, else "" (the base
// model).
func (x *exchange) adapterOn(p *pool) string {
	if x.pass.adapterOf != "" && x.pass.adapterOf == p.model {
		return x.model
	}
	return p.adapter
}

// serves reports whether an endpoint whose served names are models
// (sorted; nil: unknown, every name of its pool) can take a request for
// adapter ("": the base model). A binary search: an engine may list 1,024
// adapters and the pick path asks once per endpoint.
func serves(models []string, adapter string) bool {
	if adapter == "" || models == nil {
		return true
	}
	_, ok := slices.BinarySearch(models, adapter)
	return ok
}

// modelsLoop reads ep's GET /v1/models every models_refresh_interval until
// ctx is done, at the endpoint's phase (the first read half an interval to
// one and a half after the start); a list whose adapters or ids differ from the last one
// (an adapter loaded, unloaded, or first seen) is stored and the state
// rebuilt (rebuildSoon). A failed read keeps what was known: an engine
// that is down is out of rotation anyway.
func (g *Gateway) modelsLoop(ctx context.Context, ep *endpoint) {
	if g.cfg.ModelsRefreshInterval < 0 {
		return
	}
	// At the endpoint's phase (fleet.PhaseOffset), as its health checks
	// are: a fleet added at once is not read at once every interval. The
	// first at least half an interval after the start (the list was read
	// when the endpoint was added).
	every := g.cfg.ModelsRefreshInterval
	offset := fleet.PhaseOffset(g.phaseSeed, "models", ep.name, every)
	now := time.Now()
	t := time.NewTimer(fleet.NextPhase(now, now, offset, every))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		began := time.Now()
		spec := ep.spec.Load()
		l, err := g.prober.ModelList(ctx, ep.base, spec.header)
		if err != nil {
			t.Reset(fleet.NextPhase(time.Now(), began, offset, every))
			continue
		}
		// A change matters when adapters are listed, were, or are
		// configured (whose engines are those that list them): a fleet
		// without adapters is never rebuilt.
		if old, changed := ep.setModels(&l); changed &&
			(len(l.Adapters) > 0 || (old != nil && len(old.Adapters) > 0) || len(g.state.Load().cfg.Adapters) > 0) {
			slog.Info("gateway: endpoint's model list changed", "endpoint", ep.name, "models", len(l.IDs), "adapters", len(l.Adapters))
			g.rebuildSoon()
		}
		t.Reset(fleet.NextPhase(time.Now(), began, offset, every))
	}
}

// setModels stores l as ep's model list and returns the one it replaces
// (nil: none) and whether l differs from it as a set: an engine (or a
// proxy in front of it) that lists the same models in another order each
// read changes nothing, and must not rebuild the state at every refresh.
func (ep *endpoint) setModels(l *fleet.ModelList) (*fleet.ModelList, bool) {
	old := ep.models.Swap(l)
	return old, old == nil || !sameSet(old.IDs, l.IDs, strings.Compare) ||
		!sameSet(old.Adapters, l.Adapters, func(a, b fleet.ListedAdapter) int {
			return cmp.Or(strings.Compare(a.Name, b.Name), strings.Compare(a.Parent, b.Parent))
		})
}

// sameSet reports whether a and b hold the same elements, in any order
// (sorted copies compared: at most fleet.MaxListedModels each, once per
// models_refresh_interval).
func sameSet[T comparable](a, b []T, compare func(T, T) int) bool {
	if len(a) != len(b) {
		return false
	}
	if slices.Equal(a, b) {
		return true
	}
	a, b = slices.Clone(a), slices.Clone(b)
	slices.SortFunc(a, compare)
	slices.SortFunc(b, compare)
	return slices.Equal(a, b)
}

// Placements of an adapter's pick (infergate_lora_picks_total's label).
const (
	placementUnknown = iota // no vllm:lora_requests_info
	placementResident
	placementFreeSlot
	placementFull
	numPlacements
)

var placements = [numPlacements]string{"unknown", "resident", "free_slot", "full"}

// markAdapterPick counts an adapter request's pick by where its adapter
// stood on the endpoint chosen (infergate_lora_picks_total).
func markAdapterPick(p *pool, req *sched.Request, e *sched.Endpoint) {
	if req.Adapter == "" || p.loraPicks[0] == nil {
		return
	}
	k := placementUnknown
	switch {
	case slices.Contains(e.Adapters, req.Adapter):
		k = placementResident
	case e.MaxAdapters == 0 && e.Adapters == nil:
	case e.MaxAdapters == 0 || len(e.Adapters) < e.MaxAdapters:
		k = placementFreeSlot
	default:
		k = placementFull
	}
	p.loraPicks[k].Inc()
}

// setAdapterGauge sets infergate_lora_adapters to st's adapters per base
// model, dropping the series of models that have none any more.
func (g *Gateway) setAdapterGauge(st, prev *state) {
	n := map[string]int{}
	for _, base := range st.adapters {
		n[base]++
	}
	if prev != nil {
		for _, base := range prev.adapters {
			if n[base] == 0 {
				g.metrics.adapters.DeleteLabelValues(base)
			}
		}
	}
	for base, k := range n {
		g.metrics.adapters.WithLabelValues(base).Set(float64(k))
	}
}
