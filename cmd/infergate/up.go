package main

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/bench"
	"github.com/infergate/infergate/disagg"
	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/simserver"
)

// upFlags are up's flags (bind).
type upFlags struct {
	engines int
	// count is --engines as given: N, or MIN..MAX for an elastic fleet
	// (upscale.go); engines is N, or MAX.
	count   engineCount
	elastic elasticFlags
	listen  string
	policy  string
	grace   time.Duration
	pprofAt string
	ef      engineFlags
	lf      logFlags
	access  bool
	keys    string
	tiers   tierFlags

	pd          string // "P:D": a P/D fleet (parsePD)
	pdConnector string
	pdThreshold int
	pdBusy      string
	pdBudget    int
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
from; llm-d-tiered and dynamo-tiered weigh them by fixed factors.

P/D: --pd P:D runs P prefill and D decode engines instead of --engines, and
the gateway splits prompts whose uncached part reaches --pd-threshold tokens
(routing.pd.threshold): P computes the prompt and holds its KV, D reads it
and decodes, over --pd-connector's protocol (nixl, mooncake or sglang;
gateway/README.md "P/D"). Shorter prompts are served whole on a decode engine.

Scale from zero: --engines MIN..MAX (e.g. 0..8) keeps MAX engine addresses
and runs MIN engines. A request to a pool with no ready engine is held
(gateway scale_from_zero: --hold-ttl, bounded), the gateway's wake-up hook
starts one engine, which answers /health 503 for its modelled cold start
(sim/startup.go: an image pull with --image-cached=false, weights read from
--startup-source, warm-up; scaled by --time-scale), and the held requests
are dispatched the moment it is ready. From then on the gateway's
autoscaling policy for the pool (package autoscale, the one plan
--autoscale runs in virtual time; --autoscale target=16,... with min and
max from --engines) decides how many engines run, every second: held and
queued requests and requests in flight over the target start more, up to
MAX, and the pool scales down to the most it wanted over the down window
(--idle-timeout), to MIN, idle engines draining and stopping.`,
		Example: `  infergate up
  infergate up --engines 8 --policy round-robin --listen 127.0.0.1:9000
  infergate up --kv-host 4x --kv-remote 8x --policy precise-prefix
  infergate up --pd 1:3 --pd-connector mooncake --pd-threshold 1024
  infergate up --engines 0..8 --time-scale 20 --idle-timeout 30s
  infergate up --engines 0..8 --time-scale 20 --autoscale target=4,down_window=30s,rate_window=10s
  infergate keys new alice | tail -1 >> keys.txt && infergate up --keys-file keys.txt   # keys new prints the key, then its entry`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return fl.run(cmd) },
	}
	fl.bind(cmd.Flags())
	return cmd
}

// bind registers up's flags on f.
func (fl *upFlags) bind(f *pflag.FlagSet) {
	fl.count = engineCount{max: 4}
	f.Var(&fl.count, "engines", "number of simulated engines, or MIN..MAX (e.g. 0..8) for a fleet that scales from zero: requests are held while no engine is ready, the first one starts an engine through its modelled cold start, then the gateway's autoscaling policy (--autoscale) sets the count")
	fl.elastic.register(f)
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
	f.StringVar(&fl.pd, "pd", "", "disaggregated prefill/decode: P:D runs P prefill and D decode engines (e.g. 1:3) instead of --engines")
	f.StringVar(&fl.pdConnector, "pd-connector", string(disagg.NIXL), "with --pd, the P→D hand-off protocol: nixl, mooncake or sglang")
	f.StringVar(&fl.pdBusy, "pd-busy", "", "with --pd, how a prefill engine is judged busy (routing.pd.prefill_busy): queue (default) or cost (its backlog's wait against the decode engine's own prefill: then the decode engine prefills)")
	f.IntVar(&fl.pdBudget, "pd-decode-budget", 0, "with --pd, the decode engines' token budget per step (sim pd.decode_max_num_batched_tokens; 0: the engines' own, 8192 by default)")
	f.IntVar(&fl.pdThreshold, "pd-threshold", 0, fmt.Sprintf("with --pd, split prompts with at least this many uncached tokens (routing.pd.threshold; 0: %d, -1: always split)", sched.DefaultPDThreshold))
}

// upPD is a parsed --pd: the number of prefill and decode engines and the
// connector.
type upPD struct {
	prefill, decode int
	connector       disagg.Connector
}

