// Package tpm is the TPM attestor: a node proves that its CSR key was
// certified by an attestation key (AK) resident in the same TPM as an
// endorsement key (EK) the signer trusts, by credential activation on every
// issuance.
//
// Both halves live here, as for every provider: attest.go is the node half
// (it talks to a TPM through a transport the caller opens; device opening is
// in the device sub-package, the simulator in tpmsim behind the tpmsimulator
// build tag), verify.go is the signer half (pure Go, no TPM transport, builds
// with CGO_ENABLED=0). types.go is the wire format both sides share.
//
// The protocol takes two CSRs:
//
//  1. CSR #1 carries an Evidence with Attestation: the EK (certificate and
//     public area), the AK public area, and TPM2_Certify of the CSR key by
//     the AK with qualifyingData = attestor.Binding(SPKI).
//  2. The signer verifies it and answers with a Challenge (MakeCredential to
//     the EK, bound to the AK name) that the controller writes into the
//     CSR's challenge annotation. The secret is derived, never stored.
//  3. The node recovers the secret with TPM2_ActivateCredential and files
//     CSR #2 (same key) with an Evidence with Response: the name of CSR #1
//     and proof = HMAC-SHA256(secret, SPKI || UID of CSR #1). The secret
//     itself never appears on the wire.
//  4. The signer re-derives the secret from CSR #1, checks the proof, the
//     expiry, the key and the requester, and returns the identity
//     "tpm:ek-sha256:<hex of SHA-256(DER SPKI of the EK)>".
package tpm

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/big"
	"time"

	"github.com/google/go-tpm/tpm2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Name is the provider name on the wire.
const Name = "tpm"

// VersionV1 is the only evidence and challenge version.
const VersionV1 = "v1"

// StablePrefix prefixes the stable identity: "tpm:ek-sha256:" followed by
// the lower-case hex SHA-256 of the DER SubjectPublicKeyInfo of the EK.
const StablePrefix = "tpm:ek-sha256:"

// Evidence is the TPM attestor's evidence document (the CSR's attestation
// data block). Exactly one of Attestation (first round) and Response
// (second round) is set.
type Evidence struct {
	Version     string       `json:"version"`
	Attestation *Attestation `json:"attestation,omitempty"`
	Response    *Response    `json:"response,omitempty"`
}

// Attestation is the first-round evidence. Byte fields are base64 in JSON;
// TPM structures are in TPM wire format without a size prefix.
type Attestation struct {
	// EKCertificate is the EK certificate as DER, exactly (the node trims
	// NV filler). Empty where the TPM has no EK certificate; the signer then
	// trusts the EK only if the Machine's infrastructure reports it.
	EKCertificate []byte `json:"ekCertificate,omitempty"`
	// EKPublic is the EK's TPMT_PUBLIC. Its key must be the certificate's
	// key; the signer encrypts the challenge to it.
	EKPublic []byte `json:"ekPublic"`
	// AKPublic is the AK's TPMT_PUBLIC: a restricted signing key created
	// in the endorsement hierarchy from a fixed template. Its Name binds
	// the challenge.
	AKPublic []byte `json:"akPublic"`
	// CertifiedKey is the TPMT_PUBLIC under which the node loaded the CSR's
	// public key into the TPM (TPM2_LoadExternal); its Name is what the
	// certification names.
	CertifiedKey []byte `json:"certifiedKey"`
	// CertifyInfo is the TPMS_ATTEST returned by TPM2_Certify of the CSR
	// key by the AK with qualifyingData = attestor.Binding(SPKI).
	CertifyInfo []byte `json:"certifyInfo"`
	// CertifySignature is the AK's TPMT_SIGNATURE over CertifyInfo.
	CertifySignature []byte `json:"certifySignature"`
}

// Response is the second-round evidence: the answer to the challenge
// written on CSR #1.
type Response struct {
	// CSRName names CSR #1, the CSR that was challenged.
	CSRName string `json:"csrName"`
	// Proof is HMAC-SHA256(secret, DER(SPKI of the CSR key) || CSR #1 UID).
	Proof []byte `json:"proof"`
}

