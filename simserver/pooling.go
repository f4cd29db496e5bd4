package simserver

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"math"
	"net/http"
	"time"

	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sim"
)

// Embeddings and the tokenizer's endpoints, as vLLM serves them
// (vllm/entrypoints/openai/serving_embedding.py, serving_tokenization.py,
// protocol.py; commit 00b6063f).
//
// POST /v1/embeddings: the simulated engine answers as if it ran as a
// pooling model (vLLM --runner pooling): each input is a prefill through
// the engine (one request, one sampled token discarded), so embeddings
// queue, batch and take the time the latency model gives a prefill of
// their length; the vector is a deterministic function of the input's
// tokens (the same input gives the same vector on every replica), of the
// profile's hidden size or the request's dimensions (truncated and
// renormalised, as a Matryoshka model's), L2-normalised, as float or
// base64 (little-endian float32s). The answer is vLLM's EmbeddingResponse:
// id "embd-…", object "list", data [{index, object "embedding",
// embedding}], usage prompt_tokens = total_tokens.
//
// POST /tokenize: {"prompt"} tokenized as a completion prompt, or
// {"messages"} rendered and tokenized as the chat endpoint does, so count is
// the prompt_tokens a chat would report; the answer is {"count",
// "max_model_len", "tokens", "token_strs"} (token_strs with
// return_token_strs). POST /detokenize: {"tokens"} → {"prompt"}, 400 for an
// id outside the vocabulary. The model is optional in both (vLLM: the
// served model).

// defaultHiddenSize is the vector size when the profile has none.
const defaultHiddenSize = 4096

func (s *Server) handleEmbeddings(w http.ResponseWriter, r *http.Request) {
	var req openai.EmbeddingRequest
	if e := s.decodeBody(w, r, &req); e != nil {
		openai.WriteError(w, e)
		return
	}
	if req.Model == "" {
		req.Model = s.cfg.Model
	}
	if e := req.Validate(); e != nil {
		openai.WriteError(w, e)
		return
	}
	dims := s.eng.Profile.HiddenSize
	if dims <= 0 {
		dims = defaultHiddenSize
	}
	if req.Dimensions != nil {
		if *req.Dimensions > dims {
			openai.WriteError(w, openai.Errorf("dimensions", fmt.Sprintf("dimensions %d is larger than the model's %d", *req.Dimensions, dims)))
			return
		}
		dims = *req.Dimensions
	}
	g := genRequest{model: req.Model, maxTokens: 1}
	inputs := req.Input.Tokens
	for _, text := range req.Input.Texts {
		// vLLM's EmbeddingCompletionRequest.add_special_tokens: true.
		toks, e := s.encode(text, true)
		if e != nil {
			openai.WriteError(w, e)
			return
		}
		inputs = append(inputs, toks)
	}
	for _, toks := range inputs {
		g.tokens = toks
		if e := s.check(&g, nil); e != nil {
			openai.WriteError(w, e)
			return
		}
	}
	prompt, e := s.prefill(r.Context(), inputs, g.adapter)
	if e != nil {
		if r.Context().Err() == nil {
			openai.WriteError(w, e)
		}
		return
	}
	resp := openai.EmbeddingResponse{ID: s.newID("embd-"), Object: openai.ObjectList, Created: time.Now().Unix(), Model: req.Model,
		Data: make([]openai.Embedding, len(inputs)), Usage: openai.Usage{PromptTokens: prompt, TotalTokens: prompt}}
	for i, toks := range inputs {
		v := embedding(toks, dims)
		resp.Data[i] = openai.Embedding{Index: i, Object: openai.ObjectEmbedding, Embedding: v}
		if req.EncodingFormat == "base64" {
			b := make([]byte, 4*len(v))
			for j, f := range v {
				binary.LittleEndian.PutUint32(b[4*j:], math.Float32bits(f))
			}
			resp.Data[i].Embedding = base64.StdEncoding.EncodeToString(b)
		}
	}
	writeJSON(w, http.StatusOK, resp)
}

// embedding is the deterministic unit vector of tokens (dims components).
func embedding(tokens []uint32, dims int) []float32 {
	h := uint64(len(tokens))
	for _, t := range tokens {
		h = mix64(h ^ uint64(t))
	}
	v := make([]float32, dims)
	var norm float64
	for j := range v {
		x := float64(mix64(h+uint64(j))>>11)/(1<<53)*2 - 1
		v[j] = float32(x)
		norm += x * x
	}
	if norm = math.Sqrt(norm); norm > 0 {
		for j := range v {
			v[j] = float32(float64(v[j]) / norm)
		}
	}
	return v
}

