package gateway

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/infergate/infergate/replica"
	"github.com/infergate/infergate/replica/stream"
	"github.com/infergate/infergate/sched"
)

// Replicas: several gateways behind one L4 balancer keep cache affinity
// together (README.md "Replicas"). Each replica publishes, on one Redis
// stream (package replica/stream), a learn per routing decision (the
// endpoint's URL, the prompt's tokens and expected prefill, its block
// hashes) and its per-endpoint load every load_interval; it applies its
// peers' (package replica's Node.Apply, the code virtual time runs): their
// learns teach its policy's approximate index and speculative entries
// (sched.PeerLearner) and
// count on its view of the endpoint's load until the peer's next report,
// which replaces them; peers' loads add to its snapshot (pool.snapshot)
// until load_ttl after they were last heard from. The engines' KV events
// need no exchange: every replica subscribes to them.

// ReplicasConfig is the `replicas` section: off unless redis_url is set.
type ReplicasConfig struct {
	// RedisURL is the Redis server of the exchange
	// (redis://[:password@]host:port[/db]); "" turns the exchange off.
	RedisURL string `yaml:"redis_url"`
	// Stream is the stream's key (stream.DefaultStream); replicas of one
	// fleet share it, separate fleets on one Redis use separate keys.
	Stream string `yaml:"stream"`
	// ID is this replica's id, unique among the replicas (default
	// hostname-pid).
	ID string `yaml:"id"`
	// LoadInterval is the period of the load reports (200ms); LoadTTL how
	// long after a peer was last heard from its load counts (1s): a dead
	// replica's load vanishes after it.
	LoadInterval time.Duration `yaml:"load_interval"`
	LoadTTL      time.Duration `yaml:"load_ttl"`
	// PinTTL bounds how long a peer's pin (routing.prefix.learn_on_finish:
	// a peer's learn pins its prompt until the peer's finish) waits for
	// its finish before this replica releases it (10m,
	// replica.DefaultPinTTL): a dropped finish. A silent peer's pins are
	// released after LoadTTL.
	PinTTL time.Duration `yaml:"pin_ttl"`
	// MaxLen trims the stream to about this many entries (10000).
	MaxLen int64 `yaml:"max_len"`
	// Queue bounds the messages waiting to be written (4096); beyond it
	// they are dropped, counted.
	Queue int `yaml:"queue"`
	// Replay reads the stream's history at start to warm the approximate
	// index (default true).
	Replay *bool `yaml:"replay"`
	// Stagger makes this replica, while its decisions come in bursts,
	// wait before each decision for the learns of the replicas ranked
	// before it (at most rank × 3 of the exchange's measured delay), so
	// that replicas take turns in a burst instead of herding
	// (replica.Node.Turn; default true).
	Stagger *bool `yaml:"stagger"`
	// FinishHashes makes this replica's finishes carry the prompt's block
	// hashes (wire kind 4, replica.AppendFinish) instead of naming their
	// learn (kind 5, replica.AppendFinishRef; default false): for a fleet
	// upgraded from replicas that know kind 4 and not kind 5, which count
	// a finish_ref malformed and release the pin only at pin_ttl.
	FinishHashes bool `yaml:"finish_hashes"`
}

// enabled reports whether the exchange is on.
func (c ReplicasConfig) enabled() bool { return c.RedisURL != "" }

func (c ReplicasConfig) withDefaults() ReplicasConfig {
	if !c.enabled() {
		return c
	}
	if c.Stream == "" {
		c.Stream = stream.DefaultStream
	}
	if c.ID == "" {
		host, _ := os.Hostname()
		c.ID = host + "-" + strconv.Itoa(os.Getpid())
	}
	if c.LoadInterval == 0 {
		c.LoadInterval = stream.DefaultLoadInterval
	}
	if c.LoadTTL == 0 {
		c.LoadTTL = replica.DefaultLoadTTL
	}
	if c.PinTTL == 0 {
		c.PinTTL = replica.DefaultPinTTL
	}
	if c.MaxLen == 0 {
		c.MaxLen = stream.DefaultMaxLen
	}
	if c.Queue == 0 {
		c.Queue = stream.DefaultQueue
	}
	if c.Replay == nil {
		t := true
		c.Replay = &t
	}
	if c.Stagger == nil {
		t := true
		c.Stagger = &t
	}
	return c
}