// Challenge is the challenge document the signer returns in
// attestor.Result.Challenge and the controller writes, as is, into the
// CSR's kubelet-authenticator.x-k8s.io/challenge annotation.
type Challenge struct {
	Version string `json:"version"`
	// CredentialBlob is the TPM2B_ID_OBJECT contents from MakeCredential.
	CredentialBlob []byte `json:"credentialBlob"`
	// EncryptedSecret is the TPM2B_ENCRYPTED_SECRET contents: the seed
	// encrypted to the EK.
	EncryptedSecret []byte `json:"encryptedSecret"`
	// Expires is when the challenge stops being accepted (whole seconds,
	// UTC). It is part of the secret's derivation.
	Expires time.Time `json:"expires"`
}

// maxField bounds every byte field of the evidence; TPM structures and EK
// certificates are a few kilobytes at most.
const maxField = 8 << 10

// DecodeEvidence parses and bounds an evidence document. It checks shape
// only; verify.go checks meaning.
func DecodeEvidence(data attestor.Evidence) (*Evidence, error) {
	var ev Evidence
	if err := attestor.DecodeEvidence(data, &ev); err != nil {
		return nil, err
	}
	if ev.Version != VersionV1 {
		return nil, fmt.Errorf("unsupported TPM evidence version %q", ev.Version)
	}
	switch {
	case ev.Attestation != nil && ev.Response != nil:
		return nil, errors.New("evidence has both an attestation and a response")
	case ev.Attestation == nil && ev.Response == nil:
		return nil, errors.New("evidence has neither an attestation nor a response")
	case ev.Attestation != nil:
		a := ev.Attestation
		for _, f := range []struct {
			name     string
			b        []byte
			optional bool
		}{
			{"ekCertificate", a.EKCertificate, true},
			{"ekPublic", a.EKPublic, false},
			{"akPublic", a.AKPublic, false},
			{"certifiedKey", a.CertifiedKey, false},
			{"certifyInfo", a.CertifyInfo, false},
			{"certifySignature", a.CertifySignature, false},
		} {
			if len(f.b) == 0 && !f.optional {
				return nil, fmt.Errorf("attestation has no %s", f.name)
			}
			if len(f.b) > maxField {
				return nil, fmt.Errorf("attestation %s is %d bytes, more than %d", f.name, len(f.b), maxField)
			}
		}
	default:
		r := ev.Response
		if r.CSRName == "" || len(r.CSRName) > 253 {
			return nil, errors.New("response must name the challenged CSR")
		}
		if len(r.Proof) != sha256.Size {
			return nil, fmt.Errorf("response proof is %d bytes, want %d", len(r.Proof), sha256.Size)
		}
	}
	return &ev, nil
}

// DecodeChallenge parses a challenge annotation.
func DecodeChallenge(data []byte) (*Challenge, error) {
	var ch Challenge
	if err := attestor.DecodeEvidence(data, &ch); err != nil {
		return nil, fmt.Errorf("unable to decode TPM challenge: %w", err)
	}
	if ch.Version != VersionV1 {
		return nil, fmt.Errorf("unsupported TPM challenge version %q", ch.Version)
	}
	if len(ch.CredentialBlob) == 0 || len(ch.CredentialBlob) > maxField ||
		len(ch.EncryptedSecret) == 0 || len(ch.EncryptedSecret) > maxField {
		return nil, errors.New("TPM challenge has an empty or oversized credential")
	}
	if ch.Expires.IsZero() {
		return nil, errors.New("TPM challenge has no expiry")
	}
	return &ch, nil
}

// EndorsementKeyAnnotation returns the value of the
// cluster-x-k8s-io/tpm-endorsement-key annotation the node writes on a CSR
// that carries first-round evidence: base64 of the DER SubjectPublicKeyInfo
// of the EK. It returns "" for second-round evidence.
func EndorsementKeyAnnotation(data attestor.Evidence) (string, error) {
	ev, err := DecodeEvidence(data)
	if err != nil {
		return "", err
	}
	if ev.Attestation == nil {
		return "", nil
	}
	pub, err := decodePublic(ev.Attestation.EKPublic)
	if err != nil {
		return "", fmt.Errorf("unable to decode EK public area: %w", err)
	}
	key, err := publicKey(pub)
	if err != nil {
		return "", fmt.Errorf("unable to decode EK public key: %w", err)
	}
	der, err := x509.MarshalPKIXPublicKey(key)
	if err != nil {
		return "", fmt.Errorf("unable to encode EK public key: %w", err)
	}
	return base64.StdEncoding.EncodeToString(der), nil
}

