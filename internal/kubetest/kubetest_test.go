package kubetest

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// One server for the package's tests (a start costs seconds of CPU); tests
// use their own namespaces.
func TestServer(t *testing.T) {
	start := time.Now()
	s := Start(t, Options{})
	t.Logf("etcd and kube-apiserver ready in %v at %s", time.Since(start).Round(time.Millisecond), s.URL)

	t.Run("version", func(t *testing.T) {
		v, err := s.Clientset().Discovery().ServerVersion()
		if err != nil {
			t.Fatal(err)
		}
		if v.GitVersion != Version {
			t.Errorf("server version %s, want %s", v.GitVersion, Version)
		}
	})

	t.Run("kubeconfig", func(t *testing.T) {
		// The file a process gets with --kubeconfig reaches the same server
		// with the same rights.
		cfg, err := clientcmd.BuildConfigFromFlags("", s.Kubeconfig)
		if err != nil {
			t.Fatal(err)
		}
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
		defer cancel()
		if _, err := cs.CoreV1().Namespaces().List(ctx, metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("pods", func(t *testing.T) {
		ns := s.Namespace(t, "pods")
		labels := map[string]string{"app": "vllm"}
		pod := s.CreatePod(t, ns, "vllm-0", labels, 8000, 8001)
		if pod.Status.PodIP != "" || pod.Spec.Containers[0].Ports[1].ContainerPort != 8001 {
			t.Fatalf("created pod: ip %q ports %v", pod.Status.PodIP, pod.Spec.Containers[0].Ports)
		}
		pod = s.SetPodReady(t, ns, "vllm-0", "10.1.2.3", true)
		if pod.Status.PodIP != "10.1.2.3" || pod.Status.Phase != corev1.PodRunning || !podReady(pod) {
			t.Fatalf("after SetPodReady: %+v", pod.Status)
		}
		// Read back through a label selector, as discovery lists them.
		ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
		defer cancel()
		list, err := s.Clientset().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=vllm"})
		if err != nil || len(list.Items) != 1 || list.Items[0].Status.PodIP != "10.1.2.3" || !podReady(&list.Items[0]) {
			t.Fatalf("list app=vllm: %v %+v", err, list)
		}
		pod = s.SetPodReady(t, ns, "vllm-0", "10.1.2.3", false)
		if podReady(pod) {
			t.Fatal("pod still Ready after SetPodReady(false)")
		}
		s.DeletePod(t, ns, "vllm-0")
		if _, err := s.Clientset().CoreV1().Pods(ns).Get(ctx, "vllm-0", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Fatalf("get after delete: %v", err)
		}
	})

	t.Run("inferencepool", func(t *testing.T) {
		s.InstallInferencePoolCRD(t)
		s.InstallInferencePoolCRD(t) // applying again is a no-op, not an error
		ns := s.Namespace(t, "pool")
		ctx, cancel := context.WithTimeout(context.Background(), OpTimeout)
		defer cancel()
		pool := `apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata:
  name: llama
spec:
  selector:
    matchLabels:
      app: vllm
  targetPorts:
  - number: 8000
  - number: 8001
  endpointPickerRef:
    name: infergate-epp
    port:
      number: 9002
`
		if _, err := s.ApplyManifests(ctx, ns, []byte(pool)); err != nil {
			t.Fatal(err)
		}
		got, err := s.Dynamic().Resource(InferencePoolGVR).Namespace(ns).Get(ctx, "llama", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		ports, _, _ := unstructured.NestedSlice(got.Object, "spec", "targetPorts")
		app, _, _ := unstructured.NestedString(got.Object, "spec", "selector", "matchLabels", "app")
		// failureMode and kind are defaulted by the CRD's schema.
		mode, _, _ := unstructured.NestedString(got.Object, "spec", "endpointPickerRef", "failureMode")
		kind, _, _ := unstructured.NestedString(got.Object, "spec", "endpointPickerRef", "kind")
		if len(ports) != 2 || app != "vllm" || mode != "FailClose" || kind != "Service" {
			t.Errorf("read back: ports %v app %q failureMode %q kind %q", ports, app, mode, kind)
		}

		// The schema is enforced: a port out of range is refused.
		bad := strings.Replace(pool, "number: 8001", "number: 70000", 1)
		bad = strings.Replace(bad, "name: llama", "name: bad", 1)
		_, err = s.ApplyManifests(ctx, ns, []byte(bad))
		if err == nil || !apierrors.IsInvalid(err) {
			t.Errorf("pool with port 70000: err %v, want Invalid", err)
		}
	})

	// The figures README.md quotes: peak resident memory of each process.
	t.Logf("peak RSS after the subtests: kube-apiserver %s, etcd %s",
		procStatus(s.apiserver.cmd.Process.Pid, "VmHWM"), procStatus(s.etcd.cmd.Process.Pid, "VmHWM"))

	t.Run("stop", func(t *testing.T) {
		// A second server stops cleanly and takes its directory with it.
		s2, err := New(context.Background(), Options{})
		if err != nil {
			t.Fatal(err)
		}
		dir := s2.Dir
		if err := s2.Stop(); err != nil {
			t.Fatal(err)
		}
		if err := s2.Stop(); err != nil {
			t.Fatalf("second Stop: %v", err)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("%s still there after Stop: %v", dir, err)
		}
	})
}

// procStatus reads one field of /proc/<pid>/status ("?" where unreadable).
func procStatus(pid int, field string) string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return "?"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "?"
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func TestDecodeManifests(t *testing.T) {
	objs, err := DecodeManifests([]byte("---\n# comment only\n---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: a\n---\n"),
		[]byte(`{"apiVersion":"v1","kind":"Service","metadata":{"name":"b"}}`))
	if err != nil || len(objs) != 2 || objs[0].GetName() != "a" || objs[1].GetKind() != "Service" {
		t.Fatalf("DecodeManifests: %v %v", objs, err)
	}
	if _, err := DecodeManifests([]byte("kind: ConfigMap\nmetadata:\n  name: a\n")); err == nil {
		t.Error("a document without apiVersion decoded")
	}
	if _, err := DecodeManifests(make([]byte, MaxManifestBytes+1)); err == nil {
		t.Error("an oversized manifest decoded")
	}
}

func TestBinariesMissing(t *testing.T) {
	t.Setenv(EnvKubeDir, t.TempDir())
	if _, _, err := Binaries(); err == nil || !strings.Contains(err.Error(), EnvKubeDir) {
		t.Errorf("Binaries with an empty %s: %v", EnvKubeDir, err)
	}
}
