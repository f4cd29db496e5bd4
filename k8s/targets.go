// Package k8s discovers engines through the Kubernetes API for `infergate
// serve` and `infergate epp`: the ready pods of one InferencePool
// (inference.networking.k8s.io/v1), or the ready addresses of one Service's
// EndpointSlices, watched with client-go informers (watch.go). What it
// returns is a list of Targets (IP, port); the caller turns them into
// gateway endpoints (gateway.KubernetesDiscovery.Endpoints) and reloads the
// gateway with them (cmd/infergate/discovery.go). README.md has the rules
// and the figures.
package k8s

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// Target is one discovered engine address.
type Target struct {
	// IP is the pod IP (an InferencePool's pod) or the endpoint's address
	// (an EndpointSlice's), IPv4 or IPv6, without brackets.
	IP string
	// Port is the engine's port: one of the pool's targetPorts, or the
	// EndpointSlice's port (the pods' target port).
	Port int
	// Name is what the address was found from: "pod/<name>" for a pod,
	// else the address's hostname or IP (logs only).
	Name string
}

// HostPort is t as host:port (IPv6 bracketed).
func (t Target) HostPort() string { return net.JoinHostPort(t.IP, strconv.Itoa(t.Port)) }

// InferencePoolGVR is the InferencePool resource (GIE api/v1,
// PROTOCOLS.md §4.2).
var InferencePoolGVR = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}

// ActivePortsAnnotation restricts a pod's endpoints to some of the pool's
// targetPorts: a comma-separated list of port numbers; a port not among
// targetPorts is ignored; present but empty means none (GIE
// pkg/lwepp/datastore/datastore.go@2d3ec8bb, extractActivePorts).
const ActivePortsAnnotation = "inference.networking.k8s.io/active-ports"

// Limits of the InferencePool's spec (GIE api/v1/inferencepool_types.go:
// targetPorts 1 to 8 unique ports; the CRD's schema enforces them, the
// parser again, since the API server is not the only writer of bad data a
// watch may carry).
const (
	maxTargetPorts = 8
	// maxActivePortsBytes bounds the active-ports annotation read (it
	// can name at most the 8 target ports: 47 bytes); a longer one is
	// read as no port, and the pod reported as skipped.
	maxActivePortsBytes = 1024
	// maxSkippedExamples is how many skipped pods or endpoints Skipped
	// describes (it counts them all).
	maxSkippedExamples = 3
)

// Skipped is what a list of targets left out that the source offered as
// engines: a selected, ready pod (a ready, not terminating EndpointSlice
// endpoint) whose address cannot be an engine's (engineIP), or a pod
// whose active-ports annotation is over maxActivePortsBytes. N counts
// them; Examples describes the first maxSkippedExamples, in the list's
// order (pod name; slice then endpoint), for a log line.
type Skipped struct {
	N        int
	Examples []string
}

// add counts one more skipped pod or endpoint, described as format says.
func (s *Skipped) add(format string, args ...any) {
	s.N++
	if len(s.Examples) < maxSkippedExamples {
		s.Examples = append(s.Examples, fmt.Sprintf(format, args...))
	}
}

// engineIP returns ip in canonical form (RFC 5952 for IPv6: two spellings
// of one address are one engine) if an engine may be reached at it, else
// why not. Refused, as the EndpointSlice API refuses them
// (k8s.io/kubernetes pkg/apis/discovery/validation, validateEndpointAddress)
// but the pod API does not (kube-apiserver v1.37 accepts these in a pod's
// status.podIP): not an IP, a zone, the unspecified address (0.0.0.0 and ::
// reach the gateway's own host), multicast, the limited broadcast
// 255.255.255.255, link-local unicast (169.254.0.0/16 holds cloud metadata
// services, 169.254.169.254), an IPv4-mapped IPv6 address. Loopback is
// accepted (an engine beside the gateway in tests and on one host; the
// EndpointSlice API refuses it itself).
func engineIP(ip string) (string, error) {
	a, err := netip.ParseAddr(ip)
	switch {
	case err != nil:
		return "", errors.New("not an IP address")
	case a.Zone() != "":
		return "", errors.New("an IPv6 zone")
	case a.IsUnspecified():
		return "", errors.New("unspecified")
	case a.IsMulticast():
		return "", errors.New("multicast")
	case a == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return "", errors.New("the limited broadcast address")
	case a.IsLinkLocalUnicast():
		return "", errors.New("link-local")
	case a.Is4In6():
		return "", errors.New("IPv4-mapped IPv6")
	}
	return a.String(), nil
}

