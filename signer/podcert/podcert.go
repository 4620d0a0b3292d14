// Package podcert holds the pod-certificate pieces that do not need the API
// server: the per-Cluster policy (read from the Cluster's annotations in one
// place, so it can move into the typed API), the structural and policy checks
// of a PodCertificateRequest, and the certificate it issues. The node checks
// (issued and not superseded client certificate, live Machine, current
// attestation) and the write through the status subresource belong to the
// engine and the controller's one writer.
package podcert

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net/url"
	"strings"
	"time"

	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	"k8s.io/apimachinery/pkg/util/validation"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// DefaultSignerName is the pod signer name, dotted like the CSR signer names.
const DefaultSignerName = "cluster.x-k8s.io/pod-identity"

// Cluster annotations that hold the pod-certificate policy. They are read by
// ParsePolicy only.
const (
	// AnnotationEnabled set to "true" turns pod certificates on for the Cluster.
	AnnotationEnabled = "kubelet-authenticator.x-k8s.io/pod-certificates"
	// AnnotationTrustDomain is the SPIFFE trust domain; required, no
	// default is guessed.
	AnnotationTrustDomain = "kubelet-authenticator.x-k8s.io/pod-certificates-trust-domain"
	// AnnotationAllowed is a comma-separated list of "namespace/serviceaccount"
	// or "namespace/*" entries. Nothing is allowed without it.
	AnnotationAllowed = "kubelet-authenticator.x-k8s.io/pod-certificates-allowed"
	// AnnotationMaxLifetime caps the lifetime (Go duration, 1h to 91 days).
	AnnotationMaxLifetime = "kubelet-authenticator.x-k8s.io/pod-certificates-max-lifetime"
)

// Lifetime bounds kube-apiserver enforces on a pod certificate.
const (
	MinLifetime     = time.Hour
	MaxLifetime     = 91 * 24 * time.Hour
	DefaultLifetime = 24 * time.Hour
	// maxAllowed bounds the allow list read from an annotation.
	maxAllowed = 256
)

// Policy is one Cluster's pod-certificate policy.
type Policy struct {
	TrustDomain string
	// Allowed maps a namespace to its allowed ServiceAccounts; "*" allows
	// every ServiceAccount of the namespace.
	Allowed     map[string]map[string]bool
	MaxLifetime time.Duration
}

// ParsePolicy reads the policy from a Cluster's annotations. It returns nil
// and no error when pod certificates are not enabled, and an error naming the
// annotation to fix when they are enabled but the policy is malformed.
func ParsePolicy(ann map[string]string) (*Policy, error) {
	if ann[AnnotationEnabled] != "true" {
		return nil, nil
	}
	p := &Policy{Allowed: map[string]map[string]bool{}, MaxLifetime: DefaultLifetime}
	td := ann[AnnotationTrustDomain]
	if !validTrustDomain(td) {
		return nil, fmt.Errorf("annotation %s: %q is not a SPIFFE trust domain (lower-case letters, digits, '.', '-', '_')", AnnotationTrustDomain, td)
	}
	p.TrustDomain = td
	entries := strings.Split(ann[AnnotationAllowed], ",")
	if len(entries) > maxAllowed {
		return nil, fmt.Errorf("annotation %s: at most %d entries", AnnotationAllowed, maxAllowed)
	}
	for _, e := range entries {
		e = strings.TrimSpace(e)
		if e == "" {
			continue
		}
		ns, sa, ok := strings.Cut(e, "/")
		if !ok || len(validation.IsDNS1123Label(ns)) > 0 || (sa != "*" && len(validation.IsDNS1123Subdomain(sa)) > 0) {
			return nil, fmt.Errorf("annotation %s: entry %q is not namespace/serviceaccount or namespace/*", AnnotationAllowed, e)
		}
		if p.Allowed[ns] == nil {
			p.Allowed[ns] = map[string]bool{}
		}
		p.Allowed[ns][sa] = true
	}
	if v, ok := ann[AnnotationMaxLifetime]; ok {
		d, err := time.ParseDuration(v)
		if err != nil || d < MinLifetime || d > MaxLifetime {
			return nil, fmt.Errorf("annotation %s: %q is not a duration between %s and %s", AnnotationMaxLifetime, v, MinLifetime, MaxLifetime)
		}
		p.MaxLifetime = d
	}
	return p, nil
}

// allows reports whether the policy allows ServiceAccount ns/sa.
func (p *Policy) allows(ns, sa string) bool {
	return p.Allowed[ns]["*"] || p.Allowed[ns][sa]
}

func validTrustDomain(td string) bool {
	if td == "" || len(td) > 255 {
		return false
	}
	for _, r := range td {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '.' || r == '-' || r == '_') {
			return false
		}
	}
	return true
}

// Reasons a request is denied with.
const (
	ReasonWrongSigner      = "WrongSigner"
	ReasonNotAllowed       = "ServiceAccountNotAllowed"
	ReasonUnsupportedKey   = "UnsupportedKeyType"
	ReasonMalformedRequest = "MalformedRequest"
	ReasonPodCertsDisabled = "PodCertificatesDisabled"
)

// Checked is a request that passed Check.
type Checked struct {
	PublicKey crypto.PublicKey
	SPIFFEID  *url.URL
	NodeName  string
	// Lifetime is the lifetime asked for, already capped by the policy.
	Lifetime time.Duration
}