// StableIdentity returns "tpm:ek-sha256:<hex>" for an EK's DER SPKI.
func StableIdentity(ekSPKI []byte) string {
	sum := sha256.Sum256(ekSPKI)
	return StablePrefix + hex.EncodeToString(sum[:])
}

// proof computes HMAC-SHA256(secret, spki || csrUID).
func proof(secret, spki []byte, csrUID string) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write(spki)
	m.Write([]byte(csrUID))
	return m.Sum(nil)
}

// secretLabel separates the challenge-secret derivation from any other use
// of the controller key.
const secretLabel = "kubelet-authenticator/tpm/v1 credential\x00"

// deriveSecret computes the challenge secret
// HMAC-SHA256(key, label || csr1.UID || AK name || EK hash || expiry) with
// each variable-length field length-prefixed (uint16) and the expiry as
// big-endian Unix seconds, so that no two inputs encode alike.
func deriveSecret(key []byte, csrUID string, akName []byte, ekHash [sha256.Size]byte, expires time.Time) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(secretLabel))
	var n [8]byte
	binary.BigEndian.PutUint16(n[:2], uint16(len(csrUID)))
	m.Write(n[:2])
	m.Write([]byte(csrUID))
	binary.BigEndian.PutUint16(n[:2], uint16(len(akName)))
	m.Write(n[:2])
	m.Write(akName)
	m.Write(ekHash[:])
	binary.BigEndian.PutUint64(n[:], uint64(expires.Unix()))
	m.Write(n[:])
	return m.Sum(nil)
}

// decodePublic parses a TPMT_PUBLIC and requires that it re-encodes to the
// same bytes, so that the Name the signer computes is the Name the TPM
// computed.
func decodePublic(b []byte) (pub *tpm2.TPMTPublic, err error) {
	defer func() {
		if r := recover(); r != nil {
			pub, err = nil, fmt.Errorf("malformed TPMT_PUBLIC: %v", r)
		}
	}()
	p, err := tpm2.Unmarshal[tpm2.TPMTPublic](b)
	if err != nil {
		return nil, err
	}
	if !bytesEqual(tpm2.Marshal(p), b) {
		return nil, errors.New("TPMT_PUBLIC is not canonically encoded or has trailing data")
	}
	return p, nil
}

// decodeAttest parses a TPMS_ATTEST strictly. Only certifications are
// parsed at all: other attestation types hold TPML lists whose element count
// go-tpm trusts, which would let a few bytes of evidence loop for billions of
// iterations.
func decodeAttest(b []byte) (att *tpm2.TPMSAttest, err error) {
	if len(b) < 6 {
		return nil, errors.New("TPMS_ATTEST is truncated")
	}
	if m := tpm2.TPMGenerated(binary.BigEndian.Uint32(b)); m != tpm2.TPMGeneratedValue {
		return nil, fmt.Errorf("not generated by a TPM (magic 0x%08x)", uint32(m))
	}
	if st := tpm2.TPMST(binary.BigEndian.Uint16(b[4:])); st != tpm2.TPMSTAttestCertify {
		return nil, fmt.Errorf("attestation of type 0x%04x, not TPM_ST_ATTEST_CERTIFY", uint16(st))
	}
	defer func() {
		if r := recover(); r != nil {
			att, err = nil, fmt.Errorf("malformed TPMS_ATTEST: %v", r)
		}
	}()
	a, err := tpm2.Unmarshal[tpm2.TPMSAttest](b)
	if err != nil {
		return nil, err
	}
	if !bytesEqual(tpm2.Marshal(a), b) {
		return nil, errors.New("TPMS_ATTEST is not canonically encoded or has trailing data")
	}
	return a, nil
}

// decodeSignature parses a TPMT_SIGNATURE strictly.
func decodeSignature(b []byte) (sig *tpm2.TPMTSignature, err error) {
	defer func() {
		if r := recover(); r != nil {
			sig, err = nil, fmt.Errorf("malformed TPMT_SIGNATURE: %v", r)
		}
	}()
	s, err := tpm2.Unmarshal[tpm2.TPMTSignature](b)
	if err != nil {
		return nil, err
	}
	if !bytesEqual(tpm2.Marshal(s), b) {
		return nil, errors.New("TPMT_SIGNATURE is not canonically encoded or has trailing data")
	}
	return s, nil
}

