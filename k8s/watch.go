package k8s

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// Source is what a Watcher watches: one InferencePool or one Service, in
// Namespace (gateway.KubernetesDiscovery's fields of the same names).
type Source struct {
	Namespace     string
	InferencePool string
	Service       string
	// Port selects the Service's port (SliceTargets); Service only.
	Port string
}

// Defaults of Options.
const (
	// DefaultQuiet is how long a Watcher waits after an event for the
	// next before recomputing the targets: the pod updates of one rollout
	// step (a pod's Ready condition, its deletion, its replacement's IP)
	// arrive within tens of milliseconds of each other and are applied
	// as one reload.
	DefaultQuiet = 100 * time.Millisecond
	// DefaultMaxDelay bounds the wait a stream of events imposes: the
	// targets are recomputed at most this long after the first event of
	// a burst (part of the 2 s from an API write to routing).
	DefaultMaxDelay = 250 * time.Millisecond
)

// Options tune a Watcher.
type Options struct {
	// OnChange is called with the targets once the informers have
	// synced, then at every change of them (never concurrently, from
	// Run's goroutine; Run waits for it).
	OnChange func([]Target)
	// Quiet and MaxDelay debounce events (0: DefaultQuiet,
	// DefaultMaxDelay).
	Quiet, MaxDelay time.Duration
	// Log receives the watcher's warnings and changes (nil:
	// slog.Default()).
	Log *slog.Logger
}

// Watcher watches a Source with client-go informers and reports its
// targets (Options.OnChange). An InferencePool source watches the pool
// (dynamic informer, field selector metadata.name) and every pod of its
// namespace (the selector may change; GIE's EPP does the same,
// pkg/lwepp/controller/pod_reconciler.go@ae2846ed), a Service source its
// EndpointSlices (label kubernetes.io/service-name). A missing pool or
// Service has no targets.
type Watcher struct {
	src    Source
	opt    Options
	log    *slog.Logger
	kick   chan struct{}
	synced atomic.Bool
	start  func(stop <-chan struct{})
	// shutdown waits for the informers' goroutines, once their stop
	// channel is closed.
	shutdown func()
	has      []cache.InformerSynced
	// targets computes the targets from the informers' stores, and what
	// it left out.
	targets func() ([]Target, Skipped, error)
	stats   Stats
	// lastUnreachableLog is when unanswered last logged (Unix ns).
	lastUnreachableLog atomic.Int64
}

// Stats are a Watcher's counters, for metrics (cmd/infergate exports them
// as infergate_discovery_*; k8s/README.md "Metrics"). Safe for concurrent
// reads.
type Stats struct {
	// Added and Removed count the engines (host:port) that appeared in and
	// left the lists reported; Changes counts the lists reported
	// (OnChange calls, the first included).
	Added, Removed, Changes atomic.Uint64
	// WatchErrors counts the informers' failed lists and watches, each
	// retried by client-go's reflector with backoff: a restarted watch.
	WatchErrors atomic.Uint64
	// Unreachable counts the watcher's requests to the API server that
	// got no answer (connection refused or reset, TLS failure, timeout),
	// its own cancellations aside. client-go's reflector retries a watch
	// whose connection is refused without reporting it (WatchErrors stays
	// flat while the API server is down): this counts those.
	Unreachable atomic.Uint64
	// Engines is the number of engines of the last list reported.
	Engines atomic.Int64
	// Skipped is the number of pods or endpoints the last recomputation
	// left out although offered as engines (Skipped: an address that
	// cannot be an engine's, an active-ports annotation over 1 KiB).
	Skipped atomic.Int64
	// LastChange is when the last list was reported (Unix ns; 0 before
	// the first).
	LastChange atomic.Int64
}

// Stats returns w's counters.
func (w *Watcher) Stats() *Stats { return &w.stats }

// count records in st the list t reported after last (the engines, by
// host:port, that appeared and left), at now.
func (st *Stats) count(last, t []Target, now time.Time) {
	before := make(map[string]struct{}, len(last))
	for _, x := range last {
		before[x.HostPort()] = struct{}{}
	}
	after := make(map[string]struct{}, len(t))
	for _, x := range t {
		after[x.HostPort()] = struct{}{}
		if _, ok := before[x.HostPort()]; !ok {
			before[x.HostPort()] = struct{}{} // a duplicate counts once
			st.Added.Add(1)
		}
	}
	st.Engines.Store(int64(len(after)))
	for _, x := range last {
		if _, ok := after[x.HostPort()]; !ok {
			after[x.HostPort()] = struct{}{} // a duplicate counts once
			st.Removed.Add(1)
		}
	}
	st.Changes.Add(1)
	st.LastChange.Store(now.UnixNano())
}

