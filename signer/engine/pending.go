package engine

import (
	"fmt"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// pendingBound bounds one requester's requests waiting on a challenge,
// for the same node and in all, at the bounds of Config (B). A bootstrap
// token may be shared (a MachinePool's): first rounds forged with it must
// not lock the pool's other nodes out, so a place in the bound is held
// against newer requests only for PendingGrace after a request is filed:
//
//   - a request is denied when B older requests were filed within the
//     last PendingGrace and wait on their challenges (a burst is still
//     bounded), or 2B wait in all (memory stays bounded);
//   - else it is looked at; when B or more older ones wait, its challenge
//     lives only PendingGrace (the ttl returned), so that what is admitted
//     beyond the bound leaves as fast as it came.
//
// The older ones are never touched (their challenges are sealed, and an
// answering node is never turned away), but once they have had
// PendingGrace to be answered they no longer keep anyone out. It returns a
// nil Decision when the request is admitted, and retries when the
// requests cannot be read.
func (e *Engine) pendingBound(d *Decision, csr *certificatesv1.CertificateSigningRequest, nodeName string) (*Decision, time.Duration) {
	forNode, err := e.olderPending(csr, nodeName)
	if err != nil {
		return retry(d, err), 0
	}
	all, err := e.olderPending(csr, "")
	if err != nil {
		return retry(d, err), 0
	}
	grace := e.cfg.PendingGrace
	for _, b := range []struct {
		n     pendingCount
		bound int
		what  string
	}{
		{forNode, e.cfg.MaxPendingPerNode, fmt.Sprintf(" for node %q", nodeName)},
		{all, e.cfg.MaxPendingPerRequester, ""},
	} {
		switch {
		case b.n.recent >= b.bound:
			return deny(d, &attestor.DenyError{Reason: attestor.ReasonTooManyPending, Message: fmt.Sprintf(
				"%q has %d older requests waiting on a challenge%s (at most %d at a time, filed within %s of each other); this one is not: wait for those to be decided, or delete them, and file again",
				csr.Spec.Username, b.n.recent, b.what, b.bound, grace)}), 0
		case b.n.live >= 2*b.bound:
			return deny(d, &attestor.DenyError{Reason: attestor.ReasonTooManyPending, Message: fmt.Sprintf(
				"%q has %d older requests waiting on a challenge%s (at most %d at a time, %d with short-lived challenges); this one is not: wait for those to be decided, or delete them, and file again",
				csr.Spec.Username, b.n.live, b.what, 2*b.bound, b.bound)}), 0
		}
	}
	if forNode.live >= e.cfg.MaxPendingPerNode || all.live >= e.cfg.MaxPendingPerRequester {
		return nil, grace
	}
	return nil, 0
}

// pendingCount counts a requester's older requests waiting on a challenge:
// live, all whose challenge has not expired; recent, those of them filed
// within the last PendingGrace.
type pendingCount struct{ live, recent int }

// olderPending counts the requests of csr's requester (for nodeName, when
// set) filed before csr that wait on a challenge this signer wrote: the
// requests that stay pending for long (up to the challenge's lifetime) and
// hold the controller's memory meanwhile. Requests not yet looked at are
// not counted (a burst is decided in the order it is queued), nor are
// approved ones, which wait only for a certificate, nor ones whose
// challenge has expired (they are closed when looked at next).
func (e *Engine) olderPending(csr *certificatesv1.CertificateSigningRequest, nodeName string) (pendingCount, error) {
	var n pendingCount
	all, err := e.cfg.CSRs.ByRequester(csr.Spec.Username, nodeName)
	if err != nil {
		return n, fmt.Errorf("unable to count the pending requests of %q: %w", csr.Spec.Username, err)
	}
	now := e.now()
	for _, o := range all {
		seal, challenged := o.Annotations[attestor.AnnotationChallengeSeal]
		if o.UID == csr.UID || !challenged || Decided(o) || HasCondition(o, certificatesv1.CertificateApproved) || !filedBefore(o, csr) {
			continue
		}
		// The expiry is read, not verified (a seal the node wrote is
		// denied when its request is looked at): a request counts until
		// then either way.
		if exp, ok := sealExpiry(seal); ok && !now.Before(exp) {
			continue
		}
		n.live++
		if now.Sub(o.CreationTimestamp.Time) < e.cfg.PendingGrace {
			n.recent++
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