// objectName computes the TPM Name of a public area from its exact bytes:
// nameAlg || H_nameAlg(TPMT_PUBLIC).
func objectName(pub *tpm2.TPMTPublic, raw []byte) ([]byte, error) {
	h, err := hashFor(pub.NameAlg)
	if err != nil {
		return nil, fmt.Errorf("unsupported name algorithm: %w", err)
	}
	d := h.New()
	d.Write(raw)
	name := binary.BigEndian.AppendUint16(nil, uint16(pub.NameAlg))
	return d.Sum(name), nil
}

// hashFor maps a TPM hash algorithm to a Go hash, accepting only the ones a
// verifier should trust (no SHA-1).
func hashFor(alg tpm2.TPMAlgID) (crypto.Hash, error) {
	switch alg {
	case tpm2.TPMAlgSHA256:
		return crypto.SHA256, nil
	case tpm2.TPMAlgSHA384:
		return crypto.SHA384, nil
	case tpm2.TPMAlgSHA512:
		return crypto.SHA512, nil
	}
	return 0, fmt.Errorf("hash algorithm 0x%04x is not SHA-256, SHA-384 or SHA-512", uint16(alg))
}

// publicKey converts a TPM RSA or ECC public area to a Go public key,
// checking that an ECC point is on its curve.
func publicKey(pub *tpm2.TPMTPublic) (crypto.PublicKey, error) {
	switch pub.Type {
	case tpm2.TPMAlgRSA:
		parms, err := pub.Parameters.RSADetail()
		if err != nil {
			return nil, err
		}
		n, err := pub.Unique.RSA()
		if err != nil {
			return nil, err
		}
		if int(parms.KeyBits) < 2048 || len(n.Buffer)*8 != int(parms.KeyBits) {
			return nil, fmt.Errorf("RSA key of %d bits (modulus %d bytes); want at least 2048", parms.KeyBits, len(n.Buffer))
		}
		e := int(parms.Exponent)
		if e == 0 {
			e = 65537
		}
		if e < 3 || e%2 == 0 {
			return nil, fmt.Errorf("invalid RSA exponent %d", e)
		}
		return &rsa.PublicKey{N: new(big.Int).SetBytes(n.Buffer), E: e}, nil
	case tpm2.TPMAlgECC:
		parms, err := pub.Parameters.ECCDetail()
		if err != nil {
			return nil, err
		}
		pt, err := pub.Unique.ECC()
		if err != nil {
			return nil, err
		}
		var c elliptic.Curve
		switch parms.CurveID {
		case tpm2.TPMECCNistP256:
			c = elliptic.P256()
		case tpm2.TPMECCNistP384:
			c = elliptic.P384()
		case tpm2.TPMECCNistP521:
			c = elliptic.P521()
		default:
			return nil, fmt.Errorf("unsupported ECC curve 0x%04x", uint16(parms.CurveID))
		}
		size := (c.Params().BitSize + 7) / 8
		if len(pt.X.Buffer) > size || len(pt.Y.Buffer) > size {
			return nil, errors.New("ECC point coordinates are too long for the curve")
		}
		// Uncompressed point encoding, which ecdsa.ParseUncompressedPublicKey
		// validates (on the curve, not the identity).
		enc := make([]byte, 1+2*size)
		enc[0] = 4
		copy(enc[1+size-len(pt.X.Buffer):1+size], pt.X.Buffer)
		copy(enc[1+2*size-len(pt.Y.Buffer):], pt.Y.Buffer)
		k, err := ecdsa.ParseUncompressedPublicKey(c, enc)
		if err != nil {
			return nil, fmt.Errorf("invalid ECC public key: %w", err)
		}
		return k, nil
	}
	return nil, fmt.Errorf("unsupported key type 0x%04x", uint16(pub.Type))
}

