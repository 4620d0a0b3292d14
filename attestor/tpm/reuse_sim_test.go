//go:build tpmsimulator

package tpm

import (
	"context"
	"encoding/binary"
	"testing"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// commandLog records the command codes sent to a TPM.
type commandLog struct {
	t    transport.TPM
	sent []tpm2.TPMCC
}

func (c *commandLog) Send(cmd []byte) ([]byte, error) {
	if len(cmd) >= 10 {
		c.sent = append(c.sent, tpm2.TPMCC(binary.BigEndian.Uint32(cmd[6:10])))
	}
	return c.t.Send(cmd)
}

func (c *commandLog) count(cc tpm2.TPMCC) int {
	n := 0
	for _, x := range c.sent {
		if x == cc {
			n++
		}
	}
	return n
}

// TestSimulatorChallengeReusesKeys: answering the challenge loads the EK and
// the AK the attestation saved instead of re-creating the two primaries (and
// re-reading the EK certificate); an attestor that attested nothing, or
// whose saved contexts the TPM refuses, re-creates them and still answers;
// none of the three leaves a transient handle behind.
func TestSimulatorChallengeReusesKeys(t *testing.T) {
	sim := openSim(t)
	ca, err := tpmtest.NewManufacturerCA("Simulated", testNow.AddDate(-1, 0, 0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tpmsim.Provision(sim, ca, 0); err != nil {
		t.Fatal(err)
	}
	roots, inters, err := LoadManufacturerCAs(ca.BundlePEM())
	if err != nil {
		t.Fatal(err)
	}
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
	log := &commandLog{t: sim}
	newNode := func() *Attestor {
		a, err := NewAttestor(func() (transport.TPMCloser, error) { return tpmsim.NopCloser(log), nil })
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	ctx := context.Background()

	// challenge attests with node and returns a request and the challenge
	// the verifier made for it.
	challenge := func(node *Attestor) (*attestor.Request, *attestor.Challenge) {
		t.Helper()
		e := newEngine(v, nil)
		key := newKey(t)
		csrDER, csr := csrFor(t, key, testNode, testProviderID)
		req := &attestor.Request{NodeName: testNode, ProviderID: testProviderID, Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo}
		att, err := node.Attest(ctx, req)
		if err != nil {
			t.Fatalf("Attest: %v", err)
		}
		first := e.file(t, "csr-1", csrDER, att.Evidence, att.Annotations)
		res, err := e.verify(t, first)
		if err != nil || res.Challenge == nil {
			t.Fatalf("round 1 gave %+v, %v; want a challenge", res, err)
		}
		return req, &attestor.Challenge{CSRName: first.name, CSRUID: first.uid, Data: res.Challenge.Data}
	}
	respond := func(node *Attestor, req *attestor.Request, ch *attestor.Challenge) []tpm2.TPMCC {
		t.Helper()
		log.sent = nil
		if _, err := node.Respond(ctx, req, ch); err != nil {
			t.Fatalf("Respond: %v", err)
		}
		if h := transientHandles(t, sim); len(h) != 0 {
			t.Errorf("transient handles left after Respond: %v", h)
		}
		return log.sent
	}

	node := newNode()
	req, ch := challenge(node)
	respond(node, req, ch)
	if n := log.count(tpm2.TPMCCCreatePrimary); n != 0 {
		t.Errorf("Respond after Attest sent CreatePrimary %d times, want 0 (the attested keys loaded back)", n)
	}
	if n := log.count(tpm2.TPMCCNVRead); n != 0 {
		t.Errorf("Respond after Attest read NV %d times, want 0", n)
	}
	if n := log.count(tpm2.TPMCCContextLoad); n != 2 {
		t.Errorf("Respond after Attest loaded %d contexts, want 2 (EK and AK)", n)
	}

	// The saved keys are used once: a second answer re-creates them.
	respond(node, req, ch)
	if n := log.count(tpm2.TPMCCCreatePrimary); n != 2 {
		t.Errorf("a second Respond sent CreatePrimary %d times, want 2 (EK and AK re-created)", n)
	}

	// Another attestor (a new process) has nothing saved.
	req, ch = challenge(node)
	respond(newNode(), req, ch)
	if n := log.count(tpm2.TPMCCCreatePrimary); n != 2 {
		t.Errorf("Respond without Attest sent CreatePrimary %d times, want 2", n)
	}

	// A context the TPM refuses (here: tampered; after a TPM reset: stale)
	// falls back to re-creating the keys, with the loaded EK flushed.
	req, ch = challenge(node)
	node.held.akContext.ContextBlob.Buffer[len(node.held.akContext.ContextBlob.Buffer)-1] ^= 1
	respond(node, req, ch)
	if n := log.count(tpm2.TPMCCCreatePrimary); n != 2 {
		t.Errorf("Respond with a refused context sent CreatePrimary %d times, want 2", n)
	}
}

// TestSimulatorPersistedEK: a TPM whose provisioning persisted the EK at its
// conventional handle (OpenProvisioned, as provisioning tools do) has it
// read, not re-created: the attestation sends one CreatePrimary (the AK),
// and the signer verifies it like a re-created one.
func TestSimulatorPersistedEK(t *testing.T) {
	ca, err := tpmtest.NewManufacturerCA("Simulated", testNow.AddDate(-1, 0, 0))
	if err != nil {
		t.Fatal(err)
	}
	sim, err := tpmsim.OpenProvisioned(3, ca)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := sim.Close(); err != nil {
			t.Errorf("closing the simulator: %v", err)
		}
	})
	roots, inters, err := LoadManufacturerCAs(ca.BundlePEM())
	if err != nil {
		t.Fatal(err)
	}
	v := newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters})
	log := &commandLog{t: sim}
	node, err := NewAttestor(func() (transport.TPMCloser, error) { return tpmsim.NopCloser(log), nil })
	if err != nil {
		t.Fatal(err)
	}
	id := roundTrip(t, node, v, nil)
	if id == nil || id.Stable == "" {
		t.Fatalf("round trip proved %+v, want an identity", id)
	}
	if n := log.count(tpm2.TPMCCCreatePrimary); n != 1 {
		t.Errorf("an issuance with a persisted EK sent CreatePrimary %d times, want 1 (the AK)", n)
	}
	if h := transientHandles(t, sim); len(h) != 0 {
		t.Errorf("transient handles left: %v", h)
	}
}
