// Package openai holds the OpenAI-compatible wire types infergate speaks on
// both sides (clients → gateway → engines): chat and text completion requests
// and responses, SSE stream chunks, the error object, the model list, request
// validation and the canonical chat rendering used for tokenization.
//
// Field sets follow the OpenAI API reference and vLLM's protocol classes
// (vllm/entrypoints/openai/protocol.py); see docs/PROTOCOLS.md §5. The
// gateway forwards the client's original body, so fields not modelled here
// (tools, response_format, kv_transfer_params, …) pass through untouched.
package openai
