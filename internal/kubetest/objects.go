package kubetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/util/retry"
)

// OpTimeout bounds each helper below (one API call, or one wait for the
// server to reach a state).
const OpTimeout = time.Minute

// MaxManifestBytes bounds one manifest file or stream ApplyManifests reads.
const MaxManifestBytes = 8 << 20

// InferencePoolCRDPath is the chart's InferencePool CRD,
// deploy/helm/infergate/crds/inferencepool.yaml, found from this source
// file's location (the one copy in the repository).
func InferencePoolCRDPath() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("kubetest: cannot locate the repository (no caller information)")
	}
	p := filepath.Join(filepath.Dir(file), "..", "..", "deploy", "helm", "infergate", "crds", "inferencepool.yaml")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("kubetest: InferencePool CRD: %w", err)
	}
	return filepath.Clean(p), nil
}

// InstallInferencePoolCRD applies the chart's InferencePool CRD and waits
// until it is Established and served (inference.networking.k8s.io/v1,
// resource inferencepools).
func (s *Server) InstallInferencePoolCRD(t testing.TB) {
	t.Helper()
	p, err := InferencePoolCRDPath()
	if err != nil {
		t.Fatal(err)
	}
	b, err := readManifest(p)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
	defer cancel()
	if _, err := s.ApplyManifests(ctx, "", b); err != nil {
		t.Fatal(err)
	}
}

// InferencePoolGVR is the InferencePool resource (GIE api/v1).
var InferencePoolGVR = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}

func readManifest(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxManifestBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > MaxManifestBytes {
		return nil, fmt.Errorf("kubetest: %s is over %d bytes", path, MaxManifestBytes)
	}
	return b, nil
}

// DecodeManifests splits YAML (or JSON) streams into objects; empty
// documents are dropped. Each stream is at most MaxManifestBytes.
func DecodeManifests(manifests ...[]byte) ([]*unstructured.Unstructured, error) {
	var objs []*unstructured.Unstructured
	for _, m := range manifests {
		if len(m) > MaxManifestBytes {
			return nil, fmt.Errorf("kubetest: manifest of %d bytes, over %d", len(m), MaxManifestBytes)
		}
		dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(m), 4096)
		for {
			var obj map[string]any
			if err := dec.Decode(&obj); err != nil {
				if err == io.EOF {
					break
				}
				return nil, fmt.Errorf("kubetest: manifest: %w", err)
			}
			if len(obj) == 0 {
				continue
			}
			u := &unstructured.Unstructured{Object: obj}
			if u.GetKind() == "" || u.GetAPIVersion() == "" || u.GetName() == "" {
				return nil, fmt.Errorf("kubetest: manifest document without apiVersion, kind or metadata.name: %v", obj)
			}
			objs = append(objs, u)
		}
	}
	return objs, nil
}

// ApplyManifests applies every object of the manifests to the server with
// server-side apply (field manager "kubetest", forced), as
// `kubectl apply --server-side --force-conflicts` does: the API server
// validates each one (schema, CRD openAPIV3Schema, defaulting) and an
// invalid object is an error naming it. CustomResourceDefinitions go first
// and are waited for (Established, and their resources in discovery)
// before the rest. Namespaced objects without metadata.namespace go to
// namespace. It returns the objects as the server stored them, in the
// order applied; it stops at the first error.
func (s *Server) ApplyManifests(ctx context.Context, namespace string, manifests ...[]byte) ([]*unstructured.Unstructured, error) {
	objs, err := DecodeManifests(manifests...)
	if err != nil {
		return nil, err
	}
	var crds, rest []*unstructured.Unstructured
	for _, o := range objs {
		if o.GroupVersionKind().GroupKind() == crdGK {
			crds = append(crds, o)
		} else {
			rest = append(rest, o)
		}
	}
	dc := s.Clientset().Discovery()
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	var out []*unstructured.Unstructured
	for _, o := range crds {
		got, err := s.apply(ctx, mapper, namespace, o)
		if err != nil {
			return out, err
		}
		out = append(out, got)
	}
	for _, o := range crds {
		if err := s.waitEstablished(ctx, o.GetName()); err != nil {
			return out, err
		}
	}
	if len(crds) > 0 {
		mapper.Reset()
	}
	for _, o := range rest {
		got, err := s.apply(ctx, mapper, namespace, o)
		if err != nil {
			return out, err
		}
		out = append(out, got)
	}
	return out, nil
}

var (
	crdGK  = schema.GroupKind{Group: "apiextensions.k8s.io", Kind: "CustomResourceDefinition"}
	crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
)

