package main

import (
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/autoscale"
	kinds "github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
	"github.com/infergate/infergate/simserver"
)

// engineCount is up's --engines: N engines, or MIN..MAX for an elastic
// fleet that scales from zero.
type engineCount struct {
	min, max int
	elastic  bool
}

func (e *engineCount) String() string {
	if e.elastic {
		return fmt.Sprintf("%d..%d", e.min, e.max)
	}
	return strconv.Itoa(e.max)
}

// Set parses N or MIN..MAX (0 ≤ MIN ≤ MAX, 1 ≤ MAX ≤ 64).
func (e *engineCount) Set(s string) error {
	lo, hi, ranged := strings.Cut(strings.TrimSpace(s), "..")
	a, err := strconv.Atoi(strings.TrimSpace(lo))
	if err != nil {
		return fmt.Errorf("want N or MIN..MAX, e.g. 4 or 0..8")
	}
	if !ranged {
		*e = engineCount{min: a, max: a}
		return nil
	}
	b, err := strconv.Atoi(strings.TrimSpace(hi))
	switch {
	case err != nil:
		return fmt.Errorf("want MIN..MAX, e.g. 0..8")
	case a < 0 || b < 1 || a > b || b > 64:
		return fmt.Errorf("want 0 <= MIN <= MAX, 1 <= MAX <= 64")
	}
	*e = engineCount{min: a, max: b, elastic: true}
	return nil
}

func (e *engineCount) Type() string { return "N|MIN..MAX" }

// elasticFlags are up's flags for --engines MIN..MAX.
type elasticFlags struct {
	source      string
	imageCached bool
	autoscale   string
	idle        time.Duration
	holdTTL     time.Duration
	heartbeat   time.Duration
	weights     weightsFlags
}

// elasticFlagNames are the flags that need --engines MIN..MAX.
var elasticFlagNames = append([]string{"startup-source", "image-cached", "autoscale", "idle-timeout", "hold-ttl", "hold-heartbeat", "weights"}, weightsFlagNames...)

func (e *elasticFlags) register(f *pflag.FlagSet) {
	f.StringVar(&e.source, "startup-source", string(sim.SourcePageCache), "with --engines MIN..MAX, where a starting engine reads its weights: remote, nvme, page_cache or peer (sim/startup.go)")
	f.BoolVar(&e.imageCached, "image-cached", true, "with --engines MIN..MAX, the engine image is on the node (no image pull in the cold start)")
	f.StringVar(&e.autoscale, "autoscale", "", "with --engines MIN..MAX, the scaling policy, in plan --autoscale's spelling (autoscale/README.md): target= (requests in flight per engine, default 16), rate=, kv=, queue=, ttft=, up_window=, down_window= (default --idle-timeout), rate limits; min and max come from --engines; and up's own interval= (decision period, wall time, default 1s) and rate_window= (arrival-rate window, default 1m)")
	f.DurationVar(&e.idle, "idle-timeout", time.Minute, "with --engines MIN..MAX, the policy's down_window unless --autoscale gives one: the pool scales down to the highest count it wanted over this long (wall time)")
	f.DurationVar(&e.holdTTL, "hold-ttl", 0, "with --engines MIN..MAX, how long a request is held while no engine is ready (gateway scale_from_zero.hold_ttl; 0: twice the modelled cold start at --time-scale, plus 30s)")
	f.DurationVar(&e.heartbeat, "hold-heartbeat", 0, "with --engines MIN..MAX, ': keep-alive' SSE comments to held streaming requests at this period (0: none)")
	e.weights.register(f, "with --engines MIN..MAX, ")
}

// unused refuses the elastic flags without --engines MIN..MAX.
func (e *elasticFlags) unused(cmd *cobra.Command) error {
	for _, n := range elasticFlagNames {
		if cmd.Flags().Changed(n) {
			return fmt.Errorf("--%s needs --engines MIN..MAX", n)
		}
	}
	return nil
}

