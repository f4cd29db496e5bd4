package main

import (
	"fmt"
	"net"
	"strings"

	"github.com/spf13/cobra"

	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/sched"
	"github.com/infergate/infergate/sim"
)

func newUpCmd() *cobra.Command {
	var (
		engines   int
		listen    string
		policy    string
		profile   string
		model     string
		timeScale float64
		kvEvents  string
		profFile  string
		lora      sim.LoRAConfig
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Run the gateway with an embedded simulated vLLM fleet",
		Long: `Start N simulated vLLM-compatible engines on loopback and the gateway in front
of them, in one process. The engines model continuous batching, a paged KV cache
with prefix caching and a roofline latency model of the chosen profile, so
cache-aware routing shows its effect without a GPU.`,
		Example: `  infergate up
  infergate up --engines 8 --policy round-robin --listen 127.0.0.1:9000`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !(timeScale > 0) {
				return fmt.Errorf("--time-scale %v: must be > 0", timeScale)
			}
			prof, err := resolveProfile(profile, profFile)
			if err != nil {
				return err
			}
			kv, err := parseKVEvents(kvEvents)
			if err != nil {
				return err
			}
			if engines < 1 || engines > 64 {
				return fmt.Errorf("--engines %d: want 1..64", engines)
			}
			if model == "" {
				model = prof.Model
			}
			fleet, err := sim.StartFleet(engines, sim.ServerConfig{
				Engine:    sim.Config{Profile: prof, LoRA: lora},
				Model:     model,
				TimeScale: timeScale,
				KVEvents:  kv,
			})
			if err != nil {
				return err
			}
			defer fleet.Close()
			cfg := gateway.Config{Listen: listen, Routing: sched.Config{Policy: policy}}
			for _, u := range fleet.URLs {
				for _, m := range append([]string{model}, lora.Adapters...) {
					cfg.Endpoints = append(cfg.Endpoints, gateway.EndpointConfig{URL: u, Model: m, KVBlocks: fleet.KVBlocks(), BlockSize: fleet.BlockSize()})
				}
			}
			g, err := gateway.New(cfg, nil)
			if err != nil {
				return err
			}
			defer g.Close()
			log := newLogger(cmd)
			out := cmd.OutOrStdout()
			return listenAndServe(cmd.Context(), log, listen, g.Handler(), func(a net.Addr) {
				base := "http://" + a.String()
				fmt.Fprintf(out, "infergate %s is up: OpenAI API at %s/v1 (policy %s)\n", buildVersion(), base, policy)
				fmt.Fprintf(out, "  fleet: %d simulated engines, profile %s, model %q, time scale %gx, %d KV blocks each\n",
					engines, prof.Name, model, timeScale, fleet.KVBlocks())
				for i, u := range fleet.URLs {
					fmt.Fprintf(out, "    engine %d: %s (metrics %s/metrics)\n", i, u, u)
				}
				fmt.Fprintf(out, "  metrics: %s/metrics   health: %s/healthz\n\n", base, base)
				fmt.Fprintf(out, "Try:\n  curl -s %s/v1/chat/completions -H 'Content-Type: application/json' \\\n"+
					"    -d '{\"model\": %q, \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 32}'\n\n", base, model)
				fmt.Fprintf(out, "Press Ctrl-C to stop.\n")
			})
		},
	}
	f := cmd.Flags()
	f.IntVar(&engines, "engines", 4, "number of simulated engines")
	f.StringVar(&listen, "listen", "127.0.0.1:8080", "address to serve the OpenAI API on")
	f.StringVar(&policy, "policy", sched.Prefix, "routing policy: "+strings.Join(sched.Names(), ", "))
	f.StringVar(&profile, "profile", sim.DefaultProfile().Name, "engine profile: "+strings.Join(profileNames(), ", "))
	f.StringVar(&model, "model", "", "served model name (default: the profile's model)")
	f.Float64Var(&timeScale, "time-scale", 1, "simulated seconds per wall-clock second")
	f.StringVar(&profFile, "profile-file", "", "engine profile from a YAML file (overrides --profile; see sim/profiles/)")
	addLoRAFlags(f, &lora)
	f.StringVar(&kvEvents, "kv-events-config", "", "vLLM's --kv-events-config JSON for every engine; engine i publishes on the endpoint's port + i")
	return cmd
}

func profileNames() []string { return sim.ProfileNames() }
