package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/bench"
	"github.com/infergate/infergate/measure"
	"github.com/infergate/infergate/report"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/trace"
	"github.com/infergate/infergate/virtual"
)

// rateSeed seeds the Poisson arrivals of a --rate sweep, so every rate and
// every run of the command re-times the workload the same way.
const rateSeed = 1

// benchFlags are bench's flags (bind). Its modes: --target (replay against
// an endpoint), --compare (fresh simulated fleets in real time) and
// --compare --virtual (the same in virtual time); --rate sweeps any of
// them, --concurrency makes the real-time ones closed loop. validate is the
// one place their combinations are checked.
type benchFlags struct {
	target      string
	compare     string
	engines     int
	wl          workloadFlags
	requests    int
	speedup     float64
	timeScale   float64
	model       string
	profile     string
	profFile    string
	outPath     string
	recPath     string
	cfgPath     string
	virtual     bool
	htmlPath    string
	warm        warmupFlags
	rateList    string
	concurrency int
	maxLag      time.Duration
	kvDelay     time.Duration
	tiers       tierFlags
	// pd lists the prefill-engine counts each policy runs with (--pd;
	// [0]: aggregated only).
	pd    []int
	pdThr int
	// replicas, replicaSync, replicaDelay, replicaKill and replicaStagger are the gateway
	// replica setups each policy runs with (--replicas etc., virtual time).
	replicas       []int
	replicaSync    []bool
	replicaDelay   []time.Duration
	replicaKill    []bool
	replicaStagger []bool
	// killPID, killTarget: --kill-pid, --kill-target (a live replica
	// killed when the middle request is sent); fleet: --fleet, engines
	// whose step lag is scraped after a --target replay.
	killPID    int
	killTarget int
	fleet      []string
	// headerTimeout, idleTimeout: --header-timeout, --idle-timeout (a
	// --target's silence bounds, bench.ReplayOptions).
	headerTimeout, idleTimeout time.Duration
	// spread moves each arrival to a random instant within it after its
	// timestamp (--spread; 0: as given).
	spread time.Duration
}

func newBenchCmd() *cobra.Command {
	var fl benchFlags
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Replay a real trace against an endpoint, or compare routing policies",
		Long: `Replay a Mooncake-format trace open-loop at its timestamps (divided by --speedup):
each request is a streaming /v1/completions call whose prompt is the trace's
token ids (equal hash ids give equal token blocks), with max_tokens set to the
trace's output length and ignore_eos. Per request it records TTFT, inter-token
latency, end-to-end latency, prompt and cached tokens.

--target URL replays against an OpenAI-compatible endpoint that accepts token-id
prompts and ignore_eos (vLLM, SGLang, infergate sim or a gateway in front of
them); the URL may end in /v1. Several comma-separated URLs (gateway
replicas) are dealt the requests round robin, request i to URL i mod n, as
an L4 front balancing per request (a refused connect goes to the next URL);
--kill-pid PID SIGKILLs one of them (--kill-target, its position) just
before the middle request is sent, and a table says how each URL's requests
ended (scripts/replicas-live.sh runs the whole case). --fleet URLs names the
infergate sim engines behind a --target, whose step lag is then scraped and
judged as --compare's. --compare POLICIES
starts, for each policy, a fresh simulated fleet of --engines engines running
--speedup times faster than real time (so the engines see the trace's real
load) behind a fresh gateway, replays the same requests and prints one table.
Latencies are reported in engine time: wall-clock measurements multiplied by the
fleet's time scale.

--warmup N / --warmup-duration D send the first N requests (or those sent in the
first D of engine time) but leave them out of the summary, the HTML report and
goodput; --records keeps them, marked "warmup": true.

--rate 1,2,4,8 re-times the workload's arrivals as a Poisson process at each
rate (req/s; fixed seed, same requests in the same order) and runs once per
rate (per policy with --compare, also --virtual); the table gains a rate column.

--concurrency N replays closed loop, in real time only (--target, --compare;
not --virtual, whose fleet needs every arrival up front): N users each send the
next request as soon as their previous one finished, ignoring timestamps. With
--workload chat it is session-aware: a session's next turn is sent when the
previous answer has fully arrived plus the think time (both divided by
--speedup), with at most N sessions active at once (sessions start at their
start times, or later when N are active).

Real-time runs measure how far they fell behind their time scale and print
it beside every result (column "lag p99 ms", engine time): the simulated
fleet's step lag (--compare: how late each engine step's tokens were
delivered against the time scale's wall-clock deadline) and the client's
send lag (how late each request was sent against its schedule). A run whose
p99 lag exceeds --max-lag (default 100ms) is marked BEHIND and explained on
stderr: its latencies measure this host's CPU, not the modelled hardware.
bench then exits non-zero after writing every output; lower --speedup, free
the CPUs, use --virtual, or raise --max-lag to accept such runs. Virtual runs
have no lag.`,
		Example: `  # virtual time: 5-30 s on 2 shared cores
  infergate bench --compare round-robin,least-request,prefix --virtual --engines 8 \
    --trace data/mooncake_conversation_trace.jsonl --requests 2000 --out r.json
  # real time, light enough for a quiet 2-core host: about 8 s
  infergate bench --compare prefix,round-robin --engines 4 --workload shared-prefix \
    --sp-groups 8 --sp-prompts-per-group 16 --sp-rate 4 --sp-output-tokens 64
  # against a running endpoint (infergate up), at the trace's own pace
  infergate bench --target http://127.0.0.1:8080 --requests 200 --speedup 1`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return fl.run(cmd) },
	}
	fl.bind(cmd.Flags())
	return cmd
}

