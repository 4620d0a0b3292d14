//go:build testattestors

// Package null is the rubber-stamp attestor, for tests only: the node states
// its provider ID (and, if configured, a stable identity) and the signer
// believes it, in whichever evidence versions each side is configured with.
// Tests use it to drive the signer and the node through paths that do not
// depend on a provider, such as version skew: a node that offers "v2" first
// to a signer that accepts only "v1".
//
// Every file of this package carries the build tag testattestors, and the
// node and controller tables list it only in builds with that tag: release
// binaries never contain it (test/release checks that they do not).
package null

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Name is the provider name on the wire.
const Name = "null"

// DefaultVersions is what both halves use when configured with none.
var DefaultVersions = []string{"v1"}

// Evidence is the null attestor's evidence document, the same in every
// version.
type Evidence struct {
	Version string `json:"version"`
	// ProviderID repeats the provider ID claimed in the CSR extension.
	ProviderID string `json:"providerID"`
	// Stable, when set, is the identity the node claims for trust on first
	// use; the verifier reports it as "null:<Stable>".
	Stable string `json:"stable,omitempty"`
}

// checkVersions validates a configured version list: non-empty entries
// without duplicates. An empty list means DefaultVersions.
func checkVersions(versions []string) ([]string, error) {
	if len(versions) == 0 {
		return slices.Clone(DefaultVersions), nil
	}
	var errs []error
	for i, v := range versions {
		switch {
		case v == "" || strings.ContainsAny(v, ", \t\n"):
			errs = append(errs, fmt.Errorf("versions[%d] %q is not a version name", i, v))
		case slices.Contains(versions[:i], v):
			errs = append(errs, fmt.Errorf("versions[%d] %q is listed twice", i, v))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return slices.Clone(versions), nil
}

// Attestor is the node half.
type Attestor struct {
	versions []string
	stable   string
}

// NewAttestor returns a node half that produces the given evidence
// versions, newest (preferred) first, and claims stable as its identity
// when it is not empty.
func NewAttestor(versions []string, stable string) (*Attestor, error) {
	vs, err := checkVersions(versions)
	if err != nil {
		return nil, fmt.Errorf("null attestor: %w", err)
	}
	return &Attestor{versions: vs, stable: stable}, nil
}

// Versions implements attestor.Attestor.
func (a *Attestor) Versions() []string { return slices.Clone(a.versions) }

// Attest implements attestor.Attestor.
func (a *Attestor) Attest(_ context.Context, req *attestor.Request) (*attestor.Attestation, error) {
	version := req.Version
	if version == "" {
		version = a.versions[0]
	}
	if !slices.Contains(a.versions, version) {
		return nil, fmt.Errorf("null attestor cannot produce evidence version %q (configured: %s)", version, strings.Join(a.versions, ","))
	}
	if req.ProviderID == "" {
		return nil, errors.New("null attestor needs a provider ID")
	}
	return attestor.Encode(version, Evidence{Version: version, ProviderID: req.ProviderID, Stable: a.stable})
}

// Verifier is the signer half.
type Verifier struct {
	versions []string
}

// NewVerifier returns a signer half that accepts the given evidence
// versions, newest first.
func NewVerifier(versions []string) (*Verifier, error) {
	vs, err := checkVersions(versions)
	if err != nil {
		return nil, fmt.Errorf("null attestor: %w", err)
	}
	return &Verifier{versions: vs}, nil
}

// Versions implements attestor.Verifier.
func (v *Verifier) Versions() []string { return slices.Clone(v.versions) }

// Verify implements attestor.Verifier. It proves what the node claims: the
// provider ID in the evidence, which must repeat the CSR extension, and the
// stable identity if the node claimed one.
func (v *Verifier) Verify(_ context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	var ev Evidence
	if err := attestor.DecodeEvidence(in.Evidence, &ev); err != nil {
		return nil, err
	}
	if !slices.Contains(v.versions, ev.Version) {
		return nil, attestor.Deny(attestor.ReasonUnsupportedEvidenceVersion, "evidence version %q is not one of %s", ev.Version, strings.Join(v.versions, ","))
	}
	if ev.ProviderID != in.ProviderID {
		return nil, attestor.Deny(attestor.ReasonAttestedProviderIDMismatch,
			"evidence names provider ID %q but the CSR extension says %q", ev.ProviderID, in.ProviderID)
	}
	id := &attestor.Identity{ProviderID: ev.ProviderID}
	if ev.Stable != "" {
		id.Stable = Name + ":" + ev.Stable
	}
	return &attestor.Result{Identity: id}, nil
}

// Config is the node configuration of the null attestor (section
// nullAttestor of a test build's node configuration).
type Config struct {
	// Versions lists the evidence versions the node produces, newest
	// (preferred) first. Default: ["v1"].
	Versions []string `json:"versions,omitempty"`
	// Stable, when set, is the identity the node claims for trust on first
	// use.
	Stable string `json:"stable,omitempty"`
}

// VerifierConfig configures the verifier half (the controller's
// --null-versions in test builds).
type VerifierConfig struct {
	// Versions lists the accepted evidence versions, newest first.
	Versions []string
}
