package gcp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/go-jose/go-jose/v4"
	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tlsconfig"
)

// Denial reasons of the GCP verifier.
const (
	ReasonUnknownKey        = "UnknownKey"
	ReasonInvalidSignature  = "InvalidSignature"
	ReasonIssuerMismatch    = "IssuerMismatch"
	ReasonAudienceMismatch  = "AudienceMismatch"
	ReasonTokenExpired      = "TokenExpired"
	ReasonNotComputeEngine  = "NotComputeEngine"
	ReasonProjectNotAllowed = "ProjectNotAllowed"
	defaultJWKSRefresh      = time.Hour
	defaultJWKSMinRefresh   = 30 * time.Second
	clockSkew               = 30 * time.Second
	maxTokenLifetime        = time.Hour + clockSkew
	maxTokenSize            = 16 << 10
)

// DefaultJWKSURL publishes Google's token signing keys.
const DefaultJWKSURL = "https://www.googleapis.com/oauth2/v3/certs"

// VerifierConfig configures the signer half.
type VerifierConfig struct {
	// Projects are the project IDs whose instances may register. Required.
	Projects []string `json:"projects"`
	// AudiencePrefix must match the node's; DefaultAudiencePrefix when
	// empty.
	AudiencePrefix string `json:"audiencePrefix,omitempty"`
	// JWKS configures where Google's keys come from.
	JWKS JWKSConfig `json:"jwks,omitempty"`
}

// JWKSConfig configures the JWKS client.
type JWKSConfig struct {
	// URL is the JWKS; DefaultJWKSURL when empty.
	URL string `json:"url,omitempty"`
	// RefreshSeconds is how long fetched keys are used before they are
	// fetched again; one hour when zero. Keys are also fetched when a token
	// names an unknown key (at most every 30 seconds).
	RefreshSeconds int `json:"refreshSeconds,omitempty"`
	// TLS is the outbound TLS configuration of the JWKS client.
	TLS *tlsconfig.Config `json:"tls,omitempty"`
}

// httpDoer is the JWKS client.
type httpDoer interface {
	Do(*http.Request) (*http.Response, error)
}

// Verifier is the signer half.
type Verifier struct {
	projects []string
	prefix   string
	keys     *keySet
	clock    clock.PassiveClock
}

