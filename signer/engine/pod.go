package engine

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
)

// PodSigner is what the engine decides pod certificate requests with, for
// one workload cluster.
type PodSigner struct {
	// SignerName is the pod signer name served.
	SignerName string
	// Policy is the Cluster's pod-certificate policy; nil denies every
	// request (pod certificates off).
	Policy *podcert.Policy
	// CA signs the certificates.
	CA *issue.CA
	// StampedSince is when the admission policy that stamps the creator
	// (podcert.EnsureAdmissionPolicy) is in force from: a request created
	// before is denied, its stamp possibly the creator's own.
	StampedSince time.Time
	// Issued reads the client certificates the controller issued after
	// attestation (revocation's record, package revoke) when the request
	// was made with the certificate of node with fingerprint; an error is
	// transient. A cached record that does not hold that certificate must
	// be read again: a record is never older than the certificate asked
	// with, so a node that just joined is not denied.
	Issued func(ctx context.Context, node, fingerprint string) (*revoke.State, error)
	// Timing places the certificates' notBefore and beginRefreshAt; the
	// zero Timing is the signer's (podcert.Timing).
	Timing podcert.Timing
}

// PodDecided reports whether a pod certificate request carries a final
// condition (Issued, Denied or Failed): nothing more is done with it.
func PodDecided(pcr *certificatesv1beta1.PodCertificateRequest) bool {
	for _, c := range pcr.Status.Conditions {
		switch c.Type {
		case certificatesv1beta1.PodCertificateRequestConditionTypeIssued,
			certificatesv1beta1.PodCertificateRequestConditionTypeDenied,
			certificatesv1beta1.PodCertificateRequestConditionTypeFailed:
			return true
		}
	}
	return false
}

// DecidePod decides a pod certificate request: Skip (decided, or another
// signer's), Deny (malformed or not allowed: the policy, a creator that is
// not the node's current attested client certificate, a Machine that is
// gone or being deleted), Retry (a transient error: never denied for it),
// or Approve with PodCertificate, the certificate to write. The creator's
// fingerprint is the annotation podcert.AnnotationCreatorCredential, which
// the workload cluster's admission policy sets from the creator's
// credential ID and nothing else can set (podcert.AdmissionPolicy).
func (e *Engine) DecidePod(ctx context.Context, pcr *certificatesv1beta1.PodCertificateRequest, ps *PodSigner) *Decision {
	d := &Decision{Outcome: Skip}
	if pcr.Spec.SignerName != ps.SignerName || PodDecided(pcr) {
		return d
	}
	c, err := podcert.Check(pcr, ps.SignerName, ps.Policy)
	if err != nil {
		return denyOrRetry(d, err)
	}
	d.NodeName = c.NodeName
	if ps.StampedSince.IsZero() || pcr.CreationTimestamp.Time.Before(ps.StampedSince) {
		return denyOrRetry(d, attestor.Deny(podcert.ReasonCreatedUnstamped,
			"the request was created at %s, before the admission policy %s that records its creator was in force (%s); file a new one",
			pcr.CreationTimestamp.UTC().Format(time.RFC3339), podcert.AdmissionPolicyName, ps.StampedSince.UTC().Format(time.RFC3339)))
	}
	fp, ok := strings.CutPrefix(pcr.Annotations[podcert.AnnotationCreatorCredential], podcert.CredentialIDPrefix)
	if !ok || fp == "" {
		return denyOrRetry(d, attestor.Deny(podcert.ReasonNodeNotAttested,
			"the request was not created with a client certificate (no %s recorded by the admission policy); "+
				"only a node's attested client certificate gets pod certificates from this signer",
			podcert.AnnotationCreatorCredential))
	}
	s, err := ps.Issued(ctx, c.NodeName, fp)
	if err != nil {
		return retry(d, err)
	}
	now := e.now()
	cred, err := podcert.NodeCredential(s, c.NodeName, fp, now)
	if err != nil {
		return denyOrRetry(d, err)
	}
	m, err := e.cfg.Machines.ForNode(ctx, c.NodeName)
	if err != nil {
		return denyOrRetry(d, err)
	}
	d.Machine = m
	if m.UID != cred.Machine.UID {
		return denyOrRetry(d, attestor.Deny(podcert.ReasonNodeNotAttested,
			"node %s is Machine %s now, not Machine %s its client certificate was issued to; the node must join again", c.NodeName, m, cred.Machine))
	}
	att, err := podcert.NodeAttestation(cred, m.ProviderID)
	if err != nil {
		return retry(d, err)
	}
	// The node's attestation must pass the Cluster's policy as it is now:
	// a node that attested under another boot policy gets pod
	// certificates once it renews under this one (never, when its boot
	// state fails it: that renewal is denied).
	if want := e.PolicySHA256(cred.Attested.Provider); want != "" && want != cred.Attested.PolicySHA256 {
		return retry(d, fmt.Errorf("node %s attested under another %s policy than the Cluster's current one; "+
			"its pod certificates are issued once it renews its client certificate under the current policy", c.NodeName, cred.Attested.Provider))
	}
	if err := e.renewalDenied(s, c.NodeName, cred.Attested.At); err != nil {
		return retry(d, err)
	}
	out, err := podcert.Sign(ps.CA, c, att, cred.NotAfter, now, ps.Timing)
	if err != nil {
		return retry(d, err)
	}
	d.Outcome = Approve
	d.Reason = podcert.ReasonIssued
	d.Message = "issued for " + c.SPIFFEID.String() + " on attested node " + c.NodeName + " (Machine " + m.String() + ")"
	d.PodCertificate = out
	return d
}