func (c ReplicasConfig) validate() []error {
	if !c.enabled() {
		return nil
	}
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf("replicas."+format, args...)) }
	if _, err := redis.ParseURL(c.RedisURL); err != nil {
		bad("redis_url: %v", err)
	}
	if len(c.ID) > replica.MaxID {
		bad("id %q: at most %d bytes", c.ID, replica.MaxID)
	}
	if c.LoadInterval <= 0 {
		bad("load_interval %v: must be positive", c.LoadInterval)
	}
	if c.LoadTTL < 2*c.LoadInterval {
		bad("load_ttl %v: must be at least twice load_interval (%v), or one late report drops a live peer's load", c.LoadTTL, c.LoadInterval)
	}
	if c.PinTTL < c.LoadTTL {
		bad("pin_ttl %v: must be at least load_ttl (%v)", c.PinTTL, c.LoadTTL)
	}
	if c.MaxLen < 100 {
		bad("max_len %d: must be at least 100", c.MaxLen)
	}
	if c.Queue < 1 {
		bad("queue %d: must be positive", c.Queue)
	}
	return errs
}

// replicas is the gateway's side of the exchange (nil fields when off).
type replicas struct {
	cfg   ReplicasConfig
	node  *replica.Node
	peers *replica.Peers
	x     atomic.Pointer[stream.Exchange]
	lag   prometheus.Histogram
	wait  *prometheus.HistogramVec  // staggered decisions' waits, by release
	known atomic.Pointer[knownURLs] // replicaTarget.Known's set
	turns turns                     // staggered decisions waiting (stagger)
}

// initReplicas registers the exchange's metrics (always, zero when off)
// and, when configured, builds the node the pools' snapshots read.
func (g *Gateway) initReplicas(reg prometheus.Registerer) error {
	r := &replicas{cfg: g.cfg.Replicas}
	g.replicas = r
	if r.cfg.enabled() {
		r.peers = replica.NewPeers(r.cfg.LoadTTL)
		r.node = &replica.Node{ID: r.cfg.ID, Peers: r.peers, Target: replicaTarget{g}, NoStagger: !*r.cfg.Stagger,
			PinTTL: r.cfg.PinTTL}
	}
	r.lag = prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: "infergate", Name: "replica_lag_seconds",
		Help:    "Replica exchange: from a peer's sending a message to this replica's applying it (the two wall clocks; history replayed at start left out).",
		Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}})
	r.wait = prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "infergate", Name: "replica_stagger_seconds",
		Help:    "Replica exchange: how long a routing decision waited for the replicas ranked before this one in a burst (replicas.stagger; decisions not staggered are not observed), by what released it: learns (the learns of every replica ranked before applied; 0 when they already were), deadline, canceled (the request ended).",
		Buckets: []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05}}, []string{"release"})
	cs := []prometheus.Collector{r.lag, r.wait,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "infergate", Name: "replica_peers",
			Help: "Replica exchange: peers heard from within replicas.load_ttl."}, func() float64 {
			if r.peers == nil {
				return 0
			}
			return float64(r.peers.Live(clock(time.Now())))
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "infergate", Name: "replica_redis_up",
			Help: "Replica exchange: 1 while the last Redis call succeeded (0 off or down: routing on this replica's own view)."}, func() float64 {
			if x := r.x.Load(); x != nil && x.Up() {
				return 1
			}
			return 0
		}),
	}
	count := func(outcome string, f func(*replica.Counts, *stream.Counts) uint64) {
		cs = append(cs, prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "infergate", Name: "replica_messages_total",
			Help:        "Replica exchange messages by outcome: published, dropped (queue full or write failed), learn, load and finish (peers' applied), finish_unmatched (of those finishes, ones that named their learn and found no pin of it here: nothing touched), own (skipped), unknown (a pool or endpoint this replica lacks), malformed (refused), peers_full, not_message (an entry without the message field).",
			ConstLabels: prometheus.Labels{"outcome": outcome}}, func() float64 {
			var nc *replica.Counts
			if r.node != nil {
				nc = &r.node.Counts
			}
			var sc *stream.Counts
			if x := r.x.Load(); x != nil {
				sc = &x.Counts
			}
			return float64(f(nc, sc))
		}))
	}
	node := func(f func(*replica.Counts) uint64) func(*replica.Counts, *stream.Counts) uint64 {
		return func(n *replica.Counts, _ *stream.Counts) uint64 {
			if n == nil {
				return 0
			}
			return f(n)
		}
	}
	xs := func(f func(*stream.Counts) uint64) func(*replica.Counts, *stream.Counts) uint64 {
		return func(_ *replica.Counts, s *stream.Counts) uint64 {
			if s == nil {
				return 0
			}
			return f(s)
		}
	}
	count("published", xs(func(s *stream.Counts) uint64 { return s.Published.Load() }))
	count("dropped", xs(func(s *stream.Counts) uint64 { return s.Dropped.Load() }))
	count("not_message", xs(func(s *stream.Counts) uint64 { return s.NotBytes.Load() }))
	count("learn", node(func(n *replica.Counts) uint64 { return n.Learns.Load() }))
	count("load", node(func(n *replica.Counts) uint64 { return n.Loads.Load() }))
	count("finish", node(func(n *replica.Counts) uint64 { return n.Finishes.Load() }))
	count("finish_unmatched", node(func(n *replica.Counts) uint64 { return n.FinishesUnmatched.Load() }))
	count("own", node(func(n *replica.Counts) uint64 { return n.Own.Load() }))
	count("unknown", node(func(n *replica.Counts) uint64 { return n.Unknown.Load() }))
	count("malformed", node(func(n *replica.Counts) uint64 { return n.Malformed.Load() }))
	count("peers_full", node(func(n *replica.Counts) uint64 { return n.PeersFull.Load() }))
	cs = append(cs, prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "infergate", Name: "replica_pins_expired_total",
		Help: "Replica exchange: peers' pins (routing.prefix.learn_on_finish) released without their finish: the peer fell silent for replicas.load_ttl, the pin outlived replicas.pin_ttl, or the table of pins was full."}, func() float64 {
		if r.node == nil {
			return 0
		}
		return float64(r.node.Counts.PinsExpired.Load())
	}))
	cs = append(cs, prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "infergate", Name: "replica_pins_dropped_total",
		Help: "Replica exchange: peers' pins dropped unreleased because a reload replaced their policy or their endpoint's slot was forgotten (reload, ejection)."}, func() float64 {
		if r.node == nil {
			return 0
		}
		return float64(r.node.Counts.PinsDropped.Load())
	}))
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("gateway: register replica metrics: %w", err)
		}
	}
	return nil
}

