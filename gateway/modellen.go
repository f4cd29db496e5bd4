package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"

	"github.com/infergate/infergate/openai"
)

// DefaultMaxModelLen is the context length (tokens, prompt and output
// together) assumed for an endpoint whose max_model_len is 0 and whose
// GET /v1/models does not report one: 131072, Llama 3.1's and most current
// open models' (set max_model_len for a longer one). A key's token limit
// reserves it for a request without max_tokens (keylimits.go).
const DefaultMaxModelLen = 131072

// maxModelsBody bounds the GET /v1/models answer read at start (bytes).
const maxModelsBody = 1 << 20

// fetchMaxModelLen reads the context length an engine reports in
// GET <base>/v1/models: the largest max_model_len of its entries (vLLM's
// and the simulator's model cards carry it; LoRA adapters' cards do not,
// they share the base model's). 0 and an error when it reports none.
func (g *Gateway) fetchMaxModelLen(ctx context.Context, base string, header http.Header) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, g.cfg.HealthCheckTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+pathModels, nil)
	if err != nil {
		return 0, fmt.Errorf("read %s%s: %w", base, pathModels, err)
	}
	addHeader(req.Header, header) // the credentials: vLLM's --api-key guards every /v1 path
	resp, err := g.transport.RoundTrip(req)
	if err != nil {
		return 0, fmt.Errorf("read %s%s: %w", base, pathModels, err)
	}
	defer resp.Body.Close()
	if isAuthRefusal(resp.StatusCode) {
		return 0, fmt.Errorf("read %s%s: %w", base, pathModels, authStatus(resp.StatusCode))
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("read %s%s: status %d", base, pathModels, resp.StatusCode)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxModelsBody+1))
	if err != nil || len(body) > maxModelsBody {
		return 0, fmt.Errorf("read %s%s: %v (at most %d bytes)", base, pathModels, err, maxModelsBody)
	}
	n, err := parseMaxModelLen(body)
	if err != nil {
		return 0, fmt.Errorf("read %s%s: %w", base, pathModels, err)
	}
	return n, nil
}

// parseMaxModelLen returns the largest positive max_model_len in a model
// list (openai.ModelList), an error when there is none. The body is an
// engine's: held to openai.MaxDepth like any.
func parseMaxModelLen(body []byte) (int, error) {
	if openai.TooDeep(body) {
		return 0, fmt.Errorf("nested more than %d levels deep", openai.MaxDepth)
	}
	var list struct {
		Data []struct {
			MaxModelLen int64 `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil {
		return 0, err
	}
	n := 0
	for _, m := range list.Data {
		if m.MaxModelLen > 0 && m.MaxModelLen <= maxModelLenLimit {
			n = max(n, int(m.MaxModelLen))
		}
	}
	if n == 0 {
		return 0, fmt.Errorf("no max_model_len in the model list")
	}
	return n, nil
}

// maxModelLenLimit bounds max_model_len (2^30 tokens: beyond any model,
// and small enough that token estimates stay exact in a float64).
const maxModelLenLimit = 1 << 30
