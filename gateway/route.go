package gateway

import (
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/hftokenizer"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/replica"
	"github.com/infergate/infergate/sched"
)

// prepareTarget readies x to be sent to pool p: the model sent (an alias
// target's name spliced into the body; a LoRA adapter's kept, its name in
// sched.Request.Adapter), and the routing hashes under p's seed (the
// adapter's for an adapter) when its policy needs them.
func (g *Gateway) prepareTarget(w http.ResponseWriter, r *http.Request, x *exchange, kind apiKind, p *pool) *openai.Error {
	x.sreq.Model = p.model
	x.sreq.Adapter = x.adapterOn(p)
	x.sreq.Hashes, x.sreq.PromptTokens = nil, 0
	if p.model != x.model && kind != kindResponseByID && x.sreq.Adapter != x.model {
		if e := g.aliasTarget(w, x, p); e != nil {
			return e
		}
	}
	if (p.policy.NeedsHashes() || p.precise != nil || p.pd != nil) && x.routable(kind) {
		want := uint8(1)
		if p.precise != nil {
			want = 2
		}
		if x.pass.toks != want { // once for all targets
			ok := false
			if p.engineRender {
				x.toks, ok = g.engineTokens(r.Context(), x.toks[:0], x, kind, p)
				x.pass.routeToks = x.toks
			}
			if !ok {
				x.pass.routeToks = x.promptTokens(kind, p, want == 2)
			}
			x.pass.toks = want
		}
		tokens := x.pass.routeToks
		seed := p.seed
		switch a := x.sreq.Adapter; {
		case a != "":
			// The adapter's own identity (adapters.go), as the precise
			// index keys its KV events (fleet.KVSeeds).
			seed = prefix.Seed(a + "\x00" + x.salt)
		case x.salt != "":
			seed = prefix.Seed(p.model + "\x00" + x.salt)
		}
		x.hashes = prefix.Hashes(x.hashes[:0], tokens, p.blockSize, seed)
		x.sreq.Hashes, x.sreq.PromptTokens = x.hashes, len(tokens)
	}
	return nil
}

// serveRouted is the request's lifecycle once its model's pool is known:
// admission (queueing when the pool is full), pick, proxy, and retries on
// other endpoints of failures that reached the client with no byte. Each
// pick is made in the newest pool of the model (pool.latest): a request
// that was waiting or retrying when a reload replaced its pool goes to the
// new set of endpoints, never to one the reload removed. It reports true,
// having answered nothing, when the request may fall back to the next
// target of its alias (x.pass.fallback) and p could not serve it
// (x.pass.fell says why); otherwise the request was answered.
func (g *Gateway) serveRouted(w http.ResponseWriter, r *http.Request, x *exchange, kind apiKind, p *pool,
	reqID string, start time.Time) (fell bool) {
	if x.edge.capPriority && x.sreq.Priority > x.edge.maxPriority {
		x.sreq.Priority = x.edge.maxPriority // the key's grant
	}
	if !g.admitQueued(w, r, p, x) {
		return x.pass.fell != ""
	}
	w, endStream := x.hb.stream(w) // a heartbeat committed the answer (scale from zero)
	defer endStream()
	g.stripClientParams(x, kind)
	gate, budget := p.gate, p.budget // kept by the model's later pools
	defer gate.release()

	excluded := x.excludedFor(len(p.endpoints))
	x.pinned(p, excluded)
	var (
		last     *failure
		retrying bool // holds a retry-budget token
	)
	defer func() {
		if retrying {
			budget.done()
		}
	}()
	split := x.pdRoutable(kind, p)
	if split {
		defer g.endSplit(x, p)
	}
	g.replicas.stagger(r.Context(), p) // this replica's turn in a burst (replicas.go)
	for attempt := 1; ; attempt++ {
		if n := p.latest(); n != p {
			// Slots keep their endpoint across reloads: what failed
			// stays excluded.
			p, excluded = n, x.resizeExcluded(len(n.endpoints))
			x.pinned(p, excluded)
		}
		var (
			i int
			d sched.Decision
		)
		switch {
		case split && p.pd == nil: // a reload made it a plain pool
			i, d = g.pickExcluding(p, &x.sreq, excluded)
		case split && attempt == 1:
			i, d = g.pickSplit(r, x, kind, p, excluded, reqID)
		case split:
			i, d = g.pickDecodeRetry(r, x, kind, p, excluded, reqID)
		default:
			i, d = g.pickExcluding(p, &x.sreq, excluded)
		}
		if attempt == 1 {
			gate.picked()
		}
		if i < 0 {
			if last == nil {
				if x.pass.fallback {
					x.pass.fell = fallbackNoEndpoint
					return true
				}
				x.refundKey(w.Header()) // never sent: not admitted
				g.failNoEndpoint(w, p, x)
				return false
			}
			g.res.retriesDenied.WithLabelValues(p.model, "no_endpoint").Inc()
			return g.answerFailure(w, x, last)
		}
		if attempt > 1 {
			g.res.retries.WithLabelValues(p.model, last.rm.labels[1], last.reason).Inc()
		}
		if x.pass.tries++; x.pass.tries > 1 {
			w.Header()[AttemptsHeader] = []string{strconv.Itoa(x.pass.tries)}
		}
		f := g.attempt(w, r, x, kind, p, i, d, reqID, start)
		if split {
			g.decodeDone(x, p, f)
		}
		x.obs.attemptFailed(f)
		if f == nil {
			return false
		}
		last = f
		excluded[i] = true
		switch {
		case r.Context().Err() != nil:
			g.canceled(w, r, f.rm) // nothing reached the client
			return false
		case attempt >= g.cfg.Retry.MaxAttempts || !x.retrySafe(f) || x.pass.pinEP != nil:
			return g.answerFailure(w, x, f)
		case f.reason == reasonEndpointDown:
			// Not charged to the retry budget: the endpoint left rotation,
			// so the request would have gone elsewhere had it come a moment
			// later, and a frozen engine's requests are aborted all at once
			// (upstream/wait.go). The budget, sized against overload, turned
			// such a burst into 502s while the other engines idled (16 of
			// 40 in the second attack run).
		case f.connectionFailed() && !p.endpoints[i].ready.Load():
			// Not charged either: the connection failed on an endpoint
			// that is out of rotation now (this failure or an earlier one
			// of the same outage ejected it, or its probes failed). An
			// engine that dies with requests waiting for their first byte
			// fails them all at once, as a frozen one does; charged, the
			// ones beyond the budget were 502s while the survivors idled
			// (TestChaosKillEngine on a loaded host).
		case !retrying:
			if !budget.take(gate.active.Load(), g.cfg.Retry.BudgetPercent, g.cfg.Retry.MinRetryConcurrency) {
				g.res.retriesDenied.WithLabelValues(p.model, "budget").Inc()
				return g.answerFailure(w, x, f)
			}
			retrying = true
		}
	}
}

