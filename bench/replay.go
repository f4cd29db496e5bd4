// Package bench replays request traces against OpenAI-compatible endpoints and
// measures what users and operators care about: time to first token (TTFT),
// inter-token latency (ITL), end-to-end latency, throughput and the prefix-cache
// hit rate the engines report. Compare runs the same trace through a simulated
// fleet behind the gateway once per routing policy and reports them side by
// side. See README.md for the measurement method and the JSON schema.
//
// # Time domain
//
// Every latency and duration this package reports is in engine time: the wall
// time measured by the client multiplied by TimeScale, the target's simulated
// seconds per wall second. Against real engines TimeScale is 1 and engine time
// is wall time. A simulated fleet run TimeScale times faster than real time
// (simserver.ServerConfig.TimeScale) is replayed with arrivals compressed by the same
// factor (Speedup), so that in engine time requests arrive exactly at their
// trace timestamps and latencies read as they would on the modelled hardware.
package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/trace"
)

// ReplayOptions configures Replay.
type ReplayOptions struct {
	// Target is the base URL of an OpenAI-compatible server, such as
	// "http://127.0.0.1:8000"; requests go to Target + "/v1/completions".
	Target string
	// Targets, if it has two or more URLs, replaces Target: request i (in
	// record order) goes to Targets[i mod len(Targets)], as an L4 front
	// that deals every request (not every connection) round robin to a
	// set of gateway replicas; measure.Record.Target names the one taken.
	// A per-connection balancer differs only when requests share
	// keep-alive connections: it pins each connection's requests to one
	// replica, so the deal depends on the client's connection reuse.
	Targets []string
	// OnSend, if set, is called with a request's index just before it is
	// sent (in the request's goroutine; calls for different requests may
	// run concurrently): a hook to act at a given request, such as
	// killing a replica when the middle one is sent.
	OnSend func(i int)
	// Model is the "model" field of every request.
	Model string
	// Records are the requests to replay, in arrival order.
	Records []trace.Record
	// Requests limits the replay to the first Requests records (0: all).
	Requests int
	// OutputTokens, if > 0, replaces every record's output length (tokens),
	// like benchmark_serving's --sharegpt-output-len: for runs about
	// prompts and routing rather than decoding.
	OutputTokens int
	// Speedup compresses arrivals: record i is sent
	// (Timestamp_i − Timestamp_0)/Speedup of wall time after the start
	// (dimensionless; 0 means 1).
	Speedup float64
	// TimeScale is the target's engine seconds per wall second: 1 for real
	// engines (the default when 0), the fleet's TimeScale for a simulated one.
	TimeScale float64
	// Client sends the requests; nil uses NewClient() and closes its idle
	// connections at the end.
	Client *http.Client
	// APIKey, if set, is sent as "Authorization: Bearer <APIKey>".
	APIKey string
	// Label names the run in progress output and in Record.Policy.
	Label string
	// Progress receives a progress bar when it is a terminal, otherwise one
	// line at the end; nil for none.
	Progress io.Writer
	// Output, if set, receives every measure.Record as one JSON line, in record order,
	// when the replay ends.
	Output io.Writer
	// Warmup marks the warm-up requests (measure.Record.Warmup) before Output
	// is written; measure.Summarize leaves them out.
	Warmup measure.Warmup
	// Concurrency, if > 0, replays closed-loop instead of at the
	// timestamps: Concurrency users each send the next unsent record as soon
	// as their previous request has finished, until every record is sent.
	// With Sessions it bounds the sessions active at once instead.
	Concurrency int
	// Sessions, if set, replaces Records with a session-aware closed loop:
	// session s starts at Start/Speedup of wall time (or later, once fewer
	// than Concurrency sessions are active when Concurrency > 0), and sends
	// each next turn when the previous turn's response has fully arrived
	// plus ThinkTime/Speedup. Records are numbered session-major (session 0's
	// turns, then session 1's, ...); Requests limits the turns in that order.
	Sessions []trace.Session
	// HeaderTimeout bounds the wait for a request's response header and
	// IdleTimeout a stream's silence after it (wall time; 0:
	// DefaultHeaderTimeout, DefaultIdleTimeout; negative: unbounded): a
	// target that accepts a request and never answers, or stops
	// mid-stream, fails that request (an error naming the bound, counted
	// as TargetOutcome.Stalled) instead of holding Replay, and bench,
	// until its context ends.
	HeaderTimeout, IdleTimeout time.Duration
}

