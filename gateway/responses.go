package gateway

import (
	"container/heap"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"

	"github.com/infergate/infergate/openai"
)

// The Responses API (POST /v1/responses; vLLM's serving_responses.py).
//
// Routing. A request that starts a conversation is rendered like a chat —
// its instructions as a system message, then its input items
// (openai.ResponsesRequest.AppendMessages) — and routed prefix-aware like
// one: that rendering is what vLLM feeds its chat template, so requests
// sharing instructions and earlier items share a prefix. A request with
// previous_response_id continues a conversation whose earlier turns only
// the engine that stored the response holds (vLLM keeps responses and
// their messages in its process's memory): it is pinned to that endpoint,
// learnt from the answers (responseAffinity); its own input is not the
// prompt's prefix, so it is not hashed. The same holds for GET and DELETE
// /v1/responses/{id} and POST /v1/responses/{id}/cancel.
//
// Accounting. Usage comes from the non-streaming body or the stream's
// terminal event (response.completed, .incomplete or .failed):
// input_tokens, output_tokens and input_tokens_details.cached_tokens count
// as prompt, completion and cached prompt tokens. TTFT is taken at the first
// event carrying output (any response.*.delta with a non-empty delta:
// output_text, refusal, reasoning_text, function_call_arguments, …); events
// before it (response.created, .in_progress, .output_item.added,
// .content_part.added) are held with the status line, so a stream that
// fails before its first output is retried elsewhere as a chat's is. A
// stream is complete at EOF after its terminal event (vLLM sends no
// [DONE]); a break before it ends the stream with an "error" event
// (OpenAI's ResponseErrorEvent shape).

// DefaultAffinityMaxEntries bounds the response ids the gateway remembers
// (100,000: ~12 MB; past it the oldest id of the key holding the most is
// forgotten (responseAffinity), and a continuation of it is then routed as
// the gateway would route an unknown id).
const DefaultAffinityMaxEntries = 100_000

// maxResponseIDBytes bounds a response id the gateway learns (vLLM's are
// "resp_" and 32 hex digits; a client's request_id names it otherwise).
const maxResponseIDBytes = 256

// ResponsesConfig configures the Responses API's session affinity.
type ResponsesConfig struct {
	// AffinityMaxEntries bounds the response ids remembered with the
	// endpoint that stored them (default 100000; negative: none, every
	// continuation is routed by load).
	AffinityMaxEntries int `yaml:"affinity_max_entries"`
}

func (c ResponsesConfig) withDefaults() ResponsesConfig {
	if c.AffinityMaxEntries == 0 {
		c.AffinityMaxEntries = DefaultAffinityMaxEntries
	}
	return c
}

func (c ResponsesConfig) validate() []error {
	if c.AffinityMaxEntries > 100_000_000 {
		return []error{fmt.Errorf("responses.affinity_max_entries %d: at most 100000000", c.AffinityMaxEntries)}
	}
	return nil
}

// responseAffinity maps response ids to the endpoint that stored them and
// the key that created them, at most max entries. It outlives reloads: an
// entry names the endpoint itself (an endpoint a reload keeps is the same
// object, reload.go), not its slot, so a continuation is never sent to an
// endpoint a reload removed, nor to a new one that took its slot (neither
// holds the response: the continuation is answered as for an unknown
// response), and the key by its name (a reload rebuilds the principals;
// a key kept by name keeps its responses).
//
// Full, it forgets the oldest id of the key holding the most (max-min
// fair): one key creating responses fast evicts its own, not the others'
// (with a single first-in first-out list, any key could make every other
// key's conversations unreachable by creating affinity_max_entries
// responses). Without authentication there is one owner and this is
// first-in first-out. The owners are kept in a max-heap by how many ids
// they hold: O(log owners) per new id (a scan of the owners cost 1.8 ms
// per id under the lock with 100,000 keys).
type responseAffinity struct {
	mu     sync.Mutex
	max    int
	m      map[string]affinityEntry
	order  map[string]*idQueue // per owner, its ids oldest first
	owners ownerHeap           // the queues, the longest first
	// reserved are the request_ids of requests in flight (reserve).
	reserved map[string]reservation
}

