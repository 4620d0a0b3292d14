// Package attestor is the contract shared by the node and the signer: the
// wire format of an attested certificate signing request (wire.go), the
// reasons a signer writes on requests it denies (reasons.go), the binding
// that ties evidence to the CSR's key, and the small interfaces every
// provider implements, one or two methods a side.
//
// A provider lives in its own sub-package (attestor/tpm, attestor/aws, ...)
// with both halves side by side: the node half (an Attestor) turns a binding
// into evidence; the signer half (a Verifier) turns evidence plus binding into
// a proven Identity. The signer, not the provider, owns everything around
// that: the structural rules, the Machine, trust on first use, and the
// challenge of a two-round provider (it seals the challenge it writes, checks
// its expiry, finds the challenged request and hands it to the verifier, and
// closes it once answered).
//
// This package is imported by the exec plugin and by the controller; it must
// stay free of device, network and Kubernetes imports.
package attestor

import (
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"slices"
	"time"
)

// Attestor is the node half of a provider.
type Attestor interface {
	// Attest returns evidence that commits to req.Binding, in version
	// req.Version ("" means the newest), with the annotations the CSR
	// carrying it must be filed with.
	Attest(ctx context.Context, req *Request) (*Attestation, error)
	// Versions lists the evidence versions this attestor can produce, newest
	// first.
	Versions() []string
}

// Responder is implemented by node attestors whose proof takes a second
// round (TPM credential activation): the signer answers the first CSR with a
// challenge and the node files a second CSR carrying the response.
type Responder interface {
	Respond(ctx context.Context, req *Request, ch *Challenge) (*Attestation, error)
}

// Attestation is what a node attestor produced for one CSR.
type Attestation struct {
	// Evidence is the attestation data block (JSON with a "version" field).
	Evidence Evidence
	// Version is the evidence's version.
	Version string
	// Annotations are set on the CSR when it is created (the TPM attestor's
	// cluster-x-k8s-io/tpm-endorsement-key); nil for most providers.
	Annotations map[string]string
}

// Request is what a node attestor is asked to attest.
type Request struct {
	// NodeName is the name the node registers as.
	NodeName string
	// ProviderID is the provider ID the CSR claims.
	ProviderID string
	// Binding is Binding(SPKI of the CSR key).
	Binding []byte
	// SPKI is the DER SubjectPublicKeyInfo of the CSR key, for attestors
	// whose answer is bound to the key itself (the TPM challenge answer).
	// Binding must equal Binding(SPKI).
	SPKI []byte
	// Version is the evidence version to produce; "" for the newest the
	// attestor can produce for this request (Newest).
	Version string
	// ClusterCA is the DER certificate of the CA the node trusts for its
	// API server (the first certificate of the CA data it files the CSR
	// with): evidence versions of binding v2 commit to it (ClusterBinding).
	// Nil when the node knows none; such versions then cannot be produced.
	ClusterCA []byte
}

// Newest returns the version to produce when none is asked for: Version
// when set, else clusterBound when the node knows its cluster CA, else
// keyOnly (a node whose API server CA data is empty cannot name its
// cluster; a Cluster that requires it then says so).
func (r *Request) Newest(clusterBound, keyOnly string) string {
	switch {
	case r.Version != "":
		return r.Version
	case len(r.ClusterCA) > 0:
		return clusterBound
	}
	return keyOnly
}

// BindingFor returns the binding evidence of a version commits to: Binding
// for versions of binding v1, ClusterBinding(SPKI, ClusterCA) for those of
// binding v2 (clusterBound).
func (r *Request) BindingFor(clusterBound bool) ([]byte, error) {
	if !clusterBound {
		if len(r.Binding) == 0 {
			return nil, errors.New("the request has no binding")
		}
		return r.Binding, nil
	}
	if len(r.SPKI) == 0 || len(r.ClusterCA) == 0 {
		return nil, errors.New("cluster-bound evidence needs the CSR key and the cluster CA the node trusts for its API server")
	}
	return ClusterBinding(r.SPKI, r.ClusterCA), nil
}

