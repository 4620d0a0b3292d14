package azure

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"sigs.k8s.io/kubelet-authenticator/attestor/internal/metadata"
	"strings"
	"time"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// DefaultIMDSEndpoint is the instance metadata service.
const DefaultIMDSEndpoint = "http://169.254.169.254"

// DefaultAPIVersion is the IMDS api-version used for the attested document.
const DefaultAPIVersion = "2021-02-01"

// AttestorConfig configures the node half.
type AttestorConfig struct {
	// IMDSEndpoint is the base URL of IMDS; DefaultIMDSEndpoint when empty.
	IMDSEndpoint string `json:"imdsEndpoint,omitempty"`
	// APIVersion is the IMDS api-version; DefaultAPIVersion when empty.
	APIVersion string `json:"apiVersion,omitempty"`
}

// Attestor is the node half.
type Attestor struct {
	endpoint, apiVersion string
	client               *http.Client
}

// NewAttestor returns the node half.
func NewAttestor(cfg AttestorConfig) (*Attestor, error) {
	a := &Attestor{endpoint: strings.TrimSuffix(cfg.IMDSEndpoint, "/"), apiVersion: cfg.APIVersion, client: &http.Client{Timeout: 10 * time.Second}}
	if a.endpoint == "" {
		a.endpoint = DefaultIMDSEndpoint
	}
	if a.apiVersion == "" {
		a.apiVersion = DefaultAPIVersion
	}
	if u, err := url.Parse(a.endpoint); err != nil || u.Host == "" {
		return nil, fmt.Errorf("imdsEndpoint %q is not an absolute URL", a.endpoint)
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
		return nil, fmt.Errorf("azure attestor cannot produce evidence version %q", req.Version)
	}
	binding, err := req.BindingFor(clusterBound(version))
	if err != nil {
		return nil, fmt.Errorf("azure attestor cannot produce evidence version %s: %w", version, err)
	}
	q := url.Values{"api-version": {a.apiVersion}, "nonce": {Nonce(binding)}}
	body, err := metadata.Get(ctx, a.client, http.MethodGet, a.endpoint+"/metadata/attested/document?"+q.Encode(),
		map[string]string{"Metadata": "true"}, 1<<20)
	if err != nil {
		return nil, fmt.Errorf("unable to get the attested document from IMDS: %w", err)
	}
	var doc struct {
		Encoding  string `json:"encoding"`
		Signature string `json:"signature"`
	}
	if err := attestor.DecodeDocument(body, &doc, "the attested document"); err != nil {
		return nil, fmt.Errorf("IMDS returned an attested document that does not parse: %w", err)
	}
	if doc.Encoding != "pkcs7" || doc.Signature == "" {
		return nil, fmt.Errorf("the attested document has encoding %q and no usable signature", doc.Encoding)
	}
	return attestor.Encode(version, Evidence{Version: version, Signature: doc.Signature})
}
