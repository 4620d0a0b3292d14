package harness

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"time"
)

// certValidity is how long every certificate the harness makes is valid.
// Tests are short; a day leaves room for a slow machine and clock skew.
const certValidity = 24 * time.Hour

// CA is a self-made certificate authority: an ECDSA P-256 key and its
// self-signed certificate.
type CA struct {
	// Cert is the CA certificate, parsed.
	Cert *x509.Certificate
	// Key is the CA private key.
	Key *ecdsa.PrivateKey
	// CertPEM is Cert PEM encoded.
	CertPEM []byte
	// KeyPEM is Key as SEC 1 ("EC PRIVATE KEY") PEM, the form kubeadm writes for ECDSA keys.
	KeyPEM []byte
}

// NewCA makes a new self-signed ECDSA P-256 CA with the given common name.
func NewCA(commonName string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("unable to generate CA key: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: commonName},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(certValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("unable to create CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("unable to parse CA certificate: %w", err)
	}
	keyPEM, err := encodeECKey(key)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key, CertPEM: encodeCert(der), KeyPEM: keyPEM}, nil
}

// CertSpec says what a leaf certificate issued by a CA is for.
type CertSpec struct {
	// CommonName is the subject CN (the user name, for a client certificate).
	CommonName string
	// Organization is the subject O (the groups, for a client certificate).
	Organization []string
	// DNSNames and IPs are the subject alternative names.
	DNSNames []string
	IPs      []net.IP
	// Server asks for the server auth usage; otherwise the certificate is for client auth.
	Server bool
	// NotAfter, when set, ends the validity (a past one makes an expired
	// certificate).
	NotAfter time.Time
}

// Issue makes a new ECDSA P-256 key and a certificate for it signed by the CA.
// It returns both PEM encoded (certificate, SEC 1 key).
func (ca *CA) Issue(spec CertSpec) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("unable to generate key for %q: %w", spec.CommonName, err)
	}
	certPEM, err = ca.Sign(spec, key.Public())
	if err != nil {
		return nil, nil, err
	}
	keyPEM, err = encodeECKey(key)
	if err != nil {
		return nil, nil, err
	}
	return certPEM, keyPEM, nil
}

// Sign issues a certificate for pub as described by spec and returns it PEM encoded.
func (ca *CA) Sign(spec CertSpec, pub crypto.PublicKey) ([]byte, error) {
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	usage := x509.ExtKeyUsageClientAuth
	if spec.Server {
		usage = x509.ExtKeyUsageServerAuth
	}
	now := time.Now()
	notAfter := now.Add(certValidity)
	if !spec.NotAfter.IsZero() {
		notAfter = spec.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: spec.CommonName, Organization: spec.Organization},
		DNSNames:              spec.DNSNames,
		IPAddresses:           spec.IPs,
		NotBefore:             notAfter.Add(-certValidity - time.Hour),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{usage},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, pub, ca.Key)
	if err != nil {
		return nil, fmt.Errorf("unable to sign certificate for %q: %w", spec.CommonName, err)
	}
	return encodeCert(der), nil
}

func randomSerial() (*big.Int, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("unable to generate serial number: %w", err)
	}
	return serial, nil
}

func encodeCert(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func encodeECKey(key *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("unable to marshal EC key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), nil
}

// newServiceAccountKey makes the service-account token signing key pair:
// the private key (SEC 1 PEM) and the public key (PKIX PEM).
func newServiceAccountKey() (keyPEM, pubPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("unable to generate service-account key: %w", err)
	}
	keyPEM, err = encodeECKey(key)
	if err != nil {
		return nil, nil, err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		return nil, nil, fmt.Errorf("unable to marshal service-account public key: %w", err)
	}
	return keyPEM, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}), nil
}
