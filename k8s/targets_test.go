package k8s

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// pod is a pod of labels app=vllm, ready or not, at ip.
func pod(name, ip string, ready bool, mod ...func(*corev1.Pod)) *corev1.Pod {
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "llm", Labels: map[string]string{"app": "vllm"}},
		Status: corev1.PodStatus{PodIP: ip, Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}, {Type: corev1.PodReady, Status: st}}},
	}
	for _, m := range mod {
		m(p)
	}
	return p
}

func TestPoolTargets(t *testing.T) {
	pool := Pool{Selector: map[string]string{"app": "vllm"}, TargetPorts: []int{8000, 8001}}
	now := metav1.Now()
	pods := []*corev1.Pod{
		pod("c", "10.0.0.3", true),
		pod("a", "10.0.0.1", true),
		pod("b", "10.0.0.2", false), // not ready
		pod("d", "10.0.0.4", true, func(p *corev1.Pod) { p.DeletionTimestamp = &now }), // terminating
		pod("e", "", true), // no IP yet
		pod("f", "10.0.0.6", true, func(p *corev1.Pod) { p.Labels = map[string]string{"app": "x"} }), // not selected
		pod("g", "10.0.0.7", true, func(p *corev1.Pod) { p.Status.Conditions = nil }),                // no Ready condition
		pod("h", "10.0.0.8", true, func(p *corev1.Pod) { p.Annotations = map[string]string{ActivePortsAnnotation: " 8001, 9999,x,8001"} }),
		pod("i", "10.0.0.9", true, func(p *corev1.Pod) { p.Annotations = map[string]string{ActivePortsAnnotation: ""} }),
		pod("j", "10.0.0.1", true), // the same IP as a: listed once
	}
	got, skipped := PoolTargets(pool, pods)
	if skipped.N != 0 {
		t.Fatalf("skipped: %+v", skipped)
	}
	want := []Target{
		{"10.0.0.1", 8000, "pod/a"}, {"10.0.0.1", 8001, "pod/a"},
		{"10.0.0.3", 8000, "pod/c"}, {"10.0.0.3", 8001, "pod/c"},
		{"10.0.0.8", 8001, "pod/h"},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("got  %v\nwant %v", got, want)
	}
	// A selector change selects other pods.
	pool.Selector = map[string]string{"app": "x"}
	if got, _ := PoolTargets(pool, pods); !slices.Equal(got, []Target{{"10.0.0.6", 8000, "pod/f"}, {"10.0.0.6", 8001, "pod/f"}}) {
		t.Fatalf("selector app=x: %v", got)
	}
	// An annotation too long to read is read as no port, and the pod
	// counted as skipped.
	long := pod("k", "10.0.0.10", true, func(p *corev1.Pod) {
		p.Annotations = map[string]string{ActivePortsAnnotation: strings.Repeat("8000,", 300)}
	})
	if got, skipped := PoolTargets(Pool{Selector: map[string]string{"app": "vllm"}, TargetPorts: []int{8000}}, []*corev1.Pod{long}); len(got) != 0 ||
		skipped.N != 1 || !strings.Contains(skipped.Examples[0], "pod/k: annotation "+ActivePortsAnnotation+" over 1024 bytes") {
		t.Fatalf("long annotation: %v %+v", got, skipped)
	}
}

