package tpm

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/iotest"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/google/go-tpm/tpm2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// softTPM produces first-round evidence in software, with keys the test
// holds, so that every field can be made wrong one at a time. The real TPM
// round trips are in sim_test.go and swtpm_test.go.
type softTPM struct {
	ca     *tpmtest.ManufacturerCA
	ekKey  *rsa.PrivateKey
	ekRaw  []byte
	ekCert []byte
	akKey  *ecdsa.PrivateKey
	akPub  tpm2.TPMTPublic
}

var (
	softOnce sync.Once
	softEK   *rsa.PrivateKey
	softCA   *tpmtest.ManufacturerCA
	softErr  error
)

func newSoftTPM(t *testing.T) *softTPM {
	t.Helper()
	softOnce.Do(func() {
		softEK, softErr = rsa.GenerateKey(rand.Reader, 2048)
		if softErr == nil {
			softCA, softErr = tpmtest.NewManufacturerCA("Soft", testNow.AddDate(-1, 0, 0))
		}
	})
	if softErr != nil {
		t.Fatal(softErr)
	}
	s := &softTPM{ca: softCA, ekKey: softEK, akKey: newKey(t)}
	s.setEK(t, tpm2.RSAEKTemplate, &softEK.PublicKey)
	var err error
	if s.ekCert, err = softCA.IssueEKCertificate(&softEK.PublicKey); err != nil {
		t.Fatal(err)
	}
	s.akPub = akTemplate
	enc, _ := s.akKey.PublicKey.Bytes()
	s.akPub.Unique = tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{
		X: tpm2.TPM2BECCParameter{Buffer: enc[1:33]}, Y: tpm2.TPM2BECCParameter{Buffer: enc[33:]},
	})
	return s
}

func (s *softTPM) setEK(t *testing.T, tmpl tpm2.TPMTPublic, key *rsa.PublicKey) {
	t.Helper()
	tmpl.Unique = tpm2.NewTPMUPublicID(tpm2.TPMAlgRSA, &tpm2.TPM2BPublicKeyRSA{Buffer: key.N.Bytes()})
	s.ekRaw = tpm2.Marshal(&tmpl)
}

func (s *softTPM) akRaw() []byte { return tpm2.Marshal(&s.akPub) }

