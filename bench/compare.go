package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	kinds "github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/report"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/simserver"
	"github.com/infergate/infergate/trace"
	"github.com/infergate/infergate/virtual"
)

// DefaultEngines is the fleet size Compare uses when CompareOptions.Engines is 0.
const DefaultEngines = virtual.DefaultEngines

// shutdownTimeout bounds the graceful shutdown of a run's gateway server.
const shutdownTimeout = 10 * time.Second

// CompareOptions configures Compare.
type CompareOptions struct {
	// Policies are the routing policies to compare, run in this order
	// (default: sched.Names()).
	Policies []string
	// Engines is the number of simulated engines per fleet (default 4).
	Engines int
	// Engine is the engine model of every simulated engine (zero: sim's
	// defaults), its host and disk KV tiers included.
	Engine sim.Config
	// Remote sizes the fleet's shared remote KV tier (simserver's
	// kv_remote; zero: none). The gateway is told every tier (FleetTiers).
	Remote sim.TierSize
	// Records are the requests to replay, in arrival order.
	Records []trace.Record
	// Requests limits each run to the first Requests records (0: all).
	Requests int
	// OutputTokens, if > 0, replaces every record's output length (tokens);
	// see ReplayOptions.OutputTokens.
	OutputTokens int
	// Speedup runs the simulated fleet Speedup times faster than real time
	// (its TimeScale) and compresses arrivals by the same factor, so a run
	// takes about 1/Speedup of the trace's span in wall time while reporting
	// engine time (dimensionless; 0 means 1).
	Speedup float64
	// Model is the served model name (default: the engine profile's model,
	// else sim.DefaultModel).
	Model string
	// Seed seeds the simulated engines and the policies' tie-breaking.
	Seed int64
	// Routing tunes the policies (its Policy field is replaced by each run's
	// policy; a zero Prefix.BlockSize means the engines' block size).
	Routing sched.Config
	// Progress receives per-run progress (see ReplayOptions.Progress); nil
	// for none.
	Progress io.Writer
	// Output, if set, receives every request's measure.Record as a JSON
	// line, with Record.Policy naming the run.
	Output io.Writer
	// Warmup, Concurrency and Sessions are passed to every run's Replay (see
	// ReplayOptions): warm-up exclusion and closed-loop replay.
	Warmup      measure.Warmup
	Concurrency int
	Sessions    []trace.Session
	// RateRPS, if > 0, is recorded in every Summary (measure.Summary.RateRPS): the
	// rate the caller re-timed Records to (see Retime).
	RateRPS float64
	// MaxLag is the lag margin every run is judged against (measure.Summary.CheckLag;
	// engine time; 0 means measure.DefaultMaxLag). Compare reports a run that fell
	// behind (Summary.Behind), it does not stop.
	MaxLag time.Duration
	// References, if set, are the records' reference hits (measure.NewReferences,
	// for this fleet's capacity): every Summary gets its reference hit
	// rates (References.Apply).
	References *measure.References
	// OnRun, if set, is called after each run with its Summary, Records and
	// the prompt tokens each engine counted (report.HTMLRun.EnginePromptTokens);
	// the gateway does not say which engine served a request.
	OnRun func(report.HTMLRun)
}

// Compare replays the same records once per policy, each time through a
// fresh simulated fleet (simserver.StartFleet) behind a fresh gateway routing with
// that policy and served on a loopback port, and returns one measure.Summary per
// policy, with the fleet's mean engine utilisation. The gateway knows each
// engine's KV capacity and block size from the fleet, routes on blocks of
// the engines' size, and does not probe the in-process engines' health.
// Every run is torn down before the next starts, so runs do not share caches
// or connections. Policy names are checked before the first run. It stops at
// the first run that cannot be set up or is cancelled, returning the
// summaries completed so far with the error.
func Compare(ctx context.Context, opts CompareOptions) (report.Report, error) {
	if opts.Speedup == 0 {
		opts.Speedup = 1
	}
	if !(opts.Speedup > 0) || math.IsInf(opts.Speedup, 0) {
		return report.Report{}, fmt.Errorf("bench: speedup %v must be positive and finite", opts.Speedup)
	}
	if opts.Engines == 0 {
		opts.Engines = DefaultEngines
	}
	if opts.Engines < 0 {
		return report.Report{}, fmt.Errorf("bench: %d engines", opts.Engines)
	}
	if len(opts.Policies) == 0 {
		opts.Policies = sched.Names()
	}
	for _, p := range opts.Policies {
		cfg := opts.Routing
		cfg.Policy = p
		if err := sched.Validate(cfg); err != nil {
			return report.Report{}, fmt.Errorf("bench: %w", err)
		}
	}
	if opts.Model == "" {
		opts.Model = opts.Engine.WithDefaults().Profile.Model
	}
	if opts.Model == "" {
		opts.Model = sim.DefaultModel
	}
	var rep report.Report
	for _, p := range opts.Policies {
		s, err := compareOne(ctx, opts, p)
		if err != nil {
			return rep, fmt.Errorf("bench: policy %s: %w", p, err)
		}
		rep.Runs = append(rep.Runs, s)
	}
	return rep, nil
}

