package insecure

import (
	"context"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/attestortest"
)

func TestConformance(t *testing.T) {
	attestortest.Conformance(t, attestortest.Provider{
		Name:        Name,
		NewAttestor: func(testing.TB) attestor.Attestor { return Attestor{} },
		Verifier:    Verifier{},
		NodeName:    "node-a",
		ProviderID:  "test:///fleet/node-a",
		Unbound:     true,
	})
}

// TestProvesOnlyTheClaim: the insecure verifier proves the provider ID the
// node states and no stable identity, and denies a claim that disagrees
// with the CSR extension.
func TestProvesOnlyTheClaim(t *testing.T) {
	ctx := context.Background()
	att, err := Attestor{}.Attest(ctx, &attestor.Request{NodeName: "node-a", ProviderID: "test:///a", Binding: attestortest.NewBinding(t)})
	if err != nil {
		t.Fatal(err)
	}
	res, err := Verifier{}.Verify(ctx, &attestor.VerifyRequest{Evidence: att.Evidence, Version: VersionV1, ProviderID: "test:///a"})
	if err != nil || res.Identity == nil || res.Identity.ProviderID != "test:///a" || res.Identity.Stable != "" {
		t.Fatalf("Verify = %+v, %v; want provider ID test:///a and no stable identity", res, err)
	}
	_, err = Verifier{}.Verify(ctx, &attestor.VerifyRequest{Evidence: att.Evidence, Version: VersionV1, ProviderID: "test:///b"})
	attestortest.WantDenial(t, err, attestor.ReasonAttestedProviderIDMismatch)
	if _, err := (Attestor{}).Attest(ctx, &attestor.Request{}); err == nil {
		t.Fatal("Attest without a provider ID succeeded")
	}
}
