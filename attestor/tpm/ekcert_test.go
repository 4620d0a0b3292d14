package tpm

import (
	"crypto/x509"
	"encoding/asn1"
	"errors"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	realdatapkg "sigs.k8s.io/kubelet-authenticator/test/realdata"
)

// reasonsOf lists the reasons of every denial in err.
func reasonsOf(err error) []string {
	var out []string
	for _, d := range attestor.Denials(err) {
		out = append(out, d.Reason)
	}
	return out
}

// TestEKCertificateProfile: a certificate that chains to the manufacturer
// pool is an EK certificate only if it carries what the TCG EK credential
// profile requires and its CAs may issue it; each missing field is denied
// with a reason naming it, and every one missing is reported.
func TestEKCertificateProfile(t *testing.T) {
	soft := newSoftTPM(t)
	ek := &soft.ekKey.PublicKey
	sanNoManufacturer, err := asn1.Marshal([]asn1.RawValue{{Class: asn1.ClassContextSpecific, Tag: 4, IsCompound: true,
		Bytes: mustMarshal(t, []any{[]any{struct {
			Type  asn1.ObjectIdentifier
			Value string
		}{oidTPMModel, "Soft"}}})}})
	if err != nil {
		t.Fatal(err)
	}
	tcgKP := []asn1.ObjectIdentifier{oidEKCertificateKP}
	cases := []struct {
		name  string
		leaf  func(*x509.Certificate)
		inter func(*x509.Certificate)
		want  []string
	}{
		{name: "complete"},
		{name: "no extended key usage", want: []string{ReasonEKCertificateExtKeyUsage},
			leaf: func(c *x509.Certificate) { c.UnknownExtKeyUsage = nil }},
		{name: "extended key usage without tcg-kp-EKCertificate", want: []string{ReasonEKCertificateExtKeyUsage},
			leaf: func(c *x509.Certificate) {
				c.UnknownExtKeyUsage = nil
				c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
			}},
		{name: "any extended key usage instead of tcg-kp-EKCertificate", want: []string{ReasonEKCertificateExtKeyUsage},
			leaf: func(c *x509.Certificate) {
				c.UnknownExtKeyUsage = nil
				c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageAny}
			}},
		{name: "no key usage", want: []string{ReasonEKCertificateKeyUsage},
			leaf: func(c *x509.Certificate) { c.KeyUsage = 0 }},
		{name: "key usage of a signing key", want: []string{ReasonEKCertificateKeyUsage},
			leaf: func(c *x509.Certificate) { c.KeyUsage = x509.KeyUsageDigitalSignature }},
		{name: "no subject alternative name", want: []string{ReasonEKCertificateSubjectAltName},
			leaf: func(c *x509.Certificate) { c.ExtraExtensions = nil }},
		{name: "subject alternative name without the TPM manufacturer", want: []string{ReasonEKCertificateSubjectAltName},
			leaf: func(c *x509.Certificate) {
				c.ExtraExtensions[0].Value, c.ExtraExtensions[0].Critical = sanNoManufacturer, false
			}},
		{name: "critical subject alternative name that is not a TCG one", want: []string{ReasonEKCertificateSubjectAltName, ReasonUntrustedEKCertificate},
			leaf: func(c *x509.Certificate) { c.ExtraExtensions[0].Value = sanNoManufacturer }},
		{name: "a DNS name instead of the TPM", want: []string{ReasonEKCertificateSubjectAltName},
			leaf: func(c *x509.Certificate) {
				c.ExtraExtensions = nil
				c.DNSNames = []string{"node-a.example"}
			}},
		{name: "no basic constraints", want: []string{ReasonEKCertificateBasicConstraints},
			leaf: func(c *x509.Certificate) { c.BasicConstraintsValid = false }},
		{name: "a CA certificate", want: []string{ReasonEKCertificateBasicConstraints},
			leaf: func(c *x509.Certificate) { c.IsCA = true }},
		{name: "a bare leaf of a bundled CA", want: []string{ReasonEKCertificateExtKeyUsage, ReasonEKCertificateKeyUsage, ReasonEKCertificateSubjectAltName, ReasonEKCertificateBasicConstraints},
			leaf: func(c *x509.Certificate) {
				c.UnknownExtKeyUsage, c.KeyUsage, c.ExtraExtensions, c.BasicConstraintsValid = nil, 0, nil, false
			}},
		{name: "intermediate without key usage", want: []string{ReasonEKCertificateChainUsage},
			inter: func(c *x509.Certificate) { c.KeyUsage = 0 }},
		{name: "intermediate for TLS servers only", want: []string{ReasonEKCertificateChainUsage},
			inter: func(c *x509.Certificate) { c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth} }},
		{name: "intermediate for EK certificates", inter: func(c *x509.Certificate) { c.UnknownExtKeyUsage = tcgKP }},
		{name: "intermediate for anything", inter: func(c *x509.Certificate) { c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageAny} }},
		{name: "intermediate not a CA", want: []string{ReasonUntrustedEKCertificate},
			inter: func(c *x509.Certificate) { c.IsCA, c.MaxPathLenZero = false, false }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ca := soft.ca
			if c.inter != nil {
				var err error
				if ca, err = tpmtest.NewManufacturerCAWith("Edited", testNow.AddDate(-1, 0, 0), c.inter); err != nil {
					t.Fatal(err)
				}
			}
			der, err := ca.IssueEKCertificateWith(ek, c.leaf)
			if err != nil {
				t.Fatal(err)
			}
			cert, err := parseEKCertificate(der)
			if err != nil {
				t.Fatal(err)
			}
			roots, inters := ca.Pools()
			v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
			err = v.verifyEKCertificate(cert)
			if got := reasonsOf(err); !slices.Equal(got, c.want) {
				t.Fatalf("reasons %v, want %v (%v)", got, c.want, err)
			}
			if err != nil && len(attestor.Denials(err)) != len(strings.Split(err.Error(), "\n")) {
				t.Fatalf("%v is not only denials", err)
			}
			if len(c.want) == 0 {
				return
			}
			// The CSR is denied with the first reason, and the message
			// says everything.
			key := newKey(t)
			a := soft.quote(t, key)
			a.EKCertificate = der
			csrDER, _ := csrFor(t, key, testNode, testProviderID)
			e := newEngine(v, nil)
			_, err = e.verify(t, e.file(t, "csr-1", csrDER, evidenceOf(t, VersionV2, a, nil), nil))
			wantReason(t, err, c.want[0])
			if r, msg := attestor.Summary(attestor.Denials(err)); r != c.want[0] || (len(c.want) > 1 && !strings.Contains(msg, c.want[len(c.want)-1])) {
				t.Fatalf("summary %s: %s; want every reason of %v", r, msg, c.want)
			}
		})
	}
}