// Challenge is a signer's challenge to a first-round CSR.
type Challenge struct {
	// CSRName and CSRUID identify the CSR that was challenged (set by the
	// node when it hands a challenge to its Responder).
	CSRName string
	CSRUID  string
	// Data is the provider-defined challenge, as written in the CSR's
	// challenge annotation.
	Data []byte
	// Expires is when the challenge stops being accepted. A verifier sets
	// it on the challenge it returns; the signer seals it with the data and
	// enforces it.
	Expires time.Time
	// KeyID names the controller challenge key the challenge was made
	// under (ChallengeKeys). A verifier that derives anything from the key
	// sets it on the challenge it returns, and the signer seals with that
	// key; the signer sets it on the challenge of a Round from the seal.
	// Empty when a verifier uses no key: the signer seals with its current
	// one. Never sent to the node.
	KeyID string
}

// LegacyChallengeKeyID names the single challenge key of a controller that
// did not rotate it: the key of a Secret in its first format, and the key
// of challenges sealed before keys had names.
const LegacyChallengeKeyID = "k0"

// ErrChallengeKeyRetired is wrapped by ChallengeKeys.Key for a key that was
// rotated out: challenges made under it can no longer be answered.
var ErrChallengeKeyRetired = errors.New("the challenge key was rotated out")

// ErrChallengeKeyNotYetRead is wrapped by ChallengeKeys.Key for a key newer
// than this replica knows, that another replica may have just made: worth
// asking again once the keys have been read again.
var ErrChallengeKeyNotYetRead = errors.New("the challenge key has not been read yet")

// ChallengeKeys are the controller's challenge keys, shared by the signer
// (which seals challenges) and verifiers that derive challenge secrets: the
// current key new challenges are made under and the previous ones kept for
// the challenges in flight. Safe for concurrent use.
type ChallengeKeys interface {
	// Current returns the key new challenges are made under and its id;
	// a nil key when there is none.
	Current() (id string, key []byte)
	// Key returns the key named id. The error wraps ErrChallengeKeyRetired
	// when the key was rotated out, ErrChallengeKeyNotYetRead when it may
	// be one another replica just made; any other error means that no key
	// of this controller has that name.
	Key(id string) ([]byte, error)
}

// StaticChallengeKey is a ChallengeKeys of one key that never rotates,
// named LegacyChallengeKeyID.
func StaticChallengeKey(key []byte) ChallengeKeys { return staticKey(key) }

type staticKey []byte

func (k staticKey) Current() (string, []byte) { return LegacyChallengeKeyID, k }

func (k staticKey) Key(id string) ([]byte, error) {
	if id != LegacyChallengeKeyID {
		return nil, fmt.Errorf("challenge key %q is unknown: this signer has only one key", id)
	}
	return k, nil
}

// Evidence is a provider's evidence document: JSON with a "version" field.
type Evidence []byte

// Verifier is the signer half of a provider. It never touches a device or a
// metadata service of the node; it may call out to a provider's public
// endpoints (STS, JWKS) through configuration.
type Verifier interface {
	// Verify checks evidence against in.Binding and returns what it proves.
	// Evidence that does not verify is reported as a *DenyError; any other
	// error is transient and the CSR is retried.
	Verify(ctx context.Context, in *VerifyRequest) (*Result, error)
	// Versions lists the evidence versions this verifier accepts, newest
	// first.
	Versions() []string
}

