package attestor

import (
	"fmt"
	"strings"
)

// Reasons a signer writes on the conditions of the requests it decides.
// Every reason that crosses the wire and is not one provider's own is
// defined here, once; providers refer to these where they mean the same
// thing. docs/troubleshooting.md says what to do about each (a test keeps
// it complete).
const (
	// ReasonAttestationVerified approves an attested client request.
	ReasonAttestationVerified = "AttestationVerified"
	// ReasonAttestedServingVerified approves an attested serving request.
	ReasonAttestedServingVerified = "AttestedServingVerified"
	// ReasonServingVerified approves kubelet's own kubernetes.io/kubelet-serving
	// request whose addresses all belong to its Machine.
	ReasonServingVerified = "ServingAddressesVerified"

	// ReasonSignerNotServed: the signer name is one this controller
	// refuses (a serving signer for a provider that cannot do serving).
	ReasonSignerNotServed = "SignerNotServed"
	// ReasonRequesterNotAllowed: spec.username may not ask for this kind of
	// certificate.
	ReasonRequesterNotAllowed = "RequesterNotAllowed"
	// ReasonRequesterMismatch: a node asked for a certificate of another
	// node, or a second round was filed by another requester than the first.
	ReasonRequesterMismatch = "RequesterMismatch"
	// ReasonMalformedRequest: spec.request does not follow the wire contract
	// (PEM framing, PKCS#10, provider block, evidence header) or its
	// signature does not verify.
	ReasonMalformedRequest = "MalformedRequest"
	// ReasonProviderMismatch: the provider block names another provider than
	// the signer name.
	ReasonProviderMismatch = "ProviderMismatch"
	// ReasonSubjectMismatch: the subject is not CN=system:node:<name>,
	// O=system:nodes and nothing else.
	ReasonSubjectMismatch = "SubjectMismatch"
	// ReasonUsagesNotAllowed: spec.usages is not exactly the set of the
	// certificate kind.
	ReasonUsagesNotAllowed = "UsagesNotAllowed"
	// ReasonUnexpectedSAN: a client request carries subject alternative names.
	ReasonUnexpectedSAN = "UnexpectedSAN"
	// ReasonSANTypeNotAllowed: a serving request carries email or URI SANs.
	ReasonSANTypeNotAllowed = "SANTypeNotAllowed"
	// ReasonSANNotMachineAddress: a serving SAN is not one of the Machine's
	// status.addresses.
	ReasonSANNotMachineAddress = "SANNotMachineAddress"
	// ReasonNoSANs: a serving request names no DNS or IP address.
	ReasonNoSANs = "NoSANs"
	// ReasonCARequested: the request asks for a CA certificate.
	ReasonCARequested = "CARequested"
	// ReasonProviderIDMissing: the request has no provider ID extension.
	ReasonProviderIDMissing = "ProviderIDMissing"
	// ReasonProviderIDMalformed: the provider ID extension is not a single
	// non-critical UTF8String.
	ReasonProviderIDMalformed = "ProviderIDMalformed"
	// ReasonKeyNotAllowed: the key is neither ECDSA P-256 nor RSA of an
	// allowed size.
	ReasonKeyNotAllowed = "KeyNotAllowed"

	// ReasonAttestorNotAuthorized: the Cluster does not list the request's
	// provider among its authorized attestors.
	ReasonAttestorNotAuthorized = "AttestorNotAuthorized"
	// ReasonUnsupportedEvidenceVersion: the verifier does not accept the
	// evidence version; the supported-versions annotation says which it does.
	ReasonUnsupportedEvidenceVersion = "UnsupportedEvidenceVersion"
	// ReasonMalformedEvidence: the evidence cannot be read (not JSON, no
	// "version", a value of the wrong type, bad base64, a structure of the
	// provider's that does not parse).
	ReasonMalformedEvidence = "MalformedEvidence"
	// ReasonEvidenceTooLarge: the evidence is larger than MaxEvidenceSize.
	ReasonEvidenceTooLarge = "EvidenceTooLarge"
	// ReasonEvidenceInvalidUTF8: the evidence is not valid UTF-8.
	ReasonEvidenceInvalidUTF8 = "EvidenceInvalidUTF8"
	// ReasonEvidenceDuplicateKey: an object in the evidence names a member
	// twice.
	ReasonEvidenceDuplicateKey = "EvidenceDuplicateKey"
	// ReasonEvidenceTrailingData: the evidence has data after its JSON value.
	ReasonEvidenceTrailingData = "EvidenceTrailingData"
	// ReasonEvidenceUnknownField: the evidence has a member its provider's
	// evidence format does not define.
	ReasonEvidenceUnknownField = "EvidenceUnknownField"
	// ReasonEvidenceFieldCase: a member name of the evidence matches a
	// field only when case is ignored ("ProviderID" for "providerID").
	ReasonEvidenceFieldCase = "EvidenceFieldCaseMismatch"
	// ReasonAttestedProviderIDMismatch: the evidence proves another provider
	// ID than the CSR extension and the Machine carry.
	ReasonAttestedProviderIDMismatch = "AttestedProviderIDMismatch"
	// ReasonIdentityMismatch: the evidence proves another stable identity
	// than the one the Machine (or allowlist entry) is pinned to.
	ReasonIdentityMismatch = "IdentityMismatch"
	// ReasonSigningFailed: an approved request could not be signed and will
	// not be (its Machine went away between approval and signing).
	ReasonSigningFailed = "SigningFailed"
	// ReasonUndecidable: the request stayed undecidable (a transient error
	// every time) for longer than the signer retries one request.
	ReasonUndecidable = "Undecidable"
	// ReasonTooManyPending: the requester has as many undecided requests
	// (for this node, or in all) as the signer holds for one requester;
	// this, newer, one is not looked at.
	ReasonTooManyPending = "TooManyPendingRequests"
	// ReasonTooManyPendingInCluster: the workload cluster has as many
	// requests waiting on a challenge, of all requesters, as the signer
	// holds for one cluster; this, newer, one is not looked at.
	ReasonTooManyPendingInCluster = "TooManyPendingRequestsInCluster"

	// ReasonChallengeAnswered closes a challenged request whose challenge a
	// later request answered (and was approved instead).
	ReasonChallengeAnswered = "ChallengeAnswered"
	// ReasonChallengeExpired: nobody answered the challenge in time, or the
	// answer came after it expired.
	ReasonChallengeExpired = "ChallengeExpired"
	// ReasonMalformedChallenge: the request carries a challenge annotation
	// the signer did not write.
	ReasonMalformedChallenge = "MalformedChallenge"
	// ReasonChallengeNotFound: the answered request does not exist or is not
	// a first round of the same provider.
	ReasonChallengeNotFound = "ChallengeNotFound"
	// ReasonChallengeNotIssued: the answered request carries no challenge.
	ReasonChallengeNotIssued = "ChallengeNotIssued"
	// ReasonChallengeUsed: the answered request was decided already.
	ReasonChallengeUsed = "ChallengeUsed"
	// ReasonChallengeMismatch: the answer is for another key, node, provider
	// ID or signer than the challenged request.
	ReasonChallengeMismatch = "ChallengeMismatch"

	// ReasonMachineNotFound: no Machine of an opted-in Cluster has the
	// request's provider ID (or is the node).
	ReasonMachineNotFound = "MachineNotFound"
	// ReasonNodeNameMismatch: the Machine does not claim the node name.
	ReasonNodeNameMismatch = "NodeNameMismatch"
	// ReasonMachineProviderIDMismatch: the Machine's spec.providerID is not
	// the request's.
	ReasonMachineProviderIDMismatch = "MachineProviderIDMismatch"
	// ReasonDuplicateProviderID: more than one Machine has the provider ID.
	ReasonDuplicateProviderID = "DuplicateProviderID"
	// ReasonMachineDeleting: the Machine is being deleted.
	ReasonMachineDeleting = "MachineDeleting"
	// ReasonEndorsementKeyConflict: the Machine and its infrastructure
	// object pin different TPM endorsement keys.
	ReasonEndorsementKeyConflict = "EndorsementKeyConflict"
	// ReasonIdentityClaimedByOtherMachine: trust on first use bound the
	// attested identity to another Machine.
	ReasonIdentityClaimedByOtherMachine = "IdentityClaimedByOtherMachine"
	// ReasonMachineIdentityMismatch: trust on first use bound another
	// identity to this Machine.
	ReasonMachineIdentityMismatch = "MachineIdentityMismatch"
	// ReasonNodeAlreadyJoined: a bootstrap identity asked an attestor that
	// registers a node once (insecure) for a node that has joined; the
	// node renews with its own identity.
	ReasonNodeAlreadyJoined = "NodeAlreadyJoined"
	// ReasonNodeNotAllowed: standalone mode has no allowlist entry for the
	// node.
	ReasonNodeNotAllowed = "NodeNotAllowed"
	// ReasonAllowlistProviderIDMismatch: the allowlist entry names another
	// provider ID.
	ReasonAllowlistProviderIDMismatch = "AllowlistProviderIDMismatch"
)

// Summary turns denials into one condition: the first denial's reason, and
// a message listing every denial.
func Summary(ds []*DenyError) (reason, message string) {
	switch len(ds) {
	case 0:
		return "", ""
	case 1:
		return ds[0].Reason, ds[0].Message
	}
	parts := make([]string, len(ds))
	for i, d := range ds {
		parts[i] = d.Error()
	}
	return ds[0].Reason, fmt.Sprintf("%d checks failed: %s", len(ds), strings.Join(parts, "; "))
}

// Denial returns the condition of the denials in err (see Summary); ok is
// false when err holds none.
func Denial(err error) (reason, message string, ok bool) {
	ds := Denials(err)
	if len(ds) == 0 {
		return "", "", false
	}
	reason, message = Summary(ds)
	return reason, message, true
}