// Check applies the checks that need nothing but the request and the
// policy: signer name, key type, ServiceAccount allowed, lifetime. Every
// failure is a *attestor.DenyError. spec.unverifiedUserAnnotations are never
// read: nothing in them becomes a name in the certificate.
func Check(pcr *certificatesv1beta1.PodCertificateRequest, signerName string, p *Policy) (*Checked, error) {
	s := &pcr.Spec
	if s.SignerName != signerName {
		return nil, attestor.Deny(ReasonWrongSigner, "signer %q is not %q", s.SignerName, signerName)
	}
	if p == nil {
		return nil, attestor.Deny(ReasonPodCertsDisabled, "pod certificates are not enabled for this cluster: set annotation %s=true on the Cluster", AnnotationEnabled)
	}
	if len(validation.IsDNS1123Label(pcr.Namespace)) > 0 || len(validation.IsDNS1123Subdomain(s.ServiceAccountName)) > 0 || s.NodeName == "" {
		return nil, attestor.Deny(ReasonMalformedRequest, "namespace %q, serviceAccountName %q and nodeName %q must be set and valid", pcr.Namespace, s.ServiceAccountName, s.NodeName)
	}
	if !p.allows(pcr.Namespace, s.ServiceAccountName) {
		return nil, attestor.Deny(ReasonNotAllowed, "ServiceAccount %s/%s may not have pod certificates: add %q to the Cluster's annotation %s", pcr.Namespace, s.ServiceAccountName, pcr.Namespace+"/"+s.ServiceAccountName, AnnotationAllowed)
	}
	if len(s.PKIXPublicKey) > 4096 {
		return nil, attestor.Deny(ReasonMalformedRequest, "pkixPublicKey is %d bytes, longer than any supported key", len(s.PKIXPublicKey))
	}
	pub, err := x509.ParsePKIXPublicKey(s.PKIXPublicKey)
	if err != nil {
		return nil, attestor.Deny(ReasonMalformedRequest, "pkixPublicKey does not parse: %v", err)
	}
	if err := supportedKey(pub); err != nil {
		return nil, attestor.Deny(ReasonUnsupportedKey, "%v; use RSA 3072 or 4096, ECDSA P-256 or P-384, or Ed25519", err)
	}
	life := p.MaxLifetime
	if s.MaxExpirationSeconds != nil {
		if asked := time.Duration(*s.MaxExpirationSeconds) * time.Second; asked < life {
			life = asked
		}
	}
	if life < MinLifetime {
		return nil, attestor.Deny(ReasonMalformedRequest, "maxExpirationSeconds %s is below the minimum %s", life, MinLifetime)
	}
	return &Checked{
		PublicKey: pub,
		SPIFFEID:  &url.URL{Scheme: "spiffe", Host: p.TrustDomain, Path: "/ns/" + pcr.Namespace + "/sa/" + s.ServiceAccountName},
		NodeName:  string(s.NodeName),
		Lifetime:  life,
	}, nil
}

// supportedKey accepts the key types kubelet generates for pod certificates.
func supportedKey(pub crypto.PublicKey) error {
	switch k := pub.(type) {
	case *rsa.PublicKey:
		if n := k.N.BitLen(); n != 3072 && n != 4096 {
			return fmt.Errorf("RSA key of %d bits", n)
		}
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() {
			return fmt.Errorf("ECDSA key on curve %s", k.Curve.Params().Name)
		}
	case ed25519.PublicKey:
	default:
		return fmt.Errorf("key type %T", pub)
	}
	return nil
}

// Issued is a signed pod certificate and the times the status carries.
type Issued struct {
	CertificateChain                    string
	NotBefore, BeginRefreshAt, NotAfter time.Time
}

// ErrNodeCertExpiring is returned when the node's own client certificate
// ends too soon for a pod certificate of the minimum lifetime: retry once the
// node has renewed, never deny.
var ErrNodeCertExpiring = errors.New("the node's client certificate expires within the minimum pod certificate lifetime")

// Sign issues the certificate for c with ca: one URI SAN (the SPIFFE ID),
// client and server auth, not a CA, never valid past nodeNotAfter (the
// node's own client certificate) nor past the CA. beginRefreshAt is at half
// the lifetime.
func Sign(ca *issue.CA, c *Checked, nodeNotAfter, now time.Time) (*Issued, error) {
	notBefore := now.Add(-issue.DefaultBackdate)
	if notBefore.Before(ca.Cert.NotBefore) {
		notBefore = ca.Cert.NotBefore
	}
	notAfter := now.Add(c.Lifetime)
	if nodeNotAfter.Before(notAfter) {
		notAfter = nodeNotAfter
	}
	if ca.Cert.NotAfter.Before(notAfter) {
		notAfter = ca.Cert.NotAfter
	}
	// kube-apiserver refuses a lifetime under an hour.
	if notAfter.Sub(notBefore) < MinLifetime {
		if ca.Cert.NotAfter.Equal(notAfter) {
			return nil, fmt.Errorf("%w: %q ends at %s", issue.ErrCAExpired, ca.Cert.Subject, ca.Cert.NotAfter.UTC().Format(time.RFC3339))
		}
		return nil, ErrNodeCertExpiring
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, fmt.Errorf("unable to generate a serial number: %w", err)
	}
	ku := x509.KeyUsageDigitalSignature
	if _, ok := c.PublicKey.(*rsa.PublicKey); ok {
		ku |= x509.KeyUsageKeyEncipherment
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              ku,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth, x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		URIs:                  []*url.URL{c.SPIFFEID},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, c.PublicKey, ca.Key)
	if err != nil {
		return nil, fmt.Errorf("unable to sign certificate: %w", err)
	}
	chain := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	return &Issued{
		CertificateChain: string(chain),
		NotBefore:        notBefore,
		BeginRefreshAt:   notBefore.Add(notAfter.Sub(notBefore) / 2),
		NotAfter:         notAfter,
	}, nil
}
