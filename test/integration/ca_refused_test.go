//go:build testattestors

package integration

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor/null"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestCAOfAnotherCluster: a tenant publishes another cluster's CA
// certificate in its `<cluster>-ca` Secret, with a key of its own, so that
// evidence naming that cluster would verify in its own. The controller
// refuses the Secret before anything else: a Warning Event CARefused on the
// Cluster, its ClusterAttestation not Ready with that reason; the victim's
// Cluster is served.
func TestCAOfAnotherCluster(t *testing.T) {
	harness.Binaries(t)
	mgmt := harness.StartManagement(t)
	victim, copier := harness.StartControlPlane(t, "victim"), harness.StartControlPlane(t, "copier")
	annotations := map[string]string{capi.AnnotationEnabled: "true", capi.AnnotationAuthorizedAttestors: null.Name}
	mgmt.AddWorkloadCluster(t, "tenant-victim", "victim", victim, annotations)
	mgmt.AddWorkloadCluster(t, "tenant-copier", "copier", copier, annotations)
	ctx := context.Background()
	var s corev1.Secret
	if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: "tenant-copier", Name: "copier" + capi.CASecretSuffix}, &s); err != nil {
		t.Fatal(err)
	}
	s.Data[corev1.TLSCertKey] = victim.CACertPEM
	if err := mgmt.Client.Update(ctx, &s); err != nil {
		t.Fatal(err)
	}
	runSigner(t, mgmt, func(o *app.Options) { o.NullVersions = []string{"v1"} })

	ready := func(ns, name string) (status, reason string) {
		att := &unstructured.Unstructured{}
		att.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
		if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, att); err != nil {
			return "", ""
		}
		conds, _, _ := unstructured.NestedSlice(att.Object, "status", "conditions")
		for _, c := range conds {
			if c, _ := c.(map[string]any); c["type"] == capi.ConditionReady {
				status, _ = c["status"].(string)
				reason, _ = c["reason"].(string)
			}
		}
		return status, reason
	}
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		st, reason := ready("tenant-copier", "copier")
		return st == "False" && reason == capi.ReasonCARefused, nil
	})
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		var events corev1.EventList
		if err := mgmt.Client.List(ctx, &events, client.InNamespace("tenant-copier")); err != nil {
			return false, err
		}
		for _, e := range events.Items {
			if e.InvolvedObject.Kind == "Cluster" && e.InvolvedObject.Name == "copier" && e.Reason == capi.ReasonCARefused && e.Type == corev1.EventTypeWarning {
				return true, nil
			}
		}
		return false, nil
	})
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		st, _ := ready("tenant-victim", "victim")
		return st == "True", nil
	})
}
