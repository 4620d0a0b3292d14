package capi

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

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
		ConditionPaused: "False/NotPaused",
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
	s.Paused = true
	if c := meta.FindStatusCondition(attestationStatus(s, 7).Conditions, ConditionPaused); c.Status != metav1.ConditionTrue || !strings.Contains(c.Message, "revoked") {
		t.Errorf("paused: Paused is %+v", c)
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

// TestStatusErrorsBounded: a Cluster's status keeps at most
// maxStatusError bytes of an error (what a tenant's API server answered can
// be far longer), cut on a character boundary, saying how much was cut.
func TestStatusErrorsBounded(t *testing.T) {
	st := &state{}
	long := strings.Repeat("é", maxStatusError) // two bytes each
	st.update(func(s *ClusterStatus) {
		s.LastError, s.IdentityError, s.LockdownError, s.TrustBundleError, s.RevocationError = long, long, long, long, "short"
	})
	got := st.snapshot()
	for name, v := range map[string]string{"LastError": got.LastError, "IdentityError": got.IdentityError, "LockdownError": got.LockdownError,
		"TrustBundleError": got.TrustBundleError} {
		if len(v) > maxStatusError+64 || !utf8.ValidString(v) || !strings.HasSuffix(v, fmt.Sprintf("… (%d more bytes)", len(long)-maxStatusError)) {
			t.Errorf("%s = %d bytes %q..., want at most %d bytes of valid text saying what was cut", name, len(v), v[:min(len(v), 16)], maxStatusError)
		}
	}
	if got.RevocationError != "short" {
		t.Errorf("RevocationError = %q, want a short error kept as it is", got.RevocationError)
	}
}
