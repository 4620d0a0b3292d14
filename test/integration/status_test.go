package integration

import (
	"context"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// attestation reads the Cluster's ClusterAttestation; ok is false while
// there is none.
func (e *signerEnv) attestation(t *testing.T) (obj *unstructured.Unstructured, status v1alpha1.ClusterAttestationStatus, ok bool) {
	t.Helper()
	return e.attestationOf(t, signerCluster)
}

// attestationOf reads the ClusterAttestation of Cluster name.
func (e *signerEnv) attestationOf(t *testing.T, name string) (obj *unstructured.Unstructured, status v1alpha1.ClusterAttestationStatus, ok bool) {
	t.Helper()
	obj = &unstructured.Unstructured{}
	obj.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
	if err := e.mgmt.Client.Get(context.Background(), types.NamespacedName{Namespace: signerNS, Name: name}, obj); err != nil {
		return nil, status, false
	}
	if m, found := obj.Object["status"].(map[string]any); found {
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(m, &status); err != nil {
			t.Fatalf("ClusterAttestation status does not decode: %v", err)
		}
	}
	return obj, status, true
}

// waitAttestation waits until the ClusterAttestation's status satisfies
// cond (which says what it still lacks, or ""), and returns it.
func (e *signerEnv) waitAttestation(t *testing.T, what string, cond func(v1alpha1.ClusterAttestationStatus) string) v1alpha1.ClusterAttestationStatus {
	t.Helper()
	return e.waitAttestationOf(t, signerCluster, what, cond)
}

func (e *signerEnv) waitAttestationOf(t *testing.T, name, what string, cond func(v1alpha1.ClusterAttestationStatus) string) v1alpha1.ClusterAttestationStatus {
	t.Helper()
	var last v1alpha1.ClusterAttestationStatus
	lacking := "no ClusterAttestation"
	if err := pollFor(60*time.Second, func() bool {
		_, st, ok := e.attestationOf(t, name)
		if !ok {
			return false
		}
		last = st
		lacking = cond(st)
		return lacking == ""
	}); err != nil {
		t.Fatalf("%s: %s; status: %+v", what, lacking, last)
	}
	return last
}

// hasCondition says what is wrong with condition typ of st, or "".
func hasCondition(st v1alpha1.ClusterAttestationStatus, typ string, status metav1.ConditionStatus, reason string) string {
	c := meta.FindStatusCondition(st.Conditions, typ)
	switch {
	case c == nil:
		return "no condition " + typ
	case c.Status != status || c.Reason != reason:
		return "condition " + typ + " is " + string(c.Status) + "/" + c.Reason + " (" + c.Message + "), want " + string(status) + "/" + reason
	case c.Message == "" || c.LastTransitionTime.IsZero():
		return "condition " + typ + " has no message or transition time"
	}
	return ""
}

// TestClusterAttestationStatus is issue 15's "status a person can read":
// the controller keeps a ClusterAttestation per served Cluster, owned by
// it, that says the workload cluster is reachable, which signer names are
// served, the serving CA's expiry, whether lockdown is applied and the last
// decision (approval and denial, with its reason); `kubectl get` prints it;
// annotations with problems are reported; opting out says so.
func TestClusterAttestationStatus(t *testing.T) {
	bin := harness.Binaries(t)
	ctx := context.Background()
	mgmt := harness.StartManagement(t)
	wl := harness.StartControlPlane(t, "workload")
	cluster := mgmt.AddWorkloadCluster(t, signerNS, signerCluster, wl, map[string]string{
		capi.AnnotationEnabled:             "true",
		capi.AnnotationAuthorizedAttestors: "insecure",
	})
	// The workload API server is probed once an hour: a Cluster reads
	// reachable as soon as the controller's identity is installed in it, not
	// a probe period after its first probe, made before, failed.
	runSigner(t, mgmt, func(o *app.Options) { o.LockdownPeriod, o.ProbePeriod = time.Second, time.Hour })
	e := &signerEnv{mgmt: mgmt, wl: wl, bootstrap: wl.BootstrapClient(t)}

	// A Cluster opted in whose Secrets Cluster API has not written yet:
	// its ClusterAttestation says what the controller waits for.
	pending := &clusterv1.Cluster{
		ObjectMeta: metav1.ObjectMeta{Namespace: signerNS, Name: "pending", Annotations: map[string]string{
			capi.AnnotationEnabled: "true", capi.AnnotationAuthorizedAttestors: "insecure"}},
		Spec: clusterv1.ClusterSpec{ControlPlaneEndpoint: clusterv1.APIEndpoint{Host: "127.0.0.1", Port: 6443}},
	}
	if err := mgmt.Client.Create(ctx, pending); err != nil {
		t.Fatal(err)
	}
	e.waitAttestationOf(t, "pending", "while the Cluster's Secrets are missing", func(st v1alpha1.ClusterAttestationStatus) string {
		if w := hasCondition(st, capi.ConditionOptedIn, metav1.ConditionTrue, "Enabled"); w != "" {
			return w
		}
		return hasCondition(st, capi.ConditionReady, metav1.ConditionFalse, capi.ReasonWaitingForSecrets)
	})
	if obj, _, _ := e.attestationOf(t, "pending"); len(obj.GetOwnerReferences()) != 1 || obj.GetOwnerReferences()[0].UID != pending.UID {
		t.Errorf("the pending Cluster's ClusterAttestation is not owned by it: %+v", obj.GetOwnerReferences())
	}

	// A node joins.
	mgmt.CreateMachine(t, signerNS, signerCluster, "worker-0", "test:///0", true)
	req, _ := signertest.Request{NodeName: "worker-0", ProviderID: "test:///0"}.Build(t)
	e.file(t, signertest.CSR("join-worker-0", req))
	e.expectIssued(t, "join-worker-0", "worker-0", "test:///0", 24*time.Hour)

	clientSigner := attestor.ClientSignerName("insecure")
	st := e.waitAttestation(t, "after a node joined", func(st v1alpha1.ClusterAttestationStatus) string {
		for _, c := range []struct {
			typ    string
			status metav1.ConditionStatus
			reason string
		}{
			{capi.ConditionOptedIn, metav1.ConditionTrue, "Enabled"},
			{capi.ConditionWorkloadReachable, metav1.ConditionTrue, "Ready"},
			{capi.ConditionSignersServed, metav1.ConditionTrue, "Serving"},
			{capi.ConditionReady, metav1.ConditionTrue, "Serving"},
			{capi.ConditionLockdownApplied, metav1.ConditionFalse, "NotRequested"},
		} {
			if w := hasCondition(st, c.typ, c.status, c.reason); w != "" {
				return w
			}
		}
		switch {
		case !slices.Contains(st.SignerNames, clientSigner):
			return "signerNames lacks " + clientSigner
		case slices.Contains(st.SignerNames, attestor.ServingSignerName("insecure")):
			return "signerNames lists the refused serving signer of a client-only attestor"
		case st.LastDecision == nil || st.LastDecision.CSR != "join-worker-0":
			return "lastDecision does not name join-worker-0"
		}
		return ""
	})
	if !slices.Equal(st.AuthorizedAttestors, []string{"insecure"}) {
		t.Errorf("authorizedAttestors = %q, want [insecure]", st.AuthorizedAttestors)
	}
	if d := st.LastDecision; d.Outcome != "approved" || d.Reason != attestor.ReasonAttestationVerified || d.Machine != "worker-0" || d.Time.IsZero() {
		t.Errorf("lastDecision = %+v, want approved (%s) for Machine worker-0", d, attestor.ReasonAttestationVerified)
	}
	servingCA, err := e.mgmt.ControlPlane.Client.CoreV1().Secrets(signerNS).Get(ctx, signerCluster+capi.ServingCASecretSuffix, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if certs := parseCerts(t, servingCA.Data["tls.crt"]); st.ServingCAExpiry == nil || len(certs) == 0 ||
		!st.ServingCAExpiry.Time.Equal(certs[0].NotAfter.UTC().Truncate(time.Second)) {
		t.Errorf("servingCAExpiry = %v, want the serving CA's NotAfter", st.ServingCAExpiry)
	}
	if st.ClusterName != signerCluster || st.ObservedGeneration != cluster.Generation {
		t.Errorf("clusterName %q, observedGeneration %d; want %q, %d", st.ClusterName, st.ObservedGeneration, signerCluster, cluster.Generation)
	}
	obj, _, _ := e.attestation(t)
	if refs := obj.GetOwnerReferences(); len(refs) != 1 || refs[0].Kind != "Cluster" || refs[0].Name != signerCluster || refs[0].UID != cluster.UID {
		t.Errorf("ownerReferences = %+v, want the Cluster", refs)
	}
	if got := obj.GetLabels()[clusterv1.ClusterNameLabel]; got != signerCluster {
		t.Errorf("label %s = %q", clusterv1.ClusterNameLabel, got)
	}

	// Nothing changed, nothing written: the object keeps its
	// resourceVersion over several write periods.
	rv := obj.GetResourceVersion()
	time.Sleep(3*capi.DefaultStatusPeriod + time.Second)
	if again, _, _ := e.attestation(t); again.GetResourceVersion() != rv {
		t.Errorf("the ClusterAttestation was written again while nothing changed (resourceVersion %s, then %s)", rv, again.GetResourceVersion())
	}

	// kubectl get shows it.
	out, err := exec.Command(filepath.Join(bin, "kubectl"), "--kubeconfig", mgmt.AdminKubeconfig, "get", "clusterattestations", "-n", signerNS, signerCluster).CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl get clusterattestations: %v\n%s", err, out)
	}
	t.Logf("kubectl get clusterattestations -n %s:\n%s", signerNS, out)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 2 {
		t.Fatalf("kubectl printed %d lines, want a header and one row", len(lines))
	}
	if h := strings.Fields(lines[0]); !slices.Equal(h, []string{"NAME", "CLUSTER", "ATTESTORS", "SIGNERS", "LOCKDOWN", "REACHABLE", "SERVINGCAEXPIRY", "LASTDECISION", "AGE"}) {
		t.Errorf("kubectl header = %q", h)
	}
	if row := strings.Fields(lines[1]); len(row) != 9 || row[0] != signerCluster || row[1] != signerCluster || !strings.Contains(row[2], "insecure") ||
		row[3] != "True" || row[4] != "False" || row[5] != "True" || row[6] != st.ServingCAExpiry.UTC().Format(time.RFC3339) || row[7] != "approved" {
		t.Errorf("kubectl row = %q", row)
	}

	// In the cluster-api category, with Cluster API's own kinds.
	out, err = exec.Command(filepath.Join(bin, "kubectl"), "--kubeconfig", mgmt.AdminKubeconfig, "get", "cluster-api", "-n", signerNS, "-o", "name").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "clusterattestation.kubelet-authenticator.x-k8s.io/"+signerCluster) {
		t.Errorf("kubectl get cluster-api does not list the ClusterAttestation: %v\n%s", err, out)
	}

	// Lockdown, asked for by the annotation, shows once applied; lifted,
	// it shows as not requested.
	setAnnotation := func(key, value string) {
		t.Helper()
		var c clusterv1.Cluster
		if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: signerNS, Name: signerCluster}, &c); err != nil {
			t.Fatal(err)
		}
		c.Annotations[key] = value
		if err := mgmt.Client.Update(ctx, &c); err != nil {
			t.Fatal(err)
		}
	}
	setAnnotation(capi.AnnotationLockdown, "true")
	e.waitAttestation(t, "with lockdown", func(st v1alpha1.ClusterAttestationStatus) string {
		return hasCondition(st, capi.ConditionLockdownApplied, metav1.ConditionTrue, "Enforced")
	})
	setAnnotation(capi.AnnotationLockdown, "false")
	st = e.waitAttestation(t, "with lockdown lifted", func(st v1alpha1.ClusterAttestationStatus) string {
		return hasCondition(st, capi.ConditionLockdownApplied, metav1.ConditionFalse, "NotRequested")
	})
	if st.LastDecision == nil || st.LastDecision.CSR != "join-worker-0" {
		t.Errorf("the last decision was lost when the controller restarted with new settings: %+v", st.LastDecision)
	}

	// A denial shows with its reason.
	req, _ = signertest.Request{NodeName: "stranger-0", ProviderID: "test:///stranger"}.Build(t)
	e.file(t, signertest.CSR("stranger-0", req))
	csr := e.waitDecided(t, "stranger-0")
	denied := condition(csr, certificatesv1.CertificateDenied)
	if denied == nil {
		t.Fatalf("CSR of a node without a Machine was not denied: %+v", csr.Status)
	}
	st = e.waitAttestation(t, "after a denial", func(st v1alpha1.ClusterAttestationStatus) string {
		if st.LastDecision == nil || st.LastDecision.CSR != "stranger-0" {
			return "lastDecision does not name stranger-0"
		}
		return ""
	})
	if d := st.LastDecision; d.Outcome != "denied" || d.Reason != denied.Reason || d.Message == "" || d.Machine != "" {
		t.Errorf("lastDecision = %+v, want denied with reason %s and a message", d, denied.Reason)
	}

	// Annotations with problems: reported once per Cluster (condition and
	// Event), not silently ignored; fixed, the condition says so.
	e.waitAttestation(t, "with valid annotations", func(st v1alpha1.ClusterAttestationStatus) string {
		return hasCondition(st, capi.ConditionPolicyValid, metav1.ConditionTrue, "Valid")
	})
	setAnnotation(capi.AnnotationAuthorizedAttestors, "insecure,nosuch")
	setAnnotation(capi.AnnotationPolicyPrefix+"tpm"+capi.AnnotationPolicySuffix, "apiVersion: wrong\nkind: Nonsense\n")
	st = e.waitAttestation(t, "with bad annotations", func(st v1alpha1.ClusterAttestationStatus) string {
		return hasCondition(st, capi.ConditionPolicyValid, metav1.ConditionFalse, "Invalid")
	})
	msg := meta.FindStatusCondition(st.Conditions, capi.ConditionPolicyValid).Message
	for _, want := range []string{capi.AnnotationAuthorizedAttestors, `"nosuch"`, "kubelet-authenticator.x-k8s.io/tpm-policy", "apiVersion"} {
		if !strings.Contains(msg, want) {
			t.Errorf("PolicyValid message does not say %q: %s", want, msg)
		}
	}
	expectClusterEvent(t, e, capi.ReasonPolicyInvalid, "nosuch")
	if v, ok := gauge(t, "kubelet_authenticator_signer_cluster_policy_valid", signerNS+"/"+signerCluster); !ok || v != 0 {
		t.Errorf("cluster_policy_valid = %v (present %t), want 0", v, ok)
	}
	setAnnotation(capi.AnnotationAuthorizedAttestors, "insecure")
	var c clusterv1.Cluster
	if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: signerNS, Name: signerCluster}, &c); err != nil {
		t.Fatal(err)
	}
	delete(c.Annotations, capi.AnnotationPolicyPrefix+"tpm"+capi.AnnotationPolicySuffix)
	if err := mgmt.Client.Update(ctx, &c); err != nil {
		t.Fatal(err)
	}
	e.waitAttestation(t, "with the annotations fixed", func(st v1alpha1.ClusterAttestationStatus) string {
		return hasCondition(st, capi.ConditionPolicyValid, metav1.ConditionTrue, "Valid")
	})
	if v, ok := gauge(t, "kubelet_authenticator_signer_cluster_policy_valid", signerNS+"/"+signerCluster); !ok || v != 1 {
		t.Errorf("cluster_policy_valid = %v (present %t), want 1", v, ok)
	}

	// Opted out: the object says so, and keeps nothing else.
	setAnnotation(capi.AnnotationEnabled, "false")
	st = e.waitAttestation(t, "after opting out", func(st v1alpha1.ClusterAttestationStatus) string {
		if w := hasCondition(st, capi.ConditionOptedIn, metav1.ConditionFalse, "OptedOut"); w != "" {
			return w
		}
		return hasCondition(st, capi.ConditionReady, metav1.ConditionFalse, "OptedOut")
	})
	if st.LastDecision != nil || len(st.SignerNames) > 0 || meta.FindStatusCondition(st.Conditions, capi.ConditionWorkloadReachable) != nil {
		t.Errorf("an opted-out Cluster's status still reports its service: %+v", st)
	}
}
