package controller

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/klog/v2/ktesting"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

const (
	node = "worker-0"
	pid  = "test:///worker-0"
)

type fakeMatcher struct {
	m   *Machine
	err error
}

func (f *fakeMatcher) MatchMachine(context.Context, string, string) (*Machine, error) {
	return f.m, f.err
}

type fakeVerifier struct {
	res *attestor.Result
	err error
	// lookup, when set, is looked up through LookupCSR.
	lookup    string
	lookedUp  *attestor.CSRRecord
	lookupErr error
}

func (f *fakeVerifier) Versions() []string { return []string{"v1"} }

func (f *fakeVerifier) Verify(ctx context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	if f.lookup != "" {
		f.lookedUp, f.lookupErr = in.LookupCSR(ctx, f.lookup)
	}
	return f.res, f.err
}

type countingMetrics map[string]int

func (m countingMetrics) Decision(_, decision, reason string) { m[decision+"/"+reason]++ }

func newSigner(t *testing.T) *issue.Signer {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubernetes"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	ca, err := issue.LoadCA(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}))
	if err != nil {
		t.Fatal(err)
	}
	return &issue.Signer{CA: ca, MaxLifetime: time.Hour}
}

type env struct {
	c       *Controller
	client  *fake.Clientset
	metrics countingMetrics
}

