package simserver

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/infergate/infergate/artifact"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/openai"
	"github.com/infergate/infergate/prefix"
	"github.com/infergate/infergate/sim"
)

// Server defaults.
const (
	// DefaultMaxTokens is the output length of a request that sets neither
	// max_tokens nor max_completion_tokens. (vLLM would generate up to the
	// context limit; a simulator needs a bounded default.)
	DefaultMaxTokens = 128
	// MaxRequestBytes bounds a request body; larger bodies get 413.
	MaxRequestBytes = 32 << 20
)

// ServerConfig configures a Server.
type ServerConfig struct {
	// Engine configures the simulated engine.
	Engine sim.Config `yaml:"engine"`
	// Model is the served model name clients must send; default
	// Engine.Profile.Model, else sim.DefaultModel.
	Model string `yaml:"model"`
	// TimeScale is simulated seconds per wall second (default 1): at 10 the
	// server runs ten times faster than the hardware it models.
	TimeScale float64 `yaml:"time_scale"`
	// Seed seeds output tokens (unless Engine.Seed is set) and response ids.
	Seed int64 `yaml:"seed"`
	// KVEvents configures the vLLM KV-cache event publisher (off by default);
	// see README "KV events" and ../kvevents/README.md.
	KVEvents kvevents.PublisherConfig `yaml:"kv_events"`
	// APIKeys, when not empty, guard every /v1 path as vLLM's --api-key
	// does (auth.go): "Authorization: Bearer <one of them>" or 401
	// {"error":"Unauthorized"}; /health and /metrics stay open.
	APIKeys []string `yaml:"api_keys"`
	// ResponsesStore keeps Responses API responses for previous_response_id
	// and GET /v1/responses/{id}: vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1
	// (off by default, as in vLLM: store is then ignored and every
	// previous_response_id is not found). See responses.go.
	ResponsesStore bool `yaml:"responses_store"`
	// KVRemote sizes a remote KV tier behind the engine's GPU and its
	// kv_tiers (sim.TiersConfig.Remote): "0" (off), a multiple of the
	// engine's GPU KV cache ("8x") or bytes ("2TiB"). A Server gets a store
	// of its own; StartFleet gives every engine of the fleet one shared
	// store (remote.go). Loads use the profile's network bandwidth.
	KVRemote sim.TierSize `yaml:"kv_remote"`
	// KVRemoteEvents configures the publisher of the remote store's KV
	// events (medium REMOTE, with token ids and parents, as infergate
	// kvstore publishes them; topic DefaultRemoteTopic(model) unless set).
	// When it does not publish but KVEvents does, the store publishes on
	// loopback (ephemeral ports, with replay; RemoteStore.KVEventEndpoints).
	KVRemoteEvents kvevents.PublisherConfig `yaml:"kv_remote_events"`
	// PD configures the server's side of disaggregated prefill/decode
	// (pd.go, README "P/D"): its role, bootstrap listener, engine id and
	// side-channel bounds. Requests without P/D fields ignore it.
	PD PDConfig `yaml:"pd"`
	// Startup, when set, makes the server start unready and load for the
	// modelled cold-start time (startup.go; README "Start-up and sleep").
	Startup *StartupConfig `yaml:"startup"`
	// EnableSleepMode serves vLLM's POST /sleep, POST /wake_up and GET
	// /is_sleeping (vLLM --enable-sleep-mode with VLLM_SERVER_DEV_MODE=1;
	// sleep.go). Off: those paths answer 404, as vLLM's.
	EnableSleepMode bool `yaml:"enable_sleep_mode"`
	// Tokenizer is the model's own tokenizer the engine tokenizes with:
	// a tokenizer.json, or a folder holding one and its
	// tokenizer_config.json (chat template), as the gateway's
	// tokenizers: entry for the model; "" is cl100k_base with the
	// canonical Llama-3 layout (tokenizer.go, README "Tokenizer").
	// Empty: the profile's (sim.GPUProfile.Tokenizer), if any.
	Tokenizer string `yaml:"tokenizer"`
	// LoadedTokenizer, when set, is used instead of loading Tokenizer
	// (StartFleet loads a tokenizer.json once for all its engines).
	LoadedTokenizer Tokenizer `yaml:"-"`
}

// servedModel is the model name a server of cfg serves.
func servedModel(cfg ServerConfig) string {
	if cfg.Model != "" {
		return cfg.Model
	}
	if m := cfg.Engine.WithDefaults().Profile.Model; m != "" {
		return m
	}
	return sim.DefaultModel
}

// newRemoteFor returns the remote store cfg.KVRemote sizes, publishing its
// events as KVRemoteEvents (or KVEvents) says, or nil when it is off.
func newRemoteFor(cfg ServerConfig) (*RemoteStore, error) {
	if cfg.KVRemote.IsZero() {
		return nil, nil
	}
	n := cfg.Engine.TierBlocks(cfg.KVRemote)
	if n < 1 {
		return nil, fmt.Errorf("sim: kv_remote %s holds no KV block", cfg.KVRemote)
	}
	pc := cfg.KVRemoteEvents
	if !pc.Publishes() && cfg.KVEvents.Publishes() {
		pc = kvevents.PublisherConfig{Enable: true, Encoding: cfg.KVEvents.Encoding}
	}
	return newRemoteStore(n, pc, servedModel(cfg))
}

