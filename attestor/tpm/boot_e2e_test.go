package tpm

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// bootTPM makes tp's SHA-256 PCRs those of the machine that wrote rawLog
// (tpmtest.ExtendEventLog).
func bootTPM(t *testing.T, tp transport.TPM, rawLog []byte) {
	t.Helper()
	if err := tpmtest.ExtendEventLog(tp, rawLog); err != nil {
		t.Fatal(err)
	}
}

// bootedTPM is a fresh TPM (simulator or swtpm) for one boot scenario, and
// how the node attestor opens it.
type bootedTPM struct {
	tpm  transport.TPM
	open Opener
}

// runBootScenarios is the end-to-end check of boot-state attestation on a
// real TPM implementation: fresh returns a new TPM with PCRs at zero. The
// TPM is booted with a real machine's event log (go-tpm-tools'), the node
// attestor quotes it and sends that log, and the verifier decides under
// policies, through credential activation where it passes.
func runBootScenarios(t *testing.T, fresh func(t *testing.T) bootedTPM) {
	const sbLog, noSBLog = "rhel8-uefi.bin", "ubuntu-2104-no-secure-boot.bin"
	dir := t.TempDir()
	logFile := func(name string, raw []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, raw, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	sbRaw := realEventLog(t, sbLog)
	st := bootOf(t, sbLog)
	selection := "pcrs: {bank: sha256, indices: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}\n"
	strict := []byte(policyHeader + selection + "requireSecureBoot: true\n" +
		"allowedBootLoaderDigests: [" + strings.Join(st.BootApplications, ", ") + "]\n" +
		"allowedKernelDigests: [" + st.KernelDigest + "]\n" +
		"kernelCommandLine: {required: [ro], forbidden: [init]}\n")
	other := strings.Repeat("cd", 32)
	v := newTestVerifier(t, VerifierConfig{})

	// first has node attest for a new key, applies mutate to the
	// attestation, and files it as a first round under policy.
	first := func(t *testing.T, node *Attestor, policy []byte, mutate func(*Attestation)) error {
		t.Helper()
		key := newKey(t)
		csrDER, csr := csrFor(t, key, testNode, testProviderID)
		att, err := node.Attest(context.Background(), &attestor.Request{Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo})
		if err != nil {
			t.Fatal(err)
		}
		evidence := att.Evidence
		if mutate != nil {
			ev, err := DecodeEvidence(att.Evidence)
			if err != nil {
				t.Fatal(err)
			}
			mutate(ev.Attestation)
			if evidence, err = json.Marshal(ev); err != nil {
				t.Fatal(err)
			}
		}
		e := newEngine(v, att.Annotations)
		e.policy = policy
		_, err = e.verify(t, e.file(t, "csr-1", csrDER, evidence, att.Annotations))
		return err
	}

	t.Run("Secure Boot machine", func(t *testing.T) {
		b := fresh(t)
		bootTPM(t, b.tpm, sbRaw)
		node, err := New(b.open, AttestorConfig{EventLogPath: logFile("sb.log", sbRaw)})
		if err != nil {
			t.Fatal(err)
		}
		// The infrastructure reports this TPM's EK on the Machine.
		_, probeCSR := csrFor(t, newKey(t), testNode, testProviderID)
		probe, err := node.Attest(context.Background(), &attestor.Request{Binding: attestor.Binding(probeCSR.RawSubjectPublicKeyInfo), SPKI: probeCSR.RawSubjectPublicKeyInfo})
		if err != nil {
			t.Fatal(err)
		}
		machine := probe.Annotations

		t.Run("passes a strict policy through credential activation", func(t *testing.T) {
			roundTripPolicy(t, node, v, machine, strict)
		})
		t.Run("kernel outside the allow list, named", func(t *testing.T) {
			err := first(t, node, []byte(policyHeader+"allowedKernelDigests: ["+other+"]\n"), nil)
			wantReason(t, err, ReasonKernelNotAllowed)
			if !strings.Contains(err.Error(), st.KernelDigest) {
				t.Errorf("denial %q does not name the kernel digest %s", err, st.KernelDigest)
			}
		})
		t.Run("v2 without the log under requireBootState", func(t *testing.T) {
			err := first(t, node, []byte(policyHeader+"requireBootState: true\n"), func(a *Attestation) { a.EventLog = nil })
			wantReason(t, err, ReasonBootStateRequired)
		})
		for _, c := range []struct {
			name string
			raw  []byte
		}{
			{"log with an event dropped", dropEvent(t, sbRaw, 4)},
			{"log with an event altered", alterBytes(t, sbRaw, mustHex(t, st.KernelDigest), mustHex(t, other))},
			{"another machine's log", realEventLog(t, noSBLog)},
		} {
			t.Run(c.name, func(t *testing.T) {
				tampered, err := New(b.open, AttestorConfig{EventLogPath: logFile(strings.ReplaceAll(c.name, " ", "-"), c.raw)})
				if err != nil {
					t.Fatal(err)
				}
				wantReason(t, first(t, tampered, nil, nil), ReasonEventLogMismatch)
				wantReason(t, first(t, tampered, strict, nil), ReasonEventLogMismatch)
			})
		}
		t.Run("quote qualified by another request's binding", func(t *testing.T) {
			other := newKey(t)
			_, otherCSR := csrFor(t, other, testNode, testProviderID)
			att, err := node.Attest(context.Background(), &attestor.Request{Binding: attestor.Binding(otherCSR.RawSubjectPublicKeyInfo), SPKI: otherCSR.RawSubjectPublicKeyInfo})
			if err != nil {
				t.Fatal(err)
			}
			key := newKey(t)
			csrDER, _ := csrFor(t, key, testNode, testProviderID)
			e := newEngine(v, machine)
			e.policy = strict
			_, err = e.verify(t, e.file(t, "csr-1", csrDER, att.Evidence, att.Annotations))
			wantReason(t, err, ReasonStaleBinding)
		})
		t.Run("quote by another key than the AK", func(t *testing.T) {
			// A second restricted signing key of the same TPM quotes the
			// same PCRs with the right binding; the evidence names the AK.
			key := newKey(t)
			csrDER, csr := csrFor(t, key, testNode, testProviderID)
			binding := attestor.Binding(csr.RawSubjectPublicKeyInfo)
			att, err := node.Attest(context.Background(), &attestor.Request{Binding: binding, SPKI: csr.RawSubjectPublicKeyInfo})
			if err != nil {
				t.Fatal(err)
			}
			ev, err := DecodeEvidence(att.Evidence)
			if err != nil {
				t.Fatal(err)
			}
			otherAK := akTemplate
			otherAK.Unique = tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{X: tpm2.TPM2BECCParameter{Buffer: []byte("another AK")}})
			s, err := node.start()
			if err != nil {
				t.Fatal(err)
			}
			ak2, err := s.createPrimary(otherAK)
			if err != nil {
				t.Fatal(err)
			}
			q, err := s.quote(ak2, binding, node.pcrs)
			if err != nil {
				t.Fatal(err)
			}
			ak2Raw := ak2.raw
			if err := s.finish(); err != nil {
				t.Fatal(err)
			}
			ev.Attestation.Quote, ev.Attestation.QuoteSignature = q.quoted, q.signature
			forged, _ := json.Marshal(ev)
			e := newEngine(v, machine)
			_, err = e.verify(t, e.file(t, "csr-1", csrDER, forged, att.Annotations))
			wantReason(t, err, ReasonBadQuoteSignature)

			// Naming the other key as the AK makes the quote verify, and
			// the challenge then goes to that key: the node, whose
			// activation uses its AK, cannot answer it.
			ev.Attestation.AKPublic = ak2Raw
			forged, _ = json.Marshal(ev)
			f := e.file(t, "csr-2", csrDER, forged, att.Annotations)
			res, err := e.verify(t, f)
			if err != nil || res.Challenge == nil {
				t.Fatalf("quote by a second restricted key: %+v, %v", res, err)
			}
			if _, err := node.Respond(context.Background(), &attestor.Request{Binding: binding, SPKI: csr.RawSubjectPublicKeyInfo},
				&attestor.Challenge{CSRName: f.name, CSRUID: f.uid, Data: res.Challenge.Data, Expires: res.Challenge.Expires}); err == nil {
				t.Fatal("the node answered a challenge made to another key than its AK")
			}
		})
	})

	t.Run("machine without Secure Boot", func(t *testing.T) {
		b := fresh(t)
		raw := realEventLog(t, noSBLog)
		bootTPM(t, b.tpm, raw)
		node, err := New(b.open, AttestorConfig{EventLogPath: logFile("nosb.log", raw)})
		if err != nil {
			t.Fatal(err)
		}
		if err := first(t, node, nil, nil); err != nil {
			t.Fatalf("without a policy: %v", err)
		}
		wantReason(t, first(t, node, []byte(policyHeader+selection+"requireSecureBoot: true\n"), nil), ReasonSecureBootDisabled)
	})
}

func mustHex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
