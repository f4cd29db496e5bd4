package gateway

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/infergate/infergate/jsonscan"
	"github.com/prometheus/client_golang/prometheus"
)

// Engine render (config render: {model: engine}): routing asks one of the
// pool's engines for the prompt's token ids instead of tokenizing itself,
// as llm-d's EPP does (llm-d-router's tokenizer plugin posts the request to
// vLLM's render endpoints and reads token_ids), so the ids are the engine's
// whatever its tokenizer, chat template, tool rendering or multimodal
// preprocessing.
//
// The call, per request that needs routing tokens (chat, or a completion
// with a text prompt; token-id prompts are taken as given, Responses API
// requests tokenized by the gateway):
//
//   - POST {endpoint}/v1/chat/completions/render or /v1/completions/render
//     with the request body as sent to the engine (an alias target's model
//     spliced in). Shapes: vllm/entrypoints/serve/render/api_router.py and
//     serving.py (vllm-project/vllm 1c608d64, 0001948b; since v0.18.0,
//     vllm#36166): chat → GenerateRequest {"token_ids": [...], ...};
//     completion → [GenerateRequest, ...], one per prompt (the first is
//     routed on). Before vllm#35684 chat answered [conversation,
//     [{"prompt_token_ids": [...]}]] and completion [{"prompt_token_ids"}];
//     parseRenderIDs reads every form.
//   - An engine without them (404/405 with FastAPI's {"detail": ...}, as a
//     vLLM older than v0.18 or a `vllm serve` without --enable-scale-out
//     answers) is asked POST /tokenize instead, from then on: {"model",
//     "messages", "tools", "add_generation_prompt",
//     "continue_final_message", "chat_template", "chat_template_kwargs",
//     "add_special_tokens"} of the body for a chat, {"model", "prompt",
//     "add_special_tokens"} for a completion → {"tokens": [...]}
//     (vllm/entrypoints/openai/serving_tokenization.py; vLLM's
//     TokenizeChatRequest renders messages as the chat endpoint does). An
//     engine with neither is not asked again for unsupportedBackoff.
//   - The endpoint asked is a ready one of the pool, in rotation, skipping
//     those backing off. The call has render_timeout (default 200 ms) in
//     all, /tokenize retry included. A timeout, connection failure, 5xx or
//     unreadable answer counts against the endpoint: it is not asked again
//     for errorBackoff, doubling per failure in a row up to maxBackoff, so
//     a stalled engine costs at most one timeout per backoff, not one per
//     request; so does an answer other than 200 below 400 (a redirect,
//     which is not followed, or a 204), and a 4xx that took over half of
//     render_timeout (an endpoint that slow to refuse is too slow to
//     answer in time). A quick 4xx other than the above (the engine
//     refused this request) counts against nothing.
//   - At most render_concurrency calls per pool are in flight (default
//     64; each holds an answer of up to 16 MiB); a request past them is
//     routed on the gateway's own tokens at once (reason saturated).
//   - On any failure, or with no endpoint to ask, the request is routed on
//     the gateway's own tokens (the model's tokenizers entry, else
//     cl100k_base), counted in infergate_render_fallbacks_total by reason.
//
// Answers are cached (renderCache): an exact request seen again (a retry,
// an identical prompt, the same chat with other sampling parameters) is
// routed without a call. The key is the pool's model, the API and every
// top-level member of the body except those that cannot change the
// prompt's ids (renderIgnored: sampling, streaming, logging fields), so
// any member the gateway does not know keeps requests apart. A multi-turn
// session's later turns are not served from its earlier turns' ids: a
// chat template may render an earlier turn differently once later turns
// follow (Qwen3's drops the reasoning of turns before the last user
// query; every template replaces the generation prompt by the assistant's
// message), and the engine's tokenization of the joined text need not
// extend the earlier ids, so such a cache would route on ids the engine
// never hashes.

