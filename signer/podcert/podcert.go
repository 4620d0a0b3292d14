// Package podcert holds the pod-certificate pieces that do not need the API
// server: the per-Cluster policy (spec.podCertificates of its
// ClusterAttestation, read by NewPolicy), the structural and policy checks
// of a PodCertificateRequest, and the certificate it issues. The node checks
// (issued and not superseded client certificate, live Machine, current
// attestation) and the write through the status subresource belong to the
// engine and the controller's one writer.
package podcert

import (
	"cmp"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net/url"
	"time"

	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert/podattest"
)

// DefaultSignerName is the pod signer name, dotted like the CSR signer names.
const DefaultSignerName = "cluster.x-k8s.io/pod-identity"

// Lifetime bounds kube-apiserver enforces on a pod certificate.
const (
	MinLifetime     = v1alpha1.MinPodCertificateLifetimeSeconds * time.Second
	MaxLifetime     = v1alpha1.MaxPodCertificateLifetimeSeconds * time.Second
	DefaultLifetime = 24 * time.Hour
)

// Policy is one Cluster's pod-certificate policy.
type Policy struct {
	TrustDomain string
	// Allowed maps a namespace to its allowed ServiceAccounts; "*" allows
	// every ServiceAccount of the namespace.
	Allowed     map[string]map[string]bool
	MaxLifetime time.Duration
}

