package integration

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/signer/standalone"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestSignerStandalone runs the controller without Cluster API, in the
// cluster it serves: nodes are matched against an allowlist ConfigMap and
// certificates signed with the CA from a Secret of that cluster.
func TestSignerStandalone(t *testing.T) {
	harness.Binaries(t)
	ctx := context.Background()
	wl := harness.StartControlPlane(t, "standalone")
	ns := metav1.NamespaceSystem
	if _, err := wl.Client.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "cluster-ca"},
		Type:       corev1.SecretTypeTLS,
		Data:       map[string][]byte{corev1.TLSCertKey: wl.CACertPEM, corev1.TLSPrivateKeyKey: wl.CAKeyPEM},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := wl.Client.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "kubelet-authenticator-allowlist"},
		Data: map[string]string{standalone.AllowlistKey: `nodes:
- nodeName: node-good
  providerID: test:///good
- nodeName: node-pid
  providerID: test:///pid
- nodeName: node-pinned
  providerID: test:///pinned
  identity: insecure:some-other-machine
`},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	o := app.NewStandaloneOptions()
	o.UnauthorizedListPeriod = unauthorizedListPeriod
	o.RESTConfig = wl.AdminConfig
	o.LeaderElectionNamespace = ns
	o.MetricsBindAddress, o.HealthProbeBindAddress = "0", "0"
	o.MaxClientCertificateLifetime = 24 * time.Hour
	o.CASecret = ns + "/cluster-ca"
	o.AuthorizedAttestors = []string{"insecure"}
	runOptions(t, o)

	e := &signerEnv{wl: wl, bootstrap: wl.BootstrapClient(t)}
	build := func(node, pid string) []byte {
		b, _ := signertest.Request{NodeName: node, ProviderID: pid}.Build(t)
		return b
	}
	e.file(t, signertest.CSR("good", build("node-good", "test:///good")))
	negatives := map[string]string{
		"not-listed":   attestor.ReasonNodeNotAllowed,
		"pid-mismatch": attestor.ReasonAllowlistProviderIDMismatch,
		"pinned":       attestor.ReasonIdentityMismatch,
	}
	e.file(t, signertest.CSR("not-listed", build("node-ghost", "test:///ghost")))
	e.file(t, signertest.CSR("pid-mismatch", build("node-pid", "test:///not-pid")))
	e.file(t, signertest.CSR("pinned", build("node-pinned", "test:///pinned")))

	e.expectIssued(t, "good", "node-good", "test:///good", 24*time.Hour)
	for name, reason := range negatives {
		e.expectDenied(t, name, reason)
	}
	if v, ok := gauge(t, "kubelet_authenticator_signer_workload_cluster_synced", "/"+app.StandaloneCluster); !ok || v != 1 {
		t.Errorf("synced metric = %v (present %t)", v, ok)
	}
}
