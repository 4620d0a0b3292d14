// Package tpmtest holds test fixtures for the TPM attestor that need no TPM:
// a self-made TPM manufacturer CA (root and intermediate) that issues EK
// certificates shaped like real ones (empty subject, critical TCG
// directoryName SAN, tcg-kp-EKCertificate). Tests, the simulator
// provisioning in tpmsim and `make demo` use it; release binaries do not.
package tpmtest

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"fmt"
	"math/big"
	"time"
)

// ManufacturerCA is a two-level TPM manufacturer CA.
type ManufacturerCA struct {
	Root, Intermediate *x509.Certificate
	key                crypto.Signer
	// Manufacturer, Model and Version go into issued certificates' SAN.
	Manufacturer, Model, Version string
	// NotBefore and NotAfter bound issued certificates.
	NotBefore, NotAfter time.Time
}

// NewManufacturerCA makes a root and an intermediate named after name,
// valid from notBefore for ten years. Both are CAs allowed to sign
// certificates (basic constraints cA, keyCertSign), as the signer requires
// of every CA on an EK certificate's path.
func NewManufacturerCA(name string, notBefore time.Time) (*ManufacturerCA, error) {
	return NewManufacturerCAWith(name, notBefore, nil)
}

// NewManufacturerCAWith is NewManufacturerCA with the intermediate's
// template changed by edit before it is issued, for tests of CAs that may
// not issue EK certificates.
func NewManufacturerCAWith(name string, notBefore time.Time, edit func(intermediate *x509.Certificate)) (*ManufacturerCA, error) {
	rootKey, err := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	if err != nil {
		return nil, err
	}
	interKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	notAfter := notBefore.AddDate(10, 0, 0)
	rootTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{Organization: []string{name}, CommonName: name + " TPM Root CA"},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	rootDER, err := x509.CreateCertificate(rand.Reader, rootTmpl, rootTmpl, &rootKey.PublicKey, rootKey)
	if err != nil {
		return nil, err
	}
	root, err := x509.ParseCertificate(rootDER)
	if err != nil {
		return nil, err
	}
	interTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(2),
		Subject:               pkix.Name{Organization: []string{name}, CommonName: name + " TPM EK Intermediate CA"},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	if edit != nil {
		edit(interTmpl)
	}
	interDER, err := x509.CreateCertificate(rand.Reader, interTmpl, root, &interKey.PublicKey, rootKey)
	if err != nil {
		return nil, err
	}
	inter, err := x509.ParseCertificate(interDER)
	if err != nil {
		return nil, err
	}
	return &ManufacturerCA{
		Root: root, Intermediate: inter, key: interKey,
		Manufacturer: "id:FFFFF1D0", Model: name, Version: "id:00010002",
		NotBefore: notBefore, NotAfter: notAfter,
	}, nil
}

// Pools returns the root and intermediate pools a verifier is configured
// with.
func (ca *ManufacturerCA) Pools() (roots, intermediates *x509.CertPool) {
	roots, intermediates = x509.NewCertPool(), x509.NewCertPool()
	roots.AddCert(ca.Root)
	intermediates.AddCert(ca.Intermediate)
	return roots, intermediates
}

// BundlePEM returns root and intermediate as one PEM bundle, the form an
// operator configures.
func (ca *ManufacturerCA) BundlePEM() []byte {
	var out []byte
	for _, c := range []*x509.Certificate{ca.Root, ca.Intermediate} {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})...)
	}
	return out
}

var (
	oidSAN             = asn1.ObjectIdentifier{2, 5, 29, 17}
	oidTPMManufacturer = asn1.ObjectIdentifier{2, 23, 133, 2, 1}
	oidTPMModel        = asn1.ObjectIdentifier{2, 23, 133, 2, 2}
	oidTPMVersion      = asn1.ObjectIdentifier{2, 23, 133, 2, 3}
	oidEKCertificateKP = asn1.ObjectIdentifier{2, 23, 133, 8, 1}
)

// TCGSubjectAltName encodes the TCG EK certificate SAN: one directoryName
// holding manufacturer, model and version.
func TCGSubjectAltName(manufacturer, model, version string) ([]byte, error) {
	rdn := pkix.RDNSequence{
		{{Type: oidTPMManufacturer, Value: manufacturer}},
		{{Type: oidTPMModel, Value: model}},
		{{Type: oidTPMVersion, Value: version}},
	}
	name, err := asn1.Marshal(rdn)
	if err != nil {
		return nil, err
	}
	return asn1.Marshal([]asn1.RawValue{{Class: asn1.ClassContextSpecific, Tag: 4, IsCompound: true, Bytes: name}})
}

// IssueEKCertificate issues an EK certificate for ekPub the way TPM
// manufacturers do, with every field the TCG EK Credential Profile asks
// for and the signer requires: empty subject, critical SAN with the TPM
// description, tcg-kp-EKCertificate, key encipherment (RSA) or key
// agreement (ECC), basic constraints with cA false.
func (ca *ManufacturerCA) IssueEKCertificate(ekPub crypto.PublicKey) ([]byte, error) {
	return ca.IssueEKCertificateWith(ekPub, nil)
}

// IssueEKCertificateWith is IssueEKCertificate with the template changed by
// edit before it is signed, for tests of certificates that lack a field.
func (ca *ManufacturerCA) IssueEKCertificateWith(ekPub crypto.PublicKey, edit func(tmpl *x509.Certificate)) ([]byte, error) {
	san, err := TCGSubjectAltName(ca.Manufacturer, ca.Model, ca.Version)
	if err != nil {
		return nil, err
	}
	ku := x509.KeyUsageKeyEncipherment
	if _, ok := ekPub.(*rsa.PublicKey); !ok {
		ku = x509.KeyUsageKeyAgreement
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		NotBefore:             ca.NotBefore,
		NotAfter:              ca.NotAfter,
		KeyUsage:              ku,
		UnknownExtKeyUsage:    []asn1.ObjectIdentifier{oidEKCertificateKP},
		BasicConstraintsValid: true,
		ExtraExtensions:       []pkix.Extension{{Id: oidSAN, Critical: true, Value: san}},
	}
	if edit != nil {
		edit(tmpl)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Intermediate, ekPub, ca.key)
	if err != nil {
		return nil, fmt.Errorf("unable to issue EK certificate: %w", err)
	}
	return der, nil
}
