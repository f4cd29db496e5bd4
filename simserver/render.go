package simserver

import (
	"fmt"
	"net/http"

	"github.com/infergate/infergate/openai"
)

// vLLM's render endpoints, as the simulated engine serves them: a request
// in, the engine's prompt token ids out, nothing generated. Shapes from
// vllm/entrypoints/serve/render/api_router.py and serving.py
// (ServingRender.render_chat_request, render_completion_request) and the
// GenerateRequest of vllm/entrypoints/serve/disagg/protocol.py
// (vllm-project/vllm commits 1c608d64, 0001948b, 06408932; the endpoints
// since v0.18.0, vllm-project/vllm#36166, with this answer shape since
// #35684):
//
//	POST /v1/chat/completions/render: a ChatCompletionRequest →
//	  {"request_id": "chatcmpl-…", "token_ids": [...], "features": null,
//	   "sampling_params": {"max_tokens": N}, "model", "stream",
//	   "stream_options", "cache_salt", "priority": 0,
//	   "kv_transfer_params": null}
//	POST /v1/completions/render: a CompletionRequest → a list of those, one
//	  per prompt (request_id "cmpl-…"), a batch of prompts included.
//
// The ids are the ones the generation endpoints compute for the same body
// (chatTokens, encode: the very functions handleChat and handleCompletions
// call), so the block hashes of the engine's KV events are the hashes of
// these ids. The request is validated as a generation request is (unknown
// model 404, a prompt past the context 400, n other than 1 400).
// sampling_params carries only max_tokens (the request's, or
// DefaultMaxTokens): the simulator has no other sampling.

// renderRoutes registers the render endpoints on mux.
func (s *Server) renderRoutes(mux *http.ServeMux) {
	mux.HandleFunc("POST /v1/chat/completions/render", s.handleChatRender)
	mux.HandleFunc("POST /v1/completions/render", s.handleCompletionRender)
}

// renderedRequest is vLLM's GenerateRequest as the render endpoints return
// it.
type renderedRequest struct {
	RequestID        string                `json:"request_id"`
	TokenIDs         []uint32              `json:"token_ids"`
	Features         any                   `json:"features"`
	SamplingParams   renderSampling        `json:"sampling_params"`
	Model            string                `json:"model"`
	Stream           bool                  `json:"stream"`
	StreamOptions    *openai.StreamOptions `json:"stream_options"`
	CacheSalt        *string               `json:"cache_salt"`
	Priority         int                   `json:"priority"`
	KVTransferParams any                   `json:"kv_transfer_params"`
}

type renderSampling struct {
	MaxTokens int `json:"max_tokens"`
}

func (s *Server) rendered(g *genRequest) renderedRequest {
	out := renderedRequest{
		RequestID: g.id, TokenIDs: g.tokens, Model: g.model, Stream: g.stream,
		SamplingParams: renderSampling{MaxTokens: g.maxTokens},
	}
	if out.TokenIDs == nil {
		out.TokenIDs = []uint32{}
	}
	if g.stream {
		out.StreamOptions = g.streamOptions
	}
	if g.cacheSalt != "" {
		salt := g.cacheSalt
		out.CacheSalt = &salt
	}
	return out
}

func (s *Server) handleChatRender(w http.ResponseWriter, r *http.Request) {
	var req openai.ChatRequest
	body, e := s.decodeRaw(w, r, &req)
	if e == nil {
		e = req.Validate()
	}
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	g, e := s.chatGen(body, &req, nil)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, s.rendered(&g))
}

func (s *Server) handleCompletionRender(w http.ResponseWriter, r *http.Request) {
	var req openai.CompletionRequest
	body, e := s.decodeRaw(w, r, &req)
	if e == nil {
		e = req.Validate()
	}
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	var opt templateFields
	if e := openai.Decode(body, &opt); e != nil {
		openai.WriteError(w, e)
		return
	}
	// vLLM's CompletionRequest.add_special_tokens defaults to true.
	addSpecial := opt.AddSpecialTokens == nil || *opt.AddSpecialTokens
	out := make([]renderedRequest, 0, req.Prompt.Len())
	for i := 0; i < req.Prompt.Len(); i++ {
		g := genRequest{
			id:            s.newID("cmpl-"),
			model:         req.Model,
			maxTokens:     orDefault(req.MaxTokens, DefaultMaxTokens),
			stream:        req.Stream,
			streamOptions: req.StreamOptions,
			cacheSalt:     req.CacheSalt,
		}
		if i < len(req.Prompt.Texts) {
			if g.tokens, e = s.encode(req.Prompt.Texts[i], addSpecial); e != nil {
				openai.WriteError(w, e)
				return
			}
		} else {
			g.tokens = req.Prompt.Tokens[i-len(req.Prompt.Texts)]
			if v := s.vocab; v > 0 {
				for _, t := range g.tokens {
					if int64(t) >= int64(v) {
						openai.WriteError(w, openai.Errorf("prompt", fmt.Sprintf("token id %d is out of vocabulary (size %d)", t, v)))
						return
					}
				}
			}
		}
		if e := s.check(&g, req.N); e != nil {
			openai.WriteError(w, e)
			return
		}
		out = append(out, s.rendered(&g))
	}
	writeJSON(w, http.StatusOK, out)
}
