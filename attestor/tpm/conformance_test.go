//go:build tpmsimulator

package tpm

import (
	"testing"

	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/attestortest"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// TestConformance runs the shared attestor suite against the TPM halves on
// the simulator: both rounds of credential activation, and every rule of
// the strict evidence decoder (duplicate and case-folded keys included),
// with its own reason.
func TestConformance(t *testing.T) {
	sim := openSim(t)
	ca, err := tpmtest.NewManufacturerCA("Simulated", testNow.AddDate(-1, 0, 0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tpmsim.Provision(sim, ca, 1601); err != nil {
		t.Fatal(err)
	}
	roots, inters, err := LoadManufacturerCAs(ca.BundlePEM())
	if err != nil {
		t.Fatal(err)
	}
	attestortest.Conformance(t, attestortest.Provider{
		Name: Name,
		NewAttestor: func(tb testing.TB) attestor.Attestor {
			a, err := New(func() (transport.TPMCloser, error) { return tpmsim.NopCloser(sim), nil }, AttestorConfig{NoEventLog: true})
			if err != nil {
				tb.Fatal(err)
			}
			return a
		},
		Verifier:      newTestVerifier(t, VerifierConfig{Roots: roots, Intermediates: inters}),
		NodeName:      "node-1",
		ProviderID:    "test:///tpm/node-1",
		BindingReason: ReasonStaleBinding,
	})
}