// Pool is what discovery reads of an InferencePool: spec.selector.matchLabels
// and spec.targetPorts[].number.
type Pool struct {
	Selector    map[string]string
	TargetPorts []int
}

// ParsePool reads an InferencePool object (inference.networking.k8s.io/v1,
// as the dynamic client decodes it). A selector without matchLabels, no
// target port, more than 8, a duplicate or one out of 1..65535 is an error.
func ParsePool(u *unstructured.Unstructured) (Pool, error) {
	var p Pool
	sel, found, err := unstructured.NestedStringMap(u.Object, "spec", "selector", "matchLabels")
	if err != nil {
		return p, fmt.Errorf("InferencePool %s/%s: spec.selector.matchLabels: %w", u.GetNamespace(), u.GetName(), err)
	}
	if !found || len(sel) == 0 {
		return p, fmt.Errorf("InferencePool %s/%s: spec.selector.matchLabels: required", u.GetNamespace(), u.GetName())
	}
	p.Selector = sel
	ports, _, err := unstructured.NestedSlice(u.Object, "spec", "targetPorts")
	if err != nil {
		return p, fmt.Errorf("InferencePool %s/%s: spec.targetPorts: %w", u.GetNamespace(), u.GetName(), err)
	}
	if len(ports) == 0 || len(ports) > maxTargetPorts {
		return p, fmt.Errorf("InferencePool %s/%s: spec.targetPorts: want 1 to %d ports, got %d", u.GetNamespace(), u.GetName(), maxTargetPorts, len(ports))
	}
	for i, v := range ports {
		m, ok := v.(map[string]any)
		if !ok {
			return p, fmt.Errorf("InferencePool %s/%s: spec.targetPorts[%d]: not an object", u.GetNamespace(), u.GetName(), i)
		}
		n, ok := m["number"].(int64) // JSON numbers are int64 in unstructured
		if !ok || n < 1 || n > 65535 {
			return p, fmt.Errorf("InferencePool %s/%s: spec.targetPorts[%d].number %v: want 1 to 65535", u.GetNamespace(), u.GetName(), i, m["number"])
		}
		if slices.Contains(p.TargetPorts, int(n)) {
			return p, fmt.Errorf("InferencePool %s/%s: spec.targetPorts: port %d twice", u.GetNamespace(), u.GetName(), n)
		}
		p.TargetPorts = append(p.TargetPorts, int(n))
	}
	return p, nil
}

