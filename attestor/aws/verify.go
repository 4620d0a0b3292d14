package aws

import (
	"bytes"
	"context"
	"crypto/x509"
	"embed"
	"encoding/pem"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/smallstep/pkcs7"
	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tlsconfig"
)

// Denial reasons of the AWS verifier.
const (
	ReasonUntrustedSigner   = "UntrustedSigner"
	ReasonInvalidSignature  = "InvalidSignature"
	ReasonDocumentMismatch  = "DocumentMismatch"
	ReasonRegionMismatch    = "RegionMismatch"
	ReasonAccountNotAllowed = "AccountNotAllowed"
	ReasonSTSHostNotAllowed = "STSHostNotAllowed"
	ReasonPresignInvalid    = "PresignInvalid"
	ReasonPresignExpired    = "PresignExpired"
	ReasonBindingMismatch   = "BindingMismatch"
	ReasonSTSRejected       = "STSRejected"
	ReasonCallerMismatch    = "CallerMismatch"
	// ReasonCallerRoleNotAllowed: the presigned request was signed with
	// the credentials of a role allowedRoles does not list.
	ReasonCallerRoleNotAllowed = "CallerRoleNotAllowed"
)

// CAPANodesRole is the IAM role Cluster API Provider AWS gives worker
// nodes by default (its instance profile of the same name); an example of
// an allowedRoles entry.
const CAPANodesRole = "nodes.cluster-api-provider-aws.sigs.k8s.io"

// DefaultSTSHost is the global STS endpoint, always allowed by default.
const DefaultSTSHost = "sts.amazonaws.com"

// clockSkew is how far the verifier's clock may be behind the node's.
const clockSkew = 30 * time.Second

// builtinCerts holds the rsa2048 certificates compiled into the binary:
// certs/rsa2048/<region>.pem (see its README).
//
//go:embed certs/rsa2048
var builtinCerts embed.FS

// Regular expressions are compiled on first use, not at package init: the
// node binary links every provider, and the exec plugin's cached path pays
// for each initializer on every call (make bench, BenchmarkCachedPath).
var accountRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[0-9]{12}$`) })

var regionalSTSHost = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^sts\.[a-z]{2}(-[a-z]+)+-[0-9]+\.amazonaws\.com$`) })

// VerifierConfig configures the signer half.
type VerifierConfig struct {
	// CertificatesDir is a directory of <region>.pem files: AWS's public
	// rsa2048 certificates for the instance identity document. They are
	// trusted in addition to the built-in ones (certs/rsa2048, every
	// region AWS publishes), unless ReplaceBuiltinCertificates is set. The
	// region is the file name.
	CertificatesDir string `json:"certificatesDir,omitempty"`
	// ReplaceBuiltinCertificates makes CertificatesDir the only set of
	// certificates trusted (for an air-gapped partition, or to trust fewer
	// regions); it requires CertificatesDir.
	ReplaceBuiltinCertificates bool `json:"replaceBuiltinCertificates,omitempty"`
	// Accounts are the AWS account IDs whose instances may register.
	// Required.
	Accounts []string `json:"accounts"`
	// AllowedRoles are the IAM roles whose session may vouch for an
	// instance: the role of the instance profile your nodes run with, by
	// name ("nodes.cluster-api-provider-aws.sigs.k8s.io", CAPA's default)
	// in any account of Accounts, or by ARN
	// ("arn:aws:iam::111122223333:role/my-nodes", path allowed) for one
	// account. Required: the STS second factor proves the instance only if
	// the role is one that nothing but instances can assume, since anyone
	// allowed to assume a role may name their session after any instance.
	AllowedRoles []string `json:"allowedRoles"`
	// STS configures the replay of the presigned request.
	STS STSConfig `json:"sts,omitempty"`
}

// STSConfig configures the verifier's STS client.
type STSConfig struct {
	// Hosts are the hosts (host or host:port) a presigned request may be
	// addressed to. Empty means sts.amazonaws.com and every regional
	// sts.<region>.amazonaws.com.
	Hosts []string `json:"hosts,omitempty"`
	// TLS is the outbound TLS configuration of the STS client.
	TLS *tlsconfig.Config `json:"tls,omitempty"`
}

