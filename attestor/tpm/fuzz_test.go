package tpm

import (
	"context"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// FuzzVerifyEvidence feeds arbitrary evidence through decoding and the whole
// first-round verification: it must never panic, and bad evidence must be a
// denial, never a transient error.
func FuzzVerifyEvidence(f *testing.F) {
	soft := newSoftTPM(&testing.T{})
	key := newKey(f)
	_, csr := csrFor(f, key, testNode, testProviderID)
	f.Add([]byte(evidenceOf(&testing.T{}, soft.attest(&testing.T{}, key), nil)))
	f.Add([]byte(`{"version":"v1","response":{"csrName":"csr-1","proof":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}}`))
	f.Add([]byte(`{"version":"v1","attestation":{"ekPublic":"AAEACw==","akPublic":"AA==","certifiedKey":"AA==","certifyInfo":"/1RDRw==","certifySignature":"AA=="}}`))
	roots, inters := soft.ca.Pools()
	v := newTestVerifier(f, VerifierConfig{Roots: roots, Intermediates: inters})
	c := newCluster()
	f.Fuzz(func(t *testing.T, data []byte) {
		if _, err := attestor.EvidenceVersion(data); err != nil {
			return // the signer rejects these before any verifier runs
		}
		if ev, err := DecodeEvidence(data); err == nil && ev.Attestation != nil {
			_, _ = EndorsementKeyAnnotation(data)
		}
		_, err := v.Verify(context.Background(), &attestor.VerifyRequest{
			Evidence:  data,
			Version:   VersionV1,
			Binding:   attestor.Binding(csr.RawSubjectPublicKeyInfo),
			CSR:       csr,
			CSRName:   "csr-2",
			CSRUID:    "uid-csr-2",
			Username:  testBootstrap,
			LookupCSR: c.lookup,
		})
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
