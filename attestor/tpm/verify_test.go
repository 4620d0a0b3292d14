package tpm

import (
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

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

// attest returns valid first-round evidence for csrKey.
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

func (s *softTPM) resign(t *testing.T, a *Attestation) {
	a.CertifySignature = signECDSA(t, s.akKey, a.CertifyInfo)
}

func evidenceOf(t *testing.T, a *Attestation, r *Response) attestor.Evidence {
	t.Helper()
	b, err := json.Marshal(Evidence{Version: VersionV1, Attestation: a, Response: r})
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

// TestVerifyAttestationDenials covers every first-round refusal, each with
// its own reason.
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

	cases := []struct {
		name    string
		mutate  func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey)
		machine map[string]string
		csrAnn  map[string]string
		cfg     func(*VerifierConfig)
		reason  string
	}{
		{name: "valid", reason: ""},
		{name: "valid with infrastructure EK and no certificate",
			mutate:  func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) { a.EKCertificate = nil },
			machine: map[string]string{attestor.AnnotationEndorsementKey: ekB64},
			csrAnn:  map[string]string{attestor.AnnotationEndorsementKey: ekB64}},
		{name: "certificate from another manufacturer", reason: ReasonUntrustedEKCertificate,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				a.EKCertificate, _ = other.IssueEKCertificate(&soft.ekKey.PublicKey)
			}},
		{name: "no certificate and no infrastructure EK", reason: ReasonUntrustedEKCertificate,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) { a.EKCertificate = nil }},
		{name: "no manufacturer pool", reason: ReasonUntrustedEKCertificate,
			cfg: func(c *VerifierConfig) { c.Roots, c.Intermediates = nil, nil }},
		{name: "expired certificate", reason: ReasonUntrustedEKCertificate,
			cfg: func(c *VerifierConfig) { c.Now = func() time.Time { return testNow.AddDate(20, 0, 0) } }},
		{name: "certificate for another key", reason: ReasonEKCertificateMismatch,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				a.EKCertificate, _ = soft.ca.IssueEKCertificate(&otherKey.PublicKey)
			}},
		{name: "infrastructure reports another EK", reason: ReasonEKMismatch,
			machine: map[string]string{attestor.AnnotationEndorsementKey: spkiB64(t, &otherKey.PublicKey)},
			csrAnn:  map[string]string{attestor.AnnotationEndorsementKey: ekB64}},
		{name: "CSR annotation names another EK", reason: ReasonEKMismatch,
			machine: map[string]string{attestor.AnnotationEndorsementKey: ekB64},
			csrAnn:  map[string]string{attestor.AnnotationEndorsementKey: spkiB64(t, &otherKey.PublicKey)}},
		{name: "CSR annotation missing where infrastructure reports the EK", reason: ReasonEKMismatch,
			machine: map[string]string{attestor.AnnotationEndorsementKey: ekB64}},
		{name: "CSR annotation names another EK than the certified one", reason: ReasonEKMismatch,
			csrAnn: map[string]string{attestor.AnnotationEndorsementKey: spkiB64(t, &otherKey.PublicKey)}},
		{name: "EK not restricted", reason: ReasonEKAttributes,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				tmpl := tpm2.RSAEKTemplate
				tmpl.ObjectAttributes.Restricted = false
				soft2 := *soft
				soft2.setEK(t, tmpl, &soft.ekKey.PublicKey)
				a.EKPublic = soft2.ekRaw
			}},
		{name: "AK not fixedTPM", reason: ReasonAKAttributes,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				soft2 := *soft
				soft2.akPub.ObjectAttributes.FixedTPM = false
				*a = *soft2.attest(t, csrKey)
			}},
		{name: "AK not restricted", reason: ReasonAKAttributes,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				soft2 := *soft
				soft2.akPub.ObjectAttributes.Restricted = false
				*a = *soft2.attest(t, csrKey)
			}},
		{name: "AK can decrypt", reason: ReasonAKAttributes,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				soft2 := *soft
				soft2.akPub.ObjectAttributes.Decrypt = true
				*a = *soft2.attest(t, csrKey)
			}},
		{name: "certification signed by another key", reason: ReasonBadCertifySignature,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				a.CertifySignature = signECDSA(t, newKey(t), a.CertifyInfo)
			}},
		{name: "certification not generated by a TPM", reason: ReasonBadAttestation,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				a.CertifyInfo[0] ^= 0xFF
				soft.resign(t, a)
			}},
		{name: "quote instead of certification", reason: ReasonBadAttestation,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				info, _ := decodeAttest(a.CertifyInfo)
				info.Type = tpm2.TPMSTAttestQuote
				info.Attested = tpm2.NewTPMUAttest(tpm2.TPMSTAttestQuote, &tpm2.TPMSQuoteInfo{})
				a.CertifyInfo = tpm2.Marshal(info)
				soft.resign(t, a)
			}},
		{name: "qualifying data of another key", reason: ReasonStaleBinding,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				info, _ := decodeAttest(a.CertifyInfo)
				spki, _ := x509.MarshalPKIXPublicKey(&newKey(t).PublicKey)
				info.ExtraData.Buffer = attestor.Binding(spki)
				a.CertifyInfo = tpm2.Marshal(info)
				soft.resign(t, a)
			}},
		{name: "certifies another key", reason: ReasonCertifyKeyMismatch,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				ck, _ := tpmPublicForKey(&newKey(t).PublicKey)
				spki, _ := x509.MarshalPKIXPublicKey(&csrKey.PublicKey)
				info := soft.certifyInfo(t, tpm2.Marshal(ck), attestor.Binding(spki))
				a.CertifyInfo = tpm2.Marshal(&info)
				soft.resign(t, a)
			}},
		{name: "certified public area of another key", reason: ReasonCertifyKeyMismatch,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) {
				ck, _ := tpmPublicForKey(&newKey(t).PublicKey)
				a.CertifiedKey = tpm2.Marshal(ck)
			}},
		{name: "certified name of another template", reason: ReasonCertifyKeyMismatch,
			mutate: func(t *testing.T, a *Attestation, csrKey *ecdsa.PrivateKey) {
				ck, _ := tpmPublicForKey(&csrKey.PublicKey)
				ck.ObjectAttributes.Decrypt = true
				a.CertifiedKey = tpm2.Marshal(ck)
			}},
		{name: "trailing bytes in a TPM structure", reason: ReasonMalformedEvidence,
			mutate: func(t *testing.T, a *Attestation, _ *ecdsa.PrivateKey) { a.AKPublic = append(a.AKPublic, 0) }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := VerifierConfig{Roots: roots, Intermediates: inters}
			if c.cfg != nil {
				c.cfg(&cfg)
			}
			v := newTestVerifier(t, cfg)
			key := newKey(t)
			a := soft.attest(t, key)
			if c.mutate != nil {
				c.mutate(t, a, key)
			}
			csrDER, _ := csrFor(t, key, testNode, testProviderID)
			cl := newCluster()
			f := cl.file(t, "csr-1", testBootstrap, csrDER, evidenceOf(t, a, nil))
			f.record.Annotations = c.csrAnn
			res, err := v.Verify(context.Background(), cl.verifyRequest(f, c.machine))
			if c.reason == "" {
				if err != nil {
					t.Fatalf("denied: %v", err)
				}
				if _, err := DecodeChallenge(res.Challenge); err != nil {
					t.Fatalf("challenge: %v", err)
				}
				return
			}
			wantReason(t, err, c.reason)
		})
	}
}