// FleetEndpoints is the gateway endpoint configuration of a simulated fleet
// serving model: capacity and block size from the engines, and their KV
// event publishers when they have them.
func FleetEndpoints(fleet *simserver.Fleet, model string) []gateway.EndpointConfig {
	pub, replay := fleet.KVEventEndpoints()
	eps := make([]gateway.EndpointConfig, len(fleet.URLs))
	for i, u := range fleet.URLs {
		eps[i] = gateway.EndpointConfig{URL: u, Model: model, KVBlocks: fleet.KVBlocks(), BlockSize: fleet.BlockSize(), Kind: kinds.Sim}
		if pub[i] != "" {
			eps[i].KVEvents = &gateway.KVEventsConfig{Endpoint: pub[i], ReplayEndpoint: replay[i]}
		}
	}
	return eps
}

// FleetTiers tells cfg (the gateway in front of fleet) the engines' KV
// tiers: each endpoint's kv_events.tiers (capacities in blocks, load costs
// from the engine's profile: sim.Config.LoadCost) and, with a shared remote
// store, a kv_stores entry per model subscribing to its events.
func FleetTiers(fleet *simserver.Fleet, cfg *gateway.Config) {
	if len(fleet.Servers) == 0 {
		return
	}
	eng := fleet.Servers[0].EngineConfig()
	if !eng.Tiers.Enabled() {
		return
	}
	perBlock, latency := eng.LoadCost()
	bb := eng.BlockBytes()
	tier := func(t sim.Tier, blocks int) *gateway.KVTierConfig {
		c := &gateway.KVTierConfig{Blocks: blocks, Latency: time.Duration(latency[t] * float64(time.Second))}
		if perBlock[t] > 0 {
			c.Bandwidth = bb / perBlock[t]
		}
		return c
	}
	models := map[string]bool{}
	for i := range cfg.Endpoints {
		e := &cfg.Endpoints[i]
		models[e.Model] = true
		if e.KVEvents == nil {
			continue
		}
		kv := *e.KVEvents
		kv.Tiers = &gateway.KVTiersConfig{BlockBytes: bb}
		if !eng.Tiers.Host.IsZero() {
			kv.Tiers.CPU = tier(sim.TierHost, eng.TierBlocks(eng.Tiers.Host))
		}
		if !eng.Tiers.Disk.IsZero() {
			kv.Tiers.Disk = tier(sim.TierDisk, eng.TierBlocks(eng.Tiers.Disk))
		}
		if fleet.Remote != nil {
			kv.Tiers.Remote = tier(sim.TierRemote, 0)
		}
		e.KVEvents = &kv
	}
	pub, replay := fleet.Remote.KVEventEndpoints()
	if pub == "" {
		return
	}
	cfg.KVStores = map[string]gateway.KVStoreConfig{}
	for m := range models {
		cfg.KVStores[m] = gateway.KVStoreConfig{Endpoint: pub, ReplayEndpoint: replay,
			Topic: simserver.DefaultRemoteTopic(fleet.Servers[0].Model()), Blocks: fleet.Remote.Capacity()}
	}
}

