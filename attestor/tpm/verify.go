package tpm

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/hmac"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"strings"
	"time"

	"github.com/google/go-tpm/tpm2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Deny reasons. Each negative outcome has its own, so a person reading the
// CSR's Denied condition knows what to fix.
const (
	ReasonMalformedEvidence      = "MalformedEvidence"
	ReasonUntrustedEKCertificate = "UntrustedEKCertificate"
	ReasonEKCertificateMismatch  = "EKCertificateMismatch"
	ReasonEKMismatch             = "EKMismatch"
	ReasonEKAttributes           = "EKAttributes"
	ReasonAKAttributes           = "AKAttributes"
	ReasonBadAttestation         = "BadAttestation"
	ReasonBadCertifySignature    = "BadCertifySignature"
	ReasonStaleBinding           = "StaleBinding"
	ReasonCertifyKeyMismatch     = "CertifyKeyMismatch"
	ReasonChallengeNotFound      = "ChallengeNotFound"
	ReasonChallengeNotIssued     = "ChallengeNotIssued"
	ReasonChallengeUsed          = "ChallengeUsed"
	ReasonChallengeExpired       = "ChallengeExpired"
	ReasonRequesterMismatch      = "RequesterMismatch"
	ReasonCSRKeyMismatch         = "CSRKeyMismatch"
	ReasonNodeMismatch           = "NodeMismatch"
	ReasonBadProof               = "BadProof"
)

// DefaultChallengeTTL is how long a challenge is accepted when the
// configuration does not say.
const DefaultChallengeTTL = 10 * time.Minute

// minHMACKey is the shortest controller key accepted.
const minHMACKey = 32

// VerifierConfig configures the signer half.
type VerifierConfig struct {
	// Roots and Intermediates are the manufacturer CA pool: EK
	// certificates must chain to a root through the intermediates. TPMs
	// do not carry their intermediates, so the bundle must. Both may be nil
	// when every Machine's infrastructure reports its EK (the
	// cluster-x-k8s-io/tpm-endorsement-key annotation); an EK certificate
	// is then never trusted. See LoadManufacturerCAs.
	Roots, Intermediates *x509.CertPool
	// HMACKey is the controller key the challenge secret is derived from,
	// shared by all replicas (a Secret on the management cluster). At
	// least 32 bytes.
	HMACKey []byte
	// ChallengeTTL is how long a challenge is accepted; DefaultChallengeTTL
	// when zero.
	ChallengeTTL time.Duration
	// Now is the clock; time.Now when nil.
	Now func() time.Time
	// Rand is the randomness for MakeCredential; crypto/rand when nil.
	Rand io.Reader
}

// Verifier is the signer half of the TPM attestor. It is safe for
// concurrent use.
type Verifier struct {
	roots, intermediates *x509.CertPool
	key                  []byte
	ttl                  time.Duration
	now                  func() time.Time
	rand                 io.Reader
}

var (
	_ attestor.Verifier   = (*Verifier)(nil)
	_ attestor.Challenger = (*Verifier)(nil)
)

// NewVerifier returns a Verifier for cfg.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	var errs []error
	if len(cfg.HMACKey) < minHMACKey {
		errs = append(errs, fmt.Errorf("the controller HMAC key is %d bytes; at least %d are required", len(cfg.HMACKey), minHMACKey))
	}
	if cfg.ChallengeTTL < 0 {
		errs = append(errs, fmt.Errorf("the challenge TTL %s is negative", cfg.ChallengeTTL))
	}
	if cfg.Roots == nil && cfg.Intermediates != nil {
		errs = append(errs, errors.New("manufacturer intermediates are configured without roots"))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	v := &Verifier{
		roots:         cfg.Roots,
		intermediates: cfg.Intermediates,
		key:           bytes.Clone(cfg.HMACKey),
		ttl:           cfg.ChallengeTTL,
		now:           cfg.Now,
		rand:          cfg.Rand,
	}
	if v.ttl == 0 {
		v.ttl = DefaultChallengeTTL
	}
	if v.now == nil {
		v.now = time.Now
	}
	if v.rand == nil {
		v.rand = rand.Reader
	}
	return v, nil
}

