package tpm

import (
	"context"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// BenchmarkReplayEventLog measures parsing, replaying and deriving the
// boot state of each real event log go-tpm-tools ships, and reports its
// size (log-bytes) and the size of the v2 evidence carrying it
// (evidence-bytes: the JSON attestation data, before spec.request's
// base64).
func BenchmarkReplayEventLog(b *testing.B) {
	for _, c := range realLogs {
		raw := realEventLog(b, c.file)
		pcrs := logPCRs(b, raw, logBank(b, raw))
		b.Run(c.file, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := ReplayEventLog(raw, pcrs); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(raw)), "log-bytes")
		})
	}
}

// BenchmarkVerifyBoot measures the verifier's whole first round on v2
// evidence of a real boot (quoted by the soft TPM) under a policy: EK
// certificate chain, quote, replay, policy, and the challenge (RSA
// encryption to the EK) or the denials.
func BenchmarkVerifyBoot(b *testing.B) {
	t := &testing.T{}
	soft := newSoftTPM(t)
	roots, inters := soft.ca.Pools()
	v := newTestVerifier(b, VerifierConfig{Roots: roots, Intermediates: inters})
	for _, c := range realLogs {
		raw := realEventLog(b, c.file)
		if logBank(b, raw) == "sha1" {
			continue // the soft TPM quotes SHA-256 PCRs
		}
		key := newKey(b)
		csrDER, _ := csrFor(b, key, testNode, testProviderID)
		ev := evidenceOf(t, VersionV2, soft.quoteBoot(t, key, raw, "sha256", softIndices), nil)
		e := newEngine(v, nil)
		e.policy = []byte(policyHeader + "pcrs: {bank: sha256, indices: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}\nrequireSecureBoot: true\nkernelCommandLine: {forbidden: [init]}\n")
		req := e.request(e.file(b, "csr-1", csrDER, ev, nil))
		b.Run(c.file, func(b *testing.B) {
			for b.Loop() {
				if _, err := v.Verify(context.Background(), req); err != nil {
					if _, ok := attestor.AsDenial(err); !ok {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(len(ev)), "evidence-bytes")
		})
	}
}