// bind registers bench's flags on f.
func (fl *benchFlags) bind(f *pflag.FlagSet) {
	f.StringVar(&fl.target, "target", "", "base URL of an OpenAI-compatible endpoint to replay against; several, comma-separated (gateway replicas), are dealt the requests round robin, request i to URL i mod n, as an L4 front that balances per request")
	f.IntVar(&fl.killPID, "kill-pid", 0, "with several --target URLs: send SIGKILL to this process (a gateway replica) just before the middle request is sent, and report how each target's requests ended")
	f.IntVar(&fl.killTarget, "kill-target", 1, "with --kill-pid: the position (0-based) in --target of the URL that process serves, whose failures are attributed to the kill")
	f.DurationVar(&fl.headerTimeout, "header-timeout", bench.DefaultHeaderTimeout, "with --target: fail a request (counted \"stalled\") whose response header has not arrived after this long (negative: wait forever)")
	f.DurationVar(&fl.idleTimeout, "idle-timeout", bench.DefaultIdleTimeout, "with --target: fail a request (counted \"stalled\") whose stream has been silent this long (negative: wait forever)")
	f.StringSliceVar(&fl.fleet, "fleet", nil, "with --target: base URLs of the infergate sim engines behind it; after the replay their infergate_sim_step_lag_seconds histograms give the fleet's lag (column \"lag p99 ms\", --max-lag), as --compare measures its own fleet's")
	f.StringVar(&fl.compare, "compare", "", "comma-separated routing policies to compare on fresh simulated fleets ("+strings.Join(sched.Names(), ",")+")")
	f.IntVar(&fl.engines, "engines", 8, "simulated engines per fleet (--compare)")
	fl.wl.register(f)
	f.IntVar(&fl.requests, "requests", 0, "replay only the first N requests (0 = all)")
	f.Float64Var(&fl.speedup, "speedup", 10, "replay the trace this many times faster; in --compare also the fleet's time scale")
	f.Float64Var(&fl.timeScale, "time-scale", 1, "the target's simulated seconds per wall second, to report engine time (--target)")
	f.StringVar(&fl.model, "model", "", "model name to request (default: the profile's model)")
	f.StringVar(&fl.profile, "profile", sim.DefaultProfile().Name, "engine profile for --compare: "+strings.Join(profileNames(), ", "))
	f.StringVar(&fl.profFile, "profile-file", "", "engine profile from a YAML file for --compare (overrides --profile)")
	f.StringVarP(&fl.outPath, "out", "o", "", "write the summary as JSON to this file")
	f.StringVarP(&fl.cfgPath, "config", "c", "", "gateway YAML whose routing section tunes the compared policies (--compare)")
	f.IntSliceVar(&fl.pd, "pd", []int{0}, "with --compare --virtual: prefill-engine counts each policy runs with, the others decode engines (0 = aggregated), e.g. 0,6")
	f.IntVar(&fl.pdThr, "pd-threshold", 0, "with --pd: the decider's non-cached-token threshold (0 = 2048, -1 = always split)")
	f.IntSliceVar(&fl.replicas, "replicas", []int{1}, "with --compare --virtual: gateway replica counts each policy runs with, behind a round-robin (L4) front, each with its own index and load view, e.g. 1,3 (gateway/README.md \"Replicas\")")
	f.BoolSliceVar(&fl.replicaSync, "replica-sync", []bool{true}, "with --replicas > 1: whether the replicas exchange what they learn and their load (true, false or both: true,false)")
	f.DurationVar(&fl.kvDelay, "kv-event-delay", 0, "with --virtual: the precise index hears each step's KV events this long after the step ends (engine time; 0: at its end), as a live gateway hears them after the ZeroMQ hop")
	f.DurationSliceVar(&fl.replicaDelay, "replica-delay", []time.Duration{5 * time.Millisecond}, "with --replica-sync: the exchange's delivery delay, one run per value, e.g. 1ms,10ms")
	f.BoolSliceVar(&fl.replicaStagger, "replica-stagger", []bool{true}, "with --replica-sync: whether replicas whose decisions come in bursts take turns, each waiting rank × the exchange's measured delay before deciding (true, false or both; gateway/README.md \"Replicas\")")
	f.BoolSliceVar(&fl.replicaKill, "replica-kill", []bool{false}, "with --replicas > 1: also (true) or only with (false,true / true) replica 1 killed when the middle request arrives: its requests in flight fail, the survivors take the rest")
	f.DurationVar(&fl.spread, "spread", 0, "move each arrival to a uniformly random instant within this long after its timestamp (fixed seed; e.g. 1s for the Mooncake traces' whole-second timestamps, whose requests of one second otherwise all arrive at one instant)")
	f.BoolVar(&fl.virtual, "virtual", false, "with --compare: run the same engine model and policies in virtual time (discrete events, no sleeping, no HTTP): seconds instead of minutes")
	f.StringVar(&fl.htmlPath, "html", "", "write a self-contained HTML report to this file: what produced it (command, version, host, trace digest, profile, clock, lag), the summary table with the pooled- and infinite-cache reference hit rates, TTFT and ITL CDFs and percentiles, hit rate against the references, time series, per-engine share")
	f.StringVar(&fl.recPath, "records", "", "write per-request records as JSONL to this file")
	fl.warm.register(f)
	f.StringVar(&fl.rateList, "rate", "", "request-rate sweep: comma-separated rates (req/s, e.g. 1,2,4,8); the workload's arrivals are re-timed as a Poisson process at each rate (fixed seed, same requests in the same order) and run once per rate (per policy with --compare)")
	f.DurationVar(&fl.maxLag, "max-lag", measure.DefaultMaxLag, "real-time runs: the largest p99 lag (engine time) of the simulated fleet's steps and of the client's sends against their schedule; a run past it is marked BEHIND and bench exits non-zero")
	fl.tiers.register(f)
	f.IntVar(&fl.concurrency, "concurrency", 0, "closed loop (real time only, not --virtual): N users each send their next request as soon as the previous one finished, ignoring timestamps; with --workload chat, at most N sessions active at once, each turn sent when the previous answer has arrived plus the think time")
}