// idQueue is one owner's first-in first-out queue of ids, and its place in
// the owners' heap.
type idQueue struct {
	owner string
	ids   []string
	head  int
	at    int // index in ownerHeap
}

func (q *idQueue) len() int { return len(q.ids) - q.head }

func (q *idQueue) push(id string) { q.ids = append(q.ids, id) }

func (q *idQueue) pop() string {
	id := q.ids[q.head]
	q.ids[q.head] = ""
	q.head++
	if q.head > 1024 && q.head > len(q.ids)/2 { // compact: memory stays O(len)
		q.ids = append(q.ids[:0], q.ids[q.head:]...)
		q.head = 0
	}
	return id
}

// ownerHeap is a max-heap of queues by length (container/heap).
type ownerHeap []*idQueue

func (h ownerHeap) Len() int           { return len(h) }
func (h ownerHeap) Less(i, j int) bool { return h[i].len() > h[j].len() }
func (h ownerHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].at, h[j].at = i, j
}
func (h *ownerHeap) Push(x any) {
	q := x.(*idQueue)
	q.at = len(*h)
	*h = append(*h, q)
}
func (h *ownerHeap) Pop() any {
	old := *h
	q := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return q
}

// affinityEntry is where a response is stored: endpoint ep, serving model,
// made with the key named owner ("": authentication off).
type affinityEntry struct {
	model string
	ep    *endpoint
	owner string
}

func newResponseAffinity(max int) *responseAffinity {
	if max <= 0 {
		return &responseAffinity{}
	}
	return &responseAffinity{max: max, m: make(map[string]affinityEntry, min(max, 1024)), order: map[string]*idQueue{}}
}

// learn records that endpoint ep, serving model, stored response id, made
// by owner (nil: authentication off).
func (a *responseAffinity) learn(id, model string, ep *endpoint, owner *principal) {
	if a.max == 0 || id == "" || len(id) > maxResponseIDBytes {
		return
	}
	e := affinityEntry{model: model, ep: ep}
	if owner != nil {
		e.owner = owner.Name
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if old, ok := a.m[id]; ok {
		// The id again (a client's request_id): the latest store, unless
		// another key made it. claimResponseID refuses that request_id;
		// two keys' requests racing with it get here, and the response
		// stays its first owner's (a key never takes over another's id).
		if old.owner == e.owner {
			a.m[id] = e
		}
		return
	}
	if len(a.m) >= a.max {
		a.evictLocked()
	}
	q := a.order[e.owner]
	if q == nil {
		q = &idQueue{owner: e.owner}
		a.order[e.owner] = q
		q.push(id)
		heap.Push(&a.owners, q)
	} else {
		q.push(id)
		heap.Fix(&a.owners, q.at)
	}
	a.m[id] = e
}

// evictLocked forgets the oldest id of the owner with the most ids.
func (a *responseAffinity) evictLocked() {
	if len(a.owners) == 0 {
		return
	}
	most := a.owners[0]
	delete(a.m, most.pop())
	if most.len() == 0 {
		heap.Pop(&a.owners)
		delete(a.order, most.owner)
	} else {
		heap.Fix(&a.owners, 0)
	}
}

// lookup returns where response id is stored.
func (a *responseAffinity) lookup(id string) (affinityEntry, bool) {
	if a.max == 0 {
		return affinityEntry{}, false
	}
	a.mu.Lock()
	e, ok := a.m[id]
	a.mu.Unlock()
	return e, ok
}

// len is the number of ids remembered.
func (a *responseAffinity) len() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.m)
}

// codePreviousNotFound is the code of a previous_response_id the gateway
// cannot serve (OpenAI's code for an unknown one).
const codePreviousNotFound = "previous_response_not_found"

