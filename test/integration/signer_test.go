package integration

import (
	"context"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"fmt"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

const (
	signerNS      = "signer-test"
	signerCluster = "wl"
)

// signerEnv is a management cluster running the signer in-process, and one
// opted-in workload cluster whose bootstrap token files CSRs.
type signerEnv struct {
	mgmt      *harness.Management
	wl        *harness.ControlPlane
	bootstrap kubernetes.Interface
}

func startSigner(t *testing.T, opts ...harness.Option) *signerEnv {
	t.Helper()
	harness.Binaries(t)
	start := time.Now()
	mgmt := harness.StartManagement(t)
	wl := harness.StartControlPlane(t, "workload", opts...)
	mgmt.AddWorkloadCluster(t, signerNS, signerCluster, wl, map[string]string{
		capi.AnnotationEnabled:             "true",
		capi.AnnotationAuthorizedAttestors: "insecure",
	})
	t.Logf("control planes ready in %s", time.Since(start).Round(time.Millisecond))

	runSigner(t, mgmt, nil)

	return &signerEnv{mgmt: mgmt, wl: wl, bootstrap: wl.BootstrapClient(t)}
}

// file creates a CSR as the bootstrap token user.
func (e *signerEnv) file(t *testing.T, csr *certificatesv1.CertificateSigningRequest) {
	t.Helper()
	csr.Spec.Username, csr.Spec.Groups = "", nil // set by kube-apiserver
	if _, err := e.bootstrap.CertificatesV1().CertificateSigningRequests().Create(context.Background(), csr, metav1.CreateOptions{}); err != nil {
		t.Fatalf("unable to create CSR %s: %v", csr.Name, err)
	}
}

func (e *signerEnv) get(t *testing.T, name string) *certificatesv1.CertificateSigningRequest {
	t.Helper()
	csr, err := e.wl.Client.CertificatesV1().CertificateSigningRequests().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return csr
}

func condition(csr *certificatesv1.CertificateSigningRequest, typ certificatesv1.RequestConditionType) *certificatesv1.CertificateSigningRequestCondition {
	for i := range csr.Status.Conditions {
		if csr.Status.Conditions[i].Type == typ {
			return &csr.Status.Conditions[i]
		}
	}
	return nil
}

// waitDecided waits until the CSR is denied, failed or issued.
func (e *signerEnv) waitDecided(t *testing.T, name string) *certificatesv1.CertificateSigningRequest {
	t.Helper()
	var csr *certificatesv1.CertificateSigningRequest
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		csr = e.get(t, name)
		return len(csr.Status.Certificate) > 0 || condition(csr, certificatesv1.CertificateDenied) != nil || condition(csr, certificatesv1.CertificateFailed) != nil, nil
	})
	return csr
}

func (e *signerEnv) expectDenied(t *testing.T, name, reason string) {
	t.Helper()
	csr := e.waitDecided(t, name)
	d := condition(csr, certificatesv1.CertificateDenied)
	if d == nil {
		t.Fatalf("CSR %s was not denied: %+v", name, csr.Status)
	}
	if d.Reason != reason {
		t.Fatalf("CSR %s denied with reason %s (%s), want %s", name, d.Reason, d.Message, reason)
	}
	if d.Message == "" {
		t.Errorf("CSR %s denied without a message", name)
	}
	if len(csr.Status.Certificate) > 0 || condition(csr, certificatesv1.CertificateApproved) != nil {
		t.Errorf("denied CSR %s was also approved or issued", name)
	}
	t.Logf("%s denied: %s: %s", name, d.Reason, d.Message)
}

