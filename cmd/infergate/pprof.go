package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/infergate/infergate/gateway"
)

// checkPprofAddr returns an error unless addr is empty or a loopback
// address (profiles expose memory contents and cost CPU, so they are never
// offered to the network); commands call it before starting anything.
func checkPprofAddr(addr string) error {
	if addr == "" {
		return nil
	}
	if err := gateway.CheckLoopback(addr); err != nil {
		return fmt.Errorf("--pprof: %w (profiling is served on loopback only)", err)
	}
	return nil
}

// startPprof serves the net/http/pprof handlers on addr, which must be a
// loopback address (checkPprofAddr). It returns a function that stops the
// server.
func startPprof(log *slog.Logger, addr string) (func(), error) {
	if err := checkPprofAddr(addr); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--pprof: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("pprof server stopped", "err", err)
		}
	}()
	log.Info("pprof listening", "addr", "http://"+ln.Addr().String()+"/debug/pprof/")
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, nil
}