// TestVerifyResponseDenials covers every second-round refusal, and the
// transient error that must not become one.
func TestVerifyResponseDenials(t *testing.T) {
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	ekSPKI, _ := x509.MarshalPKIXPublicKey(&soft.ekKey.PublicKey)

	type env struct {
		clk   *clock
		v     *Verifier
		cl    *cluster
		key   *ecdsa.PrivateKey
		first *filed
		ch    *Challenge
	}
	// setup files CSR #1 and writes the signer's challenge on it.
	setup := func(t *testing.T) *env {
		e := &env{clk: &clock{t: testNow}, cl: newCluster(), key: newKey(t)}
		e.v = newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters, Now: e.clk.Now})
		csrDER, _ := csrFor(t, e.key, testNode, testProviderID)
		e.first = e.cl.file(t, "csr-1", testBootstrap, csrDER, evidenceOf(t, soft.attest(t, e.key), nil))
		res, err := e.v.Verify(context.Background(), e.cl.verifyRequest(e.first, nil))
		if err != nil {
			t.Fatal(err)
		}
		e.first.record.Annotations[attestor.AnnotationChallenge] = string(res.Challenge)
		if e.ch, err = DecodeChallenge(res.Challenge); err != nil {
			t.Fatal(err)
		}
		return e
	}
	// answer files CSR #2 with the proof a TPM holding the EK would give.
	answer := func(t *testing.T, e *env, name, user string, key *ecdsa.PrivateKey, node, csr1 string) *filed {
		csrDER, csr := csrFor(t, key, node, testProviderID)
		secret := deriveSecret(testHMACKey, e.first.record.UID, soft.akName(t), sha256.Sum256(ekSPKI), e.ch.Expires)
		ev := evidenceOf(t, nil, &Response{CSRName: csr1, Proof: proof(secret, csr.RawSubjectPublicKeyInfo, e.first.record.UID)})
		return e.cl.file(t, name, user, csrDER, ev)
	}
	verify := func(e *env, f *filed, machine map[string]string) (*attestor.Result, error) {
		return e.v.Verify(context.Background(), e.cl.verifyRequest(f, machine))
	}

	t.Run("valid", func(t *testing.T) {
		e := setup(t)
		res, err := verify(e, answer(t, e, "csr-2", testBootstrap, e.key, testNode, "csr-1"), nil)
		if err != nil {
			t.Fatal(err)
		}
		if want := StableIdentity(ekSPKI); res.Identity.Stable != want || res.Identity.ProviderID != testProviderID {
			t.Fatalf("identity %+v, want %s for %s", res.Identity, want, testProviderID)
		}
	})
	t.Run("challenged CSR does not exist", func(t *testing.T) {
		e := setup(t)
		_, err := verify(e, answer(t, e, "csr-2", testBootstrap, e.key, testNode, "csr-gone"), nil)
		wantReason(t, err, ReasonChallengeNotFound)
	})
	t.Run("lookup fails transiently", func(t *testing.T) {
		e := setup(t)
		f := answer(t, e, "csr-2", testBootstrap, e.key, testNode, "csr-1")
		e.cl.err = errTransient
		_, err := verify(e, f, nil)
		if _, denied := attestor.AsDenial(err); denied || !errors.Is(err, errTransient) {
			t.Fatalf("got %v, want the transient error, not a denial", err)
		}
	})
	t.Run("another requester", func(t *testing.T) {
		e := setup(t)
		_, err := verify(e, answer(t, e, "csr-2", "system:bootstrap:other", e.key, testNode, "csr-1"), nil)
		wantReason(t, err, ReasonRequesterMismatch)
	})
	t.Run("challenge already answered", func(t *testing.T) {
		e := setup(t)
		f := answer(t, e, "csr-2", testBootstrap, e.key, testNode, "csr-1")
		e.first.record.Denied = true
		_, err := verify(e, f, nil)
		wantReason(t, err, ReasonChallengeUsed)
	})
	t.Run("another key", func(t *testing.T) {
		e := setup(t)
		_, err := verify(e, answer(t, e, "csr-2", testBootstrap, newKey(t), testNode, "csr-1"), nil)
		wantReason(t, err, ReasonCSRKeyMismatch)
	})
	t.Run("another node name", func(t *testing.T) {
		e := setup(t)
		_, err := verify(e, answer(t, e, "csr-2", testBootstrap, e.key, "node-b", "csr-1"), nil)
		wantReason(t, err, ReasonNodeMismatch)
	})
	t.Run("no challenge written yet", func(t *testing.T) {
		e := setup(t)
		delete(e.first.record.Annotations, attestor.AnnotationChallenge)
		_, err := verify(e, answer(t, e, "csr-2", testBootstrap, e.key, testNode, "csr-1"), nil)
		wantReason(t, err, ReasonChallengeNotIssued)
	})
	t.Run("wrong proof", func(t *testing.T) {
		e := setup(t)
		csrDER, _ := csrFor(t, e.key, testNode, testProviderID)
		f := e.cl.file(t, "csr-2", testBootstrap, csrDER, evidenceOf(t, nil, &Response{CSRName: "csr-1", Proof: make([]byte, 32)}))
		_, err := verify(e, f, nil)
		wantReason(t, err, ReasonBadProof)
	})
	t.Run("proof for another challenge expiry", func(t *testing.T) {
		e := setup(t)
		e.ch.Expires = e.ch.Expires.Add(time.Hour)
		_, err := verify(e, answer(t, e, "csr-2", testBootstrap, e.key, testNode, "csr-1"), nil)
		wantReason(t, err, ReasonBadProof)
	})
	t.Run("expired", func(t *testing.T) {
		e := setup(t)
		f := answer(t, e, "csr-2", testBootstrap, e.key, testNode, "csr-1")
		e.clk.Add(DefaultChallengeTTL)
		_, err := verify(e, f, nil)
		wantReason(t, err, ReasonChallengeExpired)
	})
	t.Run("expired, then withdrawn by the signer", func(t *testing.T) {
		e := setup(t)
		f := answer(t, e, "csr-2", testBootstrap, e.key, testNode, "csr-1")
		e.clk.Add(DefaultChallengeTTL)
		e.first.record.Denied = true // the signer denied CSR #1 ChallengeExpired
		_, err := verify(e, f, nil)
		wantReason(t, err, ReasonChallengeExpired)
	})
	t.Run("answer names the challenged CSR, and verifies again once approved", func(t *testing.T) {
		e := setup(t)
		f := answer(t, e, "csr-2", testBootstrap, e.key, testNode, "csr-1")
		res, err := verify(e, f, nil)
		if err != nil || res.Identity == nil {
			t.Fatalf("Verify = %+v, %v", res, err)
		}
		if res.Answers != "csr-1" {
			t.Fatalf("Answers = %q, want csr-1", res.Answers)
		}
		// The signer denied CSR #1 ChallengeAnswered and approved CSR #2,
		// then (after a restart, past the expiry) verifies it again before
		// signing.
		e.first.record.Denied = true
		e.clk.Add(DefaultChallengeTTL)
		req := e.cl.verifyRequest(f, nil)
		req.Approved = true
		if res, err := e.v.Verify(context.Background(), req); err != nil || res.Identity == nil {
			t.Fatalf("approved CSR #2 no longer verifies: %+v, %v", res, err)
		}
		// Not approved: the same answer is a replay.
		_, err = verify(e, f, nil)
		wantReason(t, err, ReasonChallengeExpired)
	})
	t.Run("challenge expiry", func(t *testing.T) {
		e := setup(t)
		got, err := e.v.ChallengeExpiry([]byte(e.first.record.Annotations[attestor.AnnotationChallenge]))
		if err != nil || !got.Equal(e.ch.Expires) {
			t.Fatalf("ChallengeExpiry = %v, %v; want %v", got, err, e.ch.Expires)
		}
		if _, err := e.v.ChallengeExpiry([]byte("{}")); err == nil {
			t.Fatal("ChallengeExpiry accepted a document without a challenge")
		}
	})
	t.Run("response names itself", func(t *testing.T) {
		e := setup(t)
		_, err := verify(e, answer(t, e, "csr-2", testBootstrap, e.key, testNode, "csr-2"), nil)
		wantReason(t, err, ReasonMalformedEvidence)
	})
	t.Run("first round no longer verifies", func(t *testing.T) {
		e := setup(t)
		otherKey := newKey(t)
		machine := map[string]string{attestor.AnnotationEndorsementKey: spkiB64(t, &otherKey.PublicKey)}
		_, err := verify(e, answer(t, e, "csr-2", testBootstrap, e.key, testNode, "csr-1"), machine)
		wantReason(t, err, ReasonEKMismatch)
		if !strings.Contains(err.Error(), "csr-1") {
			t.Errorf("denial %q does not name the challenged CSR", err)
		}
	})
}

func TestVerifyMalformedEvidence(t *testing.T) {
	v := newTestVerifier(t, VerifierConfig{})
	_, csr := csrFor(t, newKey(t), testNode, testProviderID)
	for name, ev := range map[string]string{
		"not JSON":        `nope`,
		"unknown field":   `{"version":"v1","response":{"csrName":"a","proof":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="},"extra":1}`,
		"both rounds":     `{"version":"v1","attestation":{},"response":{}}`,
		"neither":         `{"version":"v1"}`,
		"other version":   `{"version":"v2","response":{"csrName":"a","proof":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}}`,
		"short proof":     `{"version":"v1","response":{"csrName":"a","proof":"AAAA"}}`,
		"empty ekPublic":  `{"version":"v1","attestation":{"akPublic":"AA==","certifiedKey":"AA==","certifyInfo":"AA==","certifySignature":"AA=="}}`,
		"garbage structs": `{"version":"v1","attestation":{"ekPublic":"AA==","akPublic":"AA==","certifiedKey":"AA==","certifyInfo":"AA==","certifySignature":"AA=="}}`,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := v.Verify(context.Background(), &attestor.VerifyRequest{
				Evidence: attestor.Evidence(ev), CSR: csr, CSRUID: "u", Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo),
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
