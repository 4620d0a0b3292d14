package controller

import (
	"context"
	"fmt"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/klog/v2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Reasons of the two-round (challenge) flow, written on the challenged CSR.
const (
	// ReasonChallengeAnswered: a later CSR answered this CSR's challenge and
	// was approved; this one is closed so that the challenge is answered
	// once. Not a failure: the node got its certificate through the answer.
	ReasonChallengeAnswered = "ChallengeAnswered"
	// ReasonChallengeExpired: nobody answered this CSR's challenge in time;
	// the node files a new request.
	ReasonChallengeExpired = "ChallengeExpired"
	// ReasonMalformedChallenge: the CSR carries a challenge annotation that
	// the verifier cannot read (the signer did not write it).
	ReasonMalformedChallenge = "MalformedChallenge"
)

// IdentityBinder applies trust on first use: it binds a proven stable
// identity to the Machine on first use and accepts it afterwards for that
// Machine only. A conflict is reported as a *checks.Failure (the CSR is
// denied with its reason); any other error is transient (the CSR is
// retried).
type IdentityBinder interface {
	Bind(ctx context.Context, machine *Machine, identity string) error
}

// challengeSlack is added to a challenge's expiry before the challenged CSR
// is looked at again, so that the verifier's clock has passed it too.
const challengeSlack = time.Second

// challenged decides a CSR that already carries a challenge: it is not
// challenged again (that would change the secret under a node that is
// answering), only closed once the challenge expired unanswered. handled is
// false when the CSR's verifier does not challenge, so the annotation means
// nothing to it.
func (c *Controller) challenged(ctx context.Context, csr *certificatesv1.CertificateSigningRequest, challenge string) (handled bool, err error) {
	ch, ok := c.cfg.Verifiers[c.signers[csr.Spec.SignerName]].(attestor.Challenger)
	if !ok {
		return false, nil
	}
	expires, err := ch.ChallengeExpiry([]byte(challenge))
	if err != nil {
		return true, c.denyCSR(ctx, csr, nil, ReasonMalformedChallenge, fmt.Sprintf("the request carries a %s annotation the signer did not write (%v); file a request without it", attestor.AnnotationChallenge, err))
	}
	if wait := expires.Sub(c.now()); wait > 0 {
		c.queue.AddAfter(csr.Name, wait+challengeSlack)
		return true, nil
	}
	return true, c.denyCSR(ctx, csr, nil, ReasonChallengeExpired, fmt.Sprintf(
		"the challenge expired at %s without an answer; the node files a new request (if this repeats, check that it can reach the API server and answer within the challenge TTL)",
		expires.UTC().Format(time.RFC3339)))
}

// consumeChallenge denies the CSR whose challenge the request being approved
// answered, before that request is approved. The write is conditional on
// the version that was verified, so of two answers to one challenge only one
// is approved; if it fails, the answer is retried (and verified again), never
// approved.
func (c *Controller) consumeChallenge(ctx context.Context, answered, by string) error {
	first, err := c.lister.Get(answered)
	if err != nil {
		return fmt.Errorf("unable to read the answered request %s: %w", answered, err)
	}
	if hasCondition(first, certificatesv1.CertificateApproved) || hasCondition(first, certificatesv1.CertificateDenied) ||
		hasCondition(first, certificatesv1.CertificateFailed) || len(first.Status.Certificate) > 0 {
		return fmt.Errorf("the answered request %s was decided meanwhile; deciding %s again", answered, by)
	}
	logger := klog.FromContext(ctx).WithValues("csr", answered)
	return c.denyCSR(klog.NewContext(ctx, logger), first, nil, ReasonChallengeAnswered,
		fmt.Sprintf("the challenge was answered by request %s, which is approved instead", by))
}

func (c *Controller) now() time.Time {
	if c.cfg.Now != nil {
		return c.cfg.Now()
	}
	return time.Now()
}
