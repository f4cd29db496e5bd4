package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/infergate/infergate/auth"
	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/sched"
)

// finalWriteWindow is how long the handlers of requests ended at the expiry
// of the shutdown grace get to write their last words (a 503, a stream's
// error event and [DONE]) before the connections are closed.
const finalWriteWindow = 2 * time.Second

// drainer is a handler that takes part in a shutdown (the gateway): Drain
// at the signal, Abort when the grace has expired.
type drainer interface {
	Drain()
	Abort()
}

// shutdown says how serveUntilDone stops: grace for the requests in flight,
// and the drainer to tell (nil: none).
type shutdown struct {
	grace time.Duration
	drain drainer
}

// listenAndServe serves h (not a gateway) on addr until ctx is cancelled,
// then shuts down gracefully within the default grace. ready, if not nil,
// is called with the bound address once the listener is open (so ":0"
// works).
func listenAndServe(ctx context.Context, log *slog.Logger, addr string, h http.Handler, ready func(net.Addr)) error {
	return serveUntilDone(ctx, log, addr, &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}, shutdown{grace: gateway.DefaultShutdownGrace}, ready)
}

// serveGateway serves g on addr (g.Server(), TLS when configured) until ctx
// is cancelled, then shuts it down within its shutdown_grace; ready as for
// listenAndServe.
//
// With autoscale.keda_listen it also serves KEDA's external scaler gRPC
// service there, stopped when the gateway is.
func serveGateway(ctx context.Context, log *slog.Logger, addr string, g *gateway.Gateway, ready func(net.Addr)) error {
	stop, err := serveExternalScaler(log, g)
	if err != nil {
		return err
	}
	defer stop()
	return serveUntilDone(ctx, log, addr, g.Server(), shutdown{grace: g.Config().ShutdownGrace, drain: g}, ready)
}

// serveExternalScaler serves g's KEDA external scaler on
// autoscale.keda_listen (nothing when unset); stop ends it, closing its
// streams.
func serveExternalScaler(log *slog.Logger, g *gateway.Gateway) (stop func(), err error) {
	addr := g.Config().Autoscale.KEDAListen
	if addr == "" {
		return func() {}, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("autoscale.keda_listen %s: %w", addr, err)
	}
	s := grpc.NewServer(grpc.MaxRecvMsgSize(64<<10), grpc.MaxConcurrentStreams(256), grpc.MaxHeaderListSize(gateway.MaxGRPCHeaderBytes))
	g.RegisterExternalScaler(s)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := s.Serve(ln); err != nil {
			log.Error("KEDA external scaler stopped", "err", err)
		}
	}()
	log.Info("KEDA external scaler listening", "addr", ln.Addr().String())
	return func() { s.Stop(); <-done }, nil
}

// serveUntilDone serves srv on addr (TLS when srv.TLSConfig is set) until
// ctx is cancelled (SIGINT, SIGTERM), then shuts down: the listener is
// closed and sd.drain drained (queued requests answered 503 at once), the
// requests in flight get sd.grace to finish; past it they are aborted (each
// told with an explicit error, not cut off) and get finalWriteWindow to
// write it before the connections are closed. ready as for listenAndServe.
func serveUntilDone(ctx context.Context, log *slog.Logger, addr string, srv *http.Server, sd shutdown,
	ready func(net.Addr)) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", addr, err)
	}
	srv.ErrorLog = slog.NewLogLogger(log.Handler(), slog.LevelWarn)
	if ready != nil {
		ready(ln.Addr())
	}
	errc := make(chan error, 1)
	go func() {
		if srv.TLSConfig != nil {
			errc <- srv.ServeTLS(ln, "", "") // the certificate comes from TLSConfig
			return
		}
		errc <- srv.Serve(ln)
	}()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down (a second SIGINT/SIGTERM stops at once)", "grace", sd.grace)
	if sd.drain != nil {
		sd.drain.Drain()
	}
	sctx, cancel := context.WithTimeout(context.Background(), sd.grace)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		if sd.drain != nil {
			log.Warn("shutdown grace expired: ending the requests still in flight", "grace", sd.grace)
			sd.drain.Abort()
			fctx, fcancel := context.WithTimeout(context.Background(), finalWriteWindow)
			err = srv.Shutdown(fctx) // returns once the aborted handlers are done
			fcancel()
		}
		if err != nil {
			_ = srv.Close()
		}
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// serveFlags are serve's flags (bind).
type serveFlags struct {
	configPath string
	listen     string
	policy     string
	endpoints  []string
	keyEnv     string
	tlsCert    string
	tlsKey     string
	keysFile   string
	pprofAddr  string
	grace      time.Duration
	lf         logFlags
	access     bool
	kubeconfig string
	// amend, when set, changes the file's configuration before the flags
	// apply (epp's --pool-* flags).
	amend func(*gateway.Config) error
}