// NewVerifier returns the signer half.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	var errs []error
	if len(cfg.Projects) == 0 {
		errs = append(errs, errors.New("projects: at least one project ID is required"))
	}
	jwksURL := cfg.JWKS.URL
	if jwksURL == "" {
		jwksURL = DefaultJWKSURL
	}
	if u, err := url.Parse(jwksURL); err != nil || u.Scheme != "https" || u.Host == "" {
		errs = append(errs, fmt.Errorf("jwks.url %q must be an https URL", jwksURL))
	}
	client, err := cfg.JWKS.TLS.HTTPClient(15 * time.Second)
	if err != nil {
		errs = append(errs, fmt.Errorf("jwks.tls: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	refresh := time.Duration(cfg.JWKS.RefreshSeconds) * time.Second
	if refresh <= 0 {
		refresh = defaultJWKSRefresh
	}
	v := &Verifier{projects: cfg.Projects, prefix: cfg.AudiencePrefix, clock: clock.RealClock{}}
	v.keys = &keySet{url: jwksURL, client: client, refresh: refresh, minRefresh: defaultJWKSMinRefresh}
	return v, nil
}

// Versions implements attestor.Verifier.
func (v *Verifier) Versions() []string { return []string{VersionV2, VersionV1} }

// ClusterBound implements attestor.ClusterBinder.
func (v *Verifier) ClusterBound(version string) bool { return clusterBound(version) }

// Verify implements attestor.Verifier.
func (v *Verifier) Verify(ctx context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	var ev Evidence
	if err := attestor.DecodeEvidence(in.Evidence, &ev); err != nil {
		return nil, err
	}
	if ev.Version != VersionV1 && ev.Version != VersionV2 {
		return nil, attestor.Deny(attestor.ReasonUnsupportedEvidenceVersion, "evidence version %q is not %q or %q", ev.Version, VersionV2, VersionV1)
	}
	bindings := in.Bindings(clusterBound(ev.Version))
	claims, err := v.verifyToken(ctx, ev.Token)
	if err != nil {
		return nil, err
	}
	var denials []error
	if len(claims.Audience) != 1 || !attestor.AnyBinding(bindings, func(b []byte) bool { return claims.Audience[0] == Audience(v.prefix, b) }) {
		denials = append(denials, attestor.Deny(ReasonAudienceMismatch,
			"token audience %q does not carry the binding of the CSR key (and, from evidence v2, of this cluster's CA): "+
				"evidence made for another key or another cluster", claims.Audience))
	}
	ce := claims.Google.ComputeEngine
	if ce == nil || ce.ProjectID == "" || ce.Zone == "" || ce.InstanceName == "" || ce.InstanceID == "" {
		denials = append(denials, attestor.Deny(ReasonNotComputeEngine, "the token has no complete google.compute_engine claim (request it with format=full)"))
		return nil, joinDenials(denials)
	}
	if !slices.Contains(v.projects, ce.ProjectID) {
		denials = append(denials, attestor.Deny(ReasonProjectNotAllowed, "project %s is not allowed", ce.ProjectID))
	}
	if ce.InstanceName != in.NodeName {
		denials = append(denials, attestor.Deny(attestor.ReasonNodeNameMismatch, "instance name %q is not the node name %q", ce.InstanceName, in.NodeName))
	}
	if pid := ce.ProviderID(); pid != in.ProviderID {
		denials = append(denials, attestor.Deny(attestor.ReasonAttestedProviderIDMismatch, "the token proves provider ID %q but the CSR claims %q", pid,
			in.ProviderID))
	}
	if err := joinDenials(denials); err != nil {
		return nil, err
	}
	return &attestor.Result{Identity: &attestor.Identity{ProviderID: ce.ProviderID(), Stable: ce.Stable()}}, nil
}

// verifyToken checks the token's signature, issuer and validity window and
// returns its claims. Errors other than a *DenyError are transient.
func (v *Verifier) verifyToken(ctx context.Context, token string) (*Claims, error) {
	if token == "" || len(token) > maxTokenSize {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the identity token is empty or larger than %d bytes", maxTokenSize)
	}
	if strings.Count(token, ".") != 2 {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the identity token is not a compact JWS")
	}
	jws, err := jose.ParseSignedCompact(token, []jose.SignatureAlgorithm{jose.RS256})
	if err != nil {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the identity token is not an RS256 JWT: %v", err)
	}
	if len(jws.Signatures) != 1 || jws.Signatures[0].Header.KeyID == "" {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the identity token names no signing key")
	}
	kid := jws.Signatures[0].Header.KeyID
	key, err := v.keys.key(ctx, kid, v.clock.Now())
	if err != nil {
		return nil, err
	}
	if key == nil {
		return nil, attestor.Deny(ReasonUnknownKey, "the identity token is signed with key %q, which the JWKS does not publish", kid)
	}
	payload, err := jws.Verify(key.Key)
	if err != nil {
		return nil, attestor.Deny(ReasonInvalidSignature, "the identity token does not verify with key %q: %v", kid, err)
	}
	var claims Claims
	if err := attestor.DecodeDocument(payload, &claims, "the identity token claims"); err != nil {
		return nil, err
	}
	if claims.Issuer != Issuer {
		return nil, attestor.Deny(ReasonIssuerMismatch, "token issuer %q is not %s", claims.Issuer, Issuer)
	}
	if claims.IssuedAt == nil || claims.Expiry == nil {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the identity token lacks iat or exp")
	}
	now := v.clock.Now()
	iat, exp := time.Unix(*claims.IssuedAt, 0), time.Unix(*claims.Expiry, 0)
	switch {
	case now.Add(clockSkew).Before(iat):
		return nil, attestor.Deny(ReasonTokenExpired, "the identity token is issued in the future (%s)", iat.UTC().Format(time.RFC3339))
	case now.Add(-clockSkew).After(exp):
		return nil, attestor.Deny(ReasonTokenExpired, "the identity token expired at %s", exp.UTC().Format(time.RFC3339))
	case exp.Sub(iat) > maxTokenLifetime:
		return nil, attestor.Deny(ReasonTokenExpired, "the identity token is valid for %s, longer than Google issues", exp.Sub(iat))
	}
	return &claims, nil
}

// joinDenials folds denials into one *DenyError with the first reason and
// every message.
func joinDenials(denials []error) error {
	if len(denials) == 0 {
		return nil
	}
	first, _ := attestor.AsDenial(denials[0])
	if len(denials) == 1 {
		return first
	}
	msgs := make([]string, len(denials))
	for i, d := range denials {
		msgs[i] = d.Error()
	}
	return &attestor.DenyError{Reason: first.Reason, Message: strings.Join(msgs, "; ")}
}
