package gateway

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/infergate/infergate/fleet"
)

// Engines discovered from Kubernetes (README "Kubernetes discovery"). The
// gateway itself watches nothing: package k8s watches an InferencePool and
// its pods, or a Service's EndpointSlices, and `infergate serve`/`epp`
// (cmd/infergate/discovery.go) reload the gateway with the configuration's
// own endpoints plus one endpoint per discovered address, made from the
// discovery.kubernetes.endpoint template (KubernetesDiscovery.Endpoints).
// The reload path (reload.go) does the rest: an endpoint that stays keeps
// its state, a new one is probed and its scrape and KV-event subscription
// started, a gone one drained.

// DiscoveryConfig is the configuration's discovery section.
type DiscoveryConfig struct {
	// Kubernetes, when set, adds the engines discovered through the
	// Kubernetes API to the configuration's endpoints.
	Kubernetes *KubernetesDiscovery `yaml:"kubernetes"`
}

// KubernetesDiscovery is discovery.kubernetes: what is watched (one
// InferencePool or one Service, in one namespace) and the template of a
// discovered engine. The Helm chart writes it (deploy/helm/infergate,
// templates/_helpers.tpl "infergate.config").
type KubernetesDiscovery struct {
	// Kubeconfig is the kubeconfig file (--kubeconfig overrides it; ""
	// uses $KUBECONFIG, then ~/.kube/config, then the in-cluster service
	// account).
	Kubeconfig string `yaml:"kubeconfig"`
	// Namespace is the namespace of the pool or Service ("" = the
	// kubeconfig context's, in a pod its own).
	Namespace string `yaml:"namespace"`
	// InferencePool names the inference.networking.k8s.io/v1
	// InferencePool whose ready pods are the engines, one endpoint per
	// pod IP and target port (PROTOCOLS.md §4.2). Exclusive with Service.
	InferencePool string `yaml:"inference_pool"`
	// Service names the Service whose EndpointSlices (label
	// kubernetes.io/service-name) list the engines: one endpoint per
	// ready, not terminating address.
	Service string `yaml:"service"`
	// Port selects the Service's port by name or number (the
	// EndpointSlice port's name, or its number, the pods' target port);
	// "" takes the only one, or the first listed. Service only.
	Port string `yaml:"port"`
	// Endpoint is the template of every discovered engine: an endpoint
	// without url (url is http://{ip}:{port}); its metrics_url and
	// kv_events endpoint, replay_endpoint and topic may use {ip} and
	// {port}, e.g. kv_events.endpoint "tcp://{ip}:5557". model is
	// required.
	Endpoint EndpointConfig `yaml:"endpoint"`
}

// DiscoveredAddr is one discovered engine address: an IP and a port, and
// what it was found from (pod or slice endpoint name, for logs).
type DiscoveredAddr struct {
	IP   string
	Port int
	From string
}

// Endpoints returns the endpoint of every address in addrs, in order,
// made from k's template (see KubernetesDiscovery.Endpoint). An IPv6
// address is bracketed in the url; {ip} is the bare address.
func (k *KubernetesDiscovery) Endpoints(addrs []DiscoveredAddr) []EndpointConfig {
	out := make([]EndpointConfig, 0, len(addrs))
	for _, a := range addrs {
		out = append(out, k.endpoint(a.IP, a.Port))
	}
	return out
}

// endpoint is the template filled for ip and port.
func (k *KubernetesDiscovery) endpoint(ip string, port int) EndpointConfig {
	p := strconv.Itoa(port)
	fill := strings.NewReplacer("{ip}", ip, "{port}", p).Replace
	e := k.Endpoint
	e.URL = "http://" + net.JoinHostPort(ip, p)
	e.MetricsURL = fill(e.MetricsURL)
	if kv := e.KVEvents; kv != nil {
		c := *kv
		c.Endpoint, c.ReplayEndpoint, c.Topic = fill(c.Endpoint), fill(c.ReplayEndpoint), fill(c.Topic)
		e.KVEvents = &c
	}
	return e
}

// validate checks discovery.kubernetes; the template is checked as the
// endpoint of an example address.
func (k *KubernetesDiscovery) validate(c Config) []error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("discovery.kubernetes"+format, args...))
	}
	switch {
	case (k.InferencePool == "") == (k.Service == ""):
		bad(": want one of inference_pool and service")
	case k.InferencePool != "" && k.Port != "":
		bad(".port %q: for a service only (an InferencePool's targetPorts are its ports)", k.Port)
	}
	if k.Port != "" {
		if n, err := strconv.Atoi(k.Port); err == nil && (n < 1 || n > 65535) {
			bad(".port %d: want 1 to 65535 or a port name", n)
		}
	}
	if k.Endpoint.URL != "" {
		bad(".endpoint.url %q: a discovered endpoint's url is http://{ip}:{port}; leave it out", k.Endpoint.URL)
	}
	e := k.endpoint("10.0.0.1", 8000)
	if e.BlockSize == 0 {
		e.BlockSize = c.Routing.Prefix.BlockSize
	}
	if e.Kind == "" {
		e.Kind = fleet.VLLM
	}
	for _, err := range e.validate(".endpoint", c.Routing) {
		bad("%w", err)
	}
	return errs
}

// discoveredModel is the model of the discovered engines ("" without
// discovery): its pool exists while no engine is discovered (requests
// wait for one or get 503, not 404; aliases and kv_stores may name it).
func (c Config) discoveredModel() string {
	if k := c.Discovery.Kubernetes; k != nil {
		return k.Endpoint.Model
	}
	return ""
}

// Readiness held (HoldReadiness): /readyz answers 503 and the picker's
// readiness service NOT_SERVING with the reason, whatever the endpoints.

// HoldReadiness makes the gateway report not ready, with reason, until
// ReleaseReadiness: `infergate serve` and `epp` hold it until discovery's
// informers have synced and their first endpoint list is applied.
func (g *Gateway) HoldReadiness(reason string) { g.readinessHold.Store(&reason) }

// ReleaseReadiness ends HoldReadiness.
func (g *Gateway) ReleaseReadiness() { g.readinessHold.Store(nil) }

// ReadinessHold returns the reason readiness is held, "" when it is not.
func (g *Gateway) ReadinessHold() string {
	if r := g.readinessHold.Load(); r != nil {
		return *r
	}
	return ""
}

// readinessHoldPtr is the type of Gateway.readinessHold.
type readinessHoldPtr = atomic.Pointer[string]