// owned looks up response id for key under st's keys: with authentication
// on, an id created with another key is not found (response ids are scoped
// to the key that made them, as OpenAI scopes them to a project).
func (g *Gateway) owned(id string, key *principal, st *state) (affinityEntry, bool) {
	e, ok := g.affinity.lookup(id)
	if ok && st.keys != nil && (key == nil || e.owner != key.Name) {
		return affinityEntry{}, false
	}
	return e, ok
}

// claimResponseID checks a responses request's request_id (a vLLM
// extension: the id the engine stores the response under, replacing one
// it holds by that id) with authentication on: an id the gateway knows as
// another key's response is refused 400, since the engine would overwrite
// that key's response with this one's and the gateway route the id to it
// (the attack run's takeover: Bob's request_id set to Alice's response id
// made her GET and continuation 404 and his 200). The key's own ids, and
// any id with authentication off, pass: replacing one's own response is
// the extension's purpose. The id is reserved for the request's key until
// the request ends (the caller releases it: unreserve), so another key's
// concurrent request with it is refused too. An id the gateway has forgotten (past
// responses.affinity_max_entries, or from before a restart) cannot be
// checked; vLLM's ids are 128 random bits, so reaching one needs it
// leaked.
func (g *Gateway) claimResponseID(id string, key *principal, st *state) *openai.Error {
	if id == "" {
		return nil
	}
	if !pathSafeID(id) {
		// It names the response in /v1/responses/{id} later: one that
		// cannot be written there (a space, '/', non-ASCII) would be
		// stored and never retrievable.
		return openai.NewError(http.StatusBadRequest,
			fmt.Sprintf("request_id must be 1 to %d of the characters A-Z a-z 0-9 - . _ ~ :.", maxResponseIDBytes),
			"request_id", "invalid_value")
	}
	if st.keys == nil {
		return nil
	}
	owner := ""
	if key != nil {
		owner = key.Name
	}
	if !g.affinity.reserve(id, owner) {
		return openai.NewError(http.StatusBadRequest,
			fmt.Sprintf("request_id '%s' names an existing response; omit request_id or choose another.", truncate(id, maxResponseIDBytes)),
			"request_id", "invalid_value")
	}
	return nil
}

// reservation is a request_id held by requests in flight of one owner.
type reservation struct {
	owner string
	n     int
}

// reserve holds id for owner's request in flight, unless another owner
// has a response by that id or a request in flight with it: the answer is
// learnt only at its end, so without this two keys' concurrent requests
// with one request_id raced, and the first answer's key kept the id (the
// third attack run took another key's in-flight id so). Released by
// unreserve when the request ends.
func (a *responseAffinity) reserve(id, owner string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if e, ok := a.m[id]; ok && e.owner != owner {
		return false
	}
	r, held := a.reserved[id]
	if held && r.owner != owner {
		return false
	}
	if a.reserved == nil {
		a.reserved = map[string]reservation{}
	}
	a.reserved[id] = reservation{owner: owner, n: r.n + 1}
	return true
}

// unreserve releases one reserve of id.
func (a *responseAffinity) unreserve(id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if r, ok := a.reserved[id]; ok {
		if r.n <= 1 {
			delete(a.reserved, id)
		} else {
			a.reserved[id] = reservation{owner: r.owner, n: r.n - 1}
		}
	}
}

// pathSafeID reports whether id is at most maxResponseIDBytes of RFC
// 3986's unreserved characters and ':' (it can stand as a path segment
// unescaped).
func pathSafeID(id string) bool {
	if len(id) > maxResponseIDBytes {
		return false
	}
	for i := range len(id) {
		c := id[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("-._~:", c) >= 0) {
			return false
		}
	}
	return true
}

