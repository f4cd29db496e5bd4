package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"

	"github.com/infergate/infergate/gateway"
	"github.com/infergate/infergate/internal/kubetest"
	"github.com/infergate/infergate/internal/polltest"
	"github.com/infergate/infergate/k8s"
	"github.com/infergate/infergate/simserver"
)

// discoveryCycles is how many times each end-to-end test adds and removes
// an engine through the API server (the figures' sample).
const discoveryCycles = 5

// TestKubernetesDiscoveryEndToEnd runs `infergate serve` and `infergate epp`
// as processes with --kubeconfig against a real kube-apiserver
// (internal/kubetest; skipped without scripts/kube.sh build) in front of
// simulated engines on loopback: engines written to the API server are
// routed to, engines taken out of it are drained, without a restart; the
// time from each API write to the change seen through the gateway is
// logged (go test -v).
func TestKubernetesDiscoveryEndToEnd(t *testing.T) {
	t.Parallel() // real processes, mostly waiting: run two at a time (the package took 649 s in sequence at load 12, past go test's 10-minute default)
	s := kubetest.Start(t, kubetest.Options{})
	s.InstallInferencePoolCRD(t)
	f, err := simserver.StartFleet(3, simserver.ServerConfig{Model: "m", TimeScale: 100})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ports := make([]int, len(f.URLs))
	for i, u := range f.URLs {
		_, p, _ := strings.Cut(strings.TrimPrefix(u, "http://"), ":")
		ports[i], _ = strconv.Atoi(p)
	}
	t.Run("epp", func(t *testing.T) { testDiscoveryEPP(t, s, ports) })
	t.Run("serve", func(t *testing.T) { testDiscoveryServe(t, s, f) })
}

// summary is durations as "min / median / max (n)".
func summary(ds []time.Duration) string {
	ds = slices.Clone(ds)
	slices.Sort(ds)
	r := func(d time.Duration) string { return d.Round(time.Millisecond).String() }
	return fmt.Sprintf("min %s, median %s, max %s (n=%d): %v", r(ds[0]), r(ds[len(ds)/2]), r(ds[len(ds)-1]), len(ds), ds)
}

