package engine

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// challengeSlack is added to a challenge's expiry before the challenged CSR
// is looked at again, so that the clock has passed it.
const challengeSlack = time.Second

// sealContext is the domain separator of seals; legacySealContext that of
// the seals of earlier releases, which named no Cluster.
const (
	sealContext       = "kubelet-authenticator/challenge-seal/v3\x00"
	legacySealContext = "kubelet-authenticator/challenge-seal/v1\x00"
)

// seal returns the value of the challenge-seal annotation for a challenge
// written on the CSR with uid to signerName in the Cluster with clusterUID
// under the challenge key keyID: "v3.<key id>.<expiry unix>.<mac>", the
// MAC over the Cluster, the request, signer name, expiry and the
// challenge's digest. Only a holder of the controller key can make one, so
// a challenge annotation a node filed its CSR with is never taken for one
// the signer wrote, and a challenge is bound to its signer name and its
// Cluster. The key id only picks the key to check with (a seal under
// another id does not verify); the node never reads the seal.
//
// Seals of the earlier formats ("v1.<expiry>.<mac>", "v2.<key
// id>.<expiry>.<mac>", which named no Cluster) were written by an earlier
// release; a challenge under one is closed ChallengeExpired, and its node
// files anew, once, on its own.
func seal(keyID string, key []byte, clusterUID, uid, signerName string, expires time.Time, data []byte) string {
	exp := strconv.FormatInt(expires.Unix(), 10)
	mac := base64.RawURLEncoding.EncodeToString(sealMAC(key, clusterUID, uid, signerName, exp, data))
	return "v3." + keyID + "." + exp + "." + mac
}

func sealMAC(key []byte, clusterUID, uid, signerName, exp string, data []byte) []byte {
	return mac(key, sealContext, data, clusterUID, uid, signerName, exp)
}

// legacySealMAC is the MAC of a seal of an earlier release.
func legacySealMAC(key []byte, uid, signerName, exp string, data []byte) []byte {
	return mac(key, legacySealContext, data, uid, signerName, exp)
}

func mac(key []byte, context string, data []byte, fields ...string) []byte {
	digest := sha256.Sum256(data)
	m := hmac.New(sha256.New, key)
	m.Write([]byte(context))
	for _, s := range fields {
		m.Write([]byte(s))
		m.Write([]byte{0})
	}
	m.Write(digest[:])
	return m.Sum(nil)
}

// parsedSeal is a challenge-seal annotation, not yet verified.
type parsedSeal struct {
	keyID, exp string
	expires    time.Time
	mac        []byte
	// legacy is set for a seal of an earlier release (v1, v2), which
	// names no Cluster: its challenge can no longer be answered.
	legacy bool
}

// parseSeal splits a challenge-seal annotation into its fields.
func parseSeal(sealed string) (*parsedSeal, error) {
	parts := strings.Split(sealed, ".")
	var p parsedSeal
	switch {
	case len(parts) == 3 && parts[0] == "v1":
		p.keyID, p.legacy, parts = attestor.LegacyChallengeKeyID, true, parts[1:]
	case len(parts) == 4 && (parts[0] == "v2" || parts[0] == "v3") && validKeyID(parts[1]):
		p.keyID, p.legacy, parts = parts[1], parts[0] == "v2", parts[2:]
	default:
		return nil, errors.New("the seal is not v3.<key id>.<expiry>.<mac>")
	}
	unix, err := strconv.ParseInt(parts[0], 10, 64)
	if err != nil || strconv.FormatInt(unix, 10) != parts[0] {
		return nil, errors.New("the seal's expiry is not a Unix time")
	}
	p.exp, p.expires = parts[0], time.Unix(unix, 0).UTC()
	if p.mac, err = base64.RawURLEncoding.DecodeString(parts[1]); err != nil {
		return nil, errors.New("the seal's MAC is not base64url")
	}
	return &p, nil
}

// validKeyID accepts the key ids challenge keys are named with: a
// lower-case letter and up to 15 more letters or digits.
func validKeyID(id string) bool {
	if len(id) == 0 || len(id) > 16 || id[0] < 'a' || id[0] > 'z' {
		return false
	}
	for _, c := range id {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return false
		}
	}
	return true
}

// sealExpiry reads the expiry of a challenge-seal annotation without
// verifying its MAC.
func sealExpiry(sealed string) (time.Time, bool) {
	p, err := parseSeal(sealed)
	if err != nil {
		return time.Time{}, false
	}
	return p.expires, true
}

// errLegacySeal is why a challenge sealed by an earlier release (a seal
// that names no Cluster) can no longer be answered.
var errLegacySeal = errors.New("the seal is of an earlier release and names no Cluster")