// Versions implements attestor.Verifier.
func (*Verifier) Versions() []string { return []string{VersionV1} }

// Verify implements attestor.Verifier. First-round evidence yields a
// Challenge; second-round evidence yields an Identity.
func (v *Verifier) Verify(ctx context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	ev, err := DecodeEvidence(in.Evidence)
	if err != nil {
		return nil, attestor.Deny(ReasonMalformedEvidence, "%v", err)
	}
	if ev.Attestation != nil {
		return v.verifyAttestation(in, ev.Attestation)
	}
	return v.verifyResponse(ctx, in, ev.Response)
}

// attested is what a first-round attestation proved.
type attested struct {
	ekPublic *tpm2.TPMTPublic
	ekSPKI   []byte
	ekHash   [sha256.Size]byte
	akName   []byte
}

func (v *Verifier) verifyAttestation(in *attestor.VerifyRequest, a *Attestation) (*attestor.Result, error) {
	if in.CSR == nil || in.CSRUID == "" {
		return nil, errors.New("tpm verifier needs the parsed CSR and its UID")
	}
	spki := in.CSR.RawSubjectPublicKeyInfo
	if !hmac.Equal(in.Binding, attestor.Binding(spki)) {
		return nil, errors.New("tpm verifier was given a binding that is not the CSR key's")
	}
	at, err := v.checkAttestation(a, in.CSR.PublicKey, in.Binding, in.Annotations, in.MachineAnnotations)
	if err != nil {
		return nil, err
	}
	expires := v.now().Add(v.ttl).UTC().Truncate(time.Second)
	secret := deriveSecret(v.key, in.CSRUID, at.akName, at.ekHash, expires)
	ekKey, err := tpm2.ImportEncapsulationKey(at.ekPublic)
	if err != nil {
		return nil, attestor.Deny(ReasonEKAttributes, "the EK cannot receive a credential: %v", err)
	}
	blob, encSecret, err := tpm2.CreateCredential(v.rand, ekKey, at.akName, secret)
	if err != nil {
		return nil, fmt.Errorf("unable to make the credential challenge: %w", err)
	}
	ch, err := json.Marshal(Challenge{
		Version:         VersionV1,
		CredentialBlob:  blob,
		EncryptedSecret: encSecret,
		Expires:         expires,
	})
	if err != nil {
		return nil, fmt.Errorf("unable to encode the challenge: %w", err)
	}
	return &attestor.Result{Challenge: ch}, nil
}

