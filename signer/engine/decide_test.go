package engine

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

const (
	testNode = "node-1"
	testPID  = "fake:///node-1"
)

var testNow = time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)

// scripted is a verifier that answers what its case says.
type scripted struct {
	res *attestor.Result
	err error
	got *attestor.VerifyRequest
}

func (*scripted) Versions() []string { return []string{"v2", "v1"} }

func (v *scripted) Verify(_ context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	v.got = in
	return v.res, v.err
}

// oneMachine is the Machines of one Machine, or of the error a case sets.
type oneMachine struct {
	m   *Machine
	err error
}

func (o oneMachine) MatchMachine(context.Context, string, string) (*Machine, error) {
	return o.m, o.err
}
func (o oneMachine) ForNode(context.Context, string) (*Machine, error) { return o.m, o.err }

// noCSRs is a lister with no other requests.
type noCSRs struct{}

func (noCSRs) Get(_, name string) (*certificatesv1.CertificateSigningRequest, error) {
	return nil, apierrors.NewNotFound(schema.GroupResource{Group: "certificates.k8s.io", Resource: "certificatesigningrequests"}, name)
}
func (noCSRs) ByRequester(string) ([]*certificatesv1.CertificateSigningRequest, error) {
	return nil, nil
}
func (noCSRs) Waiting(string, string) ([]*certificatesv1.CertificateSigningRequest, error) {
	return nil, nil
}
func (n noCSRs) Live(_ context.Context, signer, name string) (*certificatesv1.CertificateSigningRequest, error) {
	return n.Get(signer, name)
}

// binder is trust on first use that answers err.
type binder struct{ err error }

func (b binder) Bind(context.Context, *Machine, string) error { return b.err }

type noSigner struct{}

func (noSigner) Sign(*issue.Request) ([]byte, error) { return nil, errors.New("not in a decision") }

func denyErr(reason string) error {
	return &attestor.DenyError{Reason: reason, Message: "the case says so"}
}