// excludedFor returns x's per-request endpoint exclusion flags, n of them,
// all false.
func (x *exchange) excludedFor(n int) []bool {
	if cap(x.excluded) < n {
		x.excluded = make([]bool, n)
	}
	x.excluded = x.excluded[:n]
	clear(x.excluded)
	return x.excluded
}

// resizeExcluded returns x's exclusion flags resized to n, the first ones
// kept (a reload gave the pool more or fewer slots).
func (x *exchange) resizeExcluded(n int) []bool {
	if k := len(x.excluded); n > k {
		x.excluded = append(x.excluded, make([]bool, n-k)...)
	}
	x.excluded = x.excluded[:n]
	return x.excluded
}

// pinned excludes, when x is pinned to the endpoint that stored a response
// (responses.go), every endpoint of p but that one. The pin is the
// endpoint itself, not its slot: a reload that removed it leaves nothing
// to pick (a new endpoint in its slot holds none of its responses).
func (x *exchange) pinned(p *pool, excluded []bool) {
	if x.pass.pinEP == nil {
		return
	}
	for j, ep := range p.endpoints {
		if ep != x.pass.pinEP {
			excluded[j] = true
		}
	}
}

// pickExcluding asks p's policy for an endpoint, treating as not ready those
// excluded (failed earlier in this request) and those at their
// circuit-breaker limit, and takes a breaker slot on the pick. It returns
// the index and decision, or -1 when no endpoint can take the request.
func (g *Gateway) pickExcluding(p *pool, req *sched.Request, excluded []bool) (int, sched.Decision) {
	limit := p.maxRequests
	snap := p.snapshotRuledOut(req, excluded, limit)
	defer p.release(snap)
	defer g.settleLater(p)
	s := *snap
	if p.peers != nil && p.pd == nil {
		// Other replicas: this one's share marked, the load they are
		// expected to have routed unseen added (replicas.go).
		g.replicas.expect(s)
	}
	for round := range len(s) { // each round takes a slot or rules one endpoint out
		if round > 0 { // the first round's in the snapshot
			p.ruleOut(s, req, excluded, limit)
		}
		d := p.policy.Pick(req, s)
		if d.Endpoint < 0 || d.Endpoint >= len(s) || !s[d.Endpoint].Ready {
			return -1, d
		}
		if p.endpoints[d.Endpoint].tryAcquire(limit) {
			if p.peers != nil {
				g.replicas.learnt(p, d.Endpoint, req, d)
			}
			markAdapterPick(p, req, &s[d.Endpoint])
			return d.Endpoint, d
		}
		releasePick(p, d.Endpoint, req)
		s[d.Endpoint].Ready = false // filled up since the snapshot
	}
	return -1, sched.Decision{Endpoint: -1}
}

