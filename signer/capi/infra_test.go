package capi

import (
	"context"
	"testing"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// TestInfrastructureEndorsementKey: an endorsement key pinned on the
// Machine's infrastructure object reaches the verifier as a pin of the
// Machine's; a Machine and an infrastructure object that pin different
// keys are a denial, not a guess.
func TestInfrastructureEndorsementKey(t *testing.T) {
	gvk := schema.GroupVersionKind{Group: "infrastructure.cluster.x-k8s.io", Version: "v1beta1", Kind: "TestMachine"}
	mapper := meta.NewDefaultRESTMapper([]schema.GroupVersion{gvk.GroupVersion()})
	mapper.Add(gvk, meta.RESTScopeNamespace)
	scheme := runtime.NewScheme()
	if err := clusterv1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name           string
		machine, infra string // pinned EKs; "" = none
		want           string // pin the verifier sees
		reason         string
		unserved       bool   // the management cluster serves no such kind
		group          string // the reference's group, when not the infrastructure one
		missing        bool   // no infrastructure object
		cacheBehind    bool   // the cache has not seen the infrastructure object yet
	}{
		{name: "infrastructure only", infra: "ek-a", want: "ek-a"},
		{name: "Machine only", machine: "ek-a", want: "ek-a"},
		{name: "both agree", machine: "ek-a", infra: "ek-a", want: "ek-a"},
		{name: "conflict", machine: "ek-a", infra: "ek-b", reason: attestor.ReasonEndorsementKeyConflict},
		{name: "neither"},
		{name: "kind not served", infra: "ek-b", machine: "ek-a", want: "ek-a", unserved: true},
		{name: "a reference outside the infrastructure group is not followed", infra: "ek-b", machine: "ek-a", want: "ek-a", group: "example.com"},
		{name: "infrastructure object gone", machine: "ek-a", missing: true, reason: attestor.ReasonMachineNotFound},
		{name: "an object the cache has not seen yet is confirmed live, not denied", infra: "ek-a", want: "ek-a", cacheBehind: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := machine("m1", "test:///1")
			m.Spec.InfrastructureRef = clusterv1.ContractVersionedObjectReference{APIGroup: gvk.Group, Kind: gvk.Kind, Name: "m1-infra"}
			if tc.group != "" {
				m.Spec.InfrastructureRef.APIGroup = tc.group
				mapper.Add(schema.GroupVersionKind{Group: tc.group, Version: "v1", Kind: gvk.Kind}, meta.RESTScopeNamespace)
			}
			if tc.machine != "" {
				m.Annotations = map[string]string{attestor.AnnotationEndorsementKey: tc.machine}
			}
			m.Labels = map[string]string{clusterv1.ClusterNameLabel: "c"}
			infra := &unstructured.Unstructured{}
			infra.SetGroupVersionKind(gvk)
			infra.SetNamespace("ns")
			infra.SetName("m1-infra")
			if tc.infra != "" {
				infra.SetAnnotations(map[string]string{attestor.AnnotationEndorsementKey: tc.infra})
			}
			objs := []client.Object{&m}
			if !tc.missing {
				objs = append(objs, infra)
			}
			c := fake.NewClientBuilder().WithScheme(scheme).WithRESTMapper(mapper).
				WithObjects(objs...).
				WithIndex(&clusterv1.Machine{}, IndexProviderID, func(o client.Object) []string { return ProviderIDIndexer(o) }).
				Build()
			matcher := &Matcher{Cache: c, Live: c, Namespace: "ns", Cluster: "c", Mapper: mapper}
			if tc.cacheBehind {
				matcher.Cache = fake.NewClientBuilder().WithScheme(scheme).WithRESTMapper(mapper).
					WithObjects(&m).
					WithIndex(&clusterv1.Machine{}, IndexProviderID, func(o client.Object) []string { return ProviderIDIndexer(o) }).
					Build()
			}
			if tc.unserved {
				matcher.Mapper = meta.NewDefaultRESTMapper(nil)
			}
			got, err := matcher.MatchMachine(context.Background(), "m1", "test:///1")
			if tc.reason != "" {
				if r, _, ok := attestor.Denial(err); !ok || r != tc.reason {
					t.Fatalf("MatchMachine() = %v, want denied %s", err, tc.reason)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if pin := got.Annotations[attestor.AnnotationEndorsementKey]; pin != tc.want {
				t.Errorf("pin the verifier sees = %q, want %q", pin, tc.want)
			}
		})
	}
}
