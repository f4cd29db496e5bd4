// Package sim is a simulated vLLM engine: the engine model behind the
// embedded default fleet of `infergate up` and the substrate of routing
// benchmarks and capacity planning.
//
// The core (Engine) is a pure state machine modelled on vLLM v1: a paged KV
// cache with automatic prefix caching (chained block hashes, reference counts,
// an LRU free queue whose blocks keep their hashes until reused), a
// continuous-batching scheduler with chunked prefill, a per-step token budget
// and recompute preemption, and a roofline latency model of a model on GPUs
// (Profile). It does no I/O and never reads the clock: callers pass simulated
// time in and get step durations out, so the same code runs in real time
// (package simserver) and in virtual time (packages virtual and plan). LoRA
// adapters (Config.LoRA) have their own prefix-cache identity, vLLM's
// max_loras scheduling constraint and a simulated load latency; KV-cache
// events (Config.KVEvents) come out as kvevent.Event records, which carry no
// transport. The package imports no HTTP, Prometheus or ZeroMQ.
//
// Package simserver puts the vLLM-compatible OpenAI HTTP front, /metrics and
// the KV-event publisher around an Engine. See README.md for the model, its
// constants and its sources.
package sim