// testDiscoveryEPP: the picker serves an InferencePool whose pods are the
// engines, all at 127.0.0.1, each on its own target port (the active-ports
// annotation says which). A pod made Ready is picked (the proxy's subset
// hint names it alone), a deleted one is not (503 for that subset).
func testDiscoveryEPP(t *testing.T, s *kubetest.Server, ports []int) {
	ctx := context.Background()
	ns := s.Namespace(t, "epp")
	var tp []any
	for _, p := range ports {
		tp = append(tp, map[string]any{"number": int64(p)})
	}
	pool := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": "llama", "namespace": ns},
		"spec": map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"app": "sim"}}, "targetPorts": tp,
			"endpointPickerRef": map[string]any{"name": "epp", "port": map[string]any{"number": int64(9002)}}},
	}}
	if _, err := s.Dynamic().Resource(k8s.InferencePoolGVR).Namespace(ns).Create(ctx, pool, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	labels := map[string]string{"app": "sim"}
	pods := s.Clientset().CoreV1().Pods(ns)
	addPod := func(name string, port int) {
		s.CreatePod(t, ns, name, labels, int32(port))
		if _, err := pods.Patch(ctx, name, types.MergePatchType,
			fmt.Appendf(nil, `{"metadata":{"annotations":{%q:"%d"}}}`, k8s.ActivePortsAnnotation, port), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	addPod("sim-0", ports[0])
	s.SetPodReady(t, ns, "sim-0", "127.0.0.1", true)

	cfg := filepath.Join(t.TempDir(), "epp.yaml")
	if err := os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nhealth_check_interval: 50ms\nrouting: {policy: cache-aware}\n"+
		"epp: {listen: \"127.0.0.1:0\", health_listen: \"127.0.0.1:0\"}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := start(t, "epp", "-c", cfg, "--kubeconfig", s.Kubeconfig, "--pool-name", "llama", "--pool-namespace", ns, "--pool-model", "m")
	line := p.await(t, regexp.MustCompile(`(epp listening.*)`))
	field := func(k string) string {
		m := regexp.MustCompile(k + `=(\S+)`).FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("no %s in %q", k, line)
		}
		return m[1]
	}
	conn, err := grpc.NewClient(field("ext_proc"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := extprocv3.NewExternalProcessorClient(conn)
	hc, err := grpc.NewClient(field("health"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer hc.Close()
	ready := func() bool {
		r, err := healthpb.NewHealthClient(hc).Check(ctx, &healthpb.HealthCheckRequest{Service: "readiness"})
		return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
	}
	waitUntil(t, "the picker's readiness after discovery synced", ready)

	body := []byte(`{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"discovered"}]}`)
	// picked reports whether a request whose subset hint is addr alone
	// is sent there (else the picker answers 503: not in rotation).
	picked := func(addr string) bool {
		dest, status := envoyLike(t, c, body, []string{addr})
		if dest == "" && string(status) != "503" {
			t.Fatalf("subset {%s}: %s", addr, status)
		}
		return dest == addr
	}
	first := "127.0.0.1:" + strconv.Itoa(ports[0])
	if !picked(first) {
		t.Fatal("the pod ready at start is not picked")
	}
	var in, out []time.Duration
	for i := range discoveryCycles {
		name := fmt.Sprintf("sim-%d-%d", 1+i%2, i)
		port := ports[1+i%2]
		addr := "127.0.0.1:" + strconv.Itoa(port)
		addPod(name, port)
		if picked(addr) {
			t.Fatalf("%s picked before its pod is ready", addr)
		}
		t0 := time.Now()
		s.SetPodReady(t, ns, name, "127.0.0.1", true)
		waitUntil(t, addr+" picked after its pod became ready", func() bool { return picked(addr) })
		in = append(in, time.Since(t0))

		t0 = time.Now()
		s.DeletePod(t, ns, name)
		waitUntil(t, addr+" out of rotation after its pod was deleted", func() bool { return !picked(addr) })
		out = append(out, time.Since(t0))
	}
	t.Logf("epp: pod made Ready (status write) -> first pick through the subset hint: %s", summary(in))
	t.Logf("epp: pod deleted (delete returned) -> out of rotation (503 for its subset): %s", summary(out))

	// SIGHUP re-reads the file and keeps the discovered engines.
	reloads := func() int {
		resp, err := http.Get(field("http") + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		m := regexp.MustCompile(`(?m)^infergate_config_reloads_total\{result="success"\} (\d+)`).FindSubmatch(b)
		if m == nil {
			t.Fatalf("no infergate_config_reloads_total{result=\"success\"} in /metrics")
		}
		n, _ := strconv.Atoi(string(m[1]))
		return n
	}
	before := reloads()
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the SIGHUP reload", func() bool { return reloads() > before })
	if !picked(first) || !ready() {
		t.Fatal("the discovered engine is gone after SIGHUP")
	}

	// Un-readied: the picker is not ready without engines.
	s.SetPodReady(t, ns, "sim-0", "127.0.0.1", false)
	waitUntil(t, "sim-0 out after it is not ready", func() bool { return !picked(first) })
	waitUntil(t, "the picker not ready without engines", func() bool { return !ready() })
	p.stop(t)
}

// testDiscoveryServe: the gateway serves a Service's EndpointSlices (one
// slice per engine, as each listens on its own port; the port named
// "http"). An engine whose slice is written is in rotation (/readyz) and
// answers requests, one whose slice is deleted leaves it.
func testDiscoveryServe(t *testing.T, s *kubetest.Server, f *simserver.Fleet) {
	ctx := context.Background()
	// EndpointSlices refuse loopback addresses: the engines are served
	// on the host's own address too.
	ip := hostIPv4(t)
	var ports []int
	for _, sv := range f.Servers {
		ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
		if err != nil {
			t.Fatal(err)
		}
		hs := &http.Server{Handler: sv.Handler(), ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = hs.Serve(ln) }()
		t.Cleanup(func() { _ = hs.Close() })
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	ns := s.Namespace(t, "serve")
	api := s.Clientset().DiscoveryV1().EndpointSlices(ns)
	name := "http"
	createSlice := func(slice string, port int) {
		t.Helper()
		p, ready := int32(port), true
		if _, err := api.Create(ctx, &discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: slice, Labels: map[string]string{discoveryv1.LabelServiceName: "sim"}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports:       []discoveryv1.EndpointPort{{Name: &name, Port: &p}},
			Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{ip}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}}},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	createSlice("sim-0", ports[0])
	cfg := filepath.Join(t.TempDir(), "serve.yaml")
	if err := os.WriteFile(cfg, fmt.Appendf(nil, "listen: 127.0.0.1:0\nhealth_check_interval: 50ms\nresponse_headers: {endpoint: true}\nrouting: {policy: round-robin}\n"+
		"discovery:\n  kubernetes:\n    namespace: %s\n    service: sim\n    port: http\n    kubeconfig: %s\n    endpoint: {model: m, kind: sim}\n",
		ns, s.Kubeconfig), 0o600); err != nil {
		t.Fatal(err)
	}
	p := start(t, "serve", "-c", cfg)
	url := p.await(t, regexp.MustCompile(`gateway listening.*addr=(\S+)`))
	type readiness struct {
		Ready     int `json:"ready_endpoints"`
		Endpoints int `json:"endpoints"`
	}
	readyz := func() (int, readiness) {
		resp, err := http.Get(url + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var rd readiness
		_ = json.NewDecoder(resp.Body).Decode(&rd)
		return resp.StatusCode, rd
	}
	waitUntil(t, "/readyz 200 after discovery synced", func() bool { code, _ := readyz(); return code == http.StatusOK })
	var in, out []time.Duration
	for i := range discoveryCycles {
		slice := fmt.Sprintf("sim-%d-%d", 1+i%2, i)
		port := ports[1+i%2]
		t0 := time.Now()
		createSlice(slice, port)
		waitUntil(t, slice+" in rotation", func() bool { _, rd := readyz(); return rd.Ready == 2 })
		in = append(in, time.Since(t0))
		// It is served: round-robin sends it every other request.
		want := "http://" + net.JoinHostPort(ip, strconv.Itoa(port))
		waitUntil(t, "a request answered by "+want, func() bool {
			req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(
				fmt.Sprintf(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"%d"}]}`, time.Now().UnixNano())))
			req.Header.Set("Content-Type", "application/json")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			return resp.StatusCode == http.StatusOK && resp.Header.Get("X-Infergate-Endpoint") == want
		})
		t0 = time.Now()
		if err := api.Delete(ctx, slice, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, slice+" out of rotation", func() bool { _, rd := readyz(); return rd.Endpoints == 1 })
		out = append(out, time.Since(t0))
	}
	t.Logf("serve: EndpointSlice created (create returned) -> in rotation (/readyz): %s", summary(in))
	t.Logf("serve: EndpointSlice deleted (delete returned) -> out of rotation (/readyz): %s", summary(out))
	p.stop(t)
}

// TestDiscoveryNotReadyUntilSynced: serve with discovery whose API server
// does not answer starts, serves, and reports not ready with the reason;
// the discovered model answers 503, not 404.
func TestDiscoveryNotReadyUntilSynced(t *testing.T) {
	dir := t.TempDir()
	kc := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kc, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: none}}]
contexts: [{name: x, context: {cluster: c, user: u, namespace: llm}}]
current-context: x
`), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "serve.yaml")
	if err := os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\ndiscovery: {kubernetes: {service: vllm, endpoint: {model: m}}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startEnv(t, []string{"KUBECONFIG=" + kc}, "serve", "-c", cfg)
	url := p.await(t, regexp.MustCompile(`gateway listening.*addr=(\S+)`))
	resp, err := http.Get(url + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(b), "waiting for the informers of Service llm/vllm") {
		t.Fatalf("/readyz before sync: %d %s", resp.StatusCode, b)
	}
	if code, _ := postJSON(t, url+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`); code != http.StatusServiceUnavailable {
		t.Fatalf("the discovered model before sync: %d, want 503", code)
	}
	p.stop(t)
}

// hostIPv4 is a non-loopback IPv4 address of this host (the test skips
// without one).
func hostIPv4(t *testing.T) string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && n.IP.IsGlobalUnicast() {
			return n.IP.String()
		}
	}
	t.Skip("skipping: no non-loopback IPv4 address on this host, and EndpointSlices refuse loopback addresses")
	return ""
}

// waitUntil waits until cond holds (polltest.Until: a minute at most).
var waitUntil = polltest.Until

// TestReloaderMerged: the discovered engines are appended to the static
// endpoints from the template, an engine the file lists already for the
// template's model is not added twice, and without discovery nothing is
// added.
func TestReloaderMerged(t *testing.T) {
	static := gateway.Config{Endpoints: []gateway.EndpointConfig{{URL: "http://127.0.0.1:8001/", Model: "m"}}}
	r := &reloader{targets: []k8s.Target{{IP: "127.0.0.1", Port: 8001, Name: "pod/a"}, {IP: "10.0.0.2", Port: 8000, Name: "pod/b"}}}
	if got := r.merged(static); len(got.Endpoints) != 1 {
		t.Fatalf("without discovery: %+v", got.Endpoints)
	}
	static.Discovery.Kubernetes = &gateway.KubernetesDiscovery{Service: "s", Endpoint: gateway.EndpointConfig{Model: "m", Kind: "sim"}}
	got := r.merged(static)
	if len(got.Endpoints) != 2 || got.Endpoints[1].URL != "http://10.0.0.2:8000" || got.Endpoints[1].Kind != "sim" {
		t.Fatalf("merged: %+v", got.Endpoints)
	}
	if len(static.Endpoints) != 1 {
		t.Fatal("merged changed the static configuration")
	}
}
