package engine

import (
	"fmt"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
)

// Outcome is what the writer does with a request.
type Outcome string

const (
	// Skip means: nothing to do (not ours, decided, approved by someone else).
	Skip Outcome = "skip"
	// Retry means: a transient error (Err); the request is looked at again with
	// backoff, never denied for it.
	Retry Outcome = "retry"
	// Wait means: the request carries an open challenge; look again After.
	Wait Outcome = "wait"
	// Deny means: deny with Reason and Message (every denial, Denials).
	Deny Outcome = "deny"
	// Fail means: the request was approved by this signer but can no longer be
	// signed (an approved request cannot be denied).
	Fail Outcome = "fail"
	// Challenge means: write Annotations (the challenge and its seal).
	Challenge Outcome = "challenge"
	// Approve means: close Consume first (when set), then approve with Reason and
	// Message, then sign Issue (when set).
	Approve Outcome = "approve"
	// Sign means: the request is approved by this signer; sign Issue.
	Sign Outcome = "sign"
)

// Decision is the outcome of deciding one request. It is a value: the
// writer applies it, and tests compare it.
type Decision struct {
	Outcome Outcome
	// Profile is the request's profile.
	Profile *Profile
	// Reason and Message: the condition to write (Deny, Fail, Approve).
	Reason, Message string
	// Denials are every failed check of a Deny or Fail.
	Denials []*attestor.DenyError
	// Err is the transient error of a Retry.
	Err error
	// After is how long a Wait waits.
	After time.Duration
	// Annotations are set on the request before the outcome is written
	// (supported-versions with a Deny; the challenge and its seal).
	Annotations map[string]string
	// Consume is the challenged request whose challenge this one answered:
	// it is denied ChallengeAnswered, conditional on the version that was
	// verified, before this one is approved.
	Consume *certificatesv1.CertificateSigningRequest
	// Issue is what to sign (Approve with a signing profile, Sign).
	Issue *issue.Request
	// PodCertificate is the pod certificate to write (Approve of a pod
	// certificate request, DecidePod).
	PodCertificate *podcert.Issued
	// Machine is the matched Machine, when one was.
	Machine *Machine
	// NodeName and ProviderID are what the request claims, once parsed.
	NodeName, ProviderID string
	// Approved is true when this signer approved the request already.
	Approved bool
	// Verification reports the verifier's call, for metrics; nil when the
	// verifier was not called.
	Verification *Verification
}

// Results of a verification.
const (
	VerifyResultVerified   = "verified"
	VerifyResultChallenged = "challenged"
	VerifyResultDenied     = "denied"
	VerifyResultError      = "error"
)

// Verification is one call of a verifier.
type Verification struct {
	Provider string
	// Result is one of the VerifyResult constants.
	Result string
	Took   time.Duration
}

func deny(d *Decision, ds ...*attestor.DenyError) *Decision {
	d.Outcome = Deny
	d.Denials = ds
	d.Reason, d.Message = attestor.Summary(ds)
	return d
}

func retry(d *Decision, err error) *Decision {
	d.Outcome = Retry
	d.Err = err
	return d
}

// Undecidable turns a Retry of a request that has been retried tries times
// into its final decision: denied Undecidable (or failed, when approved),
// with the last error in the message.
func Undecidable(d *Decision, tries int) *Decision {
	out := *d
	out.Err = nil
	deny(&out, &attestor.DenyError{Reason: attestor.ReasonUndecidable, Message: fmt.Sprintf(
		"the signer could not decide this request in %d tries (last: %v); file a new request once the cause is fixed", tries, d.Err)})
	if out.Approved {
		out.Outcome = Fail
		out.Reason, out.Message = attestor.ReasonSigningFailed, out.Reason+": "+out.Message
	}
	return &out
}