// Server is a vLLM-compatible OpenAI HTTP front over a simulated sim.Engine.
//
// One driver goroutine (Start) owns the engine: it steps while there is work,
// after each step sleeps until the wall-clock deadline
// start + (virtual_now + step)/TimeScale — absolute deadlines, so sleep error
// does not accumulate — then delivers the step's tokens to the request
// streams. When idle it blocks until a request arrives and moves the virtual
// clock up to the wall-derived time. Requests arriving during a step join the
// next one, as in vLLM. If the host is too slow to keep up, virtual time lags
// the wall clock; reported latencies stay those of the modelled hardware,
// and each step's lateness is recorded (Lag, lag.go).
type Server struct {
	cfg       ServerConfig
	eng       sim.Config // engine config with defaults
	tok       Tokenizer  // every prompt's ids and every id's text (tokenizer.go)
	vocab     int        // token ids must be below it (0: unchecked)
	words     map[uint32]string
	metrics   *metrics
	snap      atomic.Pointer[sim.Stats]
	handler   http.Handler
	created   int64 // unix seconds, for /v1/models
	submit    chan *call
	cancel    chan *call
	control   chan *engineCall
	kvpub     *kvevents.Publisher // nil unless KVEvents.Publishes()
	quit      chan struct{}
	done      chan struct{}
	store     responseStore // Responses API store (responses.go)
	startOnce sync.Once
	closeOnce sync.Once
	started   atomic.Bool
	startWall atomic.Int64 // driver start, unix nanoseconds
	lag       lagHistogram // step lags (lag.go)
	// remote is the engine's remote tier when it is a RemoteStore (its
	// own, closed with it, when ownsRemote; else its fleet's).
	remote     *RemoteStore
	ownsRemote bool
	// P/D (pd.go, pdchannel.go): the configuration with defaults, the
	// holds of prefill legs, the side channel's client and the bootstrap
	// listener (nil when none).
	pd       PDConfig
	pdReg    *pdRegistry
	pdClient *http.Client
	bootLn   net.Listener
	bootSrv  *http.Server
	// pdReadBody bounds a /read body (pdReadBodyLimit).
	pdReadBody int64

	// Start-up and sleep (startup.go, sleep.go): the modelled start-up,
	// loading while it runs, ready closed when it ended; the sleep state.
	// paused and inflight are the driver's (touched on its goroutine
	// only, engine calls included): scheduling paused by a sleep, and
	// the requests the engine holds.
	startup atomic.Pointer[sim.StartupPhases]
	loading atomic.Bool
	// With Startup.Weights (startupweights.go): the real start-up's report
	// and the lease on the model's blobs, taken by the driver and released
	// at Close.
	weightsReport atomic.Pointer[WeightsReport]
	lease         *artifact.Lease
	ready         chan struct{}
	sleep         sleepState
	paused        bool
	inflight      map[string]*call
}

// maxMetricsScrapes bounds the GET /metrics answered at once (promhttp's
// MaxRequestsInFlight, as the gateway's): more are answered 503 at once
// instead of each gathering and encoding every family (the gateway's
// measured cost: 3,000 concurrent scrapes took it from 136 MB to 567 MB
// RSS). Prometheus scrapes a target one at a time; the gateway's scraper
// and a few dashboards fit.
const maxMetricsScrapes = 16

// NewServer validates cfg, loads the tokenizer and builds the handler. The
// engine does not run until Start.
func NewServer(cfg ServerConfig) (*Server, error) { return newServer(cfg, 0) }

// newServer builds server number index of a fleet; the index only varies the
// response ids, so that replicas given the same prompt answer alike (as greedy
// decoding does) but never reuse each other's ids.
func newServer(cfg ServerConfig, index int) (*Server, error) {
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 1
	}
	if !(cfg.TimeScale > 0) {
		return nil, fmt.Errorf("sim: time scale must be > 0, got %v", cfg.TimeScale)
	}
	if cfg.Engine.Seed == 0 {
		cfg.Engine.Seed = uint64(cfg.Seed)
	}
	if err := cfg.Engine.Validate(); err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	var remote *RemoteStore
	owns := false
	if cfg.Engine.Tiers.Remote == nil {
		r, err := newRemoteFor(cfg)
		if err != nil {
			return nil, err
		}
		if r != nil {
			remote, owns, cfg.Engine.Tiers.Remote = r, true, r
			if err := cfg.Engine.Validate(); err != nil {
				r.close()
				return nil, fmt.Errorf("sim: %w", err)
			}
		}
	} else {
		remote, _ = cfg.Engine.Tiers.Remote.(*RemoteStore)
	}
	s, err := buildServer(cfg, index)
	if err != nil {
		if owns {
			remote.close()
		}
		return nil, err
	}
	s.remote, s.ownsRemote = remote, owns
	return s, nil
}

