package podcert

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"reflect"
	"testing"
	"time"

	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert/podattest"
)

var enabled = &v1alpha1.PodCertificatePolicy{
	TrustDomain: "prod.example",
	Allowed: []v1alpha1.PodCertificateServiceAccounts{
		{Namespace: "payments", ServiceAccounts: []string{"api"}},
		{Namespace: "web", ServiceAccounts: []string{"*"}},
	},
}

func policy(t *testing.T, spec *v1alpha1.PodCertificatePolicy) *Policy {
	t.Helper()
	p, errs := NewPolicy(spec, field.NewPath("spec", "podCertificates"))
	if len(errs) > 0 {
		t.Fatal(errs.ToAggregate())
	}
	return p
}

func request(t *testing.T, ns, sa string, pub any) *certificatesv1beta1.PodCertificateRequest {
	t.Helper()
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return &certificatesv1beta1.PodCertificateRequest{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "r"},
		Spec: certificatesv1beta1.PodCertificateRequestSpec{
			SignerName: DefaultSignerName, PodName: "p", ServiceAccountName: sa,
			NodeName: "node-a", PKIXPublicKey: der,
			// Names here must never reach the certificate.
			UnverifiedUserAnnotations: map[string]string{"example.com/dns-names": "evil.example", "spiffe": "spiffe://prod.example/ns/kube-system/sa/admin"},
		},
	}
}

