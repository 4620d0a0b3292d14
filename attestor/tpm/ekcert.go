package tpm

import (
	"bytes"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"slices"
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

// EK certificate profile reasons: an EK certificate that chains to the
// manufacturer pool must also be an EK certificate, as the TCG EK
// Credential Profile for TPM Family 2.0 defines one, issued by CAs allowed
// to issue it. Each names the field that is missing or wrong.
const (
	// ReasonEKCertificateExtKeyUsage: the extended key usage is absent or
	// does not name tcg-kp-EKCertificate (2.23.133.8.1).
	ReasonEKCertificateExtKeyUsage = "EKCertificateExtKeyUsage"
	// ReasonEKCertificateKeyUsage: the key usage is absent or allows
	// neither keyEncipherment nor keyAgreement (a signing key's
	// certificate).
	ReasonEKCertificateKeyUsage = "EKCertificateKeyUsage"
	// ReasonEKCertificateSubjectAltName: there is no TCG subject
	// alternative name naming the TPM's manufacturer, model and version.
	ReasonEKCertificateSubjectAltName = "EKCertificateSubjectAltName"
	// ReasonEKCertificateBasicConstraints: basic constraints are absent,
	// or the certificate is a CA's.
	ReasonEKCertificateBasicConstraints = "EKCertificateBasicConstraints"
	// ReasonEKCertificateChainUsage: a CA certificate on the path to the
	// pool is not a CA's (basic constraints), may not sign certificates
	// (keyCertSign), or has an extended key usage without
	// tcg-kp-EKCertificate.
	ReasonEKCertificateChainUsage = "EKCertificateChainUsage"
)

// profileException is a hierarchy of genuine EK certificates that omit
// fields of the TCG profile, and the fields it may omit. Nothing else is
// excused: key usage and basic constraints are required of every EK
// certificate, and a field that is present must be right.
type profileException struct {
	// name says whose certificates these are, for messages.
	name string
	// caSPKISHA256 pins the hierarchy: a path whose CAs include one of
	// these keys (hex SHA-256 of the DER SubjectPublicKeyInfo) is excused.
	// Pinning keys rather than names means no other CA in the pool can
	// claim the exception by naming itself alike.
	caSPKISHA256 []string
	// omitsExtKeyUsage and omitsSubjectAltName are the fields it omits.
	omitsExtKeyUsage, omitsSubjectAltName bool
}

// profileExceptions are the exceptions allowed. Of the EK certificates of
// the six vendors checked (STMicroelectronics, Nuvoton, Infineon, Intel
// PTT, AMD fTPM, Google Compute Engine vTPM), every one carries
// tcg-kp-EKCertificate, key usage, basic constraints with cA false and a
// critical TCG subject alternative name, except those of Google Cloud's
// newer "EK/AK CA" hierarchy (Google's private CA; Shielded VM EK
// certificates whose subject names the instance): they carry neither the
// TCG extended key usage nor a TCG subject alternative name, so there is no
// TCG manufacturer ID to key the exception on, and it is keyed on the
// hierarchy's keys instead. The same CA issues the vTPM's signing-key
// certificates; their key usage (digitalSignature) still refuses them.
var profileExceptions = []profileException{{
	name: "Google Cloud EK/AK CA",
	caSPKISHA256: []string{
		// CN=EK/AK CA Root, OU=Google Cloud, O=Google LLC (until 2122).
		"56a613f57126a385dd6949294e93b0b566f96ab0573be0c2368e6f5ca779831f",
		// CN=EK/AK CA Intermediate, OU=Google Cloud, O=Google LLC (v3),
		// for a pool that anchors on the intermediate.
		"dd65674415e79258bbaedb6844b5962bc7d24e90ba7d978da5242f29c1633c8e",
	},
	omitsExtKeyUsage:    true,
	omitsSubjectAltName: true,
}}

// exceptionFor returns the exception of a verified path, if any.
func exceptionFor(chain []*x509.Certificate) *profileException {
	for i := range profileExceptions {
		e := &profileExceptions[i]
		for _, c := range chain[1:] {
			sum := sha256.Sum256(c.RawSubjectPublicKeyInfo)
			if slices.Contains(e.caSPKISHA256, hex.EncodeToString(sum[:])) {
				return e
			}
		}
	}
	return nil
}

// verifyEKCertificate verifies an EK certificate against the manufacturer
// pool at v.clock.Now(): full path validation, the TCG EK credential profile of
// the leaf (extended key usage, key usage, subject alternative name, basic
// constraints) and the usages of the CAs on the path. The TCG subject
// alternative name, which Go's x509 leaves unhandled, is parsed and
// validated here, and only then removed from the unhandled list. Every
// failed check is reported, each a denial with its own reason.
func (v *Verifier) verifyEKCertificate(cert *x509.Certificate) error {
	if v.roots == nil {
		return attestor.Deny(ReasonUntrustedEKCertificate, "no manufacturer CA pool is configured, so no EK certificate is trusted")
	}
	var errs []error
	sanErr := checkTCGSubjectAltName(cert)
	c := *cert
	c.UnhandledCriticalExtensions = nil
	for _, oid := range cert.UnhandledCriticalExtensions {
		if oid.Equal(oidSAN) && sanErr == nil {
			continue
		}
		c.UnhandledCriticalExtensions = append(c.UnhandledCriticalExtensions, oid)
	}
	chains, err := c.Verify(x509.VerifyOptions{
		Roots:         v.roots,
		Intermediates: v.intermediates,
		CurrentTime:   v.clock.Now(),
		// Go's nested EKU check knows only its own usages, not
		// tcg-kp-EKCertificate: the leaf's and the CAs' extended key
		// usages are checked below instead.
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	})
	var exc *profileException
	if err != nil {
		what := "does not chain to the manufacturer CA pool"
		if sanErr != nil && slices.ContainsFunc(cert.UnhandledCriticalExtensions, func(o asn1.ObjectIdentifier) bool { return o.Equal(oidSAN) }) {
			what = "cannot be verified: its critical subject alternative name is not a TCG one"
		}
		errs = append(errs, attestor.Deny(ReasonUntrustedEKCertificate, "the EK certificate (issuer %q) %s: %v", cert.Issuer.String(), what, err))
	} else {
		chain, err := chainWithCAUsages(chains)
		if err != nil {
			errs = append(errs, err)
		} else {
			exc = exceptionFor(chain)
		}
	}
	return errors.Join(append(checkEKProfile(cert, sanErr, exc), errs...)...)
}

// checkEKProfile checks the leaf against the TCG EK credential profile,
// excusing what exc allows (nil for none). sanErr is what
// checkTCGSubjectAltName found.
func checkEKProfile(cert *x509.Certificate, sanErr error, exc *profileException) []error {
	var errs []error
	excused := func(omits bool) string {
		if exc != nil && omits {
			return " (" + exc.name + " certificates may omit it, but this one is present and wrong)"
		}
		return ""
	}
	hasEKU := len(cert.ExtKeyUsage) > 0 || len(cert.UnknownExtKeyUsage) > 0
	switch {
	case !hasEKU && exc != nil && exc.omitsExtKeyUsage:
	case !hasEKU:
		errs = append(errs, attestor.Deny(ReasonEKCertificateExtKeyUsage,
			"the EK certificate has no extended key usage; an EK certificate names tcg-kp-EKCertificate (%s)", oidEKCertificateKP))
	case !slices.ContainsFunc(cert.UnknownExtKeyUsage, func(u asn1.ObjectIdentifier) bool { return u.Equal(oidEKCertificateKP) }):
		errs = append(errs, attestor.Deny(ReasonEKCertificateExtKeyUsage, "the certificate's extended key usage does not include tcg-kp-EKCertificate (%s)%s",
			oidEKCertificateKP, excused(exc != nil && exc.omitsExtKeyUsage)))
	}
	switch {
	case cert.KeyUsage == 0:
		errs = append(errs, attestor.Deny(ReasonEKCertificateKeyUsage,
			"the EK certificate has no key usage; an EK certificate allows key encipherment (RSA) or key agreement (ECC)"))
	case cert.KeyUsage&(x509.KeyUsageKeyEncipherment|x509.KeyUsageKeyAgreement) == 0:
		errs = append(errs, attestor.Deny(ReasonEKCertificateKeyUsage,
			"the certificate's key usage allows neither key encipherment nor key agreement: it certifies a signing key, not an endorsement key"))
	}
	switch {
	case errors.Is(sanErr, errNoSubjectAltName) && exc != nil && exc.omitsSubjectAltName:
	case sanErr != nil:
		errs = append(errs, attestor.Deny(ReasonEKCertificateSubjectAltName, "the EK certificate's %v%s", sanErr,
			excused(exc != nil && exc.omitsSubjectAltName && !errors.Is(sanErr, errNoSubjectAltName))))
	}
	switch {
	case !cert.BasicConstraintsValid:
		errs = append(errs, attestor.Deny(ReasonEKCertificateBasicConstraints, "the EK certificate has no basic constraints; an EK certificate says cA is false"))
	case cert.IsCA:
		errs = append(errs, attestor.Deny(ReasonEKCertificateBasicConstraints, "the EK certificate is a CA certificate"))
	}
	return errs
}

// chainWithCAUsages returns the first verified path whose CAs (every
// certificate after the leaf, the trust anchor included) are CAs allowed
// to sign certificates, with an extended key usage, where they have one,
// that allows tcg-kp-EKCertificate. If none is, it reports the first
// path's faults.
func chainWithCAUsages(chains [][]*x509.Certificate) ([]*x509.Certificate, error) {
	var first error
	for _, chain := range chains {
		var errs []string
		for _, ca := range chain[1:] {
			name := ca.Subject.String()
			if name == "" {
				name = fmt.Sprintf("serial %s", ca.SerialNumber)
			}
			if !ca.BasicConstraintsValid || !ca.IsCA {
				errs = append(errs, fmt.Sprintf("CA %q is not a CA certificate (basic constraints)", name))
			}
			if ca.KeyUsage&x509.KeyUsageCertSign == 0 {
				errs = append(errs, fmt.Sprintf("CA %q may not sign certificates (no keyCertSign key usage)", name))
			}
			if (len(ca.ExtKeyUsage) > 0 || len(ca.UnknownExtKeyUsage) > 0) &&
				!slices.Contains(ca.ExtKeyUsage, x509.ExtKeyUsageAny) &&
				!slices.ContainsFunc(ca.UnknownExtKeyUsage, func(u asn1.ObjectIdentifier) bool { return u.Equal(oidEKCertificateKP) }) {
				errs = append(errs, fmt.Sprintf("CA %q has an extended key usage without tcg-kp-EKCertificate (%s)", name, oidEKCertificateKP))
			}
		}
		if len(errs) == 0 {
			return chain, nil
		}
		if first == nil {
			first = attestor.Deny(ReasonEKCertificateChainUsage, "the EK certificate's path to the manufacturer CA pool has CAs not allowed to issue it: %s",
				strings.Join(errs, "; "))
		}
	}
	return nil, first
}

// errNoSubjectAltName is checkTCGSubjectAltName's error for a certificate
// with no subject alternative name at all.
var errNoSubjectAltName = errors.New("subject alternative name is absent; an EK certificate names the TPM manufacturer, model and version in it")

// checkTCGSubjectAltName requires the certificate's subject alternative
// name to be a TCG one (parseTCGSubjectAltName).
func checkTCGSubjectAltName(cert *x509.Certificate) error {
	var val []byte
	n := 0
	for _, e := range cert.Extensions {
		if e.Id.Equal(oidSAN) {
			val = e.Value
			n++
		}
	}
	switch n {
	case 0:
		return errNoSubjectAltName
	case 1:
		_, err := parseTCGSubjectAltName(val)
		return err
	}
	return errors.New("subject alternative name appears more than once")
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
