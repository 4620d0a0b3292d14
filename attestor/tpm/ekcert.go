package tpm

import (
	"bytes"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"strings"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// TCG object identifiers (TCG EK Credential Profile for TPM Family 2.0).
var (
	oidSAN             = asn1.ObjectIdentifier{2, 5, 29, 17}
	oidTPMManufacturer = asn1.ObjectIdentifier{2, 23, 133, 2, 1}
	oidTPMModel        = asn1.ObjectIdentifier{2, 23, 133, 2, 2}
	oidTPMVersion      = asn1.ObjectIdentifier{2, 23, 133, 2, 3}
	oidEKCertificateKP = asn1.ObjectIdentifier{2, 23, 133, 8, 1}
	oidRSAESOAEP       = asn1.ObjectIdentifier{1, 2, 840, 113549, 1, 1, 7}
)

// parseEKCertificate parses an EK certificate as read from NV: DER, with
// trailing 0xFF/0x00 filler removed (NV indices are sized for the largest
// certificate and read back whole). It names the TPM 1.2 certificate forms
// it refuses.
func parseEKCertificate(b []byte) (*x509.Certificate, error) {
	der, err := trimDER(b)
	if err != nil {
		return nil, fmt.Errorf("the EK certificate is not DER: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("unable to parse the EK certificate: %w", err)
	}
	switch cert.SignatureAlgorithm {
	case x509.SHA1WithRSA, x509.ECDSAWithSHA1, x509.DSAWithSHA1, x509.MD5WithRSA, x509.MD2WithRSA:
		return nil, fmt.Errorf("the EK certificate is signed with %s, which is not accepted (a TPM 1.2 certificate? TPM 2.0 is required)", cert.SignatureAlgorithm)
	}
	if cert.PublicKeyAlgorithm == x509.UnknownPublicKeyAlgorithm || cert.PublicKey == nil {
		var spki struct {
			Algorithm pkix.AlgorithmIdentifier
			PublicKey asn1.BitString
		}
		if _, err := asn1.Unmarshal(cert.RawSubjectPublicKeyInfo, &spki); err == nil && spki.Algorithm.Algorithm.Equal(oidRSAESOAEP) {
			return nil, errors.New("the EK certificate's key is an RSAES-OAEP key, the TPM 1.2 EK form; TPM 2.0 is required")
		}
		return nil, errors.New("the EK certificate's public key algorithm is not supported")
	}
	return cert, nil
}

// TPMInfo is the TPM description in a TCG EK certificate's subject
// alternative name.
type TPMInfo struct {
	Manufacturer, Model, Version string
}

// parseTCGSubjectAltName validates a TCG EK certificate SAN: GeneralNames
// holding only directoryName entries, which together name the TPM
// manufacturer ("id:" + 8 hex digits), model and version.
func parseTCGSubjectAltName(value []byte) (*TPMInfo, error) {
	var names []asn1.RawValue
	rest, err := asn1.Unmarshal(value, &names)
	if err != nil {
		return nil, fmt.Errorf("subject alternative name is not valid DER: %w", err)
	}
	if len(rest) != 0 {
		return nil, errors.New("subject alternative name has trailing data")
	}
	if len(names) == 0 {
		return nil, errors.New("subject alternative name is empty")
	}
	info := &TPMInfo{}
	for _, n := range names {
		if n.Class != asn1.ClassContextSpecific || n.Tag != 4 || !n.IsCompound {
			return nil, fmt.Errorf("subject alternative name holds a name of tag [%d], not a TCG directoryName", n.Tag)
		}
		var rdns pkix.RDNSequence
		rest, err := asn1.Unmarshal(n.Bytes, &rdns)
		if err != nil || len(rest) != 0 {
			return nil, errors.New("subject alternative name holds a malformed directoryName")
		}
		for _, rdn := range rdns {
			for _, atv := range rdn {
				s, ok := atv.Value.(string)
				if !ok {
					continue
				}
				switch {
				case atv.Type.Equal(oidTPMManufacturer):
					info.Manufacturer = s
				case atv.Type.Equal(oidTPMModel):
					info.Model = s
				case atv.Type.Equal(oidTPMVersion):
					info.Version = s
				}
			}
		}
	}
	if !validManufacturer(info.Manufacturer) {
		return nil, fmt.Errorf("subject alternative name has no valid TPM manufacturer (got %q, want id:XXXXXXXX)", info.Manufacturer)
	}
	if info.Model == "" || info.Version == "" {
		return nil, errors.New("subject alternative name lacks the TPM model or version")
	}
	return info, nil
}

func validManufacturer(s string) bool {
	h, ok := strings.CutPrefix(s, "id:")
	if !ok || len(h) != 8 {
		return false
	}
	_, err := hex.DecodeString(h)
	return err == nil
}

// verifyEKCertificate verifies an EK certificate against the manufacturer
// pool at v.now(). Full path validation runs; the only thing done by hand is
// the TCG subject alternative name, which Go's x509 leaves unhandled: it is
// parsed and validated here, and only then removed from the unhandled list.
func (v *Verifier) verifyEKCertificate(cert *x509.Certificate) error {
	if err := v.checkEKCertificate(cert); err != nil {
		return attestor.Deny(ReasonUntrustedEKCertificate, "%v", err)
	}
	return nil
}

func (v *Verifier) checkEKCertificate(cert *x509.Certificate) error {
	if v.roots == nil {
		return errors.New("no manufacturer CA pool is configured, so no EK certificate is trusted")
	}
	c := *cert
	c.UnhandledCriticalExtensions = nil
	for _, oid := range cert.UnhandledCriticalExtensions {
		if oid.Equal(oidSAN) {
			var val []byte
			for _, e := range cert.Extensions {
				if e.Id.Equal(oidSAN) {
					val = e.Value
				}
			}
			if _, err := parseTCGSubjectAltName(val); err != nil {
				return fmt.Errorf("the EK certificate's critical %w", err)
			}
			continue
		}
		c.UnhandledCriticalExtensions = append(c.UnhandledCriticalExtensions, oid)
	}
	// TCG: an EK certificate's extended key usage, when present, names
	// tcg-kp-EKCertificate. Key usage, when present, permits the EK's
	// purpose: decrypting (RSA) or key agreement (ECC).
	if len(c.ExtKeyUsage) > 0 || len(c.UnknownExtKeyUsage) > 0 {
		ok := false
		for _, u := range c.UnknownExtKeyUsage {
			ok = ok || u.Equal(oidEKCertificateKP)
		}
		for _, u := range c.ExtKeyUsage {
			ok = ok || u == x509.ExtKeyUsageAny
		}
		if !ok {
			return fmt.Errorf("the certificate's extended key usage does not include tcg-kp-EKCertificate (%s)", oidEKCertificateKP)
		}
	}
	if c.KeyUsage != 0 && c.KeyUsage&(x509.KeyUsageKeyEncipherment|x509.KeyUsageKeyAgreement) == 0 {
		return errors.New("the certificate's key usage allows neither key encipherment nor key agreement: it certifies a signing key, not an endorsement key")
	}
	if c.IsCA {
		return errors.New("the EK certificate is a CA certificate")
	}
	_, err := c.Verify(x509.VerifyOptions{
		Roots:         v.roots,
		Intermediates: v.intermediates,
		CurrentTime:   v.now(),
		// Chain EKUs are checked above for the leaf; manufacturer CAs
		// rarely carry tcg-kp-EKCertificate, so Go's nested EKU check is
		// not applied.
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	})
	if err != nil {
		return fmt.Errorf("the EK certificate (issuer %q) does not chain to the manufacturer CA pool: %w", cert.Issuer.String(), err)
	}
	return nil
}

// LoadManufacturerCAs reads PEM bundles of TPM manufacturer CA certificates
// and splits them into roots (self-signed) and intermediates. Only roots are
// trust anchors; an intermediate is used only to build a path to one. To
// trust only one intermediate of a manufacturer, put it in the roots pool
// yourself.
func LoadManufacturerCAs(bundles ...[]byte) (roots, intermediates *x509.CertPool, err error) {
	roots, intermediates = x509.NewCertPool(), x509.NewCertPool()
	var errs []error
	nroots := 0
	for i, b := range bundles {
		for n := 1; ; n++ {
			var blk *pem.Block
			blk, b = pem.Decode(b)
			if blk == nil {
				break
			}
			if blk.Type != "CERTIFICATE" {
				continue
			}
			c, err := x509.ParseCertificate(blk.Bytes)
			if err != nil {
				errs = append(errs, fmt.Errorf("bundle %d certificate %d: %w", i+1, n, err))
				continue
			}
			if bytes.Equal(c.RawIssuer, c.RawSubject) && c.CheckSignatureFrom(c) == nil {
				roots.AddCert(c)
				nroots++
			} else {
				intermediates.AddCert(c)
			}
		}
	}
	if nroots == 0 {
		errs = append(errs, errors.New("the manufacturer CA bundles hold no self-signed root"))
	}
	return roots, intermediates, errors.Join(errs...)
}
