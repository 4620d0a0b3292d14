package checks

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509/pkix"
	"encoding/asn1"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

const (
	node = "worker-0"
	pid  = "aws:///us-east-1a/i-0abc"
)

var (
	rsaOnce sync.Once
	rsaKey  *rsa.PrivateKey
	rsa1024 *rsa.PrivateKey
)

func rsaKeys(t *testing.T) (*rsa.PrivateKey, *rsa.PrivateKey) {
	rsaOnce.Do(func() {
		var err error
		if rsaKey, err = rsa.GenerateKey(rand.Reader, 2048); err != nil {
			panic(err)
		}
		// Too small on purpose; GenerateKey refuses < 1024 bits.
		if rsa1024, err = rsa.GenerateKey(rand.Reader, 1024); err != nil {
			panic(err)
		}
	})
	return rsaKey, rsa1024
}

func reasons(err error) []string {
	var out []string
	for _, f := range attestor.Denials(err) {
		out = append(out, f.Reason)
	}
	return out
}

func TestCheck(t *testing.T) {
	good := signertest.Request{NodeName: node, ProviderID: pid}
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	_, edKey, _ := ed25519.GenerateKey(rand.Reader)
	bigRSA, smallRSA := rsaKeys(t)
	caExt := func(ca bool) pkix.Extension {
		v, _ := asn1.Marshal(struct {
			IsCA bool `asn1:"optional"`
		}{ca})
		return pkix.Extension{Id: asn1.ObjectIdentifier{2, 5, 29, 19}, Critical: true, Value: v}
	}
	// A SAN extension holding only an otherName, which Go's parser skips.
	upnSAN := pkix.Extension{Id: asn1.ObjectIdentifier{2, 5, 29, 17}, Value: []byte{0x30, 0x0b, 0xa0, 0x09, 0x06, 0x03, 0x2a, 0x03, 0x04, 0xa0, 0x02, 0x0c, 0x00}}
	dupPID, _ := attestor.ProviderIDExtension(pid)
	notUTF8PID := pkix.Extension{Id: attestor.OIDProviderID, Value: []byte{0x16, 0x01, 'x'}} // IA5String

	tests := []struct {
		name    string
		req     signertest.Request
		mutate  func(*certificatesv1.CertificateSigningRequest)
		reasons []string // nil: passes
		rules   *Rules   // nil: client rules for insecure
	}{
		{name: "good bootstrap", req: good},
		{name: "good renewal", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Username = attestor.NodeUserPrefix + node
			c.Spec.Groups = []string{attestor.NodesGroup, "system:authenticated"}
		}},
		{name: "good RSA with key encipherment", req: signertest.Request{NodeName: node, ProviderID: pid, Key: bigRSA},
			mutate: func(c *certificatesv1.CertificateSigningRequest) {
				c.Spec.Usages = append(c.Spec.Usages, certificatesv1.UsageKeyEncipherment)
			}},
		{name: "expiration seconds is not a reason to deny", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			v := int32(10 * 365 * 24 * 3600)
			c.Spec.ExpirationSeconds = &v
		}},

		{name: "provider block disagrees with the signer", req: good, rules: &Rules{Kind: Client, Attested: true, Provider: "tpm"},
			reasons: []string{attestor.ReasonProviderMismatch}},
		{name: "service account requester", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Username = "system:serviceaccount:kube-system:default"
		}, reasons: []string{attestor.ReasonRequesterNotAllowed}},
		{name: "bootstrap user outside system:bootstrappers", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Groups = []string{"system:authenticated"}
		}, reasons: []string{attestor.ReasonRequesterNotAllowed}},
		{name: "bootstrap user with a malformed token id", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Username = "system:bootstrap:ABC"
		}, reasons: []string{attestor.ReasonRequesterNotAllowed}},
		{name: "node renewing another node", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Username = "system:node:control-plane-0"
			c.Spec.Groups = []string{attestor.NodesGroup}
		}, reasons: []string{attestor.ReasonRequesterMismatch}},
		{name: "node outside system:nodes", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Username = attestor.NodeUserPrefix + node
			c.Spec.Groups = []string{"system:authenticated"}
		}, reasons: []string{attestor.ReasonRequesterNotAllowed}},

		{name: "CN without system:node prefix", req: signertest.Request{ProviderID: pid, Subject: &pkix.Name{CommonName: node, Organization: []string{attestor.NodesGroup}}},
			reasons: []string{attestor.ReasonSubjectMismatch}},
		{name: "CN with an invalid node name", req: signertest.Request{NodeName: "Worker_0", ProviderID: pid},
			reasons: []string{attestor.ReasonSubjectMismatch}},
		{name: "O missing", req: signertest.Request{ProviderID: pid, Subject: &pkix.Name{CommonName: attestor.NodeUserPrefix + node}},
			reasons: []string{attestor.ReasonSubjectMismatch}},
		{name: "extra O system:masters", req: signertest.Request{ProviderID: pid, Subject: &pkix.Name{CommonName: attestor.NodeUserPrefix + node, Organization: []string{attestor.NodesGroup, "system:masters"}}},
			reasons: []string{attestor.ReasonSubjectMismatch}},
		{name: "OU in subject", req: signertest.Request{ProviderID: pid, Subject: &pkix.Name{CommonName: attestor.NodeUserPrefix + node, Organization: []string{attestor.NodesGroup}, OrganizationalUnit: []string{"x"}}},
			reasons: []string{attestor.ReasonSubjectMismatch}},
		{name: "unknown attribute in subject", req: signertest.Request{ProviderID: pid, Subject: &pkix.Name{CommonName: attestor.NodeUserPrefix + node, Organization: []string{attestor.NodesGroup},
			ExtraNames: []pkix.AttributeTypeAndValue{{Type: asn1.ObjectIdentifier{0, 9, 2342, 19200300, 100, 1, 1}, Value: "uid"}}}},
			reasons: []string{attestor.ReasonSubjectMismatch}},

		{name: "other annotations, labels and finalizers are not read", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Annotations = map[string]string{"padding": strings.Repeat("x", 200<<10), attestor.AnnotationEndorsementKey: strings.Repeat("k", attestor.MaxAnnotationSize)}
			c.Labels = map[string]string{"l": "v"}
			c.Finalizers = []string{"example.com/f"}
		}},
		{name: "an annotation the signer reads larger than it reads", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Annotations = map[string]string{attestor.AnnotationEndorsementKey: strings.Repeat("k", attestor.MaxAnnotationSize+1)}
		}, reasons: []string{attestor.ReasonMalformedRequest}},

		{name: "server auth usage", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Usages = append(c.Spec.Usages, certificatesv1.UsageServerAuth)
		}, reasons: []string{attestor.ReasonUsagesNotAllowed}},
		{name: "cert sign usage", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Usages = append(c.Spec.Usages, certificatesv1.UsageCertSign)
		}, reasons: []string{attestor.ReasonUsagesNotAllowed}},
		{name: "client auth missing", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Usages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature}
		}, reasons: []string{attestor.ReasonUsagesNotAllowed}},
		{name: "key encipherment with an ECDSA key", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Usages = append(c.Spec.Usages, certificatesv1.UsageKeyEncipherment)
		}, reasons: []string{attestor.ReasonUsagesNotAllowed}},

		{name: "DNS SAN", req: signertest.Request{NodeName: node, ProviderID: pid, DNSNames: []string{"kubernetes.default"}},
			reasons: []string{attestor.ReasonUnexpectedSAN}},
		{name: "email SAN", req: signertest.Request{NodeName: node, ProviderID: pid, Emails: []string{"a@b.c"}},
			reasons: []string{attestor.ReasonUnexpectedSAN}},
		{name: "otherName SAN Go does not parse", req: signertest.Request{NodeName: node, ProviderID: pid, ExtraExtensions: []pkix.Extension{upnSAN}},
			reasons: []string{attestor.ReasonUnexpectedSAN}},

		{name: "CA requested", req: signertest.Request{NodeName: node, ProviderID: pid, ExtraExtensions: []pkix.Extension{caExt(true)}},
			reasons: []string{attestor.ReasonCARequested}},
		{name: "basicConstraints without CA is fine", req: signertest.Request{NodeName: node, ProviderID: pid, ExtraExtensions: []pkix.Extension{caExt(false)}}},

		{name: "no provider ID", req: signertest.Request{NodeName: node, ProviderID: pid, OmitProviderID: true},
			reasons: []string{attestor.ReasonProviderIDMissing}},
		{name: "provider ID twice (Go's parser refuses duplicate extensions)", req: signertest.Request{NodeName: node, ProviderID: pid, ExtraExtensions: []pkix.Extension{dupPID}},
			reasons: []string{attestor.ReasonMalformedRequest}},
		{name: "provider ID not a UTF8String", req: signertest.Request{NodeName: node, ProviderID: pid, OmitProviderID: true, ExtraExtensions: []pkix.Extension{notUTF8PID}},
			reasons: []string{attestor.ReasonProviderIDMalformed}},

		{name: "P-384 key", req: signertest.Request{NodeName: node, ProviderID: pid, Key: p384}, reasons: []string{attestor.ReasonKeyNotAllowed}},
		{name: "Ed25519 key", req: signertest.Request{NodeName: node, ProviderID: pid, Key: edKey}, reasons: []string{attestor.ReasonKeyNotAllowed}},
		{name: "RSA 1024 key", req: signertest.Request{NodeName: node, ProviderID: pid, Key: smallRSA}, reasons: []string{attestor.ReasonKeyNotAllowed}},

		{name: "trailing garbage after the PEM blocks", req: signertest.Request{NodeName: node, ProviderID: pid, Trailer: []byte("garbage\n")},
			reasons: []string{attestor.ReasonMalformedRequest}},
		{name: "a second data block", req: signertest.Request{NodeName: node, ProviderID: pid, Trailer: []byte("-----BEGIN KUBELET AUTHENTICATOR ATTESTATION DATA-----\ne30=\n-----END KUBELET AUTHENTICATOR ATTESTATION DATA-----\n")},
			reasons: []string{attestor.ReasonMalformedRequest}},
		{name: "bare PKCS#10 without attestation", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			end := bytes.Index(c.Spec.Request, []byte("-----END CERTIFICATE REQUEST-----\n"))
			c.Spec.Request = c.Spec.Request[:end+len("-----END CERTIFICATE REQUEST-----\n")]
		}, reasons: []string{attestor.ReasonMalformedRequest}},
		{name: "broken PKCS#10 signature", req: good, mutate: func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Request = corruptSignature(t, c.Spec.Request)
		}, reasons: []string{attestor.ReasonMalformedRequest}},

		{name: "every failure is reported at once",
			req: signertest.Request{ProviderID: pid, Subject: &pkix.Name{CommonName: "admin", Organization: []string{"system:masters"}}, DNSNames: []string{"x"}, OmitProviderID: true, Key: p384},
			mutate: func(c *certificatesv1.CertificateSigningRequest) {
				c.Spec.Usages = append(c.Spec.Usages, certificatesv1.UsageServerAuth)
			},
			reasons: []string{attestor.ReasonSubjectMismatch, attestor.ReasonSubjectMismatch, attestor.ReasonKeyNotAllowed, attestor.ReasonUsagesNotAllowed, attestor.ReasonUnexpectedSAN, attestor.ReasonProviderIDMissing}},
		{name: "request-level failures are reported with a malformed request", req: signertest.Request{NodeName: node, ProviderID: pid, Trailer: []byte("x")},
			mutate: func(c *certificatesv1.CertificateSigningRequest) {
				c.Spec.Username = "alice"
				c.Spec.Usages = []certificatesv1.KeyUsage{certificatesv1.UsageAny}
			},
			reasons: []string{attestor.ReasonRequesterNotAllowed, attestor.ReasonMalformedRequest, attestor.ReasonUsagesNotAllowed}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, _ := tt.req.Build(t)
			csr := signertest.CSR("csr", req)
			if tt.mutate != nil {
				tt.mutate(csr)
			}
			rules := clientRules
			if tt.rules != nil {
				rules = *tt.rules
			}
			got, err := Check(csr, rules)
			if tt.reasons == nil {
				if err != nil {
					t.Fatalf("Check() = %v, want no failure", err)
				}
				if got.NodeName != tt.req.NodeName || got.ProviderID != pid || got.Request.Provider != "insecure" || len(got.Binding) != 32 {
					t.Errorf("Check() = %+v", got)
				}
				return
			}
			if err == nil {
				t.Fatalf("Check() passed, want %v", tt.reasons)
			}
			if got != nil {
				t.Errorf("Check() returned %+v with an error", got)
			}
			if r := reasons(err); !slices.Equal(r, tt.reasons) {
				t.Errorf("Check() reasons = %v, want %v\n%v", r, tt.reasons, err)
			}
			reason, msg, ok := attestor.Denial(err)
			if !ok || reason != tt.reasons[0] || msg == "" {
				t.Errorf("Denial() = %q, %q, %v", reason, msg, ok)
			}
			if len(tt.reasons) > 1 && !strings.Contains(msg, "checks failed") {
				t.Errorf("Denial() message %q does not list every failure", msg)
			}
		})
	}
}

