package capi

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation/field"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// policyVerifier accepts a policy document only when it is "good".
type policyVerifier struct{ insecure.Verifier }

func (policyVerifier) ValidatePolicy(doc []byte) error {
	if string(doc) != "good" {
		return errors.New("kind is missing")
	}
	return nil
}

func TestValidateAnnotations(t *testing.T) {
	verifiers := map[string]attestor.Verifier{"insecure": insecure.Verifier{}, "tpm": policyVerifier{}}
	for _, tc := range []struct {
		name        string
		annotations map[string]string
		want        []string // "type field" of each error, in order
	}{
		{"valid", map[string]string{AnnotationAuthorizedAttestors: "tpm, insecure", "kubelet-authenticator.x-k8s.io/tpm-policy": "good", AnnotationLockdown: "true"}, nil},
		{"unknown attestor", map[string]string{AnnotationAuthorizedAttestors: "tpm,tmp"},
			[]string{"FieldValueNotSupported metadata.annotations[kubelet-authenticator.x-k8s.io/authorized-attestors]"}},
		{"no attestor", map[string]string{AnnotationAuthorizedAttestors: " , "},
			[]string{"FieldValueRequired metadata.annotations[kubelet-authenticator.x-k8s.io/authorized-attestors]"}},
		{"malformed policy", map[string]string{AnnotationAuthorizedAttestors: "tpm", "kubelet-authenticator.x-k8s.io/tpm-policy": "bad"},
			[]string{"FieldValueInvalid metadata.annotations[kubelet-authenticator.x-k8s.io/tpm-policy]"}},
		{"oversize policy", map[string]string{AnnotationAuthorizedAttestors: "tpm", "kubelet-authenticator.x-k8s.io/tpm-policy": strings.Repeat("x", MaxPolicySize+1)},
			[]string{"FieldValueTooLong metadata.annotations[kubelet-authenticator.x-k8s.io/tpm-policy]"}},
		{"policy of an unknown provider", map[string]string{AnnotationAuthorizedAttestors: "tpm", "kubelet-authenticator.x-k8s.io/aws-policy": "{}"},
			[]string{"FieldValueNotSupported metadata.annotations[kubelet-authenticator.x-k8s.io/aws-policy]"}},
		{"switches", map[string]string{AnnotationAuthorizedAttestors: "tpm", AnnotationLockdown: "True", AnnotationApproveKubeletServing: "yes"},
			[]string{"FieldValueNotSupported metadata.annotations[kubelet-authenticator.x-k8s.io/lockdown]",
				"FieldValueNotSupported metadata.annotations[kubelet-authenticator.x-k8s.io/approve-kubelet-serving]"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Annotations: tc.annotations}}
			errs := ValidateAnnotations(c, verifiers)
			var got []string
			for _, e := range errs {
				got = append(got, string(e.Type)+" "+e.Field)
			}
			if strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Errorf("errors:\n%v\nwant:\n%v", errs, tc.want)
			}
			for _, e := range errs {
				if e.Type == field.ErrorTypeInvalid && strings.Contains(e.Error(), "bad") {
					t.Errorf("the error repeats the policy document: %v", e)
				}
			}
		})
	}
}

func TestServedSignerNames(t *testing.T) {
	profiles := engine.Profiles(engine.ProfileSet{
		Verifiers:      map[string]attestor.Verifier{"insecure": insecure.Verifier{}, "tpm": policyVerifier{}},
		ClientOnly:     []string{"insecure"},
		Serving:        &issue.Signer{},
		KubeletServing: true,
	})
	got := servedSignerNames(profiles, []string{"insecure"})
	want := []string{attestor.ClientSignerName("insecure"), "kubernetes.io/kubelet-serving"}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("served = %q, want %q (no refused serving signer, no unauthorized tpm)", got, want)
	}
}

