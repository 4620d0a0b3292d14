// Package tpm is the TPM attestor: a node proves that its CSR key is bound
// to an attestation key (AK) resident in the same TPM as an endorsement key
// (EK) the signer trusts, by credential activation on every issuance.
//
// Both halves live here, as for every provider. The node half is attest.go
// (it talks to a TPM through a transport the caller opens; device opening is
// in the device sub-package, the simulator in tpmsim behind the tpmsimulator
// build tag). The signer half is pure Go, with no TPM transport, and builds
// with CGO_ENABLED=0: verify.go (the Verifier and the EK and AK checks),
// challenge.go (the first round: evidence v1 and v2, and the challenge),
// answer.go (the answer round), ekcert.go (EK certificates and the
// manufacturer CA pool), bootstate.go (replaying the measured-boot event
// log against the quoted PCRs, and the boot state it proves) and policy.go
// (a Cluster's TPMBootPolicy). golden.go and cmd/tpm-boot-policy print the
// policy of an image's boot for the image builder. types.go is the wire
// format both sides share.
//
// The protocol takes two CSRs:
//
//  1. CSR #1 carries an Evidence with an Attestation: the EK (certificate and
//     public area), the AK public area, and, in version v2, a TPM2_Quote by
//     the AK over a PCR selection with qualifyingData =
//     attestor.Binding(SPKI), the PCR values and the measured-boot event
//     log. (Version v1, still verified for older nodes, carries TPM2_Certify
//     of the CSR key instead, which needs the CSR's private key in the TPM.)
//  2. The signer verifies it and answers with a Challenge (MakeCredential to
//     the EK, bound to the AK name) that it writes into the CSR's challenge
//     annotation. The secret is derived, never stored.
//  3. The node recovers the secret with TPM2_ActivateCredential and files
//     CSR #2 (same key) with an Evidence with a Response: the name of CSR #1
//     and proof = HMAC-SHA256(secret, SPKI || UID of CSR #1). The secret
//     itself never appears on the wire.
//  4. The signer finds CSR #1 and checks it is a live, unanswered challenge
//     of the same requester for the same key; the verifier verifies CSR #1's
//     evidence again, re-derives the secret, checks the proof, and returns
//     the identity "tpm:ek-sha256:<hex of SHA-256(DER SPKI of the EK)>".
package tpm

