package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/infergate/infergate/epp"
	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/openai"
)

// eppFlags are epp's flags: serve's (the same configuration), the epp
// section's, and GIE's EPP flag names as aliases.
type eppFlags struct {
	serveFlags
	extProc, health  string
	grpcPort         int
	grpcHealthPort   int
	poolName, poolNS string
	poolModel        string
	hooks            bool
	maxBuffered      int64
	maxStreams       int
}

// eppDefaultListen is epp's HTTP listener (metrics, /healthz, /readyz,
// dashboard): GIE's EPP metrics port.
const eppDefaultListen = ":9090"

func newEPPCmd() *cobra.Command {
	var fl eppFlags
	cmd := &cobra.Command{
		Use:   "epp",
		Short: "Run the scheduler as a Gateway API Inference Extension endpoint picker (Envoy ext_proc)",
		Long: `Run infergate's scheduler as the endpoint picker (EPP) of an Envoy-based gateway
(Envoy Gateway, Istio, kgateway, GKE) for an InferencePool: Envoy's ext_proc
filter sends each request's headers and body (FULL_DUPLEX_STREAMED) over gRPC;
the picker answers with the endpoint in the x-gateway-destination-endpoint
header and the envoy.lb dynamic metadata, and observes the answer for its
accounting (usage, TTFT, ITL, the prefix index, in-flight load). Envoy
proxies the request itself (ORIGINAL_DST cluster).

The configuration is serve's (-c: endpoints, routing, admission, pools, kv_events)
plus an epp section:

  epp:
    listen: ":9002"          # gRPC ext_proc (--grpc-port)
    health_listen: ":9003"   # gRPC health: "", liveness, readiness, the ext_proc service (--grpc-health-port)
    fallbacks: 0             # endpoints listed after the pick for Envoy's retries
  listen: ":9090"            # HTTP: /metrics, /healthz, /readyz, /dashboard

Answers Envoy forwards to the client: 413 for a body over max_body_bytes,
429 when admission sheds the request (queue full or timed out), 503 when no
endpoint (of the proxy's subset hint) is ready, 404 for an unknown model, 400
for an invalid body. See gateway/README.md "Endpoint picker".`,
		Example: `  infergate epp -c epp.yaml
  infergate epp --endpoint http://10.0.0.1:8000=llama --endpoint http://10.0.0.2:8000=llama --grpc-port 9002`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runEPP(cmd, &fl) },
	}
	f := cmd.Flags()
	fl.bind(f)
	if l := f.Lookup("listen"); l != nil {
		_ = l.Value.Set(eppDefaultListen)
		l.DefValue = eppDefaultListen
		l.Usage = "address of the HTTP listener: /metrics, /healthz, /readyz, /dashboard (overrides listen)"
	}
	f.StringVar(&fl.extProc, "ext-proc-listen", "", "address of the gRPC ext_proc service (overrides epp.listen; default "+gateway.DefaultEPPListen+")")
	f.StringVar(&fl.health, "health-listen", "", "address of the gRPC health service (overrides epp.health_listen; default "+gateway.DefaultEPPHealthListen+")")
	f.IntVar(&fl.grpcPort, "grpc-port", 0, "GIE alias: serve ext_proc on :PORT (epp.listen)")
	f.IntVar(&fl.grpcHealthPort, "grpc-health-port", 0, "GIE alias: serve gRPC health on :PORT (epp.health_listen)")
	f.StringVar(&fl.poolName, "pool-name", "", "GIE alias: the InferencePool whose ready pods are the endpoints (discovery.kubernetes.inference_pool)")
	f.StringVar(&fl.poolNS, "pool-namespace", "", "GIE alias: the InferencePool's namespace (discovery.kubernetes.namespace; default the kubeconfig's, in a pod its own)")
	f.StringVar(&fl.poolModel, "pool-model", "", "the model the pool's engines serve (discovery.kubernetes.endpoint.model), for --pool-name without a discovery section")
	f.BoolVar(&fl.hooks, "conformance-test-hooks", false, "Gateway API Inference Extension conformance hooks (test-epp-endpoint-selection, x-conformance-test-served-endpoint): test only")
	f.IntVar(&fl.maxStreams, "max-streams", epp.DefaultMaxStreams, "ext_proc streams (requests through the proxy) open at once over all its connections; past it a new stream ends with RESOURCE_EXHAUSTED (0: the default; negative: refused)")
	f.Int64Var(&fl.maxBuffered, "max-buffered-bytes", epp.DefaultMaxBufferedBytes, "request bytes (headers and bodies) all streams may hold at once; past it a request is answered 429 (0: the default; negative: refused)")
	return cmd
}

