package k8s

import (
	"strings"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The informers' transforms (cache.TransformFunc): what a Watcher's
// caches keep of each pod and EndpointSlice, read by PoolTargets and
// SliceTargets and nothing more.

// slimPod keeps of a pod what discovery reads, so that the informer's
// cache of a namespace's pods (every pod of it, selected or not) holds a
// few hundred bytes a pod, not what other tools write on them: name,
// labels, deletion timestamp, pod IP; of the annotations the active-ports
// one alone, at most its first maxActivePortsBytes+1 bytes (copied: a
// longer one is read as no port all the same, and does not pin the
// decoded object); of the conditions the first Ready one, type and status
// alone (PodReady reads no more). A namespace's other annotations (up to
// 256 KiB a pod, the API's limit) and condition messages are dropped:
// a watcher of 1,000 pods with 100 KiB of other annotations, a 20 KiB
// condition message and a 2 KiB active-ports annotation each held 132 MB
// of heap when it kept every annotation and condition, 3.9 MB so
// (k8s/README.md, "Bounds").
func slimPod(o any) (any, error) {
	pod, ok := o.(*corev1.Pod)
	if !ok {
		return o, nil // a DeletedFinalStateUnknown tombstone
	}
	slim := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID, ResourceVersion: pod.ResourceVersion,
			Labels: pod.Labels, DeletionTimestamp: pod.DeletionTimestamp},
		Status: corev1.PodStatus{PodIP: pod.Status.PodIP},
	}
	if a, ok := pod.Annotations[ActivePortsAnnotation]; ok {
		slim.Annotations = map[string]string{ActivePortsAnnotation: strings.Clone(a[:min(len(a), maxActivePortsBytes+1)])}
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			slim.Status.Conditions = []corev1.PodCondition{{Type: c.Type, Status: c.Status}}
			break
		}
	}
	return slim, nil
}

// slimSlice keeps of an EndpointSlice what SliceTargets reads (name,
// address type, ports; of each endpoint its first address, conditions,
// hostname and target pod's kind and name), dropping its annotations,
// managed fields, topology hints, zones and node names.
func slimSlice(o any) (any, error) {
	s, ok := o.(*discoveryv1.EndpointSlice)
	if !ok {
		return o, nil // a DeletedFinalStateUnknown tombstone
	}
	slim := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: s.Name, Namespace: s.Namespace, UID: s.UID, ResourceVersion: s.ResourceVersion, Labels: s.Labels},
		AddressType: s.AddressType, Ports: s.Ports, Endpoints: make([]discoveryv1.Endpoint, len(s.Endpoints)),
	}
	for i, e := range s.Endpoints {
		se := discoveryv1.Endpoint{Conditions: e.Conditions, Hostname: e.Hostname}
		if len(e.Addresses) > 0 {
			se.Addresses = []string{e.Addresses[0]} // a copy: [:1:1] would keep the decoded array of every address
		}
		if e.TargetRef != nil {
			se.TargetRef = &corev1.ObjectReference{Kind: e.TargetRef.Kind, Name: e.TargetRef.Name}
		}
		slim.Endpoints[i] = se
	}
	return slim, nil
}