// NewPolicy reads the policy from spec.podCertificates of a
// ClusterAttestation (path), checking again what its schema checks. It
// returns nil and no error when spec is nil (pod certificates off), and the
// problems at the path of the setting to fix otherwise.
func NewPolicy(spec *v1alpha1.PodCertificatePolicy, path *field.Path) (*Policy, field.ErrorList) {
	if spec == nil {
		return nil, nil
	}
	var errs field.ErrorList
	p := &Policy{Allowed: map[string]map[string]bool{}, MaxLifetime: DefaultLifetime}
	if !validTrustDomain(spec.TrustDomain) {
		errs = append(errs, field.Invalid(path.Child("trustDomain"), spec.TrustDomain, "not a SPIFFE trust domain (lower-case letters, digits, '.', '-', '_')"))
	}
	p.TrustDomain = spec.TrustDomain
	allowed := spec.Allowed
	if len(allowed) > v1alpha1.MaxPodCertificateServiceAccounts {
		errs = append(errs, field.TooMany(path.Child("allowed"), len(allowed), v1alpha1.MaxPodCertificateServiceAccounts))
		allowed = allowed[:v1alpha1.MaxPodCertificateServiceAccounts]
	}
	for i, a := range allowed {
		ap := path.Child("allowed").Index(i)
		if len(validation.IsDNS1123Label(a.Namespace)) > 0 {
			errs = append(errs, field.Invalid(ap.Child("namespace"), a.Namespace, "not a namespace name"))
			continue
		}
		if len(a.ServiceAccounts) > v1alpha1.MaxPodCertificateServiceAccounts {
			errs = append(errs, field.TooMany(ap.Child("serviceAccounts"), len(a.ServiceAccounts), v1alpha1.MaxPodCertificateServiceAccounts))
			continue
		}
		for j, sa := range a.ServiceAccounts {
			if sa != "*" && len(validation.IsDNS1123Subdomain(sa)) > 0 {
				errs = append(errs, field.Invalid(ap.Child("serviceAccounts").Index(j), sa, "not a ServiceAccount name nor *"))
				continue
			}
			if p.Allowed[a.Namespace] == nil {
				p.Allowed[a.Namespace] = map[string]bool{}
			}
			p.Allowed[a.Namespace][sa] = true
		}
	}
	if spec.MaxLifetimeSeconds != nil {
		d := time.Duration(*spec.MaxLifetimeSeconds) * time.Second
		if d < MinLifetime || d > MaxLifetime {
			errs = append(errs, field.Invalid(path.Child("maxLifetimeSeconds"), *spec.MaxLifetimeSeconds, fmt.Sprintf("must be between %d and %d",
				v1alpha1.MinPodCertificateLifetimeSeconds, v1alpha1.MaxPodCertificateLifetimeSeconds)))
		} else {
			p.MaxLifetime = d
		}
	}
	if len(errs) > 0 {
		return nil, errs
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
		if ok := r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '.' || r == '-' || r == '_'; !ok {
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
		return nil, attestor.Deny(ReasonPodCertsDisabled, "pod certificates are not enabled for this cluster: set spec.podCertificates of its ClusterAttestation")
	}
	if len(validation.IsDNS1123Label(pcr.Namespace)) > 0 || len(validation.IsDNS1123Subdomain(s.ServiceAccountName)) > 0 || s.NodeName == "" {
		return nil, attestor.Deny(ReasonMalformedRequest, "namespace %q, serviceAccountName %q and nodeName %q must be set and valid", pcr.Namespace,
			s.ServiceAccountName, s.NodeName)
	}
	if !p.allows(pcr.Namespace, s.ServiceAccountName) {
		return nil, attestor.Deny(ReasonNotAllowed,
			"ServiceAccount %s/%s may not have pod certificates: add it to spec.podCertificates.allowed of the Cluster's ClusterAttestation", pcr.Namespace,
			s.ServiceAccountName)
	}
	pub, err := publicKey(s)
	if err != nil {
		return nil, err
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

// MaxKeySize bounds pkixPublicKey and MaxStubRequestSize
// stubPKCS10Request: longer than any supported key (RSA 4096) needs.
const (
	MaxKeySize         = 4 << 10
	MaxStubRequestSize = 8 << 10
)

// publicKey returns the key to certify: the subject public key of
// stubPKCS10Request (what kubelet sends since Kubernetes 1.36), or the
// deprecated pkixPublicKey of older kubelets; exactly one is set. Nothing
// else of the stub request is read (kubelet's are empty): it never adds a
// name or an extension. Its signature is checked again although
// kube-apiserver checked it at creation.
func publicKey(s *certificatesv1beta1.PodCertificateRequestSpec) (crypto.PublicKey, error) {
	switch {
	case len(s.StubPKCS10Request) > 0 && len(s.PKIXPublicKey) > 0:
		return nil, attestor.Deny(ReasonMalformedRequest, "stubPKCS10Request and pkixPublicKey are both set; set only stubPKCS10Request")
	case len(s.StubPKCS10Request) > MaxStubRequestSize:
		return nil, attestor.Deny(ReasonMalformedRequest, "stubPKCS10Request is %d bytes, longer than any supported key needs", len(s.StubPKCS10Request))
	case len(s.StubPKCS10Request) > 0:
		csr, err := x509.ParseCertificateRequest(s.StubPKCS10Request)
		if err != nil {
			return nil, attestor.Deny(ReasonMalformedRequest, "stubPKCS10Request does not parse: %v", err)
		}
		if err := csr.CheckSignature(); err != nil {
			return nil, attestor.Deny(ReasonMalformedRequest, "stubPKCS10Request is not signed by its key: %v", err)
		}
		return csr.PublicKey, nil
	case len(s.PKIXPublicKey) > MaxKeySize:
		return nil, attestor.Deny(ReasonMalformedRequest, "pkixPublicKey is %d bytes, longer than any supported key", len(s.PKIXPublicKey))
	case len(s.PKIXPublicKey) > 0:
		pub, err := x509.ParsePKIXPublicKey(s.PKIXPublicKey)
		if err != nil {
			return nil, attestor.Deny(ReasonMalformedRequest, "pkixPublicKey does not parse: %v", err)
		}
		return pub, nil
	}
	return nil, attestor.Deny(ReasonMalformedRequest, "neither stubPKCS10Request nor pkixPublicKey is set")
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

// Backdate is how far before now a pod certificate starts, for clock skew:
// kube-apiserver refuses a notBefore more than five minutes from its time.
const Backdate = time.Minute

// What kube-apiserver accepts of a pod certificate's times: notBefore less
// than MaxBackdate from its time, beginRefreshAt at least RefreshMargin
// after notBefore and before notAfter.
const (
	MaxBackdate   = 5 * time.Minute
	RefreshMargin = 10 * time.Minute
)

// Timing places a pod certificate's notBefore and beginRefreshAt. The zero
// Timing is the signer's: notBefore Backdate before now, beginRefreshAt
// half-way through the lifetime. Another Timing only moves both to the
// earliest kube-apiserver accepts, so that a test sees kubelet refresh a
// certificate within minutes (the controller's --test-pod-certificate-*
// flags, in test builds only); what is certified is the same.
type Timing struct {
	// Backdate is how far before now notBefore is, under MaxBackdate; 0
	// means Backdate.
	Backdate time.Duration
	// RefreshAfter is how long after notBefore beginRefreshAt is, at least
	// RefreshMargin and at most the lifetime less RefreshMargin; 0 means
	// half the lifetime.
	RefreshAfter time.Duration
}

// Validate reports a Timing kube-apiserver would refuse the certificates of.
func (t Timing) Validate() error {
	var errs []error
	if t.Backdate < 0 || t.Backdate >= MaxBackdate {
		errs = append(errs, fmt.Errorf("backdate %s is not in [0, %s)", t.Backdate, MaxBackdate))
	}
	if t.RefreshAfter != 0 && (t.RefreshAfter < RefreshMargin || t.RefreshAfter > MinLifetime-RefreshMargin) {
		errs = append(errs, fmt.Errorf("refresh after %s is neither 0 nor in [%s, %s]", t.RefreshAfter, RefreshMargin, MinLifetime-RefreshMargin))
	}
	return errors.Join(errs...)
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
// client and server auth, not a CA, the attestation extension saying what
// was attested about the node (node), never valid past nodeNotAfter (the
// node's own client certificate) nor past the CA. notBefore and
// beginRefreshAt are placed by t (the zero Timing: beginRefreshAt at half
// the lifetime).
func Sign(ca *issue.CA, c *Checked, node *podattest.Attestation, nodeNotAfter, now time.Time, t Timing) (*Issued, error) {
	if err := t.Validate(); err != nil {
		return nil, err
	}
	ext, err := node.Extension()
	if err != nil {
		return nil, err
	}
	notBefore := now.Add(-cmp.Or(t.Backdate, Backdate))
	if notBefore.Before(ca.Cert.NotBefore) {
		notBefore = ca.Cert.NotBefore
	}
	// kube-apiserver measures the lifetime from notBefore.
	notAfter := notBefore.Add(c.Lifetime)
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
		ExtraExtensions:       []pkix.Extension{ext},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, c.PublicKey, ca.Key)
	if err != nil {
		return nil, fmt.Errorf("unable to sign certificate: %w", err)
	}
	chain := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	refresh := notAfter.Sub(notBefore) / 2
	if t.RefreshAfter != 0 {
		refresh = t.RefreshAfter
	}
	return &Issued{
		CertificateChain: string(chain),
		NotBefore:        notBefore,
		BeginRefreshAt:   notBefore.Add(refresh),
		NotAfter:         notAfter,
	}, nil
}
