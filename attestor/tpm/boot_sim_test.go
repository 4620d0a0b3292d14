//go:build tpmsimulator

package tpm

import (
	"testing"

	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
)

// TestSimulatorBootState: boot-state attestation end to end on Microsoft's
// reference TPM, its PCRs extended with real machines' boots.
func TestSimulatorBootState(t *testing.T) {
	runBootScenarios(t, func(t *testing.T) bootedTPM {
		sim := openSim(t)
		return bootedTPM{tpm: sim, open: func() (transport.TPMCloser, error) { return tpmsim.NopCloser(sim), nil }}
	})
}

// TestSimulatorV1UnderBootPolicy: an older node's v1 evidence (no quote)
// is still challenged without a policy, and with an empty one, and denied
// only where the Cluster's policy requires boot state.
func TestSimulatorV1UnderBootPolicy(t *testing.T) {
	sim := openSim(t)
	node := simAttestor(t, sim)
	v := newTestVerifier(t, VerifierConfig{})
	for _, c := range []struct {
		policy string
		reason string
	}{
		{"", ""},
		{policyHeader, ""},
		{policyHeader + "requireBootState: true\n", attestor.ReasonUnsupportedEvidenceVersion},
		{policyHeader + "requireSecureBoot: true\n", attestor.ReasonUnsupportedEvidenceVersion},
	} {
		key := newKey(t)
		att := attestV1(t, node, key)
		e := newEngine(v, att.Annotations)
		if c.policy != "" {
			e.policy = []byte(c.policy)
		}
		csrDER, _ := csrFor(t, key, testNode, testProviderID)
		res, err := e.verify(t, e.file(t, "csr-1", csrDER, att.Evidence, att.Annotations))
		if c.reason == "" {
			if err != nil || res.Challenge == nil {
				t.Errorf("policy %q: v1 gave %+v, %v; want a challenge", c.policy, res, err)
			}
			continue
		}
		wantReason(t, err, c.reason)
	}
}
