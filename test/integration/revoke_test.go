package integration

import (
	"context"
	"crypto/ecdsa"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	certificatesv1 "k8s.io/api/certificates/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// kubelet is a node's identity in the workload cluster: the client
// certificate the controller issued it, used through client-go as kubelet
// uses it.
type kubelet struct {
	name   string
	cert   *x509.Certificate
	client kubernetes.Interface
}

// join files a CSR for node with the bootstrap token (the insecure
// attestor, for the Machine whose provider ID is providerID), waits for the
// certificate and returns the node's client.
func (e *signerEnv) join(t *testing.T, csrName, node, providerID string) *kubelet {
	t.Helper()
	req, key := signertest.Request{NodeName: node, ProviderID: providerID}.Build(t)
	e.file(t, signertest.CSR(csrName, req))
	cert := e.expectIssued(t, csrName, node, providerID, 24*time.Hour)
	return e.kubeletClient(t, node, cert, key.(*ecdsa.PrivateKey))
}

// joinMachine creates a ready Machine for node in the test Cluster and joins
// node as its Machine (see join).
func (e *signerEnv) joinMachine(t *testing.T, node string) *kubelet {
	t.Helper()
	providerID := "test:///" + node
	e.mgmt.CreateMachine(t, signerNS, signerCluster, node, providerID, true)
	return e.join(t, node, node, providerID)
}

func (e *signerEnv) kubeletClient(t *testing.T, node string, cert *x509.Certificate, key *ecdsa.PrivateKey) *kubelet {
	t.Helper()
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	cfg := &rest.Config{Host: e.wl.URL, TLSClientConfig: rest.TLSClientConfig{
		CAData:   e.wl.CACertPEM,
		CertData: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw}),
		KeyData:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}),
	}}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &kubelet{name: node, cert: cert, client: cs}
}

// heartbeat does what kubelet does every few seconds: it writes its Node's
// status and renews its Lease in kube-node-lease (creating either when it
// is missing).
func (k *kubelet) heartbeat(ctx context.Context) error {
	nodes := k.client.CoreV1().Nodes()
	node, err := nodes.Get(ctx, k.name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		node, err = nodes.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: k.name}}, metav1.CreateOptions{})
	}
	if err != nil {
		return fmt.Errorf("node: %w", err)
	}
	node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
		LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}}
	if _, err := nodes.UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("node status: %w", err)
	}
	return k.renewLease(ctx)
}

func (k *kubelet) renewLease(ctx context.Context) error {
	leases := k.client.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	now := metav1.NewMicroTime(time.Now())
	lease, err := leases.Get(ctx, k.name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = leases.Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: k.name},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(k.name), LeaseDurationSeconds: ptr.To(int32(40)), RenewTime: &now}}, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("lease: %w", err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("lease: %w", err)
	}
	lease.Spec.RenewTime = &now
	if _, err := leases.Update(ctx, lease, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("lease: %w", err)
	}
	return nil
}

// expectRevoked waits until k's Node status update and Lease renewal are
// both refused by the revocation policy, and checks the message says why.
func (k *kubelet) expectRevoked(t *testing.T, machine string) {
	t.Helper()
	ctx := context.Background()
	want := fmt.Sprintf("node %s was revoked: its Machine %s was deleted from the management cluster at ", k.name, machine)
	refused := func(err error) bool {
		return apierrors.IsForbidden(err) && strings.Contains(err.Error(), want) && strings.Contains(err.Error(), revoke.PolicyName)
	}
	var last error
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		node, err := k.client.CoreV1().Nodes().Get(ctx, k.name, metav1.GetOptions{}) // reads are not admitted
		if err == nil {
			node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastHeartbeatTime: metav1.Now()}}
			_, err = k.client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
		} else if apierrors.IsNotFound(err) {
			_, err = k.client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: k.name}}, metav1.CreateOptions{})
		}
		last = err
		return refused(err), nil
	})
	t.Logf("%s (certificate %s) writing its Node: %v", k.name, revoke.Fingerprint(k.cert)[:12], last)
	if err := k.renewLease(ctx); !refused(err) {
		t.Fatalf("%s renewing its Lease: %v; want refused as revoked", k.name, err)
	} else {
		t.Logf("%s renewing its Lease: %v", k.name, err)
	}
}

