// Package issue holds a workload cluster's certificate authority and signs
// kubelet client certificates with it.
//
// The CA is the one kube-apiserver already trusts for client certificates:
// with Cluster API, the `<cluster>-ca` Secret (tls.crt, tls.key). A signed
// certificate carries the request's subject, the requested usages and the
// provider ID extension, and nothing else the request asked for. It is never
// a CA, and it never outlives the CA.
package issue

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Secret keys of a Cluster API `<cluster>-ca` Secret (kubernetes.io/tls).
const (
	SecretCertKey = "tls.crt"
	SecretKeyKey  = "tls.key"
)

// DefaultBackdate is how far before now a certificate's NotBefore is set, to
// tolerate clock skew between the management cluster and the nodes.
const DefaultBackdate = 5 * time.Minute

// CA is a certificate authority: its certificate and private key.
type CA struct {
	Cert *x509.Certificate
	Key  crypto.Signer
}

// LoadCA parses a CA certificate (the first CERTIFICATE block of certPEM)
// and its private key (PKCS#1, SEC 1 or PKCS#8) and checks that they belong
// together and that the certificate is a CA that may sign certificates.
func LoadCA(certPEM, keyPEM []byte) (*CA, error) {
	var certDER []byte
	for rest := certPEM; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type == "CERTIFICATE" {
			certDER = b.Bytes
			break
		}
	}
	if certDER == nil {
		return nil, errors.New("no CERTIFICATE PEM block in the CA certificate")
	}
	cert, err := x509.ParseCertificate(certDER)
	if err != nil {
		return nil, fmt.Errorf("unable to parse CA certificate: %w", err)
	}
	if !cert.BasicConstraintsValid || !cert.IsCA {
		return nil, fmt.Errorf("certificate %q is not a CA", cert.Subject)
	}
	if cert.KeyUsage != 0 && cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, fmt.Errorf("CA certificate %q may not sign certificates (no certSign key usage)", cert.Subject)
	}
	key, err := parseKey(keyPEM)
	if err != nil {
		return nil, err
	}
	pub, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(cert.PublicKey) {
		return nil, fmt.Errorf("CA private key does not match certificate %q", cert.Subject)
	}
	return &CA{Cert: cert, Key: key}, nil
}

func parseKey(keyPEM []byte) (crypto.Signer, error) {
	for rest := keyPEM; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			return nil, errors.New("no private key PEM block in the CA key")
		}
		var k any
		var err error
		switch b.Type {
		case "RSA PRIVATE KEY":
			k, err = x509.ParsePKCS1PrivateKey(b.Bytes)
		case "EC PRIVATE KEY":
			k, err = x509.ParseECPrivateKey(b.Bytes)
		case "PRIVATE KEY":
			k, err = x509.ParsePKCS8PrivateKey(b.Bytes)
		default:
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("unable to parse CA private key (%s): %w", b.Type, err)
		}
		switch k := k.(type) {
		case *rsa.PrivateKey, *ecdsa.PrivateKey, ed25519.PrivateKey:
			return k.(crypto.Signer), nil
		default:
			return nil, fmt.Errorf("unsupported CA private key type %T", k)
		}
	}
}

// CertPEM returns the CA certificate, PEM-encoded.
func (ca *CA) CertPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Cert.Raw})
}

// ErrCAExpired is returned by Sign when the CA has expired (or expires before
// a certificate could be valid): rotate the CA.
var ErrCAExpired = errors.New("the CA certificate has expired")

// Signer signs kubelet client and serving certificates with a CA.
type Signer struct {
	// CA signs.
	CA *CA
	// Serving makes this a serving signer: it issues server auth with the
	// request's DNS and IP SANs. Otherwise it issues client auth and never
	// a SAN. Each CA issues one kind only.
	Serving bool
	// MaxLifetime caps every certificate's lifetime; a shorter requested
	// lifetime wins.
	MaxLifetime time.Duration
	// Backdate moves NotBefore into the past; 0 means DefaultBackdate.
	Backdate time.Duration
	// Clock tells the time; nil means the real clock.
	Clock clock.PassiveClock
}