// expectIssued checks an issued certificate: approved by the signer,
// chaining to the workload cluster's CA, for the node, carrying the provider
// ID extension and nothing else that was requested.
func (e *signerEnv) expectIssued(t *testing.T, name, node, providerID string, maxLife time.Duration) *x509.Certificate {
	t.Helper()
	csr := e.waitDecided(t, name)
	if a := condition(csr, certificatesv1.CertificateApproved); a == nil || a.Reason != attestor.ReasonAttestationVerified {
		t.Fatalf("CSR %s not approved by the signer: %+v", name, csr.Status.Conditions)
	}
	if len(csr.Status.Certificate) == 0 {
		t.Fatalf("CSR %s approved but not issued: %+v", name, csr.Status.Conditions)
	}
	b, rest := pem.Decode(csr.Status.Certificate)
	if b == nil || b.Type != "CERTIFICATE" || len(strings.TrimSpace(string(rest))) != 0 {
		t.Fatalf("status.certificate is not one PEM certificate: %q", csr.Status.Certificate)
	}
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(e.wl.CACertPEM) {
		t.Fatal("bad workload CA")
	}
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("certificate does not chain to the workload cluster CA: %v", err)
	}
	if cert.Subject.CommonName != attestor.NodeUserPrefix+node || len(cert.Subject.Organization) != 1 || cert.Subject.Organization[0] != attestor.NodesGroup {
		t.Errorf("subject = %s", cert.Subject)
	}
	if len(cert.DNSNames)+len(cert.IPAddresses)+len(cert.URIs)+len(cert.EmailAddresses) > 0 || cert.IsCA {
		t.Errorf("certificate carries SANs or is a CA")
	}
	if got, err := attestor.ProviderIDFromExtensions(cert.Extensions); err != nil || got != providerID {
		t.Errorf("provider ID extension = %q, %v; want %q", got, err, providerID)
	}
	for _, ext := range cert.Extensions {
		if ext.Id.Equal(extraOID) {
			t.Errorf("certificate carries the requested extension %s; only the provider ID may be copied", extraOID)
		}
	}
	if life := time.Until(cert.NotAfter); life > maxLife || life < maxLife-5*time.Minute {
		t.Errorf("certificate lives another %s, want about %s", life.Round(time.Second), maxLife)
	}
	return cert
}

// extraOID is an extension the good CSR asks for, which must not be copied.
var extraOID = asn1.ObjectIdentifier{1, 3, 6, 1, 4, 1, 99999, 1}

func TestSignerEndToEnd(t *testing.T) {
	e := startSigner(t)
	ctx := context.Background()

	machines := []struct {
		name, providerID string
		ready            bool
		hostnames        []string
	}{
		{"worker-good", "test:///good", true, []string{"ip-10-0-0-1"}},
		{"worker-cn", "test:///cn", true, nil},
		{"worker-pid", "test:///pid", true, nil},
		{"worker-san", "test:///san", true, nil},
		{"worker-garbage", "test:///garbage", true, nil},
		{"worker-late", "test:///late", false, nil},
	}
	for _, m := range machines {
		e.mgmt.CreateMachine(t, signerNS, signerCluster, m.name, m.providerID, m.ready, m.hostnames...)
	}
	extra := pkix.Extension{Id: extraOID, Value: []byte{0x05, 0x00}}
	build := func(r signertest.Request) []byte {
		b, _ := r.Build(t)
		return b
	}

	oneHour := int32(3600)
	good := signertest.CSR("good", build(signertest.Request{NodeName: "worker-good", ProviderID: "test:///good", ExtraExtensions: []pkix.Extension{extra}}))
	good.Spec.ExpirationSeconds = &oneHour
	byHostname := signertest.CSR("by-hostname", build(signertest.Request{NodeName: "ip-10-0-0-1", ProviderID: "test:///good"}))
	late := signertest.CSR("bootstrap-not-ready", build(signertest.Request{NodeName: "worker-late", ProviderID: "test:///late"}))

	// A CSR of another signer, which the controller must leave alone.
	foreign := signertest.CSR("foreign", build(signertest.Request{NodeName: "worker-good", ProviderID: "test:///good"}))
	foreign.Spec.SignerName = certificatesv1.KubeAPIServerClientSignerName

	negatives := []struct {
		csr    *certificatesv1.CertificateSigningRequest
		reason string
	}{
		{signertest.CSR("no-machine", build(signertest.Request{NodeName: "ghost", ProviderID: "test:///ghost"})), attestor.ReasonMachineNotFound},
		{signertest.CSR("cn-mismatch", build(signertest.Request{NodeName: "control-plane-0", ProviderID: "test:///cn"})), attestor.ReasonNodeNameMismatch},
		{signertest.CSR("providerid-mismatch", build(signertest.Request{NodeName: "worker-pid", ProviderID: "test:///not-pid"})), attestor.ReasonMachineProviderIDMismatch},
		{signertest.CSR("san", build(signertest.Request{NodeName: "worker-san", ProviderID: "test:///san", DNSNames: []string{"kubernetes.default.svc"}})), attestor.ReasonUnexpectedSAN},
		{signertest.CSR("trailing-garbage", build(signertest.Request{NodeName: "worker-garbage", ProviderID: "test:///garbage", Trailer: []byte("trailing garbage\n")})), attestor.ReasonMalformedRequest},
	}

	for _, c := range []*certificatesv1.CertificateSigningRequest{good, byHostname, late, foreign} {
		e.file(t, c)
	}
	for _, n := range negatives {
		e.file(t, n.csr)
	}

	t.Run("good CSR is approved and issued", func(t *testing.T) {
		e.expectIssued(t, "good", "worker-good", "test:///good", time.Hour)
	})
	t.Run("node name from a Hostname address", func(t *testing.T) {
		e.expectIssued(t, "by-hostname", "ip-10-0-0-1", "test:///good", 24*time.Hour)
	})
	for _, n := range negatives {
		t.Run("denied "+n.csr.Name, func(t *testing.T) {
			e.expectDenied(t, n.csr.Name, n.reason)
		})
	}

	t.Run("bootstrap not ready is retried, then signed", func(t *testing.T) {
		// Everything else has been decided by now; give the signer a few
		// more retries on this one.
		time.Sleep(3 * time.Second)
		csr := e.get(t, "bootstrap-not-ready")
		if len(csr.Status.Conditions) != 0 || len(csr.Status.Certificate) != 0 {
			t.Fatalf("CSR for a Machine that is not bootstrapped was decided: %+v", csr.Status)
		}
		var m clusterv1.Machine
		if err := e.mgmt.Client.Get(ctx, types.NamespacedName{Namespace: signerNS, Name: "worker-late"}, &m); err != nil {
			t.Fatal(err)
		}
		yes := true
		m.Status.Initialization.BootstrapDataSecretCreated = &yes
		m.Status.Conditions = []metav1.Condition{{
			Type: clusterv1.MachineBootstrapConfigReadyCondition, Status: metav1.ConditionTrue,
			Reason: clusterv1.MachineBootstrapDataSecretProvidedReason, LastTransitionTime: metav1.Now(),
		}}
		if err := e.mgmt.Client.Status().Update(ctx, &m); err != nil {
			t.Fatal(err)
		}
		e.expectIssued(t, "bootstrap-not-ready", "worker-late", "test:///late", 24*time.Hour)
	})

	t.Run("foreign signer is left alone", func(t *testing.T) {
		csr := e.get(t, "foreign")
		if len(csr.Status.Conditions) != 0 || len(csr.Status.Certificate) != 0 || len(csr.Annotations) != 0 {
			t.Fatalf("CSR of signer %s was touched: %+v %v", csr.Spec.SignerName, csr.Status, csr.Annotations)
		}
	})
}

