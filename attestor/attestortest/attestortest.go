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
	"testing"

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