func (s *softTPM) akName(t *testing.T) []byte {
	n, err := objectName(&s.akPub, s.akRaw())
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// certifyInfo is what TPM2_Certify would return for the key public area ck.
func (s *softTPM) certifyInfo(t *testing.T, ckRaw, extra []byte) tpm2.TPMSAttest {
	ck, err := decodePublic(ckRaw)
	if err != nil {
		t.Fatal(err)
	}
	name, err := objectName(ck, ckRaw)
	if err != nil {
		t.Fatal(err)
	}
	return tpm2.TPMSAttest{
		Magic:           tpm2.TPMGeneratedValue,
		Type:            tpm2.TPMSTAttestCertify,
		QualifiedSigner: tpm2.TPM2BName{Buffer: s.akName(t)},
		ExtraData:       tpm2.TPM2BData{Buffer: extra},
		Attested: tpm2.NewTPMUAttest(tpm2.TPMSTAttestCertify, &tpm2.TPMSCertifyInfo{
			Name: tpm2.TPM2BName{Buffer: name}, QualifiedName: tpm2.TPM2BName{Buffer: name},
		}),
	}
}

func signECDSA(t *testing.T, key *ecdsa.PrivateKey, msg []byte) []byte {
	d := sha256.Sum256(msg)
	r, ss, err := ecdsa.Sign(rand.Reader, key, d[:])
	if err != nil {
		t.Fatal(err)
	}
	return tpm2.Marshal(&tpm2.TPMTSignature{
		SigAlg: tpm2.TPMAlgECDSA,
		Signature: tpm2.NewTPMUSignature(tpm2.TPMAlgECDSA, &tpm2.TPMSSignatureECC{
			Hash:       tpm2.TPMAlgSHA256,
			SignatureR: tpm2.TPM2BECCParameter{Buffer: r.Bytes()},
			SignatureS: tpm2.TPM2BECCParameter{Buffer: ss.Bytes()},
		}),
	})
}

// attest returns valid v1 first-round evidence for csrKey.
func (s *softTPM) attest(t *testing.T, csrKey *ecdsa.PrivateKey) *Attestation {
	t.Helper()
	spki, _ := x509.MarshalPKIXPublicKey(&csrKey.PublicKey)
	ck, err := tpmPublicForKey(&csrKey.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	ckRaw := tpm2.Marshal(ck)
	info := s.certifyInfo(t, ckRaw, attestor.Binding(spki))
	infoRaw := tpm2.Marshal(&info)
	return &Attestation{
		EKCertificate:    s.ekCert,
		EKPublic:         s.ekRaw,
		AKPublic:         s.akRaw(),
		CertifiedKey:     ckRaw,
		CertifyInfo:      infoRaw,
		CertifySignature: signECDSA(t, s.akKey, infoRaw),
	}
}

// softLog is the real measured boot (RHEL 8 on GCE, Secure Boot on) whose
// event log the soft TPM's quote carries and whose PCRs it quotes.
const softLog = "rhel8-uefi.bin"

// softIndices are the PCRs the soft TPM quotes, as a node does by default.
var softIndices = []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}

// bootPCRs are the values of PCRs indices of bank after the boot that
// rawLog records (zero for a PCR it does not extend).
func bootPCRs(tb testing.TB, rawLog []byte, bank string, indices []int) []PCRValue {
	tb.Helper()
	byIndex := map[int][]byte{}
	for _, p := range logPCRs(tb, rawLog, bank) {
		byIndex[p.Index] = p.Digest
	}
	var out []PCRValue
	for _, i := range indices {
		d, ok := byIndex[i]
		if !ok {
			d = make([]byte, pcrBankHashSize(bank))
		}
		out = append(out, PCRValue{Bank: bank, Index: i, Digest: d})
	}
	return out
}

// quote returns valid v2 first-round evidence for csrKey: what TPM2_Quote
// of SHA-256 PCRs 0-9 would return on the machine that booted softLog,
// qualified by the binding, with that log attached.
func (s *softTPM) quote(t *testing.T, csrKey *ecdsa.PrivateKey) *Attestation {
	t.Helper()
	return s.quoteBoot(t, csrKey, realEventLog(t, softLog), "sha256", softIndices)
}

// quoteBoot returns valid v2 first-round evidence for csrKey of the machine
// that booted rawLog: a quote of PCRs indices of bank, qualified by the
// binding, with the log attached (nil for none).
func (s *softTPM) quoteBoot(t *testing.T, csrKey *ecdsa.PrivateKey, rawLog []byte, bank string, indices []int) *Attestation {
	t.Helper()
	spki, _ := x509.MarshalPKIXPublicKey(&csrKey.PublicKey)
	logOf := rawLog
	if logOf == nil {
		logOf = realEventLog(t, softLog)
	}
	pcrs := bootPCRs(t, logOf, bank, indices)
	slices.SortFunc(pcrs, func(a, b PCRValue) int { return a.Index - b.Index })
	d := sha256.New()
	bitmap := make([]byte, 3)
	for _, p := range pcrs {
		d.Write(p.Digest)
		bitmap[p.Index/8] |= 1 << (p.Index % 8)
	}
	info := tpm2.TPMSAttest{
		Magic:           tpm2.TPMGeneratedValue,
		Type:            tpm2.TPMSTAttestQuote,
		QualifiedSigner: tpm2.TPM2BName{Buffer: s.akName(t)},
		ExtraData:       tpm2.TPM2BData{Buffer: attestor.Binding(spki)},
		Attested: tpm2.NewTPMUAttest(tpm2.TPMSTAttestQuote, &tpm2.TPMSQuoteInfo{
			PCRSelect: tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{Hash: pcrBanks[bank], PCRSelect: bitmap}}},
			PCRDigest: tpm2.TPM2BDigest{Buffer: d.Sum(nil)},
		}),
	}
	raw := tpm2.Marshal(&info)
	return &Attestation{
		EKCertificate:  s.ekCert,
		EKPublic:       s.ekRaw,
		AKPublic:       s.akRaw(),
		Quote:          raw,
		QuoteSignature: signECDSA(t, s.akKey, raw),
		PCRs:           pcrs,
		EventLog:       rawLog,
	}
}

// firstRound returns valid first-round evidence of version for csrKey.
func (s *softTPM) firstRound(t *testing.T, version string, csrKey *ecdsa.PrivateKey) *Attestation {
	t.Helper()
	if version == VersionV1 {
		return s.attest(t, csrKey)
	}
	return s.quote(t, csrKey)
}

// resign signs the attestation's certification or quote again with the AK.
func (s *softTPM) resign(t *testing.T, a *Attestation) {
	if a.Quote != nil {
		a.QuoteSignature = signECDSA(t, s.akKey, a.Quote)
		return
	}
	a.CertifySignature = signECDSA(t, s.akKey, a.CertifyInfo)
}

// requote changes the quote's TPMS_ATTEST and signs it again.
func (s *softTPM) requote(t *testing.T, a *Attestation, change func(*tpm2.TPMSAttest)) {
	t.Helper()
	info, err := decodeAttest(a.Quote, tpm2.TPMSTAttestQuote)
	if err != nil {
		t.Fatal(err)
	}
	change(info)
	a.Quote = tpm2.Marshal(info)
	s.resign(t, a)
}

