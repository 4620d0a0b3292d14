//go:build testattestors

package integration

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"net"
	"slices"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/attestor/null"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/signer/standalone"
	"sigs.k8s.io/kubelet-authenticator/signer/trust"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestSignerStandaloneServing: standalone mode issues serving certificates
// as Cluster API mode does, with the allowlist entry in the Machine's
// place. The attested serving signer signs with a serving CA the
// controller keeps and publishes as ClusterTrustBundles; kubelet's own
// serving requests are approved (kube-controller-manager signs them).
// Either only for the node itself, authenticated by its certificate, and
// only with its entry's names and addresses: a bootstrap-token holder gets
// no serving certificate for any node, and a node none for another's
// name or address.
func TestSignerStandaloneServing(t *testing.T) {
	harness.Binaries(t)
	ctx := context.Background()
	wl := harness.StartControlPlane(t, "standalone-serving")
	ns := metav1.NamespaceSystem
	if _, err := wl.Client.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "kubelet-authenticator-allowlist"},
		Data: map[string]string{standalone.AllowlistKey: `nodes:
- nodeName: node-0
  providerID: test:///0
  dnsNames: [node-0, node-0.internal]
  ips: [10.0.0.5]
- nodeName: node-1
  providerID: test:///1
  dnsNames: [node-1]
`},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	wl.StartControllerManager(t, "csrsigning")
	o := app.NewStandaloneOptions()
	o.UnauthorizedListPeriod = unauthorizedListPeriod
	o.RESTConfig = wl.AdminConfig
	o.LeaderElectionNamespace = ns
	o.MetricsBindAddress, o.HealthProbeBindAddress = "0", "0"
	o.MaxClientCertificateLifetime = 24 * time.Hour
	o.CACertFile, o.CAKeyFile = wl.CACertFile, wl.CAKeyFile
	o.AuthorizedAttestors = []string{insecure.Name, null.Name}
	o.NullVersions = []string{"v1"}
	o.ServingCASecret = ns + "/serving-ca"
	o.ApproveKubeletServing = true
	runOptions(t, o)

	nodeClient := func(name string) kubernetes.Interface {
		t.Helper()
		certPEM, keyPEM := wl.IssueClientCert(t, "system:node:"+name, "system:nodes")
		c, err := kubernetes.NewForConfig(wl.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	node0, node1, ghost := nodeClient("node-0"), nodeClient("node-1"), nodeClient("node-ghost")
	bootstrap := wl.BootstrapClient(t)
	e := &signerEnv{wl: wl, bootstrap: bootstrap}
	create := func(c kubernetes.Interface, csr *certificatesv1.CertificateSigningRequest) {
		t.Helper()
		if _, err := c.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{}); err != nil {
			t.Fatalf("unable to create CSR %s: %v", csr.Name, err)
		}
	}
	attested := attestor.ServingSignerName(null.Name)
	attestedCSR := func(name, node, pid string, dns []string, ips []net.IP) *certificatesv1.CertificateSigningRequest {
		t.Helper()
		ev, err := json.Marshal(null.Evidence{Version: "v1", ProviderID: pid})
		if err != nil {
			t.Fatal(err)
		}
		b, _ := signertest.Request{NodeName: node, ProviderID: pid, DNSNames: dns, IPs: ips, Provider: null.Name, Evidence: ev}.Build(t)
		return servingCSR(name, attested, b)
	}
	kubelet := certificatesv1.KubeletServingSignerName
	ip5 := []net.IP{net.ParseIP("10.0.0.5")}

	create(node0, attestedCSR("attested-good", "node-0", "test:///0", []string{"node-0", "node-0.internal"}, ip5))
	create(node0, servingCSR("kubelet-good", kubelet, servingCSRPEM(t, "system:node:node-0", []string{"node-0"}, ip5, nil)))
	negatives := []struct {
		client kubernetes.Interface
		csr    *certificatesv1.CertificateSigningRequest
		reason string
	}{
		// A bootstrap-token holder asks for a joined node's serving
		// certificate, through either signer.
		{bootstrap, attestedCSR("attested-bootstrap", "node-0", "test:///0", []string{"node-0"}, nil), attestor.ReasonRequesterNotAllowed},
		{bootstrap, servingCSR("kubelet-bootstrap", kubelet, servingCSRPEM(t, "system:node:node-0", []string{"node-0"}, nil, nil)), attestor.ReasonRequesterNotAllowed},
		// A node asks for another node's certificate, or for its address.
		{node1, attestedCSR("attested-other-node", "node-0", "test:///0", []string{"node-0"}, nil), attestor.ReasonRequesterMismatch},
		{node1, attestedCSR("attested-other-address", "node-1", "test:///1", []string{"node-1", "node-0"}, nil), attestor.ReasonSANNotMachineAddress},
		{node1, servingCSR("kubelet-other-address", kubelet, servingCSRPEM(t, "system:node:node-1", []string{"node-1"}, ip5, nil)), attestor.ReasonSANNotMachineAddress},
		// Names and addresses outside the entry.
		{node0, attestedCSR("attested-foreign-ip", "node-0", "test:///0", []string{"node-0"}, []net.IP{net.ParseIP("10.9.9.9")}), attestor.ReasonSANNotMachineAddress},
		{node0, servingCSR("kubelet-foreign-dns", kubelet, servingCSRPEM(t, "system:node:node-0", []string{"kubernetes.default.svc"}, nil, nil)), attestor.ReasonSANNotMachineAddress},
		// A node the allowlist does not have, and insecure's serving signer.
		{ghost, servingCSR("kubelet-not-allowed", kubelet, servingCSRPEM(t, "system:node:node-ghost", []string{"node-ghost"}, nil, nil)), attestor.ReasonNodeNotAllowed},
		{node0, func() *certificatesv1.CertificateSigningRequest {
			b, _ := signertest.Request{NodeName: "node-0", ProviderID: "test:///0", DNSNames: []string{"node-0"}}.Build(t)
			return servingCSR("insecure-serving", attestor.ServingSignerName(insecure.Name), b)
		}(), attestor.ReasonSignerNotServed},
	}
	for _, n := range negatives {
		create(n.client, n.csr)
	}

	var servingCA corev1.Secret
	t.Run("attested serving signed with the serving CA", func(t *testing.T) {
		csr := e.waitDecided(t, "attested-good")
		if a := condition(csr, certificatesv1.CertificateApproved); a == nil || a.Reason != attestor.ReasonAttestedServingVerified {
			t.Fatalf("not approved by the controller: %+v", csr.Status.Conditions)
		}
		s, err := wl.Client.CoreV1().Secrets(ns).Get(ctx, "serving-ca", metav1.GetOptions{})
		if err != nil {
			t.Fatalf("serving CA secret: %v", err)
		}
		servingCA = *s
		cert := parseCert(t, csr.Status.Certificate)
		verifyChain(t, cert, s.Data[corev1.TLSCertKey], x509.ExtKeyUsageServerAuth)
		if pid, err := attestor.ProviderIDFromExtensions(cert.Extensions); err != nil || pid != "test:///0" {
			t.Errorf("provider ID = %q, %v", pid, err)
		}
		if !slices.Equal(cert.DNSNames, []string{"node-0", "node-0.internal"}) || len(cert.IPAddresses) != 1 || cert.IsCA {
			t.Errorf("SANs = %v %v, CA %t", cert.DNSNames, cert.IPAddresses, cert.IsCA)
		}
		if life := time.Until(cert.NotAfter); life > 24*time.Hour {
			t.Errorf("serving certificate lives %s, more than the cap", life)
		}
	})
	t.Run("serving CA published as a ClusterTrustBundle", func(t *testing.T) {
		if servingCA.Data == nil {
			t.Skip("no serving CA")
		}
		ca := parseCert(t, servingCA.Data[corev1.TLSCertKey])
		name := trust.BundleName(attested, ca)
		harness.WaitFor(t, 30*time.Second, func() (bool, error) {
			b, err := wl.Client.CertificatesV1beta1().ClusterTrustBundles().Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, nil
			}
			return b.Spec.SignerName == attested && parseCert(t, []byte(b.Spec.TrustBundle)).Equal(ca), nil
		})
		if v, ok := gauge(t, "kubelet_authenticator_signer_serving_ca_trust_bundles_published", "/"+app.StandaloneCluster); !ok || v != 1 {
			t.Errorf("serving_ca_trust_bundles_published = %v (present %t)", v, ok)
		}
	})
	t.Run("kubelet-serving approved by us, signed by kube-controller-manager", func(t *testing.T) {
		csr := e.waitDecided(t, "kubelet-good")
		if a := condition(csr, certificatesv1.CertificateApproved); a == nil || a.Reason != attestor.ReasonServingVerified {
			t.Fatalf("not approved by the controller: %+v", csr.Status.Conditions)
		}
		verifyChain(t, parseCert(t, csr.Status.Certificate), wl.CACertPEM, x509.ExtKeyUsageServerAuth)
	})
	for _, n := range negatives {
		t.Run("denied "+n.csr.Name, func(t *testing.T) { e.expectDenied(t, n.csr.Name, n.reason) })
	}
}
