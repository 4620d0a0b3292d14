package capi

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// TestReadCARefusesAMismatchedKey: a `<cluster>-ca` Secret whose key is not
// its certificate's (a tenant publishing another cluster's CA certificate
// with a key of its own) is refused as a *RefusedCAError, which the
// reconciler turns into CARefused before it reads anything else; a
// matching one yields its whole bundle, the signing certificate first.
func TestReadCARefusesAMismatchedKey(t *testing.T) {
	victimCert, _, err := issue.NewCA("victim", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	ownCert, ownKey, err := issue.NewCA("own", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	secret := func(cert, key []byte) *corev1.Secret {
		return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c" + CASecretSuffix},
			Data: map[string][]byte{issue.SecretCertKey: cert, issue.SecretKeyKey: key}}
	}
	nn := types.NamespacedName{Namespace: "ns", Name: "c"}

	c := fake.NewClientBuilder().WithObjects(secret(victimCert, ownKey)).Build()
	_, err = ReadCA(context.Background(), c, nn)
	var refused *RefusedCAError
	if !errors.As(err, &refused) {
		t.Fatalf("ReadCA of another CA's certificate with an own key = %v, want a *RefusedCAError", err)
	}

	// A rotation: the new CA signs, the previous one is still trusted.
	rotated := append(append([]byte(nil), ownCert...), victimCert...)
	c = fake.NewClientBuilder().WithObjects(secret(rotated, ownKey)).Build()
	ca, err := ReadCA(context.Background(), c, nn)
	if err != nil {
		t.Fatal(err)
	}
	if len(ca.Bundle) != 2 || !bytes.Equal(ca.Bundle[0], ca.CA.Cert.Raw) {
		t.Fatalf("bundle of %d certificates, signing one first: %v", len(ca.Bundle), len(ca.Bundle) > 0 && bytes.Equal(ca.Bundle[0], ca.CA.Cert.Raw))
	}
}