func p256(t *testing.T) *ecdsa.PrivateKey {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func denial(t *testing.T, err error, reason string) {
	t.Helper()
	var d *attestor.DenyError
	if !errors.As(err, &d) || d.Reason != reason {
		t.Fatalf("got %v, want a denial with reason %s", err, reason)
	}
}

func TestNewPolicy(t *testing.T) {
	path := field.NewPath("spec", "podCertificates")
	if p, errs := NewPolicy(nil, path); p != nil || errs != nil {
		t.Fatalf("not enabled: got %v, %v", p, errs)
	}
	secs := func(s int32) *int32 { return &s }
	sa := func(ns string, names ...string) []v1alpha1.PodCertificateServiceAccounts {
		return []v1alpha1.PodCertificateServiceAccounts{{Namespace: ns, ServiceAccounts: names}}
	}
	for name, c := range map[string]struct {
		spec  v1alpha1.PodCertificatePolicy
		field string
	}{
		"no trust domain":    {v1alpha1.PodCertificatePolicy{Allowed: sa("a", "b")}, "spec.podCertificates.trustDomain"},
		"bad trust domain":   {v1alpha1.PodCertificatePolicy{TrustDomain: "Prod/x", Allowed: sa("a", "b")}, "spec.podCertificates.trustDomain"},
		"bad namespace":      {v1alpha1.PodCertificatePolicy{TrustDomain: "a", Allowed: sa("Pay/ments", "b")}, "spec.podCertificates.allowed[0].namespace"},
		"bad account":        {v1alpha1.PodCertificatePolicy{TrustDomain: "a", Allowed: sa("a", "b", "x/y")}, "spec.podCertificates.allowed[0].serviceAccounts[1]"},
		"lifetime too long":  {v1alpha1.PodCertificatePolicy{TrustDomain: "a", Allowed: sa("a", "b"), MaxLifetimeSeconds: secs(v1alpha1.MaxPodCertificateLifetimeSeconds + 1)}, "spec.podCertificates.maxLifetimeSeconds"},
		"lifetime too short": {v1alpha1.PodCertificatePolicy{TrustDomain: "a", Allowed: sa("a", "b"), MaxLifetimeSeconds: secs(1800)}, "spec.podCertificates.maxLifetimeSeconds"},
	} {
		p, errs := NewPolicy(&c.spec, path)
		if p != nil || len(errs) != 1 || errs[0].Field != c.field {
			t.Errorf("%s: got %v, %v; want one error at %s", name, p, errs, c.field)
		}
	}
	p := policy(t, &v1alpha1.PodCertificatePolicy{TrustDomain: "a", Allowed: sa("a", "b"), MaxLifetimeSeconds: secs(7200)})
	if p.MaxLifetime != 2*time.Hour || !p.allows("a", "b") || p.allows("a", "c") {
		t.Errorf("got %+v", p)
	}
}

func TestCheckDenies(t *testing.T) {
	p := policy(t, enabled)
	k := p256(t)
	if _, err := Check(request(t, "payments", "api", k.Public()), DefaultSignerName, nil); err == nil {
		t.Fatal("disabled cluster: accepted")
	} else {
		denial(t, err, ReasonPodCertsDisabled)
	}
	_, err := Check(request(t, "payments", "batch", k.Public()), DefaultSignerName, p)
	denial(t, err, ReasonNotAllowed)
	_, err = Check(request(t, "kube-system", "admin", k.Public()), DefaultSignerName, p)
	denial(t, err, ReasonNotAllowed)
	_, err = Check(request(t, "payments", "api", k.Public()), "example.com/other", p)
	denial(t, err, ReasonWrongSigner)
	rk, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	_, err = Check(request(t, "payments", "api", rk.Public()), DefaultSignerName, p)
	denial(t, err, ReasonUnsupportedKey)
	r := request(t, "payments", "api", k.Public())
	r.Spec.PKIXPublicKey = []byte("junk")
	_, err = Check(r, DefaultSignerName, p)
	denial(t, err, ReasonMalformedRequest)

	// The stub PKCS#10 request kubelet sends since 1.36.
	stub := func(t *testing.T, key crypto.Signer, tmpl *x509.CertificateRequest) []byte {
		t.Helper()
		der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
		if err != nil {
			t.Fatal(err)
		}
		return der
	}
	for name, tc := range map[string]struct {
		mutate func(*certificatesv1beta1.PodCertificateRequestSpec)
		reason string
	}{
		"both set": {func(s *certificatesv1beta1.PodCertificateRequestSpec) {
			s.StubPKCS10Request = stub(t, k, &x509.CertificateRequest{})
		}, ReasonMalformedRequest},
		"neither set": {func(s *certificatesv1beta1.PodCertificateRequestSpec) { s.PKIXPublicKey = nil }, ReasonMalformedRequest},
		"junk stub": {func(s *certificatesv1beta1.PodCertificateRequestSpec) {
			s.PKIXPublicKey, s.StubPKCS10Request = nil, []byte("junk")
		}, ReasonMalformedRequest},
		"oversize stub": {func(s *certificatesv1beta1.PodCertificateRequestSpec) {
			s.PKIXPublicKey, s.StubPKCS10Request = nil, make([]byte, MaxStubRequestSize+1)
		}, ReasonMalformedRequest},
		"stub signed by another key": {func(s *certificatesv1beta1.PodCertificateRequestSpec) {
			good := stub(t, k, &x509.CertificateRequest{})
			s.PKIXPublicKey, s.StubPKCS10Request = nil, good
			// Flip a bit of the signature (the last bytes of the DER).
			s.StubPKCS10Request[len(good)-1] ^= 1
		}, ReasonMalformedRequest},
		"stub with an RSA 2048 key": {func(s *certificatesv1beta1.PodCertificateRequestSpec) {
			s.PKIXPublicKey, s.StubPKCS10Request = nil, stub(t, rk, &x509.CertificateRequest{})
		}, ReasonUnsupportedKey},
	} {
		t.Run(name, func(t *testing.T) {
			r := request(t, "payments", "api", k.Public())
			tc.mutate(&r.Spec)
			_, err := Check(r, DefaultSignerName, p)
			denial(t, err, tc.reason)
		})
	}
	// A stub's names never reach the certificate: only its key is read.
	r = request(t, "payments", "api", k.Public())
	r.Spec.PKIXPublicKey, r.Spec.StubPKCS10Request = nil, stub(t, k, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: "admin"}, DNSNames: []string{"evil.example"}})
	c, err := Check(r, DefaultSignerName, p)
	if err != nil {
		t.Fatal(err)
	}
	if !k.PublicKey.Equal(c.PublicKey) || c.SPIFFEID.String() != "spiffe://prod.example/ns/payments/sa/api" {
		t.Errorf("stub request: key %v, SPIFFE ID %s", c.PublicKey, c.SPIFFEID)
	}
}

