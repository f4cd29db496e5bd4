package simserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/infergate/infergate/openai"
)

// ElasticConfig sizes an ElasticFleet.
type ElasticConfig struct {
	// Min and Max bound the engines running (0 ≤ Min ≤ Max, Max ≥ 1).
	Min, Max int
	// Drain is how long a stopping engine reports unready (/health 503)
	// while still serving, before it stops — a request that arrives
	// meanwhile cancels the stop. Give it at least two of the gateway's
	// health-check intervals, so the gateway has taken the engine out of
	// rotation when it stops (Kubernetes' readiness-then-preStop pattern).
	Drain time.Duration
	// Tick is the period of the drain checks (default 100ms).
	Tick time.Duration
	// OnReady, when set, is called (on its own goroutine) as each engine
	// finishes its start-up: a gateway's Probe, so held requests are
	// dispatched at once rather than at the next probe.
	OnReady func(slot int, url string)
}

// ElasticFleet is up to Max simulated engines behind stable loopback URLs
// (slots), of which Desired run: `infergate up --engines MIN..MAX`. A slot
// whose engine does not run answers /health and every API request 503 (a
// replica scaled to zero, its address kept by the gateway); starting it
// runs the engine's modelled cold start (ServerConfig.Startup) before it
// serves. Who decides the count is outside: SetDesired or ScaleTo (an
// autoscaler: in `up`, the gateway's per-pool autoscale.Scaler decisions,
// gateway.ScaleTarget) and Wake (the gateway's scale-from-zero hook: at
// least one, at once, before the next decision). The fleet has no scaling
// rule of its own.
type ElasticFleet struct {
	// URLs are the slots' base URLs, in order.
	URLs []string

	cfg  ServerConfig
	ecfg ElasticConfig

	mu      sync.Mutex
	slots   []*slot
	desired int
	wants   map[string]int // ScaleTo's count per pool; desired is their most
	closed  bool

	https []*http.Server
	quit  chan struct{}
	wg    sync.WaitGroup
}

// slot is one stable address of the fleet and the engine serving it.
type slot struct {
	index int
	// srv is the engine (nil: stopped), draining whether it is being
	// stopped; all under the fleet's mu.
	srv      *Server
	draining bool
	drainEnd time.Time
}

// StartElasticFleet listens on ecfg.Max loopback ports and starts ecfg.Min
// engines configured by cfg (KV events and a remote tier are not supported:
// their addresses would change with each start).
func StartElasticFleet(cfg ServerConfig, ecfg ElasticConfig) (*ElasticFleet, error) {
	if ecfg.Max < 1 || ecfg.Min < 0 || ecfg.Min > ecfg.Max {
		return nil, fmt.Errorf("sim: elastic fleet %d..%d: want 0 <= min <= max, max >= 1", ecfg.Min, ecfg.Max)
	}
	if cfg.KVEvents.Publishes() || !cfg.KVRemote.IsZero() || cfg.PD.Role != "" {
		return nil, errors.New("sim: an elastic fleet's engines publish no KV events and have no remote tier or P/D role")
	}
	if ecfg.Tick <= 0 {
		ecfg.Tick = 100 * time.Millisecond
	}
	cfg, err := loadTokenizerOnce(cfg)
	if err != nil {
		return nil, err
	}
	probe, err := newServer(cfg, 0) // the configuration is checked once, up front
	if err != nil {
		return nil, err
	}
	probe.Close()
	f := &ElasticFleet{cfg: cfg, ecfg: ecfg, quit: make(chan struct{}), wants: map[string]int{}}
	for i := range ecfg.Max {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("sim: slot %d: %w", i, err)
		}
		sl := &slot{index: i}
		f.slots = append(f.slots, sl)
		hs := &http.Server{Handler: f.slotHandler(sl), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: serverIdleTimeout}
		f.https = append(f.https, hs)
		f.URLs = append(f.URLs, "http://"+ln.Addr().String())
		f.wg.Go(func() { _ = hs.Serve(ln) })
	}
	f.SetDesired(ecfg.Min)
	f.wg.Go(f.watch)
	return f, nil
}

// errStopped answers requests to a slot whose engine does not run.
var errStopped = openai.NewError(http.StatusServiceUnavailable, "the engine is scaled to zero; retry later", "", "")

// slotHandler serves sl: its engine's handler, or 503 when it has none;
// /health 503 while it drains too.
func (f *ElasticFleet) slotHandler(sl *slot) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		api := r.URL.Path != "/health" && r.URL.Path != "/metrics"
		f.mu.Lock()
		s, draining := sl.srv, sl.draining
		if s != nil && api && draining {
			sl.draining = false // traffic: the stop is off (the next reconcile drains it again once idle, if above desired)
			slog.Info("sim: elastic fleet: engine busy again; stop cancelled", "slot", sl.index)
		}
		f.mu.Unlock()
		switch {
		case s == nil && r.URL.Path == "/health":
			w.WriteHeader(http.StatusServiceUnavailable)
		case s == nil:
			openai.WriteError(w, errStopped)
		case draining && r.URL.Path == "/health":
			w.WriteHeader(http.StatusServiceUnavailable)
		default:
			s.Handler().ServeHTTP(w, r)
		}
	})
}

// Desired returns the number of engines the fleet runs or starts.
func (f *ElasticFleet) Desired() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.desired
}

// Running returns the engines started (loading or ready, draining ones
// included) and, of those, the ready ones.
func (f *ElasticFleet) Running() (started, ready int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, sl := range f.slots {
		if sl.srv != nil {
			started++
			if sl.srv.State() == StateReady {
				ready++
			}
		}
	}
	return started, ready
}