// parsePD checks --pd and the flags that go with it; the zero upPD (and
// nil) when --pd is not given.
func (fl *upFlags) parsePD(cmd *cobra.Command) (upPD, error) {
	f := cmd.Flags()
	if !f.Changed("pd") {
		for _, n := range []string{"pd-connector", "pd-threshold", "pd-busy", "pd-decode-budget"} {
			if f.Changed(n) {
				return upPD{}, fmt.Errorf("--%s needs --pd P:D", n)
			}
		}
		return upPD{}, nil
	}
	if f.Changed("engines") {
		return upPD{}, fmt.Errorf("--pd %q and --engines: give one (--pd P:D sets the fleet's size)", fl.pd)
	}
	ps, ds, ok := strings.Cut(strings.TrimSpace(fl.pd), ":")
	p, perr := strconv.Atoi(strings.TrimSpace(ps))
	d, derr := strconv.Atoi(strings.TrimSpace(ds))
	switch {
	case !ok || perr != nil || derr != nil:
		return upPD{}, fmt.Errorf("--pd %q: want P:D, the number of prefill and decode engines, e.g. 1:3", fl.pd)
	case p < 1 || d < 1:
		return upPD{}, fmt.Errorf("--pd %q: want at least one prefill and one decode engine", fl.pd)
	case p+d > 64:
		return upPD{}, fmt.Errorf("--pd %q: %d engines, want at most 64", fl.pd, p+d)
	}
	c, err := disagg.ParseConnector(fl.pdConnector)
	switch {
	case err == nil && c == disagg.LLMD:
		return upPD{}, fmt.Errorf("--pd-connector llm-d: its hand-off runs in a routing sidecar the simulated engines do not have (want nixl, mooncake or sglang)")
	case err != nil:
		return upPD{}, fmt.Errorf("--pd-connector %q: want nixl, mooncake or sglang", fl.pdConnector)
	}
	if err := checkPDThreshold(fl.pdThreshold); err != nil {
		return upPD{}, err
	}
	if b := fl.pdBusy; b != "" && b != sched.PDBusyQueue && b != sched.PDBusyCost {
		return upPD{}, fmt.Errorf("--pd-busy %q: want queue or cost", b)
	}
	if fl.pdBudget < 0 || fl.pdBudget > 1<<20 {
		return upPD{}, fmt.Errorf("--pd-decode-budget %d: want 1..%d tokens (0: the engines' budget)", fl.pdBudget, 1<<20)
	}
	return upPD{prefill: p, decode: d, connector: c}, nil
}

// on reports whether --pd was given.
func (pd upPD) on() bool { return pd.prefill > 0 }