// checkAttestation verifies a first-round attestation: the EK is trusted,
// the AK is a restricted signing key fixed to the TPM, and the AK certified
// csrKey with qualifyingData = binding.
func (v *Verifier) checkAttestation(a *Attestation, csrKey crypto.PublicKey, binding []byte, csrAnnotations, machineAnnotations map[string]string) (*attested, error) {
	at := &attested{}

	// The EK.
	ekPub, err := decodePublic(a.EKPublic)
	if err != nil {
		return nil, attestor.Deny(ReasonMalformedEvidence, "unable to decode the EK public area: %v", err)
	}
	if err := checkEKAttributes(ekPub); err != nil {
		return nil, attestor.Deny(ReasonEKAttributes, "%v", err)
	}
	ekKey, err := publicKey(ekPub)
	if err != nil {
		return nil, attestor.Deny(ReasonEKAttributes, "unusable EK public key: %v", err)
	}
	at.ekPublic = ekPub
	at.ekSPKI, err = x509.MarshalPKIXPublicKey(ekKey)
	if err != nil {
		return nil, attestor.Deny(ReasonEKAttributes, "unable to encode the EK public key: %v", err)
	}
	at.ekHash = sha256.Sum256(at.ekSPKI)

	var cert *x509.Certificate
	if len(a.EKCertificate) > 0 {
		cert, err = parseEKCertificate(a.EKCertificate)
		if err != nil {
			return nil, attestor.Deny(ReasonUntrustedEKCertificate, "%v", err)
		}
		if !publicKeysEqual(cert.PublicKey, ekKey) {
			return nil, attestor.Deny(ReasonEKCertificateMismatch, "the EK certificate is for another key than the EK public area in the evidence")
		}
	}
	if want, ok := machineAnnotations[attestor.AnnotationEndorsementKey]; ok {
		// The infrastructure knows this machine's EK: it alone decides.
		if err := sameEK(want, ekKey); err != nil {
			return nil, attestor.Deny(ReasonEKMismatch, "the EK in the evidence is not the one the Machine's infrastructure reports (%s): %v", attestor.AnnotationEndorsementKey, err)
		}
		got, ok := csrAnnotations[attestor.AnnotationEndorsementKey]
		if !ok {
			return nil, attestor.Deny(ReasonEKMismatch, "the CSR has no %s annotation", attestor.AnnotationEndorsementKey)
		}
		if err := sameEK(got, ekKey); err != nil {
			return nil, attestor.Deny(ReasonEKMismatch, "the CSR's %s annotation is not the EK in the evidence: %v", attestor.AnnotationEndorsementKey, err)
		}
	} else {
		if cert == nil {
			return nil, attestor.Deny(ReasonUntrustedEKCertificate,
				"the TPM has no EK certificate and the Machine has no %s annotation, so nothing vouches for the EK", attestor.AnnotationEndorsementKey)
		}
		if err := v.verifyEKCertificate(cert); err != nil {
			return nil, attestor.Deny(ReasonUntrustedEKCertificate, "%v", err)
		}
		if got, ok := csrAnnotations[attestor.AnnotationEndorsementKey]; ok {
			if err := sameEK(got, ekKey); err != nil {
				return nil, attestor.Deny(ReasonEKMismatch, "the CSR's %s annotation is not the EK in the evidence: %v", attestor.AnnotationEndorsementKey, err)
			}
		}
	}

	// The AK.
	akPub, err := decodePublic(a.AKPublic)
	if err != nil {
		return nil, attestor.Deny(ReasonMalformedEvidence, "unable to decode the AK public area: %v", err)
	}
	if err := checkAKAttributes(akPub); err != nil {
		return nil, attestor.Deny(ReasonAKAttributes, "%v", err)
	}
	akKey, err := publicKey(akPub)
	if err != nil {
		return nil, attestor.Deny(ReasonAKAttributes, "unusable AK public key: %v", err)
	}
	at.akName, err = objectName(akPub, a.AKPublic)
	if err != nil {
		return nil, attestor.Deny(ReasonAKAttributes, "%v", err)
	}

	// The certification of the CSR key.
	info, err := decodeAttest(a.CertifyInfo)
	if err != nil {
		return nil, attestor.Deny(ReasonBadAttestation, "unable to decode the certification: %v", err)
	}
	if err := verifySignature(akKey, a.CertifyInfo, a.CertifySignature); err != nil {
		return nil, attestor.Deny(ReasonBadCertifySignature, "the certification is not signed by the AK: %v", err)
	}
	if info.Magic != tpm2.TPMGeneratedValue {
		return nil, attestor.Deny(ReasonBadAttestation, "the certification was not generated by a TPM (magic 0x%08x)", uint32(info.Magic))
	}
	if info.Type != tpm2.TPMSTAttestCertify {
		return nil, attestor.Deny(ReasonBadAttestation, "the attestation is of type 0x%04x, not TPM_ST_ATTEST_CERTIFY", uint16(info.Type))
	}
	if !hmac.Equal(info.ExtraData.Buffer, binding) {
		return nil, attestor.Deny(ReasonStaleBinding, "the certification's qualifying data is not the binding of this CSR's key (evidence made for another key or reused)")
	}
	certified, err := info.Attested.Certify()
	if err != nil {
		return nil, attestor.Deny(ReasonBadAttestation, "%v", err)
	}
	ckPub, err := decodePublic(a.CertifiedKey)
	if err != nil {
		return nil, attestor.Deny(ReasonMalformedEvidence, "unable to decode the certified key's public area: %v", err)
	}
	ckKey, err := publicKey(ckPub)
	if err != nil {
		return nil, attestor.Deny(ReasonCertifyKeyMismatch, "unusable certified key: %v", err)
	}
	if !publicKeysEqual(ckKey, csrKey) {
		return nil, attestor.Deny(ReasonCertifyKeyMismatch, "the certified key is not the CSR's key")
	}
	ckName, err := objectName(ckPub, a.CertifiedKey)
	if err != nil {
		return nil, attestor.Deny(ReasonCertifyKeyMismatch, "%v", err)
	}
	if !hmac.Equal(certified.Name.Buffer, ckName) {
		return nil, attestor.Deny(ReasonCertifyKeyMismatch, "the certification names object %x, not the CSR key (%x)", certified.Name.Buffer, ckName)
	}
	return at, nil
}

