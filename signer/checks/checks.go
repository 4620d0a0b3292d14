// Package checks holds the structural rules a kubelet client
// CertificateSigningRequest must follow before the signer looks at its
// evidence or at Cluster API: who may ask, what the subject, usages, key and
// extensions may be, and that spec.request follows the wire contract.
//
// Check runs every rule and reports every failure at once, so that one
// denial message tells a person everything that is wrong with a request.
// It never talks to an API server and never logs.
package checks

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"encoding/asn1"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Reasons of failed checks. Each is used as the reason of the CSR's Denied
// condition when it is the first failure.
const (
	// ReasonUnknownSigner: the signer name is not one of this project's
	// kubelet client signer names.
	ReasonUnknownSigner = "UnknownSigner"
	// ReasonRequesterNotAllowed: spec.username is neither a bootstrap token
	// identity nor a node.
	ReasonRequesterNotAllowed = "RequesterNotAllowed"
	// ReasonRequesterMismatch: a node asked for a certificate of another node.
	ReasonRequesterMismatch = "RequesterMismatch"
	// ReasonMalformedRequest: spec.request does not follow the wire contract
	// (PEM framing, PKCS#10, provider block, evidence header) or its
	// signature does not verify.
	ReasonMalformedRequest = "MalformedRequest"
	// ReasonProviderMismatch: the provider block names another provider than
	// the signer name.
	ReasonProviderMismatch = "ProviderMismatch"
	// ReasonSubjectMismatch: the subject is not CN=system:node:<name>,
	// O=system:nodes and nothing else.
	ReasonSubjectMismatch = "SubjectMismatch"
	// ReasonUsagesNotAllowed: spec.usages is not exactly digital signature
	// and client auth (plus key encipherment for RSA keys).
	ReasonUsagesNotAllowed = "UsagesNotAllowed"
	// ReasonUnexpectedSAN: the request carries subject alternative names.
	ReasonUnexpectedSAN = "UnexpectedSAN"
	// ReasonCARequested: the request asks for a CA certificate.
	ReasonCARequested = "CARequested"
	// ReasonProviderIDMissing: the request has no provider ID extension.
	ReasonProviderIDMissing = "ProviderIDMissing"
	// ReasonProviderIDMalformed: the provider ID extension is not a single
	// non-critical UTF8String.
	ReasonProviderIDMalformed = "ProviderIDMalformed"
	// ReasonKeyNotAllowed: the key is neither ECDSA P-256 nor RSA of at least
	// MinRSABits bits.
	ReasonKeyNotAllowed = "KeyNotAllowed"
)

// Identity prefixes and groups of the requesters the signer accepts.
const (
	NodeUserPrefix       = "system:node:"
	NodesGroup           = "system:nodes"
	BootstrapUserPrefix  = "system:bootstrap:"
	BootstrappersGroup   = "system:bootstrappers"
	MinRSABits           = 2048
	MaxRSABits           = 8192
	maxProviderIDLength  = 512 // Machine spec.providerID's limit
	maxReportedSANsShown = 5
)

var (
	oidCommonName       = asn1.ObjectIdentifier{2, 5, 4, 3}
	oidOrganization     = asn1.ObjectIdentifier{2, 5, 4, 10}
	oidSubjectAltName   = asn1.ObjectIdentifier{2, 5, 29, 17}
	oidBasicConstraints = asn1.ObjectIdentifier{2, 5, 29, 19}
	oidNameConstraints  = asn1.ObjectIdentifier{2, 5, 29, 30}

	// bootstrapTokenIDRE is the token-id part of a bootstrap token
	// (k8s.io/cluster-bootstrap: [a-z0-9]{6}).
	bootstrapTokenIDRE = regexp.MustCompile(`^[a-z0-9]{6}$`)
)

// Failure is one failed check. Check returns failures joined with
// errors.Join; use Failures or Denial to take them apart.
type Failure struct {
	// Reason is a CamelCase word, one of the Reason constants.
	Reason string
	// Message says what is wrong and what to do about it.
	Message string
}

func (f *Failure) Error() string { return f.Reason + ": " + f.Message }

