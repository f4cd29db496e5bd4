package gateway

import (
	"math"
	"time"

	"github.com/infergate/infergate/openai"
)

// finish accounts a request answered with code, its usage (nil if not
// reported) and, for a 2xx, its end-to-end latency.
func (g *Gateway) finish(rm *routeMetrics, x *exchange, code int, u *openai.Usage, start time.Time) {
	x.settleTokens(u)
	if code/100 == 2 && x.pass.kind.generates() {
		rm.e2e.Observe(time.Since(start).Seconds())
	}
	if u != nil {
		rm.prompt.Add(float64(max(u.PromptTokens, 0)))
		rm.generate.Add(float64(max(u.CompletionTokens, 0)))
		cached := max(u.Cached(), 0)
		rm.cached.Add(float64(cached))
		// Prediction error: what the indexes said the endpoint held vs what
		// it reported, at most prompt − 1 tokens (an engine recomputes at
		// least the last prompt token).
		limit := max(u.PromptTokens-1, 0)
		if x.predicted >= 0 && u.PromptTokens > 0 {
			rm.predErr[x.predictedBy].Observe(math.Abs(float64(min(x.predicted, limit) - cached)))
		}
		if x.precisePredicted >= 0 && u.PromptTokens > 0 {
			rm.predErr[indexPrecise].Observe(math.Abs(float64(min(x.precisePredicted, limit) - cached)))
		}
	}
	x.obs.used(u)
	x.keyUse.used(u)
	x.obs.counted(rm, code)
	g.metrics.count(rm, code)
}