// compareOne runs one policy on a fresh fleet and gateway.
func compareOne(ctx context.Context, opts CompareOptions, policy string) (_ measure.Summary, err error) {
	fleet, err := simserver.StartFleet(opts.Engines, simserver.ServerConfig{
		Engine:    opts.Engine,
		Model:     opts.Model,
		TimeScale: opts.Speedup,
		Seed:      opts.Seed,
		// Every engine publishes KV events on loopback and the gateway
		// subscribes, for the precise-prefix policy and for the precise
		// index's prediction error under any policy.
		KVEvents: kvevents.PublisherConfig{Enable: true},
		KVRemote: opts.Remote,
	})
	if err != nil {
		return measure.Summary{}, fmt.Errorf("start fleet: %w", err)
	}
	defer fleet.Close()

	blockSize := fleet.BlockSize()
	gcfg := gateway.Config{Endpoints: FleetEndpoints(fleet, opts.Model)}
	FleetTiers(fleet, &gcfg)
	routing := opts.Routing
	routing.Policy = policy
	if routing.Seed == 0 {
		routing.Seed = uint64(opts.Seed)
	}
	if routing.Prefix.BlockSize == 0 {
		routing.Prefix.BlockSize = blockSize
	}
	gw, err := gateway.New(ctx, gateway.Config{
		Listen:    "127.0.0.1:0", // unused: served on ln below
		Routing:   routing,
		Endpoints: gcfg.Endpoints,
		KVStores:  gcfg.KVStores,
		// The fleet is in-process and up until Close: active probes could
		// only eject engines falsely when the host is saturated (a probe
		// timing out is then the benchmark's own CPU load, not the engine).
		// Passive ejection on connection failures stays on.
		HealthCheckPath: "-",
		// For the same reason a loopback dial may wait for a core: on a
		// host at load 26 (2 cores) dials to the in-process engines timed
		// out after the default 5 s and round-robin lost 97 of 300
		// requests. The fleet's lag report says when the host fell behind.
		ConnectTimeout: time.Minute,
		// The records name the engine that served each request
		// (measure.Record.Endpoint); the fleet's addresses are loopback.
		ObservabilityConfig: gateway.ObservabilityConfig{ResponseHeaders: gateway.ResponseHeadersConfig{Endpoint: true}},
	}, prometheus.NewRegistry())
	if err != nil {
		return measure.Summary{}, fmt.Errorf("start gateway: %w", err)
	}
	defer gw.Close()

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return measure.Summary{}, fmt.Errorf("listen: %w", err)
	}
	srv := gw.Server()
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
		defer cancel()
		serr := srv.Shutdown(sctx)
		if serr != nil {
			_ = srv.Close()
		}
		if e := <-served; !errors.Is(e, http.ErrServerClosed) && serr == nil {
			serr = e
		}
		if serr != nil && err == nil {
			err = fmt.Errorf("gateway server: %w", serr)
		}
	}()

	client := NewClient()
	defer client.CloseIdleConnections()
	recs, err := Replay(ctx, ReplayOptions{
		Target:       "http://" + ln.Addr().String(),
		Model:        opts.Model,
		Records:      opts.Records,
		Requests:     opts.Requests,
		OutputTokens: opts.OutputTokens,
		Speedup:      opts.Speedup,
		TimeScale:    opts.Speedup,
		Client:       client,
		Label:        policy,
		Progress:     opts.Progress,
		Output:       opts.Output,
		Warmup:       opts.Warmup,
		Concurrency:  opts.Concurrency,
		Sessions:     opts.Sessions,
	})
	if err != nil {
		return measure.Summary{}, err
	}
	s := measure.Summarize(policy, recs)
	s.RateRPS = opts.RateRPS
	if opts.References != nil {
		opts.References.Apply(&s, recs)
	}
	s.FleetLag = FleetLag(fleet.Lag())
	s.CheckLag(opts.MaxLag)
	util := fleet.Utilization()
	s.MeanEngineUtilization = &util
	var prefill, preempt int64
	prompts := make([]int64, len(fleet.Servers))
	started := make([]int64, len(fleet.Servers))
	for i, srv := range fleet.Servers {
		st := srv.Stats()
		prefill += st.PrefillTokens
		preempt += st.Preemptions
		prompts[i] = st.PromptTokens
		started[i] = st.Prompts
	}
	s.SetShares(started)
	s.EnginePrefillTokens, s.Preemptions = &prefill, &preempt
	if opts.OnRun != nil {
		opts.OnRun(report.HTMLRun{Summary: s, Records: recs, EnginePromptTokens: prompts})
	}
	return s, nil
}
