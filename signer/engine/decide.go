package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
)

// Pending reports whether csr is a request of a served signer name that
// still needs work: not issued, denied or failed.
func (e *Engine) Pending(csr *certificatesv1.CertificateSigningRequest) bool {
	_, ours := e.profiles[csr.Spec.SignerName]
	return ours && !Decided(csr)
}

// Decided reports whether csr was issued, denied or failed: nothing is left
// to decide.
func Decided(csr *certificatesv1.CertificateSigningRequest) bool {
	return len(csr.Status.Certificate) > 0 || HasCondition(csr, certificatesv1.CertificateDenied) || HasCondition(csr, certificatesv1.CertificateFailed)
}

// Decide decides one request. Cheap, local checks (structure, requester,
// authorization) come before anything that costs a round trip, a verifier
// call or a challenge.
func (e *Engine) Decide(ctx context.Context, csr *certificatesv1.CertificateSigningRequest) *Decision {
	p, ok := e.profiles[csr.Spec.SignerName]
	d := &Decision{Outcome: Skip, Profile: p}
	if !ok || Decided(csr) {
		return d
	}
	approvedByUs := false
	if c := FindCondition(csr, certificatesv1.CertificateApproved); c != nil {
		if c.Reason != p.ApprovalReason() {
			return d // approved by someone else: not attested, so not signed by us
		}
		if p.Signer == nil {
			return d // approved by us; another signer issues
		}
		approvedByUs = true
		d.Approved = true
	}
	if p.Refused != "" {
		return e.close(d, approvedByUs, &attestor.DenyError{Reason: attestor.ReasonSignerNotServed, Message: p.Refused})
	}

	checked, dd := e.check(d, p, csr, approvedByUs)
	if dd != nil {
		return dd
	}
	d.NodeName, d.ProviderID = checked.NodeName, checked.ProviderID
	if approvedByUs {
		return e.resume(ctx, d, p, checked)
	}

	if dd, ok := e.challengeGuard(d, csr); ok {
		return dd
	}
	// After the guard: a request that was challenged was admitted, and is
	// never turned away by newer requests while its node answers.
	dd, challengeTTL := e.pendingBound(d, csr, checked.NodeName)
	if dd != nil {
		return dd
	}
	if dd := e.versionGate(d, p, checked); dd != nil {
		return dd
	}

	m, dd := e.machine(ctx, d, p, checked)
	if dd != nil {
		return dd
	}
	d.Machine = m
	if p.JoinOnce && m.Joined && !checked.Renewal {
		return deny(d, &attestor.DenyError{Reason: attestor.ReasonNodeAlreadyJoined, Message: fmt.Sprintf(
			"node %q of %s has joined already; attestor %q registers a node once, and the node renews with its own identity (a bootstrap token cannot ask for it again)",
			checked.NodeName, m.Describe(), p.Provider)})
	}
	if p.Verifier == nil {
		d.Outcome = Approve
		d.Reason = p.ApprovalReason()
		d.Message = fmt.Sprintf("node %q asks for its own serving certificate with addresses of %s", checked.NodeName, m.Describe())
		return d
	}

	res, dd := e.attest(ctx, d, p, csr, checked, m, challengeTTL)
	if dd != nil {
		return dd
	}
	if res.Challenge != nil {
		return e.challenge(d, csr, p, res.Challenge, challengeTTL)
	}
	return e.accept(ctx, d, p, checked, m, res.Identity)
}

// check runs the structural, requester and authorization checks, all
// reported at once, and the Cluster's list of authorized attestors.
func (e *Engine) check(d *Decision, p *Profile, csr *certificatesv1.CertificateSigningRequest, approvedByUs bool) (*checks.Checked, *Decision) {
	checked, err := checks.Check(csr, p.rules())
	ds := attestor.Denials(err)
	if err != nil && len(ds) == 0 {
		return nil, retry(d, err) // cannot happen; never deny on it
	}
	if !p.Authorizes(e.cfg.Authorized) {
		ds = append(ds, &attestor.DenyError{Reason: attestor.ReasonAttestorNotAuthorized, Message: fmt.Sprintf(
			"the Cluster does not authorize attestor %q (authorized: %q); add it to its authorized attestors or attest with an authorized one", p.Provider,
			e.cfg.Authorized)})
	}
	if len(ds) > 0 {
		return nil, e.close(d, approvedByUs, ds...)
	}
	return checked, nil
}