// buildServer is newServer once the engine's configuration is valid and
// its remote tier set.
func buildServer(cfg ServerConfig, index int) (*Server, error) {
	if cfg.KVEvents.Publishes() {
		if err := cfg.KVEvents.Validate(); err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
		cfg.Engine.KVEvents = true
	}
	tok := cfg.LoadedTokenizer
	if tok == nil {
		var err error
		if tok, err = LoadTokenizer(tokenizerPath(cfg)); err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
	}
	out, err := wordVocab(tok)
	if err != nil {
		return nil, err
	}
	if !out.roundTrip {
		slog.Warn("sim: a reply sent back as the assistant's turn does not re-tokenize to the ids generated: follow-up turns will not hit the reply's KV blocks",
			"tokenizer", tok.Name())
	}
	if len(cfg.Engine.OutputVocab) == 0 {
		cfg.Engine.OutputVocab, cfg.Engine.FirstOutputVocab = out.ids, out.first
	}
	eng := cfg.Engine.WithDefaults()
	if cfg.Model == "" {
		cfg.Model = eng.Profile.Model
	}
	if cfg.Model == "" {
		cfg.Model = sim.DefaultModel
	}
	if eng.LoRA.AdapterID(cfg.Model) != 0 {
		return nil, fmt.Errorf("sim: LoRA adapter %q has the served model's name", cfg.Model)
	}
	pd, err := cfg.PD.withDefaults()
	if err != nil {
		return nil, err
	}
	ph, err := startupErr(cfg, eng)
	if err != nil {
		return nil, err
	}
	s := &Server{
		sleep:   sleepState{turn: make(chan struct{}, 1)},
		ready:   make(chan struct{}),
		cfg:     cfg,
		eng:     eng,
		tok:     tok,
		vocab:   eng.Profile.VocabSize,
		words:   out.words,
		created: time.Now().Unix(),
		submit:  make(chan *call),
		cancel:  make(chan *call),
		control: make(chan *engineCall),
		quit:    make(chan struct{}),
		done:    make(chan struct{}),
		pd:      pd,
		pdReg:   newPDRegistry(pd.MaxWaiters),
	}
	if n := tok.VocabSize(); n > 0 {
		s.vocab = n // vLLM checks ids against its tokenizer's
	}
	s.pdReadBody = pdReadBodyLimit(eng.NumBlocks)
	s.pdClient = newPDClient()
	s.snap.Store(&sim.Stats{NumBlocks: eng.NumBlocks, BlockSize: eng.BlockSize})
	s.startup.Store(&ph)
	s.metrics = newMetrics(cfg.Model, eng, &s.snap, &s.sleep.level, &s.startup)

	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", s.handleCompletions)
	mux.HandleFunc("POST /v1/chat/completions", s.handleChat)
	mux.HandleFunc("GET /v1/models", s.handleModels)
	mux.HandleFunc("POST /v1/responses", s.handleResponses)
	mux.HandleFunc("GET /v1/responses/{id}", s.handleRetrieveResponse)
	mux.HandleFunc("POST /v1/responses/{id}/cancel", s.handleCancelResponse)
	mux.HandleFunc("POST /v1/embeddings", s.handleEmbeddings)
	mux.HandleFunc("POST /tokenize", s.handleTokenize)
	mux.HandleFunc("POST /detokenize", s.handleDetokenize)
	s.renderRoutes(mux)
	mux.HandleFunc("/", handleNotFound)
	mux.HandleFunc("GET /health", s.handleHealth)
	s.pdRoutes(mux, pd.BootstrapOnMain)
	if cfg.EnableSleepMode {
		s.sleepRoutes(mux)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.metrics.reg, promhttp.HandlerOpts{MaxRequestsInFlight: maxMetricsScrapes}))
	s.handler = withAPIKeys(mux, cfg.APIKeys)
	if cfg.KVEvents.Publishes() {
		kc := cfg.KVEvents
		kc.Endpoint = kvevents.OffsetEndpointPort(kc.WithDefaults().Endpoint, index)
		kc.ReplayEndpoint = kvevents.OffsetEndpointPort(kc.ReplayEndpoint, index)
		if s.kvpub, err = kvevents.NewPublisher(kc); err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
		pub := s.kvpub
		s.metrics.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "infergate_sim_kv_event_batches_total",
			Help:        "Simulator only (not vLLM): KV-event batches queued for publishing (sequence numbers used, dropped ones included); a subscriber that applied as many has every event of the responses delivered so far.",
			ConstLabels: prometheus.Labels{"model_name": cfg.Model, "engine": "0"}},
			func() float64 { return float64(pub.NextSeq()) }))
	}
	if err := s.startBootstrap(); err != nil {
		if s.kvpub != nil {
			_ = s.kvpub.Close()
		}
		return nil, err
	}
	return s, nil
}

// Handler returns the HTTP handler: POST /v1/completions, POST
// /v1/chat/completions, POST /v1/responses (and GET /v1/responses/{id},
// POST …/cancel), POST /v1/embeddings, POST /tokenize, POST /detokenize,
// GET /v1/models, GET /health, GET /metrics; any other path answers
// FastAPI's 404 {"detail":"Not Found"}, as vLLM does.
func (s *Server) Handler() http.Handler { return s.handler }

// Model returns the served model name.
func (s *Server) Model() string { return s.cfg.Model }

// Tokenizer returns the tokenizer the server renders and tokenizes every
// prompt with (tokenizer.go).
func (s *Server) Tokenizer() Tokenizer { return s.tok }

// EngineConfig returns the engine configuration with defaults applied.
func (s *Server) EngineConfig() sim.Config { return s.eng }

// RemoteStore returns the engine's remote KV tier (its own, or its
// fleet's shared store), or nil when it has none.
func (s *Server) RemoteStore() *RemoteStore { return s.remote }

// Stats returns the engine snapshot published after the latest step.
func (s *Server) Stats() sim.Stats { return *s.snap.Load() }

// Utilization returns the fraction of simulated time since Start that the
// engine spent executing steps (0..1; 0 before Start).
func (s *Server) Utilization() float64 {
	t0 := s.startWall.Load()
	if t0 == 0 {
		return 0
	}
	elapsed := float64(time.Since(time.Unix(0, t0))) * s.cfg.TimeScale
	if elapsed <= 0 {
		return 0
	}
	return min(1, float64(s.Stats().BusyTime)/elapsed)
}

// Start starts the driver goroutine. Calling it again, or after Close, does nothing.
func (s *Server) Start() {
	s.startOnce.Do(func() {
		select {
		case <-s.quit:
			return
		default:
		}
		s.started.Store(true)
		if s.cfg.Startup != nil {
			s.loading.Store(true) // before any request can see the server started
		}
		go s.drive()
		if s.bootSrv != nil {
			go func() { _ = s.bootSrv.Serve(s.bootLn) }() // http.ErrServerClosed after Close
		}
	})
}

// Close stops the driver, failing in-flight requests (streams get an error
// event then [DONE]; others a 503), and waits for it to exit, then closes the
// KV-event publisher. Handlers still running return promptly. Close is
// idempotent.
func (s *Server) Close() {
	s.closeOnce.Do(func() {
		close(s.quit)
		s.startOnce.Do(func() {}) // a later Start does nothing
		if !s.started.Load() {
			close(s.done)
		}
		<-s.done
		if s.bootSrv != nil {
			_ = s.bootSrv.Close() // closes the listener, served or not
		}
		s.pdClient.CloseIdleConnections()
		if s.kvpub != nil {
			_ = s.kvpub.Close()
		}
		if s.ownsRemote {
			s.remote.close()
		}
		if s.lease != nil { // the driver's, done: the engine has stopped reading the weights
			s.lease.Release()
		}
	})
	<-s.done
}

