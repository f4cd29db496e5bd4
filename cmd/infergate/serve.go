package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/sched"
)

// shutdownGrace is how long in-flight requests get to finish after SIGINT or
// SIGTERM before their connections are closed.
const shutdownGrace = 10 * time.Second

// listenAndServe serves h on addr until ctx is cancelled, then shuts down
// gracefully. ready, if not nil, is called with the bound address once the
// listener is open (so ":0" works).
func listenAndServe(ctx context.Context, log *slog.Logger, addr string, h http.Handler, ready func(net.Addr)) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", addr, err)
	}
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	if ready != nil {
		ready(ln.Addr())
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down", "grace", shutdownGrace)
	sctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func newServeCmd() *cobra.Command {
	var (
		configPath string
		listen     string
		policy     string
		endpoints  []string
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the gateway in front of real engines",
		Long: `Run the gateway in front of OpenAI-compatible engines (vLLM, SGLang, llama.cpp,
Ollama, TGI, or 'infergate sim'). Endpoints come from a YAML config (-c) and/or
--endpoint flags; flags override the file's listen address and policy.

Config example:

  listen: 127.0.0.1:8080
  routing:
    policy: cache-aware       # cache-aware | precise-prefix | prefix | power-of-two | least-request | round-robin | random
  endpoints:
    - {url: http://10.0.0.1:8000, model: meta-llama/Llama-3.1-70B-Instruct}
    - {url: http://10.0.0.2:8000, model: meta-llama/Llama-3.1-70B-Instruct, kv_blocks: 28000}

Every key (timeouts, health checks, body limits, prefix tuning), the metrics
and the error codes are listed in gateway/README.md.`,
		Example: `  infergate serve -c gateway.yaml
  infergate serve --endpoint http://127.0.0.1:8001=my-model --endpoint http://127.0.0.1:8002=my-model --policy cache-aware`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var cfg gateway.Config
			if configPath != "" {
				c, err := gateway.LoadConfig(configPath)
				if err != nil {
					return err
				}
				cfg = c
			}
			if cmd.Flags().Changed("listen") || cfg.Listen == "" {
				cfg.Listen = listen
			}
			if cmd.Flags().Changed("policy") {
				cfg.Routing.Policy = policy
			}
			for _, e := range endpoints {
				url, model, ok := strings.Cut(e, "=")
				if !ok || url == "" || model == "" {
					return fmt.Errorf("--endpoint %q: want URL=MODEL", e)
				}
				cfg.Endpoints = append(cfg.Endpoints, gateway.EndpointConfig{URL: url, Model: model})
			}
			if len(cfg.Endpoints) == 0 {
				return errors.New("no endpoints: give -c config.yaml or --endpoint URL=MODEL")
			}
			log := newLogger(cmd)
			g, err := gateway.New(cfg, nil)
			if err != nil {
				return err
			}
			defer g.Close()
			return listenAndServe(cmd.Context(), log, cfg.Listen, g.Handler(), func(a net.Addr) {
				log.Info("gateway listening", "addr", "http://"+a.String(), "policy", cfg.Routing.Policy, "endpoints", len(cfg.Endpoints))
			})
		},
	}
	f := cmd.Flags()
	f.StringVarP(&configPath, "config", "c", "", "YAML config file")
	f.StringVar(&listen, "listen", "127.0.0.1:8080", "address to serve the OpenAI API on")
	f.StringVar(&policy, "policy", "", "routing policy (default: precise-prefix when every endpoint has kv_events, else cache-aware): "+strings.Join(sched.Names(), ", "))
	f.StringArrayVar(&endpoints, "endpoint", nil, "engine endpoint as URL=MODEL (repeatable)")
	return cmd
}