// continuationTarget resolves a responses request's previous_response_id
// among the model's targets (in st): the pool holding the endpoint that
// stored the response, x pinned to that endpoint. nil, nil when the
// gateway does not know the id and authentication is off: the request is
// then routed by load (the engine answers 404 if it does not hold the
// response). With authentication on an unknown id, or another key's, is
// refused 404 previous_response_not_found (the gateway cannot tell which
// engine holds it and will not let a key reach another key's
// conversation), as is a response stored by an endpoint that serves none
// of the targets (or that a reload removed).
func (g *Gateway) continuationTarget(x *exchange, targets []*pool, key *principal, st *state) ([]*pool, *openai.Error) {
	id := x.pass.resp.PreviousResponseID
	e, ok := g.owned(id, key, st)
	if !ok {
		if st.keys == nil {
			return nil, nil
		}
		return nil, previousNotFound(id)
	}
	for _, p := range targets {
		if slicesIndex(p.endpoints, e.ep) >= 0 {
			x.pass.pinEP, x.pass.pinID = e.ep, id
			return st.targets[p.model], nil
		}
	}
	return nil, previousNotFound(id)
}

func previousNotFound(id string) *openai.Error {
	return openai.NewError(http.StatusNotFound, fmt.Sprintf("Response with id '%s' not found.", truncate(id, maxResponseIDBytes)),
		"previous_response_id", codePreviousNotFound)
}

func slicesIndex(eps []*endpoint, ep *endpoint) int {
	for i, e := range eps {
		if e == ep {
			return i
		}
	}
	return -1
}

// responseTarget resolves /v1/responses/{id}[/…] to the pool (in st) and
// endpoint that stored the response (x pinned there, x.model its model),
// or a 404 not_found: an id the gateway does not know (or another key's,
// or stored by an endpoint a reload removed) cannot be routed, there being
// no model to route it by.
func (g *Gateway) responseTarget(x *exchange, r *http.Request, key *principal, st *state) ([]*pool, *openai.Error) {
	id := responseIDOf(r.URL.Path)
	e, ok := g.owned(id, key, st)
	var p *pool
	if ok {
		p = st.pools[e.model]
	}
	if p == nil || slicesIndex(p.endpoints, e.ep) < 0 {
		return nil, openai.NewError(http.StatusNotFound, fmt.Sprintf("Response with id '%s' not found.", truncate(id, maxResponseIDBytes)),
			"", "not_found")
	}
	x.model = e.model
	x.pass.pinEP, x.pass.pinID = e.ep, id
	// A retrieval may stream the stored events (vLLM: ?stream=true).
	x.stream = r.Method == http.MethodGet && r.URL.Query().Get("stream") == "true"
	return st.targets[e.model], nil
}

// responseBody reads a non-streaming Responses answer: its id and usage.
func responseBody(b []byte) (id string, u *openai.Usage) {
	var body struct {
		ID    string                `json:"id"`
		Usage *openai.ResponseUsage `json:"usage"`
	}
	if openai.TooDeep(b) || json.Unmarshal(b, &body) != nil {
		return "", nil
	}
	return body.ID, body.Usage.Usage()
}

// responsesErrorEvent is the event a Responses stream ends with when it
// fails after it began (OpenAI's ResponseErrorEvent: type "error", code,
// message, param, sequence_number), framed with "event: error".
func responsesErrorEvent(e *openai.Error, seq int) []byte {
	code, _ := e.Code.(string)
	b, _ := json.Marshal(struct {
		Type           string  `json:"type"`
		Code           string  `json:"code"`
		Message        string  `json:"message"`
		Param          *string `json:"param"`
		SequenceNumber int     `json:"sequence_number"`
	}{"error", code, e.Message, e.Param, seq})
	return appendEvent(nil, []byte("error"), b)
}

// responsesErrorMessage is the message of a Responses error event before
// any output ({"type":"error","message":…} or response.failed's
// response.error.message), at most 256 bytes of valid UTF-8.
func responsesErrorMessage(data []byte) string {
	var ev struct {
		Message  string `json:"message"`
		Response struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		} `json:"response"`
	}
	_ = json.Unmarshal(data, &ev)
	msg := ev.Message
	if msg == "" {
		msg = ev.Response.Error.Message
	}
	return strings.TrimSpace(truncate(msg, 256))
}