func (s *Server) apply(ctx context.Context, mapper *restmapper.DeferredDiscoveryRESTMapper, namespace string, o *unstructured.Unstructured) (*unstructured.Unstructured, error) {
	gvk := o.GroupVersionKind()
	var mapping *meta.RESTMapping
	// A kind just made Established can take a moment to reach discovery.
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err == nil {
			mapping = m
			return true, nil
		}
		if meta.IsNoMatchError(err) {
			mapper.Reset()
			return false, nil
		}
		return false, err
	})
	if err != nil {
		return nil, fmt.Errorf("kubetest: %s %s: no resource for the kind: %w", gvk, o.GetName(), err)
	}
	ri := s.Dynamic().Resource(mapping.Resource)
	var got *unstructured.Unstructured
	if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
		ns := o.GetNamespace()
		if ns == "" {
			ns = namespace
		}
		if ns == "" {
			return nil, fmt.Errorf("kubetest: %s %s: namespaced object without a namespace", gvk.Kind, o.GetName())
		}
		got, err = ri.Namespace(ns).Apply(ctx, o.GetName(), o, metav1.ApplyOptions{FieldManager: "kubetest", Force: true})
	} else {
		got, err = ri.Apply(ctx, o.GetName(), o, metav1.ApplyOptions{FieldManager: "kubetest", Force: true})
	}
	if err != nil {
		return nil, fmt.Errorf("kubetest: apply %s %s: %w", gvk.Kind, o.GetName(), err)
	}
	return got, nil
}

// waitEstablished waits until the CRD's Established condition is True.
func (s *Server) waitEstablished(ctx context.Context, name string) error {
	var last string
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		crd, err := s.Dynamic().Resource(crdGVR).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		conds, _, _ := unstructured.NestedSlice(crd.Object, "status", "conditions")
		for _, c := range conds {
			m, _ := c.(map[string]any)
			if m["type"] == "Established" && m["status"] == "True" {
				return true, nil
			}
		}
		last = fmt.Sprintf("conditions %v", conds)
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("kubetest: CRD %s not Established: %w (%s)", name, err, last)
	}
	return nil
}

// Namespace creates a namespace named prefix-<random> and returns its
// name. It is not deleted: without a controller-manager a deleted
// namespace stays Terminating; the server and its data go at Stop.
func (s *Server) Namespace(t testing.TB, prefix string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
	defer cancel()
	ns, err := s.Clientset().CoreV1().Namespaces().Create(ctx,
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("kubetest: create namespace: %v", err)
	}
	return ns.Name
}

// CreatePod creates a pod with the labels and one container ("engine",
// an image that is never pulled) exposing the TCP ports. It is never
// scheduled: its status is Pending without an IP until SetPodReady.
func (s *Server) CreatePod(t testing.TB, namespace, name string, labels map[string]string, ports ...int32) *corev1.Pod {
	t.Helper()
	c := corev1.Container{Name: "engine", Image: "infergate.invalid/engine:none"}
	for _, p := range ports {
		c.Ports = append(c.Ports, corev1.ContainerPort{ContainerPort: p, Protocol: corev1.ProtocolTCP})
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: labels},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{c}},
	}
	ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
	defer cancel()
	got, err := s.Clientset().CoreV1().Pods(namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("kubetest: create pod %s/%s: %v", namespace, name, err)
	}
	return got
}

// SetPodReady writes the pod's status as a kubelet would for a running
// pod: phase Running, podIP and podIPs ip, and the Ready and
// ContainersReady conditions True (ready) or False (not ready). It
// retries on update conflicts and returns the stored pod.
func (s *Server) SetPodReady(t testing.TB, namespace, name, ip string, ready bool) *corev1.Pod {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
	defer cancel()
	pods := s.Clientset().CoreV1().Pods(namespace)
	var out *corev1.Pod
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		pod, err := pods.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		st := corev1.ConditionFalse
		if ready {
			st = corev1.ConditionTrue
		}
		now := metav1.Now()
		pod.Status.Phase = corev1.PodRunning
		pod.Status.PodIP = ip
		pod.Status.PodIPs = []corev1.PodIP{{IP: ip}}
		pod.Status.HostIP = "127.0.0.1"
		pod.Status.HostIPs = []corev1.HostIP{{IP: "127.0.0.1"}}
		if pod.Status.StartTime == nil {
			pod.Status.StartTime = &now
		}
		pod.Status.Conditions = []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: corev1.PodInitialized, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: corev1.ContainersReady, Status: st, LastTransitionTime: now},
			{Type: corev1.PodReady, Status: st, LastTransitionTime: now},
		}
		out, err = pods.UpdateStatus(ctx, pod, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("kubetest: pod %s/%s status: %v", namespace, name, err)
	}
	return out
}

// DeletePod deletes the pod and waits until it is gone (an unscheduled pod
// goes at once; a pod has no kubelet to confirm a graceful deletion, so
// the grace period is 0).
func (s *Server) DeletePod(t testing.TB, namespace, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
	defer cancel()
	pods := s.Clientset().CoreV1().Pods(namespace)
	zero := int64(0)
	if err := pods.Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatalf("kubetest: delete pod %s/%s: %v", namespace, name, err)
	}
	err := wait.PollUntilContextCancel(ctx, 50*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		_, err := pods.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("kubetest: pod %s/%s still there after delete: %v", namespace, name, err)
	}
}