func failf(reason, format string, args ...any) *Failure {
	return &Failure{Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// Failures returns every *Failure in err (as joined by errors.Join, at any
// depth), in order.
func Failures(err error) []*Failure {
	var out []*Failure
	var walk func(error)
	walk = func(e error) {
		if e == nil {
			return
		}
		if f, ok := e.(*Failure); ok {
			out = append(out, f)
			return
		}
		switch u := e.(type) {
		case interface{ Unwrap() []error }:
			for _, c := range u.Unwrap() {
				walk(c)
			}
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		}
	}
	walk(err)
	return out
}

// Denial turns the error returned by Check into a condition reason (the
// first failure's) and a message listing every failure. ok is false when err
// holds no *Failure.
func Denial(err error) (reason, message string, ok bool) {
	fs := Failures(err)
	if len(fs) == 0 {
		return "", "", false
	}
	parts := make([]string, len(fs))
	for i, f := range fs {
		parts[i] = f.Error()
	}
	if len(fs) == 1 {
		return fs[0].Reason, fs[0].Message, true
	}
	return fs[0].Reason, fmt.Sprintf("%d checks failed: %s", len(fs), strings.Join(parts, "; ")), true
}

// Checked is what a request that passed every check says about itself.
type Checked struct {
	// Request is the parsed spec.request.
	Request *attestor.AttestedRequest
	// Provider is the provider name, from the signer name and the provider
	// block (which agree).
	Provider string
	// NodeName is the node name from the subject.
	NodeName string
	// ProviderID is the provider ID from the CSR extension.
	ProviderID string
	// Binding is attestor.Binding of the CSR key.
	Binding []byte
	// Renewal is true when a node asked for its own certificate, false for a
	// bootstrap token.
	Renewal bool
	// Usages are the requested usages (already checked).
	Usages []certificatesv1.KeyUsage
	// RequestedDuration is spec.expirationSeconds, or 0 when unset. The
	// signer caps it; it is never a reason to deny.
	RequestedDuration time.Duration
}

// Check runs every structural check on csr. It returns the Checked request
// when all pass; otherwise a nil Checked and an error joining one *Failure
// per failed check.
func Check(csr *certificatesv1.CertificateSigningRequest) (*Checked, error) {
	var fails []error
	add := func(f *Failure) { fails = append(fails, f) }

	spec := &csr.Spec
	provider, ok := strings.CutPrefix(spec.SignerName, attestor.ClientSignerPrefix)
	if !ok || !attestor.ValidProviderName(provider) {
		add(failf(ReasonUnknownSigner, "signer name %q is not a kubelet client signer of this controller (%s<provider>)", spec.SignerName, attestor.ClientSignerPrefix))
		provider = ""
	}

	// The requester: a bootstrap token, or a node renewing. Which node is
	// compared with the subject below.
	requesterNode, renewal := "", false
	switch {
	case strings.HasPrefix(spec.Username, BootstrapUserPrefix):
		id := strings.TrimPrefix(spec.Username, BootstrapUserPrefix)
		if !bootstrapTokenIDRE.MatchString(id) || !slices.Contains(spec.Groups, BootstrappersGroup) {
			add(failf(ReasonRequesterNotAllowed, "requester %q is not a bootstrap token identity (system:bootstrap:<token-id> in group %s)", spec.Username, BootstrappersGroup))
		}
	case strings.HasPrefix(spec.Username, NodeUserPrefix):
		requesterNode = strings.TrimPrefix(spec.Username, NodeUserPrefix)
		renewal = true
		if !slices.Contains(spec.Groups, NodesGroup) {
			add(failf(ReasonRequesterNotAllowed, "requester %q is not in group %s", spec.Username, NodesGroup))
		}
	default:
		add(failf(ReasonRequesterNotAllowed, "requester %q may not ask for a kubelet client certificate: only bootstrap tokens (%s<id>) and nodes renewing their own certificate (%s<name>) may", spec.Username, BootstrapUserPrefix, NodeUserPrefix))
	}

	usages, rsaOnly := checkUsages(spec.Usages)

	req, err := attestor.ParseRequest(spec.Request)
	if err != nil {
		add(failf(ReasonMalformedRequest, "spec.request does not follow the wire contract: %v", err))
		// Everything else needs the parsed request; report what we have.
		if usages != nil {
			add(usages)
		}
		return nil, errors.Join(fails...)
	}
	x := req.CSR

	if provider != "" && req.Provider != provider {
		add(failf(ReasonProviderMismatch, "the provider block names %q but the signer name %q is for %q", req.Provider, spec.SignerName, provider))
	}
	if err := x.CheckSignature(); err != nil {
		add(failf(ReasonMalformedRequest, "the PKCS#10 signature does not verify: %v", err))
	}

	nodeName, subjFails := checkSubject(x)
	for _, f := range subjFails {
		add(f)
	}
	if renewal && nodeName != "" && requesterNode != nodeName {
		add(failf(ReasonRequesterMismatch, "node %q may renew only its own certificate, not one for %q", requesterNode, nodeName))
	}

	isRSA := false
	switch k := x.PublicKey.(type) {
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() {
			add(failf(ReasonKeyNotAllowed, "ECDSA key on curve %s: use P-256", k.Curve.Params().Name))
		}
	case *rsa.PublicKey:
		isRSA = true
		if n := k.N.BitLen(); n < MinRSABits || n > MaxRSABits {
			add(failf(ReasonKeyNotAllowed, "RSA key of %d bits: use ECDSA P-256 (or RSA of %d to %d bits)", n, MinRSABits, MaxRSABits))
		}
	default:
		add(failf(ReasonKeyNotAllowed, "%s key: use ECDSA P-256", x.PublicKeyAlgorithm))
	}
	if usages != nil {
		add(usages)
	} else if rsaOnly && !isRSA {
		add(failf(ReasonUsagesNotAllowed, "usage %q is allowed only for RSA keys: request %q and %q", certificatesv1.UsageKeyEncipherment, certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth))
	}

	if f := checkSANs(x); f != nil {
		add(f)
	}
	if f := checkCA(x); f != nil {
		add(f)
	}

	providerID, f := checkProviderID(x)
	if f != nil {
		add(f)
	}

	if len(fails) > 0 {
		return nil, errors.Join(fails...)
	}
	var d time.Duration
	if spec.ExpirationSeconds != nil && *spec.ExpirationSeconds > 0 {
		d = time.Duration(*spec.ExpirationSeconds) * time.Second
	}
	return &Checked{
		Request:           req,
		Provider:          req.Provider,
		NodeName:          nodeName,
		ProviderID:        providerID,
		Binding:           attestor.Binding(x.RawSubjectPublicKeyInfo),
		Renewal:           renewal,
		Usages:            slices.Clone(spec.Usages),
		RequestedDuration: d,
	}, nil
}

// checkUsages returns a failure when usages is not an allowed set, and
// rsaOnly when the set is allowed only for RSA keys.
func checkUsages(usages []certificatesv1.KeyUsage) (fail *Failure, rsaOnly bool) {
	seen := map[certificatesv1.KeyUsage]bool{}
	for _, u := range usages {
		seen[u] = true
	}
	want := "exactly [" + string(certificatesv1.UsageDigitalSignature) + ", " + string(certificatesv1.UsageClientAuth) + "] (plus " + string(certificatesv1.UsageKeyEncipherment) + " for RSA keys)"
	if !seen[certificatesv1.UsageDigitalSignature] || !seen[certificatesv1.UsageClientAuth] {
		return failf(ReasonUsagesNotAllowed, "usages %v: request %s", usages, want), false
	}
	var extra []string
	for u := range seen {
		switch u {
		case certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth:
		case certificatesv1.UsageKeyEncipherment:
			rsaOnly = true
		default:
			extra = append(extra, string(u))
		}
	}
	if len(extra) > 0 {
		slices.Sort(extra)
		return failf(ReasonUsagesNotAllowed, "usages %v include %s, not allowed for a kubelet client certificate: request %s", usages, strings.Join(extra, ", "), want), false
	}
	return nil, rsaOnly
}

// checkSubject returns the node name of a subject that is exactly
// CN=system:node:<name>, O=system:nodes, and failures otherwise. The node
// name is returned when the CN alone is well formed.
func checkSubject(x *x509.CertificateRequest) (string, []*Failure) {
	var fails []*Failure
	cn := x.Subject.CommonName
	name, ok := strings.CutPrefix(cn, NodeUserPrefix)
	if !ok {
		fails = append(fails, failf(ReasonSubjectMismatch, "subject CN %q must be %s<node name>", cn, NodeUserPrefix))
		name = ""
	} else if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		fails = append(fails, failf(ReasonSubjectMismatch, "node name %q in the subject CN is not a valid node name: %s", name, strings.Join(errs, "; ")))
		name = ""
	}
	if !slices.Equal(x.Subject.Organization, []string{NodesGroup}) {
		fails = append(fails, failf(ReasonSubjectMismatch, "subject O %q must be exactly [%q]", x.Subject.Organization, NodesGroup))
	}
	// Every attribute of the subject, whatever Go's parser knows about:
	// exactly one CN and one O.
	// A repeated O shows up in Organization and fails above.
	var cnCount int
	var others []string
	for _, atv := range x.Subject.Names {
		switch {
		case atv.Type.Equal(oidCommonName):
			cnCount++
		case atv.Type.Equal(oidOrganization):
		default:
			others = append(others, atv.Type.String())
		}
	}
	if cnCount > 1 {
		fails = append(fails, failf(ReasonSubjectMismatch, "subject has %d CN attributes, want one", cnCount))
	}
	if len(others) > 0 {
		fails = append(fails, failf(ReasonSubjectMismatch, "subject has attributes other than CN and O (%s): remove them", strings.Join(others, ", ")))
	}
	return name, fails
}

func checkSANs(x *x509.CertificateRequest) *Failure {
	var sans []string
	for _, n := range x.DNSNames {
		sans = append(sans, "DNS:"+n)
	}
	for _, n := range x.EmailAddresses {
		sans = append(sans, "email:"+n)
	}
	for _, n := range x.IPAddresses {
		sans = append(sans, "IP:"+n.String())
	}
	for _, n := range x.URIs {
		sans = append(sans, "URI:"+n.String())
	}
	hasExt := false
	for _, e := range x.Extensions {
		if e.Id.Equal(oidSubjectAltName) {
			hasExt = true
		}
	}
	if len(sans) == 0 && !hasExt {
		return nil
	}
	if len(sans) == 0 {
		return failf(ReasonUnexpectedSAN, "the request has a subject alternative name extension: a kubelet client certificate carries no SANs")
	}
	if len(sans) > maxReportedSANsShown {
		sans = append(sans[:maxReportedSANsShown], "...")
	}
	return failf(ReasonUnexpectedSAN, "the request has subject alternative names (%s): a kubelet client certificate carries no SANs", strings.Join(sans, ", "))
}

// basicConstraints is RFC 5280's BasicConstraints.
type basicConstraints struct {
	IsCA       bool `asn1:"optional"`
	MaxPathLen int  `asn1:"optional,default:-1"`
}

func checkCA(x *x509.CertificateRequest) *Failure {
	for _, e := range x.Extensions {
		switch {
		case e.Id.Equal(oidBasicConstraints):
			var bc basicConstraints
			rest, err := asn1.Unmarshal(e.Value, &bc)
			if err != nil || len(rest) != 0 {
				return failf(ReasonCARequested, "the request has a malformed basicConstraints extension: remove it")
			}
			if bc.IsCA {
				return failf(ReasonCARequested, "the request asks for a CA certificate (basicConstraints cA=true): a kubelet client certificate is never a CA")
			}
		case e.Id.Equal(oidNameConstraints):
			return failf(ReasonCARequested, "the request has a nameConstraints extension, which only CA certificates carry: remove it")
		}
	}
	return nil
}

func checkProviderID(x *x509.CertificateRequest) (string, *Failure) {
	present := false
	for _, e := range x.Extensions {
		if e.Id.Equal(attestor.OIDProviderID) {
			present = true
		}
	}
	if !present {
		return "", failf(ReasonProviderIDMissing, "the request has no provider ID extension (%s): the node must state its provider ID", attestor.OIDProviderID)
	}
	id, err := attestor.ProviderIDFromExtensions(x.Extensions)
	if err != nil {
		return "", failf(ReasonProviderIDMalformed, "%v", err)
	}
	if len(id) > maxProviderIDLength {
		return "", failf(ReasonProviderIDMalformed, "provider ID is %d bytes, more than the %d a Machine's spec.providerID holds", len(id), maxProviderIDLength)
	}
	return id, nil
}