// options are the ext_proc server's options from the flags.
func (fl *eppFlags) options(reg prometheus.Registerer) epp.Options {
	return epp.Options{MaxBufferedBytes: fl.maxBuffered, MaxStreams: fl.maxStreams, Metrics: reg}
}

// config is the gateway configuration with the epp flags applied.
func (fl *eppFlags) config(cmd *cobra.Command) (gateway.Config, error) {
	if fl.configPath != "" && !cmd.Flags().Changed("listen") {
		// The file's listen, if it has one, wins over epp's default.
		fl.listen = ""
	}
	if fl.poolName != "" || fl.poolNS != "" || fl.poolModel != "" {
		fl.amend = fl.applyPool
	}
	cfg, err := fl.serveFlags.config(cmd)
	if err != nil {
		return cfg, err
	}
	if cfg.Listen == "" {
		cfg.Listen = eppDefaultListen
	}
	e := &cfg.EPP
	switch {
	case fl.extProc != "":
		e.Listen = fl.extProc
	case fl.grpcPort != 0:
		e.Listen = ":" + strconv.Itoa(fl.grpcPort)
	}
	switch {
	case fl.health != "":
		e.HealthListen = fl.health
	case fl.grpcHealthPort != 0:
		e.HealthListen = ":" + strconv.Itoa(fl.grpcHealthPort)
	}
	if fl.hooks {
		e.ConformanceTestHooks = true
	}
	*e = e.WithDefaults()
	return cfg, nil
}

// applyPool applies the --pool-* flags (GIE's EPP flags) to cfg's
// discovery.kubernetes, making it when the file has none.
func (fl *eppFlags) applyPool(cfg *gateway.Config) error {
	var k gateway.KubernetesDiscovery
	if cfg.Discovery.Kubernetes != nil {
		k = *cfg.Discovery.Kubernetes
	}
	switch {
	case fl.poolName != "":
		k.InferencePool, k.Service, k.Port = fl.poolName, "", ""
	case k.InferencePool == "":
		return errors.New("--pool-namespace and --pool-model go with --pool-name (or an inference_pool in the configuration's discovery.kubernetes)")
	}
	if fl.poolNS != "" {
		k.Namespace = fl.poolNS
	}
	if fl.poolModel != "" {
		k.Endpoint.Model = fl.poolModel
	}
	if k.Endpoint.Model == "" {
		return errors.New("--pool-name: the model the pool's engines serve is unknown: give --pool-model, or discovery.kubernetes.endpoint.model in -c")
	}
	cfg.Discovery.Kubernetes = &k
	return nil
}

