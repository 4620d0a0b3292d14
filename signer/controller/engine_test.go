package controller

import (
	"context"
	"crypto"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/challengekey"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// challenger is a fake two-round verifier shaped like the TPM one: a first
// round is challenged with a random secret, and the answer proves it with
// an HMAC over the secret and the request's key binding.
type challenger struct {
	now   func() time.Time
	ttl   time.Duration
	mu    sync.Mutex
	calls int
}

type challengeEvidence struct {
	Version    string `json:"version"`
	ProviderID string `json:"providerID"`
	Answers    string `json:"answers,omitempty"`
	Proof      string `json:"proof,omitempty"`
}

func (*challenger) Versions() []string { return []string{"v1"} }

func (v *challenger) Verify(_ context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	v.mu.Lock()
	v.calls++
	v.mu.Unlock()
	var ev challengeEvidence
	if err := json.Unmarshal(in.Evidence, &ev); err != nil {
		return nil, attestor.Deny(attestor.ReasonMalformedEvidence, "%v", err)
	}
	switch {
	case ev.Answers == "":
		ttl := v.ttl
		if in.ChallengeTTL > 0 {
			ttl = min(ttl, in.ChallengeTTL)
		}
		return &attestor.Result{Challenge: &attestor.Challenge{Data: []byte("secret-for-" + in.UID), Expires: v.now().Add(ttl)}}, nil
	case in.Answered == nil:
		return &attestor.Result{Answers: ev.Answers}, nil
	}
	if ev.Proof != proofFor(in.Answered.Challenge.Data, in.Binding) {
		return nil, attestor.Deny("BadProof", "the answer does not prove the challenge")
	}
	return &attestor.Result{Identity: &attestor.Identity{ProviderID: ev.ProviderID, Stable: "fake:" + in.NodeName}}, nil
}

func proofFor(secret, binding []byte) string {
	m := hmac.New(sha256.New, secret)
	m.Write(binding)
	return hex.EncodeToString(m.Sum(nil))
}

// machines is one Machine, node-1.
type machines struct{}

var theMachine = &engine.Machine{Namespace: "ns", Name: "node-1", UID: types.UID("uid-m"), ProviderID: pid,
	DNSNames: []string{"node-1.example"}, IPs: []net.IP{net.ParseIP("10.0.0.1")}}

func (machines) MatchMachine(_ context.Context, nodeName, providerID string) (*engine.Machine, error) {
	if nodeName != "node-1" || providerID != pid {
		return nil, attestor.Deny(attestor.ReasonMachineNotFound, "no Machine for %s", nodeName)
	}
	return theMachine, nil
}

func (machines) ForNode(_ context.Context, nodeName string) (*engine.Machine, error) {
	return machines{}.MatchMachine(context.Background(), nodeName, pid)
}

const pid = "fake:///zone/node-1"

func cond(csr *certificatesv1.CertificateSigningRequest) string {
	for _, c := range csr.Status.Conditions {
		return string(c.Type) + "/" + c.Reason
	}
	if len(csr.Status.Certificate) > 0 {
		return "issued"
	}
	return "pending"
}

type rig struct {
	t      *testing.T
	cs     *fake.Clientset
	c      *Controller
	clock  *clocktesting.FakeClock
	v      *challenger
	ctx    context.Context
	signer string
	kind   string
	// filer files the requests (fileWith); nil for cs.
	filer Client
}

func newRig(t *testing.T, serving bool, opts ...func(*Config)) *rig {
	t.Helper()
	caCert, caKey, err := issue.NewCA("test CA", time.Now(), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	loaded, err := issue.LoadCA(caCert, caKey)
	if err != nil {
		t.Fatal(err)
	}
	clk := clocktesting.NewFakeClock(time.Now())
	v := &challenger{now: clk.Now, ttl: 5 * time.Minute}
	cs := fake.NewClientset()
	set := engine.ProfileSet{
		Verifiers: map[string]attestor.Verifier{"fake": v},
		Client:    &issue.Signer{CA: loaded, MaxLifetime: time.Hour},
		Serving:   &issue.Signer{CA: loaded, MaxLifetime: time.Hour, Serving: true},
	}
	cfg := Config{
		Cluster: "ns/c",
		Client:  cs,
		Engine: engine.Config{
			Profiles:     engine.Profiles(set),
			Authorized:   []string{"fake"},
			Machines:     machines{},
			ChallengeKey: []byte(strings.Repeat("k", 32)),
			Clock:        clk,
		},
		MinRetry: time.Millisecond,
		MaxRetry: time.Millisecond,
		// Requests to attestors not authorized are listed, not watched.
		SweepPeriod: 20 * time.Millisecond,
	}
	for _, o := range opts {
		o(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	t.Cleanup(c.startCaches(ctx))
	if !cache.WaitForCacheSync(ctx.Done(), c.HasSynced) {
		t.Fatal("caches did not sync")
	}
	r := &rig{t: t, cs: cs, c: c, clock: clk, v: v, ctx: ctx, signer: attestor.ClientSignerName("fake"), kind: "client"}
	if serving {
		r.signer, r.kind = attestor.ServingSignerName("fake"), "serving"
	}
	return r
}

// file creates a CSR with evidence ev for key material req.
func (r *rig) file(name string, req signertest.Request, ev challengeEvidence) *certificatesv1.CertificateSigningRequest {
	r.t.Helper()
	return r.fileWith(name, req, ev, nil)
}

// fileWith is file with an edit of the object before it is created.
func (r *rig) fileWith(name string, req signertest.Request, ev challengeEvidence, edit func(*certificatesv1.CertificateSigningRequest)) *certificatesv1.CertificateSigningRequest {
	r.t.Helper()
	b, err := json.Marshal(ev)
	if err != nil {
		r.t.Fatal(err)
	}
	req.Provider, req.Evidence = "fake", b
	csr := &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("uid-" + name)},
		Spec: certificatesv1.CertificateSigningRequestSpec{
			SignerName: r.signer,
			Username:   "system:bootstrap:abcdef",
			Groups:     []string{attestor.BootstrappersGroup, "system:authenticated"},
			Usages:     signertest.ClientUsages,
		},
	}
	if r.kind == "serving" {
		csr.Spec.Username, csr.Spec.Groups = "system:node:node-1", []string{attestor.NodesGroup, "system:authenticated"}
		csr.Spec.Usages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth}
		req.DNSNames = []string{"node-1.example"}
	}
	csr.Spec.Request, _ = req.Build(r.t)
	if edit != nil {
		edit(csr)
	}
	filer := r.filer
	if filer == nil {
		filer = r.cs
	}
	if _, err := filer.CertificatesV1().CertificateSigningRequests().Create(r.ctx, csr, metav1.CreateOptions{}); err != nil {
		r.t.Fatal(err)
	}
	return csr
}

// sync waits for the informer to see the latest version of name and
// decides it once, as a worker would.
func (r *rig) sync(name string) (time.Duration, error) {
	r.t.Helper()
	r.cached(name)
	return r.c.sync(r.ctx, key{signer: r.signer, name: name})
}

// cached waits for the informer to see the latest version of each named CSR.
func (r *rig) cached(names ...string) {
	r.t.Helper()
	for _, name := range names {
		live := r.get(name)
		deadline := time.Now().Add(5 * time.Second)
		for {
			cached, err := r.c.Get(r.signer, name)
			if err == nil && equality.Semantic.DeepEqual(cached.Annotations, live.Annotations) && equality.Semantic.DeepEqual(cached.Status, live.Status) {
				break
			}
			if time.Now().After(deadline) {
				r.t.Fatalf("informer never saw %s at version %s", name, live.ResourceVersion)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

func (r *rig) get(name string) *certificatesv1.CertificateSigningRequest {
	r.t.Helper()
	csr, err := r.c.cfg.Client.CertificatesV1().CertificateSigningRequests().Get(r.ctx, name, metav1.GetOptions{})
	if err != nil {
		r.t.Fatal(err)
	}
	return csr
}

// challenged files a first round named name for req, decides it, and
// returns the challenge written on it.
func (r *rig) challenged(name string, req signertest.Request) string {
	r.t.Helper()
	r.file(name, req, challengeEvidence{Version: "v1", ProviderID: pid})
	if _, err := r.sync(name); err != nil {
		r.t.Fatal(err)
	}
	ch := r.get(name).Annotations[attestor.AnnotationChallenge]
	if ch == "" {
		r.t.Fatalf("%s not challenged", name)
	}
	return ch
}

func (r *rig) patches(name string) int {
	n := 0
	for _, a := range r.cs.Actions() {
		if p, ok := a.(k8stesting.PatchAction); ok && p.GetName() == name {
			n++
		}
	}
	return n
}

// TestTwoRounds runs the challenge flow on the client and the serving
// kind: challenged once (not again on later syncs), the answer approved
// and issued, the first round closed, a replayed answer refused, and an
// unanswered challenge closed once expired.
func TestTwoRounds(t *testing.T) {
	for _, serving := range []bool{false, true} {
		name := "client"
		if serving {
			name = "serving"
		}
		t.Run(name, func(t *testing.T) {
			r := newRig(t, serving)
			req := signertest.Request{NodeName: "node-1", ProviderID: pid}
			_, key := req.Build(t)
			req.Key = key

			r.file("first", req, challengeEvidence{Version: "v1", ProviderID: pid})
			if _, err := r.sync("first"); err != nil {
				t.Fatal(err)
			}
			first := r.get("first")
			ch := first.Annotations[attestor.AnnotationChallenge]
			if ch == "" || first.Annotations[attestor.AnnotationChallengeSeal] == "" {
				t.Fatalf("first round not challenged: %v", first.Annotations)
			}
			// Syncing the challenged request again (its annotation patch
			// queues it) neither challenges it again nor calls the verifier.
			calls := r.v.calls
			for range 3 {
				after, err := r.sync("first")
				if err != nil {
					t.Fatal(err)
				}
				if after <= 0 || after > 5*time.Minute+time.Second {
					t.Errorf("look again in %v, want within the challenge's lifetime", after)
				}
			}
			if got := r.get("first").Annotations[attestor.AnnotationChallenge]; got != ch || r.v.calls != calls || r.patches("first") != 1 {
				t.Fatalf("challenged again: calls %d→%d, patches %d", calls, r.v.calls, r.patches("first"))
			}

			binding := attestor.Binding(mustSPKI(t, key))
			answer := challengeEvidence{Version: "v1", ProviderID: pid, Answers: "first", Proof: proofFor([]byte(ch), binding)}
			r.file("second", req, answer)
			if _, err := r.sync("second"); err != nil {
				t.Fatal(err)
			}
			if got := cond(r.get("first")); got != "Denied/"+attestor.ReasonChallengeAnswered {
				t.Errorf("first round: %s, want closed ChallengeAnswered", got)
			}
			second := r.get("second")
			if len(second.Status.Certificate) == 0 {
				t.Fatalf("answer not issued: %s %v", cond(second), second.Status.Conditions)
			}

			// The same answer again, in a third request: the challenge is used.
			r.file("replay", req, answer)
			if _, err := r.sync("replay"); err != nil {
				t.Fatal(err)
			}
			if got := cond(r.get("replay")); got != "Denied/"+attestor.ReasonChallengeUsed {
				t.Errorf("replayed answer: %s, want Denied/%s", got, attestor.ReasonChallengeUsed)
			}

			// A challenge nobody answers is closed once it expires, and an
			// answer after that is refused.
			r.file("lonely", req, challengeEvidence{Version: "v1", ProviderID: pid})
			if _, err := r.sync("lonely"); err != nil {
				t.Fatal(err)
			}
			lonelyCh := r.get("lonely").Annotations[attestor.AnnotationChallenge]
			r.file("late", req, challengeEvidence{Version: "v1", ProviderID: pid, Answers: "lonely", Proof: proofFor([]byte(lonelyCh), binding)})
			r.clock.Step(6 * time.Minute)
			if _, err := r.sync("late"); err != nil {
				t.Fatal(err)
			}
			if got := cond(r.get("late")); got != "Denied/"+attestor.ReasonChallengeExpired {
				t.Errorf("late answer: %s, want Denied/%s", got, attestor.ReasonChallengeExpired)
			}
			if _, err := r.sync("lonely"); err != nil {
				t.Fatal(err)
			}
			if got := cond(r.get("lonely")); got != "Denied/"+attestor.ReasonChallengeExpired {
				t.Errorf("unanswered challenge: %s, want Denied/%s", got, attestor.ReasonChallengeExpired)
			}
		})
	}
}

// TestAnswerAfterFailedApproval: the approval of an answer fails (an API
// error) after the close of the request it answered. Decided again, that
// answer is approved and issued, not refused for a challenge its own close
// used; a copy of the answer filed meanwhile, and a request of the same
// name filed anew, are still refused ChallengeUsed.
func TestAnswerAfterFailedApproval(t *testing.T) {
	r := newRig(t, false)
	req := signertest.Request{NodeName: "node-1", ProviderID: pid}
	_, key := req.Build(t)
	req.Key = key
	ch := r.challenged("first", req)
	answer := challengeEvidence{Version: "v1", ProviderID: pid, Answers: "first", Proof: proofFor([]byte(ch), attestor.Binding(mustSPKI(t, key)))}

	failed := 0
	// The approval of "second" (an update, or a patch where the cache cut
	// its metadata) fails once.
	r.cs.PrependReactor("*", "certificatesigningrequests", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "approval" || failed > 0 {
			return false, nil, nil
		}
		var name string
		switch a := a.(type) {
		case k8stesting.PatchAction:
			name = a.GetName()
		case k8stesting.UpdateAction:
			if obj, ok := a.GetObject().(*certificatesv1.CertificateSigningRequest); ok {
				name = obj.Name
			}
		}
		if name != "second" {
			return false, nil, nil
		}
		failed++
		return true, nil, apierrors.NewServiceUnavailable("etcd leader changed")
	})
	r.file("second", req, answer)
	if _, err := r.sync("second"); err == nil {
		t.Fatal("the approval failed, and the sync reported no error")
	}
	first := r.get("first")
	if got := cond(first); got != "Denied/"+attestor.ReasonChallengeAnswered {
		t.Fatalf("first round after the failed approval: %s, want closed ChallengeAnswered", got)
	}
	if got := cond(r.get("second")); got != "pending" {
		t.Fatalf("answer after its failed approval: %s, want pending", got)
	}

	// A copy of the answer, filed before the answer is decided again.
	r.file("copy", req, answer)
	r.cached("first")
	if _, err := r.sync("second"); err != nil {
		t.Fatal(err)
	}
	if got := cond(r.get("second")); !strings.HasPrefix(got, "Approved/") || len(r.get("second").Status.Certificate) == 0 {
		t.Fatalf("answer decided again: %s %v, want approved and issued", got, r.get("second").Status.Conditions)
	}
	if _, err := r.sync("copy"); err != nil {
		t.Fatal(err)
	}
	if got := cond(r.get("copy")); got != "Denied/"+attestor.ReasonChallengeUsed {
		t.Errorf("copy of the answer: %s, want Denied/%s", got, attestor.ReasonChallengeUsed)
	}

	// The answer's name, filed anew (another UID) after the first is gone.
	if err := r.cs.CertificatesV1().CertificateSigningRequests().Delete(r.ctx, "second", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	r.fileWith("second", req, answer, func(c *certificatesv1.CertificateSigningRequest) { c.UID = "uid-second-again" })
	if _, err := r.sync("second"); err != nil {
		t.Fatal(err)
	}
	if got := cond(r.get("second")); got != "Denied/"+attestor.ReasonChallengeUsed {
		t.Errorf("the answer's name filed anew: %s, want Denied/%s", got, attestor.ReasonChallengeUsed)
	}
}

func mustSPKI(t *testing.T, key crypto.Signer) []byte {
	t.Helper()
	b, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// flaky is a verifier whose upstream is down.
type flaky struct{ calls int }

func (*flaky) Versions() []string { return []string{"v1"} }
func (f *flaky) Verify(context.Context, *attestor.VerifyRequest) (*attestor.Result, error) {
	f.calls++
	return nil, errors.New("upstream unavailable")
}

// TestForgedChallenge: a request filed with a challenge annotation of its
// own (an expiry in the year 9999) is denied at once, without a verifier
// call and without waiting on the forged expiry; and authorization comes
// before the challenge guard.
func TestForgedChallenge(t *testing.T) {
	forged := `{"version":"v1","credentialBlob":"AA==","encryptedSecret":"AA==","expires":"9999-12-31T23:59:59Z"}`
	for _, tc := range []struct {
		name       string
		authorized []string
		seal       string
		want       string
	}{
		{"unsealed", []string{"fake"}, "", attestor.ReasonMalformedChallenge},
		{"sealed by someone else", []string{"fake"}, "v1.253402300799.AAAA", attestor.ReasonMalformedChallenge},
		{"sealed under a key never made", []string{"fake"}, "v2.k9.253402300799.AAAA", attestor.ReasonMalformedChallenge},
		{"sealed under a malformed key id", []string{"fake"}, "v2.K-1.253402300799.AAAA", attestor.ReasonMalformedChallenge},
		{"not authorized", nil, "", attestor.ReasonAttestorNotAuthorized},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, false, func(c *Config) { c.Engine.Authorized = tc.authorized })
			req := signertest.Request{NodeName: "node-1", ProviderID: pid}
			r.fileWith("forged", req, challengeEvidence{Version: "v1", ProviderID: pid}, func(c *certificatesv1.CertificateSigningRequest) {
				c.Annotations = map[string]string{attestor.AnnotationChallenge: forged}
				if tc.seal != "" {
					c.Annotations[attestor.AnnotationChallengeSeal] = tc.seal
				}
			})
			after, err := r.sync("forged")
			if err != nil || after != 0 {
				t.Fatalf("sync = %v, %v; want a decision now", after, err)
			}
			if got := cond(r.get("forged")); got != "Denied/"+tc.want {
				t.Errorf("forged challenge: %s, want Denied/%s", got, tc.want)
			}
			if r.v.calls != 0 {
				t.Errorf("the verifier was called %d times", r.v.calls)
			}
		})
	}
}

// TestServingRules: a client-only provider's serving signer is refused,
// and a bootstrap identity never gets a serving certificate.
func TestServingRules(t *testing.T) {
	t.Run("client-only provider", func(t *testing.T) {
		r := newRig(t, true, func(c *Config) {
			c.Engine.Profiles = engine.Profiles(engine.ProfileSet{
				Verifiers:  map[string]attestor.Verifier{"fake": &challenger{now: time.Now, ttl: time.Minute}},
				ClientOnly: []string{"fake"},
				Client:     c.Engine.Profiles[0].Signer,
				Serving:    c.Engine.Profiles[1].Signer,
			})
		})
		r.file("serving", signertest.Request{NodeName: "node-1", ProviderID: pid}, challengeEvidence{Version: "v1", ProviderID: pid})
		if _, err := r.sync("serving"); err != nil {
			t.Fatal(err)
		}
		if got := cond(r.get("serving")); got != "Denied/"+attestor.ReasonSignerNotServed {
			t.Errorf("serving request to a client-only provider: %s", got)
		}
	})
	t.Run("bootstrap requester", func(t *testing.T) {
		r := newRig(t, true)
		r.fileWith("serving", signertest.Request{NodeName: "node-1", ProviderID: pid}, challengeEvidence{Version: "v1", ProviderID: pid}, func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Username, c.Spec.Groups = "system:bootstrap:abcdef", []string{attestor.BootstrappersGroup}
		})
		if _, err := r.sync("serving"); err != nil {
			t.Fatal(err)
		}
		if got := cond(r.get("serving")); got != "Denied/"+attestor.ReasonRequesterNotAllowed {
			t.Errorf("serving request by a bootstrap token: %s", got)
		}
		if r.v.calls != 0 {
			t.Errorf("the verifier was called %d times", r.v.calls)
		}
	})
}

// TestUndecidable: a request whose verification keeps failing transiently
// is retried, never denied for it, until MaxTries; then it is denied with
// a reason of its own, and the work it caused is bounded by MaxTries.
func TestUndecidable(t *testing.T) {
	down := &flaky{}
	r := newRig(t, false, func(c *Config) {
		c.MaxTries = 4
		for _, p := range c.Engine.Profiles {
			if p.Verifier != nil {
				p.Verifier = down
			}
		}
	})
	r.file("stuck", signertest.Request{NodeName: "node-1", ProviderID: pid}, challengeEvidence{Version: "v1", ProviderID: pid})
	r.c.queue.Add(key{signer: r.signer, name: "stuck"})
	_, _ = r.sync("stuck") // let the informer catch up; counts as the first try
	r.c.queue.AddRateLimited(key{signer: r.signer, name: "stuck"})
	deadline := time.Now().Add(10 * time.Second)
	for cond(r.get("stuck")) == "pending" && time.Now().Before(deadline) {
		if r.c.queue.Len() == 0 {
			time.Sleep(5 * time.Millisecond)
			continue
		}
		k, _ := r.c.queue.Get()
		r.c.process(r.ctx, k)
	}
	if got := cond(r.get("stuck")); got != "Denied/"+attestor.ReasonUndecidable {
		t.Fatalf("stuck request: %s, want Denied/%s", got, attestor.ReasonUndecidable)
	}
	if down.calls > 5 {
		t.Errorf("the verifier was called %d times for one request, want at most MaxTries+1", down.calls)
	}
}

// TestInsecureJoinsOnce: an attestor that registers a node once (insecure)
// issues to a bootstrap token only while the Machine's node has not
// joined, for a worker and a control-plane Machine alike; the node's own
// renewal still passes.
func TestInsecureJoinsOnce(t *testing.T) {
	for _, name := range []string{"worker", "control-plane"} {
		t.Run(name, func(t *testing.T) {
			joined := *theMachine
			joined.Name, joined.Joined = name, true
			r := newRig(t, false, func(c *Config) {
				c.Engine.Machines = fixedMachine{&joined}
				for _, p := range c.Engine.Profiles {
					if p.Verifier != nil {
						p.Verifier, p.JoinOnce = plain{}, true
					}
				}
			})
			req := signertest.Request{NodeName: "node-1", ProviderID: pid}
			r.file("again", req, challengeEvidence{Version: "v1", ProviderID: pid})
			if _, err := r.sync("again"); err != nil {
				t.Fatal(err)
			}
			if got := cond(r.get("again")); got != "Denied/"+attestor.ReasonNodeAlreadyJoined {
				t.Errorf("bootstrap token for a joined node: %s, want Denied/%s", got, attestor.ReasonNodeAlreadyJoined)
			}
			r.fileWith("renewal", req, challengeEvidence{Version: "v1", ProviderID: pid}, func(c *certificatesv1.CertificateSigningRequest) {
				c.Spec.Username, c.Spec.Groups = "system:node:node-1", []string{attestor.NodesGroup}
			})
			if _, err := r.sync("renewal"); err != nil {
				t.Fatal(err)
			}
			if got := cond(r.get("renewal")); got != "issued" && !strings.HasPrefix(got, "Approved/") {
				t.Errorf("the node's own renewal: %s, want issued", got)
			}
			if len(r.get("renewal").Status.Certificate) == 0 {
				t.Errorf("the node's own renewal was not issued")
			}
		})
	}
}

// plain proves what the evidence claims, in one round.
type plain struct{}

func (plain) Versions() []string { return []string{"v1"} }
func (plain) Verify(_ context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	return &attestor.Result{Identity: &attestor.Identity{ProviderID: in.ProviderID}}, nil
}

type fixedMachine struct{ m *engine.Machine }

func (f fixedMachine) MatchMachine(context.Context, string, string) (*engine.Machine, error) {
	return f.m, nil
}
func (f fixedMachine) ForNode(context.Context, string) (*engine.Machine, error) { return f.m, nil }

// TestAnswerAcrossSigners: the signer name is part of what an answer must
// match: an answer filed to the serving signer for a challenge written on
// a client request is not taken, and the challenge stays open for its own
// signer.
func TestAnswerAcrossSigners(t *testing.T) {
	r := newRig(t, false)
	req := signertest.Request{NodeName: "node-1", ProviderID: pid}
	_, key := req.Build(t)
	req.Key = key
	ch := r.challenged("client-first", req)
	binding := attestor.Binding(mustSPKI(t, key))
	answer := challengeEvidence{Version: "v1", ProviderID: pid, Answers: "client-first", Proof: proofFor([]byte(ch), binding)}

	r.signer, r.kind = attestor.ServingSignerName("fake"), "serving"
	r.file("serving-answer", req, answer)
	if _, err := r.sync("serving-answer"); err != nil {
		t.Fatal(err)
	}
	if got := cond(r.get("serving-answer")); got != "Denied/"+attestor.ReasonChallengeNotFound {
		t.Errorf("answer across signers: %s, want Denied/%s", got, attestor.ReasonChallengeNotFound)
	}
	if got := cond(r.get("client-first")); got != "pending" {
		t.Errorf("the client challenge was closed by another signer's answer: %s", got)
	}
}

// TestLongestChallengeTTL: a challenge as long-lived as the controller's
// flags allow (--tpm-challenge-ttl up to engine.DefaultMaxChallengeTTL) is
// written, not retried until the request is undecidable.
func TestLongestChallengeTTL(t *testing.T) {
	r := newRig(t, false)
	r.v.ttl = engine.DefaultMaxChallengeTTL
	r.file("long", signertest.Request{NodeName: "node-1", ProviderID: pid}, challengeEvidence{Version: "v1", ProviderID: pid})
	if _, err := r.sync("long"); err != nil {
		t.Fatalf("a challenge of %s: %v", engine.DefaultMaxChallengeTTL, err)
	}
	if r.get("long").Annotations[attestor.AnnotationChallenge] == "" {
		t.Fatal("not challenged")
	}
}

// TestPendingBound: one requester's undecided requests are bounded, per node
// and in all. The newest requests beyond a bound are denied
// TooManyPendingRequests without a verifier call; the older ones (here
// challenged, waiting for their answers) are untouched; once an older one is
// decided, a new request is looked at again.
func TestPendingBound(t *testing.T) {
	r := newRig(t, false, func(c *Config) {
		c.Engine.MaxPendingPerNode = 2
		c.Engine.MaxPendingPerRequester = 3
	})
	base := time.Now().Truncate(time.Second)
	n := 0
	var filed []string
	file := func(name, node string) {
		t.Helper()
		n++
		at := metav1.NewTime(base.Add(time.Duration(n) * time.Second))
		r.fileWith(name, signertest.Request{NodeName: node, ProviderID: pid}, challengeEvidence{Version: "v1", ProviderID: pid},
			func(c *certificatesv1.CertificateSigningRequest) { c.CreationTimestamp = at })
		r.cached(filed...) // the engine counts what the cache holds
		filed = append(filed, name)
		if _, err := r.sync(name); err != nil {
			t.Fatal(err)
		}
	}
	challenged := func(name string) bool {
		return r.get(name).Annotations[attestor.AnnotationChallenge] != ""
	}

	file("a-1", "node-1")
	file("a-2", "node-1")
	if !challenged("a-1") || !challenged("a-2") {
		t.Fatalf("the first two requests for node-1 were not challenged: %s, %s", cond(r.get("a-1")), cond(r.get("a-2")))
	}
	calls := r.v.calls
	file("a-3", "node-1")
	if got := cond(r.get("a-3")); got != "Denied/"+attestor.ReasonTooManyPending {
		t.Fatalf("a third pending request for node-1: %s, want Denied/%s", got, attestor.ReasonTooManyPending)
	}
	if r.v.calls != calls {
		t.Errorf("the verifier was called %d times for a request over the bound", r.v.calls-calls)
	}
	if msg := r.get("a-3").Status.Conditions[0].Message; !strings.Contains(msg, `node "node-1"`) || !strings.Contains(msg, "2 older requests waiting on a challenge") {
		t.Errorf("denial does not say why: %q", msg)
	}
	// The older requests stay as they were.
	for _, name := range []string{"a-1", "a-2"} {
		if got := cond(r.get(name)); got != "pending" {
			t.Errorf("%s: %s after a newer request was turned away", name, got)
		}
		if _, err := r.sync(name); err != nil {
			t.Fatal(err)
		}
		if got := cond(r.get(name)); got != "pending" {
			t.Errorf("%s: %s on a later sync", name, got)
		}
	}

	// Another node of the same requester: within the bound in all (two
	// older pending), so looked at (and denied for its own reason: no
	// Machine).
	file("b-1", "node-2")
	if got := cond(r.get("b-1")); got != "Denied/"+attestor.ReasonMachineNotFound {
		t.Errorf("a request for another node: %s, want it looked at (Denied/%s)", got, attestor.ReasonMachineNotFound)
	}
	// Another requester is not counted against this one.
	r.fileWith("other", signertest.Request{NodeName: "node-1", ProviderID: pid}, challengeEvidence{Version: "v1", ProviderID: pid},
		func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Username = "system:bootstrap:zzzzzz"
			c.CreationTimestamp = metav1.NewTime(base.Add(time.Hour))
		})
	if _, err := r.sync("other"); err != nil {
		t.Fatal(err)
	}
	if !challenged("other") {
		t.Errorf("another requester's request: %s, want it challenged", cond(r.get("other")))
	}

	// Once the older challenges expire (and are closed), node-1 may ask again.
	r.clock.Step(6 * time.Minute)
	for _, name := range []string{"a-1", "a-2"} {
		if _, err := r.sync(name); err != nil {
			t.Fatal(err)
		}
	}
	file("a-4", "node-1")
	if !challenged("a-4") {
		t.Errorf("a request after the older ones were decided: %s, want it challenged", cond(r.get("a-4")))
	}
}

// TestSharedTokenFlood: under a bootstrap token a MachinePool's nodes
// share, a holder floods first rounds (challenged, never answered) up to
// the bounds for a node of the pool. The genuine node is turned away while
// the flood is fresh, but a request it files once the flood has had
// engine.DefaultPendingGrace (1 min) to be answered is challenged, with a
// challenge that lives only that long, and its answer is issued: it joins
// within the grace plus its own retry, not after the flood's challenges
// expire (5 min here, 10 by default). The flood's own challenges are
// untouched, and what the holder files beyond the bounds is short-lived
// and itself bounded.
func TestSharedTokenFlood(t *testing.T) {
	const bound = 4
	r := newRig(t, false, func(c *Config) {
		c.Engine.MaxPendingPerNode = bound
		c.Engine.MaxPendingPerRequester = bound
	})
	grace := engine.DefaultPendingGrace
	req := signertest.Request{NodeName: "node-1", ProviderID: pid}
	var filed []string
	file := func(name string, r0 signertest.Request, ev challengeEvidence) {
		t.Helper()
		at := metav1.NewTime(r.clock.Now())
		r.fileWith(name, r0, ev, func(c *certificatesv1.CertificateSigningRequest) { c.CreationTimestamp = at })
		r.cached(filed...)
		filed = append(filed, name)
		if _, err := r.sync(name); err != nil {
			t.Fatal(err)
		}
	}
	expiry := func(name string) time.Duration {
		t.Helper()
		seal := r.get(name).Annotations[attestor.AnnotationChallengeSeal]
		parts := strings.Split(seal, ".")
		if len(parts) != 4 {
			t.Fatalf("%s: seal %q", name, seal)
		}
		unix, err := strconv.ParseInt(parts[2], 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		return time.Unix(unix, 0).Sub(r.clock.Now())
	}

	for i := range bound {
		file(fmt.Sprintf("forged-%d", i), req, challengeEvidence{Version: "v1", ProviderID: pid})
		if expiry(fmt.Sprintf("forged-%d", i)) < 4*time.Minute {
			t.Fatalf("forged-%d within the bound: %s, want a challenge of the verifier's lifetime", i, cond(r.get(fmt.Sprintf("forged-%d", i))))
		}
		r.clock.Step(time.Second)
	}

	genuine := func(name string) string {
		t.Helper()
		g := req
		_, key := g.Build(t)
		g.Key = key
		file(name, g, challengeEvidence{Version: "v1", ProviderID: pid})
		first := r.get(name)
		ch := first.Annotations[attestor.AnnotationChallenge]
		if ch == "" {
			return cond(first)
		}
		if left := expiry(name); left > grace {
			t.Errorf("%s, admitted beyond the bound, has a challenge of %s, want at most %s", name, left, grace)
		}
		r.clock.Step(2 * time.Second) // the node answers
		file(name+"-answer", g, challengeEvidence{Version: "v1", ProviderID: pid, Answers: name, Proof: proofFor([]byte(ch), attestor.Binding(mustSPKI(t, key)))})
		if answer := r.get(name + "-answer"); len(answer.Status.Certificate) == 0 {
			return cond(answer)
		}
		return "issued"
	}
	// While the flood is fresh, the bound holds.
	if got := genuine("genuine-1"); got != "Denied/"+attestor.ReasonTooManyPending {
		t.Fatalf("the genuine node's request next to a fresh flood: %s, want Denied/%s", got, attestor.ReasonTooManyPending)
	}
	// It files again (as its agent does) once the flood has had its grace.
	r.clock.Step(grace)
	if got := genuine("genuine-2"); got != "issued" {
		t.Fatalf("the genuine node's request %s after the flood: %s, want issued", grace, got)
	}
	// The flood's own challenges are untouched.
	for i := range bound {
		if got := cond(r.get(fmt.Sprintf("forged-%d", i))); got != "pending" {
			t.Errorf("forged-%d: %s, want still pending", i, got)
		}
	}
	// What the holder files beyond the bounds is short-lived, and bounded:
	// the 5th request filed within one grace is turned away.
	for i := range bound + 1 {
		name := fmt.Sprintf("more-%d", i)
		file(name, req, challengeEvidence{Version: "v1", ProviderID: pid})
		if i == bound {
			if got := cond(r.get(name)); got != "Denied/"+attestor.ReasonTooManyPending {
				t.Errorf("%s: %s, want Denied/%s", name, got, attestor.ReasonTooManyPending)
			}
			break
		}
		if left := expiry(name); left <= 0 || left > grace {
			t.Errorf("%s beyond the bound: challenge of %s, want at most %s (%s)", name, left, grace, cond(r.get(name)))
		}
	}
}

// TestPendingBoundInAll: the bound on one requester's undecided requests
// in all, across node names.
func TestPendingBoundInAll(t *testing.T) {
	r := newRig(t, false, func(c *Config) {
		c.Engine.MaxPendingPerNode = 10
		c.Engine.MaxPendingPerRequester = 2
	})
	base := time.Now().Truncate(time.Second)
	for i, name := range []string{"p-1", "p-2", "p-3"} {
		at := metav1.NewTime(base.Add(time.Duration(i) * time.Second))
		r.fileWith(name, signertest.Request{NodeName: "node-1", ProviderID: pid}, challengeEvidence{Version: "v1", ProviderID: pid},
			func(c *certificatesv1.CertificateSigningRequest) { c.CreationTimestamp = at })
		if i > 0 {
			r.cached("p-1", "p-2")
		}
		if _, err := r.sync(name); err != nil {
			t.Fatal(err)
		}
	}
	if got := cond(r.get("p-3")); got != "Denied/"+attestor.ReasonTooManyPending {
		t.Fatalf("third pending request of one requester: %s, want Denied/%s", got, attestor.ReasonTooManyPending)
	}
	if msg := r.get("p-3").Status.Conditions[0].Message; !strings.Contains(msg, "2 older requests waiting on a challenge (at most 2") {
		t.Errorf("denial does not say why: %q", msg)
	}
}

// TestPendingBoundBurst: requests not looked at yet do not count against
// a newer one (a burst is decided in queue order), only requests waiting
// on a challenge do.
func TestPendingBoundBurst(t *testing.T) {
	r := newRig(t, false, func(c *Config) { c.Engine.MaxPendingPerNode = 1 })
	base := time.Now().Truncate(time.Second)
	for i, name := range []string{"x-1", "x-2", "x-3"} {
		at := metav1.NewTime(base.Add(time.Duration(i) * time.Second))
		r.fileWith(name, signertest.Request{NodeName: "node-1", ProviderID: pid}, challengeEvidence{Version: "v1", ProviderID: pid},
			func(c *certificatesv1.CertificateSigningRequest) { c.CreationTimestamp = at })
	}
	// The newest first: the two older ones have not been looked at.
	if _, err := r.sync("x-2"); err != nil {
		t.Fatal(err)
	}
	if r.get("x-2").Annotations[attestor.AnnotationChallenge] == "" {
		t.Fatalf("x-2 behind requests not looked at yet: %s, want it challenged", cond(r.get("x-2")))
	}
	// x-3 is newer than a request waiting on its challenge: over the bound.
	r.cached("x-2")
	if _, err := r.sync("x-3"); err != nil {
		t.Fatal(err)
	}
	if got := cond(r.get("x-3")); got != "Denied/"+attestor.ReasonTooManyPending {
		t.Errorf("x-3: %s, want Denied/%s", got, attestor.ReasonTooManyPending)
	}
	// x-1 is older than every challenged one: looked at.
	if _, err := r.sync("x-1"); err != nil {
		t.Fatal(err)
	}
	if r.get("x-1").Annotations[attestor.AnnotationChallenge] == "" {
		t.Errorf("x-1: %s, want it challenged", cond(r.get("x-1")))
	}
}

// TestPendingBoundInCluster: the requests waiting on a challenge in one
// workload cluster are bounded across requesters; the newest beyond the
// bound are denied TooManyPendingRequestsInCluster without a verifier call,
// with a reason that says what to do.
func TestPendingBoundInCluster(t *testing.T) {
	r := newRig(t, false, func(c *Config) { c.Engine.MaxPendingPerCluster = 2 })
	base := time.Now().Truncate(time.Second)
	var filed []string
	for i, name := range []string{"a", "b", "c"} {
		at := metav1.NewTime(base.Add(time.Duration(i) * time.Second))
		r.fileWith(name, signertest.Request{NodeName: "node-1", ProviderID: pid}, challengeEvidence{Version: "v1", ProviderID: pid},
			func(c *certificatesv1.CertificateSigningRequest) {
				c.Spec.Username = attestor.BootstrapUserPrefix + strings.Repeat(name, 6) // three requesters
				c.CreationTimestamp = at
			})
		r.cached(filed...)
		filed = append(filed, name)
		calls := r.v.calls
		if _, err := r.sync(name); err != nil {
			t.Fatal(err)
		}
		if name == "c" && r.v.calls != calls {
			t.Errorf("the verifier was called %d times for a request over the cluster's bound", r.v.calls-calls)
		}
	}
	for _, name := range []string{"a", "b"} {
		if r.get(name).Annotations[attestor.AnnotationChallenge] == "" {
			t.Errorf("%s: %s, want it challenged", name, cond(r.get(name)))
		}
	}
	if got := cond(r.get("c")); got != "Denied/"+attestor.ReasonTooManyPendingInCluster {
		t.Fatalf("a third requester's request beyond the cluster's bound: %s, want Denied/%s", got, attestor.ReasonTooManyPendingInCluster)
	}
	if msg := r.get("c").Status.Conditions[0].Message; !strings.Contains(msg, "the cluster has 2 older requests waiting on a challenge (at most 2") {
		t.Errorf("denial does not say why: %q", msg)
	}
}

// TestChallengeKeyRotation: the challenge keys come from their Secret on a
// real kube-apiserver. A join challenged under key k1 is answered after the
// key rotated to k2 and is issued (the seal is checked under the key it
// names); new challenges are sealed under k2. Once k1 has been dropped
// after the overlap, an answer to a challenge sealed under it is refused
// with a reason that says so, even before the challenge's own expiry.
func TestChallengeKeyRotation(t *testing.T) {
	if testing.Short() {
		t.Skip("needs kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "challenge-key-rotation")
	mc, err := client.New(cp.AdminConfig, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	nn := types.NamespacedName{Namespace: "default", Name: "challenge-keys"}
	keyClock := clocktesting.NewFakePassiveClock(time.Now())
	rot := &challengekey.Rotator{Client: mc, Secret: nn, Ring: &challengekey.Ring{}, Interval: 24 * time.Hour, Overlap: time.Hour, Clock: keyClock}
	if _, err := rot.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	r := newRig(t, false, func(c *Config) { c.Engine.ChallengeKey, c.Engine.ChallengeKeys = nil, rot.Ring })
	req := signertest.Request{NodeName: "node-1", ProviderID: pid}
	_, key := req.Build(t)
	req.Key = key
	binding := attestor.Binding(mustSPKI(t, key))
	answer := func(name, first, ch string) *certificatesv1.CertificateSigningRequest {
		t.Helper()
		r.file(name, req, challengeEvidence{Version: "v1", ProviderID: pid, Answers: first, Proof: proofFor([]byte(ch), binding)})
		if _, err := r.sync(name); err != nil {
			t.Fatal(err)
		}
		return r.get(name)
	}
	rotate := func() {
		t.Helper()
		var s corev1.Secret
		if err := mc.Get(ctx, nn, &s); err != nil {
			t.Fatal(err)
		}
		s.Annotations[challengekey.AnnotationRotate] = "now"
		if err := mc.Update(ctx, &s); err != nil {
			t.Fatal(err)
		}
		if rotated, err := rot.Sync(ctx); err != nil || !rotated {
			t.Fatalf("rotation: %v, %v", rotated, err)
		}
	}

	ch1 := r.challenged("first", req)
	if seal := r.get("first").Annotations[attestor.AnnotationChallengeSeal]; !strings.HasPrefix(seal, "v3.k1.") {
		t.Fatalf("first round sealed %q, want under k1", seal)
	}
	old := r.challenged("old", req)
	rotate() // k1 → k2, mid-join
	if second := answer("second", "first", ch1); len(second.Status.Certificate) == 0 {
		t.Fatalf("answer to a challenge made before the rotation: %s %v, want issued", cond(second), second.Status.Conditions)
	}
	r.challenged("fresh", req)
	if seal := r.get("fresh").Annotations[attestor.AnnotationChallengeSeal]; !strings.HasPrefix(seal, "v3.k2.") {
		t.Errorf("a challenge after the rotation sealed %q, want under k2", seal)
	}

	// The overlap passes for the keys (not for the challenge, which the
	// rig's clock keeps open): the next rotation drops k1.
	keyClock.SetTime(keyClock.Now().Add(time.Hour))
	rotate() // k2 → k3, k1 dropped
	late := answer("late", "old", old)
	if got := cond(late); got != "Denied/"+attestor.ReasonChallengeExpired {
		t.Fatalf("answer to a challenge under the dropped key: %s, want Denied/%s", got, attestor.ReasonChallengeExpired)
	}
	if msg := late.Status.Conditions[0].Message; !strings.Contains(msg, `challenge key "k1"`) || !strings.Contains(msg, "rotated out") {
		t.Errorf("denial %q does not say the challenge's key was rotated out", msg)
	}
}