func newEnv(t *testing.T, matcher MachineMatcher, verifier attestor.Verifier, authorized []string, objs ...*certificatesv1.CertificateSigningRequest) *env {
	t.Helper()
	var ro []runtime.Object
	for _, o := range objs {
		ro = append(ro, o)
	}
	client := fake.NewClientset(ro...)
	m := countingMetrics{}
	c, err := New(Config{
		Cluster:    "ns/wl",
		Client:     client,
		Verifiers:  map[string]attestor.Verifier{insecure.Name: verifier},
		Authorized: authorized,
		Machines:   matcher,
		Signer:     newSigner(t),
		Metrics:    m,
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if err := c.informer.GetStore().Add(o); err != nil {
			t.Fatal(err)
		}
	}
	client.ClearActions()
	return &env{c: c, client: client, metrics: m}
}

// writes returns the verbs (and subresources) of the writes the controller
// made.
func (e *env) writes() []string {
	var out []string
	for _, a := range e.client.Actions() {
		if a.GetVerb() == "get" || a.GetVerb() == "list" || a.GetVerb() == "watch" {
			continue
		}
		out = append(out, a.GetVerb()+"/"+a.GetSubresource())
	}
	return out
}

func (e *env) csr(t *testing.T, name string) *certificatesv1.CertificateSigningRequest {
	t.Helper()
	csr, err := e.client.CertificatesV1().CertificateSigningRequests().Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return csr
}

func goodCSR(t *testing.T, name string) *certificatesv1.CertificateSigningRequest {
	req, _ := signertest.Request{NodeName: node, ProviderID: pid}.Build(t)
	csr := signertest.CSR(name, req)
	csr.UID = types.UID("uid-" + name)
	return csr
}

func withCondition(csr *certificatesv1.CertificateSigningRequest, typ certificatesv1.RequestConditionType, reason string) *certificatesv1.CertificateSigningRequest {
	csr.Status.Conditions = append(csr.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{Type: typ, Status: corev1.ConditionTrue, Reason: reason})
	return csr
}

var (
	theMachine = &Machine{Namespace: "ns", Name: node, ProviderID: pid}
	verified   = &attestor.Result{Identity: &attestor.Identity{ProviderID: pid}}
)

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestSync(t *testing.T) {
	other := goodCSR(t, "c")
	other.Spec.SignerName = certificatesv1.KubeAPIServerClientKubeletSignerName
	badVersion, _ := signertest.Request{NodeName: node, ProviderID: pid, Evidence: []byte(`{"version":"v9","providerID":"` + pid + `"}`)}.Build(t)

	tests := []struct {
		name       string
		csr        *certificatesv1.CertificateSigningRequest
		matcher    *fakeMatcher
		verifier   *fakeVerifier
		authorized []string
		wantErr    bool
		writes     []string
		denied     string // reason of the Denied condition
		failed     bool
		issued     bool
	}{
		{name: "approve and sign", csr: goodCSR(t, "c"), writes: []string{"update/approval", "update/status"}, issued: true},
		{name: "approved by us, not yet signed: sign", csr: withCondition(goodCSR(t, "c"), certificatesv1.CertificateApproved, ReasonAttestationVerified),
			writes: []string{"update/status"}, issued: true},

		{name: "other signer: untouched", csr: other},
		{name: "denied: untouched", csr: withCondition(goodCSR(t, "c"), certificatesv1.CertificateDenied, "X")},
		{name: "failed: untouched", csr: withCondition(goodCSR(t, "c"), certificatesv1.CertificateFailed, "X")},
		{name: "approved by someone else: not signed", csr: withCondition(goodCSR(t, "c"), certificatesv1.CertificateApproved, "KubectlApprove")},
		{name: "issued: untouched", csr: func() *certificatesv1.CertificateSigningRequest {
			c := withCondition(goodCSR(t, "c"), certificatesv1.CertificateApproved, ReasonAttestationVerified)
			c.Status.Certificate = []byte("x")
			return c
		}()},

		{name: "structural failure", csr: func() *certificatesv1.CertificateSigningRequest {
			c := goodCSR(t, "c")
			c.Spec.Usages = append(c.Spec.Usages, certificatesv1.UsageServerAuth)
			return c
		}(), writes: []string{"update/approval"}, denied: checks.ReasonUsagesNotAllowed},
		{name: "attestor not authorized", csr: goodCSR(t, "c"), authorized: []string{"tpm"},
			writes: []string{"update/approval"}, denied: ReasonAttestorNotAuthorized},
		{name: "unsupported evidence version", csr: signertest.CSR("c", badVersion),
			writes: []string{"patch/", "update/approval"}, denied: ReasonUnsupportedEvidenceVersion},

		{name: "no Machine: denied", csr: goodCSR(t, "c"), matcher: &fakeMatcher{err: &checks.Failure{Reason: "MachineNotFound", Message: "none"}},
			writes: []string{"update/approval"}, denied: "MachineNotFound"},
		{name: "Machine lookup fails: retried, not denied", csr: goodCSR(t, "c"), matcher: &fakeMatcher{err: errors.New("connection refused")}, wantErr: true},
		{name: "Machine went away after approval: failed", csr: withCondition(goodCSR(t, "c"), certificatesv1.CertificateApproved, ReasonAttestationVerified),
			matcher: &fakeMatcher{err: &checks.Failure{Reason: "MachineNotFound", Message: "none"}}, writes: []string{"update/status"}, failed: true},

		{name: "evidence denied", csr: goodCSR(t, "c"), verifier: &fakeVerifier{err: attestor.Deny("BadQuote", "no")},
			writes: []string{"update/approval"}, denied: "BadQuote"},
		{name: "verifier transient error: retried, not denied", csr: goodCSR(t, "c"), verifier: &fakeVerifier{err: errors.New("JWKS unreachable")}, wantErr: true},
		{name: "verifier returns nothing: retried", csr: goodCSR(t, "c"), verifier: &fakeVerifier{res: &attestor.Result{}}, wantErr: true},
		{name: "attested provider ID differs", csr: goodCSR(t, "c"), verifier: &fakeVerifier{res: &attestor.Result{Identity: &attestor.Identity{ProviderID: "test:///other"}}},
			writes: []string{"update/approval"}, denied: ReasonAttestedProviderIDMismatch},
		{name: "Machine provider ID differs", csr: goodCSR(t, "c"), matcher: &fakeMatcher{m: &Machine{Namespace: "ns", Name: node, ProviderID: "test:///other"}},
			writes: []string{"update/approval"}, denied: ReasonAttestedProviderIDMismatch},
		{name: "challenge is written, nothing decided", csr: goodCSR(t, "c"), verifier: &fakeVerifier{res: &attestor.Result{Challenge: []byte("nonce")}},
			writes: []string{"patch/"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			if tt.matcher == nil {
				tt.matcher = &fakeMatcher{m: theMachine}
			}
			if tt.verifier == nil {
				tt.verifier = &fakeVerifier{res: verified}
			}
			if tt.authorized == nil {
				tt.authorized = []string{insecure.Name}
			}
			e := newEnv(t, tt.matcher, tt.verifier, tt.authorized, tt.csr)
			err := e.c.sync(ctx, tt.csr.Name)
			if (err != nil) != tt.wantErr {
				t.Fatalf("sync() error = %v, wantErr %v", err, tt.wantErr)
			}
			if got := e.writes(); !equal(got, tt.writes) {
				t.Fatalf("writes = %v, want %v", got, tt.writes)
			}
			got := e.csr(t, tt.csr.Name)
			d := findCondition(got, certificatesv1.CertificateDenied)
			switch {
			case tt.denied != "":
				if d == nil || d.Reason != tt.denied || d.Message == "" {
					t.Errorf("Denied condition = %+v, want reason %s", d, tt.denied)
				}
			case tt.csr.Status.Conditions == nil && d != nil:
				t.Errorf("denied: %+v", d)
			}
			if want := tt.failed || hasCondition(tt.csr, certificatesv1.CertificateFailed); want != hasCondition(got, certificatesv1.CertificateFailed) {
				t.Errorf("Failed condition = %v, want %v", !want, want)
			}
			if tt.issued {
				if a := findCondition(got, certificatesv1.CertificateApproved); a == nil || a.Reason != ReasonAttestationVerified {
					t.Errorf("not approved by the signer: %+v", got.Status.Conditions)
				}
				b, _ := pem.Decode(got.Status.Certificate)
				if b == nil {
					t.Fatal("no certificate issued")
				}
				cert, err := x509.ParseCertificate(b.Bytes)
				if err != nil {
					t.Fatal(err)
				}
				if p, _ := attestor.ProviderIDFromExtensions(cert.Extensions); p != pid || cert.Subject.CommonName != "system:node:"+node {
					t.Errorf("issued %s with provider ID %q", cert.Subject, p)
				}
				if e.metrics[DecisionApproved+"/"+ReasonAttestationVerified] == 0 && findCondition(tt.csr, certificatesv1.CertificateApproved) == nil {
					t.Errorf("approval not counted: %v", e.metrics)
				}
			}
			if tt.denied != "" && e.metrics[DecisionDenied+"/"+tt.denied] != 1 {
				t.Errorf("denial not counted: %v", e.metrics)
			}
		})
	}
}

func TestSyncWritesAnnotations(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	e := newEnv(t, &fakeMatcher{m: theMachine}, &fakeVerifier{res: &attestor.Result{Challenge: []byte("nonce")}}, []string{insecure.Name}, goodCSR(t, "c"))
	if err := e.c.sync(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	if got := e.csr(t, "c").Annotations[attestor.AnnotationChallenge]; got != "nonce" {
		t.Errorf("challenge annotation = %q", got)
	}

	badVersion, _ := signertest.Request{NodeName: node, ProviderID: pid, Evidence: []byte(`{"version":"v9"}`)}.Build(t)
	e = newEnv(t, &fakeMatcher{m: theMachine}, &fakeVerifier{res: verified}, []string{insecure.Name}, signertest.CSR("c", badVersion))
	if err := e.c.sync(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	if got := e.csr(t, "c").Annotations[attestor.AnnotationSupportedVersions]; got != "v1" {
		t.Errorf("supported-versions annotation = %q", got)
	}
}

func TestLookupCSR(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	first := withCondition(goodCSR(t, "first"), certificatesv1.CertificateApproved, "X")
	v := &fakeVerifier{res: verified, lookup: "first"}
	e := newEnv(t, &fakeMatcher{m: theMachine}, v, []string{insecure.Name}, goodCSR(t, "second"), first)
	if err := e.c.sync(ctx, "second"); err != nil {
		t.Fatal(err)
	}
	if v.lookupErr != nil || v.lookedUp == nil || v.lookedUp.Name != "first" || !v.lookedUp.Approved || v.lookedUp.Username != first.Spec.Username {
		t.Errorf("LookupCSR(first) = %+v, %v", v.lookedUp, v.lookupErr)
	}

	v = &fakeVerifier{res: verified, lookup: "missing"}
	e = newEnv(t, &fakeMatcher{m: theMachine}, v, []string{insecure.Name}, goodCSR(t, "second"))
	if err := e.c.sync(ctx, "second"); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(v.lookupErr, attestor.ErrCSRNotFound) {
		t.Errorf("LookupCSR(missing) error = %v, want ErrCSRNotFound", v.lookupErr)
	}
}

// TestRunDecides runs the controller against the fake clientset's watch:
// a CSR created after start is signed, one of another signer is not.
func TestRunDecides(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	e := newEnv(t, &fakeMatcher{m: theMachine}, &fakeVerifier{res: verified}, []string{insecure.Name})
	done := make(chan error)
	go func() { done <- e.c.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	other := goodCSR(t, "other")
	other.Spec.SignerName = certificatesv1.KubeAPIServerClientSignerName
	for _, c := range []*certificatesv1.CertificateSigningRequest{goodCSR(t, "good"), other} {
		if _, err := e.client.CertificatesV1().CertificateSigningRequests().Create(ctx, c, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(e.csr(t, "good").Status.Certificate) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("CSR not signed within 10s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := e.csr(t, "other"); len(got.Status.Conditions) != 0 {
		t.Errorf("other signer's CSR touched: %+v", got.Status)
	}
	for _, a := range e.client.Actions() {
		if u, ok := a.(k8stesting.UpdateAction); ok && a.GetVerb() == "update" {
			if obj, ok := u.GetObject().(*certificatesv1.CertificateSigningRequest); ok && obj.Name == "other" {
				t.Errorf("wrote other signer's CSR: %s", a.GetVerb())
			}
		}
	}
}

func TestNewReportsEveryProblem(t *testing.T) {
	_, err := New(Config{})
	if err == nil {
		t.Fatal("New(Config{}) succeeded")
	}
	for _, want := range []string{"client", "verifier", "Machine", "signer"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("New() error %q does not mention %s", err, want)
		}
	}
}