// DefaultHeaderTimeout and DefaultIdleTimeout are Replay's bounds on a
// target's silence: the gateway's own defaults for its engines
// (gateway.DefaultResponseHeaderTimeout, whose admission queue may hold
// a request that long before answering, and DefaultStreamIdleTimeout).
const (
	DefaultHeaderTimeout = 10 * time.Minute
	DefaultIdleTimeout   = time.Minute
)

// errStalled is the cause a request's context is cancelled with when its
// target stays silent past a bound (stallBound).
var errStalled = errors.New("target stalled")

// maxErrorBody bounds how much of an error response is read (bytes).
const maxErrorBody = 64 << 10

// NewClient returns an HTTP client tuned for load generation: no overall
// timeout (streams run as long as generation does; cancel with the context),
// keep-alive connections pooled without a small per-host cap, no compression
// (SSE is latency-sensitive) and larger socket buffers for multi-megabyte
// token-id prompts.
func NewClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy: http.ProxyFromEnvironment,
		DialContext: (&net.Dialer{
			Timeout:   30 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		MaxIdleConns:        0, // no global cap
		MaxIdleConnsPerHost: 4096,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
		WriteBufferSize:     64 << 10,
		ReadBufferSize:      64 << 10,
	}}
}

// CompletionsURL returns the URL of target's POST /v1/completions: target
// is a server's base URL, with or without the OpenAI client's "/v1" suffix
// ("http://h:8000", "http://h:8000/v1/", "https://h/prefix/v1"); a query
// string (a proxy's parameters) is kept after the path, not spliced into it.
func CompletionsURL(target string) (string, error) {
	u, err := url.Parse(target)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		shown := measure.RedactText(target)
		if err == nil {
			shown = u.Redacted() // a password in a URL without a host
		}
		return "", fmt.Errorf("bench: target %q: want an http(s)://host[:port] base URL", shown)
	}
	p := strings.TrimSuffix(strings.TrimSuffix(u.Path, "/"), "/v1")
	u.Path, u.RawPath = p+"/v1/completions", ""
	u.Fragment = ""
	return u.String(), nil
}

