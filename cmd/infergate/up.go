package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/infergate/infergate/bench"
	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
)

func newUpCmd() *cobra.Command {
	var (
		engines int
		listen  string
		policy  string
		grace   time.Duration
		pprofAt string
		ef      engineFlags
		lf      logFlags
		access  bool
		keys    string
	)
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
restart; gateway/README.md, "Reload").`,
		Example: `  infergate up
  infergate up --engines 8 --policy round-robin --listen 127.0.0.1:9000
  infergate keys new alice >> keys.txt && infergate up --keys-file keys.txt`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			scfg, err := ef.serverConfig()
			if err != nil {
				return err
			}
			if err := checkPprofAddr(pprofAt); err != nil {
				return err
			}
			if engines < 1 || engines > 64 {
				return fmt.Errorf("--engines %d: want 1..64", engines)
			}
			prof, model, lora := scfg.Engine.Profile, scfg.Model, scfg.Engine.LoRA
			if !cmd.Flags().Changed("responses-store") {
				scfg.ResponsesStore = true // the embedded demo: continuations work
			}
			if !scfg.KVEvents.Enable {
				// The engines publish their KV events on loopback and the
				// gateway subscribes: the precise-prefix policy's input.
				scfg.KVEvents = kvevents.PublisherConfig{Enable: true}
			}
			fleet, err := sim.StartFleet(engines, scfg)
			if err != nil {
				return err
			}
			defer fleet.Close()
			// The configuration: the fleet's endpoints and the flags, with the
			// keys read from the keys file and the environment at start and
			// at every SIGHUP.
			load := func() (gateway.Config, error) {
				cfg := gateway.Config{Listen: listen, Routing: sched.Config{Policy: policy}, ShutdownGrace: grace}
				for _, m := range append([]string{model}, lora.Adapters...) {
					cfg.Endpoints = append(cfg.Endpoints, bench.FleetEndpoints(fleet, m)...)
				}
				if err := applyEdgeFlags(cmd, &cfg, "", "", keys); err != nil {
					return cfg, err
				}
				applyAccessLog(cmd, &cfg.AccessLog, access)
				return cfg, resolveLog(cmd, &cfg.Log)
			}
			// Caught from now on: SIGHUP's default action ends the process.
			hup := make(chan os.Signal, 1)
			signal.Notify(hup, syscall.SIGHUP)
			defer signal.Stop(hup)
			cfg, err := load()
			if err != nil {
				return err
			}
			log, err := setupLogging(cmd, &cfg.Log)
			if err != nil {
				return err
			}
			g, err := gateway.New(cfg, nil)
			if err != nil {
				return err
			}
			defer g.Close()
			warnExposure(log, listen, g)
			ctx, stopHUP := context.WithCancel(cmd.Context())
			defer stopHUP()
			go reloadOnHUP(ctx, log, hup, g, load) // load reads policy: not written from here on
			resolved := g.Policy()
			if pprofAt != "" { // profiles the simulated engines too: they share the process
				stop, err := startPprof(log, pprofAt)
				if err != nil {
					return err
				}
				defer stop()
			}
			out := cmd.OutOrStdout()
			return serveGateway(ctx, log, listen, g, func(a net.Addr) {
				base := "http://" + a.String()
				auth := "open (no API keys)"
				if g.AuthEnabled() {
					auth = "API keys required"
				}
				fmt.Fprintf(out, "infergate %s is up: OpenAI API at %s/v1 (policy %s; %s)\n", buildVersion(), base, resolved, auth)
				fmt.Fprintf(out, "  fleet: %d simulated engines, profile %s, model %q, time scale %gx, %d KV blocks each\n",
					engines, prof.Name, model, scfg.TimeScale, fleet.KVBlocks())
				for i, u := range fleet.URLs {
					fmt.Fprintf(out, "    engine %d: %s (metrics %s/metrics)\n", i, u, u)
				}
				fmt.Fprintf(out, "  dashboard: %s/dashboard   metrics: %s/metrics   health: %s/healthz\n\n", base, base, base)
				fmt.Fprintf(out, "Try:\n  curl -s %s/v1/chat/completions -H 'Content-Type: application/json' \\\n"+
					"    -d '{\"model\": %q, \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 32}'\n\n", base, model)
				fmt.Fprintf(out, "Press Ctrl-C to stop.\n")
			})
		},
	}
	f := cmd.Flags()
	f.IntVar(&engines, "engines", 4, "number of simulated engines")
	f.StringVar(&listen, "listen", "127.0.0.1:8080", "address to serve the OpenAI API on")
	f.StringVar(&policy, "policy", "", "routing policy (default cache-aware; precise-prefix uses the engines' KV events): "+strings.Join(sched.Names(), ", "))
	f.DurationVar(&grace, "shutdown-grace", gateway.DefaultShutdownGrace, shutdownGraceUsage)
	f.StringVar(&pprofAt, "pprof", "", "serve net/http/pprof on this loopback address, e.g. 127.0.0.1:6060 (off by default; the engines share the process)")
	ef.register(f, false, "vLLM's --kv-events-config JSON for every engine; engine i publishes on the endpoint's port + i")
	lf.register(f)
	accessLogFlag(f, &access)
	f.StringVar(&keys, "keys-file", "", "API keys file (see 'infergate keys'); also $"+gateway.EnvAPIKeys+"; read again at SIGHUP")
	return cmd
}
