package main

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/k8s"
	"github.com/prometheus/client_golang/prometheus"
)

// Kubernetes discovery for serve and epp (gateway README "Kubernetes
// discovery"): package k8s watches the configuration's
// discovery.kubernetes source and reports its engines; each change
// reloads the gateway with the static configuration (file and flags, as
// last applied) plus one endpoint per engine from the template. SIGHUP
// re-reads the file and keeps the discovered engines. Both kinds of reload
// go through reloader, one at a time, so neither undoes the other.

// discoveryRetry is how long after a refused discovery reload (an engine's
// probe failing the build, a kv_store over its slots) the reload is tried
// again with the latest engines.
const discoveryRetry = 5 * time.Second

// reloader applies the static configuration and the discovered engines
// together.
type reloader struct {
	g    *gateway.Gateway
	log  *slog.Logger
	load func() (gateway.Config, error) // the file, flags and environment
	reg  prometheus.Registerer          // discovery's metrics (nil: none)

	mu      sync.Mutex
	static  gateway.Config // as last applied
	targets []k8s.Target   // the latest discovered
	src     k8s.Source     // what is watched (from start)
	held    bool           // readiness held until the first discovered list is applied
	retry   *time.Timer
	closed  bool
}

// merged is static with the discovered endpoints appended (none without
// discovery). An engine static already lists for the template's model is
// not added twice.
func (r *reloader) merged(static gateway.Config) gateway.Config {
	k := static.Discovery.Kubernetes
	if k == nil || len(r.targets) == 0 {
		return static
	}
	listed := map[string]bool{}
	for _, e := range static.Endpoints {
		listed[strings.TrimRight(e.URL, "/")+"\x00"+e.Model] = true
	}
	var addrs []gateway.DiscoveredAddr
	for _, t := range r.targets {
		url := "http://" + t.HostPort()
		if !listed[url+"\x00"+k.Endpoint.Model] {
			addrs = append(addrs, gateway.DiscoveredAddr{IP: t.IP, Port: t.Port, From: t.Name})
		}
	}
	static.Endpoints = append(append([]gateway.EndpointConfig(nil), static.Endpoints...), k.Endpoints(addrs)...)
	return static
}

// hup re-reads the configuration (SIGHUP) and applies it with the
// discovered engines; the file's discovery source is the one watched
// since start (a change is logged, not applied).
func (r *reloader) hup() {
	r.mu.Lock()
	defer r.mu.Unlock()
	var loaded gateway.Config
	err := r.g.ReloadWith(func() (gateway.Config, error) {
		c, err := r.load()
		if err != nil {
			return c, err
		}
		loaded = c
		return r.merged(c), nil
	})
	if err != nil {
		return
	}
	r.static = loaded
	if k := loaded.Discovery.Kubernetes; (k == nil) != (r.src == k8s.Source{}) || (k != nil && !sameSource(r.src, *k)) {
		r.log.Warn("SIGHUP: discovery.kubernetes watches another source or kubeconfig than at start; a restart applies it "+
			"(its endpoint template is applied)", "watching", r.src)
	}
}

// sameSource reports whether k names the source watched (its namespace ""
// meaning the one resolved at start).
func sameSource(s k8s.Source, k gateway.KubernetesDiscovery) bool {
	return (k.Namespace == "" || k.Namespace == s.Namespace) && k.InferencePool == s.InferencePool && k.Service == s.Service && k.Port == s.Port
}

// discovered applies the engines discovery reports (k8s.Options.OnChange).
func (r *reloader) discovered(ts []k8s.Target) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.targets = ts
	r.apply()
}

// apply reloads with the static configuration and the latest engines (mu
// held); a refusal is retried after discoveryRetry. The first success
// releases readiness.
func (r *reloader) apply() {
	if r.closed {
		return
	}
	if r.retry != nil {
		r.retry.Stop()
		r.retry = nil
	}
	err := r.g.ReloadWith(func() (gateway.Config, error) { return r.merged(r.static), nil })
	if err != nil {
		r.log.Warn("kubernetes discovery: the discovered engines were not applied; retrying", "in", discoveryRetry, "err", err)
		r.retry = time.AfterFunc(discoveryRetry, func() {
			r.mu.Lock()
			defer r.mu.Unlock()
			r.apply()
		})
		return
	}
	if r.held {
		r.held = false
		r.g.ReleaseReadiness()
	}
}