func testCA(t *testing.T, now time.Time, validity time.Duration) *issue.CA {
	t.Helper()
	c, k, err := issue.NewCA("pod CA", now, validity)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := issue.LoadCA(c, k)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

func TestSign(t *testing.T) {
	now := time.Now()
	ca := testCA(t, now.Add(-time.Hour), 365*24*time.Hour)
	p := policy(t, enabled)
	k := p256(t)
	r := request(t, "web", "frontend", k.Public())
	secs := int32(6 * 3600)
	r.Spec.MaxExpirationSeconds = &secs
	c, err := Check(r, DefaultSignerName, p)
	if err != nil {
		t.Fatal(err)
	}
	// The node's own certificate ends in 4h: the pod's may not outlive it.
	nodeEnd := now.Add(4 * time.Hour).Truncate(time.Second)
	att := &podattest.Attestation{Attestor: "tpm", ProviderID: "aws:///zone/i-1", MachineNamespace: "team", MachineName: "m-1",
		NodeName: "node-1", AttestedAt: now.Add(-time.Hour).UTC().Truncate(time.Second), BootPolicySHA256: make([]byte, 32)}
	got, err := Sign(ca, c, att, nodeEnd, now, Timing{})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := pem.Decode([]byte(got.CertificateChain))
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	if len(cert.URIs) != 1 || cert.URIs[0].String() != "spiffe://prod.example/ns/web/sa/frontend" {
		t.Errorf("URIs %v", cert.URIs)
	}
	if len(cert.DNSNames)+len(cert.IPAddresses)+len(cert.EmailAddresses) != 0 || cert.Subject.CommonName != "" {
		t.Errorf("names beyond the SPIFFE ID: %v %v %v %q", cert.DNSNames, cert.IPAddresses, cert.EmailAddresses, cert.Subject.CommonName)
	}
	if cert.IsCA || !cert.BasicConstraintsValid {
		t.Error("certificate is a CA or lacks basic constraints")
	}
	// What was attested about the node, in a non-critical extension.
	if a, err := podattest.FromCertificate(cert); err != nil || !reflect.DeepEqual(a, att) {
		t.Errorf("attestation extension %+v, %v; want %+v", a, err, att)
	}
	for _, e := range cert.Extensions {
		if e.Id.Equal(attestor.OIDPodAttestation) && e.Critical {
			t.Error("attestation extension is critical")
		}
	}
	if len(cert.ExtKeyUsage) != 2 {
		t.Errorf("ext key usages %v", cert.ExtKeyUsage)
	}
	if !cert.NotAfter.Equal(nodeEnd) || !got.NotAfter.Equal(nodeEnd) {
		t.Errorf("NotAfter %s, want the node certificate's %s", cert.NotAfter, nodeEnd)
	}
	if !got.BeginRefreshAt.After(got.NotBefore) || !got.BeginRefreshAt.Before(got.NotAfter) {
		t.Errorf("beginRefreshAt %s outside %s..%s", got.BeginRefreshAt, got.NotBefore, got.NotAfter)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		t.Errorf("does not verify against the pod CA: %v", err)
	}

	// Lifetime from maxExpirationSeconds when the node certificate lasts.
	got, err = Sign(ca, c, att, now.Add(30*24*time.Hour), now, Timing{})
	if err != nil {
		t.Fatal(err)
	}
	if d := got.NotAfter.Sub(got.NotBefore); d != 6*time.Hour {
		t.Errorf("lifetime %s, want maxExpirationSeconds 6h", d)
	}
	// The signer's timing: backdated a minute, refreshed half-way.
	if !got.NotBefore.Equal(now.Add(-Backdate)) || !got.BeginRefreshAt.Equal(got.NotBefore.Add(3*time.Hour)) {
		t.Errorf("notBefore %s, beginRefreshAt %s; want now-%s and half-way", got.NotBefore, got.BeginRefreshAt, Backdate)
	}

	// Another timing moves notBefore and beginRefreshAt, within what
	// kube-apiserver accepts, and nothing else.
	got, err = Sign(ca, c, att, now.Add(30*24*time.Hour), now, Timing{Backdate: 4 * time.Minute, RefreshAfter: RefreshMargin})
	if err != nil {
		t.Fatal(err)
	}
	if !got.NotBefore.Equal(now.Add(-4*time.Minute)) || !got.BeginRefreshAt.Equal(got.NotBefore.Add(RefreshMargin)) ||
		got.NotAfter.Sub(got.NotBefore) != 6*time.Hour {
		t.Errorf("notBefore %s, beginRefreshAt %s, notAfter %s; want now-4m, notBefore+10m, notBefore+6h", got.NotBefore, got.BeginRefreshAt, got.NotAfter)
	}
	for _, bad := range []Timing{{Backdate: MaxBackdate}, {Backdate: -time.Second}, {RefreshAfter: RefreshMargin - time.Second},
		{RefreshAfter: MinLifetime - RefreshMargin + time.Second}} {
		if _, err := Sign(ca, c, att, now.Add(30*24*time.Hour), now, bad); err == nil {
			t.Errorf("timing %+v: signed; kube-apiserver refuses such certificates", bad)
		}
	}

	// A node certificate about to end: retry (not a denial).
	if _, err := Sign(ca, c, att, now.Add(10*time.Minute), now, Timing{}); !errors.Is(err, ErrNodeCertExpiring) {
		t.Errorf("node certificate ending: got %v", err)
	} else if _, ok := attestor.AsDenial(err); ok {
		t.Error("node certificate ending is a denial")
	}
}
