package azure

import (
	"context"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/smallstep/pkcs7"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Denial reasons of the Azure verifier.
const (
	ReasonMalformedEvidence      = attestor.ReasonMalformedEvidence
	ReasonInvalidSignature       = "InvalidSignature"
	ReasonUntrustedSigner        = "UntrustedSigner"
	ReasonSignerNameNotAllowed   = "SignerNameNotAllowed"
	ReasonNonceMismatch          = "NonceMismatch"
	ReasonDocumentExpired        = "DocumentExpired"
	ReasonSubscriptionNotAllowed = "SubscriptionNotAllowed"
	ReasonProviderIDMismatch     = attestor.ReasonAttestedProviderIDMismatch
)

// DefaultSignerName is the name the attested document's signing
// certificate must carry (it or a subdomain of it) in Azure's public cloud.
const DefaultSignerName = "metadata.azure.com"

const clockSkew = 60 * time.Second

// VerifierConfig configures the signer half.
type VerifierConfig struct {
	// Roots are PEM files of the CAs the signing certificate must chain to
	// (Microsoft's: DigiCert Global Root G2 and Microsoft TLS RSA Root G2
	// today). Required.
	Roots []string `json:"roots"`
	// Intermediates are PEM files of intermediate CAs. IMDS embeds only the
	// signing certificate, so the issuing CAs (the "Microsoft Azure TLS
	// Issuing CA" / "Microsoft TLS G2 RSA CA" family) must be listed here.
	Intermediates []string `json:"intermediates,omitempty"`
	// SignerNames are the DNS names the signing certificate may carry (the
	// name or a subdomain of it); DefaultSignerName when empty. Azure
	// Government uses metadata.azure.us.
	SignerNames []string `json:"signerNames,omitempty"`
	// Subscriptions are the subscription IDs whose VMs may register.
	// Required.
	Subscriptions []string `json:"subscriptions"`
}

// Verifier is the signer half.
type Verifier struct {
	roots, intermediates *x509.CertPool
	signerNames          []string
	subscriptions        []string
	now                  func() time.Time
}

// NewVerifier returns the signer half.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	v := &Verifier{roots: x509.NewCertPool(), intermediates: x509.NewCertPool(), signerNames: cfg.SignerNames, now: time.Now}
	var errs []error
	if len(cfg.Roots) == 0 {
		errs = append(errs, errors.New("roots: at least one root CA file is required"))
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
func (v *Verifier) Versions() []string { return []string{VersionV1} }

// providerIDRE matches an Azure VM or scale set VM provider ID.
var providerIDRE = regexp.MustCompile(`^azure:///subscriptions/([^/]+)/resourceGroups/([^/]+)/providers/Microsoft\.Compute/(virtualMachines/[^/]+|virtualMachineScaleSets/[^/]+/virtualMachines/[^/]+)$`)

// Verify implements attestor.Verifier.
func (v *Verifier) Verify(ctx context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	var ev Evidence
	if err := attestor.DecodeEvidence(in.Evidence, &ev); err != nil {
		return nil, err
	}
	if ev.Version != VersionV1 {
		return nil, attestor.Deny(attestor.ReasonUnsupportedEvidenceVersion, "evidence version %q is not %q", ev.Version, VersionV1)
	}
	now := v.now()
	doc, err := v.verifyDocument(ev.Signature, now)
	if err != nil {
		return nil, err
	}
	var denials []error
	if doc.Nonce != Nonce(in.Binding) {
		denials = append(denials, attestor.Deny(ReasonNonceMismatch, "the attested document's nonce %q is not derived from the CSR key", doc.Nonce))
	}
	created, expires, err := doc.Window()
	switch {
	case err != nil:
		denials = append(denials, attestor.Deny(ReasonMalformedEvidence, "the attested document's timeStamp does not parse: %v", err))
	case now.Add(clockSkew).Before(created):
		denials = append(denials, attestor.Deny(ReasonDocumentExpired, "the attested document is created in the future (%s)", created.UTC().Format(time.RFC3339)))
	case now.Add(-clockSkew).After(expires):
		denials = append(denials, attestor.Deny(ReasonDocumentExpired, "the attested document expired at %s", expires.UTC().Format(time.RFC3339)))
	}
	sub := strings.ToLower(doc.SubscriptionID)
	if !slices.Contains(v.subscriptions, sub) {
		denials = append(denials, attestor.Deny(ReasonSubscriptionNotAllowed, "subscription %s is not allowed", doc.SubscriptionID))
	}
	m := providerIDRE.FindStringSubmatch(in.ProviderID)
	switch {
	case m == nil:
		denials = append(denials, attestor.Deny(ReasonProviderIDMismatch, "provider ID %q is not an Azure VM provider ID", in.ProviderID))
	case strings.ToLower(m[1]) != sub:
		denials = append(denials, attestor.Deny(ReasonProviderIDMismatch, "provider ID names subscription %s but the attested document %s", m[1], doc.SubscriptionID))
	}
	if doc.VMID == "" {
		denials = append(denials, attestor.Deny(ReasonMalformedEvidence, "the attested document has no vmId"))
	}
	if err := joinDenials(denials); err != nil {
		return nil, err
	}
	return &attestor.Result{Identity: &attestor.Identity{ProviderID: in.ProviderID, Stable: doc.Stable()}}, nil
}

// verifyDocument checks the PKCS#7 signature and the signing certificate's
// chain and name at time at, and returns the signed content.
func (v *Verifier) verifyDocument(signature string, at time.Time) (*AttestedData, error) {
	der, err := base64.StdEncoding.DecodeString(strings.Join(strings.Fields(signature), ""))
	if err != nil || len(der) == 0 {
		return nil, attestor.Deny(ReasonMalformedEvidence, "the attested document's signature is not base64")
	}
	p7, err := pkcs7.Parse(der)
	if err != nil {
		return nil, attestor.Deny(ReasonMalformedEvidence, "unable to parse the attested document's PKCS#7: %v", err)
	}
	if len(p7.Signers) != 1 {
		return nil, attestor.Deny(ReasonMalformedEvidence, "the attested document's PKCS#7 has %d signers, want 1", len(p7.Signers))
	}
	signer := p7.GetOnlySigner()
	if signer == nil {
		return nil, attestor.Deny(ReasonMalformedEvidence, "the attested document's PKCS#7 does not carry its signing certificate")
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
	if _, err := signer.Verify(x509.VerifyOptions{Roots: v.roots, Intermediates: inter, CurrentTime: at, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return nil, attestor.Deny(ReasonUntrustedSigner, "the attested document's signing certificate %q does not chain to a configured root: %v", signer.Subject.CommonName, err)
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