// Replay sends the records open-loop (each at its scheduled time, whether or
// not earlier ones have finished) as streaming POST /v1/completions requests
// whose prompt is the record's synthetic token ids (trace.Record.Tokens),
// max_tokens its output length (at least 1), with ignore_eos and
// stream_options.include_usage set. Each request runs in its own goroutine, so
// concurrency is bounded by the trace itself; prompts are built when sent.
// opts.Concurrency and opts.Sessions select a closed loop instead (see their
// fields); opts.Warmup marks the warm-up requests.
//
// It returns one measure.Record per request sent, in record order. Request failures
// are reported in Record.Error, not as an error. If ctx ends, unsent requests
// are dropped, in-flight ones are cancelled (and recorded as errors), and the
// records of the requests sent are returned with ctx's error.
func Replay(ctx context.Context, opts ReplayOptions) ([]measure.Record, error) {
	targets := opts.Targets
	if len(targets) < 2 {
		targets = []string{opts.Target}
		if len(opts.Targets) == 1 {
			targets = opts.Targets
		}
	}
	endpoints := make([]string, len(targets))
	for k, t := range targets {
		e, err := CompletionsURL(t)
		if err != nil {
			return nil, err
		}
		// A URL given twice ("h:8000", "h:8000/v1/") would be dealt twice
		// the requests, and TargetOutcomes would count them all under one
		// position, the other showing none sent: refused.
		if j := slices.Index(endpoints[:k], e); j >= 0 {
			return nil, fmt.Errorf("bench: targets %d and %d (%q) are the same endpoint; give each replica's URL once", j, k, measure.RedactText(t))
		}
		endpoints[k] = e
	}
	speedup, scale := opts.Speedup, opts.TimeScale
	if speedup == 0 {
		speedup = 1
	}
	if scale == 0 {
		scale = 1
	}
	if !(speedup > 0) || math.IsInf(speedup, 0) || !(scale > 0) || math.IsInf(scale, 0) {
		return nil, fmt.Errorf("bench: speedup %v and time scale %v must be positive and finite", opts.Speedup, opts.TimeScale)
	}
	if err := opts.Warmup.Validate(); err != nil {
		return nil, err
	}
	if opts.Concurrency < 0 {
		return nil, fmt.Errorf("bench: concurrency %d: must not be negative", opts.Concurrency)
	}
	recs := opts.Records
	if opts.Requests > 0 && opts.Requests < len(recs) {
		recs = recs[:opts.Requests]
	}
	client := opts.Client
	if client == nil {
		client = NewClient()
		defer client.CloseIdleConnections()
	}
	modelJSON, err := json.Marshal(opts.Model)
	if err != nil {
		return nil, fmt.Errorf("bench: model name: %w", err)
	}

	total := len(recs)
	if opts.Sessions != nil {
		total = 0
		for _, ss := range opts.Sessions {
			total += len(ss.Turns)
		}
		if opts.Requests > 0 {
			total = min(total, opts.Requests)
		}
	}
	prog := newProgress(opts.Progress, total, opts.Label)
	out := make([]measure.Record, total)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	start := time.Now()
	sent := make([]bool, total) // written by the request's goroutine only
	do := func(i int, rec trace.Record, due time.Time) {
		if opts.OutputTokens > 0 {
			rec.OutputLength = opts.OutputTokens
		}
		k := i % len(endpoints)
		r, ok := send(ctx, client, endpoints[k], modelJSON, opts, i, rec, start, due, scale)
		if !ok {
			return // ctx ended before it was due
		}
		// A target that refuses the connection got nothing: the front
		// takes the next one, as an L4 balancer's connect retry (or its
		// health check) does. The wait counts in the request's latency.
		for try := 1; try < len(endpoints) && r.Status == 0 && refused(r.Error); try++ {
			k = (i + try) % len(endpoints)
			first, lag := r.ArrivalMs, r.SendLagMs
			r, _ = send(ctx, client, endpoints[k], modelJSON, opts, -1, rec, start, time.Time{}, scale)
			if r.TTFTMs > 0 {
				r.TTFTMs += r.ArrivalMs - first
			}
			r.E2EMs += r.ArrivalMs - first
			r.ArrivalMs, r.SendLagMs = first, lag
		}
		r.Index, r.Policy = i, opts.Label
		if len(endpoints) > 1 {
			r.Target = measure.RedactText(targets[k])
		}
		if r.Error != "" {
			// Errors name the URL; a credential in it stays out of reports.
			r.Error = measure.RedactText(r.Error)
		}
		out[i], sent[i] = r, true
		prog.done(r.Error != "")
	}
	switch {
	case opts.Sessions != nil:
		sessionLoop(ctx, opts.Concurrency, opts.Sessions, total, speedup, start, do)
	case opts.Concurrency > 0:
		closedLoop(ctx, opts.Concurrency, recs, do)
	default:
		openLoop(ctx, recs, speedup, start, do)
	}
	n := 0
	for i := range out {
		if sent[i] {
			out[n] = out[i]
			n++
		}
	}
	out = out[:n]
	err = ctx.Err()
	if err != nil {
		err = context.Cause(ctx)
	}
	opts.Warmup.Mark(out)
	prog.finish(out, scale)

	if opts.Output != nil {
		if werr := measure.WriteRecords(opts.Output, out); werr != nil && err == nil {
			err = fmt.Errorf("bench: write records: %w", werr)
		}
	}
	return out, err
}