// prefill runs each of inputs through the engine as a one-token request
// and returns their prompt tokens; it returns when all have finished (or
// the client went away: the rest are aborted).
func (s *Server) prefill(ctx context.Context, inputs [][]uint32, adapter string) (int, *openai.Error) {
	if !s.started.Load() {
		return 0, openai.NewError(http.StatusServiceUnavailable, "the simulated engine is not running", "", "")
	}
	calls := make([]*call, 0, len(inputs))
	cancel := func() {
		for _, c := range calls {
			select {
			case s.cancel <- c:
			case <-s.done:
			}
		}
	}
	for _, toks := range inputs {
		id := s.newID("embd-")
		c := &call{id: id, req: sim.Request{ID: id, Tokens: toks, MaxTokens: 1, Extra: prefix.Seed(""), LoRA: adapter},
			notify: make(chan struct{}, 1)}
		select {
		case s.submit <- c:
			calls = append(calls, c)
		case <-ctx.Done():
			cancel()
			return 0, openai.NewError(499, "client closed the request", "", "")
		case <-s.done:
			return 0, errShutdown
		}
	}
	prompt := 0
	var buf []event
	for _, c := range calls {
	wait:
		for {
			select {
			case <-c.notify:
			case <-ctx.Done():
				cancel()
				return 0, openai.NewError(499, "client closed the request", "", "")
			case <-s.done:
				return 0, errShutdown
			}
			buf = c.take(buf)
			for _, ev := range buf {
				if ev.err != nil {
					cancel()
					return 0, ev.err
				}
				if ev.finished {
					prompt += ev.usage.PromptTokens
					break wait
				}
			}
		}
	}
	return prompt, nil
}

func (s *Server) handleTokenize(w http.ResponseWriter, r *http.Request) {
	var req openai.TokenizeRequest
	body, e := s.decodeRaw(w, r, &req)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	if e := s.checkModel(req.Model); e != nil {
		openai.WriteError(w, e)
		return
	}
	var toks []uint32
	switch {
	case req.Prompt != nil:
		var f templateFields
		if e = openai.Decode(body, &f); e == nil {
			// TokenizeCompletionRequest.add_special_tokens: true.
			var cut bool
			toks, cut, e = s.encodeCut(*req.Prompt, f.AddSpecialTokens == nil || *f.AddSpecialTokens)
			if cut {
				e = openai.Errorf("prompt", fmt.Sprintf("the prompt is longer than the simulator tokenizes (%d bytes: %d per token of max_model_len)",
					maxBytesPerToken*s.eng.Profile.MaxModelLen, maxBytesPerToken))
			}
		}
	case len(req.Messages) > 0:
		toks, e = s.chatTokens(body, req.Messages, req.Tools)
	default:
		e = openai.Errorf("prompt", "either prompt or messages is required")
	}
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	resp := openai.TokenizeResponse{Count: len(toks), MaxModelLen: s.eng.Profile.MaxModelLen, Tokens: toks}
	if resp.Tokens == nil {
		resp.Tokens = []uint32{}
	}
	if req.ReturnTokenStrs {
		resp.TokenStrs = make([]string, len(toks))
		for i, t := range toks {
			resp.TokenStrs[i] = s.tok.TokenString(t)
		}
	}
	writeJSON(w, http.StatusOK, resp)
}

func (s *Server) handleDetokenize(w http.ResponseWriter, r *http.Request) {
	var req openai.DetokenizeRequest
	if e := s.decodeBody(w, r, &req); e != nil {
		openai.WriteError(w, e)
		return
	}
	if e := s.checkModel(req.Model); e != nil {
		openai.WriteError(w, e)
		return
	}
	ids := make([]uint32, len(req.Tokens))
	vocab := int64(s.vocab)
	for i, t := range req.Tokens {
		if t < 0 || t > math.MaxUint32 || (vocab > 0 && t >= vocab) {
			openai.WriteError(w, openai.Errorf("tokens", fmt.Sprintf("token id %d is out of vocabulary", t)))
			return
		}
		ids[i] = uint32(t)
	}
	writeJSON(w, http.StatusOK, openai.DetokenizeResponse{Prompt: s.tok.Decode(ids)})
}

// checkModel accepts the served model, one of its adapters, or none (the
// served model), else 404 as check does.
func (s *Server) checkModel(model string) *openai.Error {
	if model == "" || model == s.cfg.Model || s.eng.LoRA.AdapterID(model) != 0 {
		return nil
	}
	return openai.NewError(http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", model), "model", openai.CodeModelNotFound)
}