// keyRetiredError says that a challenge was sealed under a challenge key
// that has since been rotated out.
type keyRetiredError struct {
	keyID string
	err   error
}

func (e *keyRetiredError) Error() string {
	if errors.Is(e.err, errLegacySeal) {
		return fmt.Sprintf("it was sealed under challenge key %q by an earlier release: %v", e.keyID, e.err)
	}
	return fmt.Sprintf("it was sealed under challenge key %q, which has been rotated out: %v", e.keyID, e.err)
}

func (e *keyRetiredError) Unwrap() error { return e.err }

// keyUnknownError says that a challenge names a challenge key this replica
// has not read yet (another replica rotated it moments ago): transient.
type keyUnknownError struct{ err error }

func (e *keyUnknownError) Error() string { return e.err.Error() }
func (e *keyUnknownError) Unwrap() error { return e.err }

// openChallenge returns the challenge the signer wrote on csr, checking its
// seal under the key the seal names. It returns nil, nil when csr carries
// no challenge; a *keyRetiredError when that key was rotated out, a
// *keyUnknownError when this replica does not know it yet.
func (e *Engine) openChallenge(csr *certificatesv1.CertificateSigningRequest) (*attestor.Challenge, error) {
	data, hasData := csr.Annotations[attestor.AnnotationChallenge]
	sealed, hasSeal := csr.Annotations[attestor.AnnotationChallengeSeal]
	if !hasData && !hasSeal {
		return nil, nil
	}
	if !hasData || !hasSeal {
		return nil, errors.New("the challenge and its seal must come together")
	}
	if e.keys == nil {
		return nil, errors.New("this signer writes no challenges")
	}
	p, err := parseSeal(sealed)
	if err != nil {
		return nil, err
	}
	key, err := e.keys.Key(p.keyID)
	switch {
	case errors.Is(err, attestor.ErrChallengeKeyRetired):
		return nil, &keyRetiredError{keyID: p.keyID, err: err}
	case errors.Is(err, attestor.ErrChallengeKeyNotYetRead):
		return nil, &keyUnknownError{err: fmt.Errorf("unable to check the seal: %w", err)}
	case err != nil:
		return nil, fmt.Errorf("the seal names no key of this signer: %w", err)
	}
	if p.legacy {
		if !hmac.Equal(p.mac, legacySealMAC(key, string(csr.UID), csr.Spec.SignerName, p.exp, []byte(data))) {
			return nil, errors.New("the seal does not verify: the signer did not write this challenge on this request")
		}
		return nil, &keyRetiredError{keyID: p.keyID, err: errLegacySeal}
	}
	if !hmac.Equal(p.mac, sealMAC(key, e.cfg.ClusterUID, string(csr.UID), csr.Spec.SignerName, p.exp, []byte(data))) {
		return nil, errors.New("the seal does not verify: the signer did not write this challenge on this request")
	}
	return &attestor.Challenge{CSRName: csr.Name, CSRUID: string(csr.UID), Data: []byte(data), Expires: p.expires, KeyID: p.keyID}, nil
}

// challengeGuard decides a request that carries a challenge: it is never
// challenged again (that would change the secret under a node that is
// answering), only closed once the challenge expired unanswered. ok is false
// when the request carries no challenge.
func (e *Engine) challengeGuard(d *Decision, csr *certificatesv1.CertificateSigningRequest) (*Decision, bool) {
	ch, err := e.openChallenge(csr)
	var retired *keyRetiredError
	var unknown *keyUnknownError
	switch {
	case errors.As(err, &retired):
		return deny(d, &attestor.DenyError{Reason: attestor.ReasonChallengeExpired, Message: fmt.Sprintf(
			"the challenge can no longer be answered: %v; the node files a new request", err)}), true
	case errors.As(err, &unknown):
		return retry(d, err), true
	case err != nil:
		return deny(d, &attestor.DenyError{Reason: attestor.ReasonMalformedChallenge, Message: fmt.Sprintf(
			"the request carries a %s annotation the signer did not write (%v); file a request without it", attestor.AnnotationChallenge, err)}), true
	}
	if ch == nil {
		return nil, false
	}
	if wait := ch.Expires.Sub(e.now()); wait > 0 {
		// A sealed expiry was written by this signer, within its bound; a
		// bound here too, so that no arithmetic on it can make a negative
		// or endless wait.
		d.Outcome, d.After = Wait, min(wait, e.cfg.MaxChallengeTTL)+challengeSlack
		return d, true
	}
	return deny(d, &attestor.DenyError{Reason: attestor.ReasonChallengeExpired, Message: fmt.Sprintf(
		"the challenge expired at %s without an answer; "+
			"the node files a new request (if this repeats, check that it can reach the API server and answer within the challenge's lifetime)",
		ch.Expires.Format(time.RFC3339))}), true
}
