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

// initKeyUsage registers the per-key usage counters (when API keys are
// configured) and gives every principal its children.
func (g *Gateway) initKeyUsage(reg prometheus.Registerer) error {
	if g.keys == nil {
		return nil
	}
	vec := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: name, Help: help}, []string{"key"})
	}
	requests := vec("key_requests_total", "Inference requests authenticated with the API key, every outcome (key: its configured name).")
	prompt := vec("key_prompt_tokens_total", "Prompt tokens of the key's requests, from the engines' usage (tokens).")
	cached := vec("key_cached_prompt_tokens_total", "Prompt tokens of the key's requests served from the engines' prefix cache (tokens).")
	generated := vec("key_generation_tokens_total", "Completion tokens of the key's requests, from the engines' usage (tokens).")
	for _, c := range []prometheus.Collector{requests, prompt, cached, generated} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("gateway: register key usage metrics: %w", err)
		}
	}
	for _, p := range g.keys.principals {
		p.usage = &keyUsage{requests: requests.WithLabelValues(p.name), prompt: prompt.WithLabelValues(p.name),
			cached: cached.WithLabelValues(p.name), generated: generated.WithLabelValues(p.name)}
	}
	return nil
}