// expectWorks waits until k's heartbeat (Node status and Lease) succeeds.
func (k *kubelet) expectWorks(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		err := k.heartbeat(context.Background())
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s (certificate %s) cannot write its Node and Lease: %v", k.name, revoke.Fingerprint(k.cert)[:12], err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// revocationState reads what the controller keeps in the workload cluster.
// editCluster updates the signer's Cluster with edit.
func (e *signerEnv) editCluster(t *testing.T, edit func(*clusterv1.Cluster)) {
	t.Helper()
	ctx := context.Background()
	var c clusterv1.Cluster
	if err := e.mgmt.Client.Get(ctx, client.ObjectKey{Namespace: signerNS, Name: signerCluster}, &c); err != nil {
		t.Fatal(err)
	}
	edit(&c)
	if err := e.mgmt.Client.Update(ctx, &c); err != nil {
		t.Fatal(err)
	}
}

// setEnabled opts the signer's Cluster in ("true") or out.
func (e *signerEnv) setEnabled(t *testing.T, v string) {
	t.Helper()
	e.editCluster(t, func(c *clusterv1.Cluster) { c.Annotations[capi.AnnotationEnabled] = v })
}

func (e *signerEnv) revocationState(t *testing.T) *revoke.State {
	t.Helper()
	s, err := revoke.Read(context.Background(), e.wl.Client.CoreV1())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestRevokeDeletedMachine: a deleted Machine's node loses write access in
// its workload cluster before its certificate expires, a renewal of its
// certificate is denied, a Machine of the same name created by a tenant
// lifts nothing, and a new Machine of that name that joins through the
// controller works while the old certificate stays refused.
func TestRevokeDeletedMachine(t *testing.T) {
	e := startSigner(t)
	ctx := context.Background()
	const node = "worker-a"
	cluster := signerNS + "/" + signerCluster

	e.mgmt.CreateMachine(t, signerNS, signerCluster, node, "test:///a-1", true)
	old := e.join(t, "a-1", node, "test:///a-1")

	// The hint the policy rests on: kube-apiserver names the certificate a
	// request authenticated with in the user's extra.
	who, err := harness.WhoAmI(ctx, old.client)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := who.Extra[revoke.CredentialIDExtra], "X509SHA256="+revoke.Fingerprint(old.cert); len(got) != 1 || got[0] != want {
		t.Fatalf("user extra %s = %q, want [%s]", revoke.CredentialIDExtra, got, want)
	}
	old.expectWorks(t)

	// The controller keeps the policy and its (empty) parameter from the
	// start.
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		_, err := e.wl.Client.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Get(ctx, revoke.PolicyName, metav1.GetOptions{})
		return err == nil, nil
	})
	if s := e.revocationState(t); len(s.Entries) != 0 {
		t.Fatalf("revoked before any Machine was deleted: %+v", s.Entries)
	}

	// Cluster API deletes the Machine: the node's certificate, valid for
	// another day, no longer writes.
	deletedAt := time.Now()
	if err := e.mgmt.Client.Delete(ctx, &clusterv1.Machine{ObjectMeta: metav1.ObjectMeta{Namespace: signerNS, Name: node}}); err != nil {
		t.Fatal(err)
	}
	old.expectRevoked(t, signerNS+"/"+node)
	t.Logf("revoked %s after the Machine's deletion (certificate still valid for %s)", time.Since(deletedAt).Round(time.Millisecond), time.Until(old.cert.NotAfter).Round(time.Minute))
	if v, ok := gauge(t, "kubelet_authenticator_signer_revoked_node_names", cluster); !ok || v != 1 {
		t.Errorf("kubelet_authenticator_signer_revoked_node_names{cluster=%q} = %v (present %t), want 1", cluster, v, ok)
	}
	expectClusterEvent(t, e, capi.ReasonNodeRevoked, node)

	// Its renewal: refused at admission (the node cannot even file it)...
	renewal, _ := signertest.Request{NodeName: node, ProviderID: "test:///a-1"}.Build(t)
	renew := func(name string) error {
		csr := signertest.CSR(name, renewal)
		csr.Spec.Username, csr.Spec.Groups = "", nil
		_, err := old.client.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{})
		return err
	}
	if err := renew("a-1-renewal"); !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "was revoked") {
		t.Fatalf("renewal CSR by the revoked node: %v; want refused as revoked", err)
	}
	// ...and denied by the engine where the policy is not in force: a
	// workload admin deletes the binding; the Machine is gone, so nothing
	// signs for the node. The controller puts the binding back.
	if err := e.wl.Client.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(ctx, revoke.PolicyName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		err := renew("a-1-renewal")
		return err == nil || apierrors.IsAlreadyExists(err), nil
	})
	csr := e.waitDecided(t, "a-1-renewal")
	if d := condition(csr, certificatesv1.CertificateDenied); d == nil || d.Reason != attestor.ReasonMachineNotFound || csr.Spec.Username != attestor.NodeUserPrefix+node {
		t.Fatalf("renewal by %s: %+v; want denied %s", csr.Spec.Username, csr.Status.Conditions, attestor.ReasonMachineNotFound)
	} else {
		t.Logf("renewal by %s denied by the engine: %s: %s", csr.Spec.Username, d.Reason, d.Message)
	}
	old.expectRevoked(t, signerNS+"/"+node) // the binding is back

	// Cluster API deletes the Node; the old certificate cannot register it
	// again (expectRevoked tries a create when the Node is gone).
	if err := e.wl.Client.CoreV1().Nodes().Delete(ctx, node, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	old.expectRevoked(t, signerNS+"/"+node)

	// A tenant creates a Machine of the same name: that alone lifts
	// nothing, whatever it claims.
	e.mgmt.CreateMachine(t, signerNS, signerCluster, node, "test:///a-2", true)
	var m clusterv1.Machine
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		err := e.mgmt.Client.Get(ctx, client.ObjectKey{Namespace: signerNS, Name: node}, &m)
		return err == nil, nil
	})
	time.Sleep(2 * time.Second) // let the controller see it
	old.expectRevoked(t, signerNS+"/"+node)
	if en := e.revocationState(t).Find(node); en == nil || len(en.Accepted) != 0 {
		t.Fatalf("state of %s after a Machine of that name appeared: %+v; want revoked, nothing accepted", node, en)
	}

	// Its node joins through the controller: its certificate works, the
	// old one stays refused.
	fresh := e.join(t, "a-2", node, "test:///a-2")
	fresh.expectWorks(t)
	old.expectRevoked(t, signerNS+"/"+node)
	en := e.revocationState(t).Find(node)
	if en == nil || len(en.Accepted) != 1 || en.Accepted[0].SHA256 != revoke.Fingerprint(fresh.cert) || en.Accepted[0].Machine.UID != m.UID {
		t.Fatalf("state of %s after the new Machine joined: %+v; want the new certificate accepted for Machine %s", node, en, m.UID)
	}
	expectClusterEvent(t, e, capi.ReasonRevokedNodeAccepted, node)

	// The new node renews with its own identity, as the agent does.
	renewed, renewedKey := signertest.Request{NodeName: node, ProviderID: "test:///a-2"}.Build(t)
	csr2 := signertest.CSR("a-2-renewal", renewed)
	csr2.Spec.Username, csr2.Spec.Groups = "", nil
	if _, err := fresh.client.CertificatesV1().CertificateSigningRequests().Create(ctx, csr2, metav1.CreateOptions{}); err != nil {
		t.Fatalf("renewal CSR by the new node: %v", err)
	}
	cert2 := e.expectIssued(t, "a-2-renewal", node, "test:///a-2", 24*time.Hour)
	e.kubeletClient(t, node, cert2, renewedKey.(*ecdsa.PrivateKey)).expectWorks(t)
	old.expectRevoked(t, signerNS+"/"+node)
	if en := e.revocationState(t).Find(node); en == nil || len(en.Accepted) != 2 {
		t.Fatalf("state of %s after the renewal: %+v; want both certificates of the new Machine accepted", node, en)
	}

	// The policy is written when the revocations change, not at every
	// recheck (10 s here).
	policies := e.wl.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies()
	before, err := policies.Get(ctx, revoke.PolicyName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(12 * time.Second)
	after, err := policies.Get(ctx, revoke.PolicyName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if after.ResourceVersion != before.ResourceVersion {
		t.Errorf("the policy was rewritten without a change (generation %d, then %d)", before.Generation, after.Generation)
	}
}

// expectClusterEvent waits for an Event with reason on the test's Cluster
// whose message names node.
func expectClusterEvent(t *testing.T, e *signerEnv, reason, node string) {
	t.Helper()
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		events, err := e.mgmt.ControlPlane.Client.CoreV1().Events(signerNS).List(context.Background(), metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, ev := range events.Items {
			if ev.Reason == reason && ev.InvolvedObject.Kind == "Cluster" && ev.InvolvedObject.Name == signerCluster && strings.Contains(ev.Message, node) {
				t.Logf("Event %s on Cluster %s: %s", ev.Reason, signerCluster, ev.Message)
				return true, nil
			}
		}
		return false, nil
	})
}

