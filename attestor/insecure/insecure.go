// Package insecure is the attestor for providers with no secure mechanism:
// the node states its provider ID and the signer believes it. It proves
// nothing beyond possession of the bootstrap credential; the signer still
// matches the provider ID and node name against the Machine, so a bootstrap
// token can register only as a machine Cluster API created, and only once
// per identity through the Machine's nodeRef. Use a real attestor wherever
// the platform has one.
package insecure

import (
	"context"
	"fmt"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Name is the provider name on the wire.
const Name = "insecure"

// VersionV1 is the only evidence version.
const VersionV1 = "v1"

// Evidence is the insecure attestor's evidence document.
type Evidence struct {
	Version string `json:"version"`
	// ProviderID repeats the provider ID claimed in the CSR extension.
	ProviderID string `json:"providerID"`
}

// Attestor is the node half.
type Attestor struct{}

// Versions implements attestor.Attestor.
func (Attestor) Versions() []string { return []string{VersionV1} }

// Attest implements attestor.Attestor.
func (Attestor) Attest(_ context.Context, req *attestor.Request) (*attestor.Attestation, error) {
	if req.Version != "" && req.Version != VersionV1 {
		return nil, fmt.Errorf("insecure attestor cannot produce evidence version %q", req.Version)
	}
	if req.ProviderID == "" {
		return nil, fmt.Errorf("insecure attestor needs a provider ID")
	}
	return attestor.Encode(VersionV1, Evidence{Version: VersionV1, ProviderID: req.ProviderID})
}

// Verifier is the signer half.
type Verifier struct{}

// Versions implements attestor.Verifier.
func (Verifier) Versions() []string { return []string{VersionV1} }

// Verify implements attestor.Verifier. It proves only what the node claims:
// the provider ID in the evidence, which must repeat the CSR extension.
func (Verifier) Verify(_ context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	var ev Evidence
	if err := attestor.DecodeEvidence(in.Evidence, &ev); err != nil {
		return nil, err
	}
	if ev.Version != VersionV1 {
		return nil, attestor.Deny(attestor.ReasonUnsupportedEvidenceVersion, "evidence version %q is not %q", ev.Version, VersionV1)
	}
	if ev.ProviderID != in.ProviderID {
		return nil, attestor.Deny(attestor.ReasonAttestedProviderIDMismatch,
			"evidence names provider ID %q but the CSR extension says %q", ev.ProviderID, in.ProviderID)
	}
	return &attestor.Result{Identity: &attestor.Identity{ProviderID: ev.ProviderID}}, nil
}