// Defaults and bounds of the render client.
const (
	// DefaultRenderTimeout bounds one engine render call (render_timeout).
	DefaultRenderTimeout = 200 * time.Millisecond
	// DefaultRenderConcurrency bounds a pool's render calls in flight
	// (render_concurrency): 64 × MaxRenderResponseBytes is 1 GiB at worst
	// (a 4,096-token prompt's answer is ~30 KB), and at a render's usual
	// 1–50 ms, 64 calls serve 1,300–64,000 uncached requests a second.
	DefaultRenderConcurrency = 64
	// maxRenderConcurrency bounds render_concurrency (16 GiB of answers).
	maxRenderConcurrency = 1024
	// MaxRenderResponseBytes bounds the answer read (a 1M-token prompt's
	// ids are about 7 MB of JSON).
	MaxRenderResponseBytes = 16 << 20
	// maxRenderIDs bounds the ids kept from an answer: routing hashes no
	// more (the text path cuts at maxRoutingTextBytes, ~128k tokens).
	maxRenderIDs = 1 << 20
	// renderCacheEntries and renderCacheIDs bound the answer cache: entries,
	// and ids over all entries (4 bytes each: 16 MiB).
	renderCacheEntries = 1024
	renderCacheIDs     = 4 << 20
	// Backoffs of an endpoint whose render call failed.
	errorBackoff       = time.Second
	maxBackoff         = 30 * time.Second
	unsupportedBackoff = 5 * time.Minute
	// maxRenderHealth bounds the endpoints whose render state is kept.
	maxRenderHealth = 4096
)

// Render modes (config render values).
const (
	RenderGateway = "gateway" // the gateway tokenizes (the default)
	RenderEngine  = "engine"  // the engine's render endpoints, /tokenize as fallback
)

// Render fallback reasons (infergate_render_fallbacks_total) and call
// results (infergate_render_requests_total).
const (
	renderOK          = "ok"
	renderTimeout     = "timeout"
	renderError       = "error"         // connection failure, 5xx, 3xx, unreadable answer
	renderUnsupported = "unsupported"   // neither render nor /tokenize served
	renderRejected    = "rejected"      // another 4xx: the engine refused the request
	renderNoEndpoint  = "no_endpoint"   // no ready endpoint, or all backing off
	renderSaturated   = "saturated"     // render_concurrency calls already in flight for the pool
	renderSlowReject  = "rejected_slow" // a 4xx refusal that took over half of render_timeout: backs off
	renderCanceled    = "canceled"      // the client went away during the call: nothing learnt of the endpoint
)

// Render APIs (infergate_render_requests_total's api).
const (
	apiRender = iota
	apiTokenize
	apiNone // neither: backing off for unsupportedBackoff
)

var renderAPINames = [...]string{apiRender: "render", apiTokenize: "tokenize"}

// engineRender is the gateway's render client: endpoint states, the answer
// cache and the metrics. One per gateway, shared by its pools.
type engineRender struct {
	client *http.Client
	next   atomic.Uint64 // rotation over a pool's endpoints
	health sync.Map      // endpoint name → *renderHealth
	// healthN counts health's entries: past maxRenderHealth (endpoints come
	// and go under discovery) the map is cleared, which costs at most one
	// more call to an endpoint that was backing off.
	healthN atomic.Int64
	cache   renderCache
	// backoff is errorBackoff (tests lengthen it).
	backoff time.Duration
	// clock times calls (time.Now; tests replace it).
	clock func() time.Time

	calls     *prometheus.CounterVec   // model, endpoint, api, result
	latency   *prometheus.HistogramVec // model, api
	fallbacks *prometheus.CounterVec   // model, reason
	lookups   *prometheus.CounterVec   // model, result (hit, miss)
}

// renderHealth is what the gateway learnt of one endpoint's render calls.
type renderHealth struct {
	api   atomic.Int32 // apiRender, apiTokenize or apiNone
	until atomic.Int64 // not asked before (unix ns)
	fails atomic.Int32 // failures in a row
}

// renderBuckets: a render is a chat template and a tokenization, 0.5 ms to
// about a second (seconds).
var renderBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}

func newEngineRender(reg prometheus.Registerer, transport http.RoundTripper) (*engineRender, error) {
	r := &engineRender{
		// Redirects are not followed: the request carries the endpoint's
		// credentials (coldstart.go's wakePost says why).
		client: &http.Client{Transport: transport, CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		}},
		backoff: errorBackoff,
		clock:   time.Now,
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "render_requests_total",
			Help: "Engine render calls of render: engine pools, by model, endpoint, api (render, tokenize) and result (ok, timeout, error, unsupported, rejected, rejected_slow, canceled)."},
			[]string{"model", "endpoint", "api", "result"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "infergate", Name: "render_duration_seconds",
			Help: "Duration of engine render calls, answered or not (seconds).", Buckets: renderBuckets}, []string{"model", "api"}),
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "render_fallbacks_total",
			Help: "Requests of render: engine pools routed on the gateway's own tokens (the tokenizers entry, else cl100k_base), by model and reason (timeout, error, unsupported, rejected, rejected_slow, no_endpoint, saturated, canceled)."},
			[]string{"model", "reason"}),
		lookups: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "infergate", Name: "render_cache_lookups_total",
			Help: "Render answer cache lookups of render: engine pools, by model and result (hit, miss)."}, []string{"model", "result"}),
	}
	r.cache.init(renderCacheEntries, renderCacheIDs)
	for _, c := range []prometheus.Collector{r.calls, r.latency, r.fallbacks, r.lookups} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register gateway metrics: %w", err)
		}
	}
	return r, nil
}