// PodReady is the rule a pod of the pool must pass to be routed to, as
// GIE's EPP has it (pkg/epp/util/pod/pod.go IsPodReady, and
// pkg/lwepp/controller/pod_reconciler.go@ae2846ed updateDatastore): no
// deletion timestamp (a terminating pod is drained at once, before its
// containers get SIGTERM's grace) and the Ready condition True; and, which
// GIE leaves to a later failure, a pod IP.
func PodReady(pod *corev1.Pod) bool {
	if pod.DeletionTimestamp != nil || pod.Status.PodIP == "" {
		return false
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// activePorts returns the ports of targetPorts a pod serves: all of them
// without the active-ports annotation, else those the annotation lists
// (GIE extractActivePorts: entries that are not numbers, or not target
// ports, are ignored). An annotation longer than maxActivePortsBytes is
// read as empty, and oversize is true.
func activePorts(pod *corev1.Pod, targetPorts []int) (ports []int, oversize bool) {
	a, ok := pod.Annotations[ActivePortsAnnotation]
	if !ok {
		return targetPorts, false
	}
	var out []int
	if len(a) > maxActivePortsBytes {
		return nil, true
	}
	for s := range strings.SplitSeq(a, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err == nil && slices.Contains(targetPorts, n) && !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out, false
}

// PoolTargets returns the targets of pool among pods: one per ready pod
// (PodReady) whose labels match the selector and active target port, in
// the order of pod name then targetPorts; an address (IP and port) twice
// (two pods with one IP, hostNetwork) is listed once. A selected, ready
// pod whose IP engineIP refuses, or whose active-ports annotation is over
// maxActivePortsBytes, is left out and counted in Skipped.
func PoolTargets(pool Pool, pods []*corev1.Pod) ([]Target, Skipped) {
	sel := labels.SelectorFromSet(pool.Selector)
	pods = slices.Clone(pods)
	slices.SortFunc(pods, func(a, b *corev1.Pod) int { return cmp.Compare(a.Name, b.Name) })
	var out []Target
	var skipped Skipped
	seen := map[string]bool{}
	for _, pod := range pods {
		if !sel.Matches(labels.Set(pod.Labels)) || !PodReady(pod) {
			continue
		}
		ip, err := engineIP(pod.Status.PodIP)
		if err != nil {
			skipped.add("pod/%s: pod IP %.64q: %v", pod.Name, pod.Status.PodIP, err)
			continue
		}
		active, oversize := activePorts(pod, pool.TargetPorts)
		if oversize {
			skipped.add("pod/%s: annotation %s over %d bytes: read as no port", pod.Name, ActivePortsAnnotation, maxActivePortsBytes)
			continue
		}
		for _, port := range pool.TargetPorts {
			if !slices.Contains(active, port) {
				continue
			}
			t := Target{IP: ip, Port: port, Name: "pod/" + pod.Name}
			if !seen[t.HostPort()] {
				seen[t.HostPort()] = true
				out = append(out, t)
			}
		}
	}
	return out, skipped
}

// errNoPort is SliceTargets' error for a port the Service does not have.
var errNoPort = errors.New("no such port")

// SliceTargets returns the targets of a Service's EndpointSlices: for the
// port named or numbered port ("" = the only one, or the first listed),
// one per endpoint that is ready (conditions.ready true or unset, which
// the API defines as ready) and not terminating, at its first address
// (the API's addresses are fungible); FQDN slices are skipped. Order:
// endpoint name (its pod, else hostname, else address), then address; an
// address listed twice (an endpoint moving between slices) is listed once.
// An endpoint whose address engineIP refuses (the API server refuses them
// too; a watch may carry what another writer made), or whose slice's port
// is out of 1..65535 (the API server accepts port 0), is counted in
// Skipped.
// A port no slice has is an error beside what was found.
func SliceTargets(eps []*discoveryv1.EndpointSlice, port string) ([]Target, Skipped, error) {
	var out []Target
	var skipped Skipped
	seen := map[string]bool{}
	found := false
	for _, s := range eps {
		if s.AddressType != discoveryv1.AddressTypeIPv4 && s.AddressType != discoveryv1.AddressTypeIPv6 {
			continue
		}
		p, ok := slicePort(s.Ports, port)
		if !ok {
			continue
		}
		found = true
		for _, e := range s.Endpoints {
			c := e.Conditions
			if len(e.Addresses) == 0 || (c.Ready != nil && !*c.Ready) || (c.Terminating != nil && *c.Terminating) {
				continue
			}
			if p < 1 || p > 65535 {
				skipped.add("EndpointSlice %s: port %d", s.Name, p)
				continue
			}
			ip, err := engineIP(e.Addresses[0])
			if err != nil {
				skipped.add("EndpointSlice %s: address %.64q: %v", s.Name, e.Addresses[0], err)
				continue
			}
			t := Target{IP: ip, Port: p, Name: ip}
			switch {
			case e.TargetRef != nil && e.TargetRef.Kind == "Pod":
				t.Name = "pod/" + e.TargetRef.Name
			case e.Hostname != nil:
				t.Name = *e.Hostname
			}
			if seen[t.HostPort()] {
				continue
			}
			seen[t.HostPort()] = true
			out = append(out, t)
		}
	}
	slices.SortFunc(out, func(a, b Target) int {
		return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(a.IP, b.IP), cmp.Compare(a.Port, b.Port))
	})
	if !found && len(eps) > 0 && port != "" {
		return out, skipped, fmt.Errorf("port %q: %w in the Service's EndpointSlices", port, errNoPort)
	}
	return out, skipped, nil
}

// slicePort is the number of the port named or numbered want among ports
// ("" = the first), which may be out of 1..65535 (the API accepts 0).
func slicePort(ports []discoveryv1.EndpointPort, want string) (int, bool) {
	for _, p := range ports {
		if p.Port == nil {
			continue
		}
		n := int(*p.Port)
		name := ""
		if p.Name != nil {
			name = *p.Name
		}
		if want == "" || want == name || want == strconv.Itoa(n) {
			return n, true
		}
	}
	return 0, false
}
