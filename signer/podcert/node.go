package podcert

import (
	"time"

	"sigs.k8s.io/kubelet-authenticator/attestor"
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
// node, when it has expired, when a newer one was issued for node since
// (superseded), or when node is revoked and the certificate is not one
// accepted after the revocation. The returned credential names the Machine
// whose liveness and attestation the caller checks next, and its NotAfter
// bounds the pod certificate.
func NodeCredential(s *revoke.State, node, fingerprint string, now time.Time) (*revoke.Credential, error) {
	var found *revoke.Credential
	for i := range s.Issued {
		if c := &s.Issued[i]; c.SHA256 == fingerprint && c.Node == node {
			found = c
			break
		}
	}
	if found == nil || !now.Before(found.NotAfter) {
		return nil, attestor.Deny(ReasonNodeNotAttested, "node %s did not ask with a current client certificate this controller issued after attestation; only attested nodes get pod certificates from this signer", node)
	}
	for _, c := range s.Issued {
		if c.Node == node && c.SHA256 != fingerprint && c.NotAfter.After(found.NotAfter) {
			return nil, attestor.Deny(ReasonNodeSuperseded, "node %s asked with a client certificate that a newer one (expiring %s) replaced; the node must use its current certificate", node, c.NotAfter.UTC().Format(time.RFC3339))
		}
	}
	if e := s.Find(node); e != nil {
		accepted := false
		for _, c := range e.Accepted {
			accepted = accepted || c.SHA256 == fingerprint
		}
		if !accepted {
			return nil, attestor.Deny(ReasonNodeRevoked, "node %s was revoked when its Machine %s was deleted", node, e.Machine)
		}
	}
	out := *found
	return &out, nil
}