// startReplicas starts the exchange and the load reports (configured
// only); both stop when the gateway closes.
func (g *Gateway) startReplicas() error {
	r := g.replicas
	if r.node == nil {
		return nil
	}
	x, err := stream.Start(stream.Config{URL: r.cfg.RedisURL, Stream: r.cfg.Stream, MaxLen: r.cfg.MaxLen, Queue: r.cfg.Queue,
		Replay: *r.cfg.Replay, Connected: r.connected}, r.apply)
	if err != nil {
		return err
	}
	r.x.Store(x)
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		defer x.Close()
		t := time.NewTicker(r.cfg.LoadInterval)
		defer t.Stop()
		for {
			select {
			case <-g.loops.Done():
				return
			case <-t.C:
				r.report(g.state.Load())
				r.node.Expire(clock(time.Now())) // peers' pins whose finish never came
			}
		}
	}()
	return nil
}

// connected seeds the exchange's delay before any learn has come back
// (replica.Unseen.Seed): twice the Redis round trip measured at connect,
// a learn's write and its read, so that the fleet's first burst is
// staggered too.
func (r *replicas) connected(rtt time.Duration) {
	r.node.Unseen.Seed(2 * max(rtt, time.Microsecond))
}

// apply is the reader's handler: a peer's message applied (replayed
// history: learns only, its loads being stale).
func (r *replicas) apply(b []byte, replayed bool) {
	if replayed {
		var m replica.Msg
		if replica.Decode(b, &m) == nil && m.Kind == replica.KindLoad {
			return
		}
	}
	now := time.Now()
	m, err := r.node.Apply(b, clock(now))
	if err == nil && m.Kind == replica.KindLearn && m.ID != r.node.ID {
		r.turns.wake() // a staggered decision's turn may have come
	}
	if err != nil || replayed || m.ID == r.node.ID {
		return
	}
	r.lag.Observe(max(0, float64(now.UnixNano()-m.At)/1e9))
}