// event is what the driver tells a request's handler: a token, or the end.
type event struct {
	text     string
	first    bool
	finished bool
	usage    openai.Usage
	err      *openai.Error
	// held is set on a prefill leg's last event: the blocks it holds for
	// a decode engine (its kv_transfer_params.remote_block_ids).
	held []int32
}

// call is one request between its handler and the driver. The driver appends
// events under mu and signals notify (capacity 1); the handler drains them.
type call struct {
	id  string
	req sim.Request
	// maxTokensParam is the client's max_tokens (0 when absent), for
	// vllm:request_params_max_tokens.
	maxTokensParam int

	mu     sync.Mutex
	events []event
	notify chan struct{}

	// Owned by the driver: simulated times of Add, of the first token and of
	// the latest token.
	arrival, first, last time.Duration

	// P/D: a prefill leg's registry keys besides its id, and the blocks it
	// holds once finished (driver-owned); a decode leg's prefill, and
	// readDone, set by the driver when its read ended (before the event
	// of its first token).
	pdKeys   []string
	held     []int32
	pdSrc    *pdSource
	readDone atomic.Bool
}

func (c *call) push(ev event) {
	c.mu.Lock()
	c.events = append(c.events, ev)
	c.mu.Unlock()
	select {
	case c.notify <- struct{}{}:
	default:
	}
}

func (c *call) take(buf []event) []event {
	c.mu.Lock()
	buf = append(buf[:0], c.events...)
	c.events = c.events[:0]
	c.mu.Unlock()
	return buf
}

var errShutdown = openai.NewError(http.StatusServiceUnavailable, "the simulated engine is shutting down", "", "")

// drive is the driver goroutine: the only code touching the sim.Engine.
func (s *Server) drive() {
	defer close(s.done)
	if !s.load() {
		return // closed while starting up
	}
	e := sim.NewEngine(s.eng)
	calls := make(map[string]*call)
	s.inflight = calls
	start := time.Now()
	s.startWall.Store(start.UnixNano())
	var vnow time.Duration
	publish := func() {
		st := e.Stats()
		s.snap.Store(&st)
		s.metrics.setLoRAInfo(&st, time.Now())
	}
	wallVirtual := func() time.Duration {
		return time.Duration(float64(time.Since(start)) * s.cfg.TimeScale)
	}
	add := func(c *call, at time.Duration) {
		if err := e.Add(&c.req, at); err != nil {
			// Handlers check requests first; this is a bug guard.
			c.push(event{err: openai.NewError(http.StatusInternalServerError, err.Error(), "", ""), finished: true})
			return
		}
		c.arrival = at
		calls[c.id] = c
		publish()
	}
	abort := func(c *call) {
		if calls[c.id] == c {
			e.Abort(c.id)
			delete(calls, c.id)
			s.metrics.success.WithLabelValues("abort").Inc()
			publish()
		}
	}
	shutdown := func() {
		for _, c := range calls {
			c.push(event{err: errShutdown, finished: true})
		}
	}
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()

	for {
		if !e.HasWork() || s.paused {
			publish()
			// Held blocks expire on an idle engine too: wake at the
			// earliest abort timeout.
			var expiry <-chan time.Time
			expireAt, holding := e.NextHeldExpiry()
			if holding {
				timer.Reset(max(0, time.Until(start.Add(time.Duration(float64(expireAt)/s.cfg.TimeScale)))))
				expiry = timer.C
			}
			select {
			case <-expiry:
				vnow = max(vnow, wallVirtual(), expireAt)
				if e.ExpireHeld(vnow) > 0 {
					s.pdReg.sweep(e.Holds)
				}
			case c := <-s.submit:
				vnow = max(vnow, wallVirtual())
				add(c, vnow)
			case c := <-s.cancel:
				abort(c)
			case c := <-s.control:
				// An idle engine's clock follows the wall's (a wake-up
				// resumes it after a sleep at the wall-derived time).
				vnow = max(vnow, wallVirtual())
				s.runEngineCall(e, c, vnow)
			case <-s.quit:
				shutdown()
				return
			}
			continue
		}
		res := e.Step(vnow)
		end := vnow + res.Duration
		kvBatch := s.kvEncode(res.Events, end) // the events are only valid until the engine is used again
		// A step that scheduled nothing while lower-tier loads are in
		// flight (sim/tiers.go) is a wait for the first to end: the engine
		// sleeps until NextLoad, and a request submitted or cancelled, or
		// an engine call, wakes it earlier, at the wall-derived time — as
		// the virtual fleet's engine wakes at an arrival (virtual/fleet.go
		// step and arrive). Its events (loads registered) happened at vnow.
		loading := false
		if res.Duration == 0 {
			if at, ok := e.NextLoad(); ok && at > vnow {
				end, loading = at, true
				kvBatch = s.kvEnqueue(kvBatch)
				publish() // Stats().Loading while it sleeps
			}
		}
		deadline := start.Add(time.Duration(float64(end) / s.cfg.TimeScale))
		woken := false
		// wake ends a load wait at the wall-derived time, within [vnow, end].
		wake := func() time.Duration {
			end, woken = min(max(wallVirtual(), vnow), end), true
			return end
		}
	wait:
		for {
			d := time.Until(deadline)
			if d <= 0 {
				break
			}
			timer.Reset(d)
			select {
			case <-timer.C:
				break wait
			case c := <-s.submit:
				if loading {
					add(c, wake())
					break wait
				}
				add(c, min(max(wallVirtual(), vnow), end))
			case c := <-s.cancel:
				abort(c)
				if loading {
					wake()
					break wait
				}
			case c := <-s.control:
				if loading {
					s.runEngineCall(e, c, wake())
					break wait
				}
				kvBatch = s.kvEnqueue(kvBatch) // the step's events precede the call's
				s.runEngineCall(e, c, end)     // after the step, whose events it follows
			case <-s.quit:
				shutdown()
				return
			}
		}
		vnow = end
		if !woken {
			lag := max(0, time.Duration(float64(time.Since(deadline))*s.cfg.TimeScale))
			s.lag.observe(lag)
			s.metrics.stepLag.Observe(lag.Seconds())
		}
		// Publish before delivering, so a client that has seen a token also
		// sees the engine state that produced it.
		publish()
		s.kvEnqueue(kvBatch)
		s.pdStep(e, calls, &res, end)
		s.deliver(calls, res.Outputs, end)
	drain:
		for {
			select {
			case c := <-s.submit:
				add(c, vnow)
			case c := <-s.cancel:
				abort(c)
			case c := <-s.control:
				s.runEngineCall(e, c, vnow)
			default:
				break drain
			}
		}
	}
}