// validate refuses the flag values and combinations bench cannot run, in
// the order they are reported, and returns the --rate sweep (nil: none).
func (fl *benchFlags) validate() ([]float64, error) {
	if (fl.target == "") == (fl.compare == "") {
		return nil, errors.New("give exactly one of --target URL or --compare POLICIES")
	}
	if err := fl.warm.w.Validate(); err != nil {
		return nil, err
	}
	targets := fl.targets()
	if k := slices.Index(targets, ""); k >= 0 {
		return nil, fmt.Errorf("--target %q: URL %d of %d is empty", fl.target, k, len(targets))
	}
	switch {
	case fl.killPID < 0:
		return nil, fmt.Errorf("--kill-pid %d: want a process id", fl.killPID)
	case fl.killPID > 0 && (fl.killPID == 1 || fl.killPID == os.Getpid() || fl.killPID == os.Getppid()):
		// SIGKILL of bench itself (or of the shell that waits for it)
		// loses every output; of init, the host.
		return nil, fmt.Errorf("--kill-pid %d is init, bench itself or its parent: want a gateway replica's process id", fl.killPID)
	case fl.killPID > 0 && len(targets) < 2:
		return nil, errors.New("--kill-pid needs several --target URLs (replicas), one of them served by that process")
	case fl.killPID > 0 && (fl.killTarget < 0 || fl.killTarget >= len(targets)):
		return nil, fmt.Errorf("--kill-target %d: want 0 to %d (a position in --target)", fl.killTarget, len(targets)-1)
	case fl.killPID > 0 && fl.concurrency > 0:
		return nil, errors.New("--kill-pid runs open loop (drop --concurrency)")
	case len(fl.fleet) > 0 && fl.target == "":
		return nil, errors.New("--fleet goes with --target (--compare measures its own fleet's lag)")
	case len(targets) > 1 && fl.concurrency > 0 && fl.wl.kind == workloadChat:
		return nil, errors.New("several --target URLs deal requests in record order; a session-aware closed loop (--concurrency with --workload chat) is not dealt")
	}
	if fl.concurrency < 0 {
		return nil, fmt.Errorf("--concurrency %d: must not be negative", fl.concurrency)
	}
	rates, err := parseRates(fl.rateList)
	if err != nil {
		return nil, err
	}
	if err := checkPDThreshold(fl.pdThr); err != nil {
		return nil, err
	}
	if fl.pdThr != 0 && !slices.ContainsFunc(fl.pd, func(p int) bool { return p > 0 }) {
		return nil, errors.New("--pd-threshold needs --pd with prefill engines (e.g. --pd 0,6)")
	}
	for _, p := range fl.pd {
		n := fl.engines
		if n <= 0 {
			n = bench.DefaultEngines
		}
		switch {
		case p < 0 || p >= n:
			return nil, fmt.Errorf("--pd %d: want 0 (aggregated) to %d prefill engines of --engines %d", p, n-1, n)
		case p > 0 && !fl.virtual:
			return nil, errors.New("--pd runs in virtual time (--compare --virtual); for a real-time P/D fleet run infergate up --pd and bench --target")
		}
	}
	for _, n := range fl.replicas {
		switch {
		case n < 1:
			return nil, fmt.Errorf("--replicas %d: want at least 1", n)
		case n > 1 && !fl.virtual:
			return nil, errors.New("--replicas runs in virtual time (--compare --virtual); live replicas are infergate serve processes with a replicas section, replayed with --target URL1,URL2,... (scripts/replicas-live.sh; gateway/README.md \"Replicas\")")
		}
	}
	if fl.spread < 0 {
		return nil, fmt.Errorf("--spread %v: must not be negative", fl.spread)
	}
	switch {
	case fl.kvDelay < 0:
		return nil, fmt.Errorf("--kv-event-delay %v: must not be negative", fl.kvDelay)
	case fl.kvDelay > 0 && !fl.virtual:
		return nil, errors.New("--kv-event-delay runs in virtual time (--compare --virtual); a real-time fleet's events take the time they take")
	}
	for _, d := range fl.replicaDelay {
		if d < 0 {
			return nil, fmt.Errorf("--replica-delay %v: must not be negative", d)
		}
	}
	switch {
	case fl.concurrency > 0 && fl.virtual:
		return nil, errors.New("--concurrency needs real time: the virtual fleet takes every arrival up front, so it cannot send a request when an earlier one finishes (drop --virtual)")
	case fl.concurrency > 0 && rates != nil:
		return nil, errors.New("--concurrency (closed loop) and --rate (open-loop arrivals) exclude each other")
	}
	return rates, nil
}