// elasticPolicy is the pool's autoscaling policy for --engines MIN..MAX:
// --autoscale's keys (autoscale.ParseConfig's spelling) with min and max
// from --engines (a min= or max= that differs is an error), down_window
// from --idle-timeout unless given, and up's own keys interval (the
// decisions' period; default elasticInterval) and rate_window (the
// arrival rate's window; default autoscale.DefaultRateWindow).
func (fl *upFlags) elasticPolicy() (gateway.AutoscaleConfig, error) {
	ac := gateway.AutoscaleConfig{Interval: elasticInterval}
	var keep []string
	down := false
	for _, item := range strings.Split(fl.elastic.autoscale, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		k, v, _ := strings.Cut(item, "=")
		switch k {
		case "min", "max":
			want := fl.count.min
			if k == "max" {
				want = fl.count.max
			}
			if n, err := strconv.Atoi(v); err != nil || n != want {
				return ac, fmt.Errorf("--autoscale %s=%s: --engines %s sets it (%d)", k, v, fl.count.String(), want)
			}
			continue
		case "interval", "rate_window":
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				return ac, fmt.Errorf("--autoscale %s=%s: want a positive duration", k, v)
			}
			if k == "interval" {
				ac.Interval = d
			} else {
				ac.RateWindow = d
			}
			continue
		case "down_window":
			down = true
		}
		keep = append(keep, item)
	}
	if !down {
		keep = append(keep, "down_window="+fl.elastic.idle.String())
	}
	ac.Policy = strings.Join(append([]string{fmt.Sprintf("min=%d,max=%d", fl.count.min, fl.count.max)}, keep...), ",")
	if _, rest, err := autoscale.ParseConfig(ac.Policy); err != nil {
		return ac, fmt.Errorf("--autoscale: %w", err)
	} else if len(rest) > 0 {
		return ac, fmt.Errorf("--autoscale: unknown keys %q (up takes autoscale.ParseConfig's keys, interval and rate_window)", rest)
	}
	return ac, nil
}

// elasticInterval is the default period of an elastic fleet's scaling
// decisions (wall time): the engines' health-check interval, so that a
// decision sees each start-up's end within a second.
const elasticInterval = time.Second

// elasticDrain is how long a stopping engine reports unready before it
// stops: two of the gateway's health-check intervals (elasticHealth) and
// a margin, so the gateway has taken it out of rotation.
const (
	elasticHealth = time.Second
	elasticDrain  = 3 * elasticHealth
)

