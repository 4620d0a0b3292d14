//go:build tpmsimulator

package tpm

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"slices"
	"testing"

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
	req := &attestor.Request{Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo, Key: key}
	var akPubs [][]byte
	for range 2 {
		raw, err := node.Attest(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		ev, err := DecodeEvidence(raw)
		if err != nil {
			t.Fatal(err)
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

// TestSimulatorInfrastructureEK covers a TPM without an EK certificate whose
// EK the infrastructure provider reports on the Machine.
func TestSimulatorInfrastructureEK(t *testing.T) {
	sim := openSim(t)
	node := simAttestor(t, sim)
	v := newTestVerifier(t, VerifierConfig{})

	key := newKey(t)
	_, csr := csrFor(t, key, testNode, testProviderID)
	raw, err := node.Attest(context.Background(), &attestor.Request{Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo, Key: key})
	if err != nil {
		t.Fatal(err)
	}
	ekB64, err := EndorsementKeyAnnotation(raw)
	if err != nil {
		t.Fatal(err)
	}
	machine := map[string]string{attestor.AnnotationEndorsementKey: ekB64}
	id := roundTrip(t, node, v, machine)
	der, _ := base64.StdEncoding.DecodeString(ekB64)
	if id.Stable != StableIdentity(der) {
		t.Errorf("stable identity %q, want that of the reported EK", id.Stable)
	}

	// Without the Machine's word, an EK with no certificate is not trusted.
	c := newCluster()
	csrDER, _ := csrFor(t, key, testNode, testProviderID)
	f := c.file(t, "csr-x", testBootstrap, csrDER, raw)
	_, err = v.Verify(context.Background(), c.verifyRequest(f, nil))
	wantReason(t, err, ReasonUntrustedEKCertificate)
}

// TestSimulatorForeignChallenge checks that a challenge not made for this
// TPM's EK and AK cannot be answered, and that a failed activation leaks
// nothing.
func TestSimulatorForeignChallenge(t *testing.T) {
	sim := openSim(t)
	node := simAttestor(t, sim)
	v := newTestVerifier(t, VerifierConfig{})
	c := newCluster()
	key := newKey(t)
	csrDER, csr := csrFor(t, key, testNode, testProviderID)
	req := &attestor.Request{Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo, Key: key}
	raw, err := node.Attest(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	ekB64, _ := EndorsementKeyAnnotation(raw)
	f := c.file(t, "csr-1", testBootstrap, csrDER, raw)
	res, err := v.Verify(context.Background(), c.verifyRequest(f, map[string]string{attestor.AnnotationEndorsementKey: ekB64}))
	if err != nil {
		t.Fatal(err)
	}
	var ch Challenge
	if err := json.Unmarshal(res.Challenge, &ch); err != nil {
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
