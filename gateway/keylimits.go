package gateway

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/infergate/infergate/openai"
)

// exchangeEdge is the per-request edge state kept in the exchange: the
// charge on the key's rate limits and the client connection's write deadline.
type exchangeEdge struct {
	// limits are the key's limits while the request holds a charge on them
	// (nil when none): charged by chargeKey, given back by refundKey when
	// the gateway refuses the request before sending it, settled against
	// usage by settleTokens at its end.
	limits *keyLimits
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
	x.edge.capPriority, x.edge.maxPriority = p.capPriority, p.maxPriority
	if !p.allows(x.model) {
		return modelNotAllowed(x.model)
	}
	kl := p.limits
	if kl == nil {
		return nil
	}
	est, asked := x.tokenEstimate(kind, maxModelLen)
	now := g.clock()
	kl.mu.Lock() // a reload may change the limits (setLimits)
	reqLimit, tokLimit := kl.req.limit, kl.tok.limit
	// A bound from the context length (max_tokens omitted) over the whole
	// minute is held to it: the request waits for a full bucket instead of
	// never passing. What the client asked for itself is not.
	tooLarge := tokLimit > 0 && asked > tokLimit
	if tokLimit > 0 && !tooLarge {
		est = min(est, tokLimit)
	}
	okReq, waitReq := kl.req.check(now, 1)
	okTok, waitTok := true, time.Duration(0)
	if est > 0 { // tokenize and the like use no tokens: an overdrawn minute does not stop them
		okTok, waitTok = kl.tok.check(now, est)
	}
	if okReq && okTok && !tooLarge {
		kl.req.take(1)
		kl.tok.take(est)
	}
	h := w.Header()
	kl.req.setHeaders(h, &requestHeaderNames)
	kl.tok.setHeaders(h, &tokenHeaderNames)
	kl.mu.Unlock()

	switch {
	case tooLarge:
		g.rateLimited.WithLabelValues(p.name, "tokens").Inc()
		return &openai.Error{Message: fmt.Sprintf("Request too large for key %s on tokens per min (TPM): Limit %.0f, Requested %.0f (prompt estimate plus max_tokens). Send a smaller request.",
			p.name, tokLimit, est), Type: "tokens", Code: codeRateLimitExceeded, Status: http.StatusTooManyRequests}
	case !okReq || !okTok:
		limit, lim, wait := "requests", reqLimit, waitReq
		if okReq {
			limit, lim, wait = "tokens", tokLimit, waitTok
		}
		g.rateLimited.WithLabelValues(p.name, limit).Inc()
		secs := max(1, int(math.Ceil(wait.Seconds())))
		h.Set("Retry-After", strconv.Itoa(secs))
		h.Set("Retry-After-Ms", strconv.FormatInt(max(1, wait.Milliseconds()), 10))
		unit := "RPM"
		if limit == "tokens" {
			unit = "TPM"
		}
		return &openai.Error{Message: fmt.Sprintf("Rate limit reached for key %s on %s per min (%s): Limit %.0f. Please try again in %s.",
			p.name, limit, unit, lim, wait.Round(time.Millisecond)), Type: limit, Code: codeRateLimitExceeded, Status: http.StatusTooManyRequests}
	}
	x.edge.limits, x.edge.reserved = kl, est
	if tokLimit <= 0 {
		x.edge.reserved = 0
	}
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
	kl.mu.Lock()
	kl.req.adjust(-1)
	kl.tok.adjust(-x.edge.reserved)
	if h != nil {
		kl.req.setHeaders(h, &requestHeaderNames)
		kl.tok.setHeaders(h, &tokenHeaderNames)
	}
	kl.mu.Unlock()
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

// settleTokens charges the difference between a request's reported usage
// and what admission charged (a refund when it used less). Without usage
// (a failed or canceled request) the admission charge stands. Idempotent.
func (x *exchange) settleTokens(u *openai.Usage) {
	kl := x.edge.limits
	if kl == nil || u == nil {
		return
	}
	used := u.TotalTokens
	if used <= 0 {
		used = u.PromptTokens + u.CompletionTokens
	}
	kl.mu.Lock()
	kl.tok.adjust(float64(max(used, 0)) - x.edge.reserved) // a no-op without a token limit
	kl.mu.Unlock()
	x.edge.limits, x.edge.reserved = nil, 0
}

// keyLimits are one key's token buckets (one per key name: memory is
// bounded by the keys configured). A reload keeps them for a key it keeps
// (loadKeys), its limits changed in place (setLimits).
type keyLimits struct {
	mu  sync.Mutex
	req bucket // requests
	tok bucket // tokens
}

// setLimits changes the per-minute limits (0: none) at now, keeping what
// the key has used of them (bucket.setLimit).
func (kl *keyLimits) setLimits(rpm, tpm int, now time.Time) {
	kl.mu.Lock()
	kl.req.setLimit(rpm, now)
	kl.tok.setLimit(tpm, now)
	kl.mu.Unlock()
}

// newKeyLimits returns the buckets for the per-minute limits (0: none), or
// nil when the key has no limit.
func newKeyLimits(rpm, tpm int) *keyLimits {
	if rpm <= 0 && tpm <= 0 {
		return nil
	}
	return &keyLimits{req: newBucket(rpm), tok: newBucket(tpm)}
}

// bucket is a token bucket holding up to limit units and refilled at limit
// per minute; starting full. Its level may go negative (to −limit at most)
// when usage reported after a response exceeds what admission charged, so
// the excess delays the key's next requests. limit 0: unlimited.
type bucket struct {
	limit float64
	level float64
	last  time.Time
}

func newBucket(perMinute int) bucket {
	return bucket{limit: float64(max(perMinute, 0)), level: float64(max(perMinute, 0))}
}

// refill adds what accrued since the last refill.
func (b *bucket) refill(now time.Time) {
	if !b.last.IsZero() {
		if dt := now.Sub(b.last); dt > 0 {
			b.level = min(b.limit, b.level+dt.Minutes()*b.limit)
		}
	}
	b.last = now
}

// check refills and reports whether n units are available now, else how
// long until they are.
func (b *bucket) check(now time.Time, n float64) (bool, time.Duration) {
	if b.limit <= 0 {
		return true, 0
	}
	b.refill(now)
	if b.level >= n {
		return true, 0
	}
	need := min(n, b.limit) - b.level
	return false, time.Duration(need / b.limit * float64(time.Minute))
}

// setLimit changes the bucket's limit at now to perMinute (0: unlimited),
// keeping what was used of the minute: a bucket limit − level short of full
// stays as short of full under the new limit (within [−limit, limit]), so
// a raised limit is available at once and a lowered one holds what was
// already spent against it. A bucket that had no limit starts full.
func (b *bucket) setLimit(perMinute int, now time.Time) {
	n := float64(max(perMinute, 0))
	if b.limit <= 0 || n <= 0 {
		*b = newBucket(perMinute)
		return
	}
	b.refill(now)
	used := b.limit - b.level
	b.limit = n
	b.level = max(-n, min(n, n-used))
}

// take removes n units (after a successful check).
func (b *bucket) take(n float64) {
	if b.limit > 0 {
		b.level -= n
	}
}

// adjust removes delta units (negative: returns them), keeping the level
// within [−limit, limit].
func (b *bucket) adjust(delta float64) {
	if b.limit > 0 {
		b.level = max(-b.limit, min(b.limit, b.level-delta))
	}
}

// Header names of OpenAI's rate-limit headers, per limit kind.
var (
	requestHeaderNames = [3]string{"X-Ratelimit-Limit-Requests", "X-Ratelimit-Remaining-Requests", "X-Ratelimit-Reset-Requests"}
	tokenHeaderNames   = [3]string{"X-Ratelimit-Limit-Tokens", "X-Ratelimit-Remaining-Tokens", "X-Ratelimit-Reset-Tokens"}
)

// setHeaders sets OpenAI's x-ratelimit-limit-, -remaining- and -reset-
// headers named by names (reset: the time until the bucket is full again,
// as a Go duration like OpenAI's "6m0s" or "20ms").
func (b *bucket) setHeaders(h http.Header, names *[3]string) {
	if b.limit <= 0 {
		return
	}
	remaining := max(0, math.Floor(b.level))
	reset := time.Duration((b.limit - b.level) / b.limit * float64(time.Minute)).Round(time.Millisecond)
	h[names[0]] = []string{strconv.FormatFloat(b.limit, 'f', 0, 64)}
	h[names[1]] = []string{strconv.FormatFloat(remaining, 'f', 0, 64)}
	h[names[2]] = []string{reset.String()}
}
