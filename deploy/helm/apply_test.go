package helm

import (
	"context"
	"strings"
	"testing"

	authzv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/infergate/infergate/internal/kubetest"
)

// The chart, rendered by the real helm with its CRD, applied object by
// object to a real API server (server-side apply; internal/kubetest):
// the API server validates every field against its schemas (Deployment,
// probes, PDB, RBAC, the InferencePool against the CRD), which `helm
// template` and `helm lint` do not. Then the chart's Role is checked by
// SubjectAccessReview for its ServiceAccount: discovery's reads and
// nothing more. HTTPRoute is left out (httpRoute.create=false): its CRD
// comes with a Gateway implementation, not with this chart.
func TestChartApply(t *testing.T) {
	bin := Require(t)
	s := kubetest.Start(t, kubetest.Options{})
	cases := []struct {
		name string
		set  []string
		want []string // kinds that must have been applied
	}{
		{name: "epp", set: []string{"replicas=2", "inferencePool.targetPorts={8000,8001}"},
			want: []string{"CustomResourceDefinition", "InferencePool", "Deployment", "Service", "ConfigMap",
				"ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget"}},
		{name: "serve", set: []string{"mode=serve", "discovery.service=vllm", "discovery.port=http"},
			want: []string{"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ns := s.Namespace(t, c.name)
			ctx, cancel := context.WithTimeout(context.Background(), 2*kubetest.OpTimeout)
			defer cancel()
			docs, err := Template(ctx, bin, Options{Namespace: ns, Set: c.set, IncludeCRDs: true})
			if err != nil {
				t.Fatal(err)
			}
			manifests := make([][]byte, len(docs))
			for i, d := range docs {
				manifests[i] = []byte(d)
			}
			objs, err := s.ApplyManifests(ctx, ns, manifests...)
			if err != nil {
				t.Fatal(err)
			}
			applied := map[string]bool{}
			sa := ""
			for _, o := range objs {
				applied[o.GetKind()] = true
				if o.GetKind() == "ServiceAccount" {
					sa = o.GetName()
				}
			}
			for _, k := range c.want {
				if !applied[k] {
					t.Errorf("no %s applied (applied: %v)", k, applied)
				}
			}
			if len(objs) != len(docs) {
				t.Errorf("%d objects applied from %d documents", len(objs), len(docs))
			}
			// Everything the server stored reads back from its API.
			for _, o := range objs {
				if o.GetUID() == "" {
					t.Errorf("%s %s: no uid in the apply answer", o.GetKind(), o.GetName())
				}
			}
			if sa == "" {
				t.Fatal("no ServiceAccount rendered")
			}
			checkAccess(t, ctx, s, ns, sa)
		})
	}
	// What helm renders without complaint (values.schema.json does not
	// check label values) the API server refuses: the CRD's pattern for a
	// label value.
	t.Run("refused", func(t *testing.T) {
		ns := s.Namespace(t, "refused")
		ctx, cancel := context.WithTimeout(context.Background(), 2*kubetest.OpTimeout)
		defer cancel()
		docs, err := Template(ctx, bin, Options{Namespace: ns, Set: []string{"inferencePool.selector.app=-bad-"}, IncludeCRDs: true})
		if err != nil {
			t.Fatalf("helm template refused it already (the test needs a value helm accepts): %v", err)
		}
		manifests := make([][]byte, len(docs))
		for i, d := range docs {
			manifests[i] = []byte(d)
		}
		_, err = s.ApplyManifests(ctx, ns, manifests...)
		if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "InferencePool") {
			t.Fatalf("apply with selector app=-bad-: %v, want the InferencePool refused as Invalid", err)
		}
		t.Logf("refused as expected: %v", err)
	})
}

// checkAccess asks the API server's RBAC authorizer what the chart's
// ServiceAccount may do: get/list/watch InferencePools, pods and
// EndpointSlices in its namespace, and not read Secrets, write pods or
// read pods in another namespace.
func checkAccess(t *testing.T, ctx context.Context, s *kubetest.Server, ns, sa string) {
	t.Helper()
	user := "system:serviceaccount:" + ns + ":" + sa
	groups := []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}
	type access struct {
		gr       schema.GroupResource
		verb, ns string
		allowed  bool
	}
	pods := schema.GroupResource{Resource: "pods"}
	checks := []access{
		{schema.GroupResource{Group: "inference.networking.k8s.io", Resource: "inferencepools"}, "watch", ns, true},
		{pods, "list", ns, true},
		{pods, "watch", ns, true},
		{schema.GroupResource{Group: "discovery.k8s.io", Resource: "endpointslices"}, "list", ns, true},
		{schema.GroupResource{Resource: "secrets"}, "get", ns, false},
		{pods, "delete", ns, false},
		{pods, "list", "kube-system", false},
	}
	for _, c := range checks {
		r, err := s.Clientset().AuthorizationV1().SubjectAccessReviews().Create(ctx, &authzv1.SubjectAccessReview{
			Spec: authzv1.SubjectAccessReviewSpec{
				User:   user,
				Groups: groups,
				ResourceAttributes: &authzv1.ResourceAttributes{
					Namespace: c.ns, Verb: c.verb, Group: c.gr.Group, Resource: c.gr.Resource,
				},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if r.Status.Allowed != c.allowed {
			t.Errorf("%s %s %s in %s: allowed %v, want %v (%s)", sa, c.verb, c.gr, c.ns, r.Status.Allowed, c.allowed, r.Status.Reason)
		}
	}
}
