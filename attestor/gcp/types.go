// Package gcp is the Google Compute Engine attestor, both halves.
//
// The node half (Attestor) asks the metadata server for the instance
// identity token of the default service account, format=full, with an
// audience that carries the binding. The signer half (Verifier) checks the
// token's RS256 signature against Google's published keys (a JWKS URL,
// cached and refreshed), the issuer, the audience recomputed from the CSR
// key, the validity window, and the google.compute_engine claims: an allowed
// project, the instance name equal to the node name, and the provider ID
// gce://<project>/<zone>/<instance name>.
package gcp

import (
	"encoding/hex"
	"strings"

	"github.com/go-jose/go-jose/v4/jwt"
)

// Name is the provider name on the wire.
const Name = "gcp"

// Evidence versions: the same document, bound by binding v1 (the CSR key)
// in VersionV1 and by binding v2 (the CSR key and the workload cluster's CA,
// attestor.ClusterBinding) in VersionV2. The node produces VersionV2 and
// VersionV1 for older signers; the signer accepts both.
const (
	VersionV1 = "v1"
	VersionV2 = "v2"
)

// clusterBound reports whether evidence of version commits to the cluster.
func clusterBound(version string) bool { return version == VersionV2 }

// DefaultAudiencePrefix prefixes hex(binding) in the token audience.
const DefaultAudiencePrefix = "https://kubelet-authenticator.x-k8s.io/binding/"

// Issuer is the only accepted "iss" of an instance identity token.
const Issuer = "https://accounts.google.com"

// Evidence is the GCP evidence document (version v1).
type Evidence struct {
	Version string `json:"version"`
	// Token is the instance identity token (a compact JWS) as the metadata
	// server returned it.
	Token string `json:"token"`
}

// Audience returns the token audience that commits to binding.
func Audience(prefix string, binding []byte) string {
	if prefix == "" {
		prefix = DefaultAudiencePrefix
	}
	return prefix + hex.EncodeToString(binding)
}

// Claims are the claims of an instance identity token (format=full).
type Claims struct {
	Issuer   string       `json:"iss"`
	Audience jwt.Audience `json:"aud"`
	Subject  string       `json:"sub"`
	Email    string       `json:"email,omitempty"`
	IssuedAt *int64       `json:"iat"`
	Expiry   *int64       `json:"exp"`
	Google   struct {
		ComputeEngine *ComputeEngine `json:"compute_engine"`
	} `json:"google"`
}

// ComputeEngine is the google.compute_engine claim.
type ComputeEngine struct {
	ProjectID                 string `json:"project_id"`
	ProjectNumber             int64  `json:"project_number"`
	Zone                      string `json:"zone"`
	InstanceID                string `json:"instance_id"`
	InstanceName              string `json:"instance_name"`
	InstanceCreationTimestamp int64  `json:"instance_creation_timestamp"`
}

// ProviderID returns gce://<project>/<zone>/<instance name>.
func (c *ComputeEngine) ProviderID() string {
	return "gce://" + c.ProjectID + "/" + c.Zone + "/" + c.InstanceName
}

// Stable returns the TOFU identity: gcp:<instance ID>.
func (c *ComputeEngine) Stable() string { return Name + ":" + c.InstanceID }

func trimSlash(s string) string { return strings.TrimSuffix(s, "/") }