import (
	"bytes"
	"compress/flate"
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
	"io"
	"math/big"
	"time"

	"github.com/google/go-tpm/tpm2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Name is the provider name on the wire.
const Name = "tpm"

// Evidence versions. The node produces VersionV4 (VersionV3 or VersionV2
// for older signers); the signer accepts all four.
const (
	// VersionV1 carries TPM2_Certify of the CSR key (which the node had to
	// load into the TPM with its private part).
	VersionV1 = "v1"
	// VersionV2 carries a TPM2_Quote whose qualifying data is the binding;
	// the CSR's private key never leaves the node process.
	VersionV2 = "v2"
	// VersionV3 has the shape of VersionV2, bound by binding v2: the
	// quote's qualifying data is attestor.ClusterBinding(SPKI, cluster CA),
	// and evidence copied into another cluster does not verify there.
	VersionV3 = "v3"
	// VersionV4 is VersionV3 with the event log deflated (eventLogDeflated,
	// raw DEFLATE): a log compresses to about two thirds, and CSR #1, which
	// the API server stores and sends on every write to it, shrinks with it.
	VersionV4 = "v4"
)

// quotes reports whether evidence of version carries a quote (the v2
// shape: v2, v3 and v4) rather than a certification of the CSR key (v1).
func quotes(version string) bool {
	return version == VersionV2 || version == VersionV3 || version == VersionV4
}

// clusterBound reports whether evidence of version commits to the
// workload cluster's CA (binding v2): v3 and v4.
func clusterBound(version string) bool { return version == VersionV3 || version == VersionV4 }

// freshQuotes reports whether the answer of evidence of version carries
// the fresh quote: v3 and v4.
func freshQuotes(version string) bool { return version == VersionV3 || version == VersionV4 }

// deflatesLog reports whether evidence of version carries its event log
// deflated (eventLogDeflated) rather than as is (eventLog): v4.
func deflatesLog(version string) bool { return version == VersionV4 }

// shape is the version whose fields evidence of version carries: v1, or
// v2 for v2, v3 and v4 (v4's log in its own field).
func shape(version string) string {
	if quotes(version) {
		return VersionV2
	}
	return version
}

// StablePrefix prefixes the stable identity: "tpm:ek-sha256:" followed by
// the lower-case hex SHA-256 of the DER SubjectPublicKeyInfo of the EK.
const StablePrefix = "tpm:ek-sha256:"

// Evidence is the TPM attestor's evidence document (the CSR's attestation
// data block). Exactly one of Attestation (first round) and Response
// (second round) is set. The Response has the same shape in every version.
type Evidence struct {
	Version     string       `json:"version"`
	Attestation *Attestation `json:"attestation,omitempty"`
	Response    *Response    `json:"response,omitempty"`
}

// Attestation is the first-round evidence. Byte fields are base64 (standard
// encoding, padded) in JSON; TPM structures are in TPM wire format without
// a size prefix. EKCertificate, EKPublic and AKPublic are common to every
// version; the other fields belong to one version each, and a field of
// another version is refused.
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

	// v1 only.

	// CertifiedKey is the TPMT_PUBLIC under which the node loaded the CSR's
	// key into the TPM (TPM2_LoadExternal); its Name is what the
	// certification names.
	CertifiedKey []byte `json:"certifiedKey,omitempty"`
	// CertifyInfo is the TPMS_ATTEST returned by TPM2_Certify of the CSR
	// key by the AK with qualifyingData = attestor.Binding(SPKI).
	CertifyInfo []byte `json:"certifyInfo,omitempty"`
	// CertifySignature is the AK's TPMT_SIGNATURE over CertifyInfo.
	CertifySignature []byte `json:"certifySignature,omitempty"`

	// v2 only.

	// Quote is the TPMS_ATTEST returned by TPM2_Quote by the AK with
	// qualifyingData = attestor.Binding(SPKI) over the node's PCR
	// selection.
	Quote []byte `json:"quote,omitempty"`
	// QuoteSignature is the AK's TPMT_SIGNATURE over Quote.
	QuoteSignature []byte `json:"quoteSignature,omitempty"`
	// PCRs are the values of the quoted PCRs, exactly the PCRs the quote
	// selects, in any order.
	PCRs []PCRValue `json:"pcrs,omitempty"`
	// EventLog is the measured-boot event log (TCG PC Client format, as
	// the kernel exposes it in binary_bios_measurements), where the host
	// has one. When present it must replay against the quoted PCRs; the
	// boot state it proves is what a Cluster's boot policy decides on. On
	// the wire in v2 and v3 only; in v4 DecodeEvidence inflates it from
	// EventLogDeflated.
	EventLog []byte `json:"eventLog,omitempty"`

	// v4 only.

	// EventLogDeflated is the event log compressed as raw DEFLATE (RFC
	// 1951, no zlib or gzip framing). It inflates to at most maxEventLog
	// bytes, with no data after the final block.
	EventLogDeflated []byte `json:"eventLogDeflated,omitempty"`
}

// PCRValue is the value of one PCR of one bank.
type PCRValue struct {
	// Bank is the PCR bank: "sha1", "sha256", "sha384" or "sha512".
	Bank string `json:"bank"`
	// Index is the PCR number.
	Index int `json:"index"`
	// Digest is the PCR's value, the bank's digest size.
	Digest []byte `json:"digest"`
}