// TestRevokeNameClaimedByLiveMachine: Machine A and Machine B both claim
// node name n (B through a Hostname in its status.addresses, as with a
// reused address) and each was issued a certificate for n. When A is
// deleted, its certificate is refused although B still claims n, and B's
// certificate keeps working.
func TestRevokeNameClaimedByLiveMachine(t *testing.T) {
	e := startSigner(t)
	ctx := context.Background()
	const node = "worker-c"

	e.mgmt.CreateMachine(t, signerNS, signerCluster, node, "test:///c-1", true)
	e.mgmt.CreateMachine(t, signerNS, signerCluster, "worker-d", "test:///d-1", true, node)
	var b clusterv1.Machine
	if err := e.mgmt.Client.Get(ctx, client.ObjectKey{Namespace: signerNS, Name: "worker-d"}, &b); err != nil {
		t.Fatal(err)
	}
	stolen := e.join(t, "c-1", node, "test:///c-1")
	claimant := e.join(t, "d-1", node, "test:///d-1")
	stolen.expectWorks(t)
	claimant.expectWorks(t)

	if err := e.mgmt.Client.Delete(ctx, &clusterv1.Machine{ObjectMeta: metav1.ObjectMeta{Namespace: signerNS, Name: node}}); err != nil {
		t.Fatal(err)
	}
	stolen.expectRevoked(t, signerNS+"/"+node)
	claimant.expectWorks(t)
	stolen.expectRevoked(t, signerNS+"/"+node)
	en := e.revocationState(t).Find(node)
	if en == nil || len(en.Accepted) != 1 || en.Accepted[0].SHA256 != revoke.Fingerprint(claimant.cert) || en.Accepted[0].Machine.UID != b.UID {
		t.Fatalf("state of %s after Machine %s was deleted: %+v; want only Machine worker-d's certificate accepted", node, node, en)
	}
}

