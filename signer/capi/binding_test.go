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
// reconciler turns into CARefused before it reads anything else; of a
// matching one only the signing certificate names the cluster: another
// cluster's CA certificate appended to tls.crt does not.
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

	// The victim's CA appended after the tenant's own.
	appended := append(append([]byte(nil), ownCert...), victimCert...)
	c = fake.NewClientBuilder().WithObjects(secret(appended, ownKey)).Build()
	ca, err := ReadCA(context.Background(), c, nn)
	if err != nil {
		t.Fatal(err)
	}
	if len(ca.Bundle) != 1 || !bytes.Equal(ca.Bundle[0], ca.CA.Cert.Raw) {
		t.Fatalf("the cluster is named by %d certificates (the signing one: %t), want the signing one only", len(ca.Bundle), len(ca.Bundle) > 0 && bytes.Equal(ca.Bundle[0], ca.CA.Cert.Raw))
	}
}