// report publishes this replica's load of every endpoint.
func (r *replicas) report(st *state) {
	x := r.x.Load()
	if x == nil || st == nil {
		return
	}
	entries := make([]replica.LoadEntry, 0, len(st.endpoints))
	for _, ep := range st.endpoints {
		entries = append(entries, replica.LoadEntry{Endpoint: ep.name, Load: replica.Load{
			InFlight: ep.ledger.InFlight(), InFlightTokens: ep.ledger.InFlightTokens(), PendingPrefill: ep.ledger.PendingPrefill()}})
	}
	x.Publish(replica.AppendLoad(nil, r.cfg.ID, time.Now().UnixNano(), entries))
}

// learnt publishes a routing decision: request req of pool p sent to
// endpoint i with decision d, and counts it unseen by the peers until the
// exchange delivers it back (replica.Unseen). It does not wait (a full
// queue drops it).
func (r *replicas) learnt(p *pool, i int, req *sched.Request, d sched.Decision) {
	r.learntRole(p, i, req, sched.RoleBoth, int64(d.MatchedBlocks*p.blockSize), true)
}

// learntRole publishes the pick of endpoint i of pool p for req by the
// profile of role (sched.RoleBoth: the pool's one policy; a P/D pool's
// sched.RoleDecode or RolePrefill: replica.AppendLearnRole), matched of
// its prompt tokens expected cached there (the pending prefill is the
// rest, as load.Ledger.Send counts it). decision counts it in
// replica.Unseen: once per request, so that a split request's two picks
// do not look like a burst to Node.Stagger.
func (r *replicas) learntRole(p *pool, i int, req *sched.Request, role sched.Role, matched int64, decision bool) {
	x := r.x.Load()
	if x == nil || req.PromptTokens <= 0 {
		return
	}
	prompt := int64(req.PromptTokens)
	pending := max(1, prompt-matched) // as load.Ledger.Send counts it
	now := time.Now()
	if decision {
		// Counted before it is queued, so that the reader cannot echo it
		// first; a learn the queue drops is retired with the next one echoed.
		r.node.Unseen.Sent(now.UnixNano(), clock(now), prompt, pending)
	}
	x.Publish(replica.AppendLearnRole(nil, r.cfg.ID, now.UnixNano(), p.model, p.endpoints[i].name, role, prompt, pending, req.Hashes))
}

// finished publishes the end of a request of pool p on slot i (every
// attempt's, learnFinished): peers whose index learns on finish release
// the pin its learn took there and touch the prompt (sched.PeerFinisher).
// A plain pool's finish names its learn (replica.AppendFinishRef: ~40
// bytes; peers touch with the hashes their pin kept), a P/D pool's, whose
// profiles touch without pins, carries the hashes (replica.AppendFinish),
// and so does every finish with replicas.finish_hashes (a fleet upgraded
// from replicas that know kind 4 but not kind 5). Only when p's policy
// learns on finish and the request's learn was published (hashes, prompt
// tokens); it does not wait.
func (r *replicas) finished(p *pool, i int, req *sched.Request) {
	x := r.x.Load()
	if x == nil || p.peers == nil || req.PromptTokens <= 0 || len(req.Hashes) == 0 || i < 0 || i >= len(p.endpoints) {
		return
	}
	if finisher(p) == nil {
		return
	}
	appendFinish := replica.AppendFinishRef
	if p.pd != nil || r.cfg.FinishHashes {
		appendFinish = replica.AppendFinish
	}
	x.Publish(appendFinish(nil, r.cfg.ID, time.Now().UnixNano(), p.model, p.endpoints[i].name, req.Hashes))
}

// learntPD publishes a P/D pool's pick (pd.go) of slot i, matched of
// the prompt's tokens expected cached there: D's (role sched.RoleDecode;
// split: D reads the prompt's KV from P and prefills nothing, as attempt
// accounts it), counted as the request's decision, or P's
// (sched.RolePrefill: where the prompt's blocks are computed). A pool
// without peers publishes nothing.
func (g *Gateway) learntPD(p *pool, x *exchange, i, matched int, role sched.Role, split bool) {
	if p.peers == nil || i < 0 {
		return
	}
	if split && role == sched.RoleDecode {
		matched = x.sreq.PromptTokens
	}
	g.replicas.learntRole(p, i, &x.sreq, role, int64(matched), role == sched.RoleDecode)
}

