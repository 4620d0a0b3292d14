// Package engine is the signer's one decision pipeline. Every signer name
// the controller serves (attested client, attested serving, kubelet's own
// serving requests) goes through the same steps:
//
//	parse → structural rules of the certificate kind → authorization for
//	the Cluster → the challenge guard → version negotiation → Machine
//	match → verify (and find the answered round) → provider ID and pins →
//	trust on first use
//
// and comes out as a Decision: a value that says what to write (deny with
// every reason, retry, wait, challenge, approve and sign, sign, fail). The
// engine reads (CSRs through a lister, Machines, a verifier's upstream) and
// binds trust-on-first-use records, but never writes a CSR: one writer, in
// package controller, applies decisions. What differs between certificate
// kinds is a Profile (which rules, which signer, whether evidence is
// verified), never a second copy of a step.
package engine

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// Machine is the Cluster API Machine (or standalone allowlist entry) a
// request was matched to.
type Machine struct {
	Namespace, Name string
	// UID is the Machine's UID: trust-on-first-use records name it.
	UID types.UID
	// ProviderID is the Machine's spec.providerID.
	ProviderID string
	// Annotations are the Machine's (and its infrastructure object's)
	// annotations, handed to the verifier.
	Annotations map[string]string
	// DNSNames are its Hostname, InternalDNS and ExternalDNS addresses; IPs
	// its InternalIP and ExternalIP addresses. Serving SANs must be among
	// them.
	DNSNames []string
	IPs      []net.IP
	// Joined is true once the Machine's node has joined (status.nodeRef
	// is set).
	Joined bool
	// Identity, when set, pins the attested stable identity: evidence that
	// proves another one is denied (standalone allowlist entries).
	Identity string
	// Description is what a message calls it when it is not a Cluster API
	// Machine (a standalone allowlist entry); empty: Machine namespace/name.
	Description string
}

// String returns namespace/name.
func (m *Machine) String() string {
	if m.Namespace == "" {
		return m.Name
	}
	return m.Namespace + "/" + m.Name
}

// Describe names it in a message for the operator: "Machine
// namespace/name", or its Description.
func (m *Machine) Describe() string {
	if m.Description != "" {
		return m.Description
	}
	return "Machine " + m.String()
}

// Machines finds the Machine of a request. A request no Machine accounts for
// is reported as *attestor.DenyError (the CSR is denied with its reason); any
// other error is transient (the CSR is retried).
type Machines interface {
	// MatchMachine returns the Machine with providerID that claims nodeName.
	MatchMachine(ctx context.Context, nodeName, providerID string) (*Machine, error)
	// ForNode returns the Machine that is node nodeName (its nodeRef, or
	// before that its name or a Hostname or InternalDNS address), for
	// requests that carry no provider ID.
	ForNode(ctx context.Context, nodeName string) (*Machine, error)
}

// IdentityBinder applies trust on first use: it binds a proven stable
// identity to the Machine on first use and accepts it afterwards for that
// Machine only. A conflict is reported as *attestor.DenyError; any other
// error is transient.
type IdentityBinder interface {
	Bind(ctx context.Context, machine *Machine, identity string) error
}

// CertificateSigner signs an approved request; *issue.Signer is one.
type CertificateSigner interface {
	Sign(req *issue.Request) ([]byte, error)
}

// CSRs reads the workload cluster's CSRs of the signer names served (an
// informer's cache).
type CSRs interface {
	// Get returns a CSR of one signer name, or an error satisfying
	// apierrors.IsNotFound when there is no such CSR.
	Get(signerName, name string) (*certificatesv1.CertificateSigningRequest, error)
	// ByRequester returns the CSRs of every served signer name that
	// username filed, decided ones too.
	ByRequester(username string) ([]*certificatesv1.CertificateSigningRequest, error)
	// Waiting returns the CSRs of every served signer name that wait on a
	// challenge (WaitingOnChallenge): of every requester when username is
	// empty, else of username; with a nodeName, only those that ask for
	// that node's certificate (checks.RequestedNodeName).
	Waiting(username, nodeName string) ([]*certificatesv1.CertificateSigningRequest, error)
	// Live reads a CSR of one signer name from the API server, for the one
	// case where the cached copy is not enough: a challenged request the
	// cache keeps no request of (it is decided), closed for the answer
	// being decided (ConsumedBy).
	Live(ctx context.Context, signerName, name string) (*certificatesv1.CertificateSigningRequest, error)
}

