package gateway

import (
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/infergate/infergate/fleet"
	"github.com/infergate/infergate/kvevents"
	"github.com/infergate/infergate/simserver"
)

// TestDiscoveryConfigHelm reads the discovery section as the Helm chart
// renders it (deploy/helm/infergate, "infergate.config") and fills the
// template for an address.
func TestDiscoveryConfigHelm(t *testing.T) {
	dir := t.TempDir()
	for name, body := range map[string]string{
		"pool.yaml": `listen: ":9090"
epp: {listen: ":9002", health_listen: ":9003"}
discovery:
  kubernetes:
    namespace: llm
    inference_pool: llama-infergate
    endpoint:
      model: meta-llama/Llama-3.1-8B-Instruct
      kind: vllm
      kv_events:
        endpoint: "tcp://{ip}:5557"
        replay_endpoint: "tcp://{ip}:5558"
routing: {policy: precise-prefix}
`,
		"service.yaml": `listen: 0.0.0.0:8080
discovery:
  kubernetes:
    namespace: llm
    service: vllm-llama
    port: 8000
    endpoint: {model: m, metrics_url: "http://{ip}:9000/metrics/{port}"}
`,
	} {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		c, err := LoadConfig(path)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := c.WithDefaults().Validate(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		k := c.Discovery.Kubernetes
		eps := k.Endpoints([]DiscoveredAddr{{IP: "10.1.2.3", Port: 8000}, {IP: "fd00::7", Port: 8001}})
		switch name {
		case "pool.yaml":
			if k.InferencePool != "llama-infergate" || k.Namespace != "llm" {
				t.Fatalf("pool: %+v", k)
			}
			if eps[0].URL != "http://10.1.2.3:8000" || eps[0].KVEvents.Endpoint != "tcp://10.1.2.3:5557" ||
				eps[0].KVEvents.ReplayEndpoint != "tcp://10.1.2.3:5558" || eps[0].Model != "meta-llama/Llama-3.1-8B-Instruct" {
				t.Fatalf("pool endpoint: %+v %+v", eps[0], eps[0].KVEvents)
			}
			if eps[1].URL != "http://[fd00::7]:8001" {
				t.Fatalf("IPv6 url %q", eps[1].URL)
			}
			if k.Endpoint.KVEvents.Endpoint != "tcp://{ip}:5557" {
				t.Fatal("the template was changed in place")
			}
		case "service.yaml":
			if k.Service != "vllm-llama" || k.Port != "8000" {
				t.Fatalf("service: %+v", k)
			}
			if eps[0].MetricsURL != "http://10.1.2.3:9000/metrics/8000" {
				t.Fatalf("metrics_url %q", eps[0].MetricsURL)
			}
		}
	}
}

// TestDiscoveryConfigInvalid: what discovery.kubernetes refuses.
func TestDiscoveryConfigInvalid(t *testing.T) {
	for _, tc := range []struct {
		k    KubernetesDiscovery
		want string
	}{
		{KubernetesDiscovery{Endpoint: EndpointConfig{Model: "m"}}, "want one of inference_pool and service"},
		{KubernetesDiscovery{InferencePool: "p", Service: "s", Endpoint: EndpointConfig{Model: "m"}}, "want one of"},
		{KubernetesDiscovery{InferencePool: "p", Port: "http", Endpoint: EndpointConfig{Model: "m"}}, "for a service only"},
		{KubernetesDiscovery{Service: "s", Port: "70000", Endpoint: EndpointConfig{Model: "m"}}, "want 1 to 65535"},
		{KubernetesDiscovery{Service: "s", Endpoint: EndpointConfig{Model: "m", URL: "http://x:1"}}, "leave it out"},
		{KubernetesDiscovery{Service: "s"}, "endpoint.model: required"},
		{KubernetesDiscovery{Service: "s", Endpoint: EndpointConfig{Model: "m", Kind: "nope"}}, "endpoint.kind"},
		{KubernetesDiscovery{Service: "s", Endpoint: EndpointConfig{Model: "m",
			KVEvents: &KVEventsConfig{Endpoint: "{ip}:5557"}}}, "want tcp://host:port"},
	} {
		c := Config{Discovery: DiscoveryConfig{Kubernetes: &tc.k}}.WithDefaults()
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: got %v, want %q", tc.k, err, tc.want)
		}
	}
	// Without discovery an empty endpoint list is still refused.
	if err := (Config{}).WithDefaults().Validate(); err == nil || !strings.Contains(err.Error(), "at least one endpoint") {
		t.Errorf("no endpoints: %v", err)
	}
}

