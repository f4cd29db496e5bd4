package main

import (
	"errors"
	"net"
	"os"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/kvstore"
	"github.com/infergate/infergate/simserver"
)

// simFlags are sim's flags (bind).
type simFlags struct {
	listen string
	ef     engineFlags
	lf     logFlags
	tiers  tierFlags
	// store: an infergate kvstore as the remote tier (kvstore.EngineTier).
	storeURL, storeEvents, storeReplay string
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
  VLLM_API_KEY=secret infergate sim --listen 127.0.0.1:8001
  # host-memory tier 4x the GPU cache, a running kvstore as the shared remote tier
  infergate sim --kv-host 4x --kv-store-url http://127.0.0.1:8100 --kv-store-events tcp://127.0.0.1:5557   # kvstore's defaults`,
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
	fl.tiers.register(f)
	f.StringVar(&fl.storeURL, "kv-store-url", "", "an infergate kvstore's native API (http://host:port) as the engine's shared remote KV tier, written through and loaded from (with --kv-store-events; instead of --kv-remote)")
	f.StringVar(&fl.storeEvents, "kv-store-events", "", "the kvstore's KV-event PUB endpoint (tcp://host:port), whose events tell the engine what the store holds")
	f.StringVar(&fl.storeReplay, "kv-store-events-replay", "", "the kvstore's KV-event replay (ROUTER) endpoint, if any")
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
	scfg.Engine = fl.tiers.engine(scfg.Engine)
	scfg.KVRemote = fl.tiers.remote
	if (fl.storeURL == "") != (fl.storeEvents == "") {
		return errors.New("--kv-store-url and --kv-store-events go together")
	}
	if fl.storeURL != "" {
		if !fl.tiers.remote.IsZero() {
			return errors.New("--kv-store-url and --kv-remote: one remote tier")
		}
		tier, err := kvstore.NewEngineTier(kvstore.EngineTierConfig{URL: fl.storeURL, Events: fl.storeEvents, EventsReplay: fl.storeReplay,
			Model: scfg.Model, BlockBytes: int64(scfg.Engine.BlockBytes())})
		if err != nil {
			return err
		}
		defer tier.Close()
		scfg.Engine.Tiers.Remote = tier
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
		if t := scfg.Engine.Tiers; t.Enabled() {
			remote := "off"
			switch {
			case fl.storeURL != "":
				remote = "kvstore " + fl.storeURL
			case !fl.tiers.remote.IsZero():
				remote = "own store " + fl.tiers.remote.String()
			}
			log.Info("KV tiers", "host", t.Host.String(), "disk", t.Disk.String(), "remote", remote)
		}
		if pub, replay := srv.RemoteStore().KVEventEndpoints(); pub != "" {
			log.Info("remote store publishing KV events", "endpoint", pub, "replay", replay, "topic", simserver.DefaultRemoteTopic(scfg.Model))
		}
		if p := srv.KVEventPublisher(); p != nil {
			args := []any{"endpoint", p.Addr(), "encoding", p.Config().Encoding, "topic", p.Config().Topic}
			if r := p.ReplayAddr(); r != nil {
				args = append(args, "replay", r)
			}
			log.Info("publishing KV events", args...)
		}
	})
}
