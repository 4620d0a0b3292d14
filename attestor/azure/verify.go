package azure

import (
	"context"
	"crypto/x509"
	"embed"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/smallstep/pkcs7"
	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tlsconfig"
)

// Denial reasons of the Azure verifier.
const (
	ReasonInvalidSignature       = "InvalidSignature"
	ReasonUntrustedSigner        = "UntrustedSigner"
	ReasonSignerNameNotAllowed   = "SignerNameNotAllowed"
	ReasonNonceMismatch          = "NonceMismatch"
	ReasonDocumentExpired        = "DocumentExpired"
	ReasonSubscriptionNotAllowed = "SubscriptionNotAllowed"
)

// DefaultSignerName is the name the attested document's signing
// certificate must carry (it or a subdomain of it) in Azure's public cloud.
const DefaultSignerName = "metadata.azure.com"

const clockSkew = 60 * time.Second

// builtinRoots holds certs/roots/*.pem: Microsoft's public roots for the
// attested document (see its README).
//
//go:embed certs/roots
var builtinRoots embed.FS

// DefaultIssuerHosts are the hosts the verifier fetches a signing
// certificate's issuing CA from when IssuersConfig.Hosts is empty: where
// Microsoft's and DigiCert's certificates point.
var DefaultIssuerHosts = []string{"www.microsoft.com", "caissuers.microsoft.com", "cacerts.digicert.com"}

// VerifierConfig configures the signer half.
type VerifierConfig struct {
	// Roots are PEM files of the CAs the signing certificate must chain to.
	// Empty means the built-in roots (DigiCert Global Root G2 and
	// Microsoft TLS RSA Root G2, certs/roots); when set they replace them.
	Roots []string `json:"roots,omitempty"`
	// Intermediates are PEM files of intermediate CAs. IMDS embeds only the
	// signing certificate; the issuing CA it names is fetched (see Issuers)
	// unless it is listed here.
	Intermediates []string `json:"intermediates,omitempty"`
	// Issuers configures fetching the issuing CA a signing certificate
	// names (its Authority Information Access "CA Issuers" URL).
	Issuers IssuersConfig `json:"issuers,omitempty"`
	// SignerNames are the DNS names the signing certificate may carry (the
	// name or a subdomain of it); DefaultSignerName when empty. Azure
	// Government uses metadata.azure.us.
	SignerNames []string `json:"signerNames,omitempty"`
	// Subscriptions are the subscription IDs whose VMs may register.
	// Required.
	Subscriptions []string `json:"subscriptions"`
}

// IssuersConfig configures the issuing CA fetcher. A fetched CA is only
// an intermediate: the chain must still end at a root, so a fetch can add
// no trust; the host allowlist keeps the controller from fetching URLs an
// attacker's certificate names.
type IssuersConfig struct {
	// Disabled turns fetching off: every issuing CA must then be in
	// Intermediates.
	Disabled bool `json:"disabled,omitempty"`
	// Hosts are the hosts (host or host:port) a CA Issuers URL may name;
	// DefaultIssuerHosts when empty.
	Hosts []string `json:"hosts,omitempty"`
	// TLS is the outbound TLS configuration for https CA Issuers URLs
	// (Microsoft's are plain http: a CA certificate is checked by its
	// signature, not by how it travelled).
	TLS *tlsconfig.Config `json:"tls,omitempty"`
}

// httpDoer is the issuing CA client.
type httpDoer interface {
	Do(*http.Request) (*http.Response, error)
}

// Verifier is the signer half.
type Verifier struct {
	roots, intermediates *x509.CertPool
	signerNames          []string
	subscriptions        []string
	clock                clock.PassiveClock
	issuers              *issuerCache // nil when fetching is disabled
}

// BuiltinRoots returns the compiled-in roots, PEM files (and their README
// with each one's source and SHA-256).
func BuiltinRoots() fs.FS {
	sub, err := fs.Sub(builtinRoots, "certs/roots")
	if err != nil {
		panic(err) // the embedded directory exists at build time
	}
	return sub
}

// NewVerifier returns the signer half.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	v := &Verifier{roots: x509.NewCertPool(), intermediates: x509.NewCertPool(), signerNames: cfg.SignerNames, clock: clock.RealClock{}}
	var errs []error
	if len(cfg.Roots) == 0 {
		names, _ := fs.Glob(BuiltinRoots(), "*.pem")
		for _, n := range names {
			data, err := fs.ReadFile(BuiltinRoots(), n)
			if err != nil || !v.roots.AppendCertsFromPEM(data) {
				errs = append(errs, fmt.Errorf("built-in root %s does not load", n))
			}
		}
	}
	if !cfg.Issuers.Disabled {
		client, err := cfg.Issuers.TLS.HTTPClient(10 * time.Second)
		if err != nil {
			errs = append(errs, fmt.Errorf("issuers.tls: %w", err))
		}
		hosts := cfg.Issuers.Hosts
		if len(hosts) == 0 {
			hosts = DefaultIssuerHosts
		}
		v.issuers = &issuerCache{client: client, hosts: hosts, certs: map[string]*x509.Certificate{}}
	}
	for _, f := range cfg.Roots {
		if err := appendPEMFile(v.roots, f); err != nil {
			errs = append(errs, fmt.Errorf("roots: %w", err))
		}
	}
	for _, f := range cfg.Intermediates {
		if err := appendPEMFile(v.intermediates, f); err != nil {
			errs = append(errs, fmt.Errorf("intermediates: %w", err))
		}
	}
	if len(v.signerNames) == 0 {
		v.signerNames = []string{DefaultSignerName}
	}
	if len(cfg.Subscriptions) == 0 {
		errs = append(errs, errors.New("subscriptions: at least one subscription ID is required"))
	}
	for _, s := range cfg.Subscriptions {
		v.subscriptions = append(v.subscriptions, strings.ToLower(s))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return v, nil
}

