package serving

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"net"
	"net/url"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

var (
	ds, sa, ke, ca = certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth, certificatesv1.UsageKeyEncipherment, certificatesv1.UsageClientAuth
)

func request(t *testing.T, key any, cn string, mutate func(*x509.CertificateRequest)) *x509.CertificateRequest {
	t.Helper()
	tmpl := &x509.CertificateRequest{
		Subject:     pkix.Name{CommonName: cn, Organization: []string{"system:nodes"}},
		DNSNames:    []string{"worker-0"},
		IPAddresses: []net.IP{net.ParseIP("10.0.0.5")},
	}
	if mutate != nil {
		mutate(tmpl)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		t.Fatal(err)
	}
	x, err := x509.ParseCertificateRequest(der)
	if err != nil {
		t.Fatal(err)
	}
	return x
}

func TestCheckRequest(t *testing.T) {
	ec, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	rsaKey, _ := rsa.GenerateKey(rand.Reader, 2048)
	node := "system:node:worker-0"
	nodeGroups := []string{"system:nodes", "system:authenticated"}
	cases := []struct {
		name           string
		user           string
		groups         []string
		key            any
		cn             string
		usages         []certificatesv1.KeyUsage
		mutate         func(*x509.CertificateRequest)
		allowBootstrap bool
		want           []string
	}{
		{name: "good ECDSA", user: node, groups: nodeGroups, key: ec, cn: node, usages: []certificatesv1.KeyUsage{ds, sa}},
		{name: "good RSA", user: node, groups: nodeGroups, key: rsaKey, cn: node, usages: []certificatesv1.KeyUsage{ke, ds, sa}},
		{name: "key encipherment for ECDSA", user: node, groups: nodeGroups, key: ec, cn: node, usages: []certificatesv1.KeyUsage{ke, ds, sa}, want: []string{checks.ReasonUsagesNotAllowed}},
		{name: "client auth", user: node, groups: nodeGroups, key: ec, cn: node, usages: []certificatesv1.KeyUsage{ds, sa, ca}, want: []string{checks.ReasonUsagesNotAllowed}},
		{name: "duplicate usage", user: node, groups: nodeGroups, key: ec, cn: node, usages: []certificatesv1.KeyUsage{ds, sa, sa}, want: []string{checks.ReasonUsagesNotAllowed}},
		{name: "other node", user: "system:node:worker-1", groups: nodeGroups, key: ec, cn: node, usages: []certificatesv1.KeyUsage{ds, sa}, want: []string{checks.ReasonRequesterMismatch}},
		{name: "not in system:nodes", user: node, key: ec, cn: node, usages: []certificatesv1.KeyUsage{ds, sa}, want: []string{checks.ReasonRequesterNotAllowed}},
		{name: "bootstrap token", user: "system:bootstrap:abcdef", groups: []string{"system:bootstrappers"}, key: ec, cn: node, usages: []certificatesv1.KeyUsage{ds, sa}, want: []string{checks.ReasonRequesterNotAllowed}},
		{name: "bootstrap token, attested", user: "system:bootstrap:abcdef", groups: []string{"system:bootstrappers"}, key: ec, cn: node, usages: []certificatesv1.KeyUsage{ds, sa}, allowBootstrap: true},
		{name: "P-384", user: node, groups: nodeGroups, key: p384, cn: node, usages: []certificatesv1.KeyUsage{ds, sa}, want: []string{checks.ReasonKeyNotAllowed}},
		{name: "bad CN, URI and no-SAN", user: node, groups: nodeGroups, key: ec, cn: "worker-0", usages: []certificatesv1.KeyUsage{ds, sa},
			mutate: func(r *x509.CertificateRequest) {
				r.DNSNames, r.IPAddresses = nil, nil
				r.URIs = []*url.URL{{Scheme: "spiffe", Host: "x"}}
			},
			want: []string{checks.ReasonSubjectMismatch, ReasonSANTypeNotAllowed, ReasonNoSANs}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			csr := &certificatesv1.CertificateSigningRequest{Spec: certificatesv1.CertificateSigningRequestSpec{Username: c.user, Groups: c.groups, Usages: c.usages}}
			_, fails := checkRequest(csr, request(t, c.key, c.cn, c.mutate), c.allowBootstrap)
			var got []string
			for _, f := range fails {
				for _, x := range checks.Failures(f) {
					got = append(got, x.Reason)
				}
			}
			if len(got) != len(c.want) {
				t.Fatalf("reasons = %v, want %v (%v)", got, c.want, fails)
			}
			for i := range got {
				if got[i] != c.want[i] {
					t.Fatalf("reasons = %v, want %v", got, c.want)
				}
			}
		})
	}
}

func TestCheckSANsAndSign(t *testing.T) {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	m := &Machine{Namespace: "ns", Name: "worker-0", DNSNames: []string{"Worker-0"}, IPs: []net.IP{net.ParseIP("10.0.0.5")}}
	x := request(t, key, "system:node:worker-0", nil)
	if err := checkSANs(x, m); err != nil {
		t.Fatalf("own addresses refused: %v", err)
	}
	foreign := request(t, key, "system:node:worker-0", func(r *x509.CertificateRequest) { r.IPAddresses = append(r.IPAddresses, net.ParseIP("10.0.0.6")) })
	if reason, _, _ := checks.Denial(checkSANs(foreign, m)); reason != ReasonSANNotMachineAddress {
		t.Fatalf("foreign IP: reason %q", reason)
	}

	now := time.Now()
	certPEM, keyPEM, err := NewCA("serving", now, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	c, err := issue.LoadCA(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := c.Key.Public().(*ecdsa.PublicKey); !ok {
		t.Fatalf("serving CA key is %T, want ECDSA", c.Key.Public())
	}
	out, err := signServing(c, x, "test:///0", []certificatesv1.KeyUsage{ds, sa}, 0, 24*time.Hour, now)
	if err != nil {
		t.Fatal(err)
	}
	leaf := parse(t, out)
	if leaf.NotAfter.After(c.Cert.NotAfter) || len(leaf.ExtKeyUsage) != 1 || leaf.ExtKeyUsage[0] != x509.ExtKeyUsageServerAuth || leaf.IsCA {
		t.Errorf("leaf = notAfter %s (CA %s), EKU %v, CA %t", leaf.NotAfter, c.Cert.NotAfter, leaf.ExtKeyUsage, leaf.IsCA)
	}
	if pid, err := attestor.ProviderIDFromExtensions(leaf.Extensions); err != nil || pid != "test:///0" {
		t.Errorf("provider ID = %q, %v", pid, err)
	}
	if _, err := signServing(c, x, "test:///0", []certificatesv1.KeyUsage{ds, sa, ca}, 0, time.Hour, now); err == nil {
		t.Error("client auth signed by the serving signer")
	}
}

func parse(t *testing.T, certPEM []byte) *x509.Certificate {
	t.Helper()
	b, _ := pem.Decode(certPEM)
	if b == nil {
		t.Fatal("no certificate")
	}
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}
