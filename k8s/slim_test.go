package k8s

import (
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestSlimPod: the pod cache keeps the active-ports annotation alone (an
// oversize one cut to maxActivePortsBytes+1 bytes, still oversize) and the
// first Ready condition's type and status alone; the targets of the slim
// pods are those of the pods.
func TestSlimPod(t *testing.T) {
	now := metav1.Now()
	blob := strings.Repeat("x", 100<<10)
	foreign := func(p *corev1.Pod) {
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations["example.com/blob"] = blob
		p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: "example.com/gate", Status: corev1.ConditionFalse, Message: blob})
		p.Spec.Containers = []corev1.Container{{Name: "engine", Image: "x.invalid/engine", Args: []string{blob}}}
	}
	ann := func(v string) func(*corev1.Pod) {
		return func(p *corev1.Pod) { p.Annotations = map[string]string{ActivePortsAnnotation: v} }
	}
	pods := []*corev1.Pod{
		pod("a", "10.0.0.1", true, foreign),
		pod("b", "10.0.0.2", true, ann("8001"), foreign),
		pod("c", "10.0.0.3", true, ann(""), foreign),
		pod("d", "10.0.0.4", true, ann("8000"+strings.Repeat(" ", maxActivePortsBytes-4)), foreign), // 1024 bytes: read
		pod("e", "10.0.0.5", true, ann("8000"+strings.Repeat(" ", maxActivePortsBytes-3)), foreign), // 1025: oversize
		pod("f", "10.0.0.6", true, ann("8000,"+blob), foreign),
		pod("g", "10.0.0.7", false, foreign),
		pod("h", "10.0.0.8", true, func(p *corev1.Pod) { p.DeletionTimestamp = &now }, foreign),
		pod("i", "10.0.0.9", true, func(p *corev1.Pod) { // the first Ready condition counts
			p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: corev1.PodReady, Status: corev1.ConditionFalse})
		}),
		pod("j", "10.0.0.10", true, func(p *corev1.Pod) { p.Labels = map[string]string{"app": "other"} }, foreign),
	}
	var slim []*corev1.Pod
	for _, p := range pods {
		o, err := slimPod(p)
		if err != nil {
			t.Fatal(err)
		}
		s := o.(*corev1.Pod)
		if len(s.Annotations) > 1 || len(s.Annotations[ActivePortsAnnotation]) > maxActivePortsBytes+1 || len(s.Status.Conditions) > 1 ||
			len(s.Spec.Containers) != 0 || (len(s.Status.Conditions) == 1 && s.Status.Conditions[0] != corev1.PodCondition{Type: corev1.PodReady, Status: s.Status.Conditions[0].Status}) {
			t.Errorf("%s: kept %+v", p.Name, s)
		}
		if s.Name != p.Name || s.Namespace != p.Namespace || s.Status.PodIP != p.Status.PodIP || s.DeletionTimestamp != p.DeletionTimestamp || s.Labels["app"] != p.Labels["app"] {
			t.Errorf("%s: lost what is read: %+v", p.Name, s)
		}
		slim = append(slim, s)
	}
	pool := Pool{Selector: map[string]string{"app": "vllm"}, TargetPorts: []int{8000, 8001}}
	want, wantSkipped := PoolTargets(pool, pods)
	got, gotSkipped := PoolTargets(pool, slim)
	if !slices.Equal(got, want) || gotSkipped.N != wantSkipped.N || !slices.Equal(gotSkipped.Examples, wantSkipped.Examples) {
		t.Fatalf("slim: %v %+v\npods: %v %+v", got, gotSkipped, want, wantSkipped)
	}
	if wantSkipped.N != 2 || len(want) != 6 { // a and i: both ports, b: 8001, d: 8000; e and f skipped
		t.Fatalf("targets %v, skipped %+v", want, wantSkipped)
	}
	if o, _ := slimPod("tombstone"); o != "tombstone" {
		t.Fatal("a tombstone was changed")
	}
}