// TestPoolTargetsPodIPs: pod IPs that kube-apiserver v1.37 accepts in a
// pod's status but that cannot be an engine's (the unspecified address
// reaches the gateway's own host, link-local holds cloud metadata
// services) are skipped and counted; an IPv6 address is canonical, so two
// spellings of one are one engine; loopback is kept.
func TestPoolTargetsPodIPs(t *testing.T) {
	pool := Pool{Selector: map[string]string{"app": "vllm"}, TargetPorts: []int{8000}}
	var pods []*corev1.Pod
	for i, ip := range []string{"0.0.0.0", "::", "169.254.169.254", "fe80::1", "224.0.0.1", "ff02::1", "255.255.255.255",
		"not-an-ip", "10.0.0.1 ", "fe80::1%eth0", "::ffff:10.0.0.1", "2001:db8::0001", "2001:db8::1", "127.0.0.1", "10.0.0.1"} {
		pods = append(pods, pod(fmt.Sprintf("p%02d", i), ip, true))
	}
	got, skipped := PoolTargets(pool, pods)
	want := []Target{{"2001:db8::1", 8000, "pod/p11"}, {"127.0.0.1", 8000, "pod/p13"}, {"10.0.0.1", 8000, "pod/p14"}}
	if !slices.Equal(got, want) {
		t.Fatalf("got  %v\nwant %v", got, want)
	}
	if skipped.N != 11 || !slices.Equal(skipped.Examples, []string{`pod/p00: pod IP "0.0.0.0": unspecified`, `pod/p01: pod IP "::": unspecified`,
		`pod/p02: pod IP "169.254.169.254": link-local`}) {
		t.Fatalf("skipped: %+v", skipped)
	}
}

func TestParsePool(t *testing.T) {
	mk := func(spec map[string]any) *unstructured.Unstructured {
		return &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
			"metadata": map[string]any{"name": "p", "namespace": "llm"}, "spec": spec}}
	}
	p, err := ParsePool(mk(map[string]any{
		"selector":    map[string]any{"matchLabels": map[string]any{"app": "vllm"}},
		"targetPorts": []any{map[string]any{"number": int64(8000)}, map[string]any{"number": int64(8002)}},
	}))
	if err != nil || p.Selector["app"] != "vllm" || !slices.Equal(p.TargetPorts, []int{8000, 8002}) {
		t.Fatalf("%+v %v", p, err)
	}
	sel := map[string]any{"matchLabels": map[string]any{"app": "vllm"}}
	port := func(n any) map[string]any { return map[string]any{"number": n} }
	for _, tc := range []struct {
		spec map[string]any
		want string
	}{
		{map[string]any{"targetPorts": []any{port(int64(1))}}, "matchLabels: required"},
		{map[string]any{"selector": sel}, "want 1 to 8 ports, got 0"},
		{map[string]any{"selector": sel, "targetPorts": []any{port(int64(0))}}, "want 1 to 65535"},
		{map[string]any{"selector": sel, "targetPorts": []any{port("8000")}}, "want 1 to 65535"},
		{map[string]any{"selector": sel, "targetPorts": []any{port(int64(1)), port(int64(1))}}, "twice"},
		{map[string]any{"selector": sel, "targetPorts": []any{"8000"}}, "not an object"},
		{map[string]any{"selector": sel, "targetPorts": []any{port(int64(1)), port(int64(2)), port(int64(3)), port(int64(4)),
			port(int64(5)), port(int64(6)), port(int64(7)), port(int64(8)), port(int64(9))}}, "got 9"},
		{map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"app": int64(3)}}, "targetPorts": []any{port(int64(1))}}, "matchLabels"},
	} {
		if _, err := ParsePool(mk(tc.spec)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: got %v, want %q", tc.spec, err, tc.want)
		}
	}
}