// refused reports whether a request's error is a refused connection
// (nothing was sent): connect(2)'s ECONNREFUSED as net/http words it.
func refused(err string) bool {
	return strings.Contains(err, syscall.ECONNREFUSED.Error())
}

// sendFunc sends record i at due (the zero Time: at once, unscheduled)
// and waits for its response; it sends nothing if ctx ends before due.
type sendFunc func(i int, rec trace.Record, due time.Time)

// sendLead is how long before its due time a scheduled request is prepared
// (wall time): its prompt and body are built ahead, so that building large
// token-id bodies (a few ms each for 100k-token prompts; the Mooncake trace
// has bursts of 16 requests on one timestamp) does not make them late.
const sendLead = 100 * time.Millisecond

// openLoop sends record i at (Timestamp_i − Timestamp_0)/speedup after
// start, each in its own goroutine started sendLead before it is due.
func openLoop(ctx context.Context, recs []trace.Record, speedup float64, start time.Time, do sendFunc) {
	var wg sync.WaitGroup
	timer := time.NewTimer(time.Hour)
	timer.Stop()
dispatch:
	for i, rec := range recs {
		due := time.Duration(float64(rec.Timestamp-recs[0].Timestamp) / speedup)
		if wait := due - sendLead - time.Since(start); wait > 0 {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
				timer.Stop()
				break dispatch
			case <-timer.C:
			}
		}
		if ctx.Err() != nil {
			break
		}
		wg.Go(func() { do(i, rec, start.Add(due)) })
	}
	wg.Wait()
}

// send builds one request, sends it at due (zero: at once) and measures
// it. It reports false, sending nothing, when ctx ends before due.
func send(ctx context.Context, client *http.Client, endpoint string, modelJSON []byte, opts ReplayOptions, i int, rec trace.Record, start, due time.Time, scale float64) (measure.Record, bool) {
	ms := func(d time.Duration) float64 { return d.Seconds() * 1000 * scale }

	body := requestBody(modelJSON, rec)
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, endpoint, bytes.NewReader(body))
	if err != nil {
		return measure.Record{Error: err.Error()}, true
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream")
	if opts.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+opts.APIKey)
	}
	if wait := time.Until(due); !due.IsZero() && wait > 0 {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return measure.Record{}, false
		case <-t.C:
		}
	}
	if ctx.Err() != nil && !due.IsZero() {
		return measure.Record{}, false
	}
	if opts.OnSend != nil && i >= 0 {
		opts.OnSend(i)
	}
	w := newStallBound(opts, cancel)
	defer w.stop()
	r := measureStream(client, req, rec, start, due, ms, w)
	if w.fired.Load() && r.Error != "" {
		r.Error = w.message()
	}
	return r, true
}

// stallBound cancels a request (its context, with errStalled) when its
// target is silent past a bound: header until the response header
// arrives, then idle between reads of the body.
type stallBound struct {
	header, idle time.Duration
	t            *time.Timer // nil: unbounded
	headerSeen   atomic.Bool
	fired        atomic.Bool
}

func newStallBound(opts ReplayOptions, cancel context.CancelCauseFunc) *stallBound {
	w := &stallBound{header: opts.HeaderTimeout, idle: opts.IdleTimeout}
	if w.header == 0 {
		w.header = DefaultHeaderTimeout
	}
	if w.idle == 0 {
		w.idle = DefaultIdleTimeout
	}
	if w.header > 0 {
		w.t = time.AfterFunc(w.header, func() {
			w.fired.Store(true)
			cancel(errStalled)
		})
	}
	return w
}

// headerArrived switches the bound from the header's to the stream's.
func (w *stallBound) headerArrived() {
	w.headerSeen.Store(true)
	w.read()
}

// read restarts the idle bound (a read returned data).
func (w *stallBound) read() {
	if w.t == nil || w.idle <= 0 {
		w.stop()
		return
	}
	w.t.Reset(w.idle)
}

