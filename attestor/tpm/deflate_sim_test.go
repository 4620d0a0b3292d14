//go:build tpmsimulator

package tpm

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
)

// TestSimulatorDeflatedLog: a node of a real machine's boot sends its log
// deflated in v4 and as is in v3 (for a signer without v4); both prove the
// same boot under a strict policy, v4 in a smaller CSR. An answer must be
// in its round's version: a v3 answer to a v4 round is denied.
func TestSimulatorDeflatedLog(t *testing.T) {
	tp := openSim(t)
	raw := realEventLog(t, "rhel8-uefi.bin")
	bootTPM(t, tp, raw)
	logPath := filepath.Join(t.TempDir(), "binary_bios_measurements")
	if err := os.WriteFile(logPath, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	node, err := New(func() (transport.TPMCloser, error) { return tpmsim.NopCloser(tp), nil }, AttestorConfig{EventLogPath: logPath})
	if err != nil {
		t.Fatal(err)
	}
	v := newTestVerifier(t, VerifierConfig{})
	policy := []byte(policyHeader + "pcrs: {bank: sha256, indices: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}\nrequireSecureBoot: true\n")
	ctx := context.Background()

	// join runs both rounds, the first in version and the answer in
	// answerIn, and returns the first round's evidence and round 2's
	// verdict.
	join := func(t *testing.T, version, answerIn string) (attestor.Evidence, error) {
		t.Helper()
		key := newKey(t)
		csrDER, csr := csrFor(t, key, testNode, testProviderID)
		req := &attestor.Request{Version: version, Binding: attestor.Binding(csr.RawSubjectPublicKeyInfo), SPKI: csr.RawSubjectPublicKeyInfo, ClusterCA: testClusterCA}
		att, err := node.Attest(ctx, req)
		if err != nil || att.Version != version {
			t.Fatalf("Attest %s: %v, %v", version, att, err)
		}
		e := newEngine(v, att.Annotations)
		e.policy = policy
		first := e.file(t, "csr-1", csrDER, att.Evidence, att.Annotations)
		res, err := e.verify(t, first)
		if err != nil || res.Challenge == nil {
			t.Fatalf("round 1 of %s: %+v, %v; want a challenge", version, res, err)
		}
		req.Version = answerIn
		att2, err := node.Respond(ctx, req, &attestor.Challenge{CSRName: first.name, CSRUID: first.uid, Data: res.Challenge.Data, Expires: res.Challenge.Expires})
		if err != nil {
			t.Fatalf("Respond: %v", err)
		}
		_, err = e.verify(t, e.file(t, "csr-2", csrDER, att2.Evidence, nil))
		return att.Evidence, err
	}

	v4, err := join(t, VersionV4, VersionV4)
	if err != nil {
		t.Fatalf("v4 join: %v", err)
	}
	v3, err := join(t, VersionV3, VersionV3)
	if err != nil {
		t.Fatalf("v3 join: %v", err)
	}
	var fields struct{ Attestation map[string]json.RawMessage }
	if err := json.Unmarshal(v4, &fields); err != nil {
		t.Fatal(err)
	}
	if _, ok := fields.Attestation["eventLogDeflated"]; !ok || fields.Attestation["eventLog"] != nil {
		t.Errorf("v4 evidence has the log in eventLog, or not in eventLogDeflated")
	}
	if len(v4) > len(v3)*3/4 {
		t.Errorf("v4 evidence is %d bytes, v3 %d: want v4 under three quarters of v3", len(v4), len(v3))
	}
	t.Logf("first-round evidence with the RHEL 8 log: v4 %d bytes, v3 %d", len(v4), len(v3))

	_, err = join(t, VersionV4, VersionV3)
	wantReason(t, err, attestor.ReasonChallengeMismatch)
}