// targets is --target split at commas (nil when not given).
func (fl *benchFlags) targets() []string {
	if fl.target == "" {
		return nil
	}
	ts := strings.Split(fl.target, ",")
	for k := range ts {
		ts[k] = strings.TrimSpace(ts[k])
	}
	return ts
}

// benchRun is one bench command under way: its flags, what they resolve to
// and what the runs have produced so far.
type benchRun struct {
	fl  *benchFlags
	ctx context.Context
	// model is the model requested: --model, else the target's default or
	// the profile's model.
	model string
	// prof, routing and policies: --compare's engine profile, the routing
	// section of --config and the policies it compares.
	prof     sim.GPUProfile
	routing  sched.Config
	policies []string
	// recs are the workload's records in arrival order; sessions the chat
	// workload's sessions for a session-aware closed loop (then recs is
	// empty).
	recs     []trace.Record
	sessions []trace.Session
	recOut   *os.File // --records, nil when not given
	refs     *measure.References
	report   report.Report
	htmlRuns []report.HTMLRun // only with --html
	// outcomes are each --target URL's outcomes per run when there are
	// several, printed after the table.
	outcomes []targetRun
}

// targetRun is one --target replay's outcomes per target URL, and the
// kill (--kill-pid) if there was one.
type targetRun struct {
	label    string
	outcomes []bench.TargetOutcome
	recs     []measure.Record
	// killAt is the index of the request before which the process was
	// killed (-1: no kill), killErr why it could not be.
	killAt  int
	killErr error
}

// run is bench's RunE: validate, load the workload, resolve the mode's
// inputs, run every rate of the sweep (or the workload's own arrivals) and
// write the outputs.
func (fl *benchFlags) run(cmd *cobra.Command) error {
	rates, err := fl.validate()
	if err != nil {
		return err
	}
	r := &benchRun{fl: fl, ctx: cmd.Context(), model: fl.model}
	if fl.concurrency > 0 && fl.wl.kind == workloadChat {
		r.sessions, err = fl.wl.sessions()
	} else {
		r.recs, err = fl.wl.load()
	}
	if err != nil {
		return err
	}
	if fl.recPath != "" {
		if r.recOut, err = os.Create(fl.recPath); err != nil {
			return err
		}
		defer r.recOut.Close()
	}
	started := time.Now()
	prov := measure.NewProvenance(buildVersion(), os.Args, started)
	if err := r.resolve(); err != nil {
		return err
	}
	if err := describeBench(prov, &fl.wl, r.recs, r.sessions, fl.requests); err != nil {
		return err
	}
	if err := r.describe(prov); err != nil {
		return err
	}
	if err := r.sweep(rates); err != nil {
		return err
	}
	return r.finish(cmd, prov, started)
}

// resolve fills in the model and, for --compare, the engine profile, the
// routing configuration and the policies.
func (r *benchRun) resolve() error {
	fl := r.fl
	if fl.target != "" {
		// The usual OpenAI base URL form (".../v1") is accepted as
		// well (bench.CompletionsURL).
		if r.model == "" {
			r.model = sim.DefaultModel
		}
		return nil
	}
	var err error
	if r.prof, err = resolveProfile(fl.profile, fl.profFile); err != nil {
		return err
	}
	if r.model == "" {
		r.model = r.prof.Model
	}
	if r.routing, err = loadRouting(fl.cfgPath); err != nil {
		return err
	}
	if r.policies, err = parsePolicies(fl.compare, r.routing); err != nil {
		return fmt.Errorf("--compare: %w", err)
	}
	return nil
}

