package tpm

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/google/go-eventlog/tcg"

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
	v4 := soft.quote(&testing.T{}, key)
	v4.EventLogDeflated, v4.EventLog = deflated(&testing.T{}, v4.EventLog[:1024]), nil
	f.Add([]byte(evidenceOf(&testing.T{}, VersionV4, v4, nil)))
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
// and a log that does not replay is reported as such, or as one that has
// no digests of the quoted bank (a SHA-1-only log: a correct refusal).
func FuzzReplayEventLog(f *testing.F) {
	raw := realEventLog(f, softLog)
	pcrs := bootPCRs(f, raw, "sha256", softIndices)
	f.Add(raw)
	f.Add(realEventLog(f, "arch-linux-workstation.bin"))
	f.Add(realEventLog(f, "debian-10.bin"))
	f.Add(raw[:len(raw)/2])
	f.Fuzz(func(t *testing.T, log []byte) {
		if _, err := ReplayEventLog(log, pcrs); err != nil && !errors.Is(err, errEventLogMismatch) && !errors.Is(err, errNoCommonBank) {
			t.Fatalf("a log that does not replay is not reported as a mismatch: %v", err)
		}
	})
}

// FuzzReplayRedigested reaches the parsers behind the replay: a mutated
// event fails its digest first, so each event's digests are recomputed
// from its (mutated) data as a measuring agent would have (GRUB's PCR 8
// strings without their label), and the log is replayed against the PCRs
// its own events produce, as a genuine TPM that made exactly these
// extensions would quote them. It must replay, without a panic (which the
// replay would turn into an error): what the parsers refuse is a Problem
// of the boot state.
func FuzzReplayRedigested(f *testing.F) {
	for _, name := range []string{softLog, "gdc-host.bin", "ubuntu-2104-no-secure-boot.bin", "cos-101-amd-sev.bin"} {
		f.Add(realEventLog(f, name))
	}
	f.Add(badSignatureListLog(f))
	f.Fuzz(func(t *testing.T, raw []byte) {
		l, err := parseAgileLog(raw)
		if err != nil || len(l.events) > 4096 {
			return
		}
		for i := range l.events {
			e := &l.events[i]
			if e.typ == uint32(tcg.EFIHCRTMEvent) {
				return // starts its PCR at 4, which LogPCRs does not model
			}
			content := e.data
			for _, p := range grubPrefixes {
				if e.pcr == 8 && bytes.HasPrefix(content, []byte(p)) {
					content = bytes.TrimSuffix(content[len(p):], []byte{0})
					break
				}
			}
			e.measure(content)
		}
		log := l.bytes()
		all, err := LogPCRs(log, "sha256")
		if err != nil {
			return // the Spec ID event was mutated: the parser refuses it
		}
		var pcrs []PCRValue
		for _, i := range softIndices {
			v := PCRValue{Bank: "sha256", Index: i, Digest: make([]byte, 32)}
			for _, p := range all {
				if p.Index == i {
					v = p
				}
			}
			pcrs = append(pcrs, v)
		}
		if _, err := ReplayEventLog(log, pcrs); err != nil {
			t.Fatalf("a log whose digests cover its data does not replay against its own PCRs: %v", err)
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