// engineTokens appends to dst the engine's token ids of x's prompt for
// pool p (a render: engine pool): from the cache, or from a render call to
// one of p's endpoints. ok is false when the request has no prompt to
// render (token ids given, or another API) or the call failed (counted as
// a fallback): the caller then tokenizes itself.
func (g *Gateway) engineTokens(ctx context.Context, dst []uint32, x *exchange, kind apiKind, p *pool) ([]uint32, bool) {
	r := g.render
	switch {
	case kind == kindChat:
	case kind == kindCompletion && len(x.comp.Prompt.Texts) > 0:
	default:
		return dst, false
	}
	body := x.upstreamBody()
	key := renderKey(p.model, kind, body)
	if ids, ok := r.cache.get(dst, key); ok {
		p.renderHits.Inc()
		return ids, true
	}
	p.renderMisses.Inc()
	// The pool's calls in flight are bounded (render_concurrency): each
	// holds its answer, up to MaxRenderResponseBytes, until parsed.
	if p.renderMax > 0 {
		if p.renderInFlight.Add(1) > p.renderMax {
			p.renderInFlight.Add(-1)
			r.fallbacks.WithLabelValues(p.model, renderSaturated).Inc()
			return dst, false
		}
		defer p.renderInFlight.Add(-1)
	}
	ep, h := r.pick(p, time.Now())
	if ep == nil {
		r.fallbacks.WithLabelValues(p.model, renderNoEndpoint).Inc()
		return dst, false
	}
	callCtx, cancel := context.WithTimeout(ctx, p.renderTimeout)
	defer cancel()
	start := len(dst)
	ids, reason := r.call(ctx, callCtx, dst, ep, h, p.model, kind, x, body, p.renderTimeout)
	if reason != renderOK {
		r.fallbacks.WithLabelValues(p.model, reason).Inc()
		return ids[:start], false
	}
	r.cache.put(key, ids[start:])
	return ids, true
}

// pick returns a ready endpoint of p that is not backing off at now, in
// rotation, and its render state; nil if none.
func (r *engineRender) pick(p *pool, now time.Time) (*endpoint, *renderHealth) {
	n := len(p.endpoints)
	if n == 0 {
		return nil, nil
	}
	first := int(r.next.Add(1) % uint64(n))
	for k := range n {
		ep := p.endpoints[(first+k)%n]
		if ep == vacant || !ep.ready.Load() {
			continue
		}
		h := r.healthOf(ep.name)
		if h.until.Load() > now.UnixNano() {
			continue
		}
		return ep, h
	}
	return nil, nil
}

func (r *engineRender) healthOf(name string) *renderHealth {
	if v, ok := r.health.Load(name); ok {
		return v.(*renderHealth)
	}
	v, loaded := r.health.LoadOrStore(name, &renderHealth{})
	if !loaded && r.healthN.Add(1) > maxRenderHealth {
		r.health.Clear()
		r.healthN.Store(0)
	}
	return v.(*renderHealth)
}

