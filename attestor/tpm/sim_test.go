//go:build tpmsimulator

package tpm

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// openSim starts the simulator for one test; tests using it run one at a
// time (the simulator is one per process).
func openSim(t *testing.T) transport.TPMCloser {
	t.Helper()
	sim, err := tpmsim.Open()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := sim.Close(); err != nil {
			t.Errorf("closing the simulator: %v", err)
		}
	})
	return sim
}

func simAttestor(t *testing.T, sim transport.TPM) *Attestor {
	t.Helper()
	a, err := NewAttestor(func() (transport.TPMCloser, error) { return tpmsim.NopCloser(sim), nil })
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// TestSimulatorRoundTrip is the conformance round trip against Microsoft's
// reference TPM: EK certificate in NV (with 0xFF filler) chaining to a
// manufacturer CA, AK, certify, credential activation, and no transient
// handle left behind.
func TestSimulatorRoundTrip(t *testing.T) {
	sim := openSim(t)
	ca, err := tpmtest.NewManufacturerCA("Simulated", testNow.AddDate(-1, 0, 0))
	if err != nil {
		t.Fatal(err)
	}
	ekCert, err := tpmsim.Provision(sim, ca, 1600)
	if err != nil {
		t.Fatal(err)
	}
	roots, inters, err := LoadManufacturerCAs(ca.BundlePEM())
	if err != nil {
		t.Fatal(err)
	}
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
	node := simAttestor(t, sim)

	before := transientHandles(t, sim)
	id := roundTrip(t, node, v, nil)
	after := transientHandles(t, sim)
	if !slices.Equal(before, after) || len(after) != 0 {
		t.Errorf("transient handles before %v, after %v: the attestor leaks", before, after)
	}
	spki, err := x509.MarshalPKIXPublicKey(ekCert.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	if want := StableIdentity(spki); id.Stable != want {
		t.Errorf("stable identity %q, want %q (the certified EK)", id.Stable, want)
	}

	// The evidence carries the certificate exactly, without the NV filler,
	// and the AK is the same key every time.
	key := newKey(t)
	_, csr := csrFor(t, key, testNode, testProviderID)
	req := &attestor.Request{Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo}
	var akPubs [][]byte
	for range 2 {
		att, err := node.Attest(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		ev, err := DecodeEvidence(att.Evidence)
		if err != nil {
			t.Fatal(err)
		}
		if ev.Version != VersionV2 || ev.Attestation.Quote == nil || ev.Attestation.CertifyInfo != nil || len(ev.Attestation.PCRs) != len(DefaultPCRs) {
			t.Errorf("evidence %s with %d PCR values, want a v2 quote of the %d default PCRs", ev.Version, len(ev.Attestation.PCRs), len(DefaultPCRs))
		}
		if !bytes.Equal(ev.Attestation.EKCertificate, ekCert.Raw) {
			t.Errorf("evidence EK certificate is %d bytes, want the %d-byte DER", len(ev.Attestation.EKCertificate), len(ekCert.Raw))
		}
		akPubs = append(akPubs, ev.Attestation.AKPublic)
	}
	if !bytes.Equal(akPubs[0], akPubs[1]) {
		t.Error("the AK differs between attestations; it must come from a fixed template")
	}
	if h := transientHandles(t, sim); len(h) != 0 {
		t.Errorf("transient handles left after Attest: %v", h)
	}
}

// TestSimulatorQuoteConfig: the PCR selection and the event log are the
// node's configuration; a host without an event log sends none. The log is
// sent as read, and the verifier replays it: this one (not a log of the
// simulator's boot) is denied.
func TestSimulatorQuoteConfig(t *testing.T) {
	sim := openSim(t)
	open := func() (transport.TPMCloser, error) { return tpmsim.NopCloser(sim), nil }
	dir := t.TempDir()
	logPath := filepath.Join(dir, "binary_bios_measurements")
	eventLog := []byte("\x00\x00\x00\x00an event log as the kernel exposes it")
	if err := os.WriteFile(logPath, eventLog, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name    string
		cfg     AttestorConfig
		pcrs    int
		wantLog []byte
	}{
		{"sha256 PCRs 0, 7 and 16 with an event log", AttestorConfig{PCRs: []int{0, 7, 16}, EventLogPath: logPath}, 3, eventLog},
		{"the sha1 bank", AttestorConfig{PCRBank: "sha1", PCRs: []int{0, 1}, EventLogPath: logPath}, 2, eventLog},
		{"sha256 PCR 16 without an event log", AttestorConfig{PCRs: []int{16}, NoEventLog: true}, 1, nil},
		{"no event log on the host", AttestorConfig{EventLogPath: filepath.Join(dir, "absent")}, len(DefaultPCRs), nil},
		{"event log turned off", AttestorConfig{EventLogPath: logPath, NoEventLog: true}, len(DefaultPCRs), nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			node, err := New(open, c.cfg)
			if err != nil {
				t.Fatal(err)
			}
			key := newKey(t)
			_, csr := csrFor(t, key, testNode, testProviderID)
			att, err := node.Attest(context.Background(), &attestor.Request{Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo})
			if err != nil {
				t.Fatal(err)
			}
			ev, err := DecodeEvidence(att.Evidence)
			if err != nil {
				t.Fatal(err)
			}
			if len(ev.Attestation.PCRs) != c.pcrs || !bytes.Equal(ev.Attestation.EventLog, c.wantLog) {
				t.Fatalf("evidence has %d PCR values and event log %q; want %d and %q", len(ev.Attestation.PCRs), ev.Attestation.EventLog, c.pcrs, c.wantLog)
			}
			ekB64 := att.Annotations[attestor.AnnotationEndorsementKey]
			machine := map[string]string{attestor.AnnotationEndorsementKey: ekB64}
			v := newTestVerifier(t, VerifierConfig{})
			if c.wantLog != nil {
				e := newEngine(v, machine)
				csrDER, _ := csrFor(t, key, testNode, testProviderID)
				_, err := e.verify(t, e.file(t, "csr-1", csrDER, att.Evidence, att.Annotations))
				wantReason(t, err, ReasonEventLogMismatch)
				return
			}
			roundTrip(t, node, v, machine)
		})
	}

}

// TestSimulatorInfrastructureEK covers a TPM without an EK certificate whose
// EK the infrastructure provider reports on the Machine.
func TestSimulatorInfrastructureEK(t *testing.T) {
	sim := openSim(t)
	node := simAttestor(t, sim)
	v := newTestVerifier(t, VerifierConfig{})

	key := newKey(t)
	_, csr := csrFor(t, key, testNode, testProviderID)
	att, err := node.Attest(context.Background(), &attestor.Request{Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo})
	if err != nil {
		t.Fatal(err)
	}
	ekB64 := att.Annotations[attestor.AnnotationEndorsementKey]
	machine := map[string]string{attestor.AnnotationEndorsementKey: ekB64}
	id := roundTrip(t, node, v, machine)
	der, _ := base64.StdEncoding.DecodeString(ekB64)
	if id.Stable != StableIdentity(der) {
		t.Errorf("stable identity %q, want that of the reported EK", id.Stable)
	}

	// Without the Machine's word, an EK with no certificate is not trusted.
	e := newEngine(v, nil)
	csrDER, _ := csrFor(t, key, testNode, testProviderID)
	_, err = e.verify(t, e.file(t, "csr-x", csrDER, att.Evidence, att.Annotations))
	wantReason(t, err, ReasonUntrustedEKCertificate)
}

// TestSimulatorForeignChallenge checks that a challenge not made for this
// TPM's EK and AK cannot be answered, and that a failed activation leaks
// nothing.
func TestSimulatorForeignChallenge(t *testing.T) {
	sim := openSim(t)
	node := simAttestor(t, sim)
	v := newTestVerifier(t, VerifierConfig{})
	key := newKey(t)
	csrDER, csr := csrFor(t, key, testNode, testProviderID)
	req := &attestor.Request{Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo}
	att, err := node.Attest(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	e := newEngine(v, att.Annotations)
	res, err := e.verify(t, e.file(t, "csr-1", csrDER, att.Evidence, att.Annotations))
	if err != nil {
		t.Fatal(err)
	}
	var ch Challenge
	if err := json.Unmarshal(res.Challenge.Data, &ch); err != nil {
		t.Fatal(err)
	}
	ch.CredentialBlob[len(ch.CredentialBlob)-1] ^= 1
	tampered, _ := json.Marshal(ch)
	if _, err := node.Respond(context.Background(), req, &attestor.Challenge{CSRName: "csr-1", CSRUID: "uid-csr-1", Data: tampered}); err == nil {
		t.Fatal("Respond answered a tampered challenge")
	}
	if h := transientHandles(t, sim); len(h) != 0 {
		t.Errorf("transient handles left after a failed activation: %v", h)
	}
}

// attestV1 makes v1 first-round evidence with the simulator, the way nodes
// before v2 did: TPM2_Certify by the AK of the CSR key, loaded into the
// TPM's null hierarchy with its private part, qualified by the binding.
func attestV1(t *testing.T, node *Attestor, key *ecdsa.PrivateKey) *attestor.Attestation {
	t.Helper()
	s, err := node.start()
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := s.finish(); err != nil {
			t.Error(err)
		}
	}()
	ek, cert, err := s.endorsementKey(node.eks)
	if err != nil {
		t.Fatal(err)
	}
	ak, err := s.createPrimary(akTemplate)
	if err != nil {
		t.Fatal(err)
	}
	loadPub, err := tpmPublicForKey(&key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	sensitive, err := tpmSensitiveForKey(key, &key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	ext, err := tpm2.LoadExternal{
		InPrivate: tpm2.New2B(*sensitive),
		InPublic:  tpm2.New2B(*loadPub),
		Hierarchy: tpm2.TPMRHNull,
	}.Execute(s.t)
	if err != nil {
		t.Fatal(err)
	}
	s.track(ext.ObjectHandle)
	spki, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	certified, err := tpm2.Certify{
		ObjectHandle:   tpm2.AuthHandle{Handle: ext.ObjectHandle, Name: ext.Name, Auth: tpm2.PasswordAuth(nil)},
		SignHandle:     ak.auth(tpm2.PasswordAuth(nil)),
		QualifyingData: tpm2.TPM2BData{Buffer: attestor.Binding(spki)},
		InScheme:       tpm2.TPMTSigScheme{Scheme: tpm2.TPMAlgNull},
	}.Execute(s.t)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := json.Marshal(Evidence{Version: VersionV1, Attestation: &Attestation{
		EKCertificate:    cert,
		EKPublic:         ek.raw,
		AKPublic:         ak.raw,
		CertifiedKey:     tpm2.Marshal(loadPub),
		CertifyInfo:      certified.CertifyInfo.Bytes(),
		CertifySignature: tpm2.Marshal(&certified.Signature),
	}})
	if err != nil {
		t.Fatal(err)
	}
	ann, err := endorsementKeyAnnotation(ek.pub)
	if err != nil {
		t.Fatal(err)
	}
	return &attestor.Attestation{Evidence: ev, Version: VersionV1, Annotations: map[string]string{attestor.AnnotationEndorsementKey: ann}}
}

// TestSimulatorV1 is an older node against this signer: v1 evidence (the
// CSR key certified by the AK) is still challenged, and a v1 answer to the
// challenge proves the identity.
func TestSimulatorV1(t *testing.T) {
	sim := openSim(t)
	ca, err := tpmtest.NewManufacturerCA("Simulated", testNow.AddDate(-1, 0, 0))
	if err != nil {
		t.Fatal(err)
	}
	ekCert, err := tpmsim.Provision(sim, ca, 0)
	if err != nil {
		t.Fatal(err)
	}
	roots, inters := ca.Pools()
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
	node := simAttestor(t, sim)
	e := newEngine(v, nil)

	key := newKey(t)
	csr1DER, csr := csrFor(t, key, testNode, testProviderID)
	first := e.file(t, "csr-1", csr1DER, attestV1(t, node, key).Evidence, nil)
	if first.parsed.Version != VersionV1 {
		t.Fatalf("filed version %q", first.parsed.Version)
	}
	res, err := e.verify(t, first)
	if err != nil {
		t.Fatalf("v1 first round: %v", err)
	}
	req := &attestor.Request{Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo}
	att, err := node.Respond(context.Background(), req, &attestor.Challenge{CSRName: first.name, CSRUID: first.uid, Data: res.Challenge.Data})
	if err != nil {
		t.Fatal(err)
	}
	// An older node answers in v1: the response has the same shape.
	var resp Evidence
	if err := json.Unmarshal(att.Evidence, &resp); err != nil {
		t.Fatal(err)
	}
	resp.Version = VersionV1
	v1Answer, _ := json.Marshal(resp)
	csr2DER, _ := csrFor(t, key, testNode, testProviderID)
	res2, err := e.verify(t, e.file(t, "csr-2", csr2DER, v1Answer, nil))
	if err != nil {
		t.Fatalf("v1 answer: %v", err)
	}
	spki, _ := x509.MarshalPKIXPublicKey(ekCert.PublicKey)
	if res2.Identity == nil || res2.Identity.Stable != StableIdentity(spki) {
		t.Fatalf("v1 answer gave %+v, want the identity of the certified EK", res2)
	}
	if h := transientHandles(t, sim); len(h) != 0 {
		t.Errorf("transient handles left: %v", h)
	}
}

// rotatingKeys is a challenge key set the test rotates: the current key
// first, then the retired ones still kept.
type rotatingKeys struct {
	ids  []string
	keys map[string][]byte
}

func (k *rotatingKeys) Current() (string, []byte) { return k.ids[0], k.keys[k.ids[0]] }

func (k *rotatingKeys) Key(id string) ([]byte, error) {
	if key, ok := k.keys[id]; ok {
		return key, nil
	}
	return nil, fmt.Errorf("key %q: %w", id, attestor.ErrChallengeKeyRetired)
}

// TestSimulatorKeyRotationMidJoin: a challenge made under key k1 is still
// answerable by the TPM after the controller's key rotated to k2 (the
// secret is derived under the key the challenge was made under, not the
// current one); once k1 is dropped, the answer is refused as expired.
func TestSimulatorKeyRotationMidJoin(t *testing.T) {
	sim := openSim(t)
	ca, err := tpmtest.NewManufacturerCA("Simulated", testNow.AddDate(-1, 0, 0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tpmsim.Provision(sim, ca, 1600); err != nil {
		t.Fatal(err)
	}
	roots, inters, err := LoadManufacturerCAs(ca.BundlePEM())
	if err != nil {
		t.Fatal(err)
	}
	keys := &rotatingKeys{ids: []string{"k1"}, keys: map[string][]byte{"k1": bytes.Repeat([]byte{1}, 32)}}
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters, Keys: keys})
	node := simAttestor(t, sim)
	ctx := context.Background()

	join := func(rotate func()) (*attestor.Result, error) {
		t.Helper()
		e := newEngine(v, nil)
		key := newKey(t)
		der, csr := csrFor(t, key, testNode, testProviderID)
		req := &attestor.Request{NodeName: testNode, ProviderID: testProviderID,
			Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo}
		att, err := node.Attest(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		first := e.file(t, "csr-1", der, att.Evidence, att.Annotations)
		res, err := e.verify(t, first)
		if err != nil || res.Challenge == nil {
			t.Fatalf("round 1: %+v, %v", res, err)
		}
		if res.Challenge.KeyID != keys.ids[0] {
			t.Fatalf("challenge made under key %q, want the current key %q", res.Challenge.KeyID, keys.ids[0])
		}
		rotate()
		att2, err := node.Respond(ctx, req, &attestor.Challenge{CSRName: first.name, CSRUID: first.uid, Data: res.Challenge.Data, Expires: res.Challenge.Expires})
		if err != nil {
			t.Fatal(err)
		}
		der2, _ := csrFor(t, key, testNode, testProviderID)
		return e.verify(t, e.file(t, "csr-2", der2, att2.Evidence, att2.Annotations))
	}

	res, err := join(func() { // k1 → k2, k1 kept
		keys.ids, keys.keys["k2"] = []string{"k2", "k1"}, bytes.Repeat([]byte{2}, 32)
	})
	if err != nil || res.Identity == nil {
		t.Fatalf("answer after the key rotated: %+v, %v; want the identity", res, err)
	}
	_, err = join(func() { // k2 → k3, k2 dropped
		keys.ids, keys.keys["k3"] = []string{"k3"}, bytes.Repeat([]byte{3}, 32)
		delete(keys.keys, "k2")
		delete(keys.keys, "k1")
	})
	wantReason(t, err, attestor.ReasonChallengeExpired)
}
