package capi

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrlcache "sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// tenantMetadata gives an object as much metadata as a namespace tenant
// may write: 250 KiB of annotations, 4,000 labels, 2,000 finalizers, owner
// references and managed fields, next to what the signer reads (keep).
func tenantMetadata(o *metav1.ObjectMeta, keepLabels, keepAnnotations map[string]string) {
	o.Labels, o.Annotations = maps.Clone(keepLabels), maps.Clone(keepAnnotations)
	if o.Labels == nil {
		o.Labels = map[string]string{}
	}
	if o.Annotations == nil {
		o.Annotations = map[string]string{}
	}
	for i := range 250 {
		o.Annotations[fmt.Sprintf("example.com/padding-%03d", i)] = strings.Repeat("a", 1000)
	}
	for i := range 4000 {
		o.Labels[fmt.Sprintf("example.com/label-%04d", i)] = fmt.Sprintf("value-%04d", i)
	}
	for i := range 2000 {
		o.Finalizers = append(o.Finalizers, fmt.Sprintf("example.com/finalizer-%04d", i))
	}
	o.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "ConfigMap", Name: "x", UID: "u"}}
	o.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubectl", FieldsV1: metav1.NewFieldsV1(`{"f:metadata":{}}`)}}
}

func transformFor(t *testing.T, opts ctrlcache.Options, obj client.Object) func(any) (any, error) {
	t.Helper()
	for o, by := range opts.ByObject {
		if fmt.Sprintf("%T", o) == fmt.Sprintf("%T", obj) && by.Transform != nil {
			return by.Transform
		}
	}
	if opts.DefaultTransform == nil {
		t.Fatalf("no transform for %T", obj)
	}
	return opts.DefaultTransform
}

func jsonSize(t *testing.T, o any) int {
	t.Helper()
	b, err := json.Marshal(o)
	if err != nil {
		t.Fatal(err)
	}
	return len(b)
}

