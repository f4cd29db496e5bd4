package gateway

import "github.com/infergate/infergate/fleet"

// DefaultMaxModelLen is the context length (tokens, prompt and output
// together) assumed for an endpoint whose max_model_len is 0 and whose
// GET /v1/models does not report one: 131072, Llama 3.1's and most current
// open models' (set max_model_len for a longer one). A key's token limit
// reserves it for a request without max_tokens (keylimits.go). What is
// discovered from an engine is read by fleet.Prober (fleet/probe.go):
// its KV capacity from /metrics, its context length from /v1/models.
const DefaultMaxModelLen = 131072

// maxModelLenLimit bounds max_model_len, configured or discovered
// (fleet.MaxModelLenLimit).
const maxModelLenLimit = fleet.MaxModelLenLimit