// httpDoer is the STS client.
type httpDoer interface {
	Do(*http.Request) (*http.Response, error)
}

// Verifier is the signer half.
type Verifier struct {
	certs    map[string][]*x509.Certificate // region -> certificates
	accounts map[string]bool
	roles    []roleRef
	hosts    []string
	client   httpDoer
	clock    clock.PassiveClock
}

// NewVerifier returns the signer half. It fails when no certificate or no
// account is configured.
func NewVerifier(cfg VerifierConfig) (*Verifier, error) {
	v := &Verifier{certs: map[string][]*x509.Certificate{}, accounts: map[string]bool{}, hosts: cfg.STS.Hosts, clock: clock.RealClock{}}
	var errs []error
	if cfg.ReplaceBuiltinCertificates && cfg.CertificatesDir == "" {
		errs = append(errs, errors.New("replaceBuiltinCertificates: set certificatesDir to the certificates that replace the built-in ones"))
	}
	if !cfg.ReplaceBuiltinCertificates {
		if err := loadCerts(BuiltinCertificates(), v.certs); err != nil {
			errs = append(errs, fmt.Errorf("built-in certificates: %w", err))
		}
	}
	if cfg.CertificatesDir != "" {
		if err := loadCerts(os.DirFS(cfg.CertificatesDir), v.certs); err != nil {
			errs = append(errs, fmt.Errorf("certificatesDir: %w", err))
		}
	}
	if len(v.certs) == 0 {
		errs = append(errs, errors.New("no AWS rsa2048 certificates: set certificatesDir to a directory of <region>.pem files"))
	}
	for _, a := range cfg.Accounts {
		if !accountRE().MatchString(a) {
			errs = append(errs, fmt.Errorf("accounts: %q is not a 12-digit AWS account ID", a))
		}
		v.accounts[a] = true
	}
	if len(cfg.Accounts) == 0 {
		errs = append(errs, errors.New("accounts: at least one AWS account ID is required"))
	}
	for _, r := range cfg.AllowedRoles {
		ref, err := parseRoleRef(r)
		if err != nil {
			errs = append(errs, fmt.Errorf("allowedRoles: %w", err))
			continue
		}
		v.roles = append(v.roles, ref)
	}
	if len(cfg.AllowedRoles) == 0 {
		errs = append(errs, fmt.Errorf("allowedRoles: list the IAM role (name or ARN) of your nodes' instance profile, e.g. %s for Cluster API Provider AWS: "+
			"without it any role in the account could vouch for an instance",
			CAPANodesRole))
	}
	client, err := cfg.STS.TLS.HTTPClient(15 * time.Second)
	if err != nil {
		errs = append(errs, fmt.Errorf("sts.tls: %w", err))
	}
	v.client = client
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return v, nil
}

// BuiltinCertificates returns the compiled-in AWS rsa2048 certificates,
// <region>.pem files (and their README with each one's source and SHA-256).
func BuiltinCertificates() fs.FS {
	sub, err := fs.Sub(builtinCerts, "certs/rsa2048")
	if err != nil {
		panic(err) // the embedded directory exists at build time
	}
	return sub
}