func (w *stallBound) stop() {
	if w.t != nil {
		w.t.Stop()
	}
}

// message is the failed request's error once the bound fired.
func (w *stallBound) message() string {
	if w.headerSeen.Load() {
		return fmt.Sprintf("%v: stream silent for %v (bench's idle bound)", errStalled, w.idle)
	}
	return fmt.Sprintf("%v: no response header within %v (bench's header bound)", errStalled, w.header)
}

// measureStream sends req (due at due; zero: unscheduled) and measures its
// response; ms converts wall durations to engine milliseconds.
// w bounds the target's silence.
func measureStream(client *http.Client, req *http.Request, rec trace.Record, start, due time.Time, ms func(time.Duration) float64, w *stallBound) measure.Record {
	t0 := time.Now()
	r := measure.Record{ArrivalMs: ms(t0.Sub(start))}
	if !due.IsZero() {
		late := ms(max(0, t0.Sub(due)))
		r.SendLagMs = &late
	}
	fail := func(err error) measure.Record {
		r.E2EMs = ms(time.Since(t0))
		r.Error = err.Error()
		return r
	}
	resp, err := client.Do(req)
	if err != nil {
		return fail(err)
	}
	defer resp.Body.Close()
	w.headerArrived()
	r.Status = resp.StatusCode
	r.Endpoint = measure.RedactText(resp.Header.Get(gateway.EndpointHeader))
	if resp.StatusCode != http.StatusOK {
		return fail(statusError(resp))
	}

	var (
		clock   = &readClock{r: resp.Body, w: w}
		er      = openai.NewEventReader(clock, 0)
		chunk   openai.StreamChunk
		usage   *openai.Usage
		tokens  itlClock
		outputs int
	)
	for {
		data, err := er.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fail(fmt.Errorf("read stream: %w", err))
		}
		chunk.Reset()
		if err := json.Unmarshal(data, &chunk); err != nil {
			var te *json.UnmarshalTypeError
			if !errors.As(err, &te) { // a type mismatch leaves the rest usable
				return fail(fmt.Errorf("bad stream chunk: %w", err))
			}
		}
		if chunk.IsError() {
			msg, ok := errorMessage(data)
			if !ok {
				msg = string(chunk.Error)
			}
			return fail(fmt.Errorf("stream error: %s", msg))
		}
		if chunk.Usage != nil {
			usage = chunk.Usage
		}
		if !chunk.HasOutput() {
			continue
		}
		if outputs == 0 {
			r.TTFTMs = ms(clock.at.Sub(t0))
		}
		tokens.output(clock.reads, clock.at)
		outputs++
	}
	r.ITLMs = tokens.itl(r.ITLMs[:0], ms)
	r.E2EMs = ms(time.Since(t0))
	if !er.Done() {
		return fail(errors.New("stream ended without [DONE]"))
	}
	if usage != nil {
		r.PromptTokens, r.CachedTokens, r.OutputTokens = usage.PromptTokens, usage.Cached(), usage.CompletionTokens
	} else {
		r.PromptTokens, r.OutputTokens, r.NoUsage = rec.InputLength, outputs, true
	}
	if outputs == 0 {
		return fail(errors.New("stream carried no output"))
	}
	return r
}

// requestBody renders the streaming completion request for rec:
//
//	{"model":M,"prompt":[ids],"max_tokens":N,"stream":true,
//	 "stream_options":{"include_usage":true},"ignore_eos":true}
//
// modelJSON is the model name already encoded as a JSON string. The body is
// written by hand: the prompt dominates it (up to about a megabyte), and
// appending digits directly is several times cheaper than encoding/json.
func requestBody(modelJSON []byte, rec trace.Record) []byte {
	tokens := rec.Tokens(make([]uint32, 0, rec.InputLength))
	b := make([]byte, 0, 7*len(tokens)+len(modelJSON)+128)
	b = append(b, `{"model":`...)
	b = append(b, modelJSON...)
	b = append(b, `,"prompt":[`...)
	for i, t := range tokens {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(t), 10)
	}
	b = append(b, `],"max_tokens":`...)
	b = strconv.AppendInt(b, int64(max(rec.OutputLength, 1)), 10) // vLLM rejects max_tokens < 1
	b = append(b, `,"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}`...)
	return b
}

