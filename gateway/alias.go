package gateway

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/jsonscan"
	"github.com/infergate/infergate/openai"
)

// Model aliases. An alias is a model name clients may send that the gateway
// serves with configured models, tried in order:
//
//	aliases:
//	  fast: [llama-8b, llama-70b]   # llama-70b when llama-8b cannot serve the request
//	  gpt-4o: [meta-llama/Llama-3.1-70B-Instruct]
//
// A request for an alias goes to its first model's pool; it falls back to
// the next model, having sent the client nothing, when that pool has no
// endpoint in rotation (fallbackNoEndpoint), its admission refuses the
// request (queue full, displaced, timed out: fallbackOverloaded), or every
// attempt failed before a byte reached the client (connection refused or
// lost, 5xx, timeouts, a broken or bad answer, the retry budget spent:
// fallbackFailed) — the failures LiteLLM's fallbacks and OpenRouter's
// "models" fall back on, which say nothing about the request itself. An
// engine's 4xx (a context-length or validation error) is relayed as is: it
// is the request's, and the next model would most likely refuse it too
// (LiteLLM keeps context_window_fallbacks as a separate list; so could a
// later version). The last model's refusal is answered as for a plain
// model. Shutting down, a canceled client and unknown-path failures the
// request may have had an effect on (passthrough.go retrySafe) never fall
// back.
//
// The engine receives the target's name: the body's top-level "model"
// value is replaced in place (spliceModel), every other byte kept. The
// answer is relayed unchanged, so its "model" names the model that served
// it, as OpenAI (a snapshot name for an alias like gpt-4o) and OpenRouter
// (the fallback used) answer; the X-Infergate-Model response header names
// it too. A key's models allow-list applies to the name the client sent:
// a key allowed an alias may use it whatever its targets (the operator
// granted the alias), and one allowed only a target may not use the alias.
// GET /v1/models lists the aliases, root naming the first target.

// Fallback reasons (label of infergate_model_fallbacks_total).
const (
	fallbackNoEndpoint = "no_endpoint"
	fallbackOverloaded = "overloaded"
	fallbackFailed     = "failed"
)

// maxAliasTargets bounds an alias's model list.
const maxAliasTargets = 8

// modelHeader is the response header naming the model an alias was served
// by.
const modelHeader = "X-Infergate-Model"

// validateAliases checks the aliases against the configured models.
func (c Config) validateAliases() []error {
	var errs []error
	models := map[string]bool{}
	for _, e := range c.Endpoints {
		models[e.Model] = true
	}
	if m := c.discoveredModel(); m != "" {
		models[m] = true
	}
	for _, name := range slices.Sorted(mapKeys(c.Aliases)) {
		targets := c.Aliases[name]
		at := fmt.Sprintf("aliases[%q]", name)
		switch {
		case name == "":
			errs = append(errs, errors.New("aliases: an alias name must not be empty"))
		case models[name]:
			errs = append(errs, fmt.Errorf("%s: an endpoint serves a model of that name; an alias needs a name of its own", at))
		case len(targets) == 0 || len(targets) > maxAliasTargets:
			errs = append(errs, fmt.Errorf("%s: want 1 to %d models, got %d", at, maxAliasTargets, len(targets)))
		}
		seen := map[string]bool{}
		for _, t := range targets {
			switch {
			case !models[t]:
				errs = append(errs, fmt.Errorf("%s: model %q is served by no endpoint (an alias names configured models, not other aliases)", at, t))
			case seen[t]:
				errs = append(errs, fmt.Errorf("%s: model %q is listed twice", at, t))
			}
			seen[t] = true
		}
	}
	return errs
}

func mapKeys[V any](m map[string]V) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// initAliases registers the fallback counter. It runs in New; the aliases
// themselves are part of what a reload replaces (state.targets, built by
// buildTargets).
func (g *Gateway) initAliases(reg prometheus.Registerer) error {
	g.fallbacks = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "model_fallbacks_total",
		Help: "Requests for an alias passed on from one of its models to the next, by alias, the model that could not serve them and why (no_endpoint, overloaded, failed)."},
		[]string{"alias", "model", "reason"})
	if err := reg.Register(g.fallbacks); err != nil {
		return fmt.Errorf("gateway: register metrics: %w", err)
	}
	return nil
}

// buildTargets returns the targets of a state's pools, aliases and LoRA
// adapters (every model's pool alone, every alias's pools in order, every
// adapter's base model's pool), giving each pool its
// encoded name. cfg is validated: every target is a pool's model.
func buildTargets(pools map[string]*pool, aliases map[string][]string, adapters map[string]string) (map[string][]*pool, error) {
	targets := make(map[string][]*pool, len(pools)+len(aliases)+len(adapters))
	for model, p := range pools {
		b, err := json.Marshal(model)
		if err != nil {
			return nil, fmt.Errorf("gateway: encode model %q: %w", model, err)
		}
		p.modelJSON, p.modelHeader = b, []string{model}
		targets[model] = []*pool{p}
	}
	for alias, models := range aliases {
		ps := make([]*pool, len(models))
		for i, m := range models {
			ps[i] = pools[m] // validated
		}
		targets[alias] = ps
	}
	for a, base := range adapters {
		targets[a] = targets[base] // its base model's pool (adapters.go)
	}
	return targets, nil
}

// aliasModels are the /v1/models entries of aliases (root: the first
// target), each created at created[alias], or now for an alias new to
// created (which records it).
func aliasModels(aliases map[string][]string, created map[string]int64, prev map[string]int64, now int64) []openai.Model {
	out := make([]openai.Model, 0, len(aliases))
	for alias, models := range aliases {
		c, ok := prev[alias]
		if !ok {
			c = now
		}
		created[alias] = c
		out = append(out, openai.Model{ID: alias, Object: openai.ObjectModel, Created: c, OwnedBy: "infergate", Root: models[0]})
	}
	return out
}

// aliasTarget makes x send p's model name in place of the alias the client
// sent, and names it in the X-Infergate-Model response header.
func (g *Gateway) aliasTarget(w http.ResponseWriter, x *exchange, p *pool) *openai.Error {
	b, ok := jsonscan.SpliceModel(x.pass.aliasBody[:0], x.body, p.modelJSON)
	if !ok {
		// openai.Decode read a model from this body: the walk can only
		// fail on what it does not expect of valid JSON.
		return openai.NewError(http.StatusBadRequest, "The request body's model could not be rewritten for the alias's target.", "model", openai.CodeInvalidJSON)
	}
	x.pass.aliasBody, x.pass.sendBody = b, b
	w.Header()[modelHeader] = p.modelHeader
	return nil
}

// fellBack records that pool p, a target of the alias x asked for, passed
// the request on to the next.
func (g *Gateway) fellBack(x *exchange, p *pool) {
	g.fallbacks.WithLabelValues(x.model, p.model, x.pass.fell).Inc()
	slog.Debug("gateway: alias falls back", "alias", x.model, "model", p.model, "reason", x.pass.fell)
}
