package issue

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"errors"
	"math/big"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

var t0 = time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)

type testCA struct {
	certPEM, keyPEM []byte
	cert            *x509.Certificate
}

func newCA(t *testing.T, key crypto.Signer, notBefore, notAfter time.Time, isCA bool) testCA {
	t.Helper()
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kubernetes"},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  isCA,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	var keyBlock *pem.Block
	switch k := key.(type) {
	case *rsa.PrivateKey:
		keyBlock = &pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(k)}
	case *ecdsa.PrivateKey:
		b, _ := x509.MarshalECPrivateKey(k)
		keyBlock = &pem.Block{Type: "EC PRIVATE KEY", Bytes: b}
	}
	return testCA{
		certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		keyPEM:  pem.EncodeToMemory(keyBlock),
		cert:    cert,
	}
}

func ecKey(t *testing.T) *ecdsa.PrivateKey {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestLoadCA(t *testing.T) {
	k := ecKey(t)
	good := newCA(t, k, t0.Add(-time.Hour), t0.Add(365*24*time.Hour), true)
	pkcs8, _ := x509.MarshalPKCS8PrivateKey(k)
	rsaK, _ := rsa.GenerateKey(rand.Reader, 2048)
	rsaCA := newCA(t, rsaK, t0.Add(-time.Hour), t0.Add(time.Hour), true)
	notCA := newCA(t, k, t0.Add(-time.Hour), t0.Add(time.Hour), false)
	other := newCA(t, ecKey(t), t0.Add(-time.Hour), t0.Add(time.Hour), true)

	tests := []struct {
		name            string
		certPEM, keyPEM []byte
		wantErr         bool
	}{
		{"SEC 1 key", good.certPEM, good.keyPEM, false},
		{"PKCS#8 key", good.certPEM, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: pkcs8}), false},
		{"PKCS#1 RSA key", rsaCA.certPEM, rsaCA.keyPEM, false},
		{"bundle: first certificate is the CA", append(append([]byte(nil), good.certPEM...), other.certPEM...), good.keyPEM, false},
		{"not a CA", notCA.certPEM, notCA.keyPEM, true},
		{"key of another CA", good.certPEM, other.keyPEM, true},
		{"no certificate", nil, good.keyPEM, true},
		{"no key", good.certPEM, []byte("junk"), true},
		{"garbled key", good.certPEM, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: []byte{1, 2}}), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ca, err := LoadCA(tt.certPEM, tt.keyPEM)
			if (err != nil) != tt.wantErr {
				t.Fatalf("LoadCA() error = %v, wantErr %v", err, tt.wantErr)
			}
			if err == nil && ca.Cert.Subject.CommonName != "kubernetes" {
				t.Errorf("loaded %v", ca.Cert.Subject)
			}
		})
	}
}

func csrFor(t *testing.T, providerID string) *x509.CertificateRequest {
	t.Helper()
	ext, err := attestor.ProviderIDExtension(providerID)
	if err != nil {
		t.Fatal(err)
	}
	bc, _ := asn1.Marshal(struct{ IsCA bool }{true})
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:  pkix.Name{CommonName: "system:node:worker-0", Organization: []string{attestor.NodesGroup}},
		DNSNames: []string{"evil.example"},
		ExtraExtensions: []pkix.Extension{ext,
			{Id: asn1.ObjectIdentifier{2, 5, 29, 19}, Critical: true, Value: bc},
			{Id: asn1.ObjectIdentifier{1, 2, 3, 4}, Value: []byte{5, 0}},
		},
	}, ecKey(t))
	if err != nil {
		t.Fatal(err)
	}
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		t.Fatal(err)
	}
	return csr
}

