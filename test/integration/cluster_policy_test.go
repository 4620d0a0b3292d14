package integration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

// TestClusterPolicySpec is issue 28's typed policy: a Cluster's policy is
// the spec of its ClusterAttestation, refused by the API server when it is
// malformed, and once written it replaces the deprecated annotations,
// which keep working until then (with a deprecation Event).
func TestClusterPolicySpec(t *testing.T) {
	e := startSigner(t) // opted in, the policy in annotations: insecure
	ctx := context.Background()
	kubeletServing := "kubernetes.io/kubelet-serving"

	// The annotations still work, and the Cluster is told they are deprecated.
	st := e.waitAttestation(t, "under the annotations", func(st v1alpha1.ClusterAttestationStatus) string {
		if st.PolicySource != v1alpha1.PolicySourceAnnotations {
			return fmt.Sprintf("policySource %q", st.PolicySource)
		}
		return hasCondition(st, capi.ConditionPolicyValid, metav1.ConditionTrue, "Valid")
	})
	if slices.Contains(st.SignerNames, kubeletServing) {
		t.Fatalf("kubelet-serving approval without asking for it: %v", st.SignerNames)
	}
	expectClusterEvent(t, e, capi.ReasonPolicyAnnotationsDeprecated, "ClusterAttestation "+signerCluster)

	// The API server refuses a malformed policy when it is written.
	for _, tc := range []struct {
		name, spec, says string
	}{
		{"a switch that is not a boolean", `{"authorizedAttestors":["insecure"],"lockdown":"True"}`, "spec.lockdown"},
		{"no attestor", `{"authorizedAttestors":[]}`, "spec.authorizedAttestors"},
		{"an attestor name that is no name", `{"authorizedAttestors":["TPM,aws"]}`, "spec.authorizedAttestors[0]"},
		{"a repeated attestor", `{"authorizedAttestors":["tpm","tpm"]}`, "spec.authorizedAttestors[1]"},
		{"a policy of an attestor not authorized", `{"authorizedAttestors":["insecure"],"policies":{"tpm":"x"}}`, "authorize the attestor or drop its policy"},
		{"an empty policy", `{"authorizedAttestors":["tpm"],"policies":{"tpm":""}}`, "spec.policies.tpm"},
		{"an unknown field", `{"authorizedAttestors":["tpm"],"lockdwon":true}`, "lockdwon"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			obj := &unstructured.Unstructured{}
			obj.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
			if err := obj.UnmarshalJSON(fmt.Appendf(nil, `{"apiVersion":%q,"kind":"ClusterAttestation","metadata":{"namespace":%q,"name":"refused"},"spec":%s}`,
				v1alpha1.GroupVersion, signerNS, tc.spec)); err != nil {
				t.Fatal(err)
			}
			err := e.mgmt.Client.Create(ctx, obj, client.FieldValidation(metav1.FieldValidationStrict))
			if err == nil {
				_ = e.mgmt.Client.Delete(ctx, obj)
				t.Fatalf("the API server took spec %s", tc.spec)
			}
			if !strings.Contains(err.Error(), tc.says) {
				t.Errorf("the refusal does not say %q: %v", tc.says, err)
			}
		})
	}

	// The spec becomes the policy: kubelet-serving approval is served, the
	// annotations are ignored (and the Cluster is told), nodes still join.
	patchSpec := func(spec string) {
		t.Helper()
		obj := &unstructured.Unstructured{}
		obj.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
		obj.SetNamespace(signerNS)
		obj.SetName(signerCluster)
		if err := e.mgmt.Client.Patch(ctx, obj, client.RawPatch(types.MergePatchType, fmt.Appendf(nil, `{"spec":%s}`, spec))); err != nil {
			t.Fatal(err)
		}
	}
	patchSpec(`{"authorizedAttestors":["insecure"],"approveKubeletServing":true}`)
	e.waitAttestation(t, "under the spec", func(st v1alpha1.ClusterAttestationStatus) string {
		if st.PolicySource != v1alpha1.PolicySourceSpec || !slices.Contains(st.SignerNames, kubeletServing) {
			return fmt.Sprintf("policySource %q, signer names %v", st.PolicySource, st.SignerNames)
		}
		return hasCondition(st, capi.ConditionPolicyValid, metav1.ConditionTrue, "Valid")
	})
	expectClusterEvent(t, e, capi.ReasonPolicyAnnotationsIgnored, capi.AnnotationAuthorizedAttestors)
	e.mgmt.CreateMachine(t, signerNS, signerCluster, "worker-spec", "test:///spec", true)
	req, _ := signertest.Request{NodeName: "worker-spec", ProviderID: "test:///spec"}.Build(t)
	e.file(t, signertest.CSR("join-worker-spec", req))
	e.expectIssued(t, "join-worker-spec", "worker-spec", "test:///spec", 24*time.Hour)

	// A spec the schema takes but this controller cannot serve says what to
	// change, at its path.
	patchSpec(`{"authorizedAttestors":["insecure","nosuch"],"approveKubeletServing":false}`)
	st = e.waitAttestation(t, "with an attestor not served", func(st v1alpha1.ClusterAttestationStatus) string {
		return hasCondition(st, capi.ConditionPolicyValid, metav1.ConditionFalse, "Invalid")
	})
	for _, c := range st.Conditions {
		if c.Type == capi.ConditionPolicyValid && (!strings.Contains(c.Message, "spec.authorizedAttestors[1]") || !strings.Contains(c.Message, `"nosuch"`)) {
			t.Errorf("PolicyValid does not name spec.authorizedAttestors[1] and its value: %s", c.Message)
		}
	}
	if slices.Contains(st.SignerNames, kubeletServing) {
		t.Errorf("kubelet-serving approval still served after the spec dropped it: %v", st.SignerNames)
	}
}