// tpmPublicForKey returns the TPMT_PUBLIC under which the node loads the
// CSR key into the TPM to certify it: an unrestricted signing key, nameAlg
// SHA-256, empty auth value, no policy. fixedTPM and fixedParent are clear,
// as TPM2_LoadExternal requires for a key with its private part.
func tpmPublicForKey(key crypto.PublicKey) (*tpm2.TPMTPublic, error) {
	attrs := tpm2.TPMAObject{SignEncrypt: true, UserWithAuth: true, NoDA: true}
	switch k := key.(type) {
	case *ecdsa.PublicKey:
		var curve tpm2.TPMECCCurve
		switch k.Curve {
		case elliptic.P256():
			curve = tpm2.TPMECCNistP256
		case elliptic.P384():
			curve = tpm2.TPMECCNistP384
		default:
			return nil, fmt.Errorf("unsupported ECDSA curve %s", k.Curve.Params().Name)
		}
		enc, err := k.Bytes()
		if err != nil {
			return nil, fmt.Errorf("invalid ECDSA key: %w", err)
		}
		size := (len(enc) - 1) / 2
		return &tpm2.TPMTPublic{
			Type:             tpm2.TPMAlgECC,
			NameAlg:          tpm2.TPMAlgSHA256,
			ObjectAttributes: attrs,
			Parameters: tpm2.NewTPMUPublicParms(tpm2.TPMAlgECC, &tpm2.TPMSECCParms{
				Symmetric: tpm2.TPMTSymDefObject{Algorithm: tpm2.TPMAlgNull},
				Scheme:    tpm2.TPMTECCScheme{Scheme: tpm2.TPMAlgNull},
				CurveID:   curve,
				KDF:       tpm2.TPMTKDFScheme{Scheme: tpm2.TPMAlgNull},
			}),
			Unique: tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{
				X: tpm2.TPM2BECCParameter{Buffer: enc[1 : 1+size]},
				Y: tpm2.TPM2BECCParameter{Buffer: enc[1+size:]},
			}),
		}, nil
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 || k.N.BitLen()%8 != 0 {
			return nil, fmt.Errorf("unsupported RSA key size %d", k.N.BitLen())
		}
		exp := uint32(k.E)
		if k.E == 65537 {
			exp = 0
		}
		return &tpm2.TPMTPublic{
			Type:             tpm2.TPMAlgRSA,
			NameAlg:          tpm2.TPMAlgSHA256,
			ObjectAttributes: attrs,
			Parameters: tpm2.NewTPMUPublicParms(tpm2.TPMAlgRSA, &tpm2.TPMSRSAParms{
				Symmetric: tpm2.TPMTSymDefObject{Algorithm: tpm2.TPMAlgNull},
				Scheme:    tpm2.TPMTRSAScheme{Scheme: tpm2.TPMAlgNull},
				KeyBits:   tpm2.TPMIRSAKeyBits(k.N.BitLen()),
				Exponent:  exp,
			}),
			Unique: tpm2.NewTPMUPublicID(tpm2.TPMAlgRSA, &tpm2.TPM2BPublicKeyRSA{Buffer: k.N.Bytes()}),
		}, nil
	}
	return nil, fmt.Errorf("unsupported CSR key type %T", key)
}

// trimDER returns the leading DER element of b. NV reads return the whole
// NV index, and EK certificate indices are often larger than the
// certificate, padded with 0xFF (erased flash) or 0x00. Only such uniform
// filler is removed; anything else after the certificate is an error.
func trimDER(b []byte) ([]byte, error) {
	n, err := derLength(b)
	if err != nil {
		return nil, err
	}
	rest := b[n:]
	if len(rest) == 0 {
		return b, nil
	}
	fill := rest[0]
	if fill != 0xFF && fill != 0x00 {
		return nil, fmt.Errorf("%d bytes of trailing data after the DER certificate (starting 0x%02x, not 0xFF or 0x00 NV filler)", len(rest), fill)
	}
	for _, c := range rest {
		if c != fill {
			return nil, fmt.Errorf("%d bytes of trailing data after the DER certificate that are not uniform NV filler", len(rest))
		}
	}
	return b[:n], nil
}

// derLength returns the total length of the DER SEQUENCE at the start of b.
func derLength(b []byte) (int, error) {
	if len(b) < 2 || b[0] != 0x30 {
		return 0, errors.New("not a DER SEQUENCE")
	}
	l := int(b[1])
	hdr := 2
	if l&0x80 != 0 {
		nb := l & 0x7f
		if nb == 0 || nb > 3 || len(b) < 2+nb {
			return 0, errors.New("unsupported DER length encoding")
		}
		l = 0
		for _, c := range b[2 : 2+nb] {
			l = l<<8 | int(c)
		}
		hdr += nb
	}
	if hdr+l > len(b) {
		return 0, fmt.Errorf("DER element of %d bytes is truncated to %d", hdr+l, len(b))
	}
	return hdr + l, nil
}

func bytesEqual(a, b []byte) bool { return hmac.Equal(a, b) }