func mustMarshal(t *testing.T, v any) []byte {
	t.Helper()
	b, err := asn1.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRealEKProfile: what the profile requires is what real EK
// certificates carry. Every accepted real EK certificate carries every
// field, except those of Google Cloud's EK/AK CA, which omit exactly the
// extended key usage and the subject alternative name; the exception
// excuses them and nothing else.
func TestRealEKProfile(t *testing.T) {
	v := realVerifier(t, realBundle)
	google := map[string]bool{"gce-pca_tpm_rsa_enc_cert.pem": true, "gce-pca_tpm_ecc_enc_cert.pem": true}
	for _, f := range []string{
		"stm-st33htph-rsa-ek.pem", "stm-st33htph-ecc-ek.pem", "nuvoton-npct75x-rsa-ek.der",
		"infineon-slb9670-tpm20-rsa-ek.pem", "intel-ptt-spt-h-rsa-ek.pem", "amd-ftpm-ryzen5-5600x-prg-rn-ek.pem",
		"gce-uca_tpm_rsa_enc_cert.pem", "gce-uca_tpm_ecc_enc_cert.pem",
		"gce-pca_tpm_rsa_enc_cert.pem", "gce-pca_tpm_ecc_enc_cert.pem",
		"gce-shielded-vm-rsa-ek-salrashid123-attribute_certificate.pem",
	} {
		t.Run(f, func(t *testing.T) {
			cert, err := parseEKCertificate(readRealCert(t, realdatapkg.Path(t, "tpm-ek", f)))
			if err != nil {
				t.Fatal(err)
			}
			var want []string
			if google[f] {
				want = []string{ReasonEKCertificateExtKeyUsage, ReasonEKCertificateSubjectAltName}
			}
			if got := reasonsOf(errors.Join(checkEKProfile(cert, checkTCGSubjectAltName(cert), nil)...)); !slices.Equal(got, want) {
				t.Fatalf("without exceptions: %v, want %v", got, want)
			}
			if err := v.verifyEKCertificate(cert); err != nil {
				t.Fatalf("rejected: %v", err)
			}
		})
	}
	// The same CA signs the vTPM's signing-key certificates: the
	// exception does not make them EK certificates.
	for _, f := range []string{"gce-pca_tpm_rsa_sign_cert.pem", "gce-pca_tpm_ecc_sign_cert.pem"} {
		t.Run(f, func(t *testing.T) {
			cert, err := parseEKCertificate(readRealCert(t, realdatapkg.Path(t, "tpm-ek", f)))
			if err != nil {
				t.Fatal(err)
			}
			if got := reasonsOf(v.verifyEKCertificate(cert)); !slices.Equal(got, []string{ReasonEKCertificateKeyUsage}) {
				t.Fatalf("reasons %v, want only %s", got, ReasonEKCertificateKeyUsage)
			}
		})
	}
}

// TestGeneratedEKCertificatesFollowTheProfile: the test manufacturer CAs
// (tpmtest, and swtpm's as test/tools/swtpm-provision.sh sets it up) issue
// EK certificates that carry every field, so the round trips exercise the
// profile rather than an exception.
func TestGeneratedEKCertificatesFollowTheProfile(t *testing.T) {
	soft := newSoftTPM(t)
	cert, err := parseEKCertificate(soft.ekCert)
	if err != nil {
		t.Fatal(err)
	}
	if errs := checkEKProfile(cert, checkTCGSubjectAltName(cert), nil); len(errs) != 0 {
		t.Fatalf("tpmtest EK certificate: %v", errs)
	}
	if _, err := chainWithCAUsages([][]*x509.Certificate{{cert, soft.ca.Intermediate, soft.ca.Root}}); err != nil {
		t.Fatalf("tpmtest CAs: %v", err)
	}
}
