package controller

import (
	"context"
	"errors"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	"k8s.io/klog/v2/ktesting"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
)

// challengingVerifier is a fakeVerifier that challenges: its challenges
// are RFC 3339 expiry times.
type challengingVerifier struct {
	fakeVerifier
	calls int
}

func (v *challengingVerifier) Verify(ctx context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	v.calls++
	return v.fakeVerifier.Verify(ctx, in)
}

func (*challengingVerifier) ChallengeExpiry(ch []byte) (time.Time, error) {
	return time.Parse(time.RFC3339, string(ch))
}

func withChallenge(csr *certificatesv1.CertificateSigningRequest, ch string) *certificatesv1.CertificateSigningRequest {
	csr.Annotations = map[string]string{attestor.AnnotationChallenge: ch}
	return csr
}

func denial(t *testing.T, e *env, name string) string {
	t.Helper()
	if c := findCondition(e.csr(t, name), certificatesv1.CertificateDenied); c != nil {
		return c.Reason
	}
	return ""
}

func TestChallengedRequest(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tt := range []struct {
		name, challenge, denied string
	}{
		{name: "pending: waits for the answer, not challenged again", challenge: now.Add(time.Minute).Format(time.RFC3339)},
		{name: "expired unanswered", challenge: now.Add(-time.Second).Format(time.RFC3339), denied: ReasonChallengeExpired},
		{name: "a challenge the signer did not write", challenge: "forged", denied: ReasonMalformedChallenge},
	} {
		t.Run(tt.name, func(t *testing.T) {
			v := &challengingVerifier{fakeVerifier: fakeVerifier{res: &attestor.Result{Challenge: []byte("new")}}}
			e := newEnv(t, &fakeMatcher{m: theMachine}, v, []string{insecure.Name}, withChallenge(goodCSR(t, "c"), tt.challenge))
			e.c.cfg.Now = func() time.Time { return now }
			if err := e.c.sync(ctx, "c"); err != nil {
				t.Fatal(err)
			}
			if v.calls != 0 {
				t.Errorf("a challenged request was verified (and challenged) again")
			}
			if got := denial(t, e, "c"); got != tt.denied {
				t.Errorf("denied %q, want %q", got, tt.denied)
			}
			if got := e.csr(t, "c").Annotations[attestor.AnnotationChallenge]; got != tt.challenge {
				t.Errorf("challenge rewritten to %q", got)
			}
		})
	}
}