// Response is the second-round evidence: the answer to the challenge
// written on CSR #1.
type Response struct {
	// CSRName names CSR #1, the CSR that was challenged.
	CSRName string `json:"csrName"`
	// Proof is HMAC-SHA256(secret, DER(SPKI of the CSR key) || CSR #1 UID).
	Proof []byte `json:"proof"`

	// v3 and v4: the fresh quote. A TPM2_Quote by CSR #1's AK over CSR #1's
	// PCR selection, taken after ActivateCredential, with qualifyingData
	// = freshQualifier(secret, SPKI, CSR #1 UID): the PCR values of the
	// boot that answered this challenge. Required where the Cluster's
	// boot policy reads PCRs.
	Quote          []byte     `json:"quote,omitempty"`
	QuoteSignature []byte     `json:"quoteSignature,omitempty"`
	PCRs           []PCRValue `json:"pcrs,omitempty"`
}

// Challenge is the challenge document the signer returns in
// attestor.Result.Challenge.Data and writes, as is, into the CSR's
// kubelet-authenticator.x-k8s.io/challenge annotation. Its version is
// always "v1", whatever the evidence version.
type Challenge struct {
	Version string `json:"version"`
	// CredentialBlob is the TPM2B_ID_OBJECT contents from MakeCredential.
	CredentialBlob []byte `json:"credentialBlob"`
	// EncryptedSecret is the TPM2B_ENCRYPTED_SECRET contents: the seed
	// encrypted to the EK.
	EncryptedSecret []byte `json:"encryptedSecret"`
	// Expires is when the challenge stops being accepted (whole seconds,
	// UTC), the same as attestor.Challenge.Expires. It is part of the
	// secret's derivation.
	Expires time.Time `json:"expires"`
}

// challengeVersion is the version of the Challenge document.
const challengeVersion = "v1"

// Bounds on the evidence. TPM structures and EK certificates are a few
// kilobytes at most; an event log is tens of kilobytes (the largest of
// go-tpm-tools' real logs is 50 KB), and the evidence, with the log in
// base64, must fit in attestor.MaxEvidenceSize.
const (
	maxField    = 8 << 10
	maxEventLog = 96 << 10
	// maxPCRValues is 24 PCRs in each of four banks.
	maxPCRValues = 96
)

// pcrBanks maps bank names on the wire to TPM hash algorithms.
var pcrBanks = map[string]tpm2.TPMAlgID{
	"sha1":   tpm2.TPMAlgSHA1,
	"sha256": tpm2.TPMAlgSHA256,
	"sha384": tpm2.TPMAlgSHA384,
	"sha512": tpm2.TPMAlgSHA512,
}

// bankName returns the wire name of a PCR bank's hash algorithm.
func bankName(alg tpm2.TPMAlgID) (string, bool) {
	for n, a := range pcrBanks {
		if a == alg {
			return n, true
		}
	}
	return "", false
}

// bankHash returns the Go hash of a PCR bank (SHA-1 included: a bank's
// values are data here, never a signature's digest).
func bankHash(alg tpm2.TPMAlgID) (crypto.Hash, bool) {
	switch alg {
	case tpm2.TPMAlgSHA1:
		return crypto.SHA1, true
	case tpm2.TPMAlgSHA256:
		return crypto.SHA256, true
	case tpm2.TPMAlgSHA384:
		return crypto.SHA384, true
	case tpm2.TPMAlgSHA512:
		return crypto.SHA512, true
	}
	return 0, false
}

// DecodeEvidence parses and bounds an evidence document of any version the
// signer accepts. It checks shape only; the verifier checks meaning.
func DecodeEvidence(data attestor.Evidence) (*Evidence, error) {
	var ev Evidence
	if err := attestor.DecodeEvidence(data, &ev); err != nil {
		return nil, err
	}
	if ev.Version != VersionV1 && !quotes(ev.Version) {
		return nil, attestor.Deny(attestor.ReasonUnsupportedEvidenceVersion, "unsupported TPM evidence version %q", ev.Version)
	}
	switch {
	case ev.Attestation != nil && ev.Response != nil:
		return nil, errors.New("evidence has both an attestation and a response")
	case ev.Attestation == nil && ev.Response == nil:
		return nil, errors.New("evidence has neither an attestation nor a response")
	case ev.Attestation != nil:
		if err := checkAttestationShape(ev.Version, ev.Attestation); err != nil {
			return nil, err
		}
		if len(ev.Attestation.EventLogDeflated) > 0 {
			log, err := inflateEventLog(ev.Attestation.EventLogDeflated)
			if err != nil {
				return nil, err
			}
			ev.Attestation.EventLog = log
		}
	default:
		r := ev.Response
		if r.CSRName == "" || len(r.CSRName) > 253 {
			return nil, errors.New("response must name the challenged CSR")
		}
		if len(r.Proof) != sha256.Size {
			return nil, fmt.Errorf("response proof is %d bytes, want %d", len(r.Proof), sha256.Size)
		}
		if err := checkFreshQuoteShape(ev.Version, r); err != nil {
			return nil, err
		}
	}
	return &ev, nil
}

