//go:build tpmsimulator

package e2e

import (
	"context"
	"crypto/ecdsa"
	"encoding/pem"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2/transport"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"

	"sigs.k8s.io/kubelet-authenticator/agent/csr"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// tpmSignerArgs are the controller flags of the TPM tests.
func tpmSignerArgs(bundle string, ttl time.Duration) []string {
	return []string{"--tpm-manufacturer-ca=" + bundle, "--tpm-challenge-ttl=" + ttl.String()}
}

// simulatorConfig is a node's tpm configuration for the in-process
// simulator: seed stands for the machine's TPM.
func simulatorConfig(seed int64, caDir string) string {
	return fmt.Sprintf("tpm:\n  device: simulator\n  simulator:\n    seed: %d\n    manufacturerCADir: %s\n", seed, caDir)
}

func manufacturerCA(t *testing.T, name string) (dir string, ca *tpmtest.ManufacturerCA) {
	t.Helper()
	ca, err := tpmtest.NewManufacturerCA(name, time.Now().Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	dir = t.TempDir()
	if err := ca.Save(dir); err != nil {
		t.Fatal(err)
	}
	return dir, ca
}

// waitCSR waits until the named CSR satisfies done.
func waitCSR(t *testing.T, env *scenario.Env, name string, timeout time.Duration, done func(*certificatesv1.CertificateSigningRequest) bool) *certificatesv1.CertificateSigningRequest {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		c, err := env.Workload.Client.CertificatesV1().CertificateSigningRequests().Get(context.Background(), name, metav1.GetOptions{})
		if err == nil && done(c) {
			return c
		}
		if err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("CSR %s: condition not reached in %s (last: %+v, %v)\ncontroller log:\n%s", name, timeout, conditions(c), err, harness.LastLines(env.ControllerLog(), 40))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func conditions(c *certificatesv1.CertificateSigningRequest) []string {
	if c == nil {
		return nil
	}
	var out []string
	for _, cond := range c.Status.Conditions {
		out = append(out, string(cond.Type)+"/"+cond.Reason+": "+cond.Message)
	}
	return out
}

func denied(c *certificatesv1.CertificateSigningRequest) string {
	for _, cond := range c.Status.Conditions {
		if cond.Type == certificatesv1.CertificateDenied || cond.Type == certificatesv1.CertificateFailed {
			return cond.Reason
		}
	}
	return ""
}

func wantDenied(t *testing.T, env *scenario.Env, name, reason string) *certificatesv1.CertificateSigningRequest {
	t.Helper()
	c := waitCSR(t, env, name, time.Minute, func(c *certificatesv1.CertificateSigningRequest) bool {
		return denied(c) != "" || len(c.Status.Certificate) > 0
	})
	if got := denied(c); got != reason {
		t.Fatalf("CSR %s: %q, want denied %s", name, conditions(c), reason)
	}
	return c
}

func challenged(c *certificatesv1.CertificateSigningRequest) bool {
	_, ok := c.Annotations[attestor.AnnotationChallenge]
	return ok || denied(c) != ""
}

// whoami runs kubectl auth whoami with the node's exec-plugin kubeconfig.
func whoami(ctx context.Context, t *testing.T, env *scenario.Env, n *scenario.Node) {
	t.Helper()
	r := n.Kubectl(ctx, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
	if r.Err != nil {
		t.Fatalf("kubectl auth whoami: %v\n%s\ncontroller log:\n%s", r.Err, r.Stderr, harness.LastLines(env.ControllerLog(), 60))
	}
	if got := strings.TrimSpace(r.Stdout); got != attestor.NodeUserPrefix+n.Name {
		t.Fatalf("API server sees %q, want system:node:%s", got, n.Name)
	}
}

// tpmCSRs returns a node's CSRs: CSR #1 (the attestation) and CSR #2 (the
// answer), each the last filed.
func tpmCSRs(t *testing.T, env *scenario.Env, node string) (first, second *certificatesv1.CertificateSigningRequest) {
	t.Helper()
	for _, c := range nodeCSRs(t, env, node) {
		r, err := attestor.ParseRequest(c.Spec.Request)
		if err != nil {
			t.Fatal(err)
		}
		ev, err := tpm.DecodeEvidence(r.Evidence)
		if err != nil {
			t.Fatal(err)
		}
		if ev.Attestation != nil {
			first = &c
		} else {
			second = &c
		}
	}
	if first == nil || second == nil {
		t.Fatalf("node %s filed no CSR pair", node)
	}
	return first, second
}

// checkRound asserts the two-round outcome a node sees: CSR #1 challenged
// and closed ChallengeAnswered, CSR #2 approved and issued.
func checkRound(t *testing.T, env *scenario.Env, node string) {
	t.Helper()
	first, second := tpmCSRs(t, env, node)
	if _, ok := first.Annotations[attestor.AnnotationChallenge]; !ok {
		t.Errorf("CSR #1 %s carries no challenge", first.Name)
	}
	if _, ok := first.Annotations[attestor.AnnotationEndorsementKey]; !ok {
		t.Errorf("CSR #1 %s carries no %s annotation", first.Name, attestor.AnnotationEndorsementKey)
	}
	if got := denied(first); got != attestor.ReasonChallengeAnswered {
		t.Errorf("CSR #1 %s: %q, want denied %s", first.Name, conditions(first), attestor.ReasonChallengeAnswered)
	}
	if len(second.Status.Certificate) == 0 || denied(second) != "" {
		t.Errorf("CSR #2 %s: %q, not issued", second.Name, conditions(second))
	}
}

// fakeNode plays a node's part by hand with the in-process simulator, to
// provoke what the node binary never does (not answering, answering late,
// answering twice, answering as someone else).
type fakeNode struct {
	name, providerID string
	client           kubernetes.Interface
	att              *tpm.Attestor
	key              *ecdsa.PrivateKey
	req              *attestor.Request
	pkcs10           []byte
}

func newFakeNode(t *testing.T, env *scenario.Env, name string, seed int64, ca *tpmtest.ManufacturerCA) *fakeNode {
	t.Helper()
	sim, err := tpmsim.OpenProvisioned(seed, ca)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sim.Close() })
	att, err := tpm.NewAttestor(func() (transport.TPMCloser, error) { return tpmsim.NopCloser(sim), nil })
	if err != nil {
		t.Fatal(err)
	}
	n := &fakeNode{name: name, providerID: "test:///fleet/" + name, att: att, client: bootstrapClient(t, env, env.BootstrapKubeconfig)}
	if n.key, err = csr.GenerateKey(); err != nil {
		t.Fatal(err)
	}
	spki, err := csr.SPKI(n.key)
	if err != nil {
		t.Fatal(err)
	}
	if n.pkcs10, err = csr.PKCS10(n.key, name, n.providerID); err != nil {
		t.Fatal(err)
	}
	n.req = &attestor.Request{NodeName: name, ProviderID: n.providerID, Binding: attestor.Binding(spki), SPKI: spki}
	return n
}

func bootstrapClient(t *testing.T, env *scenario.Env, kubeconfig string) kubernetes.Interface {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

func (n *fakeNode) file(t *testing.T, client kubernetes.Interface, name string, att *attestor.Attestation) {
	t.Helper()
	request, err := attestor.EncodeRequest(n.pkcs10, tpm.Name, att.Evidence)
	if err != nil {
		t.Fatal(err)
	}
	obj := csr.Object(name, attestor.ClientSignerName(tpm.Name), request, nil, att.Annotations)
	if _, err := client.CertificatesV1().CertificateSigningRequests().Create(context.Background(), obj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// attest files CSR #1.
func (n *fakeNode) attest(t *testing.T, name string) {
	t.Helper()
	ev, err := n.att.Attest(context.Background(), n.req)
	if err != nil {
		t.Fatal(err)
	}
	n.file(t, n.client, name, ev)
}

// answer files CSR #2 (as client) answering the challenge on first.
func (n *fakeNode) answer(t *testing.T, client kubernetes.Interface, first *certificatesv1.CertificateSigningRequest, name string) {
	t.Helper()
	ch, ok := first.Annotations[attestor.AnnotationChallenge]
	if !ok {
		t.Fatalf("CSR %s carries no challenge: %q", first.Name, conditions(first))
	}
	ev, err := n.att.Respond(context.Background(), n.req, &attestor.Challenge{CSRName: first.Name, CSRUID: string(first.UID), Data: []byte(ch)})
	if err != nil {
		t.Fatal(err)
	}
	n.file(t, client, name, ev)
}

// TestTPMSimulator runs the TPM attestor end to end on the go-tpm-tools
// simulator (Microsoft's reference TPM): the real node binary answers the
// challenge, the real controller binary verifies, applies trust on first
// use and signs, and kubectl authenticates as the node. Then every way the
// controller must say no, each with its own reason.
func TestTPMSimulator(t *testing.T) {
	caDir, ca := manufacturerCA(t, "Trusted TPM Maker")
	rogueDir, _ := manufacturerCA(t, "Rogue TPM Maker")
	env := scenario.Start(t, scenario.Options{Attestors: "tpm", ControllerArgs: tpmSignerArgs(filepath.Join(caDir, tpmtest.BundleFile), time.Minute)})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	// A controller restarted in a subtest runs until the whole test ends.
	restart := func(ttl time.Duration) {
		env.StopController()
		env.StartController(t, tpmSignerArgs(filepath.Join(caDir, tpmtest.BundleFile), ttl)...)
	}
	node := func(name string, seed int64, dir string) *scenario.Node {
		n := env.NewNode(t, name, "test:///fleet/"+name, "tpm", simulatorConfig(seed, dir))
		env.Machine(t, n)
		return n
	}

	t.Run("node attests with its TPM and talks as itself", func(t *testing.T) {
		n := node("tpm-1", 1, caDir)
		start := time.Now()
		whoami(ctx, t, env, n)
		t.Logf("cold issuance through kubectl: %s", time.Since(start).Round(time.Millisecond))
		checkRound(t, env, n.Name)
		// Trust on first use recorded the EK for the Machine.
		var recs []string
		cms, err := env.Mgmt.ControlPlane.Client.CoreV1().ConfigMaps(scenario.ControllerNamespace).List(ctx, metav1.ListOptions{LabelSelector: tofu.LabelIdentity})
		if err != nil {
			t.Fatal(err)
		}
		for _, cm := range cms.Items {
			if cm.Data[tofu.KeyMachine] == "machine-"+n.Name {
				recs = append(recs, cm.Data[tofu.KeyIdentity])
			}
		}
		if len(recs) != 1 || !strings.HasPrefix(recs[0], tpm.StablePrefix) {
			t.Errorf("trust-on-first-use records of machine-%s: %q", n.Name, recs)
		}
	})

	t.Run("EK certificate from an untrusted manufacturer", func(t *testing.T) {
		n := node("tpm-rogue", 2, rogueDir)
		if r := n.Credential(ctx); r.Err == nil {
			t.Fatal("a TPM from an untrusted manufacturer got a certificate")
		}
		csrs := nodeCSRs(t, env, n.Name)
		if len(csrs) != 1 {
			t.Fatalf("%d CSRs", len(csrs))
		}
		wantDenied(t, env, csrs[0].Name, tpm.ReasonUntrustedEKCertificate)
	})

	t.Run("the same TPM claimed for a second Machine", func(t *testing.T) {
		n := node("tpm-clone", 1, caDir) // seed 1: tpm-1's TPM
		if r := n.Credential(ctx); r.Err == nil || !strings.Contains(r.Stderr, attestor.ReasonIdentityClaimedByOtherMachine) {
			t.Fatalf("a second Machine with tpm-1's TPM: %v\n%s", r.Err, r.Stderr)
		}
		_, second := tpmCSRs(t, env, n.Name)
		wantDenied(t, env, second.Name, attestor.ReasonIdentityClaimedByOtherMachine)
	})

	t.Run("an answer replayed, and an answer from another requester", func(t *testing.T) {
		_, second := tpmCSRs(t, env, "tpm-1")
		replay := func(client kubernetes.Interface, name string) {
			obj := csr.Object(name, second.Spec.SignerName, second.Spec.Request, nil, nil)
			if _, err := client.CertificatesV1().CertificateSigningRequests().Create(ctx, obj, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		// The same bootstrap token files tpm-1's answer again.
		replay(bootstrapClient(t, env, env.BootstrapKubeconfig), "replay-same-requester")
		wantDenied(t, env, "replay-same-requester", attestor.ReasonChallengeUsed)

		// Another bootstrap token answers a challenge it did not receive.
		fn := newFakeNode(t, env, "tpm-fake-1", 11, ca)
		env.Mgmt.CreateMachine(t, env.Namespace, env.Cluster, "machine-"+fn.name, fn.providerID, true, fn.name)
		fn.attest(t, "fake-1-first")
		first := waitCSR(t, env, "fake-1-first", time.Minute, challenged)
		other := bootstrapClient(t, env, env.Workload.BootstrapKubeconfig(t, env.Workload.CreateBootstrapToken(t)))
		fn.answer(t, other, first, "fake-1-other-requester")
		wantDenied(t, env, "fake-1-other-requester", attestor.ReasonRequesterMismatch)
	})

	t.Run("the answer's approval fails after the close", func(t *testing.T) {
		// A policy in the workload cluster refuses the approval of the
		// answer (and of a probe request), as an API error would; the close
		// of CSR #1 goes through.
		fn := newFakeNode(t, env, "tpm-fake-4", 14, ca)
		env.Mgmt.CreateMachine(t, env.Namespace, env.Cluster, "machine-"+fn.name, fn.providerID, true, fn.name)
		stop := refuseApprovals(t, env, "fake-4-second")
		fn.attest(t, "fake-4-first")
		first := waitCSR(t, env, "fake-4-first", time.Minute, challenged)
		fn.answer(t, fn.client, first, "fake-4-second")
		wantDenied(t, env, "fake-4-first", attestor.ReasonChallengeAnswered)
		time.Sleep(2 * time.Second) // a few approvals refused
		if c := waitCSR(t, env, "fake-4-second", time.Second, func(*certificatesv1.CertificateSigningRequest) bool { return true }); len(c.Status.Conditions) > 0 {
			t.Fatalf("answer while its approval is refused: %q, want undecided", conditions(c))
		}
		stop()
		c := waitCSR(t, env, "fake-4-second", time.Minute, func(c *certificatesv1.CertificateSigningRequest) bool {
			return len(c.Status.Certificate) > 0 || denied(c) != ""
		})
		if len(c.Status.Certificate) == 0 {
			t.Fatalf("answer once its approval goes through: %q, want issued", conditions(c))
		}
	})

	t.Run("controller restarts between CSR #1 and CSR #2", func(t *testing.T) {
		fn := newFakeNode(t, env, "tpm-fake-2", 12, ca)
		env.Mgmt.CreateMachine(t, env.Namespace, env.Cluster, "machine-"+fn.name, fn.providerID, true, fn.name)
		fn.attest(t, "fake-2-first")
		first := waitCSR(t, env, "fake-2-first", time.Minute, challenged)
		env.StopController()
		fn.answer(t, fn.client, first, "fake-2-second")
		// A new process, with a short challenge TTL for the next cases; it
		// reads the same key from the management cluster.
		restart(4 * time.Second)
		c := waitCSR(t, env, "fake-2-second", time.Minute, func(c *certificatesv1.CertificateSigningRequest) bool {
			return len(c.Status.Certificate) > 0 || denied(c) != ""
		})
		if len(c.Status.Certificate) == 0 {
			t.Fatalf("answer after a restart: %q", conditions(c))
		}
		wantDenied(t, env, "fake-2-first", attestor.ReasonChallengeAnswered)
	})

	t.Run("challenge expired", func(t *testing.T) {
		fn := newFakeNode(t, env, "tpm-fake-3", 13, ca)
		env.Mgmt.CreateMachine(t, env.Namespace, env.Cluster, "machine-"+fn.name, fn.providerID, true, fn.name)
		fn.attest(t, "fake-3-first")
		first := waitCSR(t, env, "fake-3-first", time.Minute, challenged)
		// Nobody answers: the controller closes CSR #1 at the expiry.
		wantDenied(t, env, "fake-3-first", attestor.ReasonChallengeExpired)
		// A late answer is refused too.
		fn.answer(t, fn.client, first, "fake-3-late")
		wantDenied(t, env, "fake-3-late", attestor.ReasonChallengeExpired)
	})

	t.Run("node files anew after its challenge expired unanswered", func(t *testing.T) {
		n := node("tpm-2", 3, caDir)
		// The node files CSR #1 while no controller runs, and gives up.
		env.StopController()
		short, stop := context.WithTimeout(ctx, 5*time.Second)
		r := n.Credential(short)
		stop()
		if r.Err == nil {
			t.Fatal("credential succeeded without a controller")
		}
		csrs := nodeCSRs(t, env, n.Name)
		if len(csrs) != 1 {
			t.Fatalf("%d CSRs", len(csrs))
		}
		restart(4 * time.Second)
		wantDenied(t, env, csrs[0].Name, attestor.ReasonChallengeExpired)
		// The next call (kubelet's next try) gets a certificate by itself.
		whoami(ctx, t, env, n)
	})
}

// TestTPMSwtpm runs the node binary against swtpm (libtpms), a second,
// independent TPM implementation, over its socket, with EK certificates
// issued by swtpm_setup from a self-made manufacturer CA.
func TestTPMSwtpm(t *testing.T) {
	sock, bundle := harness.StartSwtpm(t, nil)
	otherDir, _ := manufacturerCA(t, "Another TPM Maker")

	env := scenario.Start(t, scenario.Options{Attestors: "tpm", ControllerArgs: []string{
		"--tpm-manufacturer-ca=" + bundle,
		"--tpm-manufacturer-ca=" + filepath.Join(otherDir, tpmtest.BundleFile),
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	n := env.NewNode(t, "swtpm-1", "test:///fleet/swtpm-1", "tpm", "tpm:\n  device: unix://"+sock+"\n")
	env.Machine(t, n)
	whoami(ctx, t, env, n)
	checkRound(t, env, n.Name)

	// The same swtpm for a second Machine.
	clone := env.NewNode(t, "swtpm-clone", "test:///fleet/swtpm-clone", "tpm", "tpm:\n  device: unix://"+sock+"\n")
	env.Machine(t, clone)
	if r := clone.Credential(ctx); r.Err == nil {
		t.Fatal("a second Machine with the same swtpm got a certificate")
	}
	_, second := tpmCSRs(t, env, clone.Name)
	wantDenied(t, env, second.Name, attestor.ReasonIdentityClaimedByOtherMachine)
}

// refuseApprovals makes the workload cluster refuse, by a
// ValidatingAdmissionPolicy, every write of the approval of the CSR named
// name, and returns once the policy is enforced; the function it returns
// removes the policy.
func refuseApprovals(t *testing.T, env *scenario.Env, name string) (stop func()) {
	t.Helper()
	ctx := context.Background()
	api := env.Workload.Client.AdmissionregistrationV1()
	probe := name + "-probe"
	policy := &admissionregistrationv1.ValidatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "refuse-" + name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionregistrationv1.Fail),
			MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionregistrationv1.RuleWithOperations{
					Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Update},
					Rule: admissionregistrationv1.Rule{APIGroups: []string{"certificates.k8s.io"}, APIVersions: []string{"*"},
						Resources: []string{"certificatesigningrequests/approval"}},
				},
			}}},
			Validations: []admissionregistrationv1.Validation{{Expression: fmt.Sprintf("!(object.metadata.name in [%q, %q])", name, probe)}},
		},
	}
	if _, err := api.ValidatingAdmissionPolicies().Create(ctx, policy, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: policy.Name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: policy.Name,
			ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}},
	}
	if _, err := api.ValidatingAdmissionPolicyBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	stop = func() {
		t.Helper()
		if err := api.ValidatingAdmissionPolicyBindings().Delete(ctx, binding.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := api.ValidatingAdmissionPolicies().Delete(ctx, policy.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// Enforced once the approval of the probe, by the admin, is refused.
	csrs := env.Workload.Client.CertificatesV1().CertificateSigningRequests()
	key, err := csr.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	der, err := csr.PKCS10(key, probe, "test:///probe")
	if err != nil {
		t.Fatal(err)
	}
	obj := csr.Object(probe, "example.com/probe", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}), nil, nil)
	if _, err := csrs.Create(ctx, obj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := csrs.Get(ctx, probe, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		c.Status.Conditions = []certificatesv1.CertificateSigningRequestCondition{{Type: certificatesv1.CertificateDenied, Status: corev1.ConditionTrue, Reason: "Probe"}}
		_, err = csrs.UpdateApproval(ctx, probe, c, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
		if apierrors.IsInvalid(err) || apierrors.IsForbidden(err) {
			return stop
		}
		if err != nil {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatal("the policy refusing approvals is not enforced after 30s")
		}
		time.Sleep(100 * time.Millisecond)
	}
}