// TestDecide: the decision for each kind of request, as a value, with no
// API server or informer: cheap checks before any verifier call, every
// denial with its reason, transient errors retried, never denied.
func TestDecide(t *testing.T) {
	client, serving := attestor.ClientSignerName("fake"), attestor.ServingSignerName("fake")
	machine := func() *Machine {
		return &Machine{Namespace: "ns", Name: "m-1", UID: "uid-m-1", ProviderID: testPID,
			DNSNames: []string{testNode}, IPs: []net.IP{net.ParseIP("192.0.2.1")}}
	}
	verified := &attestor.Result{Identity: &attestor.Identity{ProviderID: testPID, Stable: "fake:id-1"}}
	evidence := attestor.Evidence(`{"version":"v2"}`)

	type tc struct {
		name string
		// The request: signer name, and edits of the request and object.
		signer  string
		req     func(*signertest.Request)
		obj     func(*certificatesv1.CertificateSigningRequest)
		machine oneMachine
		verify  scripted
		bind    binder
		// The Cluster authorizes these attestors (default: fake).
		authorized []string
		// A profile edit (JoinOnce, Refused).
		profile func(*Profile)

		want        Outcome
		wantReasons []string // every denial, in order
		wantReason  string   // the condition's reason (Approve, Fail)
		wantVerify  bool     // whether the verifier was called
		wantMessage string   // what the message must say
	}
	cases := []tc{
		{name: "attested client request", want: Approve, wantReason: attestor.ReasonAttestationVerified, wantVerify: true},
		{name: "another signer's request", signer: "example.com/other", want: Skip},
		{name: "already denied", obj: condition(certificatesv1.CertificateDenied, "Whatever"), want: Skip},
		{name: "approved by someone else", obj: condition(certificatesv1.CertificateApproved, "AutoApproved"), want: Skip},
		{name: "approved by this signer, not yet signed", obj: condition(certificatesv1.CertificateApproved, attestor.ReasonAttestationVerified), want: Sign},
		{name: "approved by this signer, Machine gone", obj: condition(certificatesv1.CertificateApproved, attestor.ReasonAttestationVerified),
			machine: oneMachine{err: denyErr(attestor.ReasonMachineNotFound)}, want: Fail, wantReasons: []string{attestor.ReasonMachineNotFound}, wantReason: attestor.ReasonSigningFailed},
		{name: "signer name refused", profile: func(p *Profile) { p.Refused = "not here" }, want: Deny, wantReasons: []string{attestor.ReasonSignerNotServed}},
		{name: "malformed spec.request", obj: func(c *certificatesv1.CertificateSigningRequest) { c.Spec.Request = []byte("not a request") },
			want: Deny, wantReasons: []string{attestor.ReasonMalformedRequest}},
		{name: "attestor not authorized", authorized: []string{"tpm"}, want: Deny, wantReasons: []string{attestor.ReasonAttestorNotAuthorized}},
		{name: "structure and authorization reported together", authorized: []string{"tpm"},
			obj: func(c *certificatesv1.CertificateSigningRequest) {
				c.Spec.Usages = append(c.Spec.Usages, certificatesv1.UsageServerAuth)
			},
			want: Deny, wantReasons: []string{attestor.ReasonUsagesNotAllowed, attestor.ReasonAttestorNotAuthorized}},
		{name: "evidence version not accepted", req: func(r *signertest.Request) { r.Evidence = attestor.Evidence(`{"version":"v9"}`) },
			want: Deny, wantReasons: []string{attestor.ReasonUnsupportedEvidenceVersion}},
		{name: "no Machine", machine: oneMachine{err: denyErr(attestor.ReasonMachineNotFound)},
			want: Deny, wantReasons: []string{attestor.ReasonMachineNotFound}},
		{name: "Machines unreadable", machine: oneMachine{err: errors.New("connection refused")}, want: Retry},
		{name: "join once, node joined", profile: func(p *Profile) { p.JoinOnce = true },
			machine: oneMachine{m: func() *Machine { m := machine(); m.Joined = true; return m }()},
			want:    Deny, wantReasons: []string{attestor.ReasonNodeAlreadyJoined}},
		{name: "evidence refused", verify: scripted{err: denyErr(attestor.ReasonMalformedEvidence)},
			want: Deny, wantReasons: []string{attestor.ReasonMalformedEvidence}, wantVerify: true},
		{name: "verifier upstream down", verify: scripted{err: errors.New("metadata service timed out")}, want: Retry, wantVerify: true},
		{name: "verifier proves nothing", verify: scripted{res: &attestor.Result{}}, want: Retry, wantVerify: true},
		{name: "proven provider ID is another", verify: scripted{res: &attestor.Result{Identity: &attestor.Identity{ProviderID: "fake:///node-2"}}},
			want: Deny, wantReasons: []string{attestor.ReasonAttestedProviderIDMismatch}, wantVerify: true},
		{name: "identity pinned to another", machine: oneMachine{m: func() *Machine { m := machine(); m.Identity = "fake:id-2"; return m }()},
			want: Deny, wantReasons: []string{attestor.ReasonIdentityMismatch}, wantVerify: true},
		{name: "identity claimed by another Machine", bind: binder{err: denyErr(attestor.ReasonIdentityClaimedByOtherMachine)},
			want: Deny, wantReasons: []string{attestor.ReasonIdentityClaimedByOtherMachine}, wantVerify: true},
		{name: "trust on first use unwritable", bind: binder{err: errors.New("conflict")}, want: Retry, wantVerify: true},
		{name: "challenged", verify: scripted{res: &attestor.Result{Challenge: &attestor.Challenge{Data: []byte("c"), Expires: testNow.Add(time.Minute)}}},
			want: Challenge, wantVerify: true},
		{name: "challenge longer than allowed", verify: scripted{res: &attestor.Result{Challenge: &attestor.Challenge{Data: []byte("c"), Expires: testNow.Add(2 * time.Hour)}}},
			want: Retry, wantVerify: true},
		{name: "answer to a request that does not exist", verify: scripted{res: &attestor.Result{Answers: "round-1"}},
			want: Deny, wantReasons: []string{attestor.ReasonChallengeNotFound}, wantVerify: true},
		{name: "attested serving request", signer: serving, req: servingRequest, obj: fromNode,
			want: Approve, wantReason: attestor.ReasonAttestedServingVerified, wantVerify: true},
		{name: "serving SAN not the Machine's", signer: serving, obj: fromNode,
			req:  func(r *signertest.Request) { servingRequest(r); r.DNSNames = append(r.DNSNames, "elsewhere.example") },
			want: Deny, wantReasons: []string{attestor.ReasonSANNotMachineAddress},
			wantMessage: "DNS:elsewhere.example are not addresses of Machine ns/m-1"},
		{name: "serving SAN not the allowlist entry's", signer: serving, obj: fromNode,
			machine: oneMachine{m: func() *Machine {
				m := machine()
				m.Description = "allowlist entry node-1 of ConfigMap ns/allowlist"
				return m
			}()},
			req:  func(r *signertest.Request) { servingRequest(r); r.DNSNames = append(r.DNSNames, "elsewhere.example") },
			want: Deny, wantReasons: []string{attestor.ReasonSANNotMachineAddress},
			wantMessage: "DNS:elsewhere.example are not addresses of allowlist entry node-1 of ConfigMap ns/allowlist"},
		{name: "serving request from a bootstrap token", signer: serving, req: servingRequest,
			want: Deny, wantReasons: []string{attestor.ReasonRequesterNotAllowed}},
		{name: "kubelet's own serving request", signer: certificatesv1.KubeletServingSignerName, req: func(r *signertest.Request) {
			servingRequest(r)
			r.OmitProviderID = true
		}, obj: func(c *certificatesv1.CertificateSigningRequest) {
			fromNode(c)
			c.Spec.Request = kubeletServingPEM(c.Spec.Request)
		}, want: Approve, wantReason: attestor.ReasonServingVerified},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			v := c.verify
			if v.res == nil && v.err == nil {
				v.res = verified
			}
			set := ProfileSet{Verifiers: map[string]attestor.Verifier{"fake": &v}, Client: noSigner{}, Serving: noSigner{}, KubeletServing: true}
			profiles := Profiles(set)
			if c.profile != nil {
				for _, p := range profiles {
					if p.SignerName == client {
						c.profile(p)
					}
				}
			}
			m := c.machine
			if m.m == nil && m.err == nil {
				m.m = machine()
			}
			authorized := c.authorized
			if authorized == nil {
				authorized = []string{"fake"}
			}
			e, err := New(Config{
				Cluster: "ns/c", Profiles: profiles, Authorized: authorized, Machines: m, CSRs: noCSRs{},
				Identities: c.bind, ChallengeKey: []byte(strings.Repeat("k", 32)), Clock: clocktesting.NewFakePassiveClock(testNow),
			})
			if err != nil {
				t.Fatal(err)
			}
			r := signertest.Request{NodeName: testNode, ProviderID: testPID, Provider: "fake", Evidence: evidence}
			if c.req != nil {
				c.req(&r)
			}
			spec, _ := r.Build(t)
			csr := signertest.CSR("csr-1", spec)
			csr.UID = "uid-csr-1"
			csr.Spec.SignerName = client
			if c.signer != "" {
				csr.Spec.SignerName = c.signer
				if c.signer != client {
					csr.Spec.Usages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth}
				}
			}
			if c.obj != nil {
				c.obj(csr)
			}

			d := e.Decide(context.Background(), csr)
			if d.Outcome != c.want {
				t.Fatalf("outcome %s (reason %q: %s; err %v), want %s", d.Outcome, d.Reason, d.Message, d.Err, c.want)
			}
			var reasons []string
			for _, x := range d.Denials {
				reasons = append(reasons, x.Reason)
			}
			if strings.Join(reasons, ",") != strings.Join(c.wantReasons, ",") {
				t.Errorf("denials %q, want %q", reasons, c.wantReasons)
			}
			if !strings.Contains(d.Message, c.wantMessage) {
				t.Errorf("message %q does not say %q", d.Message, c.wantMessage)
			}
			if c.wantReason != "" && d.Reason != c.wantReason {
				t.Errorf("reason %q, want %q", d.Reason, c.wantReason)
			}
			if called := v.got != nil; called != c.wantVerify {
				t.Errorf("verifier called: %t, want %t", called, c.wantVerify)
			}
			switch d.Outcome {
			case Deny, Fail:
				if d.Message == "" {
					t.Error("a denial without a message")
				}
			case Retry:
				if d.Err == nil {
					t.Error("a retry without its error")
				}
			case Approve, Sign:
				if d.Profile.Signer != nil && d.Issue == nil {
					t.Error("approved for a signing profile with nothing to issue")
				}
			case Challenge:
				if d.Annotations[attestor.AnnotationChallenge] != "c" || d.Annotations[attestor.AnnotationChallengeSeal] == "" {
					t.Errorf("challenge annotations %v, want the challenge and its seal", d.Annotations)
				}
			}
			if c.want == Deny && d.Reason == attestor.ReasonUnsupportedEvidenceVersion && d.Annotations[attestor.AnnotationSupportedVersions] != "v2,v1" {
				t.Errorf("supported versions %q, want v2,v1", d.Annotations[attestor.AnnotationSupportedVersions])
			}
		})
	}
}

func condition(t certificatesv1.RequestConditionType, reason string) func(*certificatesv1.CertificateSigningRequest) {
	return func(c *certificatesv1.CertificateSigningRequest) {
		c.Status.Conditions = append(c.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
			Type: t, Status: corev1.ConditionTrue, Reason: reason})
	}
}

func servingRequest(r *signertest.Request) { r.DNSNames = []string{testNode} }

// fromNode makes the request the node's own (serving certificates are
// asked for by the node's identity only).
func fromNode(c *certificatesv1.CertificateSigningRequest) {
	c.Spec.Username = attestor.NodeUserPrefix + testNode
	c.Spec.Groups = []string{attestor.NodesGroup, "system:authenticated"}
}

// kubeletServingPEM keeps only the PKCS#10 block of spec.request: kubelet's
// own requests carry no provider or evidence block.
func kubeletServingPEM(spec []byte) []byte {
	i := strings.Index(string(spec), "-----END CERTIFICATE REQUEST-----")
	return spec[:i+len("-----END CERTIFICATE REQUEST-----\n")]
}
