package gateway

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/load"
	"github.com/infergate/infergate/upstream"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
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

	// spec is what the configuration says of the engine, with what was
	// discovered from it: replaced whole by a reload, never changed.
	spec atomic.Pointer[endpointSpec]

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
	waits         upstream.Waits
	// authFailing is set by the engine's first refusal of the gateway's
	// credentials and cleared by a request that succeeds (or a reload that
	// changes them), so a wrong key is logged once per run of refusals.
	authFailing atomic.Bool
	// gates are the admission controls of the pools the endpoint serves,
	// woken when it frees a slot or changes readiness (replaced whole at
	// each reload).
	gates atomic.Pointer[[]*admission]

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

// checkHealth probes the endpoint once and updates its readiness: a failed
// probe takes it out of rotation, a successful one restores it unless an
// ejection is still running. path healthCheckOff skips the probe.
func (g *Gateway) checkHealth(ctx context.Context, ep *endpoint) {
	var err error
	spec := ep.spec.Load()
	if spec.healthPath != healthCheckOff {
		err = g.probe(ctx, ep, spec)
	}
	ok := err == nil
	if ctx.Err() != nil {
		return // shutting down: leave the state as it was
	}
	if ep.spec.Load() != spec {
		return // a reload changed what it probes (its credentials, its path) meanwhile: the next probe tells
	}
	if st := authStatus(0); errors.As(err, &st) && g.engineAuthFailures != nil {
		g.engineAuthFailures.WithLabelValues(ep.name, authSourceHealth).Inc()
	}
	if ok {
		ep.probeFailures.Store(0)
	} else if n := ep.probeFailures.Add(1); g.cfg.HealthCheckAbortAfter > 0 && n >= int64(g.cfg.HealthCheckAbortAfter) {
		if a := ep.waits.AbortAll(); a > 0 {
			slog.Warn("gateway: endpoint failed its health checks; requests waiting for its answer aborted and retried elsewhere",
				"endpoint", ep.name, "failed_probes", n, "aborted", a, "err", err)
		}
	}
	if ok && time.Now().UnixNano() < ep.ejectedUntil.Load() {
		return
	}
	switch was := ep.setReady(ok); {
	case !ok && !ep.wentDown.Swap(true):
		slog.Warn("gateway: endpoint failed its health check; out of rotation", "endpoint", ep.name, "path", spec.healthPath, "err", err)
	case !was && ok && ep.wentDown.Swap(false):
		slog.Info("gateway: endpoint healthy again; back in rotation", "endpoint", ep.name)
	}
}

// probe sends GET <base><spec.healthPath> with spec's headers and returns
// nil for a 2xx answer.
func (g *Gateway) probe(ctx context.Context, ep *endpoint, spec *endpointSpec) error {
	ctx, cancel := context.WithTimeout(ctx, g.cfg.HealthCheckTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, ep.base+spec.healthPath, nil)
	if err != nil {
		return fmt.Errorf("health check %s: %w", ep.name, err)
	}
	spec.addHeader(req.Header)
	resp, err := g.transport.RoundTrip(req)
	if err != nil {
		return fmt.Errorf("health check %s: %w", ep.name, err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // keep the connection reusable
	_ = resp.Body.Close()
	if isAuthRefusal(resp.StatusCode) {
		return fmt.Errorf("health check %s: %w", ep.name, authStatus(resp.StatusCode))
	}
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("health check %s: status %d", ep.name, resp.StatusCode)
	}
	return nil
}

// healthLoop checks ep every interval until ctx is done.
func (g *Gateway) healthLoop(ctx context.Context, ep *endpoint) {
	t := time.NewTicker(g.cfg.HealthCheckInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			g.checkHealth(ctx, ep)
		}
	}
}

// cacheConfig is what vllm:cache_config_info reports.
type cacheConfig struct {
	numGPUBlocks int // blocks
	blockSize    int // tokens per block
}

// fetchCacheConfig reads vllm:cache_config_info{num_gpu_blocks,block_size}
// from the endpoint's /metrics, sending header (the endpoint's credentials
// and configured headers: endpointSpec.header).
func (g *Gateway) fetchCacheConfig(ctx context.Context, base string, header http.Header) (cacheConfig, error) {
	ctx, cancel := context.WithTimeout(ctx, g.cfg.HealthCheckTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return cacheConfig{}, fmt.Errorf("read %s/metrics: %w", base, err)
	}
	addHeader(req.Header, header)
	resp, err := g.transport.RoundTrip(req)
	if err != nil {
		return cacheConfig{}, fmt.Errorf("read %s/metrics: %w", base, err)
	}
	defer resp.Body.Close()
	if isAuthRefusal(resp.StatusCode) {
		return cacheConfig{}, fmt.Errorf("read %s/metrics: %w", base, authStatus(resp.StatusCode))
	}
	if resp.StatusCode != http.StatusOK {
		return cacheConfig{}, fmt.Errorf("read %s/metrics: status %d", base, resp.StatusCode)
	}
	cc, err := parseCacheConfig(io.LimitReader(resp.Body, 32<<20))
	if err != nil {
		return cacheConfig{}, fmt.Errorf("read %s/metrics: %w", base, err)
	}
	return cc, nil
}

// parseCacheConfig scans Prometheus text exposition for the first
// vllm:cache_config_info sample with positive num_gpu_blocks and block_size
// labels.
func parseCacheConfig(r io.Reader) (cacheConfig, error) {
	const name = "vllm:cache_config_info{"
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name) {
			continue
		}
		labels := parseLabels(line[len(name):])
		blocks, err1 := strconv.Atoi(labels["num_gpu_blocks"])
		size, err2 := strconv.Atoi(labels["block_size"])
		if err1 == nil && err2 == nil && blocks > 0 && size > 0 {
			return cacheConfig{numGPUBlocks: blocks, blockSize: size}, nil
		}
	}
	if err := sc.Err(); err != nil {
		return cacheConfig{}, err
	}
	return cacheConfig{}, fmt.Errorf("no vllm:cache_config_info with num_gpu_blocks and block_size")
}

// parseLabels parses `k="v",k2="v2"}` (the text after a metric's "{") into a
// map, unescaping \\, \" and \n. It stops at the closing brace.
func parseLabels(s string) map[string]string {
	out := map[string]string{}
	for {
		s = strings.TrimLeft(s, " ,")
		if s == "" || s[0] == '}' {
			return out
		}
		eq := strings.IndexByte(s, '=')
		if eq < 0 || eq+1 >= len(s) || s[eq+1] != '"' {
			return out
		}
		key := strings.TrimSpace(s[:eq])
		s = s[eq+2:]
		var v strings.Builder
		i := 0
		for ; i < len(s) && s[i] != '"'; i++ {
			if s[i] == '\\' && i+1 < len(s) {
				i++
				switch s[i] {
				case 'n':
					v.WriteByte('\n')
				default:
					v.WriteByte(s[i])
				}
				continue
			}
			v.WriteByte(s[i])
		}
		if i >= len(s) {
			return out
		}
		out[key] = v.String()
		s = s[i+1:]
	}
}