// call asks ep for the ids (render, or /tokenize for an engine known to
// lack render, or after render answered that it has none) and records the
// outcome against ep. It returns dst with the ids appended and
// renderOK, or dst unchanged in length and the failure.
//
// ctx is the call's (render_timeout), parent the request's: a call cut
// short because the client went away says nothing of the endpoint.
func (r *engineRender) call(parent, ctx context.Context, dst []uint32, ep *endpoint, h *renderHealth, model string, kind apiKind,
	x *exchange, body []byte, timeout time.Duration) ([]uint32, string) {
	api := int(h.api.Load())
	if api == apiNone {
		api = apiRender // its unsupportedBackoff is over: try again
	}
	for {
		reqBody, path := body, "/v1/chat/completions/render"
		switch {
		case api == apiTokenize:
			reqBody, path = tokenizeBody(model, kind, x, body), "/tokenize"
		case kind == kindCompletion:
			path = "/v1/completions/render"
		}
		t0 := r.clock()
		ids, status, err := r.post(ctx, dst, ep, path, reqBody)
		took := r.clock().Sub(t0)
		r.latency.WithLabelValues(model, renderAPINames[api]).Observe(took.Seconds())
		result := renderResult(err, parent.Err() != nil, ctx.Err() != nil, status, took, timeout)
		r.calls.WithLabelValues(model, ep.name, renderAPINames[api], result).Inc()
		switch result {
		case renderOK:
			h.api.Store(int32(api))
			h.fails.Store(0)
			return ids, renderOK
		case renderUnsupported:
			if api == apiRender {
				api = apiTokenize
				continue
			}
			h.api.Store(apiNone)
			h.until.Store(time.Now().Add(unsupportedBackoff).UnixNano())
		case renderTimeout, renderError, renderSlowReject:
			n := h.fails.Add(1)
			d := r.backoff << min(n-1, 16)
			h.until.Store(time.Now().Add(min(d, max(maxBackoff, r.backoff))).UnixNano())
		}
		return ids, result
	}
}

// renderResult classifies one render call: err and status are post's,
// canceled and timedOut whether the request's and the call's contexts
// ended, took the call's duration (s) and timeout its render_timeout.
func renderResult(err error, canceled, timedOut bool, status int, took, timeout time.Duration) string {
	switch {
	case err != nil && canceled:
		return renderCanceled
	case err != nil && timedOut:
		return renderTimeout
	case errors.Is(err, errNoRoute) || status == http.StatusMethodNotAllowed:
		return renderUnsupported
	case err != nil || status >= 500:
		return renderError
	case status < 400 && status != http.StatusOK:
		// A redirect (not followed: render.go's client) or another
		// 1xx–3xx is the endpoint's doing, not a refusal of this
		// request: it backs off like an unreadable answer.
		return renderError
	case status != http.StatusOK && took > timeout/2:
		// A refusal that used over half the call's budget: whatever it
		// says of the request, the endpoint is too slow to answer within
		// render_timeout reliably (its latency need only double, as under
		// load, to time out), and the backoff exists to bound what render
		// adds to a request, so it backs off as for a timeout. A quick
		// refusal says the request is bad, not the endpoint.
		return renderSlowReject
	case status != http.StatusOK:
		return renderRejected // e.g. a model the engine does not serve
	}
	return renderOK
}

// errNoRoute: the engine answered FastAPI's {"detail": "Not Found"} for a
// path it does not serve (an OpenAI error body is a refusal of the request).
var errNoRoute = errors.New("engine has no such route")

// post sends body to ep's path and parses the ids of a 200 answer into
// dst. For a 404 it returns errNoRoute when the body is FastAPI's, not an
// OpenAI error.
func (r *engineRender) post(ctx context.Context, dst []uint32, ep *endpoint, path string, body []byte) ([]uint32, int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ep.base+path, bytes.NewReader(body))
	if err != nil {
		return dst, 0, err
	}
	if spec := ep.spec.Load(); spec != nil {
		for k, v := range spec.header {
			req.Header[k] = v
		}
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := r.client.Do(req)
	if err != nil {
		return dst, 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, MaxRenderResponseBytes+1))
	if err != nil {
		return dst, resp.StatusCode, err
	}
	if len(b) > MaxRenderResponseBytes {
		return dst, resp.StatusCode, fmt.Errorf("render answer larger than %d bytes", MaxRenderResponseBytes)
	}
	switch resp.StatusCode {
	case http.StatusOK:
		start := len(dst)
		ids, err := parseRenderIDs(dst, b, maxRenderIDs)
		if err != nil {
			return ids[:start], resp.StatusCode, err
		}
		return ids, resp.StatusCode, nil
	case http.StatusNotFound:
		if _, _, ok := topMember(b, "detail"); ok {
			if _, _, isErr := topMember(b, "error"); !isErr {
				return dst, resp.StatusCode, errNoRoute
			}
		}
	}
	return dst, resp.StatusCode, nil
}