func (v *Verifier) verifyResponse(ctx context.Context, in *attestor.VerifyRequest, r *Response) (*attestor.Result, error) {
	if in.CSR == nil || in.LookupCSR == nil {
		return nil, errors.New("tpm verifier needs the parsed CSR and LookupCSR for a challenge response")
	}
	if r.CSRName == in.CSRName {
		return nil, attestor.Deny(ReasonMalformedEvidence, "the response names its own CSR as the challenged one")
	}
	rec, err := in.LookupCSR(ctx, r.CSRName)
	if errors.Is(err, attestor.ErrCSRNotFound) {
		return nil, attestor.Deny(ReasonChallengeNotFound, "the challenged CSR %q does not exist (deleted or never filed); file a new first-round CSR", r.CSRName)
	}
	if err != nil {
		return nil, fmt.Errorf("unable to look up the challenged CSR %q: %w", r.CSRName, err)
	}
	if rec.Username != in.Username {
		return nil, attestor.Deny(ReasonRequesterMismatch, "CSR %q was filed by %q, this one by %q", rec.Name, rec.Username, in.Username)
	}
	if rec.Denied && !rec.Approved && !rec.Issued && !in.Approved {
		if ch, err := DecodeChallenge([]byte(rec.Annotations[attestor.AnnotationChallenge])); err == nil && !v.now().Before(ch.Expires) {
			return nil, attestor.Deny(ReasonChallengeExpired, "the challenge on CSR %q expired at %s before it was answered; file a new first-round CSR", rec.Name, ch.Expires.UTC().Format(time.RFC3339))
		}
	}
	// A CSR this signer approved already consumed the challenge (CSR #1
	// was denied ChallengeAnswered before the approval): it verifies again
	// before it is signed.
	if (rec.Denied && !in.Approved) || rec.Approved || rec.Issued {
		return nil, attestor.Deny(ReasonChallengeUsed, "the challenge of CSR %q was already answered or withdrawn (approved=%t denied=%t issued=%t); file a new first-round CSR", rec.Name, rec.Approved, rec.Denied, rec.Issued)
	}
	first, err := attestor.ParseRequest(rec.Request)
	if err != nil {
		return nil, attestor.Deny(ReasonChallengeNotFound, "the challenged CSR %q is not an attested request: %v", rec.Name, err)
	}
	if first.Provider != Name {
		return nil, attestor.Deny(ReasonChallengeNotFound, "the challenged CSR %q is for provider %q, not %q", rec.Name, first.Provider, Name)
	}
	spki := in.CSR.RawSubjectPublicKeyInfo
	if !bytes.Equal(first.CSR.RawSubjectPublicKeyInfo, spki) {
		return nil, attestor.Deny(ReasonCSRKeyMismatch, "this CSR's key is not the key of the challenged CSR %q", rec.Name)
	}
	if first.CSR.Subject.CommonName != in.CSR.Subject.CommonName {
		return nil, attestor.Deny(ReasonNodeMismatch, "the challenged CSR %q is for %q, this one for %q", rec.Name, first.CSR.Subject.CommonName, in.CSR.Subject.CommonName)
	}
	if pid, err := attestor.ProviderIDFromExtensions(first.CSR.Extensions); err != nil || pid != in.ProviderID {
		return nil, attestor.Deny(ReasonNodeMismatch, "the challenged CSR %q does not claim provider ID %q", rec.Name, in.ProviderID)
	}
	raw, ok := rec.Annotations[attestor.AnnotationChallenge]
	if !ok {
		return nil, attestor.Deny(ReasonChallengeNotIssued, "CSR %q carries no challenge; wait for it before answering", rec.Name)
	}
	ch, err := DecodeChallenge([]byte(raw))
	if err != nil {
		return nil, attestor.Deny(ReasonChallengeNotIssued, "CSR %q carries an unreadable challenge: %v", rec.Name, err)
	}
	firstEv, err := DecodeEvidence(first.Evidence)
	if err != nil || firstEv.Attestation == nil {
		return nil, attestor.Deny(ReasonChallengeNotFound, "the challenged CSR %q carries no first-round attestation", rec.Name)
	}
	// Everything the secret depends on is re-derived from CSR #1, whose
	// evidence is verified again: trust decisions may have changed since
	// the challenge was written, and nothing from the node is taken on
	// faith.
	at, err := v.checkAttestation(firstEv.Attestation, first.CSR.PublicKey, attestor.Binding(spki), rec.Annotations, in.MachineAnnotations)
	if err != nil {
		if d, ok := attestor.AsDenial(err); ok {
			return nil, attestor.Deny(d.Reason, "the challenged CSR %q no longer verifies: %s", rec.Name, d.Message)
		}
		return nil, err
	}
	secret := deriveSecret(v.key, rec.UID, at.akName, at.ekHash, ch.Expires)
	if !hmac.Equal(r.Proof, proof(secret, spki, rec.UID)) {
		return nil, attestor.Deny(ReasonBadProof, "the response does not prove possession of the credential challenged on CSR %q", rec.Name)
	}
	if !in.Approved && !v.now().Before(ch.Expires) {
		return nil, attestor.Deny(ReasonChallengeExpired, "the challenge on CSR %q expired at %s; file a new first-round CSR", rec.Name, ch.Expires.UTC().Format(time.RFC3339))
	}
	return &attestor.Result{Answers: rec.Name, Identity: &attestor.Identity{
		ProviderID: in.ProviderID,
		Stable:     StablePrefix + hex.EncodeToString(at.ekHash[:]),
	}}, nil
}