// close stops the retries.
func (r *reloader) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	if r.retry != nil {
		r.retry.Stop()
	}
}

// startDiscovery starts watching cfg.Discovery.Kubernetes (nothing
// without it): readiness is held until the informers have synced and
// their engines are applied. kubeconfig ("") is --kubeconfig, over the
// configuration's. The returned stop ends the watch and waits for it.
func (r *reloader) startDiscovery(ctx context.Context, cfg gateway.Config) (stop func(), err error) {
	k := cfg.Discovery.Kubernetes
	if k == nil {
		return func() {}, nil
	}
	klog.SetSlogLogger(r.log.With("component", "client-go"))
	rc, ns, err := k8s.RESTConfig(k.Kubeconfig)
	if err != nil {
		return nil, err
	}
	if k.Namespace != "" {
		ns = k.Namespace
	}
	r.src = k8s.Source{Namespace: ns, InferencePool: k.InferencePool, Service: k.Service, Port: k.Port}
	w, err := k8s.NewWatcher(rc, r.src, k8s.Options{OnChange: r.discovered, Log: r.log})
	if err != nil {
		return nil, err
	}
	if err := registerDiscovery(r.reg, w); err != nil {
		return nil, err
	}
	what := "InferencePool " + ns + "/" + k.InferencePool
	if k.Service != "" {
		what = "Service " + ns + "/" + k.Service
	}
	r.mu.Lock()
	r.held = true
	r.mu.Unlock()
	r.g.HoldReadiness("kubernetes discovery: waiting for the informers of " + what + " at " + rc.Host + " to sync")
	r.log.Info("kubernetes discovery: watching", "source", what, "api_server", rc.Host, "model", k.Endpoint.Model)
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = w.Run(wctx)
	}()
	return func() {
		cancel()
		<-done
		r.close()
	}, nil
}

// registerDiscovery exports w's counters on reg (nothing when nil) as
// infergate_discovery_* (k8s/README.md "Metrics").
func registerDiscovery(reg prometheus.Registerer, w *k8s.Watcher) error {
	if reg == nil {
		return nil
	}
	st := w.Stats()
	counter := func(name, help string, f func() uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "infergate", Subsystem: "discovery", Name: name, Help: help},
			func() float64 { return float64(f()) })
	}
	gauge := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "infergate", Subsystem: "discovery", Name: name, Help: help}, f)
	}
	for _, c := range []prometheus.Collector{
		counter("engines_added_total", "Kubernetes discovery: engines (host:port) that appeared in the discovered list.", st.Added.Load),
		counter("engines_removed_total", "Kubernetes discovery: engines (host:port) that left the discovered list.", st.Removed.Load),
		counter("changes_total", "Kubernetes discovery: discovered lists applied (the first after the informers synced included).", st.Changes.Load),
		counter("watch_errors_total", "Kubernetes discovery: failed lists and watches of the informers, each retried by client-go with backoff (a restarted watch).", st.WatchErrors.Load),
		counter("api_unreachable_total", "Kubernetes discovery: requests to the API server that got no answer (connection refused or reset, TLS failure, timeout); client-go retries a refused watch without counting it in watch_errors_total.", st.Unreachable.Load),
		gauge("engines", "Kubernetes discovery: engines in the last discovered list.", func() float64 { return float64(st.Engines.Load()) }),
		gauge("skipped", "Kubernetes discovery: pods or EndpointSlice endpoints offered as engines but left out at the last recomputation (an address no engine can have, an active-ports annotation over 1 KiB; logged).",
			func() float64 { return float64(st.Skipped.Load()) }),
		gauge("synced", "Kubernetes discovery: 1 once the informers have synced (their first list), else 0.", func() float64 {
			if w.Synced() {
				return 1
			}
			return 0
		}),
		gauge("last_change_timestamp_seconds", "Kubernetes discovery: when the last discovered list was applied (Unix seconds; 0 before the first): time() minus it is the list's age.", func() float64 {
			return float64(st.LastChange.Load()) / 1e9
		}),
	} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("kubernetes discovery: register metrics: %w", err)
		}
	}
	return nil
}
