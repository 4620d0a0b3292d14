package gcp

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"time"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// DefaultMetadataEndpoint is the GCE metadata server.
const DefaultMetadataEndpoint = "http://metadata.google.internal"

// AttestorConfig configures the node half.
type AttestorConfig struct {
	// MetadataEndpoint is the base URL of the metadata server;
	// DefaultMetadataEndpoint when empty.
	MetadataEndpoint string `json:"metadataEndpoint,omitempty"`
	// AudiencePrefix prefixes hex(binding) in the token audience;
	// DefaultAudiencePrefix when empty. The verifier must use the same.
	AudiencePrefix string `json:"audiencePrefix,omitempty"`
}

// Attestor is the node half.
type Attestor struct {
	endpoint, prefix string
	client           *http.Client
}

// NewAttestor returns the node half.
func NewAttestor(cfg AttestorConfig) (*Attestor, error) {
	a := &Attestor{endpoint: trimSlash(cfg.MetadataEndpoint), prefix: cfg.AudiencePrefix, client: &http.Client{Timeout: 10 * time.Second}}
	if a.endpoint == "" {
		a.endpoint = DefaultMetadataEndpoint
	}
	if u, err := url.Parse(a.endpoint); err != nil || u.Host == "" {
		return nil, fmt.Errorf("metadataEndpoint %q is not an absolute URL", a.endpoint)
	}
	return a, nil
}

// Versions implements attestor.Attestor.
func (a *Attestor) Versions() []string { return []string{VersionV2, VersionV1} }

// Attest implements attestor.Attestor.
func (a *Attestor) Attest(ctx context.Context, req *attestor.Request) (*attestor.Attestation, error) {
	version := req.Newest(VersionV2, VersionV1)
	switch version {
	case VersionV1, VersionV2:
	default:
		return nil, fmt.Errorf("gcp attestor cannot produce evidence version %q", req.Version)
	}
	binding, err := req.BindingFor(clusterBound(version))
	if err != nil {
		return nil, fmt.Errorf("gcp attestor cannot produce evidence version %s: %w", version, err)
	}
	q := url.Values{"audience": {Audience(a.prefix, binding)}, "format": {"full"}}
	token, err := a.metadata(ctx, "instance/service-accounts/default/identity?"+q.Encode(), 64<<10)
	if err != nil {
		return nil, fmt.Errorf("unable to get the identity token: %w", err)
	}
	return attestor.Encode(version, Evidence{Version: version, Token: token})
}