// TestCacheOptions: of a Cluster, a Machine and an infrastructure object
// full of a tenant's metadata, the manager's cache keeps only what the
// signer reads, and the signer decides the same from what it keeps: the
// Machine is matched by provider ID within its Cluster, its endorsement
// key pin and its infrastructure object's reach the verifier, and the
// Cluster's switches, attestors and policies read the same.
func TestCacheOptions(t *testing.T) {
	opts := CacheOptions()
	const bound = 2 << 10

	m := machine("m1", "test:///1", withAddress(clusterv1.MachineHostName, "node-1"))
	gvk := schema.GroupVersionKind{Group: infrastructureGroup, Version: "v1beta1", Kind: "TestMachine"}
	m.Spec.InfrastructureRef = clusterv1.ContractVersionedObjectReference{APIGroup: gvk.Group, Kind: gvk.Kind, Name: "m1-infra"}
	tenantMetadata(&m.ObjectMeta, map[string]string{clusterv1.ClusterNameLabel: "c"}, map[string]string{attestor.AnnotationEndorsementKey: "ek-a"})
	before := jsonSize(t, &m)
	out, err := transformFor(t, opts, &m)(&m)
	if err != nil {
		t.Fatal(err)
	}
	cm := out.(*clusterv1.Machine)
	if want := map[string]string{clusterv1.ClusterNameLabel: "c"}; !maps.Equal(cm.Labels, want) {
		t.Errorf("Machine cached with %d labels, want only %v", len(cm.Labels), want)
	}
	if want := map[string]string{attestor.AnnotationEndorsementKey: "ek-a"}; !maps.Equal(cm.Annotations, want) {
		t.Errorf("Machine cached with %d annotations, want only %v", len(cm.Annotations), want)
	}
	if len(cm.Finalizers)+len(cm.OwnerReferences)+len(cm.ManagedFields) != 0 {
		t.Errorf("Machine cached with %d finalizers, %d owner references, %d managed fields; want none", len(cm.Finalizers), len(cm.OwnerReferences), len(cm.ManagedFields))
	}
	if after := jsonSize(t, cm); after > bound {
		t.Errorf("Machine cached with %d bytes (%d as written), want at most %d", after, before, bound)
	} else {
		t.Logf("Machine: %d bytes as written, %d cached", before, after)
	}

	infra := &metav1.PartialObjectMetadata{}
	infra.SetGroupVersionKind(gvk)
	infra.Namespace, infra.Name = "ns", "m1-infra"
	tenantMetadata(&infra.ObjectMeta, nil, map[string]string{attestor.AnnotationEndorsementKey: "ek-a"})
	out, err = transformFor(t, opts, infra)(infra)
	if err != nil {
		t.Fatal(err)
	}
	ci := out.(*metav1.PartialObjectMetadata)
	if len(ci.Labels)+len(ci.Finalizers)+len(ci.OwnerReferences)+len(ci.ManagedFields) != 0 || len(ci.Annotations) != 1 {
		t.Errorf("infrastructure object cached with %d labels, %d annotations, %d finalizers; want only its pin", len(ci.Labels), len(ci.Annotations), len(ci.Finalizers))
	}
	if after := jsonSize(t, ci); after > bound {
		t.Errorf("infrastructure object cached with %d bytes, want at most %d", after, bound)
	}

	// The matcher decides from what is kept.
	mapper := meta.NewDefaultRESTMapper([]schema.GroupVersion{gvk.GroupVersion()})
	mapper.Add(gvk, meta.RESTScopeNamespace)
	scheme := runtime.NewScheme()
	if err := clusterv1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	stored := &unstructured.Unstructured{}
	stored.SetGroupVersionKind(gvk)
	stored.SetNamespace(ci.Namespace)
	stored.SetName(ci.Name)
	stored.SetAnnotations(ci.Annotations)
	c := fake.NewClientBuilder().WithScheme(scheme).WithRESTMapper(mapper).WithObjects(cm, stored).
		WithIndex(&clusterv1.Machine{}, IndexProviderID, ProviderIDIndexer).Build()
	matcher := &Matcher{Cache: c, Live: c, Namespace: "ns", Cluster: "c", Mapper: mapper}
	got, err := matcher.MatchMachine(context.Background(), "node-1", "test:///1")
	if err != nil {
		t.Fatalf("the cached Machine does not match: %v", err)
	}
	if got.Annotations[attestor.AnnotationEndorsementKey] != "ek-a" || got.Name != "m1" {
		t.Errorf("matched %s with pins %v", got, got.Annotations)
	}

	cluster := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c", Generation: 7}}
	ours := map[string]string{
		AnnotationEnabled:             "true",
		AnnotationAuthorizedAttestors: "tpm,aws",
		AnnotationLockdown:            "true",
		AnnotationPolicyPrefix + "tpm" + AnnotationPolicySuffix: `{"pcrs":[7]}`,
	}
	filter := map[string]string{LabelWatchFilter: "shard-1"}
	tenantMetadata(&cluster.ObjectMeta, filter, ours)
	out, err = transformFor(t, opts, cluster)(cluster)
	if err != nil {
		t.Fatal(err)
	}
	cc := out.(*clusterv1.Cluster)
	if !maps.Equal(cc.Annotations, ours) || !maps.Equal(cc.Labels, filter) || len(cc.Finalizers)+len(cc.OwnerReferences) != 0 || cc.Generation != 7 {
		t.Errorf("Cluster cached with %d annotations, labels %v, %d finalizers, generation %d; want only this project's %d annotations and the watch-filter label",
			len(cc.Annotations), cc.Labels, len(cc.Finalizers), cc.Generation, len(ours))
	}
	p, _ := ParseClusterPolicy(cc, nil, nil)
	if !Enabled(cc) || !p.Lockdown || strings.Join(p.AuthorizedAttestors, ",") != "tpm,aws" || p.Policies["tpm"] != `{"pcrs":[7]}` {
		t.Errorf("the cached Cluster reads differently: enabled %t, policy %+v", Enabled(cc), p)
	}

	spec := &v1alpha1.ClusterAttestationSpec{AuthorizedAttestors: []string{"tpm"}, Lockdown: true,
		Policies: map[string]v1alpha1.PolicyDocument{"tpm": `{"pcrs":[7]}`}}
	att := &v1alpha1.ClusterAttestation{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c", Generation: 3}, Spec: spec.DeepCopy(),
		Status: v1alpha1.ClusterAttestationStatus{ClusterName: "c", SignerNames: []string{"x"}}}
	tenantMetadata(&att.ObjectMeta, nil, nil)
	out, err = transformFor(t, opts, att)(att)
	if err != nil {
		t.Fatal(err)
	}
	ca := out.(*v1alpha1.ClusterAttestation)
	if len(ca.Annotations)+len(ca.Labels)+len(ca.Finalizers)+len(ca.OwnerReferences)+len(ca.ManagedFields) != 0 || ca.Generation != 3 ||
		ca.Status.ClusterName != "" || !equality.Semantic.DeepEqual(ca.Spec, spec) {
		t.Errorf("ClusterAttestation cached as %+v; want its name, generation and spec only", ca)
	}
}