// deliver hands a step's outputs, completed at simulated time at, to their
// requests and records metrics, latencies in simulated seconds.
func (s *Server) deliver(calls map[string]*call, outs []sim.Output, at time.Duration) {
	if len(outs) > 0 {
		// vLLM IterationStats: prompt tokens of requests that produced their
		// first token in the step, plus the tokens generated.
		tokens := 0
		for _, o := range outs {
			if o.FirstToken {
				tokens += o.PromptTokens
			}
			tokens += o.NewTokens
		}
		s.metrics.iterationTokens.Observe(float64(tokens))
	}
	for _, o := range outs {
		c := calls[o.ID]
		if c == nil || o.NewTokens == 0 {
			continue
		}
		if o.FirstToken {
			s.metrics.firstToken(at-c.arrival, c.req.MaxTokens)
			c.first = at
		} else {
			s.metrics.itl.Observe((at - c.last).Seconds())
		}
		c.last = at
		ev := event{text: s.words[o.Token], first: o.FirstToken, finished: o.Finished, usage: usage(o)}
		if o.Finished && c.held != nil {
			ev.held = c.held
		}
		if o.Finished {
			s.metrics.finished(c.arrival, o.Scheduled, c.first, at, o.PromptTokens, o.OutputTokens, c.maxTokensParam)
			delete(calls, o.ID)
		}
		c.push(ev)
	}
}

func usage(o sim.Output) openai.Usage {
	return openai.Usage{
		PromptTokens:        o.PromptTokens,
		CompletionTokens:    o.OutputTokens,
		TotalTokens:         o.PromptTokens + o.OutputTokens,
		PromptTokensDetails: &openai.PromptTokensDetails{CachedTokens: o.CachedTokens},
	}
}

// genRequest is what the two generation endpoints have in common.
type genRequest struct {
	chat           bool
	id             string
	model          string // as requested: the base model or an adapter
	adapter        string // LoRA adapter, "" for the base model (set by check)
	tokens         []uint32
	maxTokens      int
	maxTokensParam int // the client's max_tokens, 0 when absent
	stream         bool
	streamOptions  *openai.StreamOptions
	cacheSalt      string
	// resp is set for a Responses API request (responses.go).
	resp *responsesCall
	// pd holds the request's P/D fields (nil: none; pd.go); a prefill
	// leg names pdHost:pdPort as its side channel.
	pd     *pdRequest
	pdHost string
	pdPort int
}

func (s *Server) handleChat(w http.ResponseWriter, r *http.Request) {
	var req openai.ChatRequest
	body, pd, e := s.decodeGen(w, r, &req)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	g, e := s.chatGen(body, &req, pd)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	s.serve(w, r, &g)
}

// chatGen tokenizes a decoded chat request (body: its JSON; pd: its P/D
// fields, nil for none) and builds the generation it asks for, checked
// (s.check): what the chat endpoint serves and its render endpoint answers.
func (s *Server) chatGen(body []byte, req *openai.ChatRequest, pd *pdRequest) (genRequest, *openai.Error) {
	maxTokens := req.MaxTokens
	if req.MaxCompletionTokens != nil {
		maxTokens = req.MaxCompletionTokens
	}
	toks, e := s.chatTokens(body, req.Messages, req.Tools)
	if e != nil {
		return genRequest{}, e
	}
	g := genRequest{
		chat:           true,
		id:             s.newID("chatcmpl-"),
		model:          req.Model,
		tokens:         toks,
		maxTokens:      orDefault(maxTokens, DefaultMaxTokens),
		maxTokensParam: orDefault(maxTokens, 0),
		stream:         req.Stream,
		streamOptions:  req.StreamOptions,
		cacheSalt:      req.CacheSalt,
		pd:             pd,
	}
	return g, s.check(&g, req.N)
}