// runEPP runs the picker until cmd's context ends (SIGINT, SIGTERM): the
// gateway (health checks, scrapes, KV-event feeds, SIGHUP reloads as
// serve), the ext_proc and health gRPC servers and the HTTP listener. At
// the signal the gateway drains (queued requests are answered 503), the
// streams in flight get shutdown_grace to end, then they are cut.
func runEPP(cmd *cobra.Command, fl *eppFlags) error {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	load := func() (gateway.Config, error) { return fl.config(cmd) }
	cfg, err := load()
	if err != nil {
		return err
	}
	if err := checkPprofAddr(fl.pprofAddr); err != nil {
		return err
	}
	// Before anything starts: epp.New would refuse them only after the
	// gateway had begun probing its engines.
	if err := fl.options(nil).Validate(); err != nil {
		return fmt.Errorf("--max-streams/--max-buffered-bytes: %w", err)
	}
	log, err := setupLogging(cmd, &cfg.Log)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	g, err := gateway.New(cmd.Context(), cfg, reg)
	if err != nil {
		return err
	}
	defer g.Close()
	stopScaler, err := serveExternalScaler(log, g) // autoscale.keda_listen, as serve
	if err != nil {
		return err
	}
	defer stopScaler()
	if cfg.Discovery.Kubernetes != nil {
		g.HoldReadiness("kubernetes discovery: starting")
	}
	srv, err := epp.New(g, cfg.EPP, fl.options(reg))
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.EPP.Listen)
	if err != nil {
		return fmt.Errorf("epp.listen %s: %w", cfg.EPP.Listen, err)
	}
	hln, err := net.Listen("tcp", cfg.EPP.HealthListen)
	if err != nil {
		ln.Close()
		return fmt.Errorf("epp.health_listen %s: %w", cfg.EPP.HealthListen, err)
	}
	gs := grpc.NewServer(
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: time.Minute, Timeout: 20 * time.Second}),
		grpc.MaxHeaderListSize(gateway.MaxGRPCHeaderBytes),
	)
	srv.Register(gs)
	// The health port's streams (Watch lives until its client leaves) are
	// bounded as the KEDA port's: metadata, streams per connection, and
	// Watch streams process-wide (epp.Health).
	hs := grpc.NewServer(grpc.MaxRecvMsgSize(64<<10), grpc.MaxConcurrentStreams(256), grpc.MaxHeaderListSize(gateway.MaxGRPCHeaderBytes))
	health := epp.NewHealth(g)
	health.Register(hs)

	ctx, stop := context.WithCancel(cmd.Context())
	defer stop()
	r := &reloader{g: g, log: log, load: load, static: cfg, reg: reg}
	stopDiscovery, err := r.startDiscovery(ctx, cfg)
	if err != nil {
		return err
	}
	defer stopDiscovery()
	go reloadOnHUP(ctx, log, hup, r)
	go health.Run(ctx, time.Second)
	served := make(chan struct{}, 2)
	go func() { _ = gs.Serve(ln); served <- struct{}{} }()
	go func() { _ = hs.Serve(hln); served <- struct{}{} }()
	// At the signal: the streams get the grace, then are cut.
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		<-ctx.Done()
		done := make(chan struct{})
		go func() { gs.GracefulStop(); close(done) }()
		select {
		case <-done:
		case <-time.After(g.Config().ShutdownGrace):
			gs.Stop()
			<-done
		}
		hs.Stop()
		<-served
		<-served
	}()
	if fl.pprofAddr != "" {
		stopPprof, err := startPprof(log, fl.pprofAddr)
		if err != nil {
			return err
		}
		defer stopPprof()
	}
	httpSrv := &http.Server{Handler: eppHTTP(g), BaseContext: g.BaseContext, ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout: 120 * time.Second, MaxHeaderBytes: 64 << 10}
	err = serveUntilDone(ctx, log, cfg.Listen, httpSrv, shutdown{grace: g.Config().ShutdownGrace, drain: g}, func(a net.Addr) {
		log.Info("epp listening", "ext_proc", ln.Addr().String(), "health", hln.Addr().String(), "http", "http://"+a.String(),
			"policy", g.Policy(), "endpoints", len(cfg.Endpoints))
	})
	stop()
	<-stopped
	return err
}

// eppHTTP serves the gateway's operational routes only (the OpenAI API
// goes through Envoy): /metrics, /healthz, /readyz, the dashboard.
func eppHTTP(g *gateway.Gateway) http.Handler {
	h := g.Handler()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/metrics", "/healthz", "/readyz", "/dashboard", "/dashboard/state.json":
			h.ServeHTTP(w, r)
			return
		}
		openai.WriteError(w, openai.NewError(http.StatusNotFound,
			fmt.Sprintf("Invalid URL (%s %s): the endpoint picker serves /metrics, /healthz, /readyz and /dashboard; requests go through the proxy.",
				r.Method, r.URL.Path), "", "not_found"))
	})
}
