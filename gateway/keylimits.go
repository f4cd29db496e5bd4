package gateway

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/openai"
)

// exchangeEdge is the per-request edge state kept in the exchange: the
// charge on the key's rate limits and the client connection's write deadline.
type exchangeEdge struct {
	// limits are the key's limits while the request holds a charge on them
	// (nil when none): charged by chargeKey, given back by refundKey when
	// the gateway refuses the request before sending it, settled against
	// usage by settleTokens at its end.
	limits *auth.Limits
	// capPriority: the key caps the request's priority at maxPriority.
	capPriority   bool
	maxPriority   int
	reserved      float64   // tokens charged at admission, to settle against usage
	writeDeadline time.Time // the client connection's current write deadline
}

// chargeKey checks, after the body is decoded, that the key may use the model
// (404 model_not_found otherwise, as OpenAI answers) and takes the request
// and its estimated tokens from the key's rate limits (429 otherwise);
// maxModelLen is the context length of the model's pool (0: no pool). It
// sets the x-ratelimit-* headers.
func (g *Gateway) chargeKey(w http.ResponseWriter, x *exchange, kind apiKind, p *principal, maxModelLen int) *openai.Error {
	if p == nil {
		return nil
	}
	x.edge.capPriority, x.edge.maxPriority = p.CapPriority, p.MaxPriority
	if !p.Allows(x.model) {
		return modelNotAllowed(x.model)
	}
	kl := p.Limits
	if kl == nil {
		return nil
	}
	est, asked := x.tokenEstimate(kind, maxModelLen)
	h := w.Header()
	c := kl.Charge(g.clock(), est, asked, h)
	switch {
	case c.TooLarge:
		g.rateLimited.WithLabelValues(p.Name, "tokens").Inc()
		return &openai.Error{Message: fmt.Sprintf("Request too large for key %s on tokens per min (TPM): Limit %.0f, Requested %.0f (prompt estimate plus max_tokens). Send a smaller request.",
			p.Name, c.PerMinute, c.Tokens), Type: "tokens", Code: codeRateLimitExceeded, Status: http.StatusTooManyRequests}
	case !c.OK:
		g.rateLimited.WithLabelValues(p.Name, c.Limit).Inc()
		secs := max(1, int(math.Ceil(c.Wait.Seconds())))
		h.Set("Retry-After", strconv.Itoa(secs))
		h.Set("Retry-After-Ms", strconv.FormatInt(max(1, c.Wait.Milliseconds()), 10))
		unit := "RPM"
		if c.Limit == "tokens" {
			unit = "TPM"
		}
		return &openai.Error{Message: fmt.Sprintf("Rate limit reached for key %s on %s per min (%s): Limit %.0f. Please try again in %s.",
			p.Name, c.Limit, unit, c.PerMinute, c.Wait.Round(time.Millisecond)), Type: c.Limit, Code: codeRateLimitExceeded, Status: http.StatusTooManyRequests}
	}
	x.edge.limits, x.edge.reserved = kl, c.Reserved
	return nil
}

// refundKey gives the request's charge (1 request, its reserved
// tokens) back to the key's limits: the gateway refused it before sending
// it anywhere (model without endpoints, admission queue full or timed out,
// displaced, shutdown, no endpoint, client gone while queued), so it was
// never admitted. h, when not nil, gets the x-ratelimit-* headers again.
// Idempotent; a no-op after settleTokens.
func (x *exchange) refundKey(h http.Header) {
	kl := x.edge.limits
	if kl == nil {
		return
	}
	kl.Refund(x.edge.reserved, h)
	x.edge.limits, x.edge.reserved = nil, 0
}

// tokenEstimate is what a request is charged against tokens_per_minute at
// admission, a bound on the tokens it can use: the prompt (token ids
// counted exactly; text as body bytes / 4) plus max_tokens × n × prompts
// when max_tokens is given; without max_tokens an engine generates until
// the context is full, so each of the n × prompts sequences is bounded by
// maxModelLen tokens, prompt included (and never less than the prompt).
// asked is the part the client fixed (the prompt, and max_tokens when
// given): a request whose asked part exceeds the key's minute is too
// large. The charge is settled against the engine's reported usage when
// the response ends.
//
// The other APIs: a response like a chat (max_output_tokens its
// max_tokens; a continuation's stored turns are not in its body, so its
// charge is settled up from usage); embeddings their input alone (no
// output); an unknown path its body / 4; tokenize, detokenize and
// responses by id no tokens (they count against requests_per_minute only).
func (x *exchange) tokenEstimate(kind apiKind, maxModelLen int) (est, asked float64) {
	var prompt, maxTok, n, prompts float64 = 0, 0, 1, 1
	var mt, nc *int
	switch kind {
	case kindTokenize, kindDetokenize, kindResponseByID:
		return 0, 0
	case kindEmbeddings:
		prompt = float64(len(x.body) / 4)
		if ids := x.pass.emb.Input.Tokens; len(ids) > 0 {
			prompt = 0
			for _, p := range ids {
				prompt += float64(len(p))
			}
		}
		return max(1, prompt), max(1, prompt)
	case kindOther:
		return max(1, float64(len(x.body)/4)), max(1, float64(len(x.body)/4))
	case kindResponses:
		mt, prompt = x.pass.resp.MaxOutputTokens, float64(len(x.body)/4)
	}
	if kind == kindChat {
		mt, nc = x.chat.MaxTokens, x.chat.N
		if x.chat.MaxCompletionTokens != nil {
			mt = x.chat.MaxCompletionTokens
		}
		prompt = float64(len(x.body) / 4)
	} else if kind == kindCompletion {
		mt, nc = x.comp.MaxTokens, x.comp.N
		if ids := x.comp.Prompt.Tokens; len(ids) > 0 {
			for _, p := range ids {
				prompt += float64(len(p))
			}
		} else {
			prompt = float64(len(x.body) / 4)
		}
		prompts = float64(max(1, x.comp.Prompt.Len()))
	}
	if nc != nil && *nc > 1 {
		n = float64(*nc)
	}
	if mt == nil || *mt <= 0 {
		// Usage counts the prompt once per prompt and every choice's
		// completion: prompts × (p + n × (L − p)) ≤ prompts × n × L.
		return max(1, prompt, prompts*n*float64(maxModelLen)), max(1, prompt)
	}
	maxTok = float64(*mt)
	est = max(1, prompt+maxTok*n*prompts)
	return est, est
}

// usedTokens is what u reports used: its total, else prompt plus
// completion, each negative count read as 0 and the sum saturating at
// math.MaxInt (an engine's huge counts must not wrap into a refund).
func usedTokens(u *openai.Usage) int {
	if u.TotalTokens > 0 {
		return u.TotalTokens
	}
	p, c := max(u.PromptTokens, 0), max(u.CompletionTokens, 0)
	if p > math.MaxInt-c {
		return math.MaxInt
	}
	return p + c
}

// settleTokens charges the difference between a request's reported usage
// and what admission charged (a refund when it used less). Without usage
// (a failed or canceled request) the admission charge stands. Idempotent.
func (x *exchange) settleTokens(u *openai.Usage) {
	kl := x.edge.limits
	if kl == nil || u == nil {
		return
	}
	kl.Settle(usedTokens(u), x.edge.reserved) // a no-op without a token limit
	x.edge.limits, x.edge.reserved = nil, 0
}