// checkAttestationShape requires the fields of the attestation's version,
// none of another version's, and every field within its bounds.
func checkAttestationShape(version string, a *Attestation) error {
	type field struct {
		name string
		b    []byte
		max  int
		// in is the version the field belongs to; "" for every version.
		in       string
		optional bool
	}
	fields := []field{
		{"ekCertificate", a.EKCertificate, maxField, "", true},
		{"ekPublic", a.EKPublic, maxField, "", false},
		{"akPublic", a.AKPublic, maxField, "", false},
		{"certifiedKey", a.CertifiedKey, maxField, VersionV1, false},
		{"certifyInfo", a.CertifyInfo, maxField, VersionV1, false},
		{"certifySignature", a.CertifySignature, maxField, VersionV1, false},
		{"quote", a.Quote, maxField, VersionV2, false},
		{"quoteSignature", a.QuoteSignature, maxField, VersionV2, false},
		{"eventLog", a.EventLog, maxEventLog, VersionV2, true},
	}
	switch {
	case deflatesLog(version) && a.EventLog != nil:
		return fmt.Errorf("a %s attestation carries its event log in eventLogDeflated, not eventLog", version)
	case !deflatesLog(version) && a.EventLogDeflated != nil:
		return fmt.Errorf("a %s attestation has the %s field eventLogDeflated", version, VersionV4)
	case len(a.EventLogDeflated) > maxEventLog:
		return fmt.Errorf("attestation eventLogDeflated is %d bytes, more than %d", len(a.EventLogDeflated), maxEventLog)
	}
	for _, f := range fields {
		switch {
		case f.in != "" && f.in != shape(version):
			if f.b != nil {
				return fmt.Errorf("a %s attestation has the %s field %s", version, f.in, f.name)
			}
		case len(f.b) == 0 && !f.optional:
			return fmt.Errorf("attestation has no %s", f.name)
		case len(f.b) > f.max:
			return fmt.Errorf("attestation %s is %d bytes, more than %d", f.name, len(f.b), f.max)
		}
	}
	if !quotes(version) {
		if a.PCRs != nil {
			return fmt.Errorf("a %s attestation has the v2 field pcrs", version)
		}
		return nil
	}
	return checkPCRValues(a.PCRs)
}

// checkFreshQuoteShape requires a response's fresh quote to be whole
// (quote and signature together, within bounds) and only in v3 and v4.
func checkFreshQuoteShape(version string, r *Response) error {
	if r.Quote == nil && r.QuoteSignature == nil && r.PCRs == nil {
		return nil
	}
	switch {
	case !freshQuotes(version):
		return fmt.Errorf("a %s response carries the fresh quote of %s and %s", version, VersionV3, VersionV4)
	case len(r.Quote) == 0 || len(r.QuoteSignature) == 0:
		return errors.New("the response's fresh quote needs quote and quoteSignature")
	case len(r.Quote) > maxField || len(r.QuoteSignature) > maxField:
		return fmt.Errorf("the response's fresh quote is more than %d bytes", maxField)
	}
	return checkPCRValues(r.PCRs)
}

