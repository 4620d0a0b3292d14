package podcert

import (
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"time"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert/podattest"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
)

// Reasons a request is denied with for its node.
const (
	ReasonNodeNotAttested = "NodeNotAttested"
	ReasonNodeSuperseded  = "NodeCredentialSuperseded"
	ReasonNodeRevoked     = "NodeRevoked"
)

// NodeCredential finds the client certificate the request's creator
// authenticated with (fingerprint: lower-case hex SHA-256 of its DER, as
// kube-apiserver's credential ID carries it) among those the controller
// issued after attestation (s.Issued, the record revocation keeps). The
// request is denied when the controller never issued that certificate for
// node, when it has expired, when another was issued for node after it
// (superseded), or when node is revoked and the certificate is not one
// accepted after the revocation. The returned credential names the Machine
// whose liveness and attestation the caller checks next, and its NotAfter
// bounds the pod certificate.
func NodeCredential(s *revoke.State, node, fingerprint string, now time.Time) (*revoke.Credential, error) {
	at := slices.IndexFunc(s.Issued, func(c revoke.Credential) bool { return c.SHA256 == fingerprint && c.Node == node })
	if at < 0 || !now.Before(s.Issued[at].NotAfter) {
		return nil, attestor.Deny(ReasonNodeNotAttested,
			"node %s did not ask with a current client certificate this controller issued after attestation; only attested nodes get pod certificates from this signer",
			node)
	}
	found := s.Issued[at]
	if e := s.Find(node); e != nil && !slices.ContainsFunc(e.Accepted, func(c revoke.Credential) bool { return c.SHA256 == fingerprint }) {
		return nil, attestor.Deny(ReasonNodeRevoked, "node %s was revoked when its Machine %s was deleted", node, e.Machine)
	}
	// s.Issued is in the order the certificates were issued (revoke
	// appends): one issued for node after this one supersedes it.
	for _, c := range s.Issued[at+1:] {
		if c.Node == node && c.SHA256 != fingerprint {
			return nil, attestor.Deny(ReasonNodeSuperseded,
				"node %s asked with a client certificate that a newer one (expiring %s) replaced; the node must use its current certificate", node,
				c.NotAfter.UTC().Format(time.RFC3339))
		}
	}
	return &found, nil
}

// ErrAttestationNotRecorded is returned for a node credential recorded
// before the controller kept what it attested: the request is retried,
// and issued once the node has renewed its client certificate.
var ErrAttestationNotRecorded = errors.New("the node's client certificate was recorded before the controller kept what it attested; " +
	"the request is issued once the node renews it")

// NodeAttestation returns what the pod certificates of a node that asked
// with cred carry in their attestation extension; providerID is its
// Machine's spec.providerID.
func NodeAttestation(cred *revoke.Credential, providerID string) (*podattest.Attestation, error) {
	a := cred.Attested
	if a == nil {
		return nil, ErrAttestationNotRecorded
	}
	out := &podattest.Attestation{
		Attestor:         a.Provider,
		ProviderID:       providerID,
		MachineNamespace: cred.Machine.Namespace,
		MachineName:      cred.Machine.Name,
		NodeName:         cred.Node,
		AttestedAt:       a.At,
	}
	if a.PolicySHA256 != "" {
		d, err := hex.DecodeString(a.PolicySHA256)
		if err != nil {
			return nil, fmt.Errorf("malformed policy digest in the record of node %s: %w", cred.Node, err)
		}
		out.BootPolicySHA256 = d
	}
	return out, nil
}
