// Package disagg holds the hand-off flows of disaggregated prefill and
// decode (P/D): how a request's body is rewritten for its prefill leg (P)
// and its decode leg (D), what is read from P's answer and passed to D, and
// a small orchestrator for the legs the gateway sends (the serial prefill
// leg, a concurrent one, the bootstrap query, the release of held blocks).
// It knows nothing of the gateway: a leg is sent by a Send the caller gives.
//
// The connectors (docs/PROTOCOLS.md §3; sources there):
//
//   - NIXL (vLLM NixlConnector, serial "pull"; vllm-project/vllm
//     tests/v1/kv_connector/nixl_integration/toy_proxy_server.py@030ea52e):
//     P gets the body with kv_transfer_params asking for a remote decode,
//     stream false, one token; D gets the original body with P's answered
//     kv_transfer_params copied verbatim (NIXLPrefillBody, ParsePrefill,
//     NIXLDecodeBody).
//   - Mooncake (vLLM MooncakeConnector, concurrent; llm-d/llm-d-router
//     pkg/sidecar/proxy/connector_mooncake.go@ebab6879): the engine id from
//     P's bootstrap server (GET /query), then P and D at once with a shared
//     transfer id (MooncakePrefillBody, MooncakeDecodeBody, ParseBootstrap).
//   - SGLang (bootstrap protocol; sgl-router pd_types.rs@20a9d0e4,
//     lightseekorg/smg pd_router.rs@73da68ca): the same body to P and D at
//     once with bootstrap_host, bootstrap_port and bootstrap_room, arrays
//     for batches (SGLangBody, BatchSize, NewRoom).
//   - llm-d header style (llm-d routing sidecar): the request goes to D
//     with PrefillerHeader naming P, and D's sidecar runs the hand-off.
//
// Bodies are edited as raw JSON: the members set are replaced where they
// are, those removed dropped, every other member kept byte for byte in its
// order, unknown ones included (edit). Every input is bounded (MaxBodyBytes,
// MaxResponseBytes, openai.MaxDepth) and every walk iterative.
package disagg