// dropPins drops the peers' pins that st no longer holds (replica.Node.
// DropPins): those of a policy st does not route with (replaced or its
// pool gone) and those of the slots pl forgot. Called by commit after the
// forgets.
func (r *replicas) dropPins(st *state, pl *plan) {
	if r == nil || r.node == nil {
		return
	}
	inForce := map[sched.PeerFinisher]bool{}
	for _, p := range st.pools {
		if f, ok := p.policy.(sched.PeerFinisher); ok {
			inForce[f] = true
		}
		if p.pd != nil {
			if f, ok := p.pd.Prefill().(sched.PeerFinisher); ok {
				inForce[f] = true
			}
		}
	}
	type slotOf struct {
		f    sched.PeerFinisher
		slot int
	}
	forgot := map[slotOf]bool{}
	for _, op := range pl.slots {
		if f, ok := op.policy.(sched.PeerFinisher); ok && op.forget {
			forgot[slotOf{f, op.slot}] = true
		}
	}
	r.node.DropPins(func(f sched.PeerFinisher, slot int) bool { return inForce[f] && !forgot[slotOf{f, slot}] })
}

// dropSlot drops the peers' pins on slot i of f, whose forget (an
// ejection) cleared the slot's pins.
func (r *replicas) dropSlot(f sched.PeerFinisher, i int) {
	if r == nil || r.node == nil {
		return
	}
	r.node.DropPins(func(g sched.PeerFinisher, slot int) bool { return g != f || slot != i })
}

// stagger waits before a routing decision of pool p for this replica's
// turn in a burst (replica.Node.Turn and Due): until the learns of the
// replicas ranked before it have been applied, their deadline (at most
// rank × 3 of the exchange's measured delay, replica.MaxStagger), or
// the end of ctx (the request's next stage then sees it ended); nothing
// while its decisions do not come in bursts. It checks Due at each peer's
// learn the reader applies (turns), on the request's own goroutine: no
// polling, no goroutine of its own. A P/D pool waits before its first
// pick, D's then P's (pickSplit). The wait is observed in
// infergate_replica_stagger_seconds by what ended it.
func (r *replicas) stagger(ctx context.Context, p *pool) {
	if r == nil || r.node == nil || p.peers == nil {
		return
	}
	start := time.Now()
	turn, ok := r.node.Turn(clock(start))
	if !ok {
		return
	}
	release := r.turns.wait(ctx, r.node, turn, turn.Deadline-clock(start))
	r.wait.WithLabelValues(release).Observe(time.Since(start).Seconds())
}

// turns wakes staggered decisions when the reader applies a peer's learn:
// a channel closed and replaced at each learn while decisions wait (a
// broadcast to every waiter, which then checks replica.Node.Due), left
// alone otherwise. The zero value is ready.
type turns struct {
	waiting atomic.Int64
	ch      atomic.Pointer[chan struct{}]
	// timer, when set (tests), replaces time.NewTimer for the deadline;
	// it is started after the first check of Due found the turn not come.
	timer func(time.Duration) (c <-chan time.Time, stop func() bool)
}

// wake tells the decisions waiting that a peer's learn was applied
// (called by the reader after Node.Apply). Without a waiter it does
// nothing: a waiter that comes after the learn was applied sees it in Due
// (Node.Apply stores it before wake loads waiting; the waiter adds itself
// before it checks Due: one of the two sees the other).
func (w *turns) wake() {
	if w.waiting.Load() == 0 {
		return
	}
	next := make(chan struct{})
	if old := w.ch.Swap(&next); old != nil {
		close(*old)
	}
}