// resume decides a request this signer approved and did not issue (a write
// failed, or the process stopped in between): the decision stands unless
// the Machine went away. The evidence is not verified again: its
// challenge, if any, was consumed by the approval.
func (e *Engine) resume(ctx context.Context, d *Decision, p *Profile, checked *checks.Checked) *Decision {
	m, dd := e.machine(ctx, d, p, checked)
	if dd != nil {
		if dd.Outcome == Deny {
			return e.close(dd, true, dd.Denials...)
		}
		return dd
	}
	d.Machine = m
	d.Outcome, d.Issue = Sign, issueRequest(checked)
	return d
}

// versionGate denies evidence of a version the Cluster does not accept, and
// names the versions it does (the node re-files with one of them).
func (e *Engine) versionGate(d *Decision, p *Profile, checked *checks.Checked) *Decision {
	accepted := e.versions(p)
	if p.Verifier == nil || slices.Contains(accepted, checked.Request.Version) {
		return nil
	}
	supported := strings.Join(accepted, ",")
	d.Annotations = map[string]string{attestor.AnnotationSupportedVersions: supported}
	why := fmt.Sprintf("is not accepted by attestor %q", p.Provider)
	if slices.Contains(p.Verifier.Versions(), checked.Request.Version) {
		why = "does not name the workload cluster, and the Cluster requires evidence that does (binding v2)"
	}
	return deny(d, &attestor.DenyError{Reason: attestor.ReasonUnsupportedEvidenceVersion, Message: fmt.Sprintf(
		"evidence version %q %s; file a new request with one of %s (upgrade the node's kubelet-authenticator if it has none of them)", checked.Request.Version, why,
		supported)})
}

// attest verifies the request's evidence and, when it answers a challenge,
// the challenged request and the answer (recording the challenged request
// in d.Consume). The result carries either a challenge to write or the
// proven identity.
func (e *Engine) attest(ctx context.Context, d *Decision, p *Profile, csr *certificatesv1.CertificateSigningRequest, checked *checks.Checked, m *Machine,
	challengeTTL time.Duration) (*attestor.Result, *Decision) {
	res, dd := e.verify(ctx, d, p, csr, checked, m, nil, challengeTTL)
	if dd != nil || res.Answers == "" {
		return res, dd
	}
	round, first, dd := e.answered(ctx, d, csr, checked, res.Answers)
	if dd != nil {
		return nil, dd
	}
	if res, dd = e.verify(ctx, d, p, csr, checked, m, round, 0); dd != nil {
		return nil, dd
	}
	if res.Identity == nil {
		return nil, retry(d, fmt.Errorf("attestor %q did not prove an identity from the answer to %s", p.Provider, round.Name))
	}
	if !ConsumedBy(first, csr) {
		d.Consume = first
	}
	return res, nil
}

// accept approves a request whose evidence proved id, when id is the
// Machine's: its provider ID, its pinned identity, or (trust on first use)
// an identity no other Machine holds.
func (e *Engine) accept(ctx context.Context, d *Decision, p *Profile, checked *checks.Checked, m *Machine, id *attestor.Identity) *Decision {
	if got := id.ProviderID; got != checked.ProviderID || got != m.ProviderID {
		return deny(d, &attestor.DenyError{Reason: attestor.ReasonAttestedProviderIDMismatch, Message: fmt.Sprintf(
			"attestor %q proves provider ID %q, but the request claims %q and %s has %q", p.Provider, got, checked.ProviderID, m.Describe(), m.ProviderID)})
	}
	if m.Identity != "" && id.Stable != m.Identity {
		return deny(d, &attestor.DenyError{Reason: attestor.ReasonIdentityMismatch, Message: fmt.Sprintf(
			"attestor %q proves identity %q, but %s is pinned to %q; update the pin if the node was replaced", p.Provider, id.Stable, m.Describe(), m.Identity)})
	}
	if id.Stable != "" && e.cfg.Identities != nil && m.Identity == "" {
		if err := e.cfg.Identities.Bind(ctx, m, id.Stable); err != nil {
			if ds := attestor.Denials(err); len(ds) > 0 {
				return deny(d, ds...)
			}
			return retry(d, fmt.Errorf("unable to apply trust on first use to identity %s: %w", id.Stable, err))
		}
	}

	d.Outcome = Approve
	d.Reason = p.ApprovalReason()
	d.Message = fmt.Sprintf("attestor %q verified node %q with provider ID %q of %s", p.Provider, checked.NodeName, checked.ProviderID, m.Describe())
	if p.Kind == checks.Serving {
		d.Message += "; SANs are its addresses"
	}
	d.Issue = issueRequest(checked)
	return d
}

