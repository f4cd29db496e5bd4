package main

import (
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/bench"
	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/simserver"
)

// upFlags are up's flags (bind).
type upFlags struct {
	engines int
	listen  string
	policy  string
	grace   time.Duration
	pprofAt string
	ef      engineFlags
	lf      logFlags
	access  bool
	keys    string
	tiers   tierFlags
}

func newUpCmd() *cobra.Command {
	var fl upFlags
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Run the gateway with an embedded simulated vLLM fleet",
		Long: `Start N simulated vLLM-compatible engines on loopback and the gateway in front
of them, in one process. The engines model continuous batching, a paged KV cache
with prefix caching and a roofline latency model of the chosen profile, so
cache-aware routing shows its effect without a GPU.

The engines keep Responses API responses (previous_response_id works; vLLM
needs VLLM_ENABLE_RESPONSES_API_STORE=1 for that): --responses-store=false
turns it off.

API keys: --keys-file (see 'infergate keys') and/or the INFERGATE_API_KEYS
environment variable, as for serve; without them the gateway is open. At
SIGHUP the keys file is read again (keys, models and limits change without a
restart; gateway/README.md, "Reload").

KV tiers: --kv-host and --kv-disk put a host-memory and a local-disk tier
behind each engine's GPU, --kv-remote one remote store shared by the fleet
(sizes as multiples of the GPU KV cache, 4x, or bytes, 512GiB; bandwidths
and latencies from the profile; sim/tiers.go). The engines publish their
tiers' KV events, the store its own, and the gateway is configured with the
tiers' capacities and load costs (kv_events.tiers, kv_stores). Any policy's
prediction is then split by tier (infergate_prefix_predicted_tier_tokens_total);
--policy precise-prefix (or a cost profile) prices hits by the tier they load
from; llm-d-tiered and dynamo-tiered weigh them by fixed factors.`,
		Example: `  infergate up
  infergate up --engines 8 --policy round-robin --listen 127.0.0.1:9000
  infergate up --kv-host 4x --kv-remote 8x --policy precise-prefix
  infergate keys new alice >> keys.txt && infergate up --keys-file keys.txt`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return fl.run(cmd) },
	}
	fl.bind(cmd.Flags())
	return cmd
}

// bind registers up's flags on f.
func (fl *upFlags) bind(f *pflag.FlagSet) {
	f.IntVar(&fl.engines, "engines", 4, "number of simulated engines")
	f.StringVar(&fl.listen, "listen", "127.0.0.1:8080", "address to serve the OpenAI API on")
	f.StringVar(&fl.policy, "policy", "", "routing policy (default cache-aware; precise-prefix uses the engines' KV events): "+strings.Join(sched.Names(), ", "))
	f.DurationVar(&fl.grace, "shutdown-grace", gateway.DefaultShutdownGrace, shutdownGraceUsage)
	f.StringVar(&fl.pprofAt, "pprof", "", "serve net/http/pprof on this loopback address, e.g. 127.0.0.1:6060 (off by default; the engines share the process)")
	fl.ef.register(f, false, "vLLM's --kv-events-config JSON for every engine; engine i publishes on the endpoint's port + i")
	f.IntVar(&fl.ef.engine.NumBlocks, "num-gpu-blocks", 0, "KV cache capacity of each engine in blocks (default: derived from the profile)")
	fl.tiers.register(f)
	fl.lf.register(f)
	accessLogFlag(f, &fl.access)
	f.StringVar(&fl.keys, "keys-file", "", "API keys file (see 'infergate keys'); also $"+auth.EnvAPIKeys+"; read again at SIGHUP")
}

// run is up's RunE: start the fleet, then the gateway in front of it
// (runGateway) until the command's context is cancelled.
func (fl *upFlags) run(cmd *cobra.Command) error {
	scfg, err := fl.ef.serverConfig()
	if err != nil {
		return err
	}
	if err := checkPprofAddr(fl.pprofAt); err != nil {
		return err
	}
	if fl.engines < 1 || fl.engines > 64 {
		return fmt.Errorf("--engines %d: want 1..64", fl.engines)
	}
	if !fl.tiers.remote.IsZero() && fl.engines > 63 {
		return fmt.Errorf("--engines %d with --kv-remote: want 1..63 (the store takes a slot of the gateway's precise index)", fl.engines)
	}
	scfg.Engine = fl.tiers.engine(scfg.Engine)
	scfg.KVRemote = fl.tiers.remote
	prof, model, lora := scfg.Engine.Profile, scfg.Model, scfg.Engine.LoRA
	if !cmd.Flags().Changed("responses-store") {
		scfg.ResponsesStore = true // the embedded demo: continuations work
	}
	if !scfg.KVEvents.Enable {
		// The engines publish their KV events on loopback and the
		// gateway subscribes: the precise-prefix policy's input.
		scfg.KVEvents = kvevents.PublisherConfig{Enable: true}
	}
	fleet, err := simserver.StartFleet(fl.engines, scfg)
	if err != nil {
		return err
	}
	defer fleet.Close()
	// The configuration: the fleet's endpoints and the flags, with the
	// keys read from the keys file and the environment at start and
	// at every SIGHUP.
	load := func() (gateway.Config, error) {
		cfg := gateway.Config{Listen: fl.listen, Routing: sched.Config{Policy: fl.policy}, ShutdownGrace: fl.grace}
		for _, m := range append([]string{model}, lora.Adapters...) {
			cfg.Endpoints = append(cfg.Endpoints, bench.FleetEndpoints(fleet, m)...)
		}
		bench.FleetTiers(fleet, &cfg)
		if err := applyEdgeFlags(cmd, &cfg, "", "", fl.keys); err != nil {
			return cfg, err
		}
		applyAccessLog(cmd, &cfg.AccessLog, fl.access)
		return cfg, resolveLog(cmd, &cfg.Log)
	}
	out := cmd.OutOrStdout()
	// The pprof server profiles the simulated engines too: they share the
	// process.
	return runGateway(cmd, fl.pprofAt, load, func(g *gateway.Gateway, _ *slog.Logger, _ gateway.Config) func(net.Addr) {
		resolved := g.Policy() // load reads policy: not written from here on
		return func(a net.Addr) {
			base := "http://" + a.String()
			auth := "open (no API keys)"
			if g.AuthEnabled() {
				auth = "API keys required"
			}
			fmt.Fprintf(out, "infergate %s is up: OpenAI API at %s/v1 (policy %s; %s)\n", buildVersion(), base, resolved, auth)
			fmt.Fprintf(out, "  fleet: %d simulated engines, profile %s, model %q, time scale %gx, %d KV blocks each\n",
				fl.engines, prof.Name, model, scfg.TimeScale, fleet.KVBlocks())
			if t := fl.tiers; !t.host.IsZero() || !t.disk.IsZero() || !t.remote.IsZero() {
				fmt.Fprintf(out, "  KV tiers: host %s, disk %s each; shared remote %s\n", t.host, t.disk, t.remote)
			}
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