// Request is what to sign.
type Request struct {
	// CSR is the checked PKCS#10 request: its subject and public key are
	// used, and its provider ID extension copied.
	CSR *x509.CertificateRequest
	// ProviderID is the provider ID to carry, already read from CSR.
	ProviderID string
	// Usages are the requested (and checked) spec.usages: client auth or
	// server auth, never both.
	Usages []certificatesv1.KeyUsage
	// Duration is the requested lifetime (spec.expirationSeconds); 0 means
	// MaxLifetime.
	Duration time.Duration
}

// Sign issues a certificate for req and returns it PEM-encoded.
func (s *Signer) Sign(req *Request) ([]byte, error) {
	if s.CA == nil || req.CSR == nil {
		return nil, errors.New("signer needs a CA and a request")
	}
	if s.MaxLifetime <= 0 {
		return nil, errors.New("signer needs a positive maximum lifetime")
	}
	now := time.Now()
	if s.Clock != nil {
		now = s.Clock.Now()
	}
	backdate := s.Backdate
	if backdate == 0 {
		backdate = DefaultBackdate
	}
	life := s.MaxLifetime
	if req.Duration > 0 && req.Duration < life {
		life = req.Duration
	}
	notBefore := now.Add(-backdate)
	if notBefore.Before(s.CA.Cert.NotBefore) {
		notBefore = s.CA.Cert.NotBefore
	}
	notAfter := now.Add(life)
	if notAfter.After(s.CA.Cert.NotAfter) {
		notAfter = s.CA.Cert.NotAfter
	}
	if !notAfter.After(now) {
		return nil, fmt.Errorf("%w: %q expired at %s", ErrCAExpired, s.CA.Cert.Subject, s.CA.Cert.NotAfter.UTC().Format(time.RFC3339))
	}
	keyUsage, extKeyUsage, err := usages(req.Usages, s.Serving)
	if err != nil {
		return nil, err
	}
	ext, err := attestor.ProviderIDExtension(req.ProviderID)
	if err != nil {
		return nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, fmt.Errorf("unable to generate a serial number: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		// Only CN and O: the checks allow nothing else, and a subject is
		// never copied wholesale.
		Subject: pkix.Name{
			CommonName:   req.CSR.Subject.CommonName,
			Organization: append([]string(nil), req.CSR.Subject.Organization...),
		},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              keyUsage,
		ExtKeyUsage:           extKeyUsage,
		BasicConstraintsValid: true,
		IsCA:                  false,
		ExtraExtensions:       []pkix.Extension{ext},
	}
	if s.Serving {
		// The SANs of a serving request, already compared with the
		// Machine's addresses.
		tmpl.DNSNames = append([]string(nil), req.CSR.DNSNames...)
		tmpl.IPAddresses = append(req.CSR.IPAddresses[:0:0], req.CSR.IPAddresses...)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, s.CA.Cert, req.CSR.PublicKey, s.CA.Key)
	if err != nil {
		return nil, fmt.Errorf("unable to sign certificate: %w", err)
	}
	var b bytes.Buffer
	if err := pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: der}); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// usages maps spec.usages to X.509 key usages: those of a kubelet client
// certificate, or of a serving one for a serving signer.
func usages(in []certificatesv1.KeyUsage, serving bool) (x509.KeyUsage, []x509.ExtKeyUsage, error) {
	var ku x509.KeyUsage
	var eku []x509.ExtKeyUsage
	seenClient, seenServer := false, false
	for _, u := range in {
		if (u == certificatesv1.UsageClientAuth && serving) || (u == certificatesv1.UsageServerAuth && !serving) {
			return 0, nil, fmt.Errorf("usage %q may not be signed by this signer", u)
		}
		switch u {
		case certificatesv1.UsageDigitalSignature:
			ku |= x509.KeyUsageDigitalSignature
		case certificatesv1.UsageKeyEncipherment:
			ku |= x509.KeyUsageKeyEncipherment
		case certificatesv1.UsageClientAuth:
			if !seenClient {
				eku = append(eku, x509.ExtKeyUsageClientAuth)
				seenClient = true
			}
		case certificatesv1.UsageServerAuth:
			if !seenServer {
				eku = append(eku, x509.ExtKeyUsageServerAuth)
				seenServer = true
			}
		default:
			return 0, nil, fmt.Errorf("usage %q may not be signed by this signer", u)
		}
	}
	if ku == 0 || len(eku) != 1 {
		return 0, nil, fmt.Errorf("usages %v are not digital signature with exactly one of client auth and server auth", in)
	}
	return ku, eku, nil
}
