package main

import (
	"net"
	"os"

	"github.com/spf13/cobra"

	"github.com/infergate/infergate/sim"
)

func newSimCmd() *cobra.Command {
	var (
		listen string
		ef     engineFlags
		lf     logFlags
	)
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Run one simulated vLLM-compatible engine",
		Long: `Serve one simulated engine with vLLM's OpenAI-compatible API, SSE format, usage
with cached_tokens and vLLM's Prometheus metric names. Inside: a paged KV cache
with prefix caching, continuous batching with chunked prefill, and a roofline
latency model of the chosen model-and-GPU profile.`,
		Example: `  infergate sim --listen 127.0.0.1:8001
  infergate sim --profile llama-3.1-8b-h100 --time-scale 10
  VLLM_API_KEY=secret infergate sim --listen 127.0.0.1:8001`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// vLLM: --api-key takes precedence over VLLM_API_KEY.
			if len(ef.apiKeys) == 0 {
				if k := os.Getenv(sim.EnvAPIKey); k != "" {
					ef.apiKeys = []string{k}
				}
			}
			scfg, err := ef.serverConfig()
			if err != nil {
				return err
			}
			srv, err := sim.NewServer(scfg)
			if err != nil {
				return err
			}
			srv.Start()
			defer srv.Close()
			log := newLogger(cmd)
			return listenAndServe(cmd.Context(), log, listen, srv.Handler(), func(a net.Addr) {
				log.Info("simulated engine listening", "addr", "http://"+a.String(), "profile", scfg.Engine.Profile.Name, "model", scfg.Model, "time_scale", scfg.TimeScale,
					"api_keys", len(scfg.APIKeys))
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
	f.StringArrayVar(&ef.apiKeys, "api-key", nil, "require Authorization: Bearer <key> on every /v1 path, as vLLM's --api-key (repeatable: any of them; default $"+sim.EnvAPIKey+"); /health and /metrics stay open")
	lf.register(f)
	ef.register(f, true, `vLLM's --kv-events-config JSON, all of its fields, e.g. '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}' (plus "encoding": "array"|"map")`)
	return cmd
}
