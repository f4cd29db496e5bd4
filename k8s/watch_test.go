package k8s

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"

	"github.com/infergate/infergate/internal/kubetest"
	"github.com/infergate/infergate/internal/polltest"
)

// reports collects a Watcher's OnChange calls.
type reports struct {
	mu   sync.Mutex
	all  [][]Target
	wake chan struct{}
}

func newReports() *reports { return &reports{wake: make(chan struct{}, 1)} }

func (r *reports) add(ts []Target) {
	r.mu.Lock()
	r.all = append(r.all, ts)
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// await waits (a minute at most: a generous bound, not a timing claim)
// until the latest report is want.
func (r *reports) await(t *testing.T, what string, want ...Target) {
	t.Helper()
	deadline := time.After(time.Minute)
	for {
		r.mu.Lock()
		var last []Target
		n := len(r.all)
		if n > 0 {
			last = r.all[n-1]
		}
		r.mu.Unlock()
		if n > 0 && slices.Equal(last, want) {
			return
		}
		select {
		case <-r.wake:
		case <-deadline:
			t.Fatalf("%s: the last of %d reports is %v, want %v", what, n, last, want)
		}
	}
}

// last is the last report made (nil before any).
func (r *reports) last() []Target {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.all) == 0 {
		return nil
	}
	return r.all[len(r.all)-1]
}

// count is how many reports were made.
func (r *reports) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.all)
}

// watch runs a watcher of src until the test ends.
func watch(t *testing.T, s *kubetest.Server, src Source) (*Watcher, *reports) {
	t.Helper()
	return watchAs(t, s.Config, src)
}

// watchAs runs a watcher of src with the client configuration cfg until
// the test ends.
func watchAs(t *testing.T, cfg *rest.Config, src Source) (*Watcher, *reports) {
	t.Helper()
	r := newReports()
	w, err := NewWatcher(cfg, src, Options{OnChange: r.add})
	if err != nil {
		t.Fatal(err)
	}
	if w.Synced() {
		t.Fatal("synced before Run")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != context.Canceled {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(time.Minute):
			t.Error("Run did not return within a minute of its context's end")
		}
	})
	return w, r
}

// TestWatch runs the watchers against a real kube-apiserver
// (internal/kubetest; skipped without scripts/kube.sh build).
func TestWatch(t *testing.T) {
	s := kubetest.Start(t, kubetest.Options{})
	s.InstallInferencePoolCRD(t)
	t.Run("InferencePool", func(t *testing.T) { testWatchPool(t, s) })
	t.Run("EndpointSlices", func(t *testing.T) { testWatchSlices(t, s) })
	t.Run("Errors", func(t *testing.T) { testWatchErrors(t, s) })
	// Last: it kills the API server and deletes the CRD.
	t.Run("Interrupted", func(t *testing.T) { testWatchInterrupted(t, s) })
}

func poolObject(ns, name string, selector map[string]string, ports ...int64) *unstructured.Unstructured {
	sel := map[string]any{}
	for k, v := range selector {
		sel[k] = v
	}
	var tp []any
	for _, p := range ports {
		tp = append(tp, map[string]any{"number": p})
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": name, "namespace": ns},
		"spec": map[string]any{"selector": map[string]any{"matchLabels": sel}, "targetPorts": tp,
			"endpointPickerRef": map[string]any{"name": "epp", "port": map[string]any{"number": int64(9002)}}},
	}}
}