// versions returns the evidence versions p's verifier accepts in this
// Cluster, newest first: all of them, or only those that commit to the
// workload cluster when the Cluster requires it.
func (e *Engine) versions(p *Profile) []string {
	if p.Verifier == nil {
		return nil
	}
	vs := slices.Clone(p.Verifier.Versions())
	if cb, ok := p.Verifier.(attestor.ClusterBinder); ok && e.cfg.RequireClusterBinding {
		vs = slices.DeleteFunc(vs, func(v string) bool { return !cb.ClusterBound(v) })
	}
	return vs
}

// close denies a request, or fails it when this signer approved it already
// (an approved request cannot be denied).
func (e *Engine) close(d *Decision, approved bool, ds ...*attestor.DenyError) *Decision {
	deny(d, ds...)
	if approved {
		d.Outcome = Fail
		d.Reason, d.Message = attestor.ReasonSigningFailed, d.Reason+": "+d.Message
	}
	return d
}

// machine finds the request's Machine and, for serving certificates, checks
// the SANs against its addresses. It returns a non-nil Decision when the
// request is denied or retried.
func (e *Engine) machine(ctx context.Context, d *Decision, p *Profile, c *checks.Checked) (*Machine, *Decision) {
	var m *Machine
	var err error
	if p.Verifier == nil {
		m, err = e.cfg.Machines.ForNode(ctx, c.NodeName)
	} else {
		m, err = e.cfg.Machines.MatchMachine(ctx, c.NodeName, c.ProviderID)
	}
	if err != nil {
		if ds := attestor.Denials(err); len(ds) > 0 {
			return nil, deny(d, ds...)
		}
		return nil, retry(d, fmt.Errorf("unable to match node %q (provider ID %q) to a Machine: %w", c.NodeName, c.ProviderID, err))
	}
	if p.Kind == checks.Serving {
		if err := checks.CheckMachineAddresses(c.CSR, m.Describe(), m.DNSNames, m.IPs); err != nil {
			d.Machine = m
			return nil, deny(d, attestor.Denials(err)...)
		}
	}
	return m, nil
}

// verify calls the profile's verifier, once per request and round: this is
// the only place the signer calls a verifier.
func (e *Engine) verify(ctx context.Context, d *Decision, p *Profile, csr *certificatesv1.CertificateSigningRequest, c *checks.Checked, m *Machine,
	round *attestor.Round, challengeTTL time.Duration) (*attestor.Result, *Decision) {
	start := time.Now()
	res, err := p.Verifier.Verify(ctx, &attestor.VerifyRequest{
		Evidence:           c.Request.Evidence,
		Version:            c.Request.Version,
		Binding:            c.Binding,
		ClusterCAs:         e.cfg.ClusterCAs,
		ClusterUID:         e.cfg.ClusterUID,
		CSR:                c.CSR,
		NodeName:           c.NodeName,
		ProviderID:         c.ProviderID,
		UID:                string(csr.UID),
		Annotations:        maps.Clone(csr.Annotations),
		MachineAnnotations: maps.Clone(m.Annotations),
		Answered:           round,
		Policy:             e.cfg.Policies[p.Provider],
		ChallengeTTL:       challengeTTL,
	})
	v := &Verification{Provider: p.Provider, Took: time.Since(start)}
	d.Verification = v
	if err != nil {
		if ds := attestor.Denials(err); len(ds) > 0 {
			v.Result = VerifyResultDenied
			if ds[0].Reason == attestor.ReasonUnsupportedEvidenceVersion {
				// The verifier knows the version but its policy refuses it
				// (boot state needs TPM evidence v2): tell the node which
				// of the others to file, as version negotiation does.
				others := slices.DeleteFunc(e.versions(p), func(v string) bool { return v == c.Request.Version })
				d.Annotations = map[string]string{attestor.AnnotationSupportedVersions: strings.Join(others, ",")}
			}
			return nil, deny(d, ds...)
		}
		v.Result = VerifyResultError
		return nil, retry(d, fmt.Errorf("attestor %q could not verify the evidence: %w", p.Provider, err))
	}
	set := 0
	if res != nil {
		for _, b := range []bool{res.Identity != nil, res.Challenge != nil, res.Answers != ""} {
			if b {
				set++
			}
		}
	}
	switch {
	case set != 1, round != nil && res.Identity == nil:
		v.Result = VerifyResultError
		return nil, retry(d, fmt.Errorf("attestor %q returned no usable result (an identity, a challenge, or the request answered)", p.Provider))
	case res.Challenge != nil:
		v.Result = VerifyResultChallenged
	case res.Identity != nil:
		v.Result = VerifyResultVerified
	}
	return res, nil
}