// TestDiscoveryEmptyPool: with discovery and no engine discovered the
// gateway starts, its model is known (503, not 404; an alias and a
// kv_store may name it), readiness is held until released; the reload that
// brings the discovered engines routes to them, the one that takes them
// away drains them and leaves the empty pool.
func TestDiscoveryEmptyPool(t *testing.T) {
	a := newFakeEngine(t, "a")
	cfg := testConfig("cache-aware")
	cfg.Discovery.Kubernetes = &KubernetesDiscovery{Service: "s", Endpoint: EndpointConfig{Model: "m", KVBlocks: 1000}}
	cfg.Aliases = map[string][]string{"fast": {"m"}}
	g, url := startGateway(t, cfg)
	c := testClient(t)
	g.HoldReadiness("discovery: informers not synced")
	get := func(path string) (int, string) {
		resp, err := c.Get(url + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "informers not synced") {
		t.Fatalf("/readyz held: %d %s", code, body)
	}
	g.ReleaseReadiness()
	if code, body := get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "no endpoint is ready") {
		t.Fatalf("/readyz with no engine: %d %s", code, body)
	}
	chat := `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1}`
	for _, model := range []string{"m", "fast"} {
		resp, body := post(t, c, url+"/v1/chat/completions", strings.Replace(chat, `"m"`, strconv.Quote(model), 1))
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Fatalf("%s without engines: %d %s", model, resp.StatusCode, body)
		}
	}

	host, port, _ := net.SplitHostPort(strings.TrimPrefix(a.URL(), "http://"))
	p, _ := strconv.Atoi(port)
	next := cfg
	next.Endpoints = cfg.Discovery.Kubernetes.Endpoints([]DiscoveredAddr{{IP: host, Port: p}})
	mustReload(t, g, next)
	if code, body := get("/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz with an engine: %d %s", code, body)
	}
	if resp, body := post(t, c, url+"/v1/chat/completions", chat); resp.StatusCode != http.StatusOK {
		t.Fatalf("with the engine: %d %s", resp.StatusCode, body)
	}
	mustReload(t, g, cfg)
	if endpointOf(g, a.URL()) != nil {
		t.Fatal("the engine is still configured after it left")
	}
	if resp, body := post(t, c, url+"/v1/chat/completions", chat); resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("after the engine left: %d %s", resp.StatusCode, body)
	}
}

// TestDiscoveredFeedsFollow: the discovered engines' metrics scrapes and
// KV-event subscriptions (kv_events.endpoint "tcp://{ip}:K" from the
// template) start when they appear, stay (the same feeds) while they
// stay, and stop when they leave. The engines are simulated, each on its
// own loopback address with the same KV-event port, as pods would be.
func TestDiscoveredFeedsFollow(t *testing.T) {
	kvPort := 0
	var addrs []DiscoveredAddr
	for _, ip := range []string{"127.0.0.2", "127.0.0.3"} {
		if kvPort == 0 {
			ln, err := net.Listen("tcp", ip+":0")
			if err != nil {
				t.Skipf("skipping: cannot listen on %s: %v", ip, err)
			}
			kvPort = ln.Addr().(*net.TCPAddr).Port
			ln.Close()
		}
		kv := "tcp://" + net.JoinHostPort(ip, strconv.Itoa(kvPort))
		s, err := simserver.NewServer(simserver.ServerConfig{Model: "m", TimeScale: 100,
			KVEvents: kvevents.PublisherConfig{Enable: true, Endpoint: kv, Bind: true}})
		if err != nil {
			t.Skipf("skipping: KV-event publisher on %s: %v", kv, err)
		}
		ln, err := net.Listen("tcp", ip+":0")
		if err != nil {
			s.Close()
			t.Fatal(err)
		}
		s.Start()
		hs := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = hs.Serve(ln) }()
		t.Cleanup(func() { _ = hs.Close(); s.Close() })
		addrs = append(addrs, DiscoveredAddr{IP: ip, Port: ln.Addr().(*net.TCPAddr).Port})
	}
	cfg := testConfig("precise-prefix")
	cfg.Discovery.Kubernetes = &KubernetesDiscovery{Service: "s", Endpoint: EndpointConfig{Model: "m", Kind: fleet.Sim,
		KVEvents: &KVEventsConfig{Endpoint: "tcp://{ip}:" + strconv.Itoa(kvPort)}}}
	g, gw := startGateway(t, cfg)
	c := testClient(t)
	chat := func() int {
		resp, _ := post(t, c, gw+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`)
		return resp.StatusCode
	}
	if code := chat(); code != http.StatusServiceUnavailable {
		t.Fatalf("precise-prefix pool before any engine: %d, want 503", code)
	}
	feedsOf := func(url string) feeds {
		st := g.state.Load()
		for _, ep := range st.endpoints {
			if ep.name == url {
				return st.feeds[ep]
			}
		}
		return feeds{}
	}
	url := func(a DiscoveredAddr) string { return "http://" + net.JoinHostPort(a.IP, strconv.Itoa(a.Port)) }
	with := func(as ...DiscoveredAddr) Config {
		c := cfg
		c.Endpoints = cfg.Discovery.Kubernetes.Endpoints(as)
		return c
	}

	mustReload(t, g, with(addrs[0]))
	a := feedsOf(url(addrs[0]))
	if a.scrape == nil || a.kv == nil || a.kv.cfg.Endpoint != "tcp://127.0.0.2:"+strconv.Itoa(kvPort) {
		t.Fatalf("the first engine's feeds: %+v", a)
	}
	mustReload(t, g, with(addrs[0], addrs[1]))
	if got := feedsOf(url(addrs[0])); got.scrape != a.scrape || got.kv != a.kv {
		t.Fatal("the engine that stayed got new feeds")
	}
	b := feedsOf(url(addrs[1]))
	if b.scrape == nil || b.kv == nil || b.kv.cfg.Endpoint != "tcp://127.0.0.3:"+strconv.Itoa(kvPort) {
		t.Fatalf("the second engine's feeds: %+v", b)
	}
	mustReload(t, g, with(addrs[1]))
	for name, l := range map[string]*loop{"scrape": &a.scrape.loop, "kv": &a.kv.loop} {
		select {
		case <-l.done:
		case <-time.After(time.Minute): // a bound, not a timing claim: its drain has no request to wait for
			t.Fatalf("the removed engine's %s feed still runs", name)
		}
	}
	if got := feedsOf(url(addrs[1])); got.kv != b.kv {
		t.Fatal("the engine that stayed got a new KV feed")
	}
	if code := chat(); code != http.StatusOK {
		t.Fatalf("with the second engine: %d", code)
	}
	mustReload(t, g, with())
	if code := chat(); code != http.StatusServiceUnavailable {
		t.Fatalf("after the last engine left: %d, want 503", code)
	}
}
