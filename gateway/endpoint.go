package gateway

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/load"
	"github.com/infergate/infergate/upstream"
)

// endpoint is one engine (one base URL). Pools of different models may share
// it (an engine serving several models or LoRA adapters), so its in-flight
// count is the engine's whole load as the gateway sees it. It lives as long
// as its URL is configured: a reload that keeps the URL keeps the object,
// and with it the engine's live state (readiness, ejection, in-flight
// counts, learnt prefill rate), whatever else of its configuration changed
// (spec; reload.go).
type endpoint struct {
	name string // the configured URL, normalized: the metrics label
	base string // URL prefix requests are sent to (== name)
	// urls are base + each fixed path kind's path, parsed once (read-only).
	urls [numPathKinds]*url.URL
	// servedBy is the EndpointHeader value naming it ([name]; read-only).
	servedBy []string
	// addr is the URL's host:port, the port the scheme's when the URL has
	// none: the endpoint's address as an endpoint picker names it (epp.go).
	addr string

	// spec is what the configuration says of the engine, with what was
	// discovered from it: replaced whole by a reload, never changed.
	spec atomic.Pointer[endpointSpec]

	// models is the engine's model list as last read (GET /v1/models, at
	// start and every models_refresh_interval; nil before any read
	// succeeded): the LoRA adapters it serves (adapters.go).
	models atomic.Pointer[fleet.ModelList]

	// ready is true while the endpoint is healthy and not ejected.
	ready atomic.Bool
	// ejectedUntil is the end of the current ejection (unix ns); the health
	// checker does not restore the endpoint before it.
	ejectedUntil atomic.Int64
	// ledger is the gateway's accounting of what it sent the engine: in
	// flight (also the circuit breaker's slots), in-flight tokens, prefill
	// backlog, learnt prefill rate (package load; the virtual fleet keeps
	// the same ledger in simulated time).
	ledger load.Ledger
	// wentDown is set when the endpoint left rotation after a failure, so
	// its recovery is logged (and start-up is not).
	wentDown atomic.Bool
	// onDown are called when the endpoint leaves rotation (replaced whole
	// at each reload): they make the pools' policies forget what the
	// engine's cache was believed to hold.
	onDown atomic.Pointer[[]func()]
	// outlier is the passive outlier detection state (resilience.go).
	outlier outlierState
	// probeFailures counts the health probes failed in a row; waits are
	// the attempts waiting for its response headers, aborted when
	// probeFailures reaches health_check_abort_after (upstream/wait.go).
	probeFailures atomic.Int64
	// rediscoveredAt is when a passed health check last asked for the
	// reads its engine did not answer when added (UnixNano; health.go,
	// at most once per rediscoverEvery).
	rediscoveredAt atomic.Int64
	waits          upstream.Waits
	// authFailing is set by the engine's first refusal of the gateway's
	// credentials and cleared by a request that succeeds (or a reload that
	// changes them), so a wrong key is logged once per run of refusals.
	authFailing atomic.Bool
	// gates are the admission controls of the pools the endpoint serves,
	// woken when it frees a slot or changes readiness (replaced whole at
	// each reload).
	gates atomic.Pointer[[]*admission]
	// probeNow asks the health loop for a probe at once (capacity 1): a
	// pool of the endpoint began holding requests (coldstart.go).
	probeNow chan struct{}

	// stop ends the endpoint's health loop, which closes done when it has
	// returned (reload.go retires an endpoint a reload removed).
	stop context.CancelFunc
	done chan struct{}
}

// epoch is the origin of the time the gateway passes its load ledgers.
var epoch = time.Now()

// clock is t as the load ledgers' time (load.Ledger takes time passed in):
// its monotonic distance from epoch.
func clock(t time.Time) time.Duration { return t.Sub(epoch) }

// endpointSpec is an endpoint's configuration: the URL's entries of
// Config.Endpoints merged (the first entry's settings, the largest
// max_model_len), with kv_blocks, block_size and max_model_len discovered
// from the engine where configured 0.
type endpointSpec struct {
	// cfg is the configuration as written (Model cleared), compared at a
	// reload to tell whether the engine's settings changed.
	cfg EndpointConfig

	kvBlocks  int // engine KV capacity (blocks of blockSize tokens)
	blockSize int // engine KV block size (tokens)
	// maxModelLen is the engine's context length (tokens; configured,
	// discovered from GET /v1/models, or DefaultMaxModelLen).
	maxModelLen int
	// kvUnread and lenUnread: kvBlocks and maxModelLen are the defaults
	// because the engine did not answer their reads (fleet.Unanswered; a
	// new endpoint whose engine was down or still loading its model), not
	// because it has no such page. A rebuild reads them again
	// (Gateway.discover), and the endpoint's first passed health check
	// asks for one (rediscoverAsked; health.go).
	kvUnread, lenUnread bool
	rediscoverAsked     atomic.Bool

	kind       fleet.Kind
	healthPath string // GET path probed; healthCheckOff: none
	metricsURL string // "" when the kind has no metrics page
	kvEvents   *KVEventsConfig
	// header is what the gateway adds to every request it sends the
	// engine: its credentials and configured headers (endpointHeader, with
	// api_key_env read when the spec was built; read-only, values shared;
	// nil when none).
	header http.Header
}