// RESTConfig returns the client configuration of kubeconfig: that file
// when set, else $KUBECONFIG's files, else ~/.kube/config, else the pod's
// service account (in-cluster); and the namespace of its current context
// (in a pod: the pod's, from the service account), "default" when none
// says.
func RESTConfig(kubeconfig string) (*rest.Config, string, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{})
	cfg, err := cc.ClientConfig()
	if err != nil {
		return nil, "", fmt.Errorf("kubernetes client configuration (--kubeconfig, $KUBECONFIG, ~/.kube/config or in-cluster): %w", err)
	}
	ns, _, err := cc.Namespace()
	if err != nil || ns == "" {
		ns = metav1.NamespaceDefault
	}
	return cfg, ns, nil
}

// NewWatcher returns a watcher of src through the API server of cfg.
// Nothing is contacted before Run.
func NewWatcher(cfg *rest.Config, src Source, opt Options) (*Watcher, error) {
	switch {
	case src.Namespace == "":
		return nil, errors.New("k8s: no namespace")
	case (src.InferencePool == "") == (src.Service == ""):
		return nil, errors.New("k8s: want one of an InferencePool and a Service")
	case opt.OnChange == nil:
		return nil, errors.New("k8s: no OnChange")
	}
	if opt.Quiet <= 0 {
		opt.Quiet = DefaultQuiet
	}
	if opt.MaxDelay <= 0 {
		opt.MaxDelay = DefaultMaxDelay
	}
	w := &Watcher{src: src, opt: opt, log: opt.Log, kick: make(chan struct{}, 1)}
	if w.log == nil {
		w.log = slog.Default()
	}
	cfg = rest.CopyConfig(cfg)
	cfg.UserAgent = "infergate-discovery"
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { return &unanswered{next: rt, w: w} })
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("k8s: %w", err)
	}
	handler := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { w.poke() },
		UpdateFunc: func(any, any) { w.poke() },
		DeleteFunc: func(any) { w.poke() },
	}
	if src.Service != "" {
		f := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithNamespace(src.Namespace),
			informers.WithTweakListOptions(func(o *metav1.ListOptions) {
				o.LabelSelector = discoveryv1.LabelServiceName + "=" + src.Service
			}))
		inf := f.Discovery().V1().EndpointSlices().Informer()
		if err := inf.SetTransform(slimSlice); err != nil {
			return nil, fmt.Errorf("k8s: %w", err)
		}
		if err := w.setup(inf, handler, "EndpointSlices of Service "+src.Namespace+"/"+src.Service); err != nil {
			return nil, err
		}
		w.start, w.shutdown = f.Start, f.Shutdown
		w.targets = func() ([]Target, Skipped, error) {
			var eps []*discoveryv1.EndpointSlice
			for _, o := range inf.GetStore().List() {
				if s, ok := o.(*discoveryv1.EndpointSlice); ok {
					eps = append(eps, s)
				}
			}
			return SliceTargets(eps, src.Port)
		}
		return w, nil
	}

	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("k8s: %w", err)
	}
	pf := dynamicinformer.NewFilteredDynamicSharedInformerFactory(dyn, 0, src.Namespace, func(o *metav1.ListOptions) {
		o.FieldSelector = "metadata.name=" + src.InferencePool
	})
	poolInf := pf.ForResource(InferencePoolGVR).Informer()
	if err := w.setup(poolInf, handler, "InferencePool "+src.Namespace+"/"+src.InferencePool); err != nil {
		return nil, err
	}
	f := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithNamespace(src.Namespace),
		informers.WithTransform(slimPod))
	podInf := f.Core().V1().Pods().Informer()
	if err := w.setup(podInf, handler, "pods of namespace "+src.Namespace); err != nil {
		return nil, err
	}
	w.start = func(stop <-chan struct{}) { pf.Start(stop); f.Start(stop) }
	w.shutdown = func() { pf.Shutdown(); f.Shutdown() }
	w.targets = func() ([]Target, Skipped, error) {
		var pool *unstructured.Unstructured
		for _, o := range poolInf.GetStore().List() {
			if u, ok := o.(*unstructured.Unstructured); ok && u.GetName() == src.InferencePool {
				pool = u
			}
		}
		if pool == nil {
			return nil, Skipped{}, fmt.Errorf("InferencePool %s/%s: not found", src.Namespace, src.InferencePool)
		}
		p, err := ParsePool(pool)
		if err != nil {
			return nil, Skipped{}, err
		}
		var pods []*corev1.Pod
		for _, o := range podInf.GetStore().List() {
			if pod, ok := o.(*corev1.Pod); ok {
				pods = append(pods, pod)
			}
		}
		t, skipped := PoolTargets(p, pods)
		return t, skipped, nil
	}
	return w, nil
}

// setup registers the event handler on inf and a watch-error handler that
// says what failed (a missing CRD, a Role without list/watch).
func (w *Watcher) setup(inf cache.SharedIndexInformer, h cache.ResourceEventHandler, what string) error {
	reg, err := inf.AddEventHandler(h)
	if err != nil {
		return fmt.Errorf("k8s: %s: %w", what, err)
	}
	w.has = append(w.has, reg.HasSynced)
	return inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		w.stats.WatchErrors.Add(1)
		w.log.Warn("kubernetes discovery: list/watch failed; retrying", "watch", what, "err", err)
	})
}