// Servers returns the engines running now, by slot (nil: stopped).
func (f *ElasticFleet) Servers() []*Server {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]*Server, len(f.slots))
	for i, sl := range f.slots {
		out[i] = sl.srv
	}
	return out
}

// SetDesired sets how many engines run, clamped to [Min, Max]: the lowest
// stopped slots start (each through its cold start) and, above n, idle
// engines drain and stop (busy ones when they are idle). It is the seam an
// autoscaling policy drives.
func (f *ElasticFleet) SetDesired(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.desired = min(max(n, f.ecfg.Min), f.ecfg.Max)
	f.reconcileLocked(time.Now())
}

// ScaleTo is a pool's scaling decision (gateway.ScaleTarget): the fleet
// serves every pool (a model and its LoRA adapters) from the same engines,
// so it runs the most engines any pool wants, clamped to [Min, Max].
func (f *ElasticFleet) ScaleTo(pool string, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.wants[pool] = n
	most := 0
	for _, k := range f.wants {
		most = max(most, k)
	}
	f.desired = min(max(most, f.ecfg.Min), f.ecfg.Max)
	f.reconcileLocked(time.Now())
}

// StartingEngines is the number of engines started and still in their
// modelled start-up (gateway.ScaleTarget); every pool shares them.
func (f *ElasticFleet) StartingEngines(string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, sl := range f.slots {
		if sl.srv != nil && sl.srv.State() == StateLoading {
			n++
		}
	}
	return n
}

// Wake asks for at least one engine: the gateway's scale-from-zero hook
// (it implements gateway.Waker). pool is the model; the fleet serves one.
func (f *ElasticFleet) Wake(_ context.Context, pool string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return errors.New("sim: the elastic fleet is closed")
	}
	if f.desired < 1 {
		slog.Info("sim: elastic fleet: woken from zero", "pool", pool)
		f.desired = 1
		f.wants[pool] = max(f.wants[pool], 1) // until the pool's next decision
	}
	// A draining engine is the fastest way back.
	for _, sl := range f.slots {
		if sl.srv != nil && sl.draining {
			sl.draining = false
		}
	}
	f.reconcileLocked(time.Now())
	return nil
}

// reconcileLocked starts and drains engines towards desired.
func (f *ElasticFleet) reconcileLocked(now time.Time) {
	if f.closed {
		return
	}
	live := 0
	for _, sl := range f.slots {
		if sl.srv != nil && !sl.draining {
			live++
		}
	}
	for _, sl := range f.slots {
		if live >= f.desired {
			break
		}
		switch {
		case sl.srv != nil && sl.draining:
			sl.draining = false
			live++
		case sl.srv == nil:
			s, err := newServer(f.cfg, sl.index)
			if err != nil { // checked at start: a bug guard
				slog.Error("sim: elastic fleet: engine not started", "slot", sl.index, "err", err)
				return
			}
			s.Start()
			sl.srv = s
			if f.ecfg.OnReady != nil {
				i, url := sl.index, f.URLs[sl.index]
				f.wg.Go(func() {
					select {
					case <-s.Ready():
						f.ecfg.OnReady(i, url)
					case <-f.quit:
					}
				})
			}
			if st := f.cfg.Startup; st != nil && st.Weights != nil {
				slog.Info("sim: elastic fleet: engine starting", "slot", sl.index, "url", f.URLs[sl.index],
					"weights", st.Weights.Ref.String()) // the cache decides the tier: logged by the engine
			} else {
				ph := s.StartupPhases()
				slog.Info("sim: elastic fleet: engine starting", "slot", sl.index, "url", f.URLs[sl.index],
					"modelled_startup", ph.Total(), "source", ph.Source)
			}
			live++
		}
	}
	for i := len(f.slots) - 1; i >= 0 && live > f.desired; i-- {
		sl := f.slots[i]
		if sl.srv == nil || sl.draining || sl.srv.State() == StateLoading {
			continue
		}
		if st := sl.srv.Stats(); st.Running+st.Waiting > 0 {
			continue // busy: drained once idle
		}
		sl.draining, sl.drainEnd = true, now.Add(f.ecfg.Drain)
		slog.Info("sim: elastic fleet: engine draining", "slot", sl.index, "drain", f.ecfg.Drain)
		live--
	}
}

// watch ends drains and drains busy engines above the desired count once
// they are idle, every Tick until Close.
func (f *ElasticFleet) watch() {
	t := time.NewTicker(f.ecfg.Tick)
	defer t.Stop()
	for {
		select {
		case <-f.quit:
			return
		case now := <-t.C:
			f.tick(now)
		}
	}
}

func (f *ElasticFleet) tick(now time.Time) {
	var stop []*Server
	f.mu.Lock()
	for _, sl := range f.slots {
		s := sl.srv
		if s == nil || s.State() == StateLoading {
			continue
		}
		st := s.Stats()
		if sl.draining && !now.Before(sl.drainEnd) && st.Running+st.Waiting == 0 {
			stop = append(stop, s)
			sl.srv, sl.draining = nil, false
			slog.Info("sim: elastic fleet: engine stopped", "slot", sl.index)
		}
	}
	f.reconcileLocked(now)
	f.mu.Unlock()
	for _, s := range stop {
		s.Close()
	}
}

// Close stops every engine and listener and waits for them.
func (f *ElasticFleet) Close() {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return
	}
	f.closed = true
	servers := make([]*Server, 0, len(f.slots))
	for _, sl := range f.slots {
		if sl.srv != nil {
			servers = append(servers, sl.srv)
			sl.srv = nil
		}
	}
	f.mu.Unlock()
	close(f.quit)
	for _, s := range servers {
		s.Close()
	}
	for _, hs := range f.https {
		_ = hs.Close()
	}
	f.wg.Wait()
}