// challenge decides to write a verifier's challenge, sealed.
func (e *Engine) challenge(d *Decision, csr *certificatesv1.CertificateSigningRequest, p *Profile, ch *attestor.Challenge, ttl time.Duration) *Decision {
	keyID, key := ch.KeyID, []byte(nil)
	if e.keys != nil && keyID == "" {
		keyID, key = e.keys.Current()
	} else if e.keys != nil {
		// The verifier derived its secret under this key: seal with the
		// same one, even if the current key has changed since.
		var err error
		if key, err = e.keys.Key(keyID); err != nil {
			return retry(d, fmt.Errorf("attestor %q made a challenge under challenge key %q: %w", p.Provider, keyID, err))
		}
	}
	if key == nil {
		return retry(d, fmt.Errorf("attestor %q challenges, but the signer has no challenge key", p.Provider))
	}
	now := e.now()
	expires := ch.Expires
	if ttl <= 0 {
		ttl = e.cfg.MaxChallengeTTL
	}
	if expires.IsZero() || expires.After(now.Add(ttl)) {
		return retry(d, fmt.Errorf("attestor %q made a challenge expiring at %s, outside (now, now+%s]", p.Provider, expires, ttl))
	}
	d.Outcome = Challenge
	d.Annotations = map[string]string{
		attestor.AnnotationChallenge:     string(ch.Data),
		attestor.AnnotationChallengeSeal: seal(keyID, key, e.cfg.ClusterUID, string(csr.UID), csr.Spec.SignerName, expires, ch.Data),
	}
	return d
}

