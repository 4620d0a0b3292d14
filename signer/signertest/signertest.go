// Package signertest builds attested kubelet client certificate signing
// requests, good and bad, for tests of the signer: unit tests and the
// integration tests that file them against a real kube-apiserver.
package signertest

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"net"
	"testing"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
)

// Request describes an attested CSR. The zero value of every field but
// NodeName and ProviderID yields a request that follows the wire contract.
type Request struct {
	// NodeName goes into CN=system:node:<NodeName>.
	NodeName string
	// ProviderID goes into the provider ID extension and the insecure
	// evidence.
	ProviderID string

	// Key signs the PKCS#10; nil means a fresh ECDSA P-256 key.
	Key crypto.Signer
	// Subject, when set, replaces the subject built from NodeName.
	Subject *pkix.Name
	// DNSNames, IPs and Emails are subject alternative names to request.
	DNSNames []string
	IPs      []net.IP
	Emails   []string
	// ExtraExtensions are added to the PKCS#10 request.
	ExtraExtensions []pkix.Extension
	// OmitProviderID leaves the provider ID extension out.
	OmitProviderID bool
	// Provider is the provider block; "" means insecure.
	Provider string
	// Evidence is the data block; nil means insecure evidence for
	// ProviderID.
	Evidence attestor.Evidence
	// Trailer is appended to spec.request after the three PEM blocks.
	Trailer []byte
}

// Build returns spec.request and the key it was made with.
func (r Request) Build(t testing.TB) ([]byte, crypto.Signer) {
	t.Helper()
	key := r.Key
	if key == nil {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		key = k
	}
	subject := pkix.Name{CommonName: attestor.NodeUserPrefix + r.NodeName, Organization: []string{attestor.NodesGroup}}
	if r.Subject != nil {
		subject = *r.Subject
	}
	tmpl := &x509.CertificateRequest{
		Subject:         subject,
		DNSNames:        r.DNSNames,
		IPAddresses:     r.IPs,
		EmailAddresses:  r.Emails,
		ExtraExtensions: append([]pkix.Extension(nil), r.ExtraExtensions...),
	}
	if !r.OmitProviderID {
		ext, err := attestor.ProviderIDExtension(r.ProviderID)
		if err != nil {
			t.Fatal(err)
		}
		tmpl.ExtraExtensions = append(tmpl.ExtraExtensions, ext)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		t.Fatal(err)
	}
	provider := r.Provider
	if provider == "" {
		provider = insecure.Name
	}
	ev := r.Evidence
	if ev == nil {
		ev, err = json.Marshal(insecure.Evidence{Version: insecure.VersionV1, ProviderID: r.ProviderID})
		if err != nil {
			t.Fatal(err)
		}
	}
	req, err := attestor.EncodeRequest(der, provider, ev)
	if err != nil {
		t.Fatal(err)
	}
	return append(req, r.Trailer...), key
}

// ClientUsages are the usages of a kubelet client certificate.
var ClientUsages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}

// CSR returns a CertificateSigningRequest object for the insecure client
// signer, as filed by bootstrap token user system:bootstrap:abcdef.
func CSR(name string, request []byte) *certificatesv1.CertificateSigningRequest {
	return &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: certificatesv1.CertificateSigningRequestSpec{
			Request:    request,
			SignerName: attestor.ClientSignerName(insecure.Name),
			Usages:     append([]certificatesv1.KeyUsage(nil), ClientUsages...),
			Username:   "system:bootstrap:abcdef",
			Groups:     []string{attestor.BootstrappersGroup, "system:bootstrappers:kubeadm:default-node-token", "system:authenticated"},
		},
	}
}