// ruleOut marks not ready in s, a snapshot of p, the endpoints excluded
// (failed earlier in this request), those at the circuit breaker's limit,
// and, for a LoRA adapter's request, those whose engine does not list the
// adapter (Endpoint.Models, adapters.go). The breaker bounds this
// replica's own requests: the peers' add to the snapshot's InFlight
// (p.peers), not to the ledger.
func (p *pool) ruleOut(s []sched.Endpoint, req *sched.Request, excluded []bool, limit int) {
	for i := range s {
		if excluded[i] || int(p.endpoints[i].ledger.InFlight()) >= limit || !serves(s[i].Models, req.Adapter) {
			s[i].Ready = false
		}
	}
}

// AttemptsHeader is set on a response that needed more than one attempt:
// the number of attempts (endpoints tried).
const AttemptsHeader = "X-Infergate-Attempts"

// retryBudget bounds the retries in flight of one pool.
type retryBudget struct {
	inFlight atomic.Int64
}

// take reserves a retry if fewer than max(minConc, pct% of active) are in
// flight.
func (b *retryBudget) take(active int64, pct float64, minConc int) bool {
	limit := max(int64(minConc), int64(float64(active)*pct/100))
	if b.inFlight.Add(1) > limit {
		b.inFlight.Add(-1)
		return false
	}
	return true
}

func (b *retryBudget) done() { b.inFlight.Add(-1) }

// pool is the endpoints serving one model and the policy that picks among
// them, as one configuration has them: a reload builds new pools, which
// keep the state of the old ones (policy, indexes, admission gate, retry
// budget) as far as the endpoints remain (reload.go). Entry i of
// endpoints, routes, scrapes and every snapshot is the same endpoint, slot
// i: a slot keeps its endpoint across reloads, a removed endpoint's slot
// holds vacant until a new endpoint takes it, so the per-slot state of the
// policy and the precise index stays the same endpoint's.
type pool struct {
	model  string
	policy sched.Policy
	// pdPool is a P/D pool's decisions, roles and bootstrap ports (pd.go;
	// pd nil: not a P/D pool). policy is then pd's decode profile.
	pdPool
	endpoints []*endpoint
	routes    []*routeMetrics // per endpoint
	scrapes   []*scrapeFeed   // per endpoint, nil when not scraped
	scraped   bool            // some endpoint is
	capacity  []int           // per endpoint: the policy's bound (routing blocks)
	pcap      []int           // per endpoint: the precise index's bound (0: none)
	// mcap is each endpoint's per-medium bound in the precise index
	// (kv_events.tiers; 0: none).
	mcap [][prefix.NumMedia]int
	// store is the model's kv_store (nil: none), whose blocks the precise
	// index holds in its last slot (storeSlot); tiers what the policy is told of the
	// tiers (nil: GPU only).
	store *KVStoreConfig
	tiers *sched.Tiers
	// preciseSlots is the number of slots of the precise index as this
	// pool uses it (the index may have grown since, for the pool that
	// replaces this one: storeSlot).
	preciseSlots int
	// policySlots is the number of slots the policy has (built for, or
	// grown to: sched.Grower).
	policySlots int
	live        int           // endpoints that are not vacant
	none        *routeMetrics // errors before an endpoint was picked
	blockSize   int           // routing block size (tokens)
	seed        uint64        // prefix.Seed(model + "\x00"): no cache salt
	snapshots   sync.Pool     // *[]sched.Endpoint
	// settleQueued: the pool waits in Gateway.settles (learning.go).
	settleQueued atomic.Bool
	// precise is the pool's index fed by its endpoints' KV events (nil
	// unless every endpoint publishes them); precisePolicy: the policy
	// scores with it, so its prediction is the policy's.
	precise       *prefix.PreciseIndex
	precisePolicy bool
	// tokenizer and segments tokenize prompts for the policy and the
	// precise index (nil when neither needs hashes).
	tokenizer *prefix.Tokenizer
	segments  *prefix.SegmentCache
	// hf is the model's own tokenizer (config tokenizers), nil for the
	// cl100k fallback; when set it tokenizes every prompt (hftokens.go).
	hf *hftokenizer.Tokenizer
	// adapter is the pool's model when its engines list that model as a
	// LoRA adapter (an adapter configured as a model of its own), else "";
	// served is, per slot, the model names the engine lists of those the
	// pool serves (its model and adapters, sorted; nil: unknown, all of them), nil
	// when the pool has no adapters (adapters.go).
	adapter string
	served  [][]string
	// loraPicks are infergate_lora_picks_total's children of the pool's
	// model by placement (nil without adapters).
	loraPicks [numPlacements]prometheus.Counter
	// engineRender: routing asks the endpoints for the ids (config render:
	// engine; render.go), within renderTimeout a call, at most renderMax
	// calls at once (render_concurrency; renderInFlight counts them).
	engineRender   bool
	renderTimeout  time.Duration
	renderMax      int32
	renderInFlight *atomic.Int32 // the model's: shared by the pools reloads put in its place
	// renderHits and renderMisses are the model's render cache lookups
	// (infergate_render_cache_lookups_total), resolved at build.
	renderHits, renderMisses prometheus.Counter
	// maxModelLen is the longest context of its endpoints (tokens).
	maxModelLen int
	// maxRequests is the circuit breaker's bound per endpoint.
	maxRequests int
	// peers is the other gateway replicas' load (replicas.go), added to
	// snapshots; nil without the exchange.
	peers *replica.Peers
	// gate is the model's admission control; budget bounds its retries
	// (admission.go, route.go). Both outlive reloads with the model.
	gate   *admission
	budget *retryBudget
	// modelJSON is the model name as a JSON string and modelHeader as a
	// header value (alias.go).
	modelJSON   []byte
	modelHeader []string
	// next is the pool of the same model that a reload published in its
	// place (nil while this one is in force, or after its model was
	// removed).
	next atomic.Pointer[pool]
}