// TestSlimSlice: the EndpointSlice cache keeps what SliceTargets reads, and
// its targets are those of the slices.
func TestSlimSlice(t *testing.T) {
	yes, no := true, false
	name, port := "http", int32(8000)
	host, zone, node := "h", "z", "n"
	s := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "s", Annotations: map[string]string{"example.com/blob": strings.Repeat("x", 1<<16)},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "m"}}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &name, Port: &port}},
		Endpoints: []discoveryv1.Endpoint{
			{Addresses: []string{"10.0.0.1", "10.0.0.9"}, Conditions: discoveryv1.EndpointConditions{Ready: &yes}, Hostname: &host, Zone: &zone, NodeName: &node,
				TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: "a", Namespace: "llm", UID: "u"}},
			{Addresses: []string{"10.0.0.2"}, Conditions: discoveryv1.EndpointConditions{Ready: &yes, Terminating: &yes}},
			{Addresses: []string{"10.0.0.3"}, Conditions: discoveryv1.EndpointConditions{Ready: &no}},
			{Addresses: []string{"10.0.0.4"}, Hostname: &host},
			{},
		},
	}
	o, err := slimSlice(s)
	if err != nil {
		t.Fatal(err)
	}
	sl := o.(*discoveryv1.EndpointSlice)
	if len(sl.Annotations) != 0 || len(sl.ManagedFields) != 0 || sl.Endpoints[0].Zone != nil || sl.Endpoints[0].NodeName != nil ||
		len(sl.Endpoints[0].Addresses) != 1 || sl.Endpoints[0].TargetRef.UID != "" {
		t.Fatalf("kept %+v", sl)
	}
	for _, p := range []string{"http", "8000", ""} {
		want, _, werr := SliceTargets([]*discoveryv1.EndpointSlice{s}, p)
		got, _, gerr := SliceTargets([]*discoveryv1.EndpointSlice{sl}, p)
		if !slices.Equal(got, want) || (gerr == nil) != (werr == nil) || len(want) != 2 {
			t.Fatalf("port %q: slim %v %v, slice %v %v", p, got, gerr, want, werr)
		}
	}
	if o, _ := slimSlice("tombstone"); o != "tombstone" {
		t.Fatal("a tombstone was changed")
	}
}

// FuzzActivePorts: the annotation's ports are target ports, each once; an
// annotation is oversize exactly when over maxActivePortsBytes; the slim
// pod of the cache reads the same ports.
func FuzzActivePorts(f *testing.F) {
	for _, s := range []string{"", "8000", " 8001, 9999,x,8001", "-1,0,65536,99999999999999999999999", strings.Repeat(",", 2000),
		"8000" + strings.Repeat(" ", maxActivePortsBytes-4), "8000" + strings.Repeat(" ", maxActivePortsBytes-3), "0x1f40,+8000,08000"} {
		f.Add(s)
	}
	targetPorts := []int{8000, 8001, 1}
	f.Fuzz(func(t *testing.T, a string) {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{ActivePortsAnnotation: a}}}
		got, oversize := activePorts(p, targetPorts)
		if oversize != (len(a) > maxActivePortsBytes) || (oversize && got != nil) {
			t.Fatalf("%d bytes: oversize %v, ports %v", len(a), oversize, got)
		}
		for i, n := range got {
			if !slices.Contains(targetPorts, n) || slices.Contains(got[:i], n) {
				t.Fatalf("%q: ports %v", a, got)
			}
		}
		o, _ := slimPod(p)
		slim, slimOversize := activePorts(o.(*corev1.Pod), targetPorts)
		if !slices.Equal(slim, got) || slimOversize != oversize {
			t.Fatalf("%q: slim pod reads %v %v, pod %v %v", a, slim, slimOversize, got, oversize)
		}
	})
}

// FuzzEngineIP: an address engineIP accepts is a canonical IP (accepted
// again unchanged) that is not unspecified, multicast, link-local,
// zoned or IPv4-mapped, and the endpoint URL made of it parses back to
// it; an address it refuses gives a reason.
func FuzzEngineIP(f *testing.F) {
	for _, s := range []string{"10.0.0.1", "0.0.0.0", "::", "2001:db8::0001", "fe80::1%eth0", "::ffff:10.0.0.1", "169.254.169.254",
		"224.0.0.1", "255.255.255.255", "127.0.0.1", "::1", "010.0.0.1", "1.2.3.4.5", "[::1]", "", "10.0.0.1 "} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		ip, err := engineIP(s)
		if err != nil {
			if ip != "" || err.Error() == "" {
				t.Fatalf("%q: %q %v", s, ip, err)
			}
			return
		}
		a, perr := netip.ParseAddr(ip)
		if perr != nil || a.String() != ip || a.IsUnspecified() || a.IsMulticast() || a.IsLinkLocalUnicast() || a.Zone() != "" || a.Is4In6() {
			t.Fatalf("%q: accepted as %q", s, ip)
		}
		if again, err := engineIP(ip); err != nil || again != ip {
			t.Fatalf("%q: %q then %q %v", s, ip, again, err)
		}
		u, err := url.Parse("http://" + (Target{IP: ip, Port: 8000}).HostPort())
		if err != nil || u.Hostname() != ip || u.Port() != "8000" {
			t.Fatalf("%q: URL %v %v", s, u, err)
		}
	})
}