// loadCerts adds every <region>.pem of fsys to certs.
func loadCerts(fsys fs.FS, certs map[string][]*x509.Certificate) error {
	names, err := fs.Glob(fsys, "*.pem")
	if err != nil {
		return err
	}
	var errs []error
	for _, n := range names {
		data, err := fs.ReadFile(fsys, n)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		region := strings.TrimSuffix(path.Base(n), ".pem")
		found := 0
		for {
			var b *pem.Block
			b, data = pem.Decode(data)
			if b == nil {
				break
			}
			if b.Type != "CERTIFICATE" {
				continue
			}
			c, err := x509.ParseCertificate(b.Bytes)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", n, err))
				continue
			}
			certs[region] = append(certs[region], c)
			found++
		}
		if found == 0 {
			errs = append(errs, fmt.Errorf("%s: no certificate", n))
		}
	}
	return errors.Join(errs...)
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
	doc, err := v.verifyDocument(ev.Document, ev.RSA2048)
	if err != nil {
		return nil, err
	}
	var denials []error
	if !v.accounts[doc.AccountID] {
		denials = append(denials, attestor.Deny(ReasonAccountNotAllowed, "account %s is not allowed", doc.AccountID))
	}
	if pid := doc.ProviderID(); pid != in.ProviderID {
		denials = append(denials, attestor.Deny(attestor.ReasonAttestedProviderIDMismatch,
			"the identity document proves provider ID %q but the CSR claims %q", pid, in.ProviderID))
	}
	u, err := v.checkPresigned(&ev.STS, bindings)
	if err != nil {
		denials = append(denials, err)
	}
	if err := joinDenials(denials); err != nil {
		return nil, err
	}
	caller, err := v.replay(ctx, u, ev.STS.Headers)
	if err != nil {
		return nil, err
	}
	if err := v.checkCaller(caller, doc); err != nil {
		return nil, err
	}
	return &attestor.Result{Identity: &attestor.Identity{ProviderID: doc.ProviderID(), Stable: doc.Stable()}}, nil
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

// verifyDocument checks the PKCS#7 signature of doc against the configured
// regional certificates and parses it.
func (v *Verifier) verifyDocument(doc, sig []byte) (*InstanceIdentityDocument, error) {
	if len(doc) == 0 || len(sig) == 0 {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the evidence has no identity document or no rsa2048 signature")
	}
	p7, err := pkcs7.Parse(sig)
	if err != nil {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "unable to parse the rsa2048 PKCS#7: %v", err)
	}
	if len(p7.Signers) != 1 {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the rsa2048 PKCS#7 has %d signers, want 1", len(p7.Signers))
	}
	// Only the configured certificates may have signed: certificates
	// carried in the PKCS#7 itself are ignored.
	var all []*x509.Certificate
	region := map[*x509.Certificate]string{}
	for r, cs := range v.certs {
		for _, c := range cs {
			all = append(all, c)
			region[c] = r
		}
	}
	p7.Certificates = all
	signer := p7.GetOnlySigner()
	if signer == nil {
		return nil, attestor.Deny(ReasonUntrustedSigner, "the identity document is not signed by a configured AWS rsa2048 certificate")
	}
	if err := p7.Verify(); err != nil {
		return nil, attestor.Deny(ReasonInvalidSignature, "the rsa2048 signature does not verify: %v", err)
	}
	if !bytes.Equal(p7.Content, doc) {
		return nil, attestor.Deny(ReasonDocumentMismatch, "the identity document differs from the content the rsa2048 signature covers")
	}
	var iid InstanceIdentityDocument
	if err := attestor.DecodeDocument(doc, &iid, "the identity document"); err != nil {
		return nil, err
	}
	var missing []string
	for name, val := range map[string]string{"accountId": iid.AccountID, "instanceId": iid.InstanceID, "availabilityZone": iid.AvailabilityZone,
		"region": iid.Region} {
		if val == "" {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the identity document lacks %s", strings.Join(missing, ", "))
	}
	if r := region[signer]; r != iid.Region {
		return nil, attestor.Deny(ReasonRegionMismatch, "the identity document names region %s but was signed with the certificate of %s", iid.Region, r)
	}
	return &iid, nil
}

var allowedQuery = map[string]bool{
	"Action": true, "Version": true, "X-Amz-Algorithm": true, "X-Amz-Credential": true,
	"X-Amz-Date": true, "X-Amz-Expires": true, "X-Amz-SignedHeaders": true,
	"X-Amz-Signature": true, "X-Amz-Security-Token": true,
}

func (v *Verifier) hostAllowed(host string) bool {
	if len(v.hosts) == 0 {
		return host == DefaultSTSHost || regionalSTSHost().MatchString(host)
	}
	return slices.Contains(v.hosts, host)
}