// TestSignerAuthorizedAttestors checks that a Cluster's authorized
// attestors bind: a CSR for an attestor the Cluster does not list is
// denied, and a Cluster that opts out gets no controller.
func TestSignerAuthorizedAttestors(t *testing.T) {
	e := startSigner(t)
	e.mgmt.CreateMachine(t, signerNS, signerCluster, "worker-0", "test:///0", true)

	e.editCluster(t, func(c *clusterv1.Cluster) { c.Annotations[capi.AnnotationAuthorizedAttestors] = "tpm" })
	// The controller restarts with the new list; a CSR filed right away may
	// still meet the old one, so file one per second until one is denied.
	deadline := time.Now().Add(60 * time.Second)
	for i := 0; ; i++ {
		name := fmt.Sprintf("unauthorized-%d", i)
		b, _ := signertest.Request{NodeName: "worker-0", ProviderID: "test:///0"}.Build(t)
		e.file(t, signertest.CSR(name, b))
		csr := e.waitDecided(t, name)
		if d := condition(csr, certificatesv1.CertificateDenied); d != nil {
			if d.Reason != attestor.ReasonAttestorNotAuthorized {
				t.Fatalf("denied with %s (%s), want %s", d.Reason, d.Message, attestor.ReasonAttestorNotAuthorized)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("CSRs for an attestor the Cluster no longer authorizes are still signed")
		}
		time.Sleep(time.Second)
	}

	// Opt out: no controller decides anything any more.
	e.editCluster(t, func(c *clusterv1.Cluster) {
		c.Annotations[capi.AnnotationEnabled] = "false"
		c.Annotations[capi.AnnotationAuthorizedAttestors] = "insecure"
	})
	time.Sleep(3 * time.Second)
	b, _ := signertest.Request{NodeName: "worker-0", ProviderID: "test:///0"}.Build(t)
	e.file(t, signertest.CSR("opted-out", b))
	time.Sleep(5 * time.Second)
	if csr := e.get(t, "opted-out"); len(csr.Status.Conditions) != 0 {
		t.Fatalf("CSR of an opted-out Cluster was decided: %+v", csr.Status.Conditions)
	}
}
