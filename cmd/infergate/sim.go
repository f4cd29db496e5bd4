package main

import (
	"net"
	"os"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/simserver"
)

// simFlags are sim's flags (bind).
type simFlags struct {
	listen string
	ef     engineFlags
	lf     logFlags
}

func newSimCmd() *cobra.Command {
	var fl simFlags
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
		RunE: func(cmd *cobra.Command, _ []string) error { return fl.run(cmd) },
	}
	fl.bind(cmd.Flags())
	return cmd
}

// bind registers sim's flags on f.
func (fl *simFlags) bind(f *pflag.FlagSet) {
	f.StringVar(&fl.listen, "listen", "127.0.0.1:8001", "address to serve on")
	f.StringArrayVar(&fl.ef.apiKeys, "api-key", nil, "require Authorization: Bearer <key> on every /v1 path, as vLLM's --api-key (repeatable: any of them; default $"+simserver.EnvAPIKey+"); /health and /metrics stay open")
	fl.lf.register(f)
	fl.ef.register(f, true, `vLLM's --kv-events-config JSON, all of its fields, e.g. '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}' (plus "encoding": "array"|"map")`)
}

// run is sim's RunE: serve one engine until the command's context is
// cancelled.
func (fl *simFlags) run(cmd *cobra.Command) error {
	// vLLM: --api-key takes precedence over VLLM_API_KEY.
	if len(fl.ef.apiKeys) == 0 {
		if k := os.Getenv(simserver.EnvAPIKey); k != "" {
			fl.ef.apiKeys = []string{k}
		}
	}
	scfg, err := fl.ef.serverConfig()
	if err != nil {
		return err
	}
	srv, err := simserver.NewServer(scfg)
	if err != nil {
		return err
	}
	srv.Start()
	defer srv.Close()
	log := newLogger(cmd)
	return listenAndServe(cmd.Context(), log, fl.listen, srv.Handler(), func(a net.Addr) {
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
}
