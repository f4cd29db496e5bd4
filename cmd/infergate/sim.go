package main

import (
	"encoding/json"
	"fmt"
	"net"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/sim"
)

func newSimCmd() *cobra.Command {
	var (
		listen    string
		profile   string
		model     string
		timeScale float64
		ecfg      sim.Config
		kvEvents  string
		profFile  string
	)
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Run one simulated vLLM-compatible engine",
		Long: `Serve one simulated engine with vLLM's OpenAI-compatible API, SSE format, usage
with cached_tokens and vLLM's Prometheus metric names. Inside: a paged KV cache
with prefix caching, continuous batching with chunked prefill, and a roofline
latency model of the chosen model-and-GPU profile.`,
		Example: `  infergate sim --listen 127.0.0.1:8001
  infergate sim --profile llama-3.1-8b-h100 --time-scale 10`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !(timeScale > 0) {
				return fmt.Errorf("--time-scale %v: must be > 0", timeScale)
			}
			prof, err := resolveProfile(profile, profFile)
			if err != nil {
				return err
			}
			ecfg.Profile = prof
			kv, err := parseKVEvents(kvEvents)
			if err != nil {
				return err
			}
			if model == "" {
				model = prof.Model
			}
			srv, err := sim.NewServer(sim.ServerConfig{Engine: ecfg, Model: model, TimeScale: timeScale, KVEvents: kv})
			if err != nil {
				return err
			}
			srv.Start()
			defer srv.Close()
			log := newLogger(cmd)
			return listenAndServe(cmd.Context(), log, listen, srv.Handler(), func(a net.Addr) {
				log.Info("simulated engine listening", "addr", "http://"+a.String(), "profile", prof.Name, "model", model, "time_scale", timeScale)
				if p := srv.KVEventPublisher(); p != nil {
					args := []any{"endpoint", p.Addr(), "encoding", p.Config().Encoding, "topic", p.Config().Topic}
					if r := p.ReplayAddr(); r != nil {
						args = append(args, "replay", r)
					}
					log.Info("publishing KV events", args...)
				}
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", "127.0.0.1:8001", "address to serve on")
	f.StringVar(&profile, "profile", sim.DefaultProfile().Name, "engine profile: "+strings.Join(profileNames(), ", "))
	f.StringVar(&model, "model", "", "served model name (default: the profile's model)")
	f.Float64Var(&timeScale, "time-scale", 1, "simulated seconds per wall-clock second")
	f.StringVar(&profFile, "profile-file", "", "engine profile from a YAML file (overrides --profile; see sim/profiles/)")
	f.StringVar(&kvEvents, "kv-events-config", "", `vLLM's --kv-events-config JSON, e.g. '{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557"}' (plus "encoding": "array"|"map")`)
	f.IntVar(&ecfg.BlockSize, "block-size", 0, "KV block size in tokens (default 16)")
	f.IntVar(&ecfg.NumBlocks, "num-gpu-blocks", 0, "KV cache capacity in blocks (default: derived from the profile)")
	f.IntVar(&ecfg.MaxNumSeqs, "max-num-seqs", 0, "maximum running requests per step (default 256)")
	f.IntVar(&ecfg.MaxNumBatchedTokens, "max-num-batched-tokens", 0, "token budget per step (default 8192)")
	addLoRAFlags(f, &ecfg.LoRA)
	return cmd
}

// resolveProfile returns the profile from file if given, else the built-in
// profile called name.
func resolveProfile(name, file string) (sim.Profile, error) {
	if file != "" {
		return sim.LoadProfile(file)
	}
	prof, ok := sim.Profiles()[name]
	if !ok {
		return sim.Profile{}, fmt.Errorf("unknown profile %q (have %s)", name, strings.Join(profileNames(), ", "))
	}
	return prof, nil
}

// parseKVEvents parses a --kv-events-config JSON object (vLLM's field names);
// "" means disabled.
func parseKVEvents(s string) (sim.KVEventsConfig, error) {
	var c sim.KVEventsConfig
	if s == "" {
		return c, nil
	}
	d := json.NewDecoder(strings.NewReader(s))
	d.DisallowUnknownFields()
	if err := d.Decode(&c); err != nil {
		return c, fmt.Errorf("--kv-events-config: %w", err)
	}
	return c, nil
}

// addLoRAFlags binds vLLM-style LoRA flags to c.
func addLoRAFlags(f *pflag.FlagSet, c *sim.LoRAConfig) {
	f.StringSliceVar(&c.Adapters, "lora-modules", nil, "LoRA adapter names served besides the base model (comma-separated; enables LoRA)")
	f.IntVar(&c.MaxLoras, "max-loras", 0, "adapters that may run in one batch (default 1)")
	f.IntVar(&c.MaxCPULoras, "max-cpu-loras", 0, "adapters kept loaded (default --max-loras)")
	f.DurationVar(&c.LoadLatency, "lora-load-latency", 0, "simulated time to load a non-resident adapter (default 50ms)")
}
