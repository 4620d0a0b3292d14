// Package trust keeps the serving CA the controller signs attested kubelet
// serving certificates with (the cluster.x-k8s.io/kubelet-serving-<provider>
// signers), one per workload cluster, and publishes it in the workload
// cluster as signer-linked ClusterTrustBundles that nodes and clients project
// onto disk.
//
// Lifecycle. A CA is ECDSA P-256, self-signed, valid for Policy.Lifetime.
// Policy.RotateBefore its expiry (60 days by default) a new CA is made; from
// then on new serving certificates are signed by the new CA only, and the
// old CA stays published, next to the new one, until it expires (no
// certificate it signed outlives it); then it is dropped. The state lives in
// one Secret on the management cluster (see Store), never only in memory: a
// controller that restarts in the middle of a rotation picks it up where it
// was.
//
// Publication. Each CA is one ClusterTrustBundle per serving signer name,
// named `<signer name with / as :>:<fingerprint>` (kube-apiserver requires
// that prefix for a bundle with spec.signerName) and labelled LabelServingCA,
// so that a consumer selects by signer name (the object names change at each
// rotation) and the publisher removes the bundles it no longer wants.
// Creating a signer-linked bundle requires the `attest` verb on the signer
// (resource `signers` of certificates.k8s.io, resource name the signer name or
// `cluster.x-k8s.io/*`); see docs/serving-ca.md.
package trust

import (
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"time"

	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// Defaults of Policy.
const (
	// DefaultLifetime is how long a new serving CA is valid: two years.
	DefaultLifetime = 2 * 365 * 24 * time.Hour
	// DefaultRotateBefore is how long before the signing CA expires a new
	// one is made: 60 days, so that every consumer has the new CA long
	// before a certificate signed by it reaches it.
	DefaultRotateBefore = 60 * 24 * time.Hour
	// MinLifetime is the shortest CA lifetime accepted.
	MinLifetime = time.Hour
)

// Policy is when serving CAs are made and how long they live.
type Policy struct {
	// Lifetime of a new CA; 0 means DefaultLifetime.
	Lifetime time.Duration
	// RotateBefore is how long before the signing CA's expiry a new CA is
	// made; 0 means DefaultRotateBefore.
	RotateBefore time.Duration
}

func (p Policy) lifetime() time.Duration {
	if p.Lifetime == 0 {
		return DefaultLifetime
	}
	return p.Lifetime
}

func (p Policy) rotateBefore() time.Duration {
	if p.RotateBefore == 0 {
		return DefaultRotateBefore
	}
	return p.RotateBefore
}

// Validate reports every problem with the policy, with defaults applied.
func (p Policy) Validate() error {
	var errs []error
	life, before := p.lifetime(), p.rotateBefore()
	if life < MinLifetime {
		errs = append(errs, fmt.Errorf("serving CA lifetime %s must be at least %s", life, MinLifetime))
	}
	if before <= 0 {
		errs = append(errs, fmt.Errorf("serving CA rotate-before %s must be positive", before))
	} else if before >= life {
		errs = append(errs, fmt.Errorf("serving CA rotate-before %s must be shorter than its lifetime %s, or every CA would be replaced as soon as it is made",
			before, life))
	}
	return errors.Join(errs...)
}

// Authority is a workload cluster's serving CAs at one point in time.
type Authority struct {
	// Signing is the newest CA: it alone signs.
	Signing *issue.CA
	// Trusted are the certificates of every CA that has not expired, the
	// signing CA first, then older ones, newest first. They are what is
	// published.
	Trusted []*x509.Certificate
	// NextChange is when the Authority changes next without anyone asking:
	// the signing CA is due for rotation, or an older CA expires.
	NextChange time.Time
}

// Fingerprint returns a stable digest of the authority (the signing CA's
// key and every trusted certificate): it changes when a CA is made or
// dropped.
func (a *Authority) Fingerprint() string {
	h := sha256.New()
	if der, err := x509.MarshalPKCS8PrivateKey(a.Signing.Key); err == nil {
		h.Write(der)
	}
	for _, c := range a.Trusted {
		h.Write(c.Raw)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// BundlePEM returns the trusted certificates, PEM-encoded, signing CA first.
func (a *Authority) BundlePEM() []byte {
	return encodeCerts(a.Trusted)
}

// CertFingerprint names a CA certificate in ClusterTrustBundle names: the
// first 16 bytes of the SHA-256 of its DER, in hex.
func CertFingerprint(c *x509.Certificate) string {
	sum := sha256.Sum256(c.Raw)
	return hex.EncodeToString(sum[:16])
}

// decision is what plan decided about a stored authority.
type decision struct {
	// rotate: a new CA must be made, and the signing one becomes previous.
	rotate bool
	// previous are the older CAs to keep (not expired), newest first.
	previous []*x509.Certificate
	// changed: the stored state must be written.
	changed bool
}

// plan decides, at now, what becomes of a signing CA certificate and the
// certificates of older CAs.
func (p Policy) plan(now time.Time, signing *x509.Certificate, previous []*x509.Certificate) decision {
	var d decision
	if !now.Before(signing.NotAfter.Add(-p.rotateBefore())) {
		d.rotate, d.changed = true, true
		previous = append([]*x509.Certificate{signing}, previous...)
	}
	for _, c := range previous {
		if now.Before(c.NotAfter) {
			d.previous = append(d.previous, c)
		} else {
			d.changed = true
		}
	}
	slices.SortStableFunc(d.previous, func(a, b *x509.Certificate) int { return b.NotAfter.Compare(a.NotAfter) })
	return d
}

// nextChange returns when an authority with this signing CA and these
// older CAs next needs a decision.
func (p Policy) nextChange(signing *x509.Certificate, previous []*x509.Certificate) time.Time {
	next := signing.NotAfter.Add(-p.rotateBefore())
	for _, c := range previous {
		if c.NotAfter.Before(next) {
			next = c.NotAfter
		}
	}
	return next
}
