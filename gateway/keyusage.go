package gateway

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/openai"
)

// keyUsage are one API key's usage counters, children resolved at start
// (the key names are configured, so the `key` label's values are bounded
// by the keys file; entries sharing a name share them).
type keyUsage struct {
	requests, prompt, cached, generated prometheus.Counter
}

// used adds a finished request's reported usage (nil: none reported).
// Safe on a nil receiver (no key).
func (k *keyUsage) used(u *openai.Usage) {
	if k == nil || u == nil {
		return
	}
	k.prompt.Add(float64(max(u.PromptTokens, 0)))
	k.cached.Add(float64(max(u.Cached(), 0)))
	k.generated.Add(float64(max(u.CompletionTokens, 0)))
}

// keyUsageVecs are the per-key usage counters' vectors (registered at
// start whether or not keys are configured: a reload may turn
// authentication on).
type keyUsageVecs struct {
	requests, prompt, cached, generated *prometheus.CounterVec
}

// initKeyUsage registers the per-key usage counters. Each key's children
// are resolved when its keyring is built (keyUsageVecs.of).
func (g *Gateway) initKeyUsage(reg prometheus.Registerer) error {
	vec := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: name, Help: help}, []string{"key"})
	}
	v := &g.keyUsage
	v.requests = vec("key_requests_total", "Inference requests authenticated with the API key, every outcome (key: its configured name).")
	v.prompt = vec("key_prompt_tokens_total", "Prompt tokens of the key's requests, from the engines' usage (tokens).")
	v.cached = vec("key_cached_prompt_tokens_total", "Prompt tokens of the key's requests served from the engines' prefix cache (tokens).")
	v.generated = vec("key_generation_tokens_total", "Completion tokens of the key's requests, from the engines' usage (tokens).")
	for _, c := range []prometheus.Collector{v.requests, v.prompt, v.cached, v.generated} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("gateway: register key usage metrics: %w", err)
		}
	}
	return nil
}

// of returns the usage counters of the key named name: the same series
// across reloads for as long as the name is configured (a renamed key is a
// new series; a removed key's series stays with its totals). nil vectors
// (a gateway made without initKeyUsage) give nil: no usage counted.
func (v *keyUsageVecs) of(name string) *keyUsage {
	if v == nil || v.requests == nil {
		return nil
	}
	return &keyUsage{requests: v.requests.WithLabelValues(name), prompt: v.prompt.WithLabelValues(name),
		cached: v.cached.WithLabelValues(name), generated: v.generated.WithLabelValues(name)}
}