// wait blocks until node.Due releases turn ("learns"), its deadline, d
// from now, passes ("deadline"), or ctx ends ("canceled"), and returns
// which.
func (w *turns) wait(ctx context.Context, node *replica.Node, turn replica.Turn, d time.Duration) string {
	w.waiting.Add(1)
	defer w.waiting.Add(-1)
	if w.ch.Load() == nil {
		c := make(chan struct{})
		w.ch.CompareAndSwap(nil, &c)
	}
	var deadline <-chan time.Time
	for {
		// The channel before Due: a learn applied after this load closes
		// it, one applied before is seen by Due.
		woken := w.ch.Load()
		if node.Due(turn, clock(time.Now())) == replica.Learnt {
			return "learns"
		}
		if deadline == nil {
			var stop func() bool
			deadline, stop = w.start(d)
			defer stop()
		}
		select {
		case <-*woken:
		case <-deadline:
			return "deadline"
		case <-ctx.Done():
			return "canceled"
		}
	}
}

// start starts the deadline's timer.
func (w *turns) start(d time.Duration) (<-chan time.Time, func() bool) {
	if w.timer != nil {
		return w.timer(d)
	}
	t := time.NewTimer(d)
	return t.C, t.Stop
}

// expect prepares snapshot s for a pick: this replica's share of the
// endpoints marked Preferred and the load its peers are expected to have
// routed that it has not heard of yet added (replica.Node.Expect, which
// virtual time runs too).
func (r *replicas) expect(s []sched.Endpoint) { r.node.Expect(s, clock(time.Now())) }

// replicaTarget resolves peers' learns in the configuration in force.
type replicaTarget struct{ g *Gateway }

// knownURLs is a state's endpoint URLs (each to the endpoint's own
// string: Intern's table), and each pool's slots by endpoint URL
// (Resolve's lookup).
type knownURLs struct {
	st    *state
	urls  map[string]string
	slots map[string]map[string]int // model → endpoint URL → slot
}

// known returns the current state's knownURLs, built once per state (a
// reload publishes a new one). Only the exchange's reader calls it.
func (t replicaTarget) known() *knownURLs {
	st := t.g.state.Load()
	k := t.g.replicas.known.Load()
	if k != nil && k.st == st {
		return k
	}
	k = &knownURLs{st: st, urls: map[string]string{}, slots: map[string]map[string]int{}}
	if st != nil {
		for _, ep := range st.endpoints {
			k.urls[ep.name] = ep.name
		}
		for model, p := range st.pools {
			m := make(map[string]int, len(p.endpoints))
			for i, ep := range p.endpoints {
				if ep == nil || ep == vacant || ep.name == "" {
					continue
				}
				if _, dup := m[ep.name]; !dup {
					m[ep.name] = i
				}
			}
			k.slots[model] = m
		}
	}
	t.g.replicas.known.Store(k)
	return k
}

// Intern implements replica.Target: the endpoint of URL url configured
// now, by its own string (a peer's load report then decodes without a
// string per endpoint). The table is rebuilt when a reload published a
// new state; a URL it lacks is not kept anywhere.
func (t replicaTarget) Intern(url []byte) (string, bool) {
	s, ok := t.known().urls[string(url)]
	return s, ok
}

// Resolve implements replica.Target: a P/D pool's prefill learns teach
// its prefill profile, the others its decode profile (the pool's policy).
// The slot is a map lookup: a scan of the pool's endpoints cost the reader
// 48 µs a learn at 16,384 endpoints (22 µs for a name no slot has, which a
// hostile writer to the stream chooses), and an empty name matched a
// vacant slot.
func (t replicaTarget) Resolve(model, endpoint string, role sched.Role) (sched.PeerLearner, int, bool) {
	k := t.known()
	if k.st == nil {
		return nil, 0, false
	}
	p := k.st.pools[model]
	i, ok := k.slots[model][endpoint]
	if p == nil || !ok {
		return nil, 0, false
	}
	pol := p.policy
	if p.pd != nil && role == sched.RolePrefill {
		pol = p.pd.Prefill()
	}
	l, _ := pol.(sched.PeerLearner)
	return l, i, true
}

// replicaRouting is routing as this replica builds its policies: with
// the exchange on, its seed mixed with the replica's id (replica.Seed), so
// that replicas do not break ties alike and herd.
func (g *Gateway) replicaRouting(routing sched.Config) sched.Config {
	if g.replicas != nil && g.replicas.node != nil {
		routing.Seed = replica.Seed(routing.Seed, g.replicas.cfg.ID)
	}
	return routing
}

// peersOf returns the peers' load table the pools read (nil when off).
func (g *Gateway) peersOf() *replica.Peers {
	if g.replicas == nil {
		return nil
	}
	return g.replicas.peers
}