// apply makes cfg's endpoints (those of fleet, in its order for each of
// its models) a P/D pool: each its engine's role and bootstrap port, the
// hand-off's connector, releases (the simulated engines serve
// disagg.ReleasePath) and the split threshold.
func (pd upPD) apply(cfg *gateway.Config, fleet *simserver.Fleet, threshold int) error {
	if !pd.on() {
		return nil
	}
	byURL := map[string]simserver.FleetMember{}
	for _, m := range fleet.Members {
		byURL[m.URL] = m
	}
	for i := range cfg.Endpoints {
		e := &cfg.Endpoints[i]
		m, ok := byURL[e.URL]
		if !ok {
			continue
		}
		e.Role = string(m.Role)
		if m.BootstrapAddr != "" {
			_, port, err := net.SplitHostPort(m.BootstrapAddr)
			if err != nil {
				return fmt.Errorf("engine %s: bootstrap address %q: %v", m.URL, m.BootstrapAddr, err)
			}
			if e.BootstrapPort, err = strconv.Atoi(port); err != nil {
				return fmt.Errorf("engine %s: bootstrap address %q: %v", m.URL, m.BootstrapAddr, err)
			}
		}
	}
	cfg.PD = gateway.PDConfig{Connector: string(pd.connector), Release: true}
	cfg.Routing.PD.Threshold = threshold
	return nil
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
	pd, err := fl.parsePD(cmd)
	if err != nil {
		return err
	}
	fl.engines = fl.count.max
	if fl.count.elastic {
		return fl.runElastic(cmd, scfg)
	}
	if err := fl.elastic.unused(cmd); err != nil {
		return err
	}
	if pd.on() {
		fl.engines = pd.prefill + pd.decode
		scfg.Engine.PD.DecodeMaxNumBatchedTokens = fl.pdBudget
	}
	if fl.engines < 1 || fl.engines > 64 {
		return fmt.Errorf("--engines %d: want 1..64", fl.engines)
	}
	if !fl.tiers.remote.IsZero() && fl.engines > 63 {
		return fmt.Errorf("--engines %d with --kv-remote: want 1..63 (the store takes a slot of the gateway's precise index)", fl.engines)
	}
	scfg.Engine = fl.tiers.engine(scfg.Engine)
	scfg.KVRemote = fl.tiers.remote
	prof, model := scfg.Engine.Profile, scfg.Model
	if !cmd.Flags().Changed("responses-store") {
		scfg.ResponsesStore = true // the embedded demo: continuations work
	}
	if !scfg.KVEvents.Enable {
		// The engines publish their KV events on loopback and the
		// gateway subscribes: the precise-prefix policy's input.
		scfg.KVEvents = kvevents.PublisherConfig{Enable: true}
	}
	var fleet *simserver.Fleet
	if pd.on() {
		fleet, err = simserver.StartPDFleet(pd.prefill, pd.decode, scfg)
	} else {
		fleet, err = simserver.StartFleet(fl.engines, scfg)
	}
	if err != nil {
		return err
	}
	defer fleet.Close()
	// The configuration: the fleet's endpoints and the flags, with the
	// keys read from the keys file and the environment at start and
	// at every SIGHUP.
	load := func() (gateway.Config, error) {
		cfg := gateway.Config{Listen: fl.listen, Routing: sched.Config{Policy: fl.policy}, ShutdownGrace: fl.grace,
			Tokenizers: gatewayTokenizers(scfg.Tokenizer, model)}
		// The base model only: the gateway finds the engines' LoRA
		// adapters (--lora-modules) in their GET /v1/models and routes
		// them through the base model's pool (gateway/adapters.go), which
		// tokenizes them with the base model's tokenizer.
		cfg.Endpoints = append(cfg.Endpoints, bench.FleetEndpoints(fleet, model)...)
		bench.FleetTiers(fleet, &cfg)
		if err := pd.apply(&cfg, fleet, fl.pdThreshold); err != nil {
			return cfg, err
		}
		if pd.on() {
			cfg.Routing.PD.PrefillBusy = fl.pdBusy
		}
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
			if pd.on() {
				threshold := fl.pdThreshold
				if threshold == 0 {
					threshold = sched.DefaultPDThreshold
				}
				extra := ""
				if fl.pdBusy == sched.PDBusyCost {
					extra += ", prefilled on D when P's backlog is longer (--pd-busy cost)"
				}
				if fl.pdBudget > 0 {
					extra += fmt.Sprintf(", decode engines' token budget %d", fl.pdBudget)
				}
				fmt.Fprintf(out, "  P/D: %d prefill + %d decode engines, connector %s, prompts with %d+ uncached tokens split%s\n",
					pd.prefill, pd.decode, pd.connector, threshold, extra)
			}
			if scfg.Tokenizer != "" {
				fmt.Fprintf(out, "  tokenizer: %s (the engines' and the gateway's routing)\n", scfg.Tokenizer)
			}
			if t := fl.tiers; !t.host.IsZero() || !t.disk.IsZero() || !t.remote.IsZero() {
				fmt.Fprintf(out, "  KV tiers: host %s, disk %s each; shared remote %s\n", t.host, t.disk, t.remote)
			}
			for i, u := range fleet.URLs {
				role := ""
				if m := fleet.Members[i]; pd.on() {
					role = fmt.Sprintf(" %s", m.Role)
					if m.BootstrapAddr != "" && pd.connector != disagg.NIXL {
						role += fmt.Sprintf(" (bootstrap %s)", m.BootstrapAddr)
					}
				}
				fmt.Fprintf(out, "    engine %d%s: %s (metrics %s/metrics)\n", i, role, u, u)
			}
			fmt.Fprintf(out, "  dashboard: %s/dashboard   metrics: %s/metrics   health: %s/healthz\n\n", base, base, base)
			fmt.Fprintf(out, "Try:\n  curl -s %s/v1/chat/completions -H 'Content-Type: application/json' \\\n"+
				"    -d '{\"model\": %q, \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 32}'\n\n", base, model)
			if fl.keys != "" {
				// Under `go run` the pid a shell knows is the go tool's, not
				// this process's: a SIGHUP to it kills go run, not a reload.
				fmt.Fprintf(out, "Keys: edit %s, then kill -HUP %d to reload it.\n", fl.keys, os.Getpid())
			}
			fmt.Fprintf(out, "Press Ctrl-C to stop.\n")
		}
	})
}

// checkPDThreshold checks a --pd-threshold of up, bench or plan: a token
// count, 0 for the default, or -1 to always split (routing.pd.threshold).
func checkPDThreshold(t int) error {
	if t < -1 {
		return fmt.Errorf("--pd-threshold %d: want a number of tokens, 0 for the default (%d), or -1 to always split", t, sched.DefaultPDThreshold)
	}
	return nil
}