func evidenceOf(t *testing.T, version string, a *Attestation, r *Response) attestor.Evidence {
	t.Helper()
	b, err := json.Marshal(Evidence{Version: version, Attestation: a, Response: r})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func spkiB64(t *testing.T, pub any) string {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return base64.StdEncoding.EncodeToString(der)
}

// TestVerifyAttestationDenials covers every first-round refusal of both
// evidence versions, each with its own reason.
func TestVerifyAttestationDenials(t *testing.T) {
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	other, err := tpmtest.NewManufacturerCA("Other", testNow.AddDate(-1, 0, 0))
	if err != nil {
		t.Fatal(err)
	}
	otherKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	ekB64 := spkiB64(t, &soft.ekKey.PublicKey)
	both := []string{VersionV1, VersionV2}
	v1, v2 := []string{VersionV1}, []string{VersionV2}

	cases := []struct {
		name     string
		versions []string
		mutate   func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey)
		machine  map[string]string
		csrAnn   map[string]string
		cfg      func(*VerifierConfig)
		reason   string
	}{
		{name: "valid", versions: both},
		{name: "valid with infrastructure EK and no certificate", versions: both,
			mutate:  func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) { a.EKCertificate = nil },
			machine: map[string]string{attestor.AnnotationEndorsementKey: ekB64},
			csrAnn:  map[string]string{attestor.AnnotationEndorsementKey: ekB64}},
		{name: "valid without an event log", versions: v2,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) { a.EventLog = nil }},
		{name: "certificate from another manufacturer", versions: both, reason: ReasonUntrustedEKCertificate,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				a.EKCertificate, _ = other.IssueEKCertificate(&soft.ekKey.PublicKey)
			}},
		{name: "no certificate and no infrastructure EK", versions: both, reason: ReasonUntrustedEKCertificate,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) { a.EKCertificate = nil }},
		{name: "no manufacturer pool", versions: v2, reason: ReasonUntrustedEKCertificate,
			cfg: func(c *VerifierConfig) { c.Roots, c.Intermediates = nil, nil }},
		{name: "expired certificate", versions: v2, reason: ReasonUntrustedEKCertificate,
			cfg: func(c *VerifierConfig) { c.Clock = clocktesting.NewFakePassiveClock(testNow.AddDate(20, 0, 0)) }},
		{name: "certificate for another key", versions: both, reason: ReasonEKCertificateMismatch,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				a.EKCertificate, _ = soft.ca.IssueEKCertificate(&otherKey.PublicKey)
			}},
		{name: "infrastructure reports another EK", versions: both, reason: ReasonEKMismatch,
			machine: map[string]string{attestor.AnnotationEndorsementKey: spkiB64(t, &otherKey.PublicKey)},
			csrAnn:  map[string]string{attestor.AnnotationEndorsementKey: ekB64}},
		{name: "CSR annotation names another EK", versions: v2, reason: ReasonEKMismatch,
			machine: map[string]string{attestor.AnnotationEndorsementKey: ekB64},
			csrAnn:  map[string]string{attestor.AnnotationEndorsementKey: spkiB64(t, &otherKey.PublicKey)}},
		{name: "CSR annotation missing where infrastructure reports the EK", versions: v2, reason: ReasonEKMismatch,
			machine: map[string]string{attestor.AnnotationEndorsementKey: ekB64}},
		{name: "CSR annotation names another EK than the certified one", versions: v2, reason: ReasonEKMismatch,
			csrAnn: map[string]string{attestor.AnnotationEndorsementKey: spkiB64(t, &otherKey.PublicKey)}},
		{name: "EK not restricted", versions: both, reason: ReasonEKAttributes,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				tmpl := tpm2.RSAEKTemplate
				tmpl.ObjectAttributes.Restricted = false
				soft2 := *soft
				soft2.setEK(t, tmpl, &soft.ekKey.PublicKey)
				a.EKPublic = soft2.ekRaw
			}},
		{name: "AK not fixedTPM", versions: both, reason: ReasonAKAttributes,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				soft2 := *soft
				soft2.akPub.ObjectAttributes.FixedTPM = false
				*a = *soft2.firstRound(t, versionOf(a), csrKey)
			}},
		{name: "AK not restricted", versions: both, reason: ReasonAKAttributes,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				soft2 := *soft
				soft2.akPub.ObjectAttributes.Restricted = false
				*a = *soft2.firstRound(t, versionOf(a), csrKey)
			}},
		{name: "AK can decrypt", versions: both, reason: ReasonAKAttributes,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				soft2 := *soft
				soft2.akPub.ObjectAttributes.Decrypt = true
				*a = *soft2.firstRound(t, versionOf(a), csrKey)
			}},
		{name: "trailing bytes in a TPM structure", versions: both, reason: attestor.ReasonMalformedEvidence,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) { a.AKPublic = append(a.AKPublic, 0) }},

		// v1: TPM2_Certify of the CSR key.
		{name: "certification signed by another key", versions: v1, reason: ReasonBadCertifySignature,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				a.CertifySignature = signECDSA(t, newKey(t), a.CertifyInfo)
			}},
		{name: "certification not generated by a TPM", versions: v1, reason: ReasonBadAttestation,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				a.CertifyInfo[0] ^= 0xFF
				soft.resign(t, a)
			}},
		{name: "quote instead of certification", versions: v1, reason: ReasonBadAttestation,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				a.CertifyInfo = soft.quote(t, csrKey).Quote
				soft.resign(t, a)
			}},
		{name: "certification qualified by another key's binding", versions: v1, reason: ReasonStaleBinding,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				info, _ := decodeAttest(a.CertifyInfo, tpm2.TPMSTAttestCertify)
				spki, _ := x509.MarshalPKIXPublicKey(&newKey(t).PublicKey)
				info.ExtraData.Buffer = attestor.Binding(spki)
				a.CertifyInfo = tpm2.Marshal(info)
				soft.resign(t, a)
			}},
		{name: "certifies another key", versions: v1, reason: ReasonCertifyKeyMismatch,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				ck, _ := tpmPublicForKey(&newKey(t).PublicKey)
				spki, _ := x509.MarshalPKIXPublicKey(&csrKey.PublicKey)
				info := soft.certifyInfo(t, tpm2.Marshal(ck), attestor.Binding(spki))
				a.CertifyInfo = tpm2.Marshal(&info)
				soft.resign(t, a)
			}},
		{name: "certified public area of another key", versions: v1, reason: ReasonCertifyKeyMismatch,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				ck, _ := tpmPublicForKey(&newKey(t).PublicKey)
				a.CertifiedKey = tpm2.Marshal(ck)
			}},
		{name: "certified name of another template", versions: v1, reason: ReasonCertifyKeyMismatch,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				ck, _ := tpmPublicForKey(&csrKey.PublicKey)
				ck.ObjectAttributes.Decrypt = true
				a.CertifiedKey = tpm2.Marshal(ck)
			}},

		// v2: TPM2_Quote qualified by the binding.
		{name: "quote signed by another key", versions: v2, reason: ReasonBadQuoteSignature,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				a.QuoteSignature = signECDSA(t, newKey(t), a.Quote)
			}},
		{name: "quote signature over other bytes", versions: v2, reason: ReasonBadQuoteSignature,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				a.QuoteSignature = soft.quote(t, newKey(t)).QuoteSignature
			}},
		{name: "quote not generated by a TPM", versions: v2, reason: ReasonBadAttestation,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				a.Quote[0] ^= 0xFF
				soft.resign(t, a)
			}},
		{name: "certification instead of quote", versions: v2, reason: ReasonBadAttestation,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				a.Quote = soft.attest(t, csrKey).CertifyInfo
				soft.resign(t, a)
			}},
		{name: "quote qualified by another key's binding", versions: v2, reason: ReasonStaleBinding,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				spki, _ := x509.MarshalPKIXPublicKey(&newKey(t).PublicKey)
				soft.requote(t, a, func(info *tpm2.TPMSAttest) { info.ExtraData.Buffer = attestor.Binding(spki) })
			}},
		{name: "quote qualified by nothing", versions: v2, reason: ReasonStaleBinding,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				soft.requote(t, a, func(info *tpm2.TPMSAttest) { info.ExtraData.Buffer = nil })
			}},
		{name: "a PCR value that is not the quoted one", versions: v2, reason: ReasonPCRMismatch,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) { a.PCRs[7].Digest[0] ^= 1 }},
		{name: "PCR values in another order are the same values", versions: v2,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				slices.Reverse(a.PCRs)
			}},
		{name: "a quoted PCR without its value", versions: v2, reason: ReasonPCRMismatch,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) { a.PCRs = a.PCRs[:9] }},
		{name: "a PCR value the quote does not cover", versions: v2, reason: ReasonPCRMismatch,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				a.PCRs = append(a.PCRs, PCRValue{Bank: "sha256", Index: 16, Digest: make([]byte, 32)})
			}},
		{name: "values of a PCR the quote does not cover, standing in for a quoted one", versions: v2, reason: ReasonPCRMismatch,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) { a.PCRs[9].Index = 10 }},
		{name: "quote of a smaller selection than the values claim", versions: v2, reason: ReasonPCRMismatch,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				// Only PCR 0 quoted, with the digest of all ten: the
				// evidence's own list must not stand for the selection.
				soft.requote(t, a, func(info *tpm2.TPMSAttest) {
					q, _ := info.Attested.Quote()
					q.PCRSelect = tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{Hash: tpm2.TPMAlgSHA256, PCRSelect: []byte{1, 0, 0}}}}
					info.Attested = tpm2.NewTPMUAttest(tpm2.TPMSTAttestQuote, q)
				})
			}},
		{name: "quote of another bank", versions: v2, reason: ReasonPCRMismatch,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				soft.requote(t, a, func(info *tpm2.TPMSAttest) {
					q, _ := info.Attested.Quote()
					q.PCRSelect.PCRSelections[0].Hash = tpm2.TPMAlgSHA384
					info.Attested = tpm2.NewTPMUAttest(tpm2.TPMSTAttestQuote, q)
				})
			}},
		{name: "a v1 field in v2 evidence", versions: v2, reason: attestor.ReasonMalformedEvidence,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				a.CertifiedKey = soft.attest(t, csrKey).CertifiedKey
			}},
		{name: "EK without a symmetric cipher cannot be challenged", versions: both, reason: ReasonEKUnusable,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				tmpl := tpm2.RSAEKTemplate
				tmpl.Parameters = tpm2.NewTPMUPublicParms(tpm2.TPMAlgRSA, &tpm2.TPMSRSAParms{
					Symmetric: tpm2.TPMTSymDefObject{Algorithm: tpm2.TPMAlgNull},
					Scheme:    tpm2.TPMTRSAScheme{Scheme: tpm2.TPMAlgNull},
					KeyBits:   2048,
				})
				soft2 := *soft
				soft2.setEK(t, tmpl, &soft.ekKey.PublicKey)
				a.EKPublic = soft2.ekRaw
			}},
	}
	for _, c := range cases {
		for _, version := range c.versions {
			t.Run(version+"/"+c.name, func(t *testing.T) {
				cfg := VerifierConfig{Roots: roots, Intermediates: inters}
				if c.cfg != nil {
					c.cfg(&cfg)
				}
				v := newTestVerifier(t, cfg)
				key := newKey(t)
				a := soft.firstRound(t, version, key)
				if c.mutate != nil {
					c.mutate(t, a, key)
				}
				csrDER, _ := csrFor(t, key, testNode, testProviderID)
				e := newEngine(v, c.machine)
				res, err := e.verify(t, e.file(t, "csr-1", csrDER, evidenceOf(t, version, a, nil), c.csrAnn))
				if c.reason == "" {
					if err != nil {
						t.Fatalf("denied: %v", err)
					}
					ch, err := DecodeChallenge(res.Challenge.Data)
					if err != nil {
						t.Fatalf("challenge: %v", err)
					}
					if !ch.Expires.Equal(res.Challenge.Expires) || !ch.Expires.Equal(testNow.Add(DefaultChallengeTTL)) {
						t.Fatalf("challenge expires %v (document %v), want %v", res.Challenge.Expires, ch.Expires, testNow.Add(DefaultChallengeTTL))
					}
					return
				}
				wantReason(t, err, c.reason)
			})
		}
	}
}