// blockRevocationRecord makes the workload cluster refuse every write of
// the controller's revocation record, as a workload administrator's
// admission policy could, and returns a function that lifts the block.
// It returns once the block is in force.
func blockRevocationRecord(t *testing.T, e *signerEnv) (unblock func()) {
	t.Helper()
	ctx := context.Background()
	const name = "test-block-revocation-record"
	api := e.wl.Client.AdmissionregistrationV1()
	policy := &admissionregistrationv1.ValidatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionregistrationv1.Fail),
			MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionregistrationv1.RuleWithOperations{
					Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update},
					Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"configmaps"}},
				},
			}}},
			Validations: []admissionregistrationv1.Validation{{
				Expression: "object.metadata.name != '" + revoke.ConfigMapName + "'",
				Message:    "blocked by the test",
			}},
		},
	}
	if _, err := api.ValidatingAdmissionPolicies().Create(ctx, policy, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: name,
			ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}},
	}
	if _, err := api.ValidatingAdmissionPolicyBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cms := e.wl.Client.CoreV1().ConfigMaps(revoke.Namespace)
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		cm, err := cms.Get(ctx, revoke.ConfigMapName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		_, err = cms.Update(ctx, cm, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
		return err != nil && strings.Contains(err.Error(), "blocked by the test"), nil
	})
	return func() {
		t.Helper()
		if err := api.ValidatingAdmissionPolicyBindings().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := api.ValidatingAdmissionPolicies().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRevokePendingAcrossOptOut: a Machine is deleted while its workload
// cluster refuses the revocation for a moment, and the Cluster opts out
// before the revocation is written. The deletion is not forgotten: once
// the Cluster opts in again, the deleted Machine's certificate is refused.
func TestRevokePendingAcrossOptOut(t *testing.T) {
	e := startSigner(t)
	ctx := context.Background()
	const node = "worker-e"

	e.mgmt.CreateMachine(t, signerNS, signerCluster, node, "test:///e-1", true)
	old := e.join(t, "e-1", node, "test:///e-1")
	old.expectWorks(t)
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		_, err := e.wl.Client.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Get(ctx, revoke.PolicyName, metav1.GetOptions{})
		return err == nil, nil
	})

	unblock := blockRevocationRecord(t, e)
	if err := e.mgmt.Client.Delete(ctx, &clusterv1.Machine{ObjectMeta: metav1.ObjectMeta{Namespace: signerNS, Name: node}}); err != nil {
		t.Fatal(err)
	}
	expectClusterEvent(t, e, capi.ReasonRevocationFailed, node) // tried, refused
	e.setEnabled(t, "false")
	time.Sleep(3 * time.Second) // the controller sees it and stops serving the Cluster
	unblock()
	if s := e.revocationState(t); s.Find(node) != nil {
		t.Fatalf("%s revoked while the record was blocked: %+v", node, s.Entries)
	}
	old.expectWorks(t) // nothing revoked it yet

	e.setEnabled(t, "true")
	old.expectRevoked(t, signerNS+"/"+node)

	// Once enforced, the deletion's record in the management cluster goes.
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		list, err := e.mgmt.ControlPlane.Client.CoreV1().ConfigMaps(metav1.NamespaceSystem).List(ctx, metav1.ListOptions{LabelSelector: capi.LabelPendingRevocation})
		return err == nil && len(list.Items) == 0, nil
	})
}