// VerifyRequest is one CSR's evidence, as the signer hands it to a verifier.
// The signer has already checked the request's structure, its requester,
// the Cluster's authorization, the evidence version and the Machine.
type VerifyRequest struct {
	// Evidence is the attestation data block, and Version its parsed
	// "version" field (one of Versions()).
	Evidence Evidence
	Version  string
	// Binding is Binding(SPKI of the CSR key), computed by the signer.
	Binding []byte
	// ClusterCAs are the DER certificates of the CA the signer signs this
	// workload cluster's clients with: its signing certificate first, then
	// the other certificates of its bundle (a CA rotation). Evidence of
	// binding v2 must commit to one of them (Bindings).
	ClusterCAs [][]byte
	// ClusterUID is the UID of the Cluster the request is filed in; a
	// challenge secret is derived from it.
	ClusterUID string
	// CSR is the parsed PKCS#10 request.
	CSR *x509.CertificateRequest
	// NodeName is the node name from the CSR subject.
	NodeName string
	// ProviderID is the provider ID the CSR extension claims.
	ProviderID string
	// UID is the CSR object's UID: a challenge is bound to it.
	UID string
	// Annotations are the CSR's annotations.
	Annotations map[string]string
	// MachineAnnotations are the annotations of the Machine the CSR was
	// matched to and of its infrastructure object, for providers whose
	// infrastructure reports a key the evidence must match
	// (cluster-x-k8s-io/tpm-endorsement-key).
	MachineAnnotations map[string]string
	// Answered is set when the evidence answers a challenge: the first
	// round, as the signer found it (see Result.Answers).
	Answered *Round
	// Policy is the Cluster's policy document for this provider (YAML or
	// JSON, provider-defined: the TPM boot-state policy), nil when the
	// Cluster sets none. A verifier that cannot parse it returns a
	// transient error (the operator fixes it), never a denial.
	Policy []byte
	// ChallengeTTL, when positive, bounds the lifetime of a challenge the
	// verifier returns: the signer shortens challenges when a requester
	// has many waiting (a shared bootstrap token). The signer retries a
	// request whose challenge lives longer.
	ChallengeTTL time.Duration
}

// Bindings returns the bindings evidence of a version may commit to: the
// key-only Binding for versions of binding v1, or, for those of binding v2
// (clusterBound), ClusterBinding of the CSR key with each of ClusterCAs.
func (in *VerifyRequest) Bindings(clusterBound bool) [][]byte {
	if !clusterBound {
		return [][]byte{in.Binding}
	}
	if in.CSR == nil {
		return nil
	}
	out := make([][]byte, 0, len(in.ClusterCAs))
	for _, ca := range in.ClusterCAs {
		out = append(out, ClusterBinding(in.CSR.RawSubjectPublicKeyInfo, ca))
	}
	return out
}

// AnyBinding reports whether ok holds for one of bindings: evidence that
// commits to one of them is bound to the key (and the cluster).
func AnyBinding(bindings [][]byte, ok func(binding []byte) bool) bool {
	return slices.ContainsFunc(bindings, ok)
}

// ClusterBinder is implemented by verifiers with evidence versions of
// binding v2: the signer asks it which versions commit to the workload
// cluster when a Cluster's policy requires cluster-bound evidence.
// Verifiers of providers that bind nothing (insecure) do not implement it,
// and the requirement does not apply to them.
type ClusterBinder interface {
	// ClusterBound reports whether evidence of version commits to the
	// workload cluster's CA (binding v2).
	ClusterBound(version string) bool
}

// Round is an earlier, challenged request, as the signer found it. The
// signer has checked that it was filed by the same requester to the same
// signer name, for the same key, node name and provider ID, that its
// challenge is one the signer wrote and has not expired, and that it is
// still undecided.
type Round struct {
	// Name and UID identify the challenged CSR.
	Name, UID string
	// CSR is its parsed PKCS#10 request.
	CSR *x509.CertificateRequest
	// Evidence and Version are its first-round evidence.
	Evidence Evidence
	Version  string
	// Annotations are its annotations.
	Annotations map[string]string
	// Challenge is the challenge the signer wrote on it.
	Challenge *Challenge
}