func TestAttestationStatus(t *testing.T) {
	expiry := time.Date(2028, 1, 2, 3, 4, 5, 600, time.UTC)
	s := ClusterStatus{
		Cluster: types.NamespacedName{Namespace: "ns", Name: "c"}, Connected: true, Synced: true,
		AuthorizedAttestors: []string{"insecure"}, SignerNames: []string{"a"}, Lockdown: true, LockdownError: "forbidden",
		ServingCAExpiry: expiry, TrustBundlesPublished: true, ServingCAs: 1, PolicyErrors: "metadata.annotations[x]: bad",
		LastDecision: Decision{Time: expiry, CSR: "csr-1", Outcome: "denied", Reason: "R", Message: strings.Repeat("m", 5000)},
	}
	st := attestationStatus(s, 7)
	for typ, want := range map[string]string{
		ConditionReady: "True/Serving", ConditionWorkloadReachable: "True/Ready", ConditionSignersServed: "True/Serving",
		ConditionLockdownApplied: "False/EnforcementFailed", ConditionServingCAPublished: "True/Published",
		ConditionScopedIdentity: "False/NotInstalled", ConditionPolicyValid: "False/Invalid", ConditionOptedIn: "True/Enabled",
	} {
		c := meta.FindStatusCondition(st.Conditions, typ)
		if c == nil || string(c.Status)+"/"+c.Reason != want || c.ObservedGeneration != 7 {
			t.Errorf("condition %s = %+v, want %s", typ, c, want)
		}
	}
	if st.ServingCAExpiry == nil || !st.ServingCAExpiry.Equal(&metav1.Time{Time: expiry.Truncate(time.Second)}) {
		t.Errorf("servingCAExpiry = %v", st.ServingCAExpiry)
	}
	if d := st.LastDecision; d == nil || d.CSR != "csr-1" || len(d.Message) > maxDecisionMessage+3 {
		t.Errorf("lastDecision = %+v", d)
	}
	s.Connected, s.LastError = false, "connection refused"
	st = attestationStatus(s, 7)
	if c := meta.FindStatusCondition(st.Conditions, ConditionReady); c.Reason != "WorkloadUnreachable" {
		t.Errorf("unreachable: Ready is %+v", c)
	}
	if c := meta.FindStatusCondition(st.Conditions, ConditionWorkloadReachable); c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "connection refused") {
		t.Errorf("unreachable: WorkloadReachable is %+v", c)
	}
}

func TestIdleStatus(t *testing.T) {
	nn := types.NamespacedName{Namespace: "ns", Name: "c"}
	for _, tc := range []struct {
		idle          idleCluster
		optedIn, want string
	}{
		{idleCluster{reason: ReasonOptedOut}, "False/OptedOut", "False/OptedOut"},
		{idleCluster{optedIn: true, reason: ReasonKubeconfigRefused, message: "Secret c-kubeconfig not used: exec"}, "True/Enabled", "False/KubeconfigRefused"},
		{idleCluster{optedIn: true, reason: ReasonWaitingForSecrets, message: "not found"}, "True/Enabled", "False/WaitingForSecrets"},
		{idleCluster{optedIn: true, reason: ReasonWorkloadBoundsExceeded, message: "answer too large", bound: "ResponseTooLarge"}, "True/Enabled", "False/WorkloadBoundsExceeded"},
	} {
		st := idleStatus(nn, tc.idle)
		o, r := meta.FindStatusCondition(st.Conditions, ConditionOptedIn), meta.FindStatusCondition(st.Conditions, ConditionReady)
		if tc.idle.bound != "" {
			b := meta.FindStatusCondition(st.Conditions, ConditionWorkloadWithinBounds)
			if b == nil || b.Status != metav1.ConditionFalse || b.Reason != tc.idle.bound {
				t.Errorf("%+v: conditions %+v, want %s False/%s", tc.idle, st.Conditions, ConditionWorkloadWithinBounds, tc.idle.bound)
			}
			st.Conditions = slices.DeleteFunc(st.Conditions, func(c metav1.Condition) bool { return c.Type == ConditionWorkloadWithinBounds })
		}
		if len(st.Conditions) != 2 || o == nil || r == nil || string(o.Status)+"/"+o.Reason != tc.optedIn || string(r.Status)+"/"+r.Reason != tc.want || r.Message == "" {
			t.Errorf("%+v: conditions %+v, want OptedIn %s, Ready %s", tc.idle, st.Conditions, tc.optedIn, tc.want)
		}
	}
}
