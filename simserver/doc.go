// Package simserver puts a vLLM-compatible OpenAI HTTP front on a simulated
// engine (sim.Engine), driven in real time scaled by TimeScale:
// /v1/completions, /v1/chat/completions (SSE streaming like vLLM),
// /v1/responses, /v1/embeddings, /tokenize, /detokenize, /v1/models, /health
// and /metrics with vLLM's metric names, vLLM's --api-key check, and the
// engine's KV-cache events published over ZeroMQ (kvevents.Publisher). LoRA
// adapters of the engine's configuration are served as separate models.
// Disaggregated prefill/decode: vLLM's kv_transfer_params (NIXL, Mooncake)
// and SGLang's bootstrap fields, over a simulated side channel (pd.go,
// pdchannel.go; README "P/D").
// StartFleet runs n Servers on loopback ports (infergate up, bench --compare).
// The engine model itself, its constants and sources are package sim; see
// README.md for the HTTP front.
package simserver