// describe records the mode in prov (target or fleet, clock, time scale,
// profile) and sets the reference hit rates of the replayed records: the
// infinite cache only for a target (its KV capacity is unknown), also the
// fleet's pooled cache for --compare.
func (r *benchRun) describe(prov *measure.Provenance) error {
	fl := r.fl
	replayed := r.recs
	if fl.requests > 0 && fl.requests < len(replayed) {
		replayed = replayed[:fl.requests]
	}
	if fl.target != "" {
		prov.Target, prov.TimeScale, prov.Speedup, prov.Clock = measure.RedactValue(fl.target), fl.timeScale, fl.speedup, "real"
		if len(replayed) > 0 {
			r.refs = measure.NewReferences(replayed, 0, 0) // the target's KV capacity is unknown: infinite cache only
		}
		return nil
	}
	n := fl.engines
	if n <= 0 {
		n = bench.DefaultEngines
	}
	ec := sim.Config{Profile: r.prof}
	var err error
	if prov.Profile, err = bench.NewProfileInfo(ec, fl.profFile); err != nil {
		return err
	}
	prov.Engines, prov.Clock = n, "real"
	if fl.virtual {
		prov.Clock = "virtual"
	} else {
		prov.TimeScale, prov.Speedup = fl.speedup, fl.speedup
	}
	if len(replayed) > 0 {
		ec = ec.WithDefaults()
		r.refs = measure.NewReferences(replayed, n*ec.NumBlocks, ec.BlockSize)
		if t := fl.tiers; !t.host.IsZero() || !t.disk.IsZero() || !t.remote.IsZero() {
			tiered := n*(ec.NumBlocks+ec.TierBlocks(t.host)+ec.TierBlocks(t.disk)) + ec.TierBlocks(t.remote)
			r.refs.AddTiered(replayed, tiered, ec.BlockSize)
		}
	}
	return nil
}

// sweep runs the workload at its own arrivals when rates is nil, else its
// first --requests records re-timed as a Poisson process at each rate.
func (r *benchRun) sweep(rates []float64) error {
	recs := r.recs
	if r.fl.spread > 0 {
		var err error
		if recs, err = bench.Spread(recs, r.fl.spread, rateSeed); err != nil {
			return err
		}
	}
	if rates == nil {
		return r.runAt(recs, 0)
	}
	if n := r.fl.requests; n > 0 && n < len(recs) {
		recs = recs[:n]
	}
	for _, rate := range rates {
		rt, err := bench.Retime(recs, rate, rateSeed)
		if err != nil {
			return err
		}
		if err := r.runAt(rt, rate); err != nil {
			return fmt.Errorf("rate %g req/s: %w", rate, err)
		}
	}
	return nil
}

// runAt replays recs (re-timed to rate req/s when rate > 0) in the mode
// the flags select.
func (r *benchRun) runAt(recs []trace.Record, rate float64) error {
	switch {
	case r.fl.target != "":
		return r.replayTarget(recs, rate)
	case r.fl.virtual:
		return r.compareVirtual(recs, rate)
	default:
		return r.compareReal(recs, rate)
	}
}

// addHTML keeps a run for the HTML report (only with --html).
func (r *benchRun) addHTML(run report.HTMLRun) {
	if r.fl.htmlPath != "" {
		r.htmlRuns = append(r.htmlRuns, report.MeasuredRun(run))
	}
}