func TestSign(t *testing.T) {
	caKey := ecKey(t)
	tc := newCA(t, caKey, t0.Add(-24*time.Hour), t0.Add(30*24*time.Hour), true)
	ca, err := LoadCA(tc.certPEM, tc.keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	const pid = "aws:///us-east-1a/i-0abc"
	s := &Signer{CA: ca, MaxLifetime: 7 * 24 * time.Hour, Clock: clocktesting.NewFakePassiveClock(t0)}
	csr := csrFor(t, pid)

	certPEM, err := s.Sign(&Request{CSR: csr, ProviderID: pid, Usages: []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}})
	if err != nil {
		t.Fatal(err)
	}
	b, rest := pem.Decode(certPEM)
	if b == nil || len(rest) != 0 || b.Type != "CERTIFICATE" {
		t.Fatalf("Sign() returned %q", certPEM)
	}
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, CurrentTime: t0, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("issued certificate does not chain to the CA: %v", err)
	}
	if cert.Subject.CommonName != "system:node:worker-0" || len(cert.Subject.Organization) != 1 || cert.Subject.Organization[0] != attestor.NodesGroup {
		t.Errorf("subject = %v", cert.Subject)
	}
	if cert.IsCA || !cert.BasicConstraintsValid {
		t.Error("issued a CA certificate")
	}
	if len(cert.DNSNames) != 0 {
		t.Errorf("copied SANs %v", cert.DNSNames)
	}
	if cert.KeyUsage != x509.KeyUsageDigitalSignature || len(cert.ExtKeyUsage) != 1 || cert.ExtKeyUsage[0] != x509.ExtKeyUsageClientAuth {
		t.Errorf("usages = %v %v", cert.KeyUsage, cert.ExtKeyUsage)
	}
	got, err := attestor.ProviderIDFromExtensions(cert.Extensions)
	if err != nil || got != pid {
		t.Errorf("provider ID = %q, %v", got, err)
	}
	for _, e := range cert.Extensions {
		if e.Id.Equal(asn1.ObjectIdentifier{1, 2, 3, 4}) {
			t.Error("copied an unknown requested extension")
		}
	}
	if !cert.PublicKey.(*ecdsa.PublicKey).Equal(csr.PublicKey) {
		t.Error("certificate is not for the request's key")
	}
	if !cert.NotBefore.Equal(t0.Add(-DefaultBackdate)) || !cert.NotAfter.Equal(t0.Add(7*24*time.Hour)) {
		t.Errorf("validity = %s .. %s", cert.NotBefore, cert.NotAfter)
	}
}

func TestSignLifetime(t *testing.T) {
	caKey := ecKey(t)
	tc := newCA(t, caKey, t0.Add(-24*time.Hour), t0.Add(48*time.Hour), true)
	ca, err := LoadCA(tc.certPEM, tc.keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	const pid = "gce://p/z/n"
	csr := csrFor(t, pid)
	usages := []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}
	tests := []struct {
		name      string
		now       time.Time
		max       time.Duration
		requested time.Duration
		want      time.Time
		wantErr   error
	}{
		{"unset request gets the maximum", t0, 24 * time.Hour, 0, t0.Add(24 * time.Hour), nil},
		{"shorter request wins", t0, 24 * time.Hour, time.Hour, t0.Add(time.Hour), nil},
		{"longer request is capped", t0, 24 * time.Hour, 365 * 24 * time.Hour, t0.Add(24 * time.Hour), nil},
		{"never past the CA", t0, 7 * 24 * time.Hour, 0, t0.Add(48 * time.Hour), nil},
		{"expired CA", t0.Add(49 * time.Hour), time.Hour, 0, time.Time{}, ErrCAExpired},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := &Signer{CA: ca, MaxLifetime: tt.max, Clock: clocktesting.NewFakePassiveClock(tt.now)}
			certPEM, err := s.Sign(&Request{CSR: csr, ProviderID: pid, Usages: usages, Duration: tt.requested})
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("Sign() error = %v, want %v", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			b, _ := pem.Decode(certPEM)
			cert, _ := x509.ParseCertificate(b.Bytes)
			if !cert.NotAfter.Equal(tt.want) {
				t.Errorf("NotAfter = %s, want %s", cert.NotAfter, tt.want)
			}
		})
	}
}

func TestSignRefusesOtherUsages(t *testing.T) {
	k := ecKey(t)
	tc := newCA(t, k, t0.Add(-time.Hour), t0.Add(time.Hour), true)
	ca, _ := LoadCA(tc.certPEM, tc.keyPEM)
	s := &Signer{CA: ca, MaxLifetime: time.Hour, Clock: clocktesting.NewFakePassiveClock(t0)}
	for _, u := range [][]certificatesv1.KeyUsage{
		{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth, certificatesv1.UsageCertSign},
		{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth},
		{certificatesv1.UsageClientAuth},
	} {
		if _, err := s.Sign(&Request{CSR: csrFor(t, "x"), ProviderID: "x", Usages: u}); err == nil {
			t.Errorf("Sign(%v) succeeded", u)
		}
	}
}
