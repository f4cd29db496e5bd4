// Package sim simulates a vLLM engine: the embedded default fleet of
// `infergate up` and the substrate of routing benchmarks and capacity planning.
//
// The core (Engine) is a pure state machine modelled on vLLM v1: a paged KV
// cache with automatic prefix caching (chained block hashes, reference counts,
// an LRU free queue whose blocks keep their hashes until reused), a
// continuous-batching scheduler with chunked prefill, a per-step token budget
// and recompute preemption, and a roofline latency model of a model on GPUs
// (Profile). It does no I/O and never reads the clock: callers pass simulated
// time in and get step durations out, so the same code runs in real time
// (Server) and in virtual time (plan).
//
// Server puts a vLLM-compatible OpenAI HTTP front on an Engine, driven in real
// time scaled by TimeScale: /v1/completions, /v1/chat/completions (SSE
// streaming like vLLM), /v1/models, /health and /metrics with vLLM's metric
// names. LoRA adapters (Config.LoRA) are served as separate models with their
// own prefix-cache identity, vLLM's max_loras scheduling constraint and a
// simulated load latency. See README.md for the model, its constants and its
// sources.
package sim