// latest returns the model's pool in force: p, or the one reloads put in
// its place.
func (p *pool) latest() *pool {
	for n := p.next.Load(); n != nil; n = p.next.Load() {
		p = n
	}
	return p
}

// snapshot returns the pool's endpoints as the scheduler sees them now
// (readiness and in-flight counts read from atomics) in a pooled slice;
// return it with release.
func (p *pool) snapshot() *[]sched.Endpoint { return p.snapshotRuledOut(nil, nil, 0) }

// snapshotRuledOut is snapshot, and for a request (req not nil) ruleOut
// in the same pass: one read of each endpoint's state instead of two, the
// breaker's count the one the snapshot holds (this replica's own, before
// the peers' share is added). Until 2026-12-05 ruleOut was a second pass
// over the pool's endpoints on every pick (BenchmarkEPPDecision).
func (p *pool) snapshotRuledOut(req *sched.Request, excluded []bool, limit int) *[]sched.Endpoint {
	sp, _ := p.snapshots.Get().(*[]sched.Endpoint)
	if sp == nil {
		s := make([]sched.Endpoint, len(p.endpoints))
		sp = &s
	}
	s := *sp
	var now time.Time
	if p.scraped || p.peers != nil {
		now = time.Now()
	}
	for i, ep := range p.endpoints {
		s[i] = sched.Endpoint{Name: ep.name, Ready: ep.ready.Load()}
		if p.roles != nil {
			s[i].Role = p.roles[i]
		}
		if p.served != nil {
			s[i].Models = p.served[i]
		}
		ep.ledger.Fill(&s[i])
		if req != nil && (excluded[i] || s[i].InFlight >= limit || !serves(s[i].Models, req.Adapter)) {
			s[i].Ready = false
		}
		if p.peers != nil {
			p.peers.Add(ep.name, clock(now), &s[i])
		}
		if f := p.scrapes[i]; f != nil {
			if l, _, ok := f.latest(now); ok && l.HasQueue {
				e := &s[i]
				e.Metrics, e.Waiting, e.Running = true, l.Waiting, l.Running
				e.KVUtil = -1 // no gauge: left unscored by the kv-utilization scorer
				if l.HasKVUtil {
					e.KVUtil = l.KVUtil
				}
				if l.LoRA.Known {
					e.Adapters, e.MaxAdapters = loraAdapters(l.LoRA), l.LoRA.Max
				}
			}
		}
	}
	return sp
}

// loraAdapters are the adapters an engine has loaded: those with running or
// waiting requests (vllm:lora_requests_info). It allocates only when both
// lists are non-empty.
func loraAdapters(st fleet.LoRAState) []string {
	switch {
	case len(st.Waiting) == 0:
		return st.Running
	case len(st.Running) == 0:
		return st.Waiting
	}
	return append(append(make([]string, 0, len(st.Running)+len(st.Waiting)), st.Running...), st.Waiting...)
}

func (p *pool) release(sp *[]sched.Endpoint) { p.snapshots.Put(sp) }