func appendPEMFile(pool *x509.CertPool, name string) error {
	data, err := os.ReadFile(name)
	if err != nil {
		return err
	}
	if !pool.AppendCertsFromPEM(data) {
		return fmt.Errorf("%s: no PEM certificate", name)
	}
	return nil
}

// Versions implements attestor.Verifier.
func (v *Verifier) Versions() []string { return []string{VersionV2, VersionV1} }

// ClusterBound implements attestor.ClusterBinder.
func (v *Verifier) ClusterBound(version string) bool { return clusterBound(version) }

// Regular expressions are compiled on first use, not at package init: the
// node binary links every provider, and the exec plugin's cached path pays
// for each initializer on every call (make bench, BenchmarkCachedPath).
// providerIDRE matches an Azure VM or scale set VM provider ID.
var providerIDRE = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`^azure:///subscriptions/([^/]+)/resourceGroups/([^/]+)/providers/Microsoft\.Compute/(virtualMachines/[^/]+|virtualMachineScaleSets/[^/]+/virtualMachines/[^/]+)$`) //nolint:lll // one regular expression reads better whole
})

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
	now := v.clock.Now()
	doc, err := v.verifyDocument(ctx, ev.Signature, now)
	if err != nil {
		return nil, err
	}
	var denials []error
	if !attestor.AnyBinding(bindings, func(b []byte) bool { return doc.Nonce == Nonce(b) }) {
		denials = append(denials, attestor.Deny(ReasonNonceMismatch,
			"the attested document's nonce %q is not derived from the CSR key (and, from evidence v2, this cluster's CA): "+
				"evidence made for another key or another cluster",
			doc.Nonce))
	}
	created, expires, err := doc.Window()
	switch {
	case err != nil:
		denials = append(denials, attestor.Deny(attestor.ReasonMalformedEvidence, "the attested document's timeStamp does not parse: %v", err))
	case now.Add(clockSkew).Before(created):
		denials = append(denials, attestor.Deny(ReasonDocumentExpired, "the attested document is created in the future (%s)", created.UTC().Format(time.RFC3339)))
	case now.Add(-clockSkew).After(expires):
		denials = append(denials, attestor.Deny(ReasonDocumentExpired, "the attested document expired at %s", expires.UTC().Format(time.RFC3339)))
	}
	sub := strings.ToLower(doc.SubscriptionID)
	if !slices.Contains(v.subscriptions, sub) {
		denials = append(denials, attestor.Deny(ReasonSubscriptionNotAllowed, "subscription %s is not allowed", doc.SubscriptionID))
	}
	m := providerIDRE().FindStringSubmatch(in.ProviderID)
	switch {
	case m == nil:
		denials = append(denials, attestor.Deny(attestor.ReasonAttestedProviderIDMismatch, "provider ID %q is not an Azure VM provider ID", in.ProviderID))
	case strings.ToLower(m[1]) != sub:
		denials = append(denials, attestor.Deny(attestor.ReasonAttestedProviderIDMismatch, "provider ID names subscription %s but the attested document %s", m[1],
			doc.SubscriptionID))
	}
	if doc.VMID == "" {
		denials = append(denials, attestor.Deny(attestor.ReasonMalformedEvidence, "the attested document has no vmId"))
	}
	if err := joinDenials(denials); err != nil {
		return nil, err
	}
	return &attestor.Result{Identity: &attestor.Identity{ProviderID: in.ProviderID, Stable: doc.Stable()}}, nil
}