func (s *Server) handleCompletions(w http.ResponseWriter, r *http.Request) {
	var req openai.CompletionRequest
	body, pd, e := s.decodeGen(w, r, &req)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	if req.Prompt.Len() != 1 {
		openai.WriteError(w, openai.Errorf("prompt", "the simulator serves one prompt per request; got a batch of "+fmt.Sprint(req.Prompt.Len())))
		return
	}
	if req.Echo {
		openai.WriteError(w, openai.Errorf("echo", "echo is not supported by the simulator"))
		return
	}
	g := genRequest{
		id:             s.newID("cmpl-"),
		model:          req.Model,
		maxTokens:      orDefault(req.MaxTokens, DefaultMaxTokens),
		maxTokensParam: orDefault(req.MaxTokens, 0),
		stream:         req.Stream,
		streamOptions:  req.StreamOptions,
		cacheSalt:      req.CacheSalt,
		pd:             pd,
	}
	if len(req.Prompt.Texts) == 1 {
		var opt templateFields
		if e := openai.Decode(body, &opt); e != nil {
			openai.WriteError(w, e)
			return
		}
		// vLLM's CompletionRequest.add_special_tokens defaults to true.
		if g.tokens, e = s.encode(req.Prompt.Texts[0], opt.AddSpecialTokens == nil || *opt.AddSpecialTokens); e != nil {
			openai.WriteError(w, e)
			return
		}
	} else {
		g.tokens = req.Prompt.Tokens[0]
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
	s.serve(w, r, &g)
}

// decode reads a JSON body of at most MaxRequestBytes into v and validates it.
func (s *Server) decode(w http.ResponseWriter, r *http.Request, v interface{ Validate() *openai.Error }) *openai.Error {
	if e := s.decodeBody(w, r, v); e != nil {
		return e
	}
	return v.Validate()
}

// decodeBody reads a JSON body of at most MaxRequestBytes into v.
func (s *Server) decodeBody(w http.ResponseWriter, r *http.Request, v any) *openai.Error {
	_, e := s.decodeRaw(w, r, v)
	return e
}

// decodeRaw is decodeBody, returning the body too.
func (s *Server) decodeRaw(w http.ResponseWriter, r *http.Request, v any) ([]byte, *openai.Error) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxRequestBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, openai.NewError(http.StatusRequestEntityTooLarge,
				fmt.Sprintf("request body exceeds %d bytes", tooBig.Limit), "", openai.CodeRequestTooLarge)
		}
		return nil, openai.NewError(http.StatusBadRequest, "reading request body: "+err.Error(), "", "")
	}
	return body, openai.Decode(body, v)
}

// decodeGen decodes and validates a generation request, and reads its P/D
// fields (kv_transfer_params, SGLang's bootstrap_*; pd.go).
func (s *Server) decodeGen(w http.ResponseWriter, r *http.Request, v interface{ Validate() *openai.Error }) ([]byte, *pdRequest, *openai.Error) {
	body, e := s.decodeRaw(w, r, v)
	if e != nil {
		return nil, nil, e
	}
	if e := v.Validate(); e != nil {
		return nil, nil, e
	}
	pd, e := parsePD(body, s.pd.Role)
	return body, pd, e
}

// maxBytesPerToken bounds how much prompt text is tokenized per token of
// context: English averages about 4 bytes per cl100k token (Llama-3's and
// Qwen3's alike), so text longer than 16 bytes per token of the model's
// context cannot fit, and tokenizing it in full would only cost memory.
const maxBytesPerToken = 16

// encode tokenizes a text prompt with the server's tokenizer (addSpecial:
// its BOS, as vLLM's add_special_tokens). Text too long to fit the context
// is cut at maxBytesPerToken × MaxModelLen bytes (prefix.CutText) and
// marked with one extra token past the limit, so check answers the usual
// context-length error. A tokenizer error (a pre-tokenizer pattern out of
// its match budget) is a 400.
func (s *Server) encode(text string, addSpecial bool) ([]uint32, *openai.Error) {
	ids, cut, e := s.encodeCut(text, addSpecial)
	for cut && len(ids) <= s.eng.Profile.MaxModelLen {
		ids = append(ids, 0)
	}
	return ids, e
}

// encodeCut is encode without the marker: cut reports that text was cut.
func (s *Server) encodeCut(text string, addSpecial bool) (ids []uint32, cut bool, e *openai.Error) {
	if limit := s.eng.Profile.MaxModelLen; limit > 0 {
		text, cut = prefix.CutText(text, maxBytesPerToken*limit)
	}
	ids, err := s.tok.Encode(nil, text, addSpecial)
	if err != nil {
		return nil, false, openai.Errorf("prompt", "tokenizing the prompt: "+err.Error())
	}
	return ids, cut, nil
}

// templateFields are the fields of vLLM's chat and tokenize requests that
// decide how a chat is rendered and a prompt tokenized
// (vllm/entrypoints/openai/protocol.py, ChatCompletionRequest,
// TokenizeChatRequest, TokenizeCompletionRequest; commit 00b6063f).
type templateFields struct {
	Messages             json.RawMessage `json:"messages"`
	AddGenerationPrompt  *bool           `json:"add_generation_prompt"`  // default true
	ContinueFinalMessage bool            `json:"continue_final_message"` // default false
	AddSpecialTokens     *bool           `json:"add_special_tokens"`     // chat: false; completion: true
	ChatTemplateKwargs   map[string]any  `json:"chat_template_kwargs"`
}

// chatTokens renders a chat request (its body, decoded messages and tools)
// with the server's tokenizer and tokenizes it, without added special
// tokens unless add_special_tokens (vLLM's default for chats: the template
// writes them).
func (s *Server) chatTokens(body []byte, msgs []openai.Message, tools json.RawMessage) ([]uint32, *openai.Error) {
	if _, ok := s.tok.(cl100k); ok {
		// The canonical layout reads none of the template fields: no
		// second decode of the body.
		return s.promptTokens(ChatPrompt{Messages: msgs, Tools: tools, AddGenerationPrompt: true}, false)
	}
	var f templateFields
	if e := openai.Decode(body, &f); e != nil {
		return nil, e
	}
	c := ChatPrompt{Messages: msgs, RawMessages: f.Messages, Tools: tools, AddGenerationPrompt: f.AddGenerationPrompt == nil || *f.AddGenerationPrompt,
		ContinueFinalMessage: f.ContinueFinalMessage, Kwargs: f.ChatTemplateKwargs}
	return s.promptTokens(c, f.AddSpecialTokens != nil && *f.AddSpecialTokens)
}

// promptTokens renders c with the server's tokenizer and tokenizes it
// (encode).
func (s *Server) promptTokens(c ChatPrompt, addSpecial bool) ([]uint32, *openai.Error) {
	text, err := s.tok.RenderChat(c)
	if err != nil {
		return nil, openai.Errorf("messages", err.Error())
	}
	return s.encode(text, addSpecial)
}

