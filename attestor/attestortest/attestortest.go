// Package attestortest holds what every attestor's tests share: a binding
// to a fresh CSR key, and the check that a verifier denied with a given
// reason.
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