func TestSliceTargets(t *testing.T) {
	yes, no := true, false
	name := func(s string) *string { return &s }
	port := func(n int32) *int32 { return &n }
	slice := func(typ discoveryv1.AddressType, ports []discoveryv1.EndpointPort, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
		return &discoveryv1.EndpointSlice{AddressType: typ, Ports: ports, Endpoints: eps}
	}
	ep := func(addr string, ready, terminating *bool, podName string) discoveryv1.Endpoint {
		e := discoveryv1.Endpoint{Addresses: []string{addr}, Conditions: discoveryv1.EndpointConditions{Ready: ready, Terminating: terminating}}
		if podName != "" {
			e.TargetRef = &corev1.ObjectReference{Kind: "Pod", Name: podName}
		}
		return e
	}
	ports := []discoveryv1.EndpointPort{{Name: name("metrics"), Port: port(9000)}, {Name: name("http"), Port: port(8000)}}
	eps := []*discoveryv1.EndpointSlice{
		slice(discoveryv1.AddressTypeIPv4, ports,
			ep("10.0.0.2", &yes, &no, "b"),
			ep("10.0.0.1", nil, nil, "a"),        // ready unset: ready
			ep("10.0.0.3", &no, &no, "c"),        // not ready
			ep("10.0.0.4", &yes, &yes, "d"),      // terminating (publishNotReadyAddresses keeps ready)
			ep("not-an-ip", &yes, nil, "e"),      // refused
			discoveryv1.Endpoint{Addresses: nil}, // no address
		),
		slice(discoveryv1.AddressTypeIPv6, ports, ep("fd00::1", &yes, nil, "f")),
		slice(discoveryv1.AddressTypeIPv4, ports, ep("10.0.0.2", &yes, nil, "b")), // moving between slices
		slice(discoveryv1.AddressTypeFQDN, ports, ep("x.example", &yes, nil, "")),
	}
	got, skipped, err := SliceTargets(eps, "http")
	want := []Target{{"10.0.0.1", 8000, "pod/a"}, {"10.0.0.2", 8000, "pod/b"}, {"fd00::1", 8000, "pod/f"}}
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("http: %v %v\nwant %v", got, err, want)
	}
	if skipped.N != 1 || !slices.Equal(skipped.Examples, []string{`EndpointSlice : address "not-an-ip": not an IP address`}) {
		t.Fatalf("skipped: %+v", skipped)
	}
	if got, _, _ := SliceTargets(eps, "9000"); len(got) != 3 || got[0].Port != 9000 {
		t.Fatalf("9000: %v", got)
	}
	if got, _, _ := SliceTargets(eps, ""); len(got) != 3 || got[0].Port != 9000 {
		t.Fatalf("first port: %v", got)
	}
	if got, _, err := SliceTargets(eps, "grpc"); len(got) != 0 || err == nil {
		t.Fatalf("no such port: %v %v", got, err)
	}
	if got, _, err := SliceTargets(nil, "grpc"); len(got) != 0 || err != nil {
		t.Fatalf("no slices: %v %v", got, err)
	}
	// A slice whose port is 0 (the API server accepts it): its ready
	// endpoints are skipped and counted, not dropped silently.
	zero := []*discoveryv1.EndpointSlice{{ObjectMeta: metav1.ObjectMeta{Name: "z"}, AddressType: discoveryv1.AddressTypeIPv4,
		Ports: []discoveryv1.EndpointPort{{Name: name("http"), Port: port(0)}}, Endpoints: []discoveryv1.Endpoint{ep("10.0.0.1", nil, nil, "a"), ep("10.0.0.2", &no, nil, "b")}}}
	for _, p := range []string{"", "http"} {
		if got, skipped, err := SliceTargets(zero, p); len(got) != 0 || err != nil || skipped.N != 1 || skipped.Examples[0] != "EndpointSlice z: port 0" {
			t.Fatalf("port 0 (%q): %v %+v %v", p, got, skipped, err)
		}
	}
}

func TestStatsCount(t *testing.T) {
	var st Stats
	a, b, c := Target{IP: "10.0.0.1", Port: 8000}, Target{IP: "10.0.0.2", Port: 8000}, Target{IP: "10.0.0.3", Port: 8000}
	now := time.Unix(100, 0)
	st.count(nil, []Target{a, b}, now)
	st.count([]Target{a, b}, []Target{b, c, c}, now.Add(time.Second)) // c listed twice counts once
	st.count([]Target{b, c, c}, nil, now.Add(2*time.Second))
	if st.Added.Load() != 3 || st.Removed.Load() != 3 || st.Changes.Load() != 3 || st.Engines.Load() != 0 ||
		st.LastChange.Load() != now.Add(2*time.Second).UnixNano() {
		t.Fatalf("added %d removed %d changes %d engines %d last %d", st.Added.Load(), st.Removed.Load(), st.Changes.Load(),
			st.Engines.Load(), st.LastChange.Load())
	}
}