func newServeCmd() *cobra.Command {
	var fl serveFlags
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the gateway in front of real engines",
		Long: `Run the gateway in front of OpenAI-compatible engines (vLLM, SGLang, llama.cpp,
Ollama, TGI, or 'infergate sim'). Endpoints come from a YAML config (-c) and/or
--endpoint flags; flags override the file's listen address, policy and
shutdown grace.

Config example:

  listen: 127.0.0.1:8080
  routing:
    policy: cache-aware       # cache-aware | precise-prefix | prefix | power-of-two | least-request | round-robin | random
  endpoints:
    - {url: http://10.0.0.1:8000, model: meta-llama/Llama-3.1-70B-Instruct}
    - {url: http://10.0.0.2:8000, model: meta-llama/Llama-3.1-70B-Instruct, kv_blocks: 28000}

Every key (timeouts, health checks, body limits, prefix tuning, API keys, TLS),
the metrics and the error codes are listed in gateway/README.md.

SIGTERM or SIGINT: the gateway stops accepting, answers requests waiting in
an admission queue (and any new one) 503 shutting_down, and gives those in
flight shutdown_grace (--shutdown-grace, default 25s) to finish; then it ends
them with an explicit error (503, or a stream's error event and [DONE]) and
exits.

SIGHUP: the configuration (file, flags, environment, keys file) is read
again and applied without a restart and without dropping a request:
endpoints (their engine credentials too, api_key_env read again), routing,
aliases, API keys and their limits, admission and circuit_breaker. An
invalid configuration is refused whole (logged, counted in
infergate_config_reloads_total{result="failure"}) and the one in force
stays; settings that need a restart (listen, tls, timeouts, log, access_log,
tracing, ...) keep their value and are logged. See gateway/README.md "Reload".

API keys: auth.keys_file (or --keys-file) and/or the INFERGATE_API_KEYS
environment variable (same format, ';' between entries); hash a key with
'infergate keys hash'. Without keys the gateway is open.

Engines that need a key (vLLM --api-key, hosted OpenAI-compatible APIs): set
api_key_env (or --endpoint-api-key-env) to the name of an environment variable
holding it; the gateway sends its own key, never the client's. An engine that
refuses it (401/403) is ejected and the client gets 502 upstream_auth.

Kubernetes: with a discovery.kubernetes section (namespace, inference_pool
or service and port, endpoint: the template of a discovered engine) the
engines are the ready pods of an InferencePool or the ready addresses of a
Service's EndpointSlices, watched through the API server (--kubeconfig,
$KUBECONFIG, ~/.kube/config, else in-cluster); they join and leave without a
restart, and /readyz is not ready until the watch has synced. See
gateway/README.md "Kubernetes discovery".

Observability: --log-level/--log-format (log.level, log.format); one access
log line per API request, on unless --access-log=false (access_log.enabled,
access_log.path); X-Infergate-Endpoint on answers with
response_headers.endpoint; OpenTelemetry traces over OTLP/HTTP with
tracing.otlp_endpoint (the client's traceparent is carried to the engine).`,
		Example: `  infergate serve -c gateway.yaml
  infergate serve --endpoint http://127.0.0.1:8001=my-model --endpoint http://127.0.0.1:8002=my-model --policy cache-aware
  VLLM_KEY=... infergate serve --endpoint http://10.0.0.1:8000=my-model --endpoint-api-key-env VLLM_KEY`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// The configuration as the file, the flags and the environment
			// give it: at start, and again at every SIGHUP.
			load := func() (gateway.Config, error) { return fl.config(cmd) }
			return runGateway(cmd, fl.pprofAddr, load, func(g *gateway.Gateway, log *slog.Logger, cfg gateway.Config) func(net.Addr) {
				scheme := "http://"
				if g.TLSEnabled() {
					scheme = "https://"
				}
				return func(a net.Addr) {
					log.Info("gateway listening", "addr", scheme+a.String(), "policy", g.Policy(), "endpoints", len(cfg.Endpoints),
						"auth", g.AuthEnabled())
				}
			})
		},
	}
	fl.bind(cmd.Flags())
	return cmd
}

