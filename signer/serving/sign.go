package serving

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// DefaultCAValidity is how long a serving CA made by NewCA is valid.
const DefaultCAValidity = 2 * 365 * 24 * time.Hour

// NewCA makes a self-signed serving CA with an ECDSA P-256 key and returns
// its certificate and key (SEC 1), PEM-encoded.
func NewCA(commonName string, now time.Time, validity time.Duration) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("unable to generate the serving CA key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, nil, fmt.Errorf("unable to generate a serial number: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: commonName},
		NotBefore:             now.Add(-issue.DefaultBackdate),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, nil, fmt.Errorf("unable to self-sign the serving CA: %w", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), nil
}

// signServing issues a serving certificate for a checked request: its
// subject CN and O, its DNS and IP SANs, server auth, the provider ID
// extension. It never outlives the CA.
func signServing(ca *issue.CA, x *x509.CertificateRequest, providerID string, usages []certificatesv1.KeyUsage, requested, maxLife time.Duration, now time.Time) ([]byte, error) {
	if maxLife <= 0 {
		return nil, errors.New("serving signer needs a positive maximum lifetime")
	}
	life := maxLife
	if requested > 0 && requested < life {
		life = requested
	}
	notBefore := now.Add(-issue.DefaultBackdate)
	if notBefore.Before(ca.Cert.NotBefore) {
		notBefore = ca.Cert.NotBefore
	}
	notAfter := now.Add(life)
	if notAfter.After(ca.Cert.NotAfter) {
		notAfter = ca.Cert.NotAfter
	}
	if !notAfter.After(now) {
		return nil, fmt.Errorf("%w: serving CA %q expired at %s", issue.ErrCAExpired, ca.Cert.Subject, ca.Cert.NotAfter.UTC().Format(time.RFC3339))
	}
	var ku x509.KeyUsage
	for _, u := range usages {
		switch u {
		case certificatesv1.UsageDigitalSignature:
			ku |= x509.KeyUsageDigitalSignature
		case certificatesv1.UsageKeyEncipherment:
			ku |= x509.KeyUsageKeyEncipherment
		case certificatesv1.UsageServerAuth:
		default:
			return nil, fmt.Errorf("usage %q may not be signed by the serving signer", u)
		}
	}
	ext, err := attestor.ProviderIDExtension(providerID)
	if err != nil {
		return nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, fmt.Errorf("unable to generate a serial number: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: x.Subject.CommonName, Organization: append([]string(nil), x.Subject.Organization...)},
		DNSNames:              append([]string(nil), x.DNSNames...),
		IPAddresses:           append(x.IPAddresses[:0:0], x.IPAddresses...),
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              ku,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		ExtraExtensions:       []pkix.Extension{ext},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, x.PublicKey, ca.Key)
	if err != nil {
		return nil, fmt.Errorf("unable to sign the serving certificate: %w", err)
	}
	var b bytes.Buffer
	if err := pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: der}); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}
