package trust

import (
	"bytes"
	"cmp"
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// SecretPreviousKey is the Secret key holding the certificates (PEM) of the
// older CAs that are still published; their private keys are not kept. The
// signing CA is under tls.crt and tls.key, as in any kubernetes.io/tls
// Secret.
const SecretPreviousKey = "previous.crt"

// maxAttempts bounds how often Ensure starts over after losing a race
// for the Secret.
const maxAttempts = 4

// Metrics is told about rotations; signer/app implements it.
type Metrics interface {
	// Rotated is called after a new serving CA was made for cluster to
	// replace one that is due (not for a cluster's first CA).
	Rotated(cluster string)
}

// SecretRef names a cluster's serving CA Secret and what it is made with.
type SecretRef struct {
	types.NamespacedName
	// Cluster names the workload cluster in certificate subjects and
	// metrics.
	Cluster string
	// CommonName begins the subject common name of the CAs made, which
	// goes on with Cluster and the time; empty means "kubelet-serving-ca".
	CommonName string
	// Labels and OwnerReferences are set on a Secret this package creates.
	Labels          map[string]string
	OwnerReferences []metav1.OwnerReference
}

// Store keeps serving CAs in Secrets of the management cluster: tls.crt and
// tls.key are the signing CA, SecretPreviousKey the older CAs still
// published. Every change is a create, or an update conditional on the
// resourceVersion read, so that two controllers never both rotate.
type Store struct {
	// Client creates and updates Secrets; Reader reads them from the API
	// server (not a cache).
	Client client.Client
	Reader client.Reader
	// Clock is the time; nil means the real clock.
	Clock clock.PassiveClock
	// Policy is when CAs are made and how long they live.
	Policy Policy
	// Metrics, when set, is told about rotations.
	Metrics Metrics
}

func (s *Store) now() time.Time {
	if s.Clock == nil {
		return time.Now()
	}
	return s.Clock.Now()
}

// Ensure returns the cluster's authority at the current time, first
// making its first CA, rotating a CA that is due and dropping expired
// ones as the policy says, and storing the outcome.
func (s *Store) Ensure(ctx context.Context, ref SecretRef) (*Authority, error) {
	for attempt := 1; ; attempt++ {
		a, err := s.ensure(ctx, ref)
		if attempt < maxAttempts && (apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err)) {
			continue // someone else wrote it first: decide again on what they wrote
		}
		if err != nil {
			return nil, fmt.Errorf("serving CA secret %s: %w", ref.NamespacedName, err)
		}
		return a, nil
	}
}

func (s *Store) ensure(ctx context.Context, ref SecretRef) (*Authority, error) {
	now := s.now()
	var sec corev1.Secret
	err := s.Reader.Get(ctx, ref.NamespacedName, &sec)
	if apierrors.IsNotFound(err) {
		ca, certPEM, keyPEM, err := s.newCA(ref, now)
		if err != nil {
			return nil, err
		}
		sec = corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{
				Name: ref.Name, Namespace: ref.Namespace,
				Labels: ref.Labels, OwnerReferences: ref.OwnerReferences,
			},
			Type: corev1.SecretTypeTLS,
			Data: map[string][]byte{corev1.TLSCertKey: certPEM, corev1.TLSPrivateKeyKey: keyPEM},
		}
		if err := s.Client.Create(ctx, &sec); err != nil {
			return nil, fmt.Errorf("unable to create: %w", err)
		}
		return &Authority{Signing: ca, Trusted: []*x509.Certificate{ca.Cert}, NextChange: s.Policy.nextChange(ca.Cert, nil)}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("unable to read: %w", err)
	}

	signing, err := issue.LoadCA(sec.Data[corev1.TLSCertKey], sec.Data[corev1.TLSPrivateKeyKey])
	if err != nil {
		return nil, err
	}
	previous, err := parseCerts(sec.Data[SecretPreviousKey])
	if err != nil {
		return nil, fmt.Errorf("key %s: %w", SecretPreviousKey, err)
	}
	d := s.Policy.plan(now, signing.Cert, previous)
	if d.rotate {
		ca, certPEM, keyPEM, err := s.newCA(ref, now)
		if err != nil {
			return nil, err
		}
		signing = ca
		sec.Data[corev1.TLSCertKey], sec.Data[corev1.TLSPrivateKeyKey] = certPEM, keyPEM
	}
	if d.changed {
		if len(d.previous) == 0 {
			delete(sec.Data, SecretPreviousKey)
		} else {
			sec.Data[SecretPreviousKey] = encodeCerts(d.previous)
		}
		// Conditional on the resourceVersion read: a concurrent writer
		// makes this fail with a conflict, and Ensure starts over.
		if err := s.Client.Update(ctx, &sec); err != nil {
			return nil, fmt.Errorf("unable to update: %w", err)
		}
		if d.rotate && s.Metrics != nil {
			s.Metrics.Rotated(ref.Cluster)
		}
	}
	return &Authority{
		Signing:    signing,
		Trusted:    append([]*x509.Certificate{signing.Cert}, d.previous...),
		NextChange: s.Policy.nextChange(signing.Cert, d.previous),
	}, nil
}

func (s *Store) newCA(ref SecretRef, now time.Time) (*issue.CA, []byte, []byte, error) {
	cn := fmt.Sprintf("%s %s %s", cmp.Or(ref.CommonName, "kubelet-serving-ca"), ref.Cluster, now.UTC().Format("20060102T150405Z"))
	certPEM, keyPEM, err := issue.NewCA(cn, now, s.Policy.lifetime())
	if err != nil {
		return nil, nil, nil, err
	}
	ca, err := issue.LoadCA(certPEM, keyPEM)
	if err != nil {
		return nil, nil, nil, err
	}
	return ca, certPEM, keyPEM, nil
}

func parseCerts(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for rest := bytes.TrimSpace(data); len(rest) > 0; rest = bytes.TrimSpace(rest) {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			return nil, errors.New("data that is not a PEM block")
		}
		if b.Type != "CERTIFICATE" {
			return nil, fmt.Errorf("a %q PEM block, not CERTIFICATE", b.Type)
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("unable to parse a certificate: %w", err)
		}
		out = append(out, c)
	}
	return out, nil
}

func encodeCerts(certs []*x509.Certificate) []byte {
	var b bytes.Buffer
	for _, c := range certs {
		_ = pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
	}
	return b.Bytes()
}