// versionOf tells the soft TPM's v1 and v2 attestations apart.
func versionOf(a *Attestation) string {
	if a.Quote != nil {
		return VersionV2
	}
	return VersionV1
}

// TestMakeCredentialTransient: a failing randomness source is the
// signer's problem, retried, never a denial.
func TestMakeCredentialTransient(t *testing.T) {
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters, Rand: iotest.ErrReader(errTransient)})
	key := newKey(t)
	csrDER, _ := csrFor(t, key, testNode, testProviderID)
	e := newEngine(v, nil)
	_, err := e.verify(t, e.file(t, "csr-1", csrDER, evidenceOf(t, VersionV2, soft.quote(t, key), nil), nil))
	if _, denied := attestor.AsDenial(err); denied || !errors.Is(err, errTransient) {
		t.Fatalf("got %v, want the transient error, not a denial", err)
	}
}

var errTransient = errors.New("entropy source unavailable")

// TestVerifyAnswerDenials covers every refusal of an answer, given the
// challenged round the signer found, for both evidence versions of that
// round.
func TestVerifyAnswerDenials(t *testing.T) {
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	ekSPKI, _ := x509.MarshalPKIXPublicKey(&soft.ekKey.PublicKey)

	type env struct {
		e     *engine
		key   *ecdsa.PrivateKey
		first *filed
	}
	// setup files CSR #1 and has the signer challenge it.
	setup := func(t *testing.T, version string) *env {
		v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
		en := &env{e: newEngine(v, nil), key: newKey(t)}
		csrDER, _ := csrFor(t, en.key, testNode, testProviderID)
		en.first = en.e.file(t, "csr-1", csrDER, evidenceOf(t, version, soft.firstRound(t, version, en.key), nil), nil)
		if _, err := en.e.verify(t, en.first); err != nil {
			t.Fatal(err)
		}
		return en
	}
	// answer files CSR #2 with the proof a TPM holding the EK would give.
	answer := func(t *testing.T, en *env, key *ecdsa.PrivateKey, csr1 string) *filed {
		csrDER, csr := csrFor(t, key, testNode, testProviderID)
		secret := deriveSecret(testHMACKey, testClusterUID, en.first.uid, soft.akName(t), sha256.Sum256(ekSPKI), en.first.challenge.Expires)
		ev := evidenceOf(t, VersionV2, nil, &Response{CSRName: csr1, Proof: proof(secret, csr.RawSubjectPublicKeyInfo, en.first.uid)})
		return en.e.file(t, "csr-2", csrDER, ev, nil)
	}

	for _, version := range []string{VersionV1, VersionV2} {
		t.Run(version+"/valid", func(t *testing.T) {
			en := setup(t, version)
			res, err := en.e.verify(t, answer(t, en, en.key, "csr-1"))
			if err != nil {
				t.Fatal(err)
			}
			if want := StableIdentity(ekSPKI); res.Identity.Stable != want || res.Identity.ProviderID != testProviderID {
				t.Fatalf("identity %+v, want %s for %s", res.Identity, want, testProviderID)
			}
		})
		t.Run(version+"/the answer names the challenged CSR", func(t *testing.T) {
			en := setup(t, version)
			res, err := en.e.v.Verify(context.Background(), en.e.request(answer(t, en, en.key, "csr-1")))
			if err != nil || res.Answers != "csr-1" || res.Identity != nil || res.Challenge != nil {
				t.Fatalf("Verify = %+v, %v; want Answers csr-1 and nothing else", res, err)
			}
		})
		t.Run(version+"/another key than the challenged round's", func(t *testing.T) {
			en := setup(t, version)
			_, err := en.e.verify(t, answer(t, en, newKey(t), "csr-1"))
			wantReason(t, err, ReasonStaleBinding)
		})
		t.Run(version+"/wrong proof", func(t *testing.T) {
			en := setup(t, version)
			csrDER, _ := csrFor(t, en.key, testNode, testProviderID)
			f := en.e.file(t, "csr-2", csrDER, evidenceOf(t, VersionV2, nil, &Response{CSRName: "csr-1", Proof: make([]byte, 32)}), nil)
			_, err := en.e.verify(t, f)
			wantReason(t, err, ReasonBadProof)
		})
		t.Run(version+"/proof for another challenge expiry", func(t *testing.T) {
			en := setup(t, version)
			f := answer(t, en, en.key, "csr-1")
			en.first.challenge = &attestor.Challenge{Data: en.first.challenge.Data, Expires: en.first.challenge.Expires.Add(time.Hour), KeyID: en.first.challenge.KeyID}
			_, err := en.e.verify(t, f)
			wantReason(t, err, ReasonBadProof)
		})
		t.Run(version+"/proof for another first round", func(t *testing.T) {
			en := setup(t, version)
			f := answer(t, en, en.key, "csr-1")
			en.first.uid = "uid-other"
			_, err := en.e.verify(t, f)
			wantReason(t, err, ReasonBadProof)
		})
		t.Run(version+"/first round no longer verifies", func(t *testing.T) {
			en := setup(t, version)
			en.e.machine = map[string]string{attestor.AnnotationEndorsementKey: spkiB64(t, &newKey(t).PublicKey)}
			_, err := en.e.verify(t, answer(t, en, en.key, "csr-1"))
			wantReason(t, err, ReasonEKMismatch)
			if !strings.Contains(err.Error(), "csr-1") {
				t.Errorf("denial %q does not name the challenged CSR", err)
			}
		})
	}
	t.Run("the answered round is not a first round", func(t *testing.T) {
		en := setup(t, VersionV2)
		f := answer(t, en, en.key, "csr-1")
		en.first.parsed.Evidence = f.parsed.Evidence
		_, err := en.e.verify(t, f)
		wantReason(t, err, attestor.ReasonChallengeNotFound)
	})
	t.Run("the answered round is another CSR than the response names", func(t *testing.T) {
		en := setup(t, VersionV2)
		f := answer(t, en, en.key, "csr-1")
		req := en.e.request(f)
		req.Answered = en.first.round()
		req.Answered.Name = "csr-0"
		_, err := en.e.v.Verify(context.Background(), req)
		wantReason(t, err, attestor.ReasonChallengeMismatch)
	})
	t.Run("the answered round carries no challenge", func(t *testing.T) {
		en := setup(t, VersionV2)
		f := answer(t, en, en.key, "csr-1")
		en.first.challenge = nil
		_, err := en.e.verify(t, f)
		wantReason(t, err, attestor.ReasonChallengeNotIssued)
	})
	t.Run("the response names its own CSR", func(t *testing.T) {
		en := setup(t, VersionV2)
		f := answer(t, en, en.key, "csr-2")
		_, err := en.e.verify(t, f)
		wantReason(t, err, attestor.ReasonMalformedEvidence)
	})
	t.Run("first-round evidence handed over as an answer", func(t *testing.T) {
		en := setup(t, VersionV2)
		req := en.e.request(en.first)
		req.Answered = en.first.round()
		_, err := en.e.v.Verify(context.Background(), req)
		wantReason(t, err, attestor.ReasonMalformedEvidence)
	})
}

