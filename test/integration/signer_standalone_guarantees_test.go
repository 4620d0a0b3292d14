//go:build testattestors

package integration

import (
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/null"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/signer/standalone"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestSignerStandaloneGuarantees: what the Cluster API mode guarantees
// holds without it: a node registers once, and trust on first use.
func TestSignerStandaloneGuarantees(t *testing.T) {
	harness.Binaries(t)
	ctx := context.Background()
	wl := harness.StartControlPlane(t, "standalone-guarantees")
	ns := metav1.NamespaceSystem
	allow := func(list string) {
		t.Helper()
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "kubelet-authenticator-allowlist"}, Data: map[string]string{standalone.AllowlistKey: list}}
		if _, err := wl.Client.CoreV1().ConfigMaps(ns).Update(ctx, cm, metav1.UpdateOptions{}); apierrors.IsNotFound(err) {
			_, err = wl.Client.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
		} else if err != nil {
			t.Fatal(err)
		}
	}
	allow(`nodes:
- nodeName: node-joined
  providerID: test:///joined
- nodeName: node-a
  providerID: test:///a
- nodeName: node-b
  providerID: test:///b
`)
	o := app.NewStandaloneOptions()
	o.UnauthorizedListPeriod = unauthorizedListPeriod
	o.RESTConfig = wl.AdminConfig
	o.LeaderElectionNamespace = ns
	o.MetricsBindAddress, o.HealthProbeBindAddress = "0", "0"
	o.MaxClientCertificateLifetime = 24 * time.Hour
	o.CACertFile, o.CAKeyFile = wl.CACertFile, wl.CAKeyFile
	o.AuthorizedAttestors = []string{"insecure", null.Name}
	o.NullVersions = []string{"v1"}
	o.RevocationPeriod = time.Second
	runOptions(t, o)
	e := &signerEnv{wl: wl, bootstrap: wl.BootstrapClient(t)}

	// Join once: an insecure node registers once; after its Node exists a
	// bootstrap-token holder cannot get a fresh identity for it, and the
	// node renews with its own.
	req, key := signertest.Request{NodeName: "node-joined", ProviderID: "test:///joined"}.Build(t)
	e.file(t, signertest.CSR("first", req))
	cert := e.expectIssued(t, "first", "node-joined", "test:///joined", 24*time.Hour)
	k := e.kubeletClient(t, "node-joined", cert, key.(*ecdsa.PrivateKey))
	if _, err := k.client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-joined"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	again, _ := signertest.Request{NodeName: "node-joined", ProviderID: "test:///joined"}.Build(t)
	e.file(t, signertest.CSR("again", again))
	e.expectDenied(t, "again", attestor.ReasonNodeAlreadyJoined)
	renewal, _ := signertest.Request{NodeName: "node-joined", ProviderID: "test:///joined"}.Build(t)
	renew := signertest.CSR("renewal", renewal)
	renew.Spec.Username, renew.Spec.Groups = "", nil
	if _, err := k.client.CertificatesV1().CertificateSigningRequests().Create(ctx, renew, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	e.expectIssued(t, "renewal", "node-joined", "test:///joined", 24*time.Hour)

	// Trust on first use: the first stable identity an entry's node proves
	// is its own; another entry cannot claim it, nor the entry another.
	nullCSR := func(name, node, pid, stable string) {
		t.Helper()
		ev, err := json.Marshal(null.Evidence{Version: "v1", ProviderID: pid, Stable: stable})
		if err != nil {
			t.Fatal(err)
		}
		b, _ := signertest.Request{NodeName: node, ProviderID: pid, Provider: null.Name, Evidence: ev}.Build(t)
		csr := signertest.CSR(name, b)
		csr.Spec.SignerName = attestor.ClientSignerName(null.Name)
		e.file(t, csr)
	}
	nullCSR("a-first", "node-a", "test:///a", "device-1")
	e.expectIssued(t, "a-first", "node-a", "test:///a", 24*time.Hour)
	nullCSR("b-steals", "node-b", "test:///b", "device-1")
	e.expectDenied(t, "b-steals", attestor.ReasonIdentityClaimedByOtherMachine)
	nullCSR("a-swapped", "node-a", "test:///a", "device-2")
	e.expectDenied(t, "a-swapped", attestor.ReasonMachineIdentityMismatch)
	// Without a management cluster, the denials name who can act here.
	for _, name := range []string{"b-steals", "a-swapped"} {
		if msg := condition(e.get(t, name), certificatesv1.CertificateDenied).Message; strings.Contains(msg, "management cluster") ||
			!strings.Contains(msg, "the cluster's administrator") {
			t.Errorf("CSR %s's denial points to another administrator: %s", name, msg)
		}
	}
	nullCSR("a-again", "node-a", "test:///a", "device-1")
	e.expectIssued(t, "a-again", "node-a", "test:///a", 24*time.Hour)

	// An entry taken out of the allowlist gives its identity up: a new
	// entry's node may prove it.
	allow(`nodes:
- nodeName: node-joined
  providerID: test:///joined
- nodeName: node-b
  providerID: test:///b
`)
	nullCSR("b-after", "node-b", "test:///b", "device-1")
	e.expectIssued(t, "b-after", "node-b", "test:///b", 24*time.Hour)

	// Revocation: a node whose entry is taken out loses its certificates'
	// write access before they expire, by the admission policy the
	// controller keeps; the cluster's other nodes keep theirs.
	k.expectWorks(t)
	allow(`nodes:
- nodeName: node-b
  providerID: test:///b
`)
	var last error
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		last = k.heartbeat(ctx)
		return apierrors.IsForbidden(last) && strings.Contains(last.Error(), "node node-joined was revoked: its entry was taken out of the allowlist"), nil
	})
	t.Logf("node-joined writing its Node after its entry was taken out: %v", last)
}
