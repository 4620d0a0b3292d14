package engine

import (
	"fmt"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// pendingBound bounds the requests waiting on a challenge that come before
// this one, at the bounds of Config (B): one requester's for the same node,
// one requester's in all, and the workload cluster's of all requesters
// together (what one tenant's requests may hold of the controller's
// cache). A bootstrap token may be shared (a MachinePool's): first rounds
// forged with it must not lock the pool's other nodes out, so a place in a
// bound is held against newer requests only for PendingGrace after a
// request is filed:
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
	forNode, err := e.olderPending(csr, csr.Spec.Username, nodeName)
	if err != nil {
		return retry(d, err), 0
	}
	all, err := e.olderPending(csr, csr.Spec.Username, "")
	if err != nil {
		return retry(d, err), 0
	}
	inCluster, err := e.olderPending(csr, "", "")
	if err != nil {
		return retry(d, err), 0
	}
	grace := e.cfg.PendingGrace
	short := false
	for _, b := range []struct {
		n      pendingCount
		bound  int
		reason string
		who    func(n int) string // whose n requests wait
	}{
		{forNode, e.cfg.MaxPendingPerNode, attestor.ReasonTooManyPending, func(n int) string {
			return fmt.Sprintf("%q has %d older requests waiting on a challenge for node %q", csr.Spec.Username, n, nodeName)
		}},
		{all, e.cfg.MaxPendingPerRequester, attestor.ReasonTooManyPending, func(n int) string {
			return fmt.Sprintf("%q has %d older requests waiting on a challenge", csr.Spec.Username, n)
		}},
		{inCluster, e.cfg.MaxPendingPerCluster, attestor.ReasonTooManyPendingInCluster, func(n int) string {
			return fmt.Sprintf("the cluster has %d older requests waiting on a challenge", n)
		}},
	} {
		var msg string
		switch {
		case b.n.recent >= b.bound:
			msg = b.who(b.n.recent) + fmt.Sprintf(" (at most %d at a time, filed within %s of each other)", b.bound, grace)
		case b.n.live >= 2*b.bound:
			msg = b.who(b.n.live) + fmt.Sprintf(" (at most %d at a time, %d with short-lived challenges)", 2*b.bound, b.bound)
		case b.n.live >= b.bound:
			short = true
			continue
		default:
			continue
		}
		return deny(d, &attestor.DenyError{Reason: b.reason, Message: msg + "; this one is not: wait for those to be decided, or delete them, and file again"}), 0
	}
	if short {
		return nil, grace
	}
	return nil, 0
}

// pendingCount counts older requests waiting on a challenge: live, all
// whose challenge has not expired; recent, those of them filed within the
// last PendingGrace.
type pendingCount struct{ live, recent int }

// olderPending counts the requests filed before csr that wait on a
// challenge this signer wrote: of every requester when username is empty,
// else of username (for nodeName, when set).
func (e *Engine) olderPending(csr *certificatesv1.CertificateSigningRequest, username, nodeName string) (pendingCount, error) {
	waiting, err := e.cfg.CSRs.Waiting(username, nodeName)
	if err != nil {
		return pendingCount{}, fmt.Errorf("unable to count the requests waiting on a challenge: %w", err)
	}
	return e.countOlder(waiting, csr), nil
}

// countOlder counts the requests of all filed before csr that wait on a
// challenge: the requests that stay pending for long (up to the
// challenge's lifetime) and hold the controller's memory meanwhile.
// Requests not yet looked at are not counted (a burst is decided in the
// order it is queued), nor are approved ones, which wait only for a
// certificate, nor ones whose challenge has expired (they are closed when
// looked at next).
func (e *Engine) countOlder(all []*certificatesv1.CertificateSigningRequest, csr *certificatesv1.CertificateSigningRequest) pendingCount {
	var n pendingCount
	now := e.now()
	for _, o := range all {
		if o.UID == csr.UID || !WaitingOnChallenge(o) || !filedBefore(o, csr) {
			continue
		}
		// The expiry is read, not verified (a seal the node wrote is
		// denied when its request is looked at): a request counts until
		// then either way.
		if exp, ok := sealExpiry(o.Annotations[attestor.AnnotationChallengeSeal]); ok && !now.Before(exp) {
			continue
		}
		n.live++
		if now.Sub(o.CreationTimestamp.Time) < e.cfg.PendingGrace {
			n.recent++
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