func TestVerifyMalformedEvidence(t *testing.T) {
	v := newTestVerifier(t, VerifierConfig{})
	_, csr := csrFor(t, newKey(t), testNode, testProviderID)
	const z32 = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
	for name, ev := range map[string]string{
		"not JSON":             `nope`,
		"unknown field":        `{"version":"v1","response":{"csrName":"a","proof":"` + z32 + `"},"extra":1}`,
		"both rounds":          `{"version":"v1","attestation":{},"response":{}}`,
		"neither":              `{"version":"v2"}`,
		"other version":        `{"version":"v5","response":{"csrName":"a","proof":"` + z32 + `"}}`,
		"short proof":          `{"version":"v2","response":{"csrName":"a","proof":"AAAA"}}`,
		"empty ekPublic":       `{"version":"v1","attestation":{"akPublic":"AA==","certifiedKey":"AA==","certifyInfo":"AA==","certifySignature":"AA=="}}`,
		"garbage structs":      `{"version":"v1","attestation":{"ekPublic":"AA==","akPublic":"AA==","certifiedKey":"AA==","certifyInfo":"AA==","certifySignature":"AA=="}}`,
		"v2 without a quote":   `{"version":"v2","attestation":{"ekPublic":"AA==","akPublic":"AA==","quoteSignature":"AA=="}}`,
		"v2 with a v1 field":   `{"version":"v2","attestation":{"ekPublic":"AA==","akPublic":"AA==","quote":"AA==","quoteSignature":"AA==","certifyInfo":"AA=="}}`,
		"v1 with PCRs":         `{"version":"v1","attestation":{"ekPublic":"AA==","akPublic":"AA==","certifiedKey":"AA==","certifyInfo":"AA==","certifySignature":"AA==","pcrs":[]}}`,
		"PCR of unknown bank":  `{"version":"v2","attestation":{"ekPublic":"AA==","akPublic":"AA==","quote":"AA==","quoteSignature":"AA==","pcrs":[{"bank":"sm3","index":0,"digest":"` + z32 + `"}]}}`,
		"PCR of wrong size":    `{"version":"v2","attestation":{"ekPublic":"AA==","akPublic":"AA==","quote":"AA==","quoteSignature":"AA==","pcrs":[{"bank":"sha1","index":0,"digest":"` + z32 + `"}]}}`,
		"PCR out of range":     `{"version":"v2","attestation":{"ekPublic":"AA==","akPublic":"AA==","quote":"AA==","quoteSignature":"AA==","pcrs":[{"bank":"sha256","index":32,"digest":"` + z32 + `"}]}}`,
		"PCR twice":            `{"version":"v2","attestation":{"ekPublic":"AA==","akPublic":"AA==","quote":"AA==","quoteSignature":"AA==","pcrs":[{"bank":"sha256","index":1,"digest":"` + z32 + `"},{"bank":"sha256","index":1,"digest":"` + z32 + `"}]}}`,
		"quote of many banks":  `{"version":"v2","attestation":{"ekPublic":"AA==","akPublic":"AA==","quote":"/1RDR4AYAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAD/////","quoteSignature":"AA=="}}`,
		"quote, garbage after": `{"version":"v2","attestation":{"ekPublic":"AA==","akPublic":"AA==","quote":"/1RDR4AYAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA","quoteSignature":"AA=="}}`,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := v.Verify(context.Background(), &attestor.VerifyRequest{
				Evidence: attestor.Evidence(ev), CSR: csr, UID: "u", Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo),
			})
			if err == nil {
				t.Fatal("accepted")
			}
			if _, ok := attestor.AsDenial(err); !ok {
				t.Fatalf("got a transient error %v for bad evidence", err)
			}
		})
	}
}

