package tpm

import (
	"context"
	"errors"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// FuzzVerifyEvidence feeds arbitrary evidence through decoding and the whole
// verification, as a first round and as an answer to a challenged round:
// it must never panic, and bad evidence must be a denial, never a
// transient error.
func FuzzVerifyEvidence(f *testing.F) {
	soft := newSoftTPM(&testing.T{})
	key := newKey(f)
	csrDER, csr := csrFor(f, key, testNode, testProviderID)
	f.Add([]byte(evidenceOf(&testing.T{}, VersionV2, soft.quote(&testing.T{}, key), nil)))
	f.Add([]byte(evidenceOf(&testing.T{}, VersionV1, soft.attest(&testing.T{}, key), nil)))
	f.Add([]byte(`{"version":"v2","response":{"csrName":"csr-1","proof":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}}`))
	f.Add([]byte(`{"version":"v1","attestation":{"ekPublic":"AAEACw==","akPublic":"AA==","certifiedKey":"AA==","certifyInfo":"/1RDRw==","certifySignature":"AA=="}}`))
	f.Add([]byte(`{"version":"v2","attestation":{"ekPublic":"AAEACw==","akPublic":"AA==","quote":"/1RDR4AYAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAABAAsD/wMAAAA=","quoteSignature":"AA==","pcrs":[{"bank":"sha256","index":0,"digest":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}]}}`))
	roots, inters := soft.ca.Pools()
	v := newTestVerifier(f, VerifierConfig{Roots: roots, Intermediates: inters})
	// A challenged first round for the answers to name.
	e := newEngine(v, nil)
	first := e.file(f, "csr-1", csrDER, evidenceOf(&testing.T{}, VersionV2, soft.quote(&testing.T{}, key), nil), nil)
	if _, err := e.verify(f, first); err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if _, err := attestor.EvidenceVersion(data); err != nil {
			return // the signer rejects these before any verifier runs
		}
		if ev, err := DecodeEvidence(data); err == nil && ev.Attestation != nil {
			_, _ = EndorsementKeyAnnotation(data)
		}
		in := &attestor.VerifyRequest{
			Evidence: data,
			Binding:  attestor.Binding(csr.RawSubjectPublicKeyInfo),
			CSR:      csr,
			UID:      "uid-csr-2",
		}
		res, err := v.Verify(context.Background(), in)
		if err == nil && res.Answers != "" {
			in.Answered = first.round()
			_, err = v.Verify(context.Background(), in)
		}
		if err != nil {
			if _, ok := attestor.AsDenial(err); !ok {
				t.Fatalf("bad evidence gave a transient error: %v", err)
			}
		}
	})
}

// FuzzDecodeChallenge: the node parses the challenge annotation, which only
// the controller writes, but must still not panic on it.
func FuzzDecodeChallenge(f *testing.F) {
	f.Add([]byte(`{"version":"v1","credentialBlob":"AAEC","encryptedSecret":"AAEC","expires":"2026-11-22T12:00:00Z"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		_, _ = DecodeChallenge(data)
	})
}

// FuzzReplayEventLog feeds arbitrary event logs, seeded with real ones, to
// the replay the verifier runs on what a node sends: it must never panic,
// and a log that does not replay is reported as such.
func FuzzReplayEventLog(f *testing.F) {
	raw := realEventLog(f, softLog)
	pcrs := bootPCRs(f, raw, "sha256", softIndices)
	f.Add(raw)
	f.Add(realEventLog(f, "arch-linux-workstation.bin"))
	f.Add(raw[:len(raw)/2])
	f.Fuzz(func(t *testing.T, log []byte) {
		if _, err := ReplayEventLog(log, pcrs); err != nil && !errors.Is(err, errEventLogMismatch) {
			t.Fatalf("a log that does not replay is not reported as a mismatch: %v", err)
		}
	})
}

// FuzzParsePolicy: a policy document never panics the parser.
func FuzzParsePolicy(f *testing.F) {
	f.Add([]byte(policyHeader + "pcrs: {bank: sha256, indices: [0, 4, 7, 8, 9]}\nrequireSecureBoot: true\nkernelCommandLine: {required: [ro]}\ndbx: {minEntries: 3}\n"))
	f.Add([]byte(`{"apiVersion":"kubelet-authenticator.x-k8s.io/v1alpha1","kind":"TPMBootPolicy","pcrValues":[{"index":1,"digest":"00"}]}`))
	f.Fuzz(func(t *testing.T, doc []byte) {
		_, _ = ParsePolicy(doc)
	})
}
