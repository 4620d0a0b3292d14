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
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"encoding/asn1"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"regexp"
	"slices"
	"strings"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

const (
	// MinRSABits is the smallest RSA key a CSR may carry.
	MinRSABits = 2048
	// MaxRSABits is the largest RSA key a CSR may carry.
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

func failf(reason, format string, args ...any) *attestor.DenyError {
	return &attestor.DenyError{Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// Kind is the kind of certificate a signer name issues; it decides which
// structural rules apply.
type Kind string

const (
	// Client is a kubelet client certificate: requested by a bootstrap
	// token or by the node renewing its own, no SANs, client auth.
	Client Kind = "client"
	// Serving is a kubelet serving certificate: requested only by the node
	// itself, DNS and IP SANs (which the signer compares with the
	// Machine's addresses), server auth.
	Serving Kind = "serving"
)

// Rules says which structural rules a request must follow.
type Rules struct {
	// Kind is the certificate kind.
	Kind Kind
	// Attested is true when spec.request follows the wire contract
	// (PKCS#10 plus provider and evidence blocks, a provider ID extension)
	// for Provider; false for a plain PKCS#10 request (kubelet's own
	// kubernetes.io/kubelet-serving).
	Attested bool
	// Provider is the provider the signer name is for, when Attested.
	Provider string
}

// Checked is what a request that passed every check says about itself.
type Checked struct {
	// CSR is the parsed PKCS#10 request.
	CSR *x509.CertificateRequest
	// Request is the parsed spec.request, when the rules are Attested.
	Request *attestor.AttestedRequest
	// NodeName is the node name from the subject.
	NodeName string
	// ProviderID is the provider ID from the CSR extension ("" for a plain
	// request).
	ProviderID string
	// Binding is attestor.Binding of the CSR key.
	Binding []byte
	// Renewal is true when a node asked for its own certificate, false for a
	// bootstrap token.
	Renewal bool
	// Usages are the requested (and checked) usages.
	Usages []certificatesv1.KeyUsage
	// RequestedDuration is spec.expirationSeconds, or 0 when unset. The
	// signer caps it; it is never a reason to deny.
	RequestedDuration time.Duration
}

// Check runs every structural rule of r on csr. It returns the Checked
// request when all pass; otherwise a nil Checked and an error joining one
// *attestor.DenyError per failed rule.
func Check(csr *certificatesv1.CertificateSigningRequest, r Rules) (*Checked, error) {
	var fails []error
	// add keeps every denial given, and ignores nil ones.
	add := func(fs ...*attestor.DenyError) {
		for _, f := range fs {
			if f != nil {
				fails = append(fails, f)
			}
		}
	}
	spec := &csr.Spec

	// The requester: a bootstrap token (client certificates only), or the
	// node itself. Which node is compared with the subject below.
	requesterNode, renewal, f := checkRequester(spec, r.Kind)
	add(f)

	// The annotations the signer reads are bounded as spec.request is: the
	// controller caches no more of one (signer/controller).
	for _, k := range attestor.RequestAnnotations() {
		if v, ok := csr.Annotations[k]; ok && len(v) > attestor.MaxAnnotationSize {
			add(failf(attestor.ReasonMalformedRequest, "annotation %s is larger than the %d bytes the signer reads; file a request without it", k,
				attestor.MaxAnnotationSize))
		}
	}

	usages, rsaOnly := checkUsages(spec.Usages, r.Kind)

	x, req, f := parseRequest(spec, r)
	add(f)
	if x == nil {
		// Everything else needs the parsed request; report what we have.
		add(usages)
		return nil, errors.Join(fails...)
	}
	if err := x.CheckSignature(); err != nil {
		add(failf(attestor.ReasonMalformedRequest, "the PKCS#10 signature does not verify: %v", err))
	}

	nodeName, subjFails := checkSubject(x)
	add(subjFails...)
	if renewal && nodeName != "" && requesterNode != nodeName {
		add(failf(attestor.ReasonRequesterMismatch, "node %q may ask only for its own certificate, not one for %q", requesterNode, nodeName))
	}

	isRSA, f := checkKey(x)
	add(f)
	if usages != nil {
		add(usages)
	} else if rsaOnly && !isRSA {
		add(failf(attestor.ReasonUsagesNotAllowed, "usage %q is allowed only for RSA keys: request %q and %q", certificatesv1.UsageKeyEncipherment,
			certificatesv1.UsageDigitalSignature, authUsage(r.Kind)))
	}

	if r.Kind == Client {
		add(checkNoSANs(x))
	} else {
		add(checkServingSANTypes(x)...)
	}
	add(checkCA(x))

	var providerID string
	if r.Attested {
		providerID, f = checkProviderID(x)
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
		CSR:               x,
		Request:           req,
		NodeName:          nodeName,
		ProviderID:        providerID,
		Binding:           attestor.Binding(x.RawSubjectPublicKeyInfo),
		Renewal:           renewal,
		Usages:            slices.Clone(spec.Usages),
		RequestedDuration: d,
	}, nil
}

// checkRequester says which node asks (empty for a bootstrap token), and
// whether it renews its own certificate; f says why the requester may not
// ask for a certificate of kind k.
func checkRequester(spec *certificatesv1.CertificateSigningRequestSpec, k Kind) (requesterNode string, renewal bool, f *attestor.DenyError) {
	switch {
	case k == Client && strings.HasPrefix(spec.Username, attestor.BootstrapUserPrefix):
		id := strings.TrimPrefix(spec.Username, attestor.BootstrapUserPrefix)
		if !bootstrapTokenIDRE.MatchString(id) || !slices.Contains(spec.Groups, attestor.BootstrappersGroup) {
			return "", false, failf(attestor.ReasonRequesterNotAllowed, "requester %q is not a bootstrap token identity (system:bootstrap:<token-id> in group %s)",
				spec.Username, attestor.BootstrappersGroup)
		}
		return "", false, nil
	case strings.HasPrefix(spec.Username, attestor.NodeUserPrefix):
		requesterNode = strings.TrimPrefix(spec.Username, attestor.NodeUserPrefix)
		if !slices.Contains(spec.Groups, attestor.NodesGroup) {
			f = failf(attestor.ReasonRequesterNotAllowed, "requester %q is not in group %s", spec.Username, attestor.NodesGroup)
		}
		return requesterNode, true, f
	case k == Client:
		return "", false, failf(attestor.ReasonRequesterNotAllowed,
			"requester %q may not ask for a kubelet client certificate: only bootstrap tokens (%s<id>) and nodes renewing their own certificate (%s<name>) may",
			spec.Username, attestor.BootstrapUserPrefix, attestor.NodeUserPrefix)
	default:
		return "", false, failf(attestor.ReasonRequesterNotAllowed,
			"requester %q may not ask for a kubelet serving certificate: "+
				"only the node itself (%s<name>, with a client certificate it was issued) may, never a bootstrap identity",
			spec.Username, attestor.NodeUserPrefix)
	}
}

// parseRequest parses spec.request: under the wire contract for an
// attested signer (the CSR and the evidence), as a plain PKCS#10 request
// otherwise. x is nil when it does not parse.
func parseRequest(spec *certificatesv1.CertificateSigningRequestSpec, r Rules) (*x509.CertificateRequest, *attestor.AttestedRequest, *attestor.DenyError) {
	if !r.Attested {
		x, err := parsePlain(spec.Request)
		if err != nil {
			return nil, nil, failf(attestor.ReasonMalformedRequest, "spec.request: %v", err)
		}
		return x, nil, nil
	}
	req, err := attestor.ParseRequest(spec.Request)
	if d, ok := attestor.AsDenial(err); ok {
		return nil, nil, d // the evidence decoder's own reason
	}
	if err != nil {
		return nil, nil, failf(attestor.ReasonMalformedRequest, "spec.request does not follow the wire contract: %v", err)
	}
	if req.Provider != r.Provider {
		return req.CSR, req, failf(attestor.ReasonProviderMismatch, "the provider block names %q but the signer name %q is for %q", req.Provider, spec.SignerName,
			r.Provider)
	}
	return req.CSR, req, nil
}

// checkKey allows ECDSA P-256 keys and RSA keys of MinRSABits to
// MaxRSABits.
func checkKey(x *x509.CertificateRequest) (isRSA bool, f *attestor.DenyError) {
	switch k := x.PublicKey.(type) {
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() {
			return false, failf(attestor.ReasonKeyNotAllowed, "ECDSA key on curve %s: use P-256", k.Curve.Params().Name)
		}
		return false, nil
	case *rsa.PublicKey:
		if n := k.N.BitLen(); n < MinRSABits || n > MaxRSABits {
			return true, failf(attestor.ReasonKeyNotAllowed, "RSA key of %d bits: use ECDSA P-256 (or RSA of %d to %d bits)", n, MinRSABits, MaxRSABits)
		}
		return true, nil
	default:
		return false, failf(attestor.ReasonKeyNotAllowed, "%s key: use ECDSA P-256", x.PublicKeyAlgorithm)
	}
}

func authUsage(k Kind) certificatesv1.KeyUsage {
	if k == Serving {
		return certificatesv1.UsageServerAuth
	}
	return certificatesv1.UsageClientAuth
}

// checkUsages returns a failure when usages is not the allowed set of the
// kind, and rsaOnly when the set is allowed only for RSA keys.
func checkUsages(usages []certificatesv1.KeyUsage, k Kind) (fail *attestor.DenyError, rsaOnly bool) {
	auth := authUsage(k)
	seen := map[certificatesv1.KeyUsage]bool{}
	for _, u := range usages {
		seen[u] = true
	}
	want := fmt.Sprintf("exactly [%s, %s] (plus %s for RSA keys)", certificatesv1.UsageDigitalSignature, auth, certificatesv1.UsageKeyEncipherment)
	if !seen[certificatesv1.UsageDigitalSignature] || !seen[auth] || len(seen) != len(usages) {
		return failf(attestor.ReasonUsagesNotAllowed, "usages %v: request %s, each once", usages, want), false
	}
	var extra []string
	for u := range seen {
		switch u {
		case certificatesv1.UsageDigitalSignature, auth:
		case certificatesv1.UsageKeyEncipherment:
			rsaOnly = true
		default:
			extra = append(extra, string(u))
		}
	}
	if len(extra) > 0 {
		slices.Sort(extra)
		return failf(attestor.ReasonUsagesNotAllowed, "usages %v include %s, not allowed for a kubelet %s certificate: request %s", usages, strings.Join(extra, ", "),
			k, want), false
	}
	return nil, rsaOnly
}

// CheckMachineAddresses requires every DNS and IP SAN of a serving request
// to be one of the Machine's addresses (DNS names compared without case).
// machine names it in the message ("Machine namespace/name", or the
// standalone allowlist entry: engine.Machine.Describe).
func CheckMachineAddresses(x *x509.CertificateRequest, machine string, dnsNames []string, ips []net.IP) error {
	var foreign []string
	for _, n := range x.DNSNames {
		if !slices.ContainsFunc(dnsNames, func(d string) bool { return strings.EqualFold(d, n) }) {
			foreign = append(foreign, "DNS:"+n)
		}
	}
	for _, ip := range x.IPAddresses {
		if !slices.ContainsFunc(ips, ip.Equal) {
			foreign = append(foreign, "IP:"+ip.String())
		}
	}
	if len(foreign) == 0 {
		return nil
	}
	shown := make([]string, len(ips))
	for i, ip := range ips {
		shown[i] = ip.String()
	}
	return failf(attestor.ReasonSANNotMachineAddress,
		"subject alternative names %s are not addresses of %s (DNS %q, IP %q); request only the node's own addresses",
		strings.Join(foreign, ", "), machine, dnsNames, shown)
}

// checkServingSANTypes requires at least one DNS or IP SAN and no others.
func checkServingSANTypes(x *x509.CertificateRequest) []*attestor.DenyError {
	var out []*attestor.DenyError
	var bad []string
	for _, e := range x.EmailAddresses {
		bad = append(bad, "email:"+e)
	}
	for _, u := range x.URIs {
		bad = append(bad, "URI:"+u.String())
	}
	if len(bad) > 0 {
		out = append(out, failf(attestor.ReasonSANTypeNotAllowed,
			"subject alternative names %s are not allowed: a kubelet serving certificate carries only DNS and IP SANs", strings.Join(bad, ", ")))
	}
	if len(x.DNSNames)+len(x.IPAddresses) == 0 {
		out = append(out, failf(attestor.ReasonNoSANs, "the request names no DNS or IP address: request the node's addresses as SANs"))
	}
	return out
}

// RequestedNodeName returns the node name a request asks a certificate for
// (the CN of its first PEM block, a PKCS#10 request, less the
// system:node: prefix), without checking anything else: for counting a
// requester's requests per node, never for deciding one.
func RequestedNodeName(request []byte) (string, bool) {
	block, _ := pem.Decode(request)
	if block == nil || block.Type != attestor.PEMTypeCSR {
		return "", false
	}
	x, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return "", false
	}
	return strings.CutPrefix(x.Subject.CommonName, attestor.NodeUserPrefix)
}

// parsePlain parses spec.request of a kubernetes.io signer: one PKCS#10
// PEM block and nothing else.
func parsePlain(b []byte) (*x509.CertificateRequest, error) {
	block, rest := pem.Decode(b)
	if block == nil || block.Type != attestor.PEMTypeCSR {
		return nil, errors.New("not a PEM-encoded CERTIFICATE REQUEST")
	}
	if len(bytes.TrimSpace(rest)) != 0 {
		return nil, errors.New("data after the CERTIFICATE REQUEST block")
	}
	x, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("unable to parse the PKCS#10 request: %w", err)
	}
	return x, nil
}

// checkSubject returns the node name of a subject that is exactly
// CN=system:node:<name>, O=system:nodes, and failures otherwise. The node
// name is returned when the CN alone is well formed.
func checkSubject(x *x509.CertificateRequest) (string, []*attestor.DenyError) {
	var fails []*attestor.DenyError
	cn := x.Subject.CommonName
	name, ok := strings.CutPrefix(cn, attestor.NodeUserPrefix)
	if !ok {
		fails = append(fails, failf(attestor.ReasonSubjectMismatch, "subject CN %q must be %s<node name>", cn, attestor.NodeUserPrefix))
		name = ""
	} else if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		fails = append(fails, failf(attestor.ReasonSubjectMismatch, "node name %q in the subject CN is not a valid node name: %s", name, strings.Join(errs, "; ")))
		name = ""
	}
	if !slices.Equal(x.Subject.Organization, []string{attestor.NodesGroup}) {
		fails = append(fails, failf(attestor.ReasonSubjectMismatch, "subject O %q must be exactly [%q]", x.Subject.Organization, attestor.NodesGroup))
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
		fails = append(fails, failf(attestor.ReasonSubjectMismatch, "subject has %d CN attributes, want one", cnCount))
	}
	if len(others) > 0 {
		fails = append(fails, failf(attestor.ReasonSubjectMismatch, "subject has attributes other than CN and O (%s): remove them", strings.Join(others, ", ")))
	}
	return name, fails
}

