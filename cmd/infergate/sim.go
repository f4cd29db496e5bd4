package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/kvstore"
	"github.com/infergate/infergate/sim"
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
	// P/D (simserver PDConfig; SGLang's server args for the mode and port).
	pdMode         string
	bootstrapPort  int
	bootstrapMain  bool
	pdEngineID     string
	pdAdvertise    string
	pdWait         time.Duration
	pdMaxWaiters   int
	pdAbortTimeout time.Duration
	// Start-up and sleep (simserver startup.go, sleep.go).
	sleepMode     bool
	startupSource string
	imageCached   bool
	weights       weightsFlags
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
	f.StringVar(&fl.pdMode, "disaggregation-mode", "null", "P/D role, as SGLang's flag: prefill (SGLang bootstrap bodies are prefill legs: one token, KV held by room), decode (they are decode legs: wait for the room, read it), or null; vLLM's kv_transfer_params work in any mode")
	f.IntVar(&fl.bootstrapPort, "disaggregation-bootstrap-port", simserver.DefaultBootstrapPort, "port of the bootstrap listener (GET /query and the P/D side channel) on --listen's host; it runs in prefill mode or when this flag is given; 0 takes a free port")
	f.BoolVar(&fl.bootstrapMain, "pd-bootstrap-on-main", false, "also serve the bootstrap GET /query on --listen")
	f.StringVar(&fl.pdEngineID, "pd-engine-id", "", "engine id in kv_transfer_params and /query (default a random UUID)")
	f.StringVar(&fl.pdAdvertise, "pd-advertise-addr", "", "host:port a prefill response names as remote_host/remote_port (default the address the request came in on)")
	f.DurationVar(&fl.pdWait, "pd-wait", 0, "how long a concurrent decode leg (Mooncake, SGLang) waits for its prefill before recomputing (default 30s)")
	f.IntVar(&fl.pdMaxWaiters, "pd-max-waiters", 0, "side-channel transfer long polls this engine holds open at once; beyond it 503 with Retry-After (default 1024)")
	f.BoolVar(&fl.sleepMode, "enable-sleep-mode", false, "serve vLLM's sleep mode: POST /sleep?level=1|2, POST /wake_up[?tags=weights|kv_cache], GET /is_sleeping (vLLM --enable-sleep-mode with VLLM_SERVER_DEV_MODE=1)")
	f.StringVar(&fl.startupSource, "startup-source", "", "model the engine's cold start: unready (/health 503) for image pull, weights read from remote, nvme, page_cache or peer, and warm-up (sim/startup.go), at --time-scale; default: ready at once")
	f.BoolVar(&fl.imageCached, "image-cached", true, "with --startup-source or --weights, the image is on the node (no image pull)")
	fl.weights.register(f, "model the engine's cold start (as --startup-source) with ")
	f.DurationVar(&fl.pdAbortTimeout, "pd-abort-timeout", 0, "how long a finished prefill's KV is held for its decode leg (default $VLLM_NIXL_ABORT_REQUEST_TIMEOUT seconds, else 480s)")
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
	scfg.EnableSleepMode = fl.sleepMode
	weights, cache, err := fl.weights.open(cmd)
	if err != nil {
		return err
	}
	if cache != nil {
		defer cache.Close() // after the engine (deferred below) released its lease
	}
	if fl.startupSource != "" || weights != nil {
		var src sim.WeightSource
		if fl.startupSource != "" {
			if src, err = sim.ParseWeightSource(fl.startupSource); err != nil {
				return fmt.Errorf("--startup-source: %w", err)
			}
		}
		scfg.Startup = &simserver.StartupConfig{Source: src, ImageCached: fl.imageCached, Weights: weights}
	} else if cmd.Flags().Changed("image-cached") {
		return errors.New("--image-cached needs --startup-source or --weights")
	}
	if err := fl.pdConfig(cmd.Flags(), &scfg); err != nil {
		return err
	}
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
		if b := srv.BootstrapAddr(); b != "" || srv.Role() != simserver.RoleBoth {
			log.Info("P/D", "role", srv.Role(), "engine_id", srv.EngineID(), "bootstrap", b)
		}
	})
}

// pdConfig sets scfg's P/D configuration from the flags.
func (fl *simFlags) pdConfig(f *pflag.FlagSet, scfg *simserver.ServerConfig) error {
	role, err := simserver.ParseRole(fl.pdMode)
	if err != nil || fl.pdMode == "" || fl.pdMode == "both" {
		return fmt.Errorf("--disaggregation-mode %q: must be prefill, decode or null", fl.pdMode)
	}
	pd := simserver.PDConfig{Role: role, BootstrapOnMain: fl.bootstrapMain, EngineID: fl.pdEngineID,
		AdvertiseAddr: fl.pdAdvertise, Wait: fl.pdWait, MaxWaiters: fl.pdMaxWaiters}
	if fl.pdMaxWaiters < 0 {
		return fmt.Errorf("--pd-max-waiters %d: must not be negative", fl.pdMaxWaiters)
	}
	if role == simserver.RolePrefill || f.Changed("disaggregation-bootstrap-port") {
		if fl.bootstrapPort < 0 || fl.bootstrapPort > 65535 {
			return fmt.Errorf("--disaggregation-bootstrap-port %d: must be in [0, 65535]", fl.bootstrapPort)
		}
		host, _, err := net.SplitHostPort(fl.listen)
		if err != nil {
			return fmt.Errorf("--listen %q: %w", fl.listen, err)
		}
		pd.BootstrapAddr = net.JoinHostPort(host, strconv.Itoa(fl.bootstrapPort))
	}
	scfg.PD = pd
	abort := fl.pdAbortTimeout
	if abort == 0 {
		// vLLM's variable, in seconds (vllm/envs.py).
		if v := os.Getenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n <= 0 {
				return fmt.Errorf("VLLM_NIXL_ABORT_REQUEST_TIMEOUT=%q: must be a positive number of seconds", v)
			}
			abort = time.Duration(n) * time.Second
		}
	}
	if abort < 0 {
		return fmt.Errorf("--pd-abort-timeout %v: must not be negative", abort)
	}
	scfg.Engine.PD.AbortTimeout = abort
	return nil
}