// bind registers serve's flags on f.
func (fl *serveFlags) bind(f *pflag.FlagSet) {
	f.StringVarP(&fl.configPath, "config", "c", "", "YAML config file")
	f.StringVar(&fl.listen, "listen", "127.0.0.1:8080", "address to serve the OpenAI API on")
	f.StringVar(&fl.policy, "policy", "", "routing policy (default cache-aware; precise-prefix needs kv_events on every endpoint): "+strings.Join(sched.Names(), ", "))
	f.StringArrayVar(&fl.endpoints, "endpoint", nil, "engine endpoint as URL=MODEL (repeatable)")
	f.StringVar(&fl.keyEnv, "endpoint-api-key-env", "", "name of the environment variable holding the API key the --endpoint engines require "+
		"(vLLM --api-key, a hosted backend's key; sent as Authorization: Bearer); the key itself is never a flag")
	f.StringVar(&fl.tlsCert, "tls-cert", "", "PEM certificate chain: serve HTTPS (overrides tls.cert_file; needs --tls-key)")
	f.StringVar(&fl.tlsKey, "tls-key", "", "PEM private key for --tls-cert (overrides tls.key_file)")
	f.StringVar(&fl.keysFile, "keys-file", "", "API keys file (overrides auth.keys_file; see 'infergate keys')")
	f.StringVar(&fl.pprofAddr, "pprof", "", "serve net/http/pprof on this loopback address, e.g. 127.0.0.1:6060 (off by default)")
	f.DurationVar(&fl.grace, "shutdown-grace", gateway.DefaultShutdownGrace, shutdownGraceUsage+" (overrides shutdown_grace)")
	f.StringVar(&fl.kubeconfig, "kubeconfig", "", "kubeconfig file for discovery.kubernetes (overrides its kubeconfig; default $KUBECONFIG, ~/.kube/config, else the pod's service account)")
	fl.lf.register(f)
	accessLogFlag(f, &fl.access)
}

// config is the gateway configuration the file (-c), the flags and the
// environment give; the flags given on cmd's command line override the
// file's listen address, policy and shutdown grace.
func (fl *serveFlags) config(cmd *cobra.Command) (gateway.Config, error) {
	var cfg gateway.Config
	if fl.configPath != "" {
		c, err := gateway.LoadConfig(fl.configPath)
		if err != nil {
			return cfg, err
		}
		cfg = c
	}
	if fl.amend != nil {
		if err := fl.amend(&cfg); err != nil {
			return cfg, err
		}
	}
	if cmd.Flags().Changed("listen") || cfg.Listen == "" {
		cfg.Listen = fl.listen
	}
	if cmd.Flags().Changed("policy") {
		cfg.Routing.Policy = fl.policy
	}
	if cmd.Flags().Changed("shutdown-grace") {
		cfg.ShutdownGrace = fl.grace
	}
	for _, e := range fl.endpoints {
		url, model, ok := strings.Cut(e, "=")
		if !ok || url == "" || model == "" {
			return cfg, fmt.Errorf("--endpoint %q: want URL=MODEL", e)
		}
		cfg.Endpoints = append(cfg.Endpoints, gateway.EndpointConfig{URL: url, Model: model, APIKeyEnv: fl.keyEnv})
	}
	if fl.keyEnv != "" && len(fl.endpoints) == 0 {
		return cfg, errors.New("--endpoint-api-key-env is for the --endpoint flags' engines: give it with --endpoint URL=MODEL (or set api_key_env in the config)")
	}
	if k := cfg.Discovery.Kubernetes; k != nil && fl.kubeconfig != "" {
		c := *k
		c.Kubeconfig = fl.kubeconfig
		cfg.Discovery.Kubernetes = &c
	}
	if fl.kubeconfig != "" && cfg.Discovery.Kubernetes == nil {
		return cfg, errors.New("--kubeconfig is for Kubernetes discovery: the configuration has no discovery.kubernetes section")
	}
	if len(cfg.Endpoints) == 0 && cfg.Discovery.Kubernetes == nil {
		return cfg, errors.New("no endpoints: give -c config.yaml (endpoints or discovery.kubernetes) or --endpoint URL=MODEL")
	}
	if err := applyEdgeFlags(cmd, &cfg, fl.tlsCert, fl.tlsKey, fl.keysFile); err != nil {
		return cfg, err
	}
	applyAccessLog(cmd, &cfg.AccessLog, fl.access)
	return cfg, resolveLog(cmd, &cfg.Log)
}