func TestCheckResult(t *testing.T) {
	req, key := signertest.Request{NodeName: node, ProviderID: pid}.Build(t)
	csr := signertest.CSR("csr", req)
	v := int32(3600)
	csr.Spec.ExpirationSeconds = &v
	got, err := Check(csr, clientRules)
	if err != nil {
		t.Fatal(err)
	}
	if got.RequestedDuration != time.Hour || got.Renewal {
		t.Errorf("Check() = %+v", got)
	}
	spki := got.Request.CSR.RawSubjectPublicKeyInfo
	if !bytes.Equal(got.Binding, attestor.Binding(spki)) {
		t.Error("binding is not over the CSR key")
	}
	if !got.Request.CSR.PublicKey.(*ecdsa.PublicKey).Equal(key.Public()) {
		t.Error("parsed key is not the request's key")
	}
}

// corruptSignature flips a bit in the last byte of the PKCS#10 block (the
// signature) and re-encodes spec.request.
func corruptSignature(t *testing.T, request []byte) []byte {
	t.Helper()
	ar, err := attestor.ParseRequest(request)
	if err != nil {
		t.Fatal(err)
	}
	der := bytes.Clone(ar.CSRDER)
	der[len(der)-1] ^= 1
	out, err := attestor.EncodeRequest(der, ar.Provider, ar.Evidence)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

var clientRules = Rules{Kind: Client, Attested: true, Provider: "insecure"}