// answered finds and checks the request whose challenge csr answers. The
// checks that hold for every two-round provider are made here, once: the
// challenged request exists under the same signer name, was filed by the
// same requester for the same key, node and provider ID, carries a
// challenge this signer sealed that has not expired, and is undecided.
func (e *Engine) answered(ctx context.Context, d *Decision, csr *certificatesv1.CertificateSigningRequest, c *checks.Checked, name string) (*attestor.Round,
	*certificatesv1.CertificateSigningRequest, *Decision) {
	denyf := func(reason, format string, args ...any) (*attestor.Round, *certificatesv1.CertificateSigningRequest, *Decision) {
		return nil, nil, deny(d, &attestor.DenyError{Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
	if name == csr.Name {
		return denyf(attestor.ReasonChallengeMismatch, "the answer names its own request as the challenged one")
	}
	first, err := e.cfg.CSRs.Get(csr.Spec.SignerName, name)
	if apierrors.IsNotFound(err) {
		return denyf(attestor.ReasonChallengeNotFound,
			"there is no request %q to signer %s (deleted, never filed, or filed to another signer); file a new first-round request", name, csr.Spec.SignerName)
	}
	if err != nil {
		return nil, nil, retry(d, fmt.Errorf("unable to read the challenged request %s: %w", name, err))
	}
	if first.Spec.SignerName != csr.Spec.SignerName {
		return denyf(attestor.ReasonChallengeMismatch, "request %q was filed to signer %s, this one to %s", name, first.Spec.SignerName, csr.Spec.SignerName)
	}
	if first.Spec.Username != csr.Spec.Username {
		return denyf(attestor.ReasonRequesterMismatch, "request %q was filed by %q, this one by %q", name, first.Spec.Username, csr.Spec.Username)
	}
	if c := FindCondition(first, certificatesv1.CertificateDenied); c != nil && c.Reason == attestor.ReasonChallengeExpired {
		return denyf(attestor.ReasonChallengeExpired, "the challenge on request %q expired before it was answered; file a new first-round request", name)
	}
	if HasCondition(first, certificatesv1.CertificateApproved) || Decided(first) {
		// A close (Denied) for csr is never beside an approval: the API
		// server refuses a CSR both approved and denied.
		if !ConsumedBy(first, csr) {
			return denyf(attestor.ReasonChallengeUsed, "the challenge of request %q was already answered or withdrawn; file a new first-round request", name)
		}
		// Closed for this very answer, whose approval failed (or the
		// controller stopped) after the close: it is approved now. The
		// cache keeps no request of a decided CSR.
		live, err := e.cfg.CSRs.Live(ctx, csr.Spec.SignerName, name)
		if apierrors.IsNotFound(err) {
			return denyf(attestor.ReasonChallengeNotFound, "request %q, whose challenge this request answered, is gone; file a new first-round request", name)
		}
		if err != nil {
			return nil, nil, retry(d, fmt.Errorf("unable to read the challenged request %s: %w", name, err))
		}
		if !ConsumedBy(live, csr) || live.UID != first.UID {
			return denyf(attestor.ReasonChallengeUsed, "the challenge of request %q was already answered or withdrawn; file a new first-round request", name)
		}
		first = live
	}
	ch, err := e.openChallenge(first)
	var retired *keyRetiredError
	var unknown *keyUnknownError
	switch {
	case errors.As(err, &retired):
		return denyf(attestor.ReasonChallengeExpired, "the challenge on request %q can no longer be answered: %v; file a new first-round request", name, err)
	case errors.As(err, &unknown):
		return nil, nil, retry(d, fmt.Errorf("the challenge on request %q: %w", name, err))
	case err != nil:
		return denyf(attestor.ReasonChallengeNotIssued, "request %q carries no challenge this signer wrote: %v", name, err)
	}
	if ch == nil {
		return denyf(attestor.ReasonChallengeNotIssued, "request %q carries no challenge yet; wait for it before answering", name)
	}
	if !e.now().Before(ch.Expires) {
		return denyf(attestor.ReasonChallengeExpired, "the challenge on request %q expired at %s; file a new first-round request", name,
			ch.Expires.Format(time.RFC3339))
	}
	req, err := attestor.ParseRequest(first.Spec.Request)
	if err != nil {
		return denyf(attestor.ReasonChallengeNotFound, "the challenged request %q is not an attested request: %v", name, err)
	}
	var mismatch []string
	if req.Provider != c.Request.Provider {
		mismatch = append(mismatch, fmt.Sprintf("provider %q", req.Provider))
	}
	if !bytes.Equal(req.CSR.RawSubjectPublicKeyInfo, c.CSR.RawSubjectPublicKeyInfo) {
		mismatch = append(mismatch, "another key")
	}
	if req.CSR.Subject.CommonName != c.CSR.Subject.CommonName {
		mismatch = append(mismatch, fmt.Sprintf("subject %q", req.CSR.Subject.CommonName))
	}
	if pid, err := attestor.ProviderIDFromExtensions(req.CSR.Extensions); err != nil || pid != c.ProviderID {
		mismatch = append(mismatch, "another provider ID")
	}
	if len(mismatch) > 0 {
		return denyf(attestor.ReasonChallengeMismatch, "the challenged request %q is for %s than this answer; answer only your own challenge", name,
			strings.Join(mismatch, ", "))
	}
	return &attestor.Round{
		Name: first.Name, UID: string(first.UID), CSR: req.CSR,
		Evidence: req.Evidence, Version: req.Version,
		Annotations: maps.Clone(first.Annotations), Challenge: ch,
	}, first, nil
}

func issueRequest(c *checks.Checked) *issue.Request {
	return &issue.Request{CSR: c.CSR, ProviderID: c.ProviderID, Usages: c.Usages, Duration: c.RequestedDuration}
}

// ConsumedMessage is the message of the condition that closes a
// challenged request (denied ChallengeAnswered) for the answer with name
// and uid. The controller writes it; ConsumedBy reads it back.
func ConsumedMessage(name string, uid types.UID) string {
	return fmt.Sprintf("the challenge was answered by request %s (UID %s), which is approved instead", name, uid)
}

// ConsumedBy reports whether first was closed for the answer csr: the
// close is the conditional write that makes a challenge single-use, and
// it names the one answer that may then be approved. An answer whose
// approval failed after the close (an API error, the controller stopped)
// is approved when decided again; any other answer, or one of the same
// name filed anew (another UID), is refused ChallengeUsed.
func ConsumedBy(first, csr *certificatesv1.CertificateSigningRequest) bool {
	c := FindCondition(first, certificatesv1.CertificateDenied)
	return c != nil && c.Reason == attestor.ReasonChallengeAnswered && csr.UID != "" && c.Message == ConsumedMessage(csr.Name, csr.UID)
}

// FindCondition returns csr's condition of type t that is not False.
func FindCondition(csr *certificatesv1.CertificateSigningRequest, t certificatesv1.RequestConditionType) *certificatesv1.CertificateSigningRequestCondition {
	for i := range csr.Status.Conditions {
		if c := &csr.Status.Conditions[i]; c.Type == t && c.Status != corev1.ConditionFalse {
			return c
		}
	}
	return nil
}

// HasCondition reports whether csr has a condition of type t that is not
// False.
func HasCondition(csr *certificatesv1.CertificateSigningRequest, t certificatesv1.RequestConditionType) bool {
	return FindCondition(csr, t) != nil
}