// runElastic is up with --engines MIN..MAX: an elastic fleet of simulated
// engines (simserver.ElasticFleet) and the gateway holding requests while
// none is ready, its wake-up hook the fleet.
func (fl *upFlags) runElastic(cmd *cobra.Command, scfg simserver.ServerConfig) error {
	f := cmd.Flags()
	for _, n := range []string{"pd", "kv-remote", "kv-events-config"} {
		if f.Lookup(n) != nil && f.Changed(n) {
			return fmt.Errorf("--engines %s and --%s: an elastic fleet's engines publish no KV events and share no remote tier (their sockets would change at each start), and have no P/D roles; drop one", fl.count.String(), n)
		}
	}
	if fl.policy == sched.PrecisePrefix {
		return fmt.Errorf("--engines %s: --policy %s needs KV events, which an elastic fleet's engines do not publish", fl.count.String(), fl.policy)
	}
	src, err := sim.ParseWeightSource(fl.elastic.source)
	if err != nil {
		return fmt.Errorf("--startup-source: %w", err)
	}
	policy, err := fl.elasticPolicy()
	if err != nil {
		return err
	}
	weights, cache, err := fl.elastic.weights.open(cmd)
	if err != nil {
		return err
	}
	if cache != nil {
		defer cache.Close() // after the fleet (deferred below) released the engines' leases
	}
	scfg.Engine = fl.tiers.engine(scfg.Engine)
	scfg.Startup = &simserver.StartupConfig{Source: src, ImageCached: fl.elastic.imageCached, Weights: weights}
	scfg.EnableSleepMode = true
	if !f.Changed("responses-store") {
		scfg.ResponsesStore = true
	}
	eng := scfg.Engine.WithDefaults()
	in := sim.StartupInput{Source: src, ImageCached: fl.elastic.imageCached}
	if weights != nil {
		in.Source = sim.SourceRemote // the cache decides at each start: size the hold for the slowest tier
	}
	ph, err := eng.Profile.StartupPhases(in)
	if err != nil {
		return fmt.Errorf("--engines %s: profile %s: %w", fl.count.String(), eng.Profile.Name, err)
	}
	wallStart := time.Duration(float64(ph.Total()) / scfg.TimeScale)
	hold := fl.elastic.holdTTL
	if hold == 0 {
		hold = 2*wallStart + 30*time.Second
	}
	// An engine that finishes its start-up tells the gateway, which probes
	// it at once: held requests leave within a probe's round trip. The
	// gateway's autoscaling decisions for the pool set the fleet's size
	// (gateway.ScaleTarget); its wake-up hook starts the first engine.
	var gw atomic.Pointer[gateway.Gateway]
	fleet, err := simserver.StartElasticFleet(scfg, simserver.ElasticConfig{Min: fl.count.min, Max: fl.count.max,
		Drain: elasticDrain,
		OnReady: func(_ int, url string) {
			if g := gw.Load(); g != nil {
				g.Probe(url)
			}
		}})
	if err != nil {
		return err
	}
	defer fleet.Close()
	model := scfg.Model
	if model == "" {
		model = eng.Profile.Model
	}
	if model == "" {
		model = sim.DefaultModel
	}
	load := func() (gateway.Config, error) {
		cfg := gateway.Config{Listen: fl.listen, Routing: sched.Config{Policy: fl.policy}, ShutdownGrace: fl.grace,
			HealthCheckInterval: elasticHealth, Tokenizers: gatewayTokenizers(scfg.Tokenizer, model)}
		for _, u := range fleet.URLs {
			cfg.Endpoints = append(cfg.Endpoints, gateway.EndpointConfig{URL: u, Model: model, Kind: kinds.Sim,
				KVBlocks: eng.NumBlocks, BlockSize: eng.BlockSize, MaxModelLen: eng.Profile.MaxModelLen})
		}
		// The engines' LoRA adapters are configured, not discovered: an
		// elastic fleet may have no engine to list them.
		if len(eng.LoRA.Adapters) > 0 {
			cfg.Adapters = map[string][]string{model: eng.LoRA.Adapters}
		}
		cfg.ScaleFromZero = map[string]gateway.ScaleFromZeroConfig{"*": {HoldTTL: hold, Heartbeat: fl.elastic.heartbeat,
			Wake: gateway.WakeConfig{Waker: fleet}}}
		cfg.Autoscale = policy
		cfg.Autoscale.Target = fleet
		if err := applyEdgeFlags(cmd, &cfg, "", "", fl.keys); err != nil {
			return cfg, err
		}
		applyAccessLog(cmd, &cfg.AccessLog, fl.access)
		return cfg, resolveLog(cmd, &cfg.Log)
	}
	out := cmd.OutOrStdout()
	return runGateway(cmd, fl.pprofAt, load, func(g *gateway.Gateway, _ *slog.Logger, _ gateway.Config) func(net.Addr) {
		resolved := g.Policy()
		gw.Store(g)
		return func(a net.Addr) {
			base := "http://" + a.String()
			auth := "open (no API keys)"
			if g.AuthEnabled() {
				auth = "API keys required"
			}
			fmt.Fprintf(out, "infergate %s is up: OpenAI API at %s/v1 (policy %s; %s)\n", buildVersion(), base, resolved, auth)
			fmt.Fprintf(out, "  fleet: %s simulated engines (scale from zero), profile %s, model %q, time scale %gx, %d KV blocks each\n",
				fl.count.String(), eng.Profile.Name, model, scfg.TimeScale, eng.NumBlocks)
			fmt.Fprintf(out, "  cold start: %.1fs modelled (image pull %.1fs, weights %.1fs from %s at %.1f GB/s, warm-up %.1fs), %s wall at %gx\n",
				ph.Total().Seconds(), ph.ImagePull.Seconds(), ph.WeightsLoad.Seconds(), src, ph.ReadBandwidth/1e9, ph.WarmUp.Seconds(),
				wallStart.Round(time.Millisecond), scfg.TimeScale)
			if scfg.Tokenizer != "" {
				fmt.Fprintf(out, "  tokenizer: %s (the engines' and the gateway's routing)\n", scfg.Tokenizer)
			}
			fmt.Fprintf(out, "  requests held up to %s while no engine is ready; autoscaling %s, a decision every %s (infergate_autoscale_* in /metrics)\n",
				hold, policy.Policy, policy.Interval)
			for i, u := range fleet.URLs {
				fmt.Fprintf(out, "    engine %d: %s (metrics %s/metrics)\n", i, u, u)
			}
			fmt.Fprintf(out, "  dashboard: %s/dashboard   metrics: %s/metrics   health: %s/healthz\n\n", base, base, base)
			fmt.Fprintf(out, "Try:\n  curl -s %s/v1/chat/completions -H 'Content-Type: application/json' \\\n"+
				"    -d '{\"model\": %q, \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 32}'\n\n", base, model)
			fmt.Fprintf(out, "Press Ctrl-C to stop.\n")
		}
	})
}