func testWatchPool(t *testing.T, s *kubetest.Server) {
	ctx := context.Background()
	ns := s.Namespace(t, "pool")
	pools := s.Dynamic().Resource(InferencePoolGVR).Namespace(ns)
	pods := s.Clientset().CoreV1().Pods(ns)
	// Another pool in the namespace, which the watcher must not read.
	if _, err := pools.Create(ctx, poolObject(ns, "other", map[string]string{"app": "other"}, 9000), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := pools.Create(ctx, poolObject(ns, "llama", map[string]string{"app": "vllm"}, 8000, 8001), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w, r := watch(t, s, Source{Namespace: ns, InferencePool: "llama"})
	r.await(t, "synced, no pod")
	if !w.Synced() {
		t.Fatal("reported before synced")
	}
	vllm := map[string]string{"app": "vllm"}

	s.CreatePod(t, ns, "a", vllm, 8000, 8001)
	s.SetPodReady(t, ns, "a", "10.0.0.1", true)
	a0, a1 := Target{"10.0.0.1", 8000, "pod/a"}, Target{"10.0.0.1", 8001, "pod/a"}
	r.await(t, "a ready", a0, a1)

	patch := func(name, body string) {
		t.Helper()
		if _, err := pods.Patch(ctx, name, types.MergePatchType, []byte(body), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	patch("a", `{"metadata":{"annotations":{"`+ActivePortsAnnotation+`":"8001"}}}`)
	r.await(t, "a's active ports 8001", a1)
	s.SetPodReady(t, ns, "a", "10.0.0.1", false)
	r.await(t, "a not ready")
	s.SetPodReady(t, ns, "a", "10.0.0.1", true)
	r.await(t, "a ready again", a1)

	// A pod out of the selector, then the selector changed to it.
	s.CreatePod(t, ns, "b", map[string]string{"app": "other"}, 8000)
	s.SetPodReady(t, ns, "b", "10.0.0.2", true)
	u, err := pools.Get(ctx, "llama", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_ = unstructured.SetNestedStringMap(u.Object, map[string]string{"app": "other"}, "spec", "selector", "matchLabels")
	if _, err := pools.Update(ctx, u, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	b0, b1 := Target{"10.0.0.2", 8000, "pod/b"}, Target{"10.0.0.2", 8001, "pod/b"}
	r.await(t, "selector app=other", b0, b1)

	// A terminating pod (deletionTimestamp set, held by a finalizer) is
	// out at once.
	c := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "c", Labels: map[string]string{"app": "other"}, Finalizers: []string{"infergate.test/hold"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "engine", Image: "infergate.invalid/engine:none"}}}}
	if _, err := pods.Create(ctx, c, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	s.SetPodReady(t, ns, "c", "10.0.0.3", true)
	c0, c1 := Target{"10.0.0.3", 8000, "pod/c"}, Target{"10.0.0.3", 8001, "pod/c"}
	r.await(t, "c ready", b0, b1, c0, c1)
	if err := pods.Delete(ctx, "c", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := pods.Get(ctx, "c", metav1.GetOptions{})
	if err != nil || got.DeletionTimestamp == nil {
		t.Fatalf("c after delete: %v, deletionTimestamp %v", err, got.GetDeletionTimestamp())
	}
	r.await(t, "c terminating", b0, b1)
	patch("c", `{"metadata":{"finalizers":null}}`)

	// The pool's ports changed, the pool deleted and created again.
	u, err = pools.Get(ctx, "llama", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_ = unstructured.SetNestedSlice(u.Object, []any{map[string]any{"number": int64(8001)}}, "spec", "targetPorts")
	if _, err := pools.Update(ctx, u, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	r.await(t, "targetPorts [8001]", b1)
	if err := pools.Delete(ctx, "llama", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	r.await(t, "pool deleted")
	if _, err := pools.Create(ctx, poolObject(ns, "llama", map[string]string{"app": "other"}, 8000), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	r.await(t, "pool created again", b0)
	s.DeletePod(t, ns, "b")
	r.await(t, "b deleted")

	// A pod carrying 100 KiB of another tool's annotation is read as any
	// (the cache keeps the active-ports annotation alone); a ready pod
	// whose IP the pod API accepts but no engine can have (0.0.0.0 would
	// reach the gateway's own host) is left out and counted.
	s.CreatePod(t, ns, "d", map[string]string{"app": "other"}, 8000)
	patch("d", `{"metadata":{"annotations":{"example.com/blob":"`+strings.Repeat("x", 100<<10)+`"}}}`)
	s.SetPodReady(t, ns, "d", "10.0.0.4", true)
	r.await(t, "d ready", Target{"10.0.0.4", 8000, "pod/d"})
	s.CreatePod(t, ns, "e", map[string]string{"app": "other"}, 8000)
	s.SetPodReady(t, ns, "e", "0.0.0.0", true)
	s.DeletePod(t, ns, "d")
	r.await(t, "d deleted, e unspecified")
	if n := w.Stats().Skipped.Load(); n != 1 {
		t.Fatalf("skipped %d, want e", n)
	}
	s.DeletePod(t, ns, "e")
	// Every list reported was counted, and what came and went.
	if st := w.Stats(); st.Changes.Load() < 5 || st.Added.Load() == 0 || st.Removed.Load() == 0 || st.Engines.Load() != 0 ||
		st.LastChange.Load() == 0 || st.WatchErrors.Load() != 0 {
		t.Errorf("stats: changes %d added %d removed %d engines %d last %d watch errors %d", st.Changes.Load(), st.Added.Load(),
			st.Removed.Load(), st.Engines.Load(), st.LastChange.Load(), st.WatchErrors.Load())
	}
}

func testWatchSlices(t *testing.T, s *kubetest.Server) {
	ctx := context.Background()
	ns := s.Namespace(t, "svc")
	api := s.Clientset().DiscoveryV1().EndpointSlices(ns)
	http, metrics := "http", "metrics"
	p8000, p9000 := int32(8000), int32(9000)
	ep := func(ip string, ready, terminating bool) discoveryv1.Endpoint {
		return discoveryv1.Endpoint{Addresses: []string{ip},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready, Terminating: &terminating}}
	}
	slice := func(name, svc string, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
		return &discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports:       []discoveryv1.EndpointPort{{Name: &metrics, Port: &p9000}, {Name: &http, Port: &p8000}},
			Endpoints:   eps,
		}
	}
	if _, err := api.Create(ctx, slice("vllm-1", "vllm", ep("10.0.0.1", true, false), ep("10.0.0.2", false, false)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, r := watch(t, s, Source{Namespace: ns, Service: "vllm", Port: "http"})
	t1, t2, t3 := Target{"10.0.0.1", 8000, "10.0.0.1"}, Target{"10.0.0.2", 8000, "10.0.0.2"}, Target{"10.0.0.3", 8000, "10.0.0.3"}
	r.await(t, "synced", t1)
	update := func(sl *discoveryv1.EndpointSlice) {
		t.Helper()
		cur, err := api.Get(ctx, sl.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		sl.ResourceVersion = cur.ResourceVersion
		if _, err := api.Update(ctx, sl, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	update(slice("vllm-1", "vllm", ep("10.0.0.1", true, false), ep("10.0.0.2", true, false)))
	r.await(t, "10.0.0.2 ready", t1, t2)
	// Terminating: ready false and terminating true, as the EndpointSlice
	// controller writes it; and ready true with terminating true
	// (publishNotReadyAddresses).
	update(slice("vllm-1", "vllm", ep("10.0.0.1", false, true), ep("10.0.0.2", true, true)))
	r.await(t, "both terminating")
	// Another Service's slice is not read; a second slice of this one is.
	if _, err := api.Create(ctx, slice("other-1", "other", ep("10.0.0.9", true, false)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := api.Create(ctx, slice("vllm-2", "vllm", ep("10.0.0.3", true, false)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	r.await(t, "second slice", t3)
	if err := api.Delete(ctx, "vllm-2", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	r.await(t, "second slice deleted")
}

// testWatchErrors: a watcher of a pool that does not exist reports no
// engine; one without the CRD's resource (an API group the server does not
// serve) never syncs, and ends with its context.
func testWatchErrors(t *testing.T, s *kubetest.Server) {
	ns := s.Namespace(t, "err")
	_, r := watch(t, s, Source{Namespace: ns, InferencePool: "missing"})
	r.await(t, "missing pool")

	if _, err := NewWatcher(s.Config, Source{Namespace: ns}, Options{OnChange: func([]Target) {}}); err == nil {
		t.Fatal("a source without pool or service was accepted")
	}
	if _, err := NewWatcher(s.Config, Source{InferencePool: "p"}, Options{OnChange: func([]Target) {}}); err == nil {
		t.Fatal("a source without namespace was accepted")
	}
	// The watcher's requests are refused (a kubeconfig for another user
	// without rights): Run keeps retrying, never synced, until its context
	// ends.
	cfg := *s.Config
	cfg.Impersonate.UserName = "system:serviceaccount:" + ns + ":nobody"
	w, err := NewWatcher(&cfg, Source{Namespace: ns, Service: "vllm"}, Options{OnChange: func([]Target) { t.Error("reported without rights") }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := w.Run(ctx); err != context.DeadlineExceeded {
		t.Fatalf("Run without rights: %v", err)
	}
	if w.Synced() {
		t.Fatal("synced without rights")
	}
	if w.Stats().WatchErrors.Load() == 0 {
		t.Fatal("refused lists not counted as watch errors")
	}
}

// waitFor waits until cond holds (polltest.Until: a minute at most).
var waitFor = polltest.Until

// testWatchInterrupted: the API server killed mid-watch and started again,
// the watcher's RoleBinding removed and restored, the CRD deleted while
// watched, the pool created again with another selector. While a source
// cannot be read the last list is kept (no report, failures counted as
// watch errors); once it can, the watcher catches up.
func testWatchInterrupted(t *testing.T, s *kubetest.Server) {
	ctx := context.Background()
	ns := s.Namespace(t, "intr")
	pools := s.Dynamic().Resource(InferencePoolGVR).Namespace(ns)
	if _, err := pools.Create(ctx, poolObject(ns, "llama", map[string]string{"app": "vllm"}, 8000), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	vllm := map[string]string{"app": "vllm"}
	s.CreatePod(t, ns, "a", vllm, 8000)
	s.SetPodReady(t, ns, "a", "10.0.0.1", true)
	// A second watcher as a ServiceAccount with the chart's rights.
	user := "system:serviceaccount:" + ns + ":discovery"
	rbac := s.Clientset().RbacV1()
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "discovery"}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{InferencePoolGVR.Group}, Resources: []string{"inferencepools"}, Verbs: []string{"get", "list", "watch"}}}}
	binding := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "discovery"},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "discovery"}}
	if _, err := rbac.Roles(ns).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := rbac.RoleBindings(ns).Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cfg := rest.CopyConfig(s.Config)
	cfg.Impersonate.UserName = user
	src := Source{Namespace: ns, InferencePool: "llama"}
	w, r := watch(t, s, src)
	limited, rl := watchAs(t, cfg, src)
	a0, b0 := Target{"10.0.0.1", 8000, "pod/a"}, Target{"10.0.0.2", 8000, "pod/b"}
	r.await(t, "a ready", a0)
	rl.await(t, "a ready (ServiceAccount)", a0)

	// The binding removed (a watch already open goes on: a request is
	// authorized when it starts), then the API server killed: the lists
	// are kept, nothing reported while it is down.
	if err := rbac.RoleBindings(ns).Delete(ctx, "discovery", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	n, unreachable := r.count(), w.Stats().Unreachable.Load()
	if err := s.KillAPIServer(); err != nil {
		t.Fatal(err)
	}
	// client-go retries a refused watch without reporting it as failed:
	// the watcher's transport counts it.
	waitFor(t, "a request unanswered after the kill", func() bool { return w.Stats().Unreachable.Load() > unreachable })
	if r.count() != n || !w.Synced() {
		t.Fatalf("the API server down: %d reports after %d, synced %v", r.count(), n, w.Synced())
	}
	if err := s.StartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	refused := limited.Stats().WatchErrors.Load()
	s.CreatePod(t, ns, "b", vllm, 8000)
	s.SetPodReady(t, ns, "b", "10.0.0.2", true)
	r.await(t, "b ready after the restart", a0, b0)
	// The ServiceAccount's lists are refused now: its last list stays.
	waitFor(t, "a refused list after the restart", func() bool { return limited.Stats().WatchErrors.Load() > refused })
	rl.await(t, "the ServiceAccount's list kept", a0)
	binding.ResourceVersion = ""
	if _, err := rbac.RoleBindings(ns).Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rl.await(t, "b ready once the binding is back (ServiceAccount)", a0, b0)

	// The CRD deleted: the pool goes with it, and the pool's watch fails
	// until the CRD is back. Whether the engines go too depends on whether
	// the pool's reflector saw the pool's deletion before its watch ended:
	// one still in back-off from the restart above lists nothing but
	// errors, and a source that cannot be read keeps its last list. Either
	// is right; nothing else is.
	crds := s.Dynamic().Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	crd := InferencePoolGVR.Resource + "." + InferencePoolGVR.Group
	if err := crds.Delete(ctx, crd, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the CRD gone", func() bool {
		_, err := crds.Get(ctx, crd, metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	waitFor(t, "a failed watch of the missing CRD", func() bool { return w.Stats().WatchErrors.Load() > 0 })
	if last := r.last(); len(last) != 0 && !slices.Equal(last, []Target{a0, b0}) {
		t.Fatalf("the CRD deleted: the last report is %v, want none or the last list kept (%v)", last, []Target{a0, b0})
	}
	s.InstallInferencePoolCRD(t)
	s.CreatePod(t, ns, "c", map[string]string{"app": "x"}, 8000)
	s.SetPodReady(t, ns, "c", "10.0.0.3", true)
	if _, err := pools.Create(ctx, poolObject(ns, "llama", map[string]string{"app": "x"}, 8000), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	r.await(t, "the pool created again, selecting c", Target{"10.0.0.3", 8000, "pod/c"})
}
