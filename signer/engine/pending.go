package engine

import (
	"fmt"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// pendingBound denies a request when its requester already has as many
// older requests waiting on a challenge, for the same node or in all, as
// the engine holds for one requester. Older requests are kept and newer ones turned
// away, so a flood never displaces the requests before it, and a request's
// standing only improves as older ones are decided. It returns nil when the
// request is within the bounds, and retries when the requests cannot be
// read.
func (e *Engine) pendingBound(d *Decision, csr *certificatesv1.CertificateSigningRequest, nodeName string) *Decision {
	olderForNode, err := e.olderPending(csr, nodeName)
	if err != nil {
		return retry(d, err)
	}
	older, err := e.olderPending(csr, "")
	if err != nil {
		return retry(d, err)
	}
	switch {
	case olderForNode >= e.cfg.MaxPendingPerNode:
		return deny(d, &attestor.DenyError{Reason: attestor.ReasonTooManyPending, Message: fmt.Sprintf(
			"%q has %d older requests waiting on a challenge for node %q (at most %d at a time); this one is not: wait for those to be decided, or delete them, and file again",
			csr.Spec.Username, olderForNode, nodeName, e.cfg.MaxPendingPerNode)})
	case older >= e.cfg.MaxPendingPerRequester:
		return deny(d, &attestor.DenyError{Reason: attestor.ReasonTooManyPending, Message: fmt.Sprintf(
			"%q has %d older requests waiting on a challenge (at most %d at a time); this one is not: wait for those to be decided, or delete them, and file again",
			csr.Spec.Username, older, e.cfg.MaxPendingPerRequester)})
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
	n := 0
	for _, o := range all {
		_, challenged := o.Annotations[attestor.AnnotationChallengeSeal]
		if o.UID != csr.UID && challenged && !Decided(o) && !HasCondition(o, certificatesv1.CertificateApproved) && filedBefore(o, csr) {
			n++
		}
	}
	return n, nil
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