// Profile is what one signer name issues, and how.
type Profile struct {
	// SignerName is the signer name served.
	SignerName string
	// Kind decides the structural rules.
	Kind checks.Kind
	// Provider and Verifier: the attestor whose evidence the requests carry.
	// Both empty for kubelet's own kubernetes.io/kubelet-serving requests,
	// which carry none and are approved, not signed.
	Provider string
	Verifier attestor.Verifier
	// Signer signs approved requests; nil means approve only (another
	// signer, kube-controller-manager, issues).
	Signer CertificateSigner
	// JoinOnce issues to a bootstrap identity only for a Machine whose node
	// has not joined: the attestor proves nothing a second registration
	// could be told apart by (insecure). The node's own renewals pass.
	JoinOnce bool
	// Refused, when set, denies every request to this signer name with
	// reason SignerNotServed and this explanation.
	Refused string
}

// ApprovalReason is the reason of the Approved condition this profile
// writes; a request approved with another reason was approved by someone
// else and is never signed by this controller.
func (p *Profile) ApprovalReason() string {
	switch {
	case p.Verifier == nil:
		return attestor.ReasonServingVerified
	case p.Kind == checks.Serving:
		return attestor.ReasonAttestedServingVerified
	}
	return attestor.ReasonAttestationVerified
}

func (p *Profile) rules() checks.Rules {
	return checks.Rules{Kind: p.Kind, Attested: p.Verifier != nil, Provider: p.Provider}
}

// Config configures an Engine.
type Config struct {
	// Cluster names the workload cluster in messages.
	Cluster string
	// Profiles are the signer names served.
	Profiles []*Profile
	// Authorized lists the providers the Cluster authorizes.
	Authorized []string
	// Policies are the Cluster's policy documents, by provider, handed to
	// the provider's verifier (the TPM boot-state policy).
	Policies map[string][]byte
	// ClusterUID is the UID of the Cluster served: challenge seals and
	// the challenge secrets verifiers derive name it.
	ClusterUID string
	// ClusterCAs are the DER certificates of the CA this workload
	// cluster's clients are signed with, the signing one first, then the
	// rest of its bundle: evidence of binding v2 must commit to one of
	// them.
	ClusterCAs [][]byte
	// RequireClusterBinding refuses evidence that does not commit to the
	// workload cluster (binding v1) for every provider whose verifier has
	// versions that do (attestor.ClusterBinder): such requests are denied
	// UnsupportedEvidenceVersion with the cluster-bound versions as the
	// supported ones, and the node files anew in one of them.
	RequireClusterBinding bool
	// Machines matches requests to Machines.
	Machines Machines
	// Identities, when set, applies trust on first use.
	Identities IdentityBinder
	// CSRs reads other CSRs (the round a second round answers).
	CSRs CSRs
	// ChallengeKey seals the challenges the engine writes; required when a
	// verifier challenges (at least 32 bytes, shared by every replica).
	ChallengeKey []byte
	// ChallengeKeys, when set, replaces ChallengeKey: the current key
	// seals new challenges, and a challenge is checked under the key its
	// seal names, so that a rotation leaves the challenges in flight
	// answerable while their key is kept.
	ChallengeKeys attestor.ChallengeKeys
	// MaxChallengeTTL bounds how long a challenge may stay open; 0 means
	// DefaultMaxChallengeTTL.
	MaxChallengeTTL time.Duration
	// MaxPendingPerNode bounds the requests waiting on a challenge one
	// requester may have for one node name; newer ones beyond it are
	// denied TooManyPendingRequests without being verified. 0 means
	// DefaultMaxPendingPerNode.
	MaxPendingPerNode int
	// MaxPendingPerRequester bounds one requester's requests waiting on a
	// challenge in all (a bootstrap token shared by nodes joining together); 0 means
	// DefaultMaxPendingPerRequester.
	MaxPendingPerRequester int
	// PendingGrace is how long a request waiting on a challenge holds its
	// place in the bounds above against newer requests, and the lifetime
	// of the challenges written beyond them; 0 means DefaultPendingGrace.
	// It must leave a node time enough to see its challenge and answer.
	PendingGrace time.Duration
	// MaxPendingPerCluster bounds the requests waiting on a challenge in
	// the workload cluster, of all requesters; newer ones beyond it are
	// denied TooManyPendingRequestsInCluster without being verified. 0
	// means DefaultMaxPendingPerCluster.
	MaxPendingPerCluster int
	// Clock tells the time; nil means the real clock.
	Clock clock.PassiveClock
}

// DefaultMaxChallengeTTL bounds a challenge's lifetime when the Config does
// not; the controller's flags allow no longer challenge lifetime.
const DefaultMaxChallengeTTL = time.Hour