// verifyDocument checks the PKCS#7 signature and the signing certificate's
// chain and name at time at, and returns the signed content. Errors other
// than a *DenyError (an issuing CA that could not be fetched) are
// transient.
func (v *Verifier) verifyDocument(ctx context.Context, signature string, at time.Time) (*AttestedData, error) {
	der, err := base64.StdEncoding.DecodeString(strings.Join(strings.Fields(signature), ""))
	if err != nil || len(der) == 0 {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the attested document's signature is not base64")
	}
	p7, err := pkcs7.Parse(der)
	if err != nil {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "unable to parse the attested document's PKCS#7: %v", err)
	}
	if len(p7.Signers) != 1 {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the attested document's PKCS#7 has %d signers, want 1", len(p7.Signers))
	}
	signer := p7.GetOnlySigner()
	if signer == nil {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the attested document's PKCS#7 does not carry its signing certificate")
	}
	if err := p7.Verify(); err != nil {
		return nil, attestor.Deny(ReasonInvalidSignature, "the attested document's signature does not verify: %v", err)
	}
	inter := v.intermediates.Clone()
	for _, c := range p7.Certificates {
		if c != signer {
			inter.AddCert(c)
		}
	}
	opts := x509.VerifyOptions{Roots: v.roots, Intermediates: inter, CurrentTime: at, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}
	_, err = signer.Verify(opts)
	// IMDS embeds only the signing certificate: fetch the issuing CAs it
	// (and each fetched CA) names, a few hops at most.
	var unknown x509.UnknownAuthorityError
	for next, hop := []*x509.Certificate{signer}, 0; err != nil && errors.As(err, &unknown) && v.issuers != nil && len(next) > 0 && hop < 3; hop++ {
		var fetched []*x509.Certificate
		for _, c := range next {
			cs, ferr := v.issuers.fetch(ctx, c)
			if ferr != nil {
				return nil, ferr
			}
			fetched = append(fetched, cs...)
		}
		for _, c := range fetched {
			inter.AddCert(c)
		}
		next = fetched
		_, err = signer.Verify(opts)
	}
	if err != nil {
		return nil, attestor.Deny(ReasonUntrustedSigner, "the attested document's signing certificate %q does not chain to a configured root: %v",
			signer.Subject.CommonName, err)
	}
	if !v.signerNameAllowed(signer) {
		return nil, attestor.Deny(ReasonSignerNameNotAllowed, "the attested document is signed by %q (%s), not by the metadata service (%s)",
			signer.Subject.CommonName, strings.Join(signer.DNSNames, ", "), strings.Join(v.signerNames, ", "))
	}
	var doc AttestedData
	if err := attestor.DecodeDocument(p7.Content, &doc, "the attested data"); err != nil {
		return nil, err
	}
	return &doc, nil
}

func (v *Verifier) signerNameAllowed(c *x509.Certificate) bool {
	for _, dns := range c.DNSNames {
		dns = strings.ToLower(dns)
		for _, n := range v.signerNames {
			n = strings.ToLower(n)
			if dns == n || strings.HasSuffix(dns, "."+n) {
				return true
			}
		}
	}
	return false
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

// issuerCache fetches and keeps the issuing CAs that certificates name.
type issuerCache struct {
	client httpDoer
	hosts  []string

	mu    sync.Mutex
	certs map[string]*x509.Certificate // URL -> CA certificate
}

// maxIssuers bounds the cache: Azure has a handful of issuing CAs.
const maxIssuers = 64

// fetch returns the CA certificates c's CA Issuers URLs name, from the
// cache or fetched. A URL on a host not allowed is a denial; one that
// cannot be fetched is a transient error.
func (ic *issuerCache) fetch(ctx context.Context, c *x509.Certificate) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	var lastErr error
	for _, raw := range c.IssuingCertificateURL {
		u, err := url.Parse(raw)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || !slices.Contains(ic.hosts, u.Host) {
			lastErr = attestor.Deny(ReasonUntrustedSigner, "certificate %q names issuing CA URL %q, whose host is not one the verifier fetches from (issuers.hosts)",
				c.Subject.CommonName, raw)
			continue
		}
		ic.mu.Lock()
		ca, ok := ic.certs[raw]
		ic.mu.Unlock()
		if !ok {
			if ca, err = ic.get(ctx, raw); err != nil {
				lastErr = err
				continue
			}
			ic.mu.Lock()
			if len(ic.certs) >= maxIssuers {
				clear(ic.certs)
			}
			ic.certs[raw] = ca
			ic.mu.Unlock()
		}
		out = append(out, ca)
		break // one URL per certificate is enough; the others are mirrors
	}
	if len(out) == 0 && lastErr != nil {
		return nil, lastErr
	}
	return out, nil
}

func (ic *issuerCache) get(ctx context.Context, raw string) (*x509.Certificate, error) {
	r, err := http.NewRequestWithContext(ctx, http.MethodGet, raw, nil)
	if err != nil {
		return nil, err
	}
	resp, err := ic.client.Do(r)
	if err != nil {
		return nil, fmt.Errorf("unable to fetch issuing CA %s: %w", raw, err)
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode >= 500:
		return nil, fmt.Errorf("issuing CA %s: %s", raw, resp.Status) // the host's trouble: retried
	case resp.StatusCode != http.StatusOK:
		// The URL comes from the node's own certificate: a path the host
		// does not serve is the node's to answer for, not retried.
		return nil, attestor.Deny(ReasonUntrustedSigner, "issuing CA URL %s named by the document's signing certificate answers %s", raw, resp.Status)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return nil, fmt.Errorf("unable to read issuing CA %s: %w", raw, err)
	}
	if b, _ := pem.Decode(body); b != nil && b.Type == "CERTIFICATE" {
		body = b.Bytes
	}
	ca, err := x509.ParseCertificate(body)
	if err != nil || !ca.IsCA {
		return nil, attestor.Deny(ReasonUntrustedSigner, "issuing CA URL %s named by the document's signing certificate serves no CA certificate (%v)", raw, err)
	}
	return ca, nil
}