func TestAnswerConsumesTheChallenge(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	answered := &attestor.Result{Answers: "first", Identity: &attestor.Identity{ProviderID: pid, Stable: "test:1"}}

	t.Run("challenged request denied ChallengeAnswered before the answer is approved", func(t *testing.T) {
		e := newEnv(t, &fakeMatcher{m: theMachine}, &fakeVerifier{res: answered}, []string{insecure.Name},
			withChallenge(goodCSR(t, "first"), "x"), goodCSR(t, "second"))
		if err := e.c.sync(ctx, "second"); err != nil {
			t.Fatal(err)
		}
		if got := denial(t, e, "first"); got != ReasonChallengeAnswered {
			t.Errorf("first denied %q, want %s", got, ReasonChallengeAnswered)
		}
		if len(e.csr(t, "second").Status.Certificate) == 0 {
			t.Error("the answer was not signed")
		}
		if w := e.writes(); !equal(w, []string{"update/approval", "update/approval", "update/status"}) {
			t.Errorf("writes = %q, want deny first, approve second, sign second", w)
		}
	})
	t.Run("challenged request decided meanwhile: retried, not approved", func(t *testing.T) {
		first := withCondition(withChallenge(goodCSR(t, "first"), "x"), certificatesv1.CertificateDenied, ReasonChallengeAnswered)
		e := newEnv(t, &fakeMatcher{m: theMachine}, &fakeVerifier{res: answered}, []string{insecure.Name}, first, goodCSR(t, "second"))
		if err := e.c.sync(ctx, "second"); err == nil {
			t.Fatal("sync approved an answer to a closed challenge")
		}
		if w := e.writes(); len(w) != 0 {
			t.Errorf("writes = %q, want none", w)
		}
	})
	t.Run("denying the challenged request fails: retried, not approved", func(t *testing.T) {
		e := newEnv(t, &fakeMatcher{m: theMachine}, &fakeVerifier{res: answered}, []string{insecure.Name}, goodCSR(t, "second"))
		// "first" is in the cache but not on the server: the write fails.
		if err := e.c.informer.GetStore().Add(withChallenge(goodCSR(t, "first"), "x")); err != nil {
			t.Fatal(err)
		}
		if err := e.c.sync(ctx, "second"); err == nil {
			t.Fatal("sync approved although the challenged request could not be closed")
		}
		if hasCondition(e.csr(t, "second"), certificatesv1.CertificateApproved) {
			t.Error("approved")
		}
	})
	t.Run("approved answer signed after a retry: verified as approved", func(t *testing.T) {
		v := &recordingVerifier{res: answered}
		second := withCondition(goodCSR(t, "second"), certificatesv1.CertificateApproved, ReasonAttestationVerified)
		e := newEnv(t, &fakeMatcher{m: theMachine}, v, []string{insecure.Name}, second)
		if err := e.c.sync(ctx, "second"); err != nil {
			t.Fatal(err)
		}
		if !v.approved {
			t.Error("VerifyRequest.Approved not set for an approved request")
		}
		if w := e.writes(); !equal(w, []string{"update/status"}) {
			t.Errorf("writes = %q, want only the signature", w)
		}
	})
}

type recordingVerifier struct {
	res      *attestor.Result
	approved bool
}

func (*recordingVerifier) Versions() []string { return []string{"v1"} }

func (v *recordingVerifier) Verify(_ context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	v.approved = in.Approved
	return v.res, nil
}

type fakeBinder struct {
	err      error
	machine  *Machine
	identity string
}

func (b *fakeBinder) Bind(_ context.Context, m *Machine, identity string) error {
	b.machine, b.identity = m, identity
	return b.err
}

func TestTrustOnFirstUse(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	proven := &attestor.Result{Identity: &attestor.Identity{ProviderID: pid, Stable: "test:device-1"}}
	for _, tt := range []struct {
		name    string
		res     *attestor.Result
		err     error
		denied  string
		retried bool
		bound   bool
	}{
		{name: "first use recorded, approved", res: proven, bound: true},
		{name: "claimed elsewhere: denied", res: proven, err: &checks.Failure{Reason: "IdentityClaimedByOtherMachine", Message: "m"}, denied: "IdentityClaimedByOtherMachine", bound: true},
		{name: "API down: retried", res: proven, err: errors.New("connection refused"), retried: true, bound: true},
		{name: "no stable identity (insecure): not recorded", res: verified},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b := &fakeBinder{err: tt.err}
			e := newEnv(t, &fakeMatcher{m: theMachine}, &fakeVerifier{res: tt.res}, []string{insecure.Name}, goodCSR(t, "c"))
			e.c.cfg.Identities = b
			err := e.c.sync(ctx, "c")
			if (err != nil) != tt.retried {
				t.Fatalf("sync = %v, retried want %t", err, tt.retried)
			}
			if got := denial(t, e, "c"); got != tt.denied {
				t.Errorf("denied %q, want %q", got, tt.denied)
			}
			if tt.bound && (b.machine != theMachine || b.identity != "test:device-1") {
				t.Errorf("Bind(%+v, %q)", b.machine, b.identity)
			}
			if !tt.bound && b.machine != nil {
				t.Error("an identity-less result was recorded")
			}
			if issued := len(e.csr(t, "c").Status.Certificate) > 0; issued != (tt.denied == "" && !tt.retried) {
				t.Errorf("issued = %t", issued)
			}
		})
	}
}