// replayTarget is --target: one replay against the endpoint, open loop or
// closed loop (--concurrency).
func (r *benchRun) replayTarget(recs []trace.Record, rate float64) error {
	fl := r.fl
	targets := fl.targets()
	opts := bench.ReplayOptions{Target: fl.target, Model: r.model, Records: recs, Requests: fl.requests,
		Speedup: fl.speedup, TimeScale: fl.timeScale, Label: "target", Progress: os.Stderr,
		Warmup: fl.warm.w, Concurrency: fl.concurrency, Sessions: r.sessions,
		HeaderTimeout: fl.headerTimeout, IdleTimeout: fl.idleTimeout}
	if len(targets) > 1 {
		opts.Target, opts.Targets = "", targets
	}
	tr := targetRun{label: measure.RedactValue(fl.target), killAt: -1}
	if fl.killPID > 0 {
		n := len(recs)
		if fl.requests > 0 && fl.requests < n {
			n = fl.requests
		}
		tr.killAt = n / 2
		pid := fl.killPID
		opts.OnSend = func(i int) {
			if i == tr.killAt {
				// Only request killAt's goroutine writes killErr, before
				// Replay returns.
				tr.killErr = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
	if r.recOut != nil {
		opts.Output = r.recOut
	}
	rs, err := bench.Replay(r.ctx, opts)
	if err != nil {
		return err
	}
	s := measure.Summarize(measure.RedactValue(fl.target), rs)
	s.RateRPS = rate
	r.refs.Apply(&s, rs)
	if len(fl.fleet) > 0 {
		ctx, cancel := context.WithTimeout(r.ctx, 30*time.Second)
		s.FleetLag, err = bench.ScrapeStepLag(ctx, http.DefaultClient, fl.fleet)
		cancel()
		if err != nil {
			return err
		}
	}
	s.CheckLag(fl.maxLag)
	if len(targets) > 1 {
		tr.outcomes, tr.recs = bench.TargetOutcomes(targets, rs), rs
		r.outcomes = append(r.outcomes, tr)
	}
	r.report.Runs = append(r.report.Runs, s)
	r.addHTML(report.HTMLRun{Summary: s, Records: rs})
	return nil
}

// compareVirtual is --compare --virtual: each policy on a fresh fleet in
// virtual time.
func (r *benchRun) compareVirtual(recs []trace.Record, rate float64) error {
	fl := r.fl
	for _, p := range r.policies {
		for _, pd := range fl.pd {
			for _, rs := range fl.replicaSetups() {
				if err := r.runVirtual(recs, rate, p, pd, rs); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// replicaSetup is one gateway-replica setup of a virtual run.
type replicaSetup struct {
	n         int
	sync      bool
	delay     time.Duration
	noStagger bool
	kill      bool
}

// name is the setup's suffix of the run's name ("" for one replica).
func (rs replicaSetup) name() string {
	if rs.n <= 1 {
		return ""
	}
	s := fmt.Sprintf(" %dR unshared", rs.n)
	if rs.sync {
		s = fmt.Sprintf(" %dR shared %v", rs.n, rs.delay)
		if rs.noStagger {
			s += " unstaggered"
		}
	}
	if rs.kill {
		s += " kill"
	}
	return s
}

// replicaSetups are the setups of --replicas, --replica-sync,
// --replica-delay and --replica-kill, in that nesting.
func (fl *benchFlags) replicaSetups() []replicaSetup {
	var out []replicaSetup
	for _, n := range fl.replicas {
		if n <= 1 {
			out = append(out, replicaSetup{n: 1})
			continue
		}
		for _, sync := range fl.replicaSync {
			delays := fl.replicaDelay
			if !sync {
				delays = delays[:min(len(delays), 1)]
			}
			staggers := fl.replicaStagger
			if !sync {
				staggers = []bool{true} // nothing to stagger on
			}
			for _, d := range delays {
				for _, st := range staggers {
					for _, kill := range fl.replicaKill {
						out = append(out, replicaSetup{n: n, sync: sync, delay: d, noStagger: !st, kill: kill})
					}
				}
			}
		}
	}
	return out
}

// runVirtual is one run of compareVirtual: policy p on a fresh fleet, pd
// of its engines prefill engines (0: aggregated).
func (r *benchRun) runVirtual(recs []trace.Record, rate float64, p string, pd int, rs replicaSetup) error {
	fl := r.fl
	routing := r.routing
	if pd > 0 && fl.pdThr != 0 {
		routing.PD.Threshold = fl.pdThr
	}
	engines := fl.engines
	if engines <= 0 {
		engines = bench.DefaultEngines
	}
	{
		opts := virtual.ReplayOptions{Policy: p, Engines: fl.engines, TrackPrecise: true, KVEventDelay: fl.kvDelay, Prefill: pd,
			Engine: fl.tiers.engine(sim.Config{Profile: r.prof}), Remote: fl.tiers.remote, Records: recs, Requests: fl.requests,
			Model: r.model, Routing: routing, Warmup: fl.warm.w, RateRPS: rate,
			Replicas: rs.n, ReplicaSync: rs.sync, ReplicaDelay: rs.delay, ReplicaNoStagger: rs.noStagger}
		if rs.kill {
			n := len(recs)
			if fl.requests > 0 {
				n = min(n, fl.requests)
			}
			opts.KillAtRequest, opts.KillReplica = n/2, 1
		}
		run, err := virtual.Replay(r.ctx, opts)
		if err != nil {
			return err
		}
		name := p
		if pd > 0 {
			name = fmt.Sprintf("%s %dP%dD", p, pd, engines-pd)
		}
		name += rs.name()
		if name != p {
			run.Summary.Policy = name
			for i := range run.Records {
				run.Records[i].Policy = name
			}
		}
		if slices.Contains(fl.replicaKill, true) {
			printAfterMidpoint(os.Stderr, name, run)
		}
		if r.recOut != nil {
			if err := measure.WriteRecords(r.recOut, run.Records); err != nil {
				return err
			}
		}
		fmt.Fprintf(os.Stderr, "%s: %d requests in virtual time, %s wall\n", run.Summary.Policy, len(run.Records), run.Wall.Round(time.Millisecond))
		printStagger(os.Stderr, name, run.Stagger)
		r.refs.Apply(&run.Summary, run.Records)
		r.report.Runs = append(r.report.Runs, run.Summary)
		r.addHTML(report.HTMLRun{Summary: run.Summary, Records: run.Records, Engine: run.Engine})
	}
	return nil
}

// compareReal is --compare in real time: each policy on a fresh simulated
// fleet behind a fresh gateway, open loop or closed loop (--concurrency).
func (r *benchRun) compareReal(recs []trace.Record, rate float64) error {
	fl := r.fl
	opts := bench.CompareOptions{Routing: r.routing, Policies: r.policies, Engines: fl.engines, Engine: fl.tiers.engine(sim.Config{Profile: r.prof}),
		Remote:  fl.tiers.remote,
		Records: recs, Requests: fl.requests, Speedup: fl.speedup, Model: r.model, Progress: os.Stderr,
		Warmup: fl.warm.w, Concurrency: fl.concurrency, Sessions: r.sessions, RateRPS: rate, OnRun: r.addHTML, MaxLag: fl.maxLag,
		References: r.refs}
	if r.recOut != nil {
		opts.Output = r.recOut
	}
	rep, err := bench.Compare(r.ctx, opts)
	r.report.Runs = append(r.report.Runs, rep.Runs...)
	return err
}

// finish prints the table, the lag warnings and the failed runs' first
// errors, writes --out and --html, and returns the command's verdict: an
// error when every request of a run failed or a run fell behind.
func (r *benchRun) finish(cmd *cobra.Command, prov *measure.Provenance, started time.Time) error {
	res := &r.report
	res.PooledHitRate, res.InfiniteHitRate = r.refs.All()
	if err := res.WriteTable(cmd.OutOrStdout()); err != nil {
		return err
	}
	for _, tr := range r.outcomes {
		if err := r.writeTargetRun(cmd.OutOrStdout(), tr); err != nil {
			return err
		}
	}
	behind, err := res.WriteLagWarnings(cmd.ErrOrStderr())
	if err != nil {
		return err
	}
	failed := false
	for _, run := range res.Runs {
		if run.Errors > 0 && run.FirstError != "" {
			fmt.Fprintf(cmd.ErrOrStderr(), "%s: %d of %d requests failed; first error: %s\n", run.Policy, run.Errors, run.Requests, run.FirstError)
		}
		failed = failed || (run.Requests > 0 && run.Errors == run.Requests)
	}
	fmt.Fprintf(cmd.OutOrStdout(), "\ncompleted in %s (wall clock)\n", time.Since(started).Round(time.Second))
	prov.WallS = time.Since(started).Seconds()
	res.Provenance = prov
	if err := r.writeOutputs(prov); err != nil {
		return err
	}
	if failed {
		return errors.New("every request of a run failed")
	}
	if behind > 0 {
		return fmt.Errorf("%d of %d runs fell behind their time scale by more than --max-lag %v (p99): their latencies are not the modelled hardware's (outputs written; see the warnings above)",
			behind, len(res.Runs), r.fl.maxLag)
	}
	return nil
}

// writeTargetRun prints how each target's requests ended and, after a
// kill, which failed and how: on the killed target, those in flight at
// the kill (dealt before the middle request) and those dealt from it on
// (goroutines of one instant race to send, so by index, not by time); on
// the others (the survivors), any failure at all, which the kill should
// not cause.
func (r *benchRun) writeTargetRun(w io.Writer, tr targetRun) error {
	fmt.Fprintf(w, "\nper target (%s):\n", tr.label)
	if err := bench.WriteTargetOutcomes(w, tr.outcomes); err != nil {
		return err
	}
	if tr.killAt < 0 {
		return nil
	}
	if tr.killErr != nil {
		_, err := fmt.Fprintf(w, "kill of pid %d before request %d failed: %v\n", r.fl.killPID, tr.killAt, tr.killErr)
		return err
	}
	killed := tr.outcomes[r.fl.killTarget].Target
	var held, after, survivors []int
	var hung int
	for _, rec := range tr.recs {
		if rec.Error == "" {
			continue
		}
		o := bench.TargetOutcomes([]string{rec.Target}, []measure.Record{rec})[0]
		switch {
		case o.Cancelled > 0 || o.Stalled > 0: // no explicit error: hung
			hung++
			survivors = append(survivors, rec.Index)
		case rec.Target != killed:
			survivors = append(survivors, rec.Index)
		case rec.Index < tr.killAt:
			held = append(held, rec.Index)
		default:
			after = append(after, rec.Index)
		}
	}
	fmt.Fprintf(w, "killed pid %d (target %d, %s) just before request %d was sent\n", r.fl.killPID, r.fl.killTarget, killed, tr.killAt)
	fmt.Fprintf(w, "  in flight on it at the kill, ended with an explicit error: %d %s\n", len(held), indexList(held))
	fmt.Fprintf(w, "  dealt to it from the middle request on (on a kept-alive connection to the dead process, or already in flight when they share the kill's instant), ended with an explicit error: %d %s\n", len(after), indexList(after))
	_, err := fmt.Fprintf(w, "  failed elsewhere or hung (lost; want 0): %d %s (hung: %d)\n", len(survivors), indexList(survivors), hung)
	return err
}

// indexList shows up to 20 request indices.
func indexList(xs []int) string {
	if len(xs) == 0 {
		return ""
	}
	if len(xs) > 20 {
		return fmt.Sprint(xs[:20]) + "..."
	}
	return fmt.Sprint(xs)
}

// writeOutputs writes the report as JSON (--out) and as HTML (--html).
func (r *benchRun) writeOutputs(prov *measure.Provenance) error {
	fl := r.fl
	if fl.outPath != "" {
		if err := writeFile(fl.outPath, r.report.WriteJSON); err != nil {
			return err
		}
	}
	if fl.htmlPath == "" {
		return nil
	}
	rep := report.HTMLReport{Title: fl.htmlTitle(), Runs: r.htmlRuns, Provenance: prov, References: r.refs}
	return writeFile(fl.htmlPath, func(w io.Writer) error { return report.WriteHTMLReport(w, rep) })
}

// htmlTitle is the HTML report's title: the target, or the compared
// policies with the fleet size and the clock.
func (fl *benchFlags) htmlTitle() string {
	if fl.target != "" {
		return "infergate bench: " + measure.RedactValue(fl.target)
	}
	mode := "real time"
	if fl.virtual {
		mode = "virtual time"
	}
	return fmt.Sprintf("infergate bench: %s on %d engines (%s)", fl.compare, fl.engines, mode)
}

// writeFile creates path and writes it with write, reporting the first error.
func writeFile(path string, write func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// describeBench records the workload of a bench run in prov: recs (or the
// turns of sessions) of which the first requests (0: all) are replayed.
func describeBench(prov *measure.Provenance, wl *workloadFlags, recs []trace.Record, sessions []trace.Session, requests int) error {
	total := len(recs)
	for _, s := range sessions {
		total += len(s.Turns)
	}
	replayed := total
	if requests > 0 && requests < total {
		replayed = requests
	}
	var err error
	prov.Workload, err = wl.describe(replayed, total)
	return err
}

// printStagger reports, for synced replicas, each replica's staggered
// decisions (virtual.StaggerStats): how many the learns of the replicas
// ranked before it released and how many their deadline did, and the mean
// wait, as the live gateway's infergate_replica_stagger_seconds counts
// them.
func printStagger(w io.Writer, name string, st []virtual.StaggerStats) {
	if len(st) == 0 {
		return
	}
	fmt.Fprintf(w, "%s: staggered decisions per replica (released by learns / by deadline, mean wait ms):", name)
	for r, s := range st {
		mean := 0.0
		if n := s.Learns + s.Deadline; n > 0 {
			mean = float64(s.Wait) / float64(n) / float64(time.Millisecond)
		}
		fmt.Fprintf(w, " r%d %d/%d %.3f", r, s.Learns, s.Deadline, mean)
	}
	fmt.Fprintln(w)
}

// printAfterMidpoint reports, for --replica-kill, the requests that failed
// with the killed replica and every run's hit rate and TTFT on the
// requests that arrived from the middle one on (where the kill happens),
// so that runs with and without the kill compare on the same requests.
func printAfterMidpoint(w io.Writer, name string, run virtual.ReplayResult) {
	var killed, after, prompt, cached int
	var ttft []float64
	from := run.KilledAt
	if n := len(run.Records); from == 0 && n > 0 {
		from = run.Records[n/2].ArrivalMs
	}
	for i := range run.Records {
		rec := &run.Records[i]
		if rec.Status == 502 {
			killed++
		}
		if rec.ArrivalMs < from || rec.Status != 200 {
			continue
		}
		after++
		prompt += rec.PromptTokens
		cached += rec.CachedTokens
		ttft = append(ttft, rec.TTFTMs)
	}
	hit := 0.0
	if prompt > 0 {
		hit = float64(cached) / float64(prompt)
	}
	slices.Sort(ttft)
	q := func(p float64) float64 {
		if len(ttft) == 0 {
			return 0
		}
		return ttft[min(len(ttft)-1, int(p*float64(len(ttft))))]
	}
	fmt.Fprintf(w, "%s: from %.1f s (the middle request): %d requests served, hit rate %.2f%%, TTFT p50/p90/p99 %.0f/%.0f/%.0f ms; %d failed with a killed replica\n",
		name, from/1000, after, 100*hit, q(0.5), q(0.9), q(0.99), killed)
}
