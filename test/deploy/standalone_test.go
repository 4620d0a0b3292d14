package deploy

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/kubelet-authenticator/attestor"

	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/signer/standalone"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestStandaloneManifests applies deploy/standalone to a real cluster (Pod
// Security "restricted" on its namespace) and runs the real controller
// binary with the Deployment's arguments and nothing but a token of its
// ServiceAccount: it signs an allowlisted node's CSR, refuses a second
// registration once the node's Node exists, and logs no forbidden
// request, so the manifests' RBAC is all standalone mode needs.
func TestStandaloneManifests(t *testing.T) {
	harness.Binaries(t)
	bin := buildController(t)
	m := render(t, "standalone")
	var d appsv1.Deployment
	m.get(t, "Deployment", deployment, &d)
	wl := harness.StartControlPlane(t, "standalone")
	apply(t, wl.AdminKubeconfig, m)
	ctx := context.Background()

	// What the operator adds (docs/standalone.md): the CA and the allowlist.
	if _, err := wl.Client.CoreV1().Secrets(namespace).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "cluster-ca"}, Type: corev1.SecretTypeTLS,
		Data: map[string][]byte{corev1.TLSCertKey: wl.CACertPEM, corev1.TLSPrivateKeyKey: wl.CAKeyPEM},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := wl.Client.CoreV1().ConfigMaps(namespace).Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "allowlist"},
		Data: map[string]string{standalone.AllowlistKey: `nodes:
- nodeName: node-1
  providerID: test:///node-1
`},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	tr, err := wl.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, serviceAccount,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr(int64(3600))}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "sa.kubeconfig")
	if err := os.WriteFile(kubeconfig, wl.KubeconfigFor("", clientcmdapi.AuthInfo{Token: tr.Status.Token}), 0o600); err != nil {
		t.Fatal(err)
	}
	args := append(append([]string(nil), d.Spec.Template.Spec.Containers[0].Args...),
		"--authorized-attestors=insecure", // beside the Deployment's tpm
		"--revocation-period=1s",
		"--kubeconfig="+kubeconfig,
		"--leader-election-namespace="+namespace,
		fmt.Sprintf("--metrics-bind-address=127.0.0.1:%d", harness.FreePort(t)),
		fmt.Sprintf("--health-probe-bind-address=127.0.0.1:%d", harness.FreePort(t)),
		"-v=2")
	log := filepath.Join(dir, "controller.log")
	harness.StartProcess(t, "controller", log, bin, args...)

	bootstrap := wl.BootstrapClient(t)
	file := func(name string) *certificatesv1.CertificateSigningRequest {
		t.Helper()
		req, _ := signertest.Request{NodeName: "node-1", ProviderID: "test:///node-1"}.Build(t)
		csr := signertest.CSR(name, req)
		csr.Spec.Username, csr.Spec.Groups = "", nil
		if _, err := bootstrap.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		return harness.WaitForCSRDecision(t, wl.Client, name, 60*time.Second)
	}
	if got := file("first"); len(got.Status.Certificate) == 0 {
		t.Fatalf("the allowlisted node's request was not issued: %+v", got.Status.Conditions)
	}
	if _, err := wl.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got := file("again")
	if c := harness.CSRCondition(got, certificatesv1.CertificateDenied); c == nil || c.Reason != attestor.ReasonNodeAlreadyJoined {
		t.Errorf("a second registration of a joined node: %+v, want denied %s", got.Status.Conditions, attestor.ReasonNodeAlreadyJoined)
	}
	// Its entry taken out of the allowlist, the node's name is revoked.
	if _, err := wl.Client.CoreV1().ConfigMaps(namespace).Update(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "allowlist"}, Data: map[string]string{standalone.AllowlistKey: "nodes: []\n"},
	}, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		s, err := revoke.Read(ctx, wl.Client.CoreV1())
		if err != nil {
			return false, client.IgnoreNotFound(err)
		}
		return s.Find("node-1") != nil, nil
	})
	if _, err := wl.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies().Get(ctx, revoke.PolicyName, metav1.GetOptions{}); err != nil {
		t.Errorf("the revocation policy: %v", err)
	}
	// The TPM attestor's key, made with the ServiceAccount's rights.
	if _, err := wl.Client.CoreV1().Secrets(namespace).Get(ctx, app.DefaultTPMKeySecretName, metav1.GetOptions{}); err != nil {
		t.Errorf("the TPM key Secret: %v", err)
	}
	if l := readFile(t, log); strings.Contains(strings.ToLower(l), "forbidden") {
		t.Errorf("the controller logs a forbidden request:\n%s", grep(l, "orbidden"))
	}
}