// checkPresigned checks the presigned request locally: where it goes, what
// it asks, when it expires, and that it signs the binding.
func (v *Verifier) checkPresigned(p *PresignedRequest, bindings [][]byte) (*url.URL, error) {
	u, err := url.Parse(p.URL)
	if err != nil {
		return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS URL does not parse: %v", err)
	}
	if u.Scheme != "https" || u.User != nil || u.Fragment != "" || u.Opaque != "" {
		return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS URL must be a plain https URL")
	}
	if !v.hostAllowed(u.Host) {
		return nil, attestor.Deny(ReasonSTSHostNotAllowed, "the presigned request is addressed to %q, which is not an allowed STS host", u.Host)
	}
	if u.Path != "/" && u.Path != "" {
		return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS URL has path %q, want /", u.Path)
	}
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS query does not parse: %v", err)
	}
	for k, vs := range q {
		if !allowedQuery[k] {
			return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS query has unexpected parameter %q", k)
		}
		if len(vs) != 1 {
			return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS query repeats %q", k)
		}
	}
	want := map[string]string{
		"Action":              "GetCallerIdentity",
		"Version":             "2011-06-15",
		"X-Amz-Algorithm":     sigv4Algorithm,
		"X-Amz-SignedHeaders": "host;" + BindingHeader,
	}
	for k, w := range want {
		if got := q.Get(k); got != w {
			return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS request has %s=%q, want %q", k, got, w)
		}
	}
	if q.Get("X-Amz-Signature") == "" || q.Get("X-Amz-Credential") == "" {
		return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS request is not signed")
	}
	if scope := strings.Split(q.Get("X-Amz-Credential"), "/"); len(scope) != 5 || scope[3] != stsService || scope[4] != "aws4_request" {
		return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS request has an invalid credential scope")
	}
	signedAt, err := time.Parse(amzDateFormat, q.Get("X-Amz-Date"))
	if err != nil {
		return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS request has an invalid X-Amz-Date: %v", err)
	}
	expires, err := strconv.Atoi(q.Get("X-Amz-Expires"))
	if err != nil || expires < 1 || expires > MaxPresignExpiry {
		return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS request has X-Amz-Expires=%q, want 1 to %d seconds", q.Get("X-Amz-Expires"),
			MaxPresignExpiry)
	}
	now := v.clock.Now()
	if now.Add(clockSkew).Before(signedAt) {
		return nil, attestor.Deny(ReasonPresignExpired, "the presigned STS request is dated %s, in the future", signedAt.Format(time.RFC3339))
	}
	if end := signedAt.Add(time.Duration(expires) * time.Second); now.After(end) {
		return nil, attestor.Deny(ReasonPresignExpired, "the presigned STS request expired at %s", end.Format(time.RFC3339))
	}
	if len(p.Headers) != 1 {
		return nil, attestor.Deny(ReasonPresignInvalid, "the presigned STS request must carry exactly the %s header", BindingHeader)
	}
	if got, ok := p.Headers[BindingHeader]; !ok || !attestor.AnyBinding(bindings, func(b []byte) bool { return got == bindingHex(b) }) {
		return nil, attestor.Deny(ReasonBindingMismatch,
			"the presigned STS request signs a binding other than the CSR key's (and, from evidence v2, this cluster's CA): "+
				"evidence made for another key or another cluster")
	}
	return u, nil
}

// callerIdentity is what STS answered.
type callerIdentity struct {
	Arn     string `xml:"GetCallerIdentityResult>Arn"`
	UserID  string `xml:"GetCallerIdentityResult>UserId"`
	Account string `xml:"GetCallerIdentityResult>Account"`
}

type stsError struct {
	Code    string `xml:"Error>Code"`
	Message string `xml:"Error>Message"`
}

// replay sends the presigned request to STS. Errors other than a
// *DenyError are transient.
func (v *Verifier) replay(ctx context.Context, u *url.URL, headers map[string]string) (*callerIdentity, error) {
	r, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, attestor.Deny(ReasonPresignInvalid, "unable to build the STS request: %v", err)
	}
	for k, val := range headers {
		r.Header.Set(k, val)
	}
	resp, err := v.client.Do(r)
	if err != nil {
		return nil, fmt.Errorf("unable to reach STS at %s: %w", u.Host, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return nil, fmt.Errorf("unable to read the STS response: %w", err)
	}
	switch resp.StatusCode {
	case http.StatusOK:
		var ci callerIdentity
		if err := xml.Unmarshal(body, &ci); err != nil {
			return nil, fmt.Errorf("unable to parse the STS GetCallerIdentity response: %w", err)
		}
		return &ci, nil
	case http.StatusBadRequest, http.StatusForbidden:
		var se stsError
		_ = xml.Unmarshal(body, &se)
		switch se.Code {
		case "Throttling", "RequestLimitExceeded", "ServiceUnavailable", "InternalFailure":
			return nil, fmt.Errorf("STS is throttling or failing: %s", se.Code)
		}
		return nil, attestor.Deny(ReasonSTSRejected, "STS rejected the presigned request: %s %s", se.Code, se.Message)
	default:
		return nil, fmt.Errorf("STS answered %s", resp.Status)
	}
}