// check resolves the requested model to the base model or one of its LoRA
// adapters (404 if neither) and validates what the engine and the simulator
// require.
// check validates what the engine and the simulator require.
func (s *Server) check(g *genRequest, n *int) *openai.Error {
	switch {
	case g.model == s.cfg.Model:
		g.adapter = ""
	case s.eng.LoRA.AdapterID(g.model) != 0:
		g.adapter = g.model
	default:
		return openai.NewError(http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", g.model), "model", openai.CodeModelNotFound)
	}
	if n != nil && *n != 1 {
		return openai.Errorf("n", "the simulator generates one choice per request (n must be 1)")
	}
	if g.pd != nil && g.pd.oneToken {
		g.maxTokens = 1 // SGLang's prefill server does not decode
	}
	if err := s.eng.CheckRequest(len(g.tokens), g.maxTokens); err != nil {
		msg := err.Error()
		switch {
		case errors.Is(err, sim.ErrTooLong):
			msg = fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
				s.eng.Profile.MaxModelLen, uint64(len(g.tokens))+uint64(g.maxTokens), len(g.tokens), g.maxTokens)
		case errors.Is(err, sim.ErrEmptyPrompt):
			msg = "the prompt must not be empty"
		}
		return openai.Errorf("", strings.TrimPrefix(msg, "sim: "))
	}
	return nil
}

// serve submits the request to the driver and writes the response.
func (s *Server) serve(w http.ResponseWriter, r *http.Request, g *genRequest) {
	if !s.started.Load() {
		openai.WriteError(w, openai.NewError(http.StatusServiceUnavailable, "the simulated engine is not running", "", ""))
		return
	}
	if s.loading.Load() {
		openai.WriteError(w, errLoading)
		return
	}
	if slog.Default().Enabled(r.Context(), slog.LevelDebug) {
		// What vLLM reads for its OpenTelemetry spans (--otlp-traces-endpoint):
		// the request's W3C trace context, logged so a test or an operator
		// can follow a trace through the gateway to the engine.
		slog.Debug("sim: request received", "id", g.id, "x_request_id", r.Header.Get("X-Request-Id"),
			"traceparent", r.Header.Get("Traceparent"), "tracestate", r.Header.Get("Tracestate"))
	}
	c := &call{
		id: g.id,
		req: sim.Request{ID: g.id, Tokens: g.tokens, MaxTokens: g.maxTokens,
			Extra: prefix.Seed(g.cacheSalt), LoRA: g.adapter},
		maxTokensParam: g.maxTokensParam,
		notify:         make(chan struct{}, 1),
	}
	ctx := r.Context()
	auth := r.Header.Get("Authorization")
	if g.pd != nil && !s.pdPrepare(ctx, r, g, c, auth) {
		return // the client went away while D waited for P
	}
	released := false
	// release tells P that D read its blocks, once, when the read ended.
	release := func() {
		if c.pdSrc != nil && !released && c.readDone.Load() {
			released = true
			s.pdRelease(context.WithoutCancel(ctx), c.pdSrc, auth)
		}
	}
	defer release()
	select {
	case s.submit <- c:
	case <-ctx.Done():
		return
	case <-s.done:
		openai.WriteError(w, errShutdown)
		return
	}
	var out responder
	switch {
	case g.resp != nil && g.stream:
		out = newResponsesStream(w, s, g)
	case g.resp != nil:
		out = &responsesFull{w: w, s: s, g: g}
	case g.stream:
		out = newStreamResponder(w, s, g)
	default:
		out = &fullResponder{w: w, s: s, g: g}
	}
	var buf []event
	for {
		select {
		case <-c.notify:
		case <-ctx.Done():
			select {
			case s.cancel <- c:
			case <-s.done:
			}
			return
		case <-s.done:
			// The driver pushed its last events before exiting: deliver them.
			buf = c.take(buf)
			if !out.events(buf) {
				out.fail(errShutdown)
			}
			return
		}
		buf = c.take(buf)
		release()
		if out.events(buf) {
			return
		}
	}
}

// responder writes one response from the request's events.
type responder interface {
	// events writes evs and reports whether the response is complete.
	events(evs []event) bool
	// fail ends the response with an error.
	fail(e *openai.Error)
}

// fullResponder collects a non-streaming response.
type fullResponder struct {
	w    http.ResponseWriter
	s    *Server
	g    *genRequest
	text strings.Builder
}

func (f *fullResponder) events(evs []event) bool {
	for _, ev := range evs {
		if ev.err != nil {
			f.fail(ev.err)
			return true
		}
		f.text.WriteString(ev.text)
		if !ev.finished {
			continue
		}
		u := ev.usage
		reason := "length"
		var body any
		if f.g.chat {
			body = openai.ChatCompletion{
				ID: f.g.id, Object: openai.ObjectChatCompletion, Created: time.Now().Unix(), Model: f.g.model,
				Choices: []openai.ChatChoice{{Message: openai.ChatMessage{Role: "assistant", Content: f.text.String()}, FinishReason: &reason}},
				Usage:   &u,
			}
		} else {
			body = openai.Completion{
				ID: f.g.id, Object: openai.ObjectTextCompletion, Created: time.Now().Unix(), Model: f.g.model,
				Choices: []openai.CompletionChoice{{Text: f.text.String(), FinishReason: &reason}},
				Usage:   &u,
			}
		}
		writeJSON(f.w, http.StatusOK, f.s.withKVParams(body, f.g, ev.held))
		return true
	}
	return false
}

func (f *fullResponder) fail(e *openai.Error) { openai.WriteError(f.w, e) }

