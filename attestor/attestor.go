// Package attestor is the contract shared by the node and the signer: the
// wire format of an attested certificate signing request, the binding that
// ties evidence to the CSR's key, and the two small interfaces every provider
// implements, one per side.
//
// A provider lives in its own sub-package (attestor/tpm, attestor/aws, ...)
// with both halves side by side: the node half (an Attestor) turns a binding
// into evidence; the signer half (a Verifier) turns evidence plus binding into
// a proven Identity. The signer, not the provider, compares that identity with
// what Cluster API knows about the machine and applies trust on first use.
//
// This package is imported by the exec plugin's hot path and by the
// controller; it must stay free of device, network and Kubernetes imports.
package attestor

import (
	"context"
	"crypto"
	"crypto/sha256"
	"crypto/x509"
	"errors"
	"fmt"
	"time"
)

// Attestor is the node half of a provider.
type Attestor interface {
	// Attest returns evidence (a JSON document with a "version" field) that
	// commits to req.Binding. version is one of Versions(); "" means the
	// newest.
	Attest(ctx context.Context, req *Request) (Evidence, error)
	// Versions lists the evidence versions this attestor can produce, newest
	// first.
	Versions() []string
}

// Responder is implemented by node attestors whose proof takes a second
// round (TPM credential activation): the signer answers the first CSR with a
// challenge and the node files a second CSR carrying the response.
type Responder interface {
	Respond(ctx context.Context, req *Request, ch *Challenge) (Evidence, error)
}

// Annotator is implemented by node attestors that label their CSR (the TPM
// attestor writes the EK public key into cluster-x-k8s-io/tpm-endorsement-key).
type Annotator interface {
	// Annotations returns the annotations for a CSR carrying evidence.
	Annotations(evidence Evidence) (map[string]string, error)
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
	// that must show the key itself to their evidence source (TPM2_Certify
	// loads it into the TPM; the TPM challenge answer is bound to it).
	// Binding must equal Binding(SPKI). Optional for attestors that need
	// only the binding.
	SPKI []byte
	// Key is the CSR's private key, for attestors whose evidence source
	// must be shown possession of it: TPM2_Certify refuses a public-only
	// object, so the TPM attestor loads the key pair into the TPM's null
	// hierarchy (transiently) to certify it. Optional for other attestors;
	// never sent anywhere.
	Key crypto.Signer
	// Version is the evidence version to produce; "" for the newest.
	Version string
}

// Challenge is a signer's challenge to a first-round CSR.
type Challenge struct {
	// CSRName and CSRUID identify the CSR that was challenged.
	CSRName string
	CSRUID  string
	// Data is the provider-defined challenge, as the signer wrote it.
	Data []byte
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
type VerifyRequest struct {
	// Evidence is the attestation data block, and Version its parsed
	// "version" field (already checked against Versions()).
	Evidence Evidence
	Version  string
	// Binding is Binding(SPKI of the CSR key), computed by the signer.
	Binding []byte
	// CSR is the parsed PKCS#10 request.
	CSR *x509.CertificateRequest
	// NodeName is the node name from the CSR subject.
	NodeName string
	// ProviderID is the provider ID the CSR extension claims.
	ProviderID string

	// CSRName, CSRUID, Username and Annotations describe the Kubernetes
	// object, for providers that answer in more than one round.
	CSRName     string
	CSRUID      string
	Username    string
	Annotations map[string]string

	// MachineAnnotations are the annotations of the Machine the CSR was
	// matched to (and of its infrastructure object, where the signer reads
	// one), for providers whose infrastructure reports a key the evidence
	// must match (cluster-x-k8s-io/tpm-endorsement-key).
	MachineAnnotations map[string]string

	// Approved reports that this signer approved the CSR already and is
	// verifying it again before it signs: evidence that is good once (a
	// challenge answer whose challenged CSR the approval consumed) is still
	// accepted, since the approval is what consumed it.
	Approved bool

	// LookupCSR fetches another CSR of the same workload cluster by name,
	// for providers whose second round refers to the first. It returns an
	// error wrapping ErrCSRNotFound when there is no such CSR.
	LookupCSR func(ctx context.Context, name string) (*CSRRecord, error)
}

// CSRRecord is a CertificateSigningRequest as a verifier sees it.
type CSRRecord struct {
	Name        string
	UID         string
	Username    string
	SignerName  string
	Request     []byte
	Annotations map[string]string
	// Approved, Denied and Issued report the CSR's state.
	Approved, Denied, Issued bool
}

// ErrCSRNotFound is wrapped by LookupCSR when the named CSR does not exist.
var ErrCSRNotFound = errors.New("certificate signing request not found")

// Result is what a verifier proved. Exactly one of Identity and Challenge is
// set.
type Result struct {
	// Identity is set when the evidence proved who the node is.
	Identity *Identity
	// Challenge is set when the verifier needs a second round: the signer
	// writes it into the CSR's challenge annotation and waits for the answer.
	Challenge []byte
	// Answers, set with Identity, names the earlier CSR whose challenge
	// this evidence answered. The signer denies that CSR (reason
	// ChallengeAnswered) before it approves this one, so that a challenge
	// is answered once.
	Answers string
}

// Challenger is implemented by verifiers that challenge (return
// Result.Challenge). The signer asks it when a challenge it wrote stops
// being accepted, to deny the challenged CSR then if nobody answered, rather
// than challenge it again.
type Challenger interface {
	// ChallengeExpiry returns the expiry of a challenge this verifier made.
	ChallengeExpiry(challenge []byte) (time.Time, error)
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

// DenyError reports evidence that does not verify. Reason is a short
// CamelCase word used as the CSR condition reason; Message says what to fix.
type DenyError struct {
	Reason  string
	Message string
}

func (e *DenyError) Error() string { return e.Reason + ": " + e.Message }

// Deny returns a *DenyError with a formatted message.
func Deny(reason, format string, args ...any) error {
	return &DenyError{Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// AsDenial reports whether err carries a *DenyError, and returns it.
func AsDenial(err error) (*DenyError, bool) {
	var d *DenyError
	if errors.As(err, &d) {
		return d, true
	}
	return nil, false
}

// bindingContext is the domain separator of Binding.
const bindingContext = "kubelet-authenticator/v1\x00"

// Binding returns SHA-256("kubelet-authenticator/v1\x00" || spkiDER), the
// value every piece of evidence must commit to.
func Binding(spkiDER []byte) []byte {
	h := sha256.New()
	h.Write([]byte(bindingContext))
	h.Write(spkiDER)
	return h.Sum(nil)
}
