// Package attestortest holds what every attestor's tests share: the
// conformance suite every provider passes (Conformance, see Provider for
// how to hook a provider in), a binding to a fresh CSR key, and the check
// that a verifier denied with a given reason.
//
// A provider's test runs the suite against its emulator:
//
//	attestortest.Conformance(t, attestortest.Provider{
//		Name:        aws.Name,
//		NewAttestor: func(tb testing.TB) attestor.Attestor { return newNodeHalf(tb) },
//		Verifier:    verifier,
//		NodeName:    "node-a",
//		ProviderID:  "aws:///eu-test-1a/i-0123456789abcdef0",
//	})
//
// The suite plays the signer: it files each piece of evidence in a real
// PKCS#10 request through the wire format, derives the binding from the
// CSR's key, and answers a challenge through the node half when the
// verifier sets one, so a two-round provider (TPM) needs nothing more than
// its node half implementing attestor.Responder and, where the key must be
// made by the TPM's host, Provider.NewKey.
package attestortest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// NewBinding returns the binding of a fresh ECDSA P-256 CSR key.
func NewBinding(tb testing.TB) []byte {
	tb.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	der, err := x509.MarshalPKIXPublicKey(&k.PublicKey)
	if err != nil {
		tb.Fatal(err)
	}
	return attestor.Binding(der)
}

// NewCACert returns the DER certificate of a fresh self-signed CA: a
// workload cluster's CA, which evidence of binding v2 names.
func NewCACert(tb testing.TB) []byte {
	tb.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubernetes"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, k.Public(), k)
	if err != nil {
		tb.Fatal(err)
	}
	return der
}

// WantDenial fails the test unless err is a denial with reason.
func WantDenial(tb testing.TB, err error, reason string) {
	tb.Helper()
	d, ok := attestor.AsDenial(err)
	if !ok {
		tb.Fatalf("got %v, want a denial with reason %s", err, reason)
	}
	if d.Reason != reason {
		tb.Fatalf("got denial %v, want reason %s", d, reason)
	}
}