// checkPCRValues bounds PCR values: known banks, indices in range, the
// bank's digest size, no PCR twice.
func checkPCRValues(pcrs []PCRValue) error {
	if len(pcrs) > maxPCRValues {
		return fmt.Errorf("%d PCR values, more than %d", len(pcrs), maxPCRValues)
	}
	type pcr struct {
		bank  string
		index int
	}
	seen := map[pcr]bool{}
	for _, p := range pcrs {
		alg, ok := pcrBanks[p.Bank]
		if !ok {
			return fmt.Errorf("PCR value of unknown bank %q (want sha1, sha256, sha384 or sha512)", p.Bank)
		}
		if p.Index < 0 || p.Index >= maxPCRIndex {
			return fmt.Errorf("PCR index %d is out of range 0-%d", p.Index, maxPCRIndex-1)
		}
		h, _ := bankHash(alg)
		if len(p.Digest) != h.Size() {
			return fmt.Errorf("PCR %s:%d is %d bytes, want %d", p.Bank, p.Index, len(p.Digest), h.Size())
		}
		k := pcr{p.Bank, p.Index}
		if seen[k] {
			return fmt.Errorf("PCR %s:%d appears more than once", p.Bank, p.Index)
		}
		seen[k] = true
	}
	return nil
}

// inflateEventLog inflates a v4 event log: raw DEFLATE of at most
// maxEventLog bytes once inflated, one stream with nothing after its final
// block, and not empty (a host without a log leaves the field out).
func inflateEventLog(deflated []byte) ([]byte, error) {
	in := bytes.NewReader(deflated)
	r := flate.NewReader(in)
	log, err := io.ReadAll(io.LimitReader(r, maxEventLog+1))
	switch {
	case err != nil:
		return nil, fmt.Errorf("attestation eventLogDeflated is not raw DEFLATE: %w", err)
	case len(log) > maxEventLog:
		return nil, fmt.Errorf("attestation eventLogDeflated inflates to more than %d bytes", maxEventLog)
	case in.Len() != 0:
		return nil, fmt.Errorf("attestation eventLogDeflated has %d bytes after its final block", in.Len())
	case len(log) == 0:
		return nil, errors.New("attestation eventLogDeflated inflates to an empty log (leave the field out where the host has none)")
	}
	return log, nil
}