// unanswered counts (Stats.Unreachable) and logs, at most every
// unsyncedWarning, the requests of a Watcher that got no answer from the
// API server.
type unanswered struct {
	next http.RoundTripper
	w    *Watcher
}

func (u *unanswered) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := u.next.RoundTrip(req)
	if err != nil && req.Context().Err() == nil {
		u.w.stats.Unreachable.Add(1)
		now := time.Now().UnixNano()
		if last := u.w.lastUnreachableLog.Load(); now-last >= int64(unsyncedWarning) && u.w.lastUnreachableLog.CompareAndSwap(last, now) {
			u.w.log.Warn("kubernetes discovery: the API server did not answer; client-go retries (the engines last listed stay)",
				"source", u.w.src, "err", err)
		}
	}
	return resp, err
}

// WrappedRoundTripper returns the wrapped transport (client-go's
// utilnet.RoundTripperWrapper).
func (u *unanswered) WrappedRoundTripper() http.RoundTripper { return u.next }

// poke tells Run that something changed (never blocks).
func (w *Watcher) poke() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// Synced reports whether the informers have synced (the first OnChange
// follows).
func (w *Watcher) Synced() bool { return w.synced.Load() }

// Run starts the informers and reports the targets until ctx ends: once
// every informer has synced (its first list), then after each burst of
// events (debounced: Options.Quiet after the last, at most
// Options.MaxDelay after the first) whose targets differ from the last
// reported. It returns ctx's error, having stopped the informers and
// waited for their goroutines. Run once.
func (w *Watcher) Run(ctx context.Context) error {
	w.start(ctx.Done())
	defer w.shutdown()
	if err := w.waitSynced(ctx); err != nil {
		return err
	}
	w.synced.Store(true)
	var last []Target
	var lastSkipped []string
	first, lastErr := true, ""
	for {
		t, skipped, err := w.targets()
		w.stats.Skipped.Store(int64(skipped.N))
		// Skipped pods are logged when the first of them change, not at
		// every event (their count is a gauge).
		if !slices.Equal(skipped.Examples, lastSkipped) {
			if skipped.N > 0 {
				w.log.Warn("kubernetes discovery: offered as engines but left out", "count", skipped.N, "first", skipped.Examples)
			}
			lastSkipped = skipped.Examples
		}
		// An error is logged when it appears or changes, not at every
		// event of a busy namespace.
		switch {
		case err != nil && err.Error() != lastErr:
			w.log.Warn("kubernetes discovery: the source is missing or invalid (engines: what could be read)", "err", err)
			lastErr = err.Error()
		case err == nil:
			lastErr = ""
		}
		if first || !slices.Equal(t, last) {
			w.log.Info("kubernetes discovery: engines", "count", len(t), "engines", names(t))
			w.stats.count(last, t, time.Now())
			w.opt.OnChange(slices.Clone(t))
			last, first = t, false
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-w.kick:
		}
		if err := w.settle(ctx); err != nil {
			return err
		}
	}
}

// unsyncedWarning is the period of the warning that the informers have
// not synced (the API server unreachable, the Role without list/watch,
// the CRD not installed: client-go retries at its debug log level).
const unsyncedWarning = 10 * time.Second

// waitSynced waits until every informer has synced or ctx ends, warning
// every unsyncedWarning.
func (w *Watcher) waitSynced(ctx context.Context) error {
	poll := time.NewTicker(50 * time.Millisecond)
	defer poll.Stop()
	start := time.Now()
	next := start.Add(unsyncedWarning)
	for {
		synced := true
		for _, has := range w.has {
			synced = synced && has()
		}
		if synced {
			return nil
		}
		if now := time.Now(); now.After(next) {
			w.log.Warn("kubernetes discovery: not synced yet (is the API server reachable, the InferencePool CRD installed, "+
				"the Role granting get/list/watch?); retrying", "source", w.src, "waiting", now.Sub(start).Round(time.Second))
			next = now.Add(unsyncedWarning)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-poll.C:
		}
	}
}

// settle waits until no event came for Quiet, or MaxDelay has passed.
func (w *Watcher) settle(ctx context.Context) error {
	quiet := time.NewTimer(w.opt.Quiet)
	defer quiet.Stop()
	deadline := time.NewTimer(w.opt.MaxDelay)
	defer deadline.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-w.kick:
			quiet.Reset(w.opt.Quiet)
		case <-quiet.C:
			return nil
		case <-deadline.C:
			return nil
		}
	}
}

// names lists targets as name=host:port for a log line (at most 16).
func names(ts []Target) []string {
	out := make([]string, 0, min(len(ts), 16))
	for i, t := range ts {
		if i == 16 {
			out = append(out, fmt.Sprintf("… %d more", len(ts)-16))
			break
		}
		out = append(out, t.Name+"="+t.HostPort())
	}
	return out
}