// denyOrRetry denies for the denials err carries, and retries any other
// error.
func denyOrRetry(d *Decision, err error) *Decision {
	if ds := attestor.Denials(err); len(ds) > 0 {
		return deny(d, ds...)
	}
	return retry(d, err)
}

// PolicySHA256 returns the lower-case hex SHA-256 of the Cluster's policy
// document for provider (the TPM boot policy), or "" when it has none: the
// record of a client certificate names the policy its evidence passed, and
// the node's pod certificates carry it.
func (e *Engine) PolicySHA256(provider string) string {
	doc, ok := e.cfg.Policies[provider]
	if !ok {
		return ""
	}
	sum := sha256.Sum256(doc)
	return hex.EncodeToString(sum[:])
}

// renewalDenied returns an error when this signer denied a renewal of
// node's client certificate (a client certificate request filed with the
// node's own credential) after at, when the node's current certificate
// was attested: a renewal that failed the Cluster's policy, its boot state
// among it. Until a renewal is approved, the node's attestation is not
// current, and its pod certificates are retried, never issued.
//
// The denial is found in revocation's record s (State.Denied), where the
// controller records it before writing it: there it is later than every
// certificate the record holds for the node, whatever the replicas'
// clocks, since recording a newer certificate drops it, and it stays
// until then or for the longest client certificate lifetime. The
// controller's cache is read too: it holds the denied request from the
// moment it is written, before the record's watch may have caught up, and
// until the workload cluster deletes it (kube-controller-manager after an
// hour). An error reading the cache is returned as well.
func (e *Engine) renewalDenied(s *revoke.State, node string, at time.Time) error {
	request, reason := "", ""
	if d := s.FindDenial(node); d != nil {
		request, reason = d.Request, d.Reason
	} else {
		// The node files its renewals with its own credential.
		csrs, err := e.cfg.CSRs.ByRequester(attestor.NodeUserPrefix + node)
		if err != nil {
			return fmt.Errorf("unable to read the renewals of node %s: %w", node, err)
		}
		for _, csr := range csrs {
			p, ok := e.profiles[csr.Spec.SignerName]
			if !ok || p.Kind != checks.Client {
				continue
			}
			if c := FindCondition(csr, certificatesv1.CertificateDenied); c != nil && c.LastUpdateTime.After(at) {
				request, reason = csr.Name, c.Reason
				break
			}
		}
	}
	if request == "" {
		return nil
	}
	return fmt.Errorf("node %s was denied the renewal of its client certificate (%s: %s) after its current one was issued; "+
		"its pod certificates are issued once a renewal is approved", node, request, reason)
}