// ChallengeExpiry implements attestor.Challenger.
func (*Verifier) ChallengeExpiry(challenge []byte) (time.Time, error) {
	ch, err := DecodeChallenge(challenge)
	if err != nil {
		return time.Time{}, err
	}
	return ch.Expires, nil
}

// checkEKAttributes requires a restricted decryption key fixed to its TPM:
// the kind of key credential activation needs and manufacturers certify.
func checkEKAttributes(p *tpm2.TPMTPublic) error {
	return checkKeyAttributes(p, false, "the EK is not a restricted decryption key fixed to its TPM")
}

// checkAKAttributes requires a restricted signing key generated in and fixed
// to its TPM: such a key signs only TPM-generated structures.
func checkAKAttributes(p *tpm2.TPMTPublic) error {
	return checkKeyAttributes(p, true, "the AK is not a restricted signing key fixed to its TPM")
}

// checkKeyAttributes requires a restricted key generated in and fixed to
// its TPM that either signs (and does not decrypt) or decrypts (and does
// not sign), with a name algorithm this verifier knows. Every missing
// attribute is reported.
func checkKeyAttributes(p *tpm2.TPMTPublic, sign bool, what string) error {
	a := p.ObjectAttributes
	signWrong, decryptWrong := "sign is set", "decrypt is clear"
	if sign {
		signWrong, decryptWrong = "sign is clear", "decrypt is set"
	}
	var errs []error
	for _, c := range []struct {
		ok   bool
		what string
	}{
		{a.FixedTPM, "fixedTPM is clear"},
		{a.FixedParent, "fixedParent is clear"},
		{a.SensitiveDataOrigin, "sensitiveDataOrigin is clear"},
		{a.Restricted, "restricted is clear"},
		{a.SignEncrypt == sign, signWrong},
		{a.Decrypt != sign, decryptWrong},
	} {
		if !c.ok {
			errs = append(errs, errors.New(c.what))
		}
	}
	if _, err := hashFor(p.NameAlg); err != nil {
		errs = append(errs, fmt.Errorf("name algorithm: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%s: %s", what, strings.ReplaceAll(err.Error(), "\n", "; "))
	}
	return nil
}

// verifySignature checks a TPMT_SIGNATURE by key over msg.
func verifySignature(key crypto.PublicKey, msg, rawSig []byte) error {
	sig, err := decodeSignature(rawSig)
	if err != nil {
		return err
	}
	switch k := key.(type) {
	case *ecdsa.PublicKey:
		if sig.SigAlg != tpm2.TPMAlgECDSA {
			return fmt.Errorf("signature algorithm 0x%04x, want ECDSA", uint16(sig.SigAlg))
		}
		s, err := sig.Signature.ECDSA()
		if err != nil {
			return err
		}
		h, err := hashFor(s.Hash)
		if err != nil {
			return err
		}
		d := h.New()
		d.Write(msg)
		r, ss := new(big.Int).SetBytes(s.SignatureR.Buffer), new(big.Int).SetBytes(s.SignatureS.Buffer)
		if !ecdsa.Verify(k, d.Sum(nil), r, ss) {
			return errors.New("ECDSA signature does not verify")
		}
		return nil
	case *rsa.PublicKey:
		var s *tpm2.TPMSSignatureRSA
		switch sig.SigAlg {
		case tpm2.TPMAlgRSASSA:
			s, err = sig.Signature.RSASSA()
		case tpm2.TPMAlgRSAPSS:
			s, err = sig.Signature.RSAPSS()
		default:
			return fmt.Errorf("signature algorithm 0x%04x, want RSASSA or RSAPSS", uint16(sig.SigAlg))
		}
		if err != nil {
			return err
		}
		h, err := hashFor(s.Hash)
		if err != nil {
			return err
		}
		d := h.New()
		d.Write(msg)
		if sig.SigAlg == tpm2.TPMAlgRSASSA {
			err = rsa.VerifyPKCS1v15(k, h, d.Sum(nil), s.Sig.Buffer)
		} else {
			err = rsa.VerifyPSS(k, h, d.Sum(nil), s.Sig.Buffer, &rsa.PSSOptions{SaltLength: rsa.PSSSaltLengthAuto})
		}
		return err
	}
	return fmt.Errorf("unsupported AK key type %T", key)
}

// sameEK compares a base64 DER SPKI (an annotation) with the EK key.
func sameEK(b64 string, ek crypto.PublicKey) error {
	der, err := base64.StdEncoding.DecodeString(strings.TrimSpace(b64))
	if err != nil {
		return fmt.Errorf("the annotation is not base64: %w", err)
	}
	k, err := x509.ParsePKIXPublicKey(der)
	if err != nil {
		return fmt.Errorf("the annotation is not a DER public key: %w", err)
	}
	if !publicKeysEqual(k, ek) {
		return errors.New("different keys")
	}
	return nil
}

func publicKeysEqual(a, b crypto.PublicKey) bool {
	ak, ok := a.(interface{ Equal(crypto.PublicKey) bool })
	return ok && b != nil && ak.Equal(b)
}

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
