package tpm

import (
	"crypto/hmac"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// answer verifies a response against the challenged round the signer found
// (in.Answered). The signer has checked everything about that round that is
// not the TPM's business: it exists, was filed by the same requester to the
// same signer for the same key, node name and provider ID, carries a
// challenge the signer sealed, unexpired, and is undecided. What is left
// here: the round's evidence verifies again (trust may have changed since
// the challenge was written), now against this request's binding, and the
// proof shows that the TPM holding that EK and AK recovered the secret.
func (v *Verifier) answer(in *attestor.VerifyRequest, version string, r *Response, pol *Policy) (*attestor.Result, error) {
	round := in.Answered
	if round.UID == in.UID {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "the response names its own CSR as the challenged one")
	}
	if round.Name != r.CSRName {
		return nil, attestor.Deny(attestor.ReasonChallengeMismatch, "the response answers CSR %q, not %q", r.CSRName, round.Name)
	}
	if round.Challenge == nil || round.Challenge.Expires.IsZero() {
		return nil, attestor.Deny(attestor.ReasonChallengeNotIssued, "CSR %q carries no challenge; wait for it before answering", round.Name)
	}
	first, err := DecodeEvidence(round.Evidence)
	if err != nil || first.Attestation == nil {
		return nil, attestor.Deny(attestor.ReasonChallengeNotFound, "the challenged CSR %q carries no first-round TPM attestation", round.Name)
	}
	if clusterBound(version) != clusterBound(first.Version) || deflatesLog(version) != deflatesLog(first.Version) {
		return nil, attestor.Deny(attestor.ReasonChallengeMismatch,
			"the response is evidence %s, the challenged CSR %q evidence %s: answer in the version of the challenged request", version, round.Name, first.Version)
	}
	at, err := v.checkAttestation(first.Version, first.Attestation, in.CSR.PublicKey, in.Bindings(clusterBound(first.Version)), round.Annotations,
		in.MachineAnnotations, pol)
	if err != nil {
		ds := attestor.Denials(err)
		if len(ds) == 0 {
			return nil, err
		}
		errs := make([]error, len(ds))
		for i, d := range ds {
			errs[i] = attestor.Deny(d.Reason, "the challenged CSR %q no longer verifies: %s", round.Name, d.Message)
		}
		return nil, errors.Join(errs...)
	}
	// The secret was derived under the key the challenge was sealed with,
	// which may no longer be the current one.
	key, err := v.keys.Key(round.Challenge.KeyID)
	if errors.Is(err, attestor.ErrChallengeKeyRetired) {
		return nil, attestor.Deny(attestor.ReasonChallengeExpired, "the challenge on CSR %q can no longer be answered: %v", round.Name, err)
	}
	if err != nil {
		return nil, fmt.Errorf("unable to derive the challenge secret of CSR %q: %w", round.Name, err)
	}
	secret := deriveSecret(key, in.ClusterUID, round.UID, at.akName, at.ekHash, round.Challenge.Expires)
	if !hmac.Equal(r.Proof, proof(secret, in.CSR.RawSubjectPublicKeyInfo, round.UID)) {
		return nil, attestor.Deny(ReasonBadProof, "the response does not prove possession of the credential challenged on CSR %q", round.Name)
	}
	if err := v.checkFreshQuote(at, first, r, freshQualifier(secret, in.CSR.RawSubjectPublicKeyInfo, round.UID), pol); err != nil {
		return nil, err
	}
	return &attestor.Result{Identity: &attestor.Identity{
		ProviderID: in.ProviderID,
		Stable:     StablePrefix + hex.EncodeToString(at.ekHash[:]),
	}}, nil
}

// checkFreshQuote verifies the fresh quote of a response (v3, v4): by the
// first round's AK, over the first round's selection, qualified by the
// answered challenge, its PCR values those the TPM quoted; where the
// Cluster's boot policy reads PCRs, the fresh values must pass it, with
// the first round's event log replayed against them. A response without
// one is refused where the policy reads PCRs: the boot state proven would
// be that of any boot in which the AK once quoted.
func (v *Verifier) checkFreshQuote(at *attested, first *Evidence, r *Response, qualifier []byte, pol *Policy) error {
	if r.Quote == nil {
		if pol != nil && pol.needsQuote() {
			return attestor.Deny(ReasonFreshQuoteRequired,
				"the Cluster's TPM boot policy reads PCRs, and the answer carries no fresh quote of them (evidence %s or %s): upgrade the node's kubelet-authenticator",
				VersionV4, VersionV3)
		}
		return nil
	}
	sel, err := checkQuote(at, &Attestation{Quote: r.Quote, QuoteSignature: r.QuoteSignature, PCRs: r.PCRs}, [][]byte{qualifier})
	if err != nil {
		if d, ok := attestor.AsDenial(err); ok && d.Reason == ReasonStaleBinding {
			return attestor.Deny(ReasonFreshQuoteMismatch, "the fresh quote is not qualified by the answered challenge (a quote saved from another answer)")
		}
		return err
	}
	if !maps.EqualFunc(sel, at.sel, slices.Equal) {
		return attestor.Deny(ReasonFreshQuoteMismatch, "the fresh quote selects PCRs %v, the first round's quote %v", sel, at.sel)
	}
	if pol == nil {
		return nil
	}
	var state *BootState
	var noState string
	if log := first.Attestation.EventLog; len(log) > 0 {
		state, err = v.replays.replay(log, r.PCRs)
		switch {
		case errors.Is(err, errNoCommonBank):
			noState, err = err.Error(), nil
		case err != nil:
			return attestor.Deny(ReasonEventLogMismatch,
				"the PCRs quoted in the answer are not those the first round's event log leads to (the machine booted again, or extended them since): %v", err)
		}
	}
	return pol.evaluate(first.Version, r.PCRs, sel, state, noState)
}