// statusError turns a non-200 response into an error naming the status and,
// when the body is an OpenAI error object, its message.
func statusError(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	if msg, ok := errorMessage(b); ok {
		return fmt.Errorf("HTTP %d: %s", resp.StatusCode, msg)
	}
	msg := strings.TrimSpace(string(b))
	if len(msg) > 200 {
		msg = strings.ToValidUTF8(msg[:200], "") + "…"
	}
	if msg == "" {
		return fmt.Errorf("HTTP %d", resp.StatusCode)
	}
	return fmt.Errorf("HTTP %d: %s", resp.StatusCode, msg)
}

// errorMessage extracts the message of an error body or event in any of the
// shapes engines send: OpenAI's {"error": {"message": ...}} (whatever the type
// of "code": vLLM sends the HTTP status as an integer) or older vLLM's flat
// {"object": "error", "message": ...}.
func errorMessage(b []byte) (string, bool) {
	var e struct {
		Error *struct {
			Message string `json:"message"`
		} `json:"error"`
		Object  string `json:"object"`
		Message string `json:"message"`
	}
	if json.Unmarshal(b, &e) != nil {
		return "", false
	}
	switch {
	case e.Error != nil && e.Error.Message != "":
		return e.Error.Message, true
	case e.Object == "error" && e.Message != "":
		return e.Message, true
	}
	return "", false
}

// readClock wraps a response body and timestamps each Read that returned
// data: an SSE event parsed from the buffer arrived with the latest read
// (openai.EventReader reads only when its buffer holds no complete line).
type readClock struct {
	r     io.Reader
	w     *stallBound // told of each read (nil: none)
	reads int         // reads that returned data
	at    time.Time   // when the latest of them returned
}

func (c *readClock) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if n > 0 {
		c.reads++
		c.at = time.Now()
		if c.w != nil {
			c.w.read()
		}
	}
	return n, err
}

// itlClock turns the arrival of output-carrying chunks, each tagged with the
// read that brought it, into inter-token latencies.
//
// Chunks that arrive in one read carry the same timestamp: the sender's
// flushes coalesced on the way (a busy gateway or client reads several at
// once, TCP merges small segments), and nothing on the client side says how
// far apart they were produced. Gaps measured per chunk would then be one
// long gap followed by zeros (an ITL p50 of 0.0 ms on a busy host). The
// gap between two reads is instead split evenly over the chunks of the later
// read, as SGLang's bench_serving does for chunks carrying several tokens:
// the entries keep their sum (first to last output read) and their mean,
// and their median reads as a token cadence.
type itlClock struct {
	groups []itlGroup
}

// itlGroup is one read's output chunks: how many, and when the read returned.
type itlGroup struct {
	read   int
	chunks int
	at     time.Time
}

// output records one output-carrying chunk parsed after read number read,
// which returned at at.
func (c *itlClock) output(read int, at time.Time) {
	if n := len(c.groups); n > 0 && c.groups[n-1].read == read {
		c.groups[n-1].chunks++
		return
	}
	c.groups = append(c.groups, itlGroup{read: read, chunks: 1, at: at})
}

// itl appends to dst one latency per chunk after the first read's, each its
// read's gap from the previous read divided by the read's chunks, converted
// by ms; it returns dst (nil when there are none).
func (c *itlClock) itl(dst []float64, ms func(time.Duration) float64) []float64 {
	for k := 1; k < len(c.groups); k++ {
		g := c.groups[k]
		gap := ms(g.at.Sub(c.groups[k-1].at)) / float64(g.chunks)
		for range g.chunks {
			dst = append(dst, gap)
		}
	}
	if len(dst) == 0 {
		return nil
	}
	return dst
}
