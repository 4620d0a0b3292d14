package engine

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"

	certificatesv1 "k8s.io/api/certificates/v1"
	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/client-go/kubernetes/fake"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
)

// TestDecidePod: the pod certificate decision for each kind of request
// and record, as a value: who asked (the credential the admission policy
// stamped), whether that credential is the node's current attested one,
// its Machine, and the boot policy it was attested under.
func TestDecidePod(t *testing.T) {
	const fp, newer = "aa", "bb"
	bootPolicy := []byte("pcrs: [0, 7]\n")
	sum := sha256.Sum256(bootPolicy)
	policyDigest := hex.EncodeToString(sum[:])
	oldDigest := strings.Repeat("0", 64)
	machine := &Machine{Namespace: "ns", Name: testNode, UID: "m-uid", ProviderID: testPID}
	cred := func(sha string, att *revoke.Attestation) revoke.Credential {
		return revoke.Credential{SHA256: sha, Node: testNode, Machine: revoke.Machine{Namespace: "ns", Name: testNode, UID: "m-uid"},
			NotAfter: testNow.Add(24 * time.Hour), Attested: att}
	}
	tpmUnder := func(digest string) *revoke.Attestation {
		return &revoke.Attestation{Provider: "tpm", PolicySHA256: digest, At: testNow.Add(-time.Hour)}
	}

	cases := []struct {
		name       string
		stamp      string // the credential the admission policy recorded
		issued     []revoke.Credential
		policies   map[string][]byte
		machine    *Machine
		csrs       []*certificatesv1.CertificateSigningRequest // the node's own requests
		denied     []revoke.Denial                             // the record's denials
		want       Outcome
		wantReason string
	}{
		{name: "current attested certificate", stamp: fp, issued: []revoke.Credential{cred(fp, tpmUnder(""))}, want: Approve, wantReason: podcert.ReasonIssued},
		{name: "attested under today's boot policy", stamp: fp, policies: map[string][]byte{"tpm": bootPolicy},
			issued: []revoke.Credential{cred(fp, tpmUnder(policyDigest))}, want: Approve, wantReason: podcert.ReasonIssued},
		{name: "attested under another boot policy", stamp: fp, policies: map[string][]byte{"tpm": bootPolicy},
			issued: []revoke.Credential{cred(fp, tpmUnder(oldDigest))}, want: Retry},
		{name: "attested before the boot policy existed", stamp: fp, policies: map[string][]byte{"tpm": bootPolicy},
			issued: []revoke.Credential{cred(fp, tpmUnder(""))}, want: Retry},
		{name: "boot policy dropped since", stamp: fp, issued: []revoke.Credential{cred(fp, tpmUnder(oldDigest))}, want: Approve, wantReason: podcert.ReasonIssued},
		{name: "never attested", stamp: fp, issued: []revoke.Credential{cred(newer, tpmUnder(""))}, want: Deny, wantReason: podcert.ReasonNodeNotAttested},
		{name: "superseded certificate", stamp: fp, issued: []revoke.Credential{cred(fp, tpmUnder("")), cred(newer, tpmUnder(""))},
			want: Deny, wantReason: podcert.ReasonNodeSuperseded},
		{name: "not created with a certificate", stamp: "", issued: []revoke.Credential{cred(fp, tpmUnder(""))}, want: Deny,
			wantReason: podcert.ReasonNodeNotAttested},
		{name: "another Machine has the node name now", stamp: fp, issued: []revoke.Credential{cred(fp, tpmUnder(""))},
			machine: &Machine{Namespace: "ns", Name: testNode, UID: "other-uid", ProviderID: testPID}, want: Deny, wantReason: podcert.ReasonNodeNotAttested},
		{name: "recorded before attestations were kept", stamp: fp, issued: []revoke.Credential{cred(fp, nil)}, want: Retry},
		{name: "renewal denied since", stamp: fp, issued: []revoke.Credential{cred(fp, tpmUnder(""))},
			csrs: []*certificatesv1.CertificateSigningRequest{renewal(attestor.ClientSignerName("fake"), testNow.Add(-time.Minute))}, want: Retry},
		{name: "renewal denied before the current certificate", stamp: fp, issued: []revoke.Credential{cred(fp, tpmUnder(""))},
			csrs: []*certificatesv1.CertificateSigningRequest{renewal(attestor.ClientSignerName("fake"), testNow.Add(-2*time.Hour))}, want: Approve,
			wantReason: podcert.ReasonIssued},
		{name: "renewal denied, its request deleted since", stamp: fp, issued: []revoke.Credential{cred(fp, tpmUnder(""))},
			denied: []revoke.Denial{{Node: testNode, Request: "renewal", Reason: "SecureBootDisabled", At: testNow.Add(-2 * time.Minute)}}, want: Retry},
		{name: "another node's renewal denied", stamp: fp, issued: []revoke.Credential{cred(fp, tpmUnder(""))},
			denied: []revoke.Denial{{Node: "other", Request: "renewal", Reason: "SecureBootDisabled", At: testNow.Add(-2 * time.Minute)}}, want: Approve,
			wantReason: podcert.ReasonIssued},
		{name: "serving certificate denied since", stamp: fp, issued: []revoke.Credential{cred(fp, tpmUnder(""))},
			csrs: []*certificatesv1.CertificateSigningRequest{renewal(attestor.ServingSignerName("fake"), testNow.Add(-time.Minute))}, want: Approve,
			wantReason: podcert.ReasonIssued},
	}
	ca := podCA(t)
	pol, errs := podcert.NewPolicy(&v1alpha1.PodCertificatePolicy{TrustDomain: "wl.example",
		Allowed: []v1alpha1.PodCertificateServiceAccounts{{Namespace: "payments", ServiceAccounts: []string{"api"}}}}, field.NewPath("spec"))
	if len(errs) > 0 {
		t.Fatal(errs.ToAggregate())
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := c.machine
			if m == nil {
				m = machine
			}
			profiles := Profiles(ProfileSet{Verifiers: map[string]attestor.Verifier{"fake": &scripted{}}, Client: noSigner{}, Serving: noSigner{}})
			e, err := New(Config{Cluster: "ns/c", Profiles: profiles, Authorized: []string{"fake"}, Machines: oneMachine{m: m}, CSRs: nodeCSRs(c.csrs),
				Policies: c.policies, Clock: clocktesting.NewFakePassiveClock(testNow)})
			if err != nil {
				t.Fatal(err)
			}
			state := &revoke.State{Issued: c.issued, Denied: c.denied}
			d := e.DecidePod(context.Background(), podRequest(t, c.stamp), &PodSigner{
				SignerName: podcert.DefaultSignerName, Policy: pol, CA: ca, StampedSince: testNow.Add(-2 * time.Hour),
				Issued: func(context.Context, string, string) (*revoke.State, error) { return state, nil },
			})
			if d.Outcome != c.want {
				t.Fatalf("outcome %s (%s: %s; err %v), want %s", d.Outcome, d.Reason, d.Message, d.Err, c.want)
			}
			if c.wantReason != "" && d.Reason != c.wantReason {
				t.Errorf("reason %s (%s), want %s", d.Reason, d.Message, c.wantReason)
			}
			if c.want == Approve && d.PodCertificate == nil {
				t.Error("approved without a certificate")
			}
		})
	}
}