// streamResponder writes Server-Sent Events like vLLM (docs/PROTOCOLS.md §5.4): a
// role chunk before the first chat token, one chunk per token flushed at once,
// finish_reason on the last token's chunk, an optional usage chunk with empty
// choices, then [DONE].
type streamResponder struct {
	w       http.ResponseWriter
	flusher http.Flusher
	s       *Server
	g       *genRequest
	created int64
	buf     []byte
}

func newStreamResponder(w http.ResponseWriter, s *Server, g *genRequest) *streamResponder {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("Connection", "keep-alive")
	w.WriteHeader(http.StatusOK)
	f, _ := w.(http.Flusher)
	sr := &streamResponder{w: w, flusher: f, s: s, g: g, created: time.Now().Unix()}
	sr.flush()
	return sr
}

func (sr *streamResponder) flush() {
	if sr.flusher != nil {
		sr.flusher.Flush()
	}
}

// send writes one "data:" event holding v as JSON.
func (sr *streamResponder) send(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		return
	}
	sr.buf = append(sr.buf[:0], "data: "...)
	sr.buf = append(sr.buf, b...)
	sr.buf = append(sr.buf, "\n\n"...)
	_, _ = sr.w.Write(sr.buf)
}

func (sr *streamResponder) events(evs []event) bool {
	g := sr.g
	continuous := g.streamOptions != nil && g.streamOptions.ContinuousUsageStats
	for _, ev := range evs {
		if ev.err != nil {
			sr.fail(ev.err)
			return true
		}
		var reason *string
		if ev.finished {
			r := "length"
			reason = &r
		}
		var u *openai.Usage
		if continuous {
			uu := ev.usage
			u = &uu
		}
		text := ev.text
		if g.chat {
			if ev.first {
				empty := ""
				sr.send(openai.ChatChunk{ID: g.id, Object: openai.ObjectChatCompletionChunk, Created: sr.created, Model: g.model,
					Choices: []openai.ChatChunkChoice{{Delta: openai.Delta{Role: "assistant", Content: &empty}}}})
			}
			sr.send(sr.s.withKVParams(openai.ChatChunk{ID: g.id, Object: openai.ObjectChatCompletionChunk, Created: sr.created, Model: g.model,
				Choices: []openai.ChatChunkChoice{{Delta: openai.Delta{Content: &text}, FinishReason: reason}}, Usage: u}, g, ev.held))
		} else {
			sr.send(sr.s.withKVParams(openai.Completion{ID: g.id, Object: openai.ObjectTextCompletion, Created: sr.created, Model: g.model,
				Choices: []openai.CompletionChoice{{Text: text, FinishReason: reason}}, Usage: u}, g, ev.held))
		}
		if ev.finished {
			if g.streamOptions != nil && g.streamOptions.IncludeUsage {
				uu := ev.usage
				if g.chat {
					sr.send(openai.ChatChunk{ID: g.id, Object: openai.ObjectChatCompletionChunk, Created: sr.created, Model: g.model,
						Choices: []openai.ChatChunkChoice{}, Usage: &uu})
				} else {
					sr.send(openai.Completion{ID: g.id, Object: openai.ObjectTextCompletion, Created: sr.created, Model: g.model,
						Choices: []openai.CompletionChoice{}, Usage: &uu})
				}
			}
			sr.done()
			return true
		}
	}
	sr.flush()
	return false
}

// fail sends the error as an event, then [DONE], as vLLM does for mid-stream errors.
func (sr *streamResponder) fail(e *openai.Error) {
	sr.send(openai.ErrorResponse{Error: e})
	sr.done()
}

func (sr *streamResponder) done() {
	_, _ = io.WriteString(sr.w, "data: [DONE]\n\n")
	sr.flush()
}

// handleModels lists the base model, then each LoRA adapter as its own entry
// whose parent is the base model (vLLM OpenAIServingModels.show_available_models:
// adapter cards have root = the adapter's path, here its name, and no
// max_model_len).
func (s *Server) handleModels(w http.ResponseWriter, _ *http.Request) {
	data := make([]openai.Model, 0, 1+len(s.eng.LoRA.Adapters))
	data = append(data, openai.Model{
		ID: s.cfg.Model, Object: openai.ObjectModel, Created: s.created, OwnedBy: "vllm",
		Root: s.cfg.Model, MaxModelLen: s.eng.Profile.MaxModelLen,
	})
	for _, a := range s.eng.LoRA.Adapters {
		parent := s.cfg.Model
		data = append(data, openai.Model{
			ID: a, Object: openai.ObjectModel, Created: s.created, OwnedBy: "vllm",
			Root: a, Parent: &parent,
		})
	}
	writeJSON(w, http.StatusOK, openai.ModelList{Object: openai.ObjectList, Data: data})
}

// handleHealth answers 200 with an empty body while the engine runs (like
// vLLM's /health), 503 otherwise.
func (s *Server) handleHealth(w http.ResponseWriter, _ *http.Request) {
	select {
	case <-s.done:
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	default:
	}
	if !s.started.Load() || s.loading.Load() {
		w.WriteHeader(http.StatusServiceUnavailable) // loading: vLLM does not answer at all yet (README "Start-up and sleep")
		return
	}
	w.WriteHeader(http.StatusOK)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		openai.WriteError(w, openai.NewError(http.StatusInternalServerError, err.Error(), "", ""))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// newID returns prefix followed by 32 random hex digits (crypto/rand), as
// vLLM's random_uuid() ids are: unique across servers and processes (ids
// derived from the seed collided between two sim processes, and a
// Responses previous_response_id then named another user's conversation),
// and unpredictable (a per-process random half with a counter mixed into
// the other let one client compute another's ids from its own, then take
// over their responses with request_id).
func (s *Server) newID(prefix string) string {
	var b [16]byte
	_, _ = crand.Read(b[:]) // it cannot fail on Linux
	return prefix + hex.EncodeToString(b[:])
}

// mix64 is the splitmix64 finalizer.
func mix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

func orDefault(p *int, def int) int {
	if p == nil {
		return def
	}
	return *p
}