// vacant stands in a pool for a slot whose endpoint a reload removed
// (reload.go): never ready, so never picked, and in no health loop.
var vacant = func() *endpoint {
	ep := &endpoint{done: make(chan struct{})}
	ep.spec.Store(&endpointSpec{blockSize: 1})
	close(ep.done)
	return ep
}()

// setReady records readiness, runs the onDown hooks on a ready→unready
// transition, and returns the previous readiness.
func (ep *endpoint) setReady(ok bool) (was bool) {
	if was = ep.ready.Swap(ok); was && !ok {
		if hooks := ep.onDown.Load(); hooks != nil {
			for _, f := range *hooks {
				f()
			}
		}
	}
	if was != ok {
		ep.wakeGates()
	}
	return was
}

// eject takes the endpoint out of rotation for d after a connection failure
// at now.
func (ep *endpoint) eject(now time.Time, d time.Duration) {
	ep.ejectedUntil.Store(now.Add(d).UnixNano())
	ep.wentDown.Store(true)
	ep.setReady(false)
}

// url returns the URL of kind's path on the endpoint (for a kind without a
// fixed path, path: a passablePath) with the client's raw query, if any (a
// copy then; the parsed URL is shared), escaped for a request line
// (escapeQuery).
func (ep *endpoint) url(kind apiKind, path, rawQuery string) *url.URL {
	var u *url.URL
	if int(kind) < numPathKinds {
		u = ep.urls[kind]
	} else {
		q := *ep.urls[kindChat]
		q.Path = strings.TrimSuffix(q.Path, pathChat) + path // the base URL's own path, then path
		q.RawPath = ""                                       // passablePath admits no escapes
		u = &q
	}
	if rawQuery == "" {
		return u
	}
	q := *u
	q.RawQuery = escapeQuery(rawQuery)
	return &q
}

// escapeQuery returns raw with every byte that may not appear in a URI's
// query (RFC 3986 §3.4: unreserved, sub-delims, ":", "@", "/", "?" and
// %XX escapes) percent-encoded, a "%" not followed by two hex digits
// included. An HTTP/1.1 request line cannot carry such bytes, but HTTP/2's
// :path does (net/http accepts a query with spaces there), and the request
// line written upstream must never be split or extended by a client's
// bytes. A valid query (the common case) is returned as is.
func escapeQuery(raw string) string {
	i := 0
	for i < len(raw) && queryByteOK(raw, i) {
		i++
	}
	if i == len(raw) {
		return raw
	}
	const hex = "0123456789ABCDEF"
	b := make([]byte, 0, len(raw)+16)
	b = append(b, raw[:i]...)
	for ; i < len(raw); i++ {
		if c := raw[i]; queryByteOK(raw, i) {
			b = append(b, c)
		} else {
			b = append(b, '%', hex[c>>4], hex[c&15])
		}
	}
	return string(b)
}

// queryByteOK reports whether raw[i] may stand as is in a query.
func queryByteOK(raw string, i int) bool {
	c := raw[i]
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	case c == '%':
		return i+2 < len(raw) && isHex(raw[i+1]) && isHex(raw[i+2])
	}
	return strings.IndexByte("-._~!$&'()*+,;=:@/?", c) >= 0
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// tryAcquire takes one of ep's circuit-breaker slots (an in-flight request)
// if fewer than limit are taken.
func (ep *endpoint) tryAcquire(limit int) bool { return ep.ledger.TryAcquire(limit) }

// releaseSlot gives back a slot taken by tryAcquire and wakes the admission
// queues of the models the endpoint serves.
func (ep *endpoint) releaseSlot() {
	ep.ledger.Release()
	ep.wakeGates()
}

// wakeGates lets the admission queues of ep's models admit waiters (a
// circuit-breaker slot freed, or the endpoint came back).
func (ep *endpoint) wakeGates() {
	if gates := ep.gates.Load(); gates != nil {
		for _, a := range *gates {
			a.wake()
		}
	}
}