// Result is what a verifier proved. Exactly one of Identity, Challenge and
// Answers is set.
type Result struct {
	// Identity is set when the evidence proved who the node is.
	Identity *Identity
	// Challenge is set when the verifier needs a second round: the signer
	// writes Data into the CSR's challenge annotation, seals it, and waits
	// for the answer until Expires.
	Challenge *Challenge
	// Answers is set when the evidence answers the challenge of the named
	// CSR and in.Answered was nil: the signer finds that CSR, checks it
	// (see Round) and calls Verify again with in.Answered set.
	Answers string
}

// Identity is what a provider proved about a node.
type Identity struct {
	// ProviderID is the provider ID the evidence proves. The signer requires
	// it to equal both the CSR extension and the Machine's spec.providerID.
	ProviderID string
	// Stable is a provider-scoped identity that survives reboots and
	// reinstalls (an EK hash, an instance ID) used for trust on first use,
	// prefixed with the provider name ("tpm:ek-sha256:..."). Empty when the
	// provider proves none (insecure).
	Stable string
}

// DenyError is the one denial type: a request that does not pass a check.
// Reason is a short CamelCase word used as the CSR condition reason (one of
// the constants in reasons.go, or a provider's own); Message says what to
// fix. Several are joined with errors.Join so that one denial says
// everything that is wrong.
type DenyError struct {
	Reason  string
	Message string
}

func (e *DenyError) Error() string { return e.Reason + ": " + e.Message }

// Deny returns a *DenyError with a formatted message.
func Deny(reason, format string, args ...any) error {
	return &DenyError{Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// AsDenial reports whether err carries a *DenyError, and returns the first.
func AsDenial(err error) (*DenyError, bool) {
	if ds := Denials(err); len(ds) > 0 {
		return ds[0], true
	}
	return nil, false
}

// Denials returns every *DenyError in err (as joined by errors.Join or
// wrapped with %w, at any depth), in order.
func Denials(err error) []*DenyError {
	var out []*DenyError
	var walk func(error)
	walk = func(e error) {
		if e == nil {
			return
		}
		if d, ok := e.(*DenyError); ok { //nolint:errorlint // walks the whole tree; errors.As stops at the first
			out = append(out, d)
			return
		}
		switch u := e.(type) { //nolint:errorlint // the walk itself unwraps
		case interface{ Unwrap() []error }:
			for _, x := range u.Unwrap() {
				walk(x)
			}
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		}
	}
	walk(err)
	return out
}

// bindingContext and clusterBindingContext are the domain separators of
// Binding and ClusterBinding.
const (
	bindingContext        = "kubelet-authenticator/v1\x00"
	clusterBindingContext = "kubelet-authenticator/v2\x00"
)

// Binding returns SHA-256("kubelet-authenticator/v1\x00" || spkiDER), the
// value every piece of evidence must commit to.
func Binding(spkiDER []byte) []byte {
	h := sha256.New()
	h.Write([]byte(bindingContext))
	h.Write(spkiDER)
	return h.Sum(nil)
}

// ClusterBinding returns binding v2: SHA-256("kubelet-authenticator/v2\x00"
// || spkiDER || SHA-256(clusterCADER)), the value evidence commits to when
// it names the workload cluster as well as the key, so that evidence
// copied into another cluster (another CA) does not verify there.
func ClusterBinding(spkiDER, clusterCADER []byte) []byte {
	ca := sha256.Sum256(clusterCADER)
	h := sha256.New()
	h.Write([]byte(clusterBindingContext))
	h.Write(spkiDER)
	h.Write(ca[:])
	return h.Sum(nil)
}

// FirstCertificate returns the DER of the first CERTIFICATE block of a PEM
// bundle: the cluster CA a node commits its evidence to, out of the CA
// data it trusts its API server with.
func FirstCertificate(pemData []byte) ([]byte, error) {
	for rest := pemData; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			return nil, errors.New("no CERTIFICATE PEM block in the CA data")
		}
		if b.Type == "CERTIFICATE" {
			if _, err := x509.ParseCertificate(b.Bytes); err != nil {
				return nil, fmt.Errorf("unable to parse the CA certificate: %w", err)
			}
			return b.Bytes, nil
		}
	}
}