// tokenizeBody is the POST /tokenize body asking for the ids of x's
// prompt: the members of body that vLLM's TokenizeChatRequest and
// TokenizeCompletionRequest read (the first prompt of a completion).
func tokenizeBody(model string, kind apiKind, x *exchange, body []byte) []byte {
	b := append(make([]byte, 0, len(body)+64), `{"model":`...)
	b = appendJSONString(b, model)
	members := []string{"add_special_tokens"}
	if kind == kindChat {
		members = []string{"messages", "tools", "add_generation_prompt", "continue_final_message",
			"chat_template", "chat_template_kwargs", "add_special_tokens"}
	} else {
		b = append(b, `,"prompt":`...)
		b = appendJSONString(b, x.comp.Prompt.Texts[0])
	}
	for _, m := range members {
		if v := memberValue(body, m); v != nil {
			b = append(b, ',', '"')
			b = append(b, m...)
			b = append(b, '"', ':')
			b = append(b, v...)
		}
	}
	return append(b, '}')
}

// renderIgnored are the top-level request members that cannot change a
// prompt's ids (vLLM's ChatCompletionRequest and CompletionRequest:
// sampling, output, streaming and bookkeeping), left out of the cache key.
var renderIgnored = map[string]bool{
	"max_tokens": true, "max_completion_tokens": true, "temperature": true, "top_p": true, "top_k": true,
	"min_p": true, "n": true, "stream": true, "stream_options": true, "seed": true, "stop": true,
	"stop_token_ids": true, "user": true, "logprobs": true, "top_logprobs": true, "frequency_penalty": true,
	"presence_penalty": true, "repetition_penalty": true, "logit_bias": true, "ignore_eos": true,
	"min_tokens": true, "skip_special_tokens": true, "spaces_between_special_tokens": true,
	"priority": true, "request_id": true, "metadata": true, "store": true, "service_tier": true,
	"response_format": true, "parallel_tool_calls": true, "kv_transfer_params": true,
}

// renderKey is the cache key of a render of body for model's pool through
// kind: xxhash over the model, the API and each top-level member not in
// renderIgnored, in order (key and raw value).
func renderKey(model string, kind apiKind, body []byte) uint64 {
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString(model)
	sep := [3]byte{0, byte(kind), 0}
	_, _ = d.Write(sep[:])
	_ = jsonscan.Object(body, maxRenderDepth, func(m jsonscan.Member) bool {
		if !renderIgnored[string(m.Key)] {
			_, _ = d.Write(m.Raw)
			_, _ = d.Write(sep[:1])
		}
		return true
	})
	return d.Sum64()
}

// renderCache is an LRU of render answers: key → ids, bounded in entries
// and in ids over all entries. Safe for concurrent use.
type renderCache struct {
	mu         sync.Mutex
	entries    map[uint64]*renderEntry
	head       renderEntry // sentinel: head.next most recent, head.prev least
	ids        int
	maxEntries int
	maxIDs     int
}

type renderEntry struct {
	key        uint64
	ids        []uint32
	prev, next *renderEntry
}

func (c *renderCache) init(maxEntries, maxIDs int) {
	c.entries = make(map[uint64]*renderEntry, maxEntries)
	c.head.prev, c.head.next = &c.head, &c.head
	c.maxEntries, c.maxIDs = maxEntries, maxIDs
}

func (c *renderCache) unlink(e *renderEntry) { e.prev.next, e.next.prev = e.next, e.prev }

func (c *renderCache) front(e *renderEntry) {
	e.prev, e.next = &c.head, c.head.next
	c.head.next.prev = e
	c.head.next = e
}

// get appends key's ids to dst.
func (c *renderCache) get(dst []uint32, key uint64) ([]uint32, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.entries[key]
	if !ok {
		return dst, false
	}
	c.unlink(e)
	c.front(e)
	return append(dst, e.ids...), true
}

// put stores a copy of ids under key, evicting the least recently used
// entries past the bounds; an answer larger than half the id bound is not
// kept (it would evict most of the cache for one prompt).
func (c *renderCache) put(key uint64, ids []uint32) {
	if len(ids) > c.maxIDs/2 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.entries[key]; ok {
		c.ids -= len(e.ids)
		c.unlink(e)
		delete(c.entries, key)
	}
	for len(c.entries) > 0 && (len(c.entries) >= c.maxEntries || c.ids+len(ids) > c.maxIDs) {
		old := c.head.prev
		c.unlink(old)
		delete(c.entries, old.key)
		c.ids -= len(old.ids)
	}
	e := &renderEntry{key: key, ids: append([]uint32(nil), ids...)}
	c.entries[key] = e
	c.front(e)
	c.ids += len(ids)
}
