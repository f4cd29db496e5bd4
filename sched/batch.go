package sched

import (
	"fmt"
	"math"
)

// BatchConfig prices the batch a request joins (YAML routing.cost.batch):
// the cost, ttft and ttft-bound estimates then follow an engine step's
// roofline instead of counting prefill tokens alone (batchModel). Zero
// StepSeconds (the default) leaves every estimate as without it.
type BatchConfig struct {
	// StepSeconds is s₀, the time of one engine step of a small decode
	// batch: the weights streamed from HBM once plus the step's fixed
	// overhead (vLLM's inter-token latency at batch 1), seconds. 0: the
	// batch is not priced. Llama-3.1-70B bf16 on 4×H100 (the simulator's
	// default profile): 139.1 GB / (4 × 3.35 TB/s × 0.567) + 3 ms = 0.0213.
	StepSeconds float64 `yaml:"step_seconds"`
	// KVTokensPerSecond is κ, the KV tokens a memory-bound step reads per
	// second: HBM bandwidth / KV bytes per token (0: KV reads not priced).
	// Llama-3.1-70B bf16 on 4×H100: 7.6 TB/s / 327,680 B = 23.2e6.
	KVTokensPerSecond float64 `yaml:"kv_tokens_per_second"`
	// StepTokens is the engine's per-step token budget shared by decodes
	// and prefill chunks (vLLM --max-num-batched-tokens; default 8192).
	StepTokens int `yaml:"step_tokens"`
}

// DefaultStepTokens is BatchConfig.StepTokens' default: vLLM's default
// --max-num-batched-tokens with chunked prefill (vllm/config/scheduler.py;
// sim.DefaultMaxNumBatchedTokens).
const DefaultStepTokens = 8192

// batchModel is the step-time model behind a batch-priced estimate, the
// simulator's roofline (sim/profile.go GPUProfile.StepTime: t = overhead +
// max(FLOPs / compute, bytes / bandwidth), Williams et al. 2009; Yuan et
// al. 2024, arXiv:2402.16363 §3) reduced to what a gateway knows of an
// engine: a step computing T tokens while its batch holds K tokens of KV
// takes
//
//	s(T, K) = max(s₀ + K / κ,  T / rate)
//
// the memory floor (the weights and the batch's KV read once per step)
// or the compute of its tokens at the prefill rate, whichever is longer
// (DistServe's latency model, Zhong et al., OSDI '24, arXiv:2401.09670
// Appendix A: a prefill's time linear in its tokens' matmul work, a decode
// step's in the batch's KV tokens; Sarathi-Serve, Agrawal et al., OSDI '24,
// §3: a decode batch is memory-bound, so prefill tokens up to the knee
// ride in its step almost for free). A request of U uncached tokens sent
// to endpoint e, with Q prefill tokens pending there, N requests in flight
// (each decoding one token per step, as vLLM v1 batches running decodes
// with prefill chunks) and K prompt tokens in flight (their KV), gets its
// first token after
//
//	n        = max(1, ⌈(Q + U) / budget⌉)           steps of prefill
//	prefill  = max(n · (s₀ + K/κ), (Q + U + n·N) / rate)
//	wait     = s(N, K) / 2    if Q = 0 and N > 0, else 0
//	TTFT     = wait + prefill
//
// prefill is the backlog and its own tokens over n steps, each at least
// the memory floor, together at least the compute of the backlog, its
// own tokens and the decodes riding along. wait is the rest of a decode
// step in progress when it arrives (uniform in the step: half of it on
// average), since an engine schedules a step's batch when the step starts
// (vLLM v1's scheduler; sim/engine.go Step) and an idle one starts a step
// at once. With a backlog the step in progress is part of it, which
// prefill counts whole, as the plain estimate does (the ledger releases a
// request's backlog only at its first token, so the chunks already
// computed are counted too: an upper bound either way). wait is the
// batch's price for a short prompt: its own tokens ride under the memory
// floor, so a hit of fewer than s₀·rate tokens (≈ 185 for the 70B
// default) saves it nothing while a decoding engine costs it half a step
// more than an idle one. The work its own tokens add to the engine (the
// ttft scorer's α term) is the compute they add beyond that floor,
//
//	work = prefill − max(n · (s₀ + K/κ), (Q + n·N) / rate)
//
// which is U / rate when the steps are compute-bound and 0 when its
// tokens fit under the floor. The decodes' own tokens are in N, their
// KV in K (prompt tokens only: the gateway's ledger does not count the
// tokens decoded so far). N counts requests still prefilling as decodes
// too: an upper bound.
type batchModel struct {
	step, kvRate, budget float64
}

// on reports whether the batch is priced.
func (m batchModel) on() bool { return m.step > 0 }

// newBatchModel validates cfg.
func newBatchModel(cfg BatchConfig) (batchModel, error) {
	if !(cfg.StepSeconds >= 0) || math.IsInf(cfg.StepSeconds, 0) {
		return batchModel{}, fmt.Errorf("cost.batch.step_seconds %g must be >= 0 and finite", cfg.StepSeconds)
	}
	if !(cfg.KVTokensPerSecond >= 0) || math.IsInf(cfg.KVTokensPerSecond, 0) {
		return batchModel{}, fmt.Errorf("cost.batch.kv_tokens_per_second %g must be >= 0 and finite", cfg.KVTokensPerSecond)
	}
	if cfg.StepTokens < 0 {
		return batchModel{}, fmt.Errorf("cost.batch.step_tokens %d must be >= 0", cfg.StepTokens)
	}
	budget := cfg.StepTokens
	if budget == 0 {
		budget = DefaultStepTokens
	}
	return batchModel{step: cfg.StepSeconds, kvRate: cfg.KVTokensPerSecond, budget: float64(budget)}, nil
}

// estimate returns the TTFT (s) of a request of u uncached tokens at an
// endpoint with q pending prefill tokens, n requests and k prompt tokens in
// flight, prefilling at rate tokens/s, and the work (s) its tokens add
// there (the formulas on batchModel).
func (m batchModel) estimate(q, u, n, k, rate float64) (ttft, work float64) {
	floor := m.step
	if m.kvRate > 0 {
		floor += k / m.kvRate
	}
	if q == 0 && n > 0 {
		ttft = max(floor, n/rate) / 2
	}
	steps := max(1, math.Ceil((q+u)/m.budget))
	prefill := max(steps*floor, (q+u+steps*n)/rate)
	base := max(steps*floor, (q+steps*n)/rate)
	return ttft + prefill, prefill - base
}