func TestNewVerifierValidates(t *testing.T) {
	_, err := NewVerifier(VerifierConfig{HMACKey: []byte("short"), ChallengeTTL: -time.Second})
	if err == nil || !strings.Contains(err.Error(), "HMAC key") || !strings.Contains(err.Error(), "negative") {
		t.Fatalf("got %v, want both problems reported", err)
	}
}

func TestTrimDER(t *testing.T) {
	soft := newSoftTPM(t)
	der := soft.ekCert
	for _, c := range []struct {
		name string
		in   []byte
		ok   bool
	}{
		{"exact", der, true},
		{"0xFF filler", append(append([]byte{}, der...), 0xFF, 0xFF, 0xFF), true},
		{"0x00 filler", append(append([]byte{}, der...), 0, 0), true},
		{"mixed filler", append(append([]byte{}, der...), 0xFF, 0x00), false},
		{"other trailing data", append(append([]byte{}, der...), 0x11), false},
		{"truncated", der[:len(der)-1], false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := trimDER(c.in)
			if c.ok != (err == nil) {
				t.Fatalf("err = %v, want ok=%t", err, c.ok)
			}
			if c.ok && string(got) != string(der) {
				t.Fatal("trimmed to the wrong length")
			}
		})
	}
}

func TestNewAttestorValidates(t *testing.T) {
	_, err := New(nil, AttestorConfig{EndorsementKeys: []EKKind{"dsa"}, PCRBank: "md5", PCRs: []int{3, 24, -1}})
	for _, want := range []string{`"dsa"`, `"md5"`, "PCR 24", "PCR -1"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("got %v, want every problem reported (%s)", err, want)
		}
	}
	if _, err := New(nil, AttestorConfig{PCRs: []int{}}); err == nil {
		t.Error("an empty PCR selection was accepted")
	}
	a, err := New(nil, AttestorConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if sel := a.pcrs.PCRSelections; len(sel) != 1 || sel[0].Hash != tpm2.TPMAlgSHA256 || !bytes.Equal(sel[0].PCRSelect, []byte{0xff, 0x03, 0}) || a.eventLog != DefaultEventLogPath {
		t.Errorf("default selection %+v, event log %q; want SHA-256 PCRs 0-9 and %s", sel, a.eventLog, DefaultEventLogPath)
	}
}