func checkNoSANs(x *x509.CertificateRequest) *attestor.DenyError {
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
		return failf(attestor.ReasonUnexpectedSAN, "the request has a subject alternative name extension: a kubelet client certificate carries no SANs")
	}
	if len(sans) > maxReportedSANsShown {
		sans = append(sans[:maxReportedSANsShown], "...")
	}
	return failf(attestor.ReasonUnexpectedSAN, "the request has subject alternative names (%s): a kubelet client certificate carries no SANs", strings.Join(sans,
		", "))
}

// basicConstraints is RFC 5280's BasicConstraints.
type basicConstraints struct {
	IsCA       bool `asn1:"optional"`
	MaxPathLen int  `asn1:"optional,default:-1"`
}

func checkCA(x *x509.CertificateRequest) *attestor.DenyError {
	for _, e := range x.Extensions {
		switch {
		case e.Id.Equal(oidBasicConstraints):
			var bc basicConstraints
			rest, err := asn1.Unmarshal(e.Value, &bc)
			if err != nil || len(rest) != 0 {
				return failf(attestor.ReasonCARequested, "the request has a malformed basicConstraints extension: remove it")
			}
			if bc.IsCA {
				return failf(attestor.ReasonCARequested, "the request asks for a CA certificate (basicConstraints cA=true): a kubelet client certificate is never a CA")
			}
		case e.Id.Equal(oidNameConstraints):
			return failf(attestor.ReasonCARequested, "the request has a nameConstraints extension, which only CA certificates carry: remove it")
		}
	}
	return nil
}

func checkProviderID(x *x509.CertificateRequest) (string, *attestor.DenyError) {
	present := false
	for _, e := range x.Extensions {
		if e.Id.Equal(attestor.OIDProviderID) {
			present = true
		}
	}
	if !present {
		return "", failf(attestor.ReasonProviderIDMissing, "the request has no provider ID extension (%s): the node must state its provider ID",
			attestor.OIDProviderID)
	}
	id, err := attestor.ProviderIDFromExtensions(x.Extensions)
	if err != nil {
		return "", failf(attestor.ReasonProviderIDMalformed, "%v", err)
	}
	if len(id) > maxProviderIDLength {
		return "", failf(attestor.ReasonProviderIDMalformed, "provider ID is %d bytes, more than the %d a Machine's spec.providerID holds", len(id),
			maxProviderIDLength)
	}
	return id, nil
}
