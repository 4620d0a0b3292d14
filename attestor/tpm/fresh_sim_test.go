//go:build tpmsimulator

package tpm

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-tpm-tools/simulator"
	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
)

// TestSimulatorSavedQuoteAfterReboot is the stale quote: a node saves its
// first-round evidence (a quote of a Secure Boot boot, bound to a CSR key
// it keeps) and, after the machine rebooted without Secure Boot, files it
// again and answers the challenge with its TPM. Credential activation
// proves the TPM is there now, not that its PCRs are current: the fresh
// quote in the answer does, and the answer is denied, with the fresh quote
// (its PCRs are not the saved log's) and without it (the policy reads
// PCRs). An answer in the boot that made the quote passes.
func TestSimulatorSavedQuoteAfterReboot(t *testing.T) {
	sim, err := simulator.Get()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sim.Close() })
	tp := transport.FromReadWriteCloser(sim)
	dir := t.TempDir()
	sbRaw, noSBRaw := realEventLog(t, "rhel8-uefi.bin"), realEventLog(t, "ubuntu-2104-no-secure-boot.bin")
	logPath := filepath.Join(dir, "binary_bios_measurements")
	boot := func(raw []byte) {
		t.Helper()
		if err := os.WriteFile(logPath, raw, 0o600); err != nil {
			t.Fatal(err)
		}
		bootTPM(t, tp, raw)
	}
	boot(sbRaw)
	node, err := New(func() (transport.TPMCloser, error) { return tpmsim.NopCloser(tp), nil }, AttestorConfig{EventLogPath: logPath})
	if err != nil {
		t.Fatal(err)
	}
	policy := []byte(policyHeader + "pcrs: {bank: sha256, indices: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}\nrequireSecureBoot: true\n")
	v := newTestVerifier(t, VerifierConfig{})
	ctx := context.Background()

	// answer files the saved first round and the node's answer to its
	// challenge, edited by strip, and returns round 2's verdict.
	answer := func(t *testing.T, reboot bool, strip bool) error {
		t.Helper()
		key := newKey(t)
		csrDER, csr := csrFor(t, key, testNode, testProviderID)
		req := &attestor.Request{Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo, ClusterCA: testClusterCA}
		saved, err := node.Attest(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if reboot {
			if err := sim.Reset(); err != nil {
				t.Fatal(err)
			}
			boot(noSBRaw)
			t.Cleanup(func() { // the next case boots with Secure Boot again
				if err := sim.Reset(); err != nil {
					t.Fatal(err)
				}
				boot(sbRaw)
			})
		}
		e := newEngine(v, saved.Annotations)
		e.policy = policy
		first := e.file(t, "csr-1", csrDER, saved.Evidence, saved.Annotations)
		res, err := e.verify(t, first)
		if err != nil || res.Challenge == nil {
			t.Fatalf("the saved first round: %+v, %v; want a challenge (it is a good boot's)", res, err)
		}
		att2, err := node.Respond(ctx, req, &attestor.Challenge{CSRName: first.name, CSRUID: first.uid, Data: res.Challenge.Data, Expires: res.Challenge.Expires})
		if err != nil {
			t.Fatalf("Respond: %v", err)
		}
		evidence := att2.Evidence
		if strip {
			ev, err := DecodeEvidence(evidence)
			if err != nil {
				t.Fatal(err)
			}
			ev.Response.Quote, ev.Response.QuoteSignature, ev.Response.PCRs = nil, nil, nil
			if evidence, err = json.Marshal(ev); err != nil {
				t.Fatal(err)
			}
		}
		_, err = e.verify(t, e.file(t, "csr-2", csrDER, evidence, nil))
		return err
	}

	t.Run("answered in the boot that quoted", func(t *testing.T) {
		if err := answer(t, false, false); err != nil {
			t.Fatalf("round 2: %v", err)
		}
	})
	t.Run("saved quote, rebooted without Secure Boot", func(t *testing.T) {
		err := answer(t, true, false)
		wantReason(t, err, ReasonEventLogMismatch)
		if !strings.Contains(err.Error(), "booted again") {
			t.Errorf("denial %q does not say the PCRs moved on", err)
		}
	})
	t.Run("saved quote, rebooted, fresh quote left out", func(t *testing.T) {
		wantReason(t, answer(t, true, true), ReasonFreshQuoteRequired)
	})
}