// TestLargestEvidenceFits: v2 evidence with the largest event log the node
// attaches still fits in a CSR's spec.request, and is verified.
func TestLargestEvidenceFits(t *testing.T) {
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	key := newKey(t)
	a := soft.quote(t, key)
	a.EventLog = make([]byte, maxEventLog)
	if _, err := rand.Read(a.EventLog); err != nil {
		t.Fatal(err)
	}
	// The longest PCR list a node sends: 24 SHA-512 PCRs.
	csrDER, _ := csrFor(t, key, testNode, testProviderID)
	ev := evidenceOf(t, VersionV2, a, nil)
	for i := range 24 {
		a.PCRs = append(a.PCRs, PCRValue{Bank: "sha512", Index: i, Digest: make([]byte, 64)})
	}
	if _, err := attestor.EncodeRequest(csrDER, Name, evidenceOf(t, VersionV2, a, nil)); err != nil {
		t.Fatalf("the largest evidence does not fit: %v", err)
	}
	// It is read through: random bytes are no event log.
	e := newEngine(newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters}), nil)
	_, err := e.verify(t, e.file(t, "csr-1", csrDER, ev, nil))
	wantReason(t, err, ReasonEventLogMismatch)
	a.EventLog = append(a.EventLog, 0)
	if _, err := DecodeEvidence(evidenceOf(t, VersionV2, a, nil)); err == nil {
		t.Fatal("an event log over the bound was accepted")
	}
}