// DefaultMaxPendingPerNode leaves a node room for a challenged client and
// serving request and a retry of each; DefaultMaxPendingPerRequester for a
// bootstrap token shared by the nodes of a scale-up joining together (two
// rounds each for TPM nodes); DefaultMaxPendingPerCluster for two such
// tokens at once, or one and the renewals of a few hundred joined nodes. A
// pending request costs the controller at most attestor.MaxRequestSize of
// cache and its four annotations of attestor.MaxAnnotationSize, nothing of
// its other metadata (TPM evidence, the largest, is under 100 KiB), so one
// requester holds at most 63 MiB of it and one cluster 125 MiB; a
// challenge is answered within seconds, so the real figure is a small part
// of that.
const (
	DefaultMaxPendingPerNode      = 4
	DefaultMaxPendingPerRequester = 200
	DefaultMaxPendingPerCluster   = 400
)

// DefaultPendingGrace leaves a node that sees its challenge within seconds
// (it watches its request) ample time to answer it: a TPM answers in well
// under a second, a slow one in a few.
const DefaultPendingGrace = time.Minute

// Engine decides requests.
type Engine struct {
	cfg      Config
	keys     attestor.ChallengeKeys
	profiles map[string]*Profile
}

// New returns an Engine.
func New(cfg Config) (*Engine, error) {
	var errs []error
	if cfg.Machines == nil {
		errs = append(errs, errors.New("the engine needs a Machine matcher"))
	}
	if cfg.CSRs == nil {
		errs = append(errs, errors.New("the engine needs a CSR lister"))
	}
	if len(cfg.Profiles) == 0 {
		errs = append(errs, errors.New("the engine needs at least one signer name to serve"))
	}
	if cfg.ChallengeKey != nil && len(cfg.ChallengeKey) < 32 {
		errs = append(errs, fmt.Errorf("the challenge key is %d bytes; at least 32 are required", len(cfg.ChallengeKey)))
	}
	e := &Engine{cfg: cfg, keys: cfg.ChallengeKeys, profiles: map[string]*Profile{}}
	if e.keys == nil && cfg.ChallengeKey != nil {
		e.keys = attestor.StaticChallengeKey(cfg.ChallengeKey)
	}
	for _, p := range cfg.Profiles {
		if _, dup := e.profiles[p.SignerName]; dup {
			errs = append(errs, fmt.Errorf("signer name %q is served twice", p.SignerName))
		}
		if p.Refused == "" && p.Verifier == nil && p.Signer != nil {
			errs = append(errs, fmt.Errorf("signer name %q would sign without verifying evidence", p.SignerName))
		}
		if p.Refused == "" && p.Verifier != nil && p.Signer == nil {
			errs = append(errs, fmt.Errorf("signer name %q verifies evidence but has no CA to sign with", p.SignerName))
		}
		e.profiles[p.SignerName] = p
	}
	if e.cfg.MaxChallengeTTL <= 0 {
		e.cfg.MaxChallengeTTL = DefaultMaxChallengeTTL
	}
	if e.cfg.MaxPendingPerNode <= 0 {
		e.cfg.MaxPendingPerNode = DefaultMaxPendingPerNode
	}
	if e.cfg.MaxPendingPerRequester <= 0 {
		e.cfg.MaxPendingPerRequester = DefaultMaxPendingPerRequester
	}
	if e.cfg.PendingGrace <= 0 {
		e.cfg.PendingGrace = DefaultPendingGrace
	}
	if e.cfg.PendingGrace > e.cfg.MaxChallengeTTL {
		errs = append(errs, fmt.Errorf("the pending grace %s is longer than the longest challenge lifetime %s", e.cfg.PendingGrace, e.cfg.MaxChallengeTTL))
	}
	if e.cfg.MaxPendingPerCluster <= 0 {
		e.cfg.MaxPendingPerCluster = DefaultMaxPendingPerCluster
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return e, nil
}

// Profile returns the profile of a signer name, if it is served.
func (e *Engine) Profile(signerName string) (*Profile, bool) {
	p, ok := e.profiles[signerName]
	return p, ok
}

// Profiles returns the profiles of the signer names the engine decides.
func (e *Engine) Profiles() []*Profile { return slices.Clone(e.cfg.Profiles) }

// Served reports whether a request to p's signer name can be signed or
// approved under the Cluster's authorized attestors (Profile.Serves).
func (e *Engine) Served(p *Profile) bool { return p.Serves(e.cfg.Authorized) }

// SignerNames returns the signer names of the engine's profiles.
func (e *Engine) SignerNames() []string {
	out := make([]string, 0, len(e.profiles))
	for _, p := range e.cfg.Profiles {
		out = append(out, p.SignerName)
	}
	return out
}

func (e *Engine) now() time.Time {
	if e.cfg.Clock != nil {
		return e.cfg.Clock.Now()
	}
	return time.Now()
}