// roleRef is an allowedRoles entry: a role name, with the partition and
// account of an ARN when it was given as one.
type roleRef struct {
	partition, account, name string
}

var roleNameRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[\w+=,.@-]{1,64}$`) })

// parseRoleRef parses a role name or an IAM role ARN
// (arn:<partition>:iam::<account>:role/<path/><name>).
func parseRoleRef(s string) (roleRef, error) {
	if !strings.HasPrefix(s, "arn:") {
		if !roleNameRE().MatchString(s) {
			return roleRef{}, fmt.Errorf("%q is neither an IAM role name nor a role ARN", s)
		}
		return roleRef{name: s}, nil
	}
	parts := strings.SplitN(s, ":", 6)
	if len(parts) != 6 || parts[1] == "" || parts[2] != "iam" || parts[3] != "" || !accountRE().MatchString(parts[4]) || !strings.HasPrefix(parts[5], "role/") {
		return roleRef{}, fmt.Errorf("%q is not an IAM role ARN (arn:aws:iam::<account>:role/<name>)", s)
	}
	name := parts[5][strings.LastIndex(parts[5], "/")+1:]
	if !roleNameRE().MatchString(name) {
		return roleRef{}, fmt.Errorf("%q has an invalid role name", s)
	}
	return roleRef{partition: parts[1], account: parts[4], name: name}, nil
}

// allows reports whether the role session of role name in partition and
// account matches r. An assumed-role ARN carries the role's name without
// its path, so a path in the configured ARN is not compared.
func (r roleRef) allows(partition, account, name string) bool {
	if r.name != name {
		return false
	}
	return r.account == "" || (r.partition == partition && r.account == account)
}

// checkCaller requires the STS caller to be the instance's role session,
// arn:<partition>:sts::<account>:assumed-role/<role>/<instance ID>, of an
// allowed role. The session name alone proves nothing: whoever may assume
// a role chooses the session name.
func (v *Verifier) checkCaller(ci *callerIdentity, doc *InstanceIdentityDocument) error {
	parts := strings.SplitN(ci.Arn, ":", 6)
	if len(parts) != 6 || parts[0] != "arn" || parts[2] != "sts" {
		return attestor.Deny(ReasonCallerMismatch, "STS caller %q is not an STS ARN", ci.Arn)
	}
	res := strings.Split(parts[5], "/")
	if len(res) != 3 || res[0] != "assumed-role" {
		return attestor.Deny(ReasonCallerMismatch, "STS caller %q is not an assumed-role session", ci.Arn)
	}
	var errs []error
	if res[2] != doc.InstanceID {
		errs = append(errs, attestor.Deny(ReasonCallerMismatch, "STS caller session %q is not instance %s", res[2], doc.InstanceID))
	}
	if parts[4] != doc.AccountID || ci.Account != doc.AccountID {
		errs = append(errs, attestor.Deny(ReasonCallerMismatch, "STS caller account %s/%s is not the document's account %s", parts[4], ci.Account, doc.AccountID))
	}
	allowed := false
	for _, r := range v.roles {
		if r.allows(parts[1], parts[4], res[1]) {
			allowed = true
			break
		}
	}
	if !allowed {
		errs = append(errs, attestor.Deny(ReasonCallerRoleNotAllowed,
			"the STS caller is a session of role %q in account %s, which allowedRoles does not list (it lists the role of the nodes' instance profile)", res[1],
			parts[4]))
	}
	return joinDenials(errs)
}