// deflateEventLog compresses an event log for v4 evidence. BestSpeed: in
// the node's short-lived process it takes half the time of the default
// level (RHEL 8's log: 1.9 against 4.2 ms) for 3% more bytes.
func deflateEventLog(log []byte) ([]byte, error) {
	var b bytes.Buffer
	w, err := flate.NewWriter(&b, flate.BestSpeed)
	if err != nil {
		return nil, err
	}
	if _, err := w.Write(log); err != nil {
		return nil, err
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// maxPCRIndex bounds PCR numbers: PCR selections are at most four bytes.
const maxPCRIndex = 32

// DecodeChallenge parses a challenge annotation.
func DecodeChallenge(data []byte) (*Challenge, error) {
	var ch Challenge
	if err := attestor.DecodeEvidence(data, &ch); err != nil {
		return nil, fmt.Errorf("unable to decode TPM challenge: %w", err)
	}
	if ch.Version != challengeVersion {
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
// cluster-x-k8s-io/tpm-endorsement-key annotation for a CSR that carries
// first-round evidence: base64 of the DER SubjectPublicKeyInfo of the EK. It
// returns "" for second-round evidence. (The node attestor returns the
// annotation with its evidence; this is for tools and tests that hold only
// the evidence.)
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
	return endorsementKeyAnnotation(pub)
}

// endorsementKeyAnnotation returns base64 of the DER SPKI of an EK.
func endorsementKeyAnnotation(ek *tpm2.TPMTPublic) (string, error) {
	key, err := publicKey(ek)
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

// freshQualifier is the qualifying data of the fresh quote of a response:
// HMAC-SHA256(secret, label || DER(SPKI) || csr1.UID). Only the TPM that
// activated the credential knows it, and only after the challenge; it is
// never the secret, which every reader of the CSR would then know.
func freshQualifier(secret, spki []byte, csrUID string) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(freshQuoteLabel))
	m.Write(spki)
	m.Write([]byte(csrUID))
	return m.Sum(nil)
}

// freshQuoteLabel separates the fresh quote's qualifying data from the
// proof.
const freshQuoteLabel = "kubelet-authenticator/tpm/v3 fresh quote\x00"

// secretLabel separates the challenge-secret derivation from any other use
// of the controller key.
const secretLabel = "kubelet-authenticator/tpm/v2 credential\x00"

// deriveSecret computes the challenge secret
// HMAC-SHA256(key, label || Cluster UID || csr1.UID || AK name || EK hash ||
// expiry) with
// each variable-length field length-prefixed (uint16) and the expiry as
// big-endian Unix seconds, so that no two inputs encode alike.
func deriveSecret(key []byte, clusterUID, csrUID string, akName []byte, ekHash [sha256.Size]byte, expires time.Time) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(secretLabel))
	var n [8]byte
	binary.BigEndian.PutUint16(n[:2], uint16(len(clusterUID)))
	m.Write(n[:2])
	m.Write([]byte(clusterUID))
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

// decodeAttest parses a TPMS_ATTEST of type want (TPM_ST_ATTEST_CERTIFY
// or TPM_ST_ATTEST_QUOTE) strictly: magic and type are checked before
// anything else is parsed, a quote's PCR selection list is bounded before
// go-tpm reads it (it trusts the element count), and the structure must
// re-encode to the same bytes.
func decodeAttest(b []byte, want tpm2.TPMST) (att *tpm2.TPMSAttest, err error) {
	if len(b) < 6 {
		return nil, errors.New("TPMS_ATTEST is truncated")
	}
	if m := tpm2.TPMGenerated(binary.BigEndian.Uint32(b)); m != tpm2.TPMGeneratedValue {
		return nil, fmt.Errorf("not generated by a TPM (magic 0x%08x)", uint32(m))
	}
	if st := tpm2.TPMST(binary.BigEndian.Uint16(b[4:])); st != want {
		return nil, fmt.Errorf("attestation of type 0x%04x, not %s", uint16(st), attestTypeName(want))
	}
	if want == tpm2.TPMSTAttestQuote {
		if err := boundQuoteSelection(b); err != nil {
			return nil, err
		}
	} else if want != tpm2.TPMSTAttestCertify {
		return nil, fmt.Errorf("attestation type 0x%04x is not parsed", uint16(want))
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

func attestTypeName(st tpm2.TPMST) string {
	switch st {
	case tpm2.TPMSTAttestCertify:
		return "TPM_ST_ATTEST_CERTIFY"
	case tpm2.TPMSTAttestQuote:
		return "TPM_ST_ATTEST_QUOTE"
	}
	return fmt.Sprintf("0x%04x", uint16(st))
}

// maxPCRBanks bounds the entries of a quote's PCR selection: one per bank.
const maxPCRBanks = 8

// boundQuoteSelection walks a quote's TPMS_ATTEST up to its PCR selection
// (magic, type, qualifiedSigner, extraData, clockInfo, firmwareVersion)
// and refuses a selection of more than maxPCRBanks entries or of a select
// bitmap wider than maxPCRIndex PCRs.
func boundQuoteSelection(b []byte) error {
	off := 6
	for range 2 { // qualifiedSigner, extraData: TPM2B
		if len(b) < off+2 {
			return errors.New("TPMS_ATTEST is truncated")
		}
		off += 2 + int(binary.BigEndian.Uint16(b[off:]))
	}
	off += 17 + 8 // TPMS_CLOCK_INFO, firmwareVersion
	if len(b) < off+4 {
		return errors.New("TPMS_ATTEST is truncated")
	}
	n := binary.BigEndian.Uint32(b[off:])
	if n > maxPCRBanks {
		return fmt.Errorf("quote selects %d PCR banks, more than %d", n, maxPCRBanks)
	}
	off += 4
	for range n {
		if len(b) < off+3 {
			return errors.New("TPMS_ATTEST is truncated")
		}
		if size := int(b[off+2]); size > maxPCRIndex/8 {
			return fmt.Errorf("quote PCR selection is %d bytes, more than %d", size, maxPCRIndex/8)
		}
		off += 3 + int(b[off+2])
	}
	return nil
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
