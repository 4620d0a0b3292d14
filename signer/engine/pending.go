package engine

import (
	"fmt"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// pendingBound denies a request when its requester already has as many
// older requests waiting on a challenge, for the same node or in all, as
// the engine holds for one requester, or the workload cluster as many as it
// holds for one cluster (all requesters together: what one tenant's
// requests may hold of the controller's cache). Older requests are kept and
// newer ones turned away, so a flood never displaces the requests before
// it, and a request's standing only improves as older ones are decided. It
// returns nil when the request is within the bounds, and retries when the
// requests cannot be read.
func (e *Engine) pendingBound(d *Decision, csr *certificatesv1.CertificateSigningRequest, nodeName string) *Decision {
	olderForNode, err := e.olderPending(csr, nodeName)
	if err != nil {
		return retry(d, err)
	}
	older, err := e.olderPending(csr, "")
	if err != nil {
		return retry(d, err)
	}
	waiting, err := e.cfg.CSRs.Waiting()
	if err != nil {
		return retry(d, fmt.Errorf("unable to count the requests waiting on a challenge: %w", err))
	}
	olderInCluster := countOlder(waiting, csr)
	switch {
	case olderForNode >= e.cfg.MaxPendingPerNode:
		return deny(d, &attestor.DenyError{Reason: attestor.ReasonTooManyPending, Message: fmt.Sprintf(
			"%q has %d older requests waiting on a challenge for node %q (at most %d at a time); this one is not: wait for those to be decided, or delete them, and file again",
			csr.Spec.Username, olderForNode, nodeName, e.cfg.MaxPendingPerNode)})
	case older >= e.cfg.MaxPendingPerRequester:
		return deny(d, &attestor.DenyError{Reason: attestor.ReasonTooManyPending, Message: fmt.Sprintf(
			"%q has %d older requests waiting on a challenge (at most %d at a time); this one is not: wait for those to be decided, or delete them, and file again",
			csr.Spec.Username, older, e.cfg.MaxPendingPerRequester)})
	case olderInCluster >= e.cfg.MaxPendingPerCluster:
		return deny(d, &attestor.DenyError{Reason: attestor.ReasonTooManyPendingInCluster, Message: fmt.Sprintf(
			"the cluster has %d older requests waiting on a challenge (at most %d at a time, of all requesters); this one is not: file again once they are decided (a challenge expires unanswered within %s), or delete the ones no node answers",
			olderInCluster, e.cfg.MaxPendingPerCluster, e.cfg.MaxChallengeTTL)})
	}
	return nil
}

// olderPending counts the requests of csr's requester (for nodeName, when
// set) filed before csr that wait on a challenge this signer wrote: the
// requests that stay pending for long (up to the challenge's lifetime) and
// hold the controller's memory meanwhile. Requests not yet looked at are
// not counted (a burst is decided in the order it is queued), nor are
// approved ones, which wait only for a certificate.
func (e *Engine) olderPending(csr *certificatesv1.CertificateSigningRequest, nodeName string) (int, error) {
	all, err := e.cfg.CSRs.ByRequester(csr.Spec.Username, nodeName)
	if err != nil {
		return 0, fmt.Errorf("unable to count the pending requests of %q: %w", csr.Spec.Username, err)
	}
	return countOlder(all, csr), nil
}

// countOlder counts the requests of all filed before csr that wait on a
// challenge.
func countOlder(all []*certificatesv1.CertificateSigningRequest, csr *certificatesv1.CertificateSigningRequest) int {
	n := 0
	for _, o := range all {
		if o.UID != csr.UID && WaitingOnChallenge(o) && filedBefore(o, csr) {
			n++
		}
	}
	return n
}

// WaitingOnChallenge reports whether csr carries a challenge this signer
// wrote (its seal; Decide checks it) and is neither decided nor approved:
// it stays pending, and cached, until its node answers or the challenge
// expires.
func WaitingOnChallenge(csr *certificatesv1.CertificateSigningRequest) bool {
	_, challenged := csr.Annotations[attestor.AnnotationChallengeSeal]
	return challenged && !Decided(csr) && !HasCondition(csr, certificatesv1.CertificateApproved)
}

// filedBefore orders requests by creation, then by name (the API server
// stamps creation to the second).
func filedBefore(a, b *certificatesv1.CertificateSigningRequest) bool {
	ta, tb := a.CreationTimestamp.Time, b.CreationTimestamp.Time
	if !ta.Equal(tb) {
		return ta.Before(tb)
	}
	return a.Name < b.Name
}