// TestRevokeDeletedWhileOptedOut: a Machine deleted while its Cluster is
// opted out is seen by no informer; once the Cluster opts in again, the
// record of the certificates issued in the workload cluster names a
// Machine that is gone, and its node's certificate is refused. A Machine
// still there keeps its node's certificate working.
func TestRevokeDeletedWhileOptedOut(t *testing.T) {
	e := startSigner(t)
	ctx := context.Background()
	const gone, kept = "worker-g", "worker-k"

	e.mgmt.CreateMachine(t, signerNS, signerCluster, gone, "test:///g-1", true)
	e.mgmt.CreateMachine(t, signerNS, signerCluster, kept, "test:///k-1", true)
	old := e.join(t, "g-1", gone, "test:///g-1")
	live := e.join(t, "k-1", kept, "test:///k-1")
	old.expectWorks(t)
	live.expectWorks(t)

	e.setEnabled(t, "false")
	time.Sleep(3 * time.Second) // the controller sees it and stops serving the Cluster
	if err := e.mgmt.Client.Delete(ctx, &clusterv1.Machine{ObjectMeta: metav1.ObjectMeta{Namespace: signerNS, Name: gone}}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	if s := e.revocationState(t); s.Find(gone) != nil {
		t.Fatalf("%s revoked while its Cluster was opted out: %+v", gone, s.Entries)
	}
	old.expectWorks(t) // nothing revoked it yet

	e.setEnabled(t, "true")
	old.expectRevoked(t, signerNS+"/"+gone)
	expectClusterEvent(t, e, capi.ReasonNodeRevoked, gone)
	live.expectWorks(t)
	if s := e.revocationState(t); s.Find(kept) != nil {
		t.Errorf("%s, whose Machine is there, was revoked: %+v", kept, s.Entries)
	}
}

// TestRevokeWaitsWhilePaused: clusterctl move pauses a Cluster and then
// deletes its Machines from the management cluster it leaves, while they
// live on in the other: a Machine of a paused Cluster deleted is not
// revoked, while a new node still joins. A Machine still gone once the
// Cluster is unpaused is revoked.
func TestRevokeWaitsWhilePaused(t *testing.T) {
	e := startSigner(t)
	ctx := context.Background()
	const node = "worker-p"

	e.mgmt.CreateMachine(t, signerNS, signerCluster, node, "test:///p-1", true)
	old := e.join(t, "p-1", node, "test:///p-1")
	old.expectWorks(t)
	setPaused := func(v bool) { e.editCluster(t, func(c *clusterv1.Cluster) { c.Spec.Paused = &v }) }
	setPaused(true)
	e.waitAttestation(t, "the Cluster paused", func(st v1alpha1.ClusterAttestationStatus) string {
		return hasCondition(st, capi.ConditionPaused, metav1.ConditionTrue, "Paused")
	})
	if err := e.mgmt.Client.Delete(ctx, &clusterv1.Machine{ObjectMeta: metav1.ObjectMeta{Namespace: signerNS, Name: node}}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Second)
	if s := e.revocationState(t); s.Find(node) != nil {
		t.Fatalf("%s revoked while its Cluster was paused: %+v", node, s.Entries)
	}
	old.expectWorks(t)
	// A pause holds back revocation only: a new node still joins.
	e.mgmt.CreateMachine(t, signerNS, signerCluster, "worker-q", "test:///q-1", true)
	e.join(t, "q-1", "worker-q", "test:///q-1").expectWorks(t)

	setPaused(false)
	e.waitAttestation(t, "the Cluster unpaused", func(st v1alpha1.ClusterAttestationStatus) string {
		return hasCondition(st, capi.ConditionPaused, metav1.ConditionFalse, "NotPaused")
	})
	old.expectRevoked(t, signerNS+"/"+node)
}