// podCA returns a pod CA valid around testNow.
func podCA(t *testing.T) *issue.CA {
	t.Helper()
	certPEM, keyPEM, err := issue.NewCA("pod CA", testNow.Add(-24*time.Hour), 365*24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := issue.LoadCA(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// podRequest is a request of ServiceAccount payments/api on testNode as
// kubelet 1.36 files it, created with the credential stamp (none when
// empty).
func podRequest(t *testing.T, stamp string) *certificatesv1beta1.PodCertificateRequest {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	stub, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
	if err != nil {
		t.Fatal(err)
	}
	pcr := &certificatesv1beta1.PodCertificateRequest{
		ObjectMeta: metav1.ObjectMeta{Namespace: "payments", Name: "req-1", CreationTimestamp: metav1.NewTime(testNow.Add(-time.Minute))},
		Spec: certificatesv1beta1.PodCertificateRequestSpec{
			SignerName: podcert.DefaultSignerName, PodName: "p", PodUID: "p-uid", ServiceAccountName: "api", ServiceAccountUID: "sa-uid",
			NodeName: types.NodeName(testNode), NodeUID: "n-uid", MaxExpirationSeconds: ptr.To(int32(86400)), StubPKCS10Request: stub,
		},
	}
	if stamp != "" {
		pcr.Annotations = map[string]string{podcert.AnnotationCreatorCredential: podcert.CredentialIDPrefix + stamp}
	}
	return pcr
}

// nodeCSRs is a lister that holds the given requests of the node.
type nodeCSRs []*certificatesv1.CertificateSigningRequest

func (n nodeCSRs) Get(signer, name string) (*certificatesv1.CertificateSigningRequest, error) {
	return noCSRs{}.Get(signer, name)
}

func (n nodeCSRs) Live(_ context.Context, signer, name string) (*certificatesv1.CertificateSigningRequest, error) {
	return noCSRs{}.Get(signer, name)
}

func (n nodeCSRs) ByRequester(username string) ([]*certificatesv1.CertificateSigningRequest, error) {
	var out []*certificatesv1.CertificateSigningRequest
	for _, csr := range n {
		if csr.Spec.Username == username {
			out = append(out, csr)
		}
	}
	return out, nil
}
func (nodeCSRs) Waiting(string, string) ([]*certificatesv1.CertificateSigningRequest, error) {
	return nil, nil
}

// renewal is a request of testNode to signer that this signer denied at.
func renewal(signer string, at time.Time) *certificatesv1.CertificateSigningRequest {
	csr := &certificatesv1.CertificateSigningRequest{ObjectMeta: metav1.ObjectMeta{Name: "renewal"}}
	csr.Spec.SignerName, csr.Spec.Username = signer, attestor.NodeUserPrefix+testNode
	csr.Status.Conditions = []certificatesv1.CertificateSigningRequestCondition{{Type: certificatesv1.CertificateDenied, Status: corev1.ConditionTrue,
		Reason: "SecureBootDisabled", LastUpdateTime: metav1.NewTime(at)}}
	return csr
}

// TestDecidePodAfterRecordedDenial: through revocation's record as the
// controller writes it, a node whose renewal was denied after its current
// certificate gets no pod certificates (retried) although the denied
// request is gone; once a certificate issued after the denial is recorded,
// the node's requests with it are issued.
func TestDecidePodAfterRecordedDenial(t *testing.T) {
	ctx := context.Background()
	clock := clocktesting.NewFakePassiveClock(testNow.Add(-time.Hour))
	rv := &revoke.Revoker{Client: fake.NewClientset(), Lifetime: 24 * time.Hour, Clock: clock}
	m := &Machine{Namespace: "ns", Name: testNode, UID: "m-uid", ProviderID: testPID}
	recordCert := func(raw string) string {
		t.Helper()
		cert := &x509.Certificate{Raw: []byte(raw), NotAfter: testNow.Add(24 * time.Hour)}
		if _, err := rv.Accept(ctx, testNode, revoke.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID}, cert, revoke.Attestation{Provider: "tpm"}); err != nil {
			t.Fatal(err)
		}
		return revoke.Fingerprint(cert)
	}
	ca := podCA(t)
	pol, errs := podcert.NewPolicy(&v1alpha1.PodCertificatePolicy{TrustDomain: "wl.example",
		Allowed: []v1alpha1.PodCertificateServiceAccounts{{Namespace: "payments", ServiceAccounts: []string{"api"}}}}, field.NewPath("spec"))
	if len(errs) > 0 {
		t.Fatal(errs.ToAggregate())
	}
	e, err := New(Config{Cluster: "ns/c", Authorized: []string{"fake"}, Machines: oneMachine{m: m}, CSRs: nodeCSRs(nil),
		Profiles: Profiles(ProfileSet{Verifiers: map[string]attestor.Verifier{"fake": &scripted{}}, Client: noSigner{}, Serving: noSigner{}}),
		Clock:    clocktesting.NewFakePassiveClock(testNow)})
	if err != nil {
		t.Fatal(err)
	}
	decide := func(fp string) *Decision {
		t.Helper()
		return e.DecidePod(ctx, podRequest(t, fp), &PodSigner{SignerName: podcert.DefaultSignerName, Policy: pol, CA: ca, StampedSince: testNow.Add(-2 * time.Hour),
			Issued: func(ctx context.Context, node, _ string) (*revoke.State, error) {
				return revoke.Read(ctx, rv.Client.CoreV1(), node)
			}})
	}

	current := recordCert("current")
	if d := decide(current); d.Outcome != Approve {
		t.Fatalf("before the denial: %s (%s), want Approve", d.Outcome, d.Err)
	}
	clock.SetTime(testNow.Add(-30 * time.Minute))
	if err := rv.Deny(ctx, testNode, "renewal", "SecureBootDisabled"); err != nil {
		t.Fatal(err)
	}
	d := decide(current)
	if d.Outcome != Retry || d.Err == nil || !strings.Contains(d.Err.Error(), "denied the renewal of its client certificate (renewal: SecureBootDisabled)") {
		t.Fatalf("after the denial, its request gone: %s (%v), want Retry for the denied renewal", d.Outcome, d.Err)
	}
	clock.SetTime(testNow.Add(-10 * time.Minute))
	newer := recordCert("newer")
	if d := decide(newer); d.Outcome != Approve {
		t.Fatalf("with a certificate issued after the denial: %s (%v), want Approve", d.Outcome, d.Err)
	}
	if d := decide(current); d.Outcome != Deny || d.Reason != podcert.ReasonNodeSuperseded {
		t.Fatalf("with the certificate from before the denial: %s %s, want Deny %s", d.Outcome, d.Reason, podcert.ReasonNodeSuperseded)
	}
}
