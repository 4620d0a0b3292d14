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

const sealContext = "kubelet-authenticator/challenge-seal/v1\x00"

// seal returns the value of the challenge-seal annotation for a challenge
// written on the CSR with uid to signerName: "v1.<expiry unix>.<mac>", the
// MAC over all of them and the challenge's digest. Only a holder of the
// controller key can make one, so a challenge annotation a node filed its
// CSR with is never taken for one the signer wrote, and a challenge is
// bound to its signer name.
func (e *Engine) seal(uid, signerName string, expires time.Time, data []byte) string {
	exp := strconv.FormatInt(expires.Unix(), 10)
	return "v1." + exp + "." + base64.RawURLEncoding.EncodeToString(e.sealMAC(uid, signerName, exp, data))
}

func (e *Engine) sealMAC(uid, signerName, exp string, data []byte) []byte {
	digest := sha256.Sum256(data)
	m := hmac.New(sha256.New, e.cfg.ChallengeKey)
	m.Write([]byte(sealContext))
	for _, s := range []string{uid, signerName, exp} {
		m.Write([]byte(s))
		m.Write([]byte{0})
	}
	m.Write(digest[:])
	return m.Sum(nil)
}

// sealExpiry reads the expiry of a challenge-seal annotation without
// verifying its MAC.
func sealExpiry(sealed string) (time.Time, bool) {
	parts := strings.Split(sealed, ".")
	if len(parts) != 3 || parts[0] != "v1" {
		return time.Time{}, false
	}
	unix, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil {
		return time.Time{}, false
	}
	return time.Unix(unix, 0), true
}

// openChallenge returns the challenge the signer wrote on csr, checking its
// seal. It returns nil, nil when csr carries no challenge.
func (e *Engine) openChallenge(csr *certificatesv1.CertificateSigningRequest) (*attestor.Challenge, error) {
	data, hasData := csr.Annotations[attestor.AnnotationChallenge]
	sealed, hasSeal := csr.Annotations[attestor.AnnotationChallengeSeal]
	if !hasData && !hasSeal {
		return nil, nil
	}
	if !hasData || !hasSeal {
		return nil, errors.New("the challenge and its seal must come together")
	}
	if e.cfg.ChallengeKey == nil {
		return nil, errors.New("this signer writes no challenges")
	}
	parts := strings.Split(sealed, ".")
	if len(parts) != 3 || parts[0] != "v1" {
		return nil, errors.New("the seal is not v1.<expiry>.<mac>")
	}
	unix, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil || strconv.FormatInt(unix, 10) != parts[1] {
		return nil, errors.New("the seal's expiry is not a Unix time")
	}
	mac, err := base64.RawURLEncoding.DecodeString(parts[2])
	if err != nil {
		return nil, errors.New("the seal's MAC is not base64url")
	}
	if !hmac.Equal(mac, e.sealMAC(string(csr.UID), csr.Spec.SignerName, parts[1], []byte(data))) {
		return nil, errors.New("the seal does not verify: the signer did not write this challenge on this request")
	}
	return &attestor.Challenge{CSRName: csr.Name, CSRUID: string(csr.UID), Data: []byte(data), Expires: time.Unix(unix, 0).UTC()}, nil
}

// challengeGuard decides a request that carries a challenge: it is never
// challenged again (that would change the secret under a node that is
// answering), only closed once the challenge expired unanswered. ok is false
// when the request carries no challenge.
func (e *Engine) challengeGuard(d *Decision, csr *certificatesv1.CertificateSigningRequest) (*Decision, bool) {
	ch, err := e.openChallenge(csr)
	if err != nil {
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
		"the challenge expired at %s without an answer; the node files a new request (if this repeats, check that it can reach the API server and answer within the challenge's lifetime)",
		ch.Expires.Format(time.RFC3339))}), true
}