// TestChallengeTTLShortened: when the signer asks for a shorter challenge
// (a requester with many waiting, a shared bootstrap token), the challenge
// and the document the node reads expire then, not after the verifier's
// own lifetime; a longer one asked for does not lengthen it.
func TestChallengeTTLShortened(t *testing.T) {
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
	for _, tc := range []struct {
		ask, want time.Duration
	}{
		{0, DefaultChallengeTTL},
		{time.Minute, time.Minute},
		{2 * DefaultChallengeTTL, DefaultChallengeTTL},
	} {
		key := newKey(t)
		csrDER, _ := csrFor(t, key, testNode, testProviderID)
		e := newEngine(v, nil)
		req := e.request(e.file(t, "csr-1", csrDER, evidenceOf(t, VersionV2, soft.quote(t, key), nil), nil))
		req.ChallengeTTL = tc.ask
		res, err := v.Verify(context.Background(), req)
		if err != nil || res.Challenge == nil {
			t.Fatalf("asked for %s: %+v, %v; want a challenge", tc.ask, res, err)
		}
		ch, err := DecodeChallenge(res.Challenge.Data)
		if err != nil {
			t.Fatal(err)
		}
		if want := testNow.Add(tc.want); !res.Challenge.Expires.Equal(want) || !ch.Expires.Equal(want) {
			t.Errorf("asked for %s: challenge expires %v (document %v), want %v", tc.ask, res.Challenge.Expires, ch.Expires, want)
		}
	}
}
