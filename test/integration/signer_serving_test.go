//go:build testattestors

package integration

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"net"
	"slices"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/attestor/null"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

func servingCSRPEM(t *testing.T, cn string, dns []string, ips []net.IP, emails []string) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:  pkix.Name{CommonName: cn, Organization: []string{attestor.NodesGroup}},
		DNSNames: dns, IPAddresses: ips, EmailAddresses: emails,
	}, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})
}

func servingCSR(name, signer string, request []byte, usages ...certificatesv1.KeyUsage) *certificatesv1.CertificateSigningRequest {
	if len(usages) == 0 {
		usages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth}
	}
	return &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       certificatesv1.CertificateSigningRequestSpec{Request: request, SignerName: signer, Usages: usages},
	}
}

// TestSignerServing checks serving certificates end to end: kubelet's own
// kubernetes.io/kubelet-serving CSRs are approved by the controller only
// with the Machine's addresses and signed by kube-controller-manager; the
// attested serving signer signs with the cluster's serving CA kept on the
// management cluster.
func TestSignerServing(t *testing.T) {
	harness.Binaries(t)
	ctx := context.Background()
	mgmt := harness.StartManagement(t)
	wl := harness.StartControlPlane(t, "workload")
	mgmt.AddWorkloadCluster(t, signerNS, signerCluster, wl, map[string]string{
		capi.AnnotationEnabled:               "true",
		capi.AnnotationAuthorizedAttestors:   "insecure,null",
		capi.AnnotationApproveKubeletServing: "true",
	})
	wl.StartControllerManager(t, "csrsigning")
	runSigner(t, mgmt, func(o *app.Options) { o.NullVersions = []string{"v1"} })

	m := mgmt.CreateMachine(t, signerNS, signerCluster, "worker-0", "test:///0", true, "worker-0")
	m.Status.Addresses = append(m.Status.Addresses,
		clusterv1.MachineAddress{Type: clusterv1.MachineInternalDNS, Address: "worker-0.internal"},
		clusterv1.MachineAddress{Type: clusterv1.MachineInternalIP, Address: "10.0.0.5"},
		clusterv1.MachineAddress{Type: clusterv1.MachineExternalIP, Address: "203.0.113.5"},
	)
	if err := mgmt.Client.Status().Update(ctx, m); err != nil {
		t.Fatal(err)
	}

	nodeCert, nodeKey := wl.IssueClientCert(t, "system:node:worker-0", attestor.NodesGroup)
	node, err := kubernetes.NewForConfig(wl.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: nodeCert, ClientKeyData: nodeKey}))
	if err != nil {
		t.Fatal(err)
	}
	mgmt.CreateMachine(t, signerNS, signerCluster, "worker-1", "test:///1", true, "worker-1")
	nodeClient := func(name string) kubernetes.Interface {
		certPEM, keyPEM := wl.IssueClientCert(t, attestor.NodeUserPrefix+name, attestor.NodesGroup)
		c, err := kubernetes.NewForConfig(wl.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	node1, node2 := nodeClient("worker-1"), nodeClient("worker-2")
	bootstrap := wl.BootstrapClient(t)
	e := &signerEnv{mgmt: mgmt, wl: wl, bootstrap: bootstrap}
	create := func(c kubernetes.Interface, csr *certificatesv1.CertificateSigningRequest) {
		t.Helper()
		if _, err := c.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{}); err != nil {
			t.Fatalf("unable to create CSR %s: %v", csr.Name, err)
		}
	}

	ips := []net.IP{net.ParseIP("10.0.0.5"), net.ParseIP("203.0.113.5")}
	kubelet := certificatesv1.KubeletServingSignerName
	create(node, servingCSR("kubelet-good", kubelet, servingCSRPEM(t, "system:node:worker-0", []string{"worker-0", "worker-0.internal"}, ips, nil)))
	negatives := []struct {
		client kubernetes.Interface
		csr    *certificatesv1.CertificateSigningRequest
		reason string
	}{
		{node, servingCSR("kubelet-foreign-ip", kubelet, servingCSRPEM(t, "system:node:worker-0", []string{"worker-0"}, []net.IP{net.ParseIP("10.9.9.9")}, nil)), attestor.ReasonSANNotMachineAddress},
		{node, servingCSR("kubelet-foreign-dns", kubelet, servingCSRPEM(t, "system:node:worker-0", []string{"kubernetes.default.svc"}, nil, nil)), attestor.ReasonSANNotMachineAddress},
		// kube-apiserver's CSR admission already stops a node from asking for
		// another's name; another node asking for this one's address:
		{node1, servingCSR("kubelet-other-nodes-address", kubelet, servingCSRPEM(t, "system:node:worker-1", []string{"worker-1", "worker-0"}, nil, nil)), attestor.ReasonSANNotMachineAddress},
		{node2, servingCSR("kubelet-no-machine", kubelet, servingCSRPEM(t, "system:node:worker-2", []string{"worker-2"}, nil, nil)), attestor.ReasonMachineNotFound},
		{bootstrap, servingCSR("kubelet-bootstrap", kubelet, servingCSRPEM(t, "system:node:worker-0", []string{"worker-0"}, nil, nil)), attestor.ReasonRequesterNotAllowed},
		{node, servingCSR("kubelet-email", kubelet, servingCSRPEM(t, "system:node:worker-0", []string{"worker-0"}, nil, []string{"a@example.com"})), attestor.ReasonSANTypeNotAllowed},
		{node, servingCSR("kubelet-client-usage", kubelet, servingCSRPEM(t, "system:node:worker-0", []string{"worker-0"}, nil, nil),
			certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth, certificatesv1.UsageClientAuth), attestor.ReasonUsagesNotAllowed},
	}
	for _, n := range negatives {
		create(n.client, n.csr)
	}

	// The attested serving signer of a provider that vouches for a node
	// (null stands in for one here), and insecure's, which is refused.
	attestedSigner := attestor.ServingSignerName(null.Name)
	nullEvidence, err := json.Marshal(null.Evidence{Version: "v1", ProviderID: "test:///0"})
	if err != nil {
		t.Fatal(err)
	}
	good, _ := signertest.Request{NodeName: "worker-0", ProviderID: "test:///0", DNSNames: []string{"worker-0", "worker-0.internal"}, Provider: null.Name, Evidence: nullEvidence}.Build(t)
	create(node, servingCSR("attested-good", attestedSigner, good))
	bad, _ := signertest.Request{NodeName: "worker-0", ProviderID: "test:///0", DNSNames: []string{"evil.example.com"}, Provider: null.Name, Evidence: nullEvidence}.Build(t)
	create(node, servingCSR("attested-foreign-dns", attestedSigner, bad))
	fromBootstrap, _ := signertest.Request{NodeName: "worker-0", ProviderID: "test:///0", DNSNames: []string{"worker-0"}, Provider: null.Name, Evidence: nullEvidence}.Build(t)
	create(bootstrap, servingCSR("attested-bootstrap", attestedSigner, fromBootstrap))
	insecureServing, _ := signertest.Request{NodeName: "worker-0", ProviderID: "test:///0", DNSNames: []string{"worker-0"}}.Build(t)
	create(node, servingCSR("insecure-serving", attestor.ServingSignerName(insecure.Name), insecureServing))

	t.Run("kubelet-serving approved by us, signed by kube-controller-manager", func(t *testing.T) {
		csr := e.waitDecided(t, "kubelet-good")
		if a := condition(csr, certificatesv1.CertificateApproved); a == nil || a.Reason != attestor.ReasonServingVerified {
			t.Fatalf("not approved by the controller: %+v", csr.Status.Conditions)
		}
		cert := parseCert(t, csr.Status.Certificate)
		verifyChain(t, cert, wl.CACertPEM, x509.ExtKeyUsageServerAuth)
		if !slices.Equal(cert.DNSNames, []string{"worker-0", "worker-0.internal"}) || len(cert.IPAddresses) != 2 {
			t.Errorf("SANs = %v %v", cert.DNSNames, cert.IPAddresses)
		}
	})
	for _, n := range negatives {
		t.Run("denied "+n.csr.Name, func(t *testing.T) { e.expectDenied(t, n.csr.Name, n.reason) })
	}
	t.Run("attested serving signed with the serving CA", func(t *testing.T) {
		csr := e.waitDecided(t, "attested-good")
		if a := condition(csr, certificatesv1.CertificateApproved); a == nil || a.Reason != attestor.ReasonAttestedServingVerified {
			t.Fatalf("not approved by the controller: %+v", csr.Status.Conditions)
		}
		var s corev1.Secret
		if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: signerNS, Name: signerCluster + capi.ServingCASecretSuffix}, &s); err != nil {
			t.Fatalf("serving CA secret: %v", err)
		}
		cert := parseCert(t, csr.Status.Certificate)
		verifyChain(t, cert, s.Data[corev1.TLSCertKey], x509.ExtKeyUsageServerAuth)
		if pid, err := attestor.ProviderIDFromExtensions(cert.Extensions); err != nil || pid != "test:///0" {
			t.Errorf("provider ID = %q, %v", pid, err)
		}
		if !slices.Equal(cert.DNSNames, []string{"worker-0", "worker-0.internal"}) || cert.IsCA {
			t.Errorf("SANs = %v, CA %t", cert.DNSNames, cert.IsCA)
		}
		if life := time.Until(cert.NotAfter); life > 24*time.Hour {
			t.Errorf("serving certificate lives %s, more than the cap", life)
		}
	})
	t.Run("attested serving with a foreign SAN denied", func(t *testing.T) {
		e.expectDenied(t, "attested-foreign-dns", attestor.ReasonSANNotMachineAddress)
	})
	t.Run("attested serving never for a bootstrap identity", func(t *testing.T) {
		e.expectDenied(t, "attested-bootstrap", attestor.ReasonRequesterNotAllowed)
	})
	t.Run("no serving signer for insecure", func(t *testing.T) {
		e.expectDenied(t, "insecure-serving", attestor.ReasonSignerNotServed)
	})
}

func parseCert(t *testing.T, certPEM []byte) *x509.Certificate {
	t.Helper()
	b, _ := pem.Decode(certPEM)
	if b == nil {
		t.Fatalf("no certificate in %q", certPEM)
	}
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

func verifyChain(t *testing.T, cert *x509.Certificate, caPEM []byte, usage x509.ExtKeyUsage) {
	t.Helper()
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatal("bad CA PEM")
	}
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
		t.Errorf("certificate does not verify: %v", err)
	}
}