// runGateway runs a gateway (serve, up) with the configuration load
// returns until cmd's context is cancelled. SIGHUP is caught from the call
// on (its default action would end the process, during start-up too) and
// applies load's configuration again. pprofAddr is --pprof (checked after
// the configuration is loaded; "" is off). ready is given the gateway, the
// logger and the configuration once the gateway is built and returns what
// is called with the bound address once it listens (serveGateway).
func runGateway(cmd *cobra.Command, pprofAddr string, load func() (gateway.Config, error),
	ready func(g *gateway.Gateway, log *slog.Logger, cfg gateway.Config) func(net.Addr)) error {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	cfg, err := load()
	if err != nil {
		return err
	}
	if err := checkPprofAddr(pprofAddr); err != nil {
		return err
	}
	log, err := setupLogging(cmd, &cfg.Log)
	if err != nil {
		return err
	}
	// The registry the gateway would make itself, kept for discovery's
	// metrics (discovery.go).
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	g, err := gateway.New(cmd.Context(), cfg, reg)
	if err != nil {
		return err
	}
	defer g.Close()
	if cfg.Discovery.Kubernetes != nil {
		g.HoldReadiness("kubernetes discovery: starting")
	}
	warnExposure(log, cfg.Listen, g)
	ctx, stop := context.WithCancel(cmd.Context())
	defer stop()
	r := &reloader{g: g, log: log, load: load, static: cfg, reg: reg}
	stopDiscovery, err := r.startDiscovery(ctx, cfg)
	if err != nil {
		return err
	}
	defer stopDiscovery()
	go reloadOnHUP(ctx, log, hup, r)
	onReady := ready(g, log, cfg)
	if pprofAddr != "" {
		stop, err := startPprof(log, pprofAddr)
		if err != nil {
			return err
		}
		defer stop()
	}
	return serveGateway(ctx, log, cfg.Listen, g, onReady)
}

// reloadOnHUP applies the configuration r loads, with the engines
// discovery found, at every SIGHUP on hup until ctx is done
// (Gateway.ReloadWith logs and counts the outcome).
func reloadOnHUP(ctx context.Context, log *slog.Logger, hup <-chan os.Signal, r *reloader) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			log.Info("SIGHUP: reloading the configuration")
			r.hup()
		}
	}
}

// shutdownGraceUsage is the --shutdown-grace flag's help (serve and up).
const shutdownGraceUsage = "time requests in flight get to finish after SIGTERM/SIGINT before they are ended with an explicit error"

// applyEdgeFlags applies the TLS and keys-file flags and the
// INFERGATE_API_KEYS environment variable to cfg.
func applyEdgeFlags(cmd *cobra.Command, cfg *gateway.Config, tlsCert, tlsKey, keysFile string) error {
	if cmd.Flags().Changed("tls-cert") || cmd.Flags().Changed("tls-key") {
		cfg.TLS.CertFile, cfg.TLS.KeyFile = tlsCert, tlsKey
	}
	if keysFile != "" {
		cfg.Auth.KeysFile = keysFile
	}
	if v, ok := os.LookupEnv(auth.EnvAPIKeys); ok {
		if err := cfg.Auth.AddKeys(v, auth.EnvAPIKeys); err != nil {
			return err
		}
	}
	return nil
}

// warnExposure logs a warning when the gateway listens beyond loopback
// without API keys, or with keys but without TLS.
func warnExposure(log *slog.Logger, listen string, g *gateway.Gateway) {
	if gateway.IsLoopbackListen(listen) {
		return
	}
	switch {
	case !g.AuthEnabled():
		log.Warn("listening on a non-loopback address without API keys: anyone who can reach it can use the engines "+
			"(set auth.keys_file or "+auth.EnvAPIKeys+")", "listen", listen)
	case !g.TLSEnabled():
		log.Warn("API keys are required but TLS is off: keys cross the network in clear text unless a TLS proxy fronts the gateway "+
			"(set tls.cert_file/tls.key_file or --tls-cert/--tls-key)", "listen", listen)
	}
}
