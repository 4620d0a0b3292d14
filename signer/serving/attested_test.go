package serving

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/signer/checks"
	"sigs.k8s.io/kubelet-authenticator/signer/controller"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

type oneMachine struct{ m *Machine }

func (o oneMachine) ForNode(context.Context, string) (*Machine, error)       { return o.m, nil }
func (o oneMachine) Match(context.Context, string, string) (*Machine, error) { return o.m, nil }

// stableVerifier proves the claimed provider ID and a fixed stable identity,
// as the TPM and cloud verifiers do.
type stableVerifier struct{}

func (stableVerifier) Versions() []string { return []string{insecure.VersionV1} }
func (stableVerifier) Verify(_ context.Context, in *attestor.VerifyRequest) (*attestor.Result, error) {
	return &attestor.Result{Identity: &attestor.Identity{ProviderID: in.ProviderID, Stable: "test:hw-1"}}, nil
}

type binder struct {
	err   error
	bound []string
}

func (b *binder) Bind(_ context.Context, m *controller.Machine, identity string) error {
	b.bound = append(b.bound, m.Namespace+"/"+m.Name+"="+identity)
	return b.err
}

// TestAttestedServingAppliesTrustOnFirstUse: a serving certificate for a
// Machine's addresses goes only to the identity bound to that Machine, as a
// client certificate does.
func TestAttestedServingAppliesTrustOnFirstUse(t *testing.T) {
	for name, tc := range map[string]struct {
		bindErr    error
		wantReason string
		wantCert   bool
	}{
		"first use binds and signs":    {nil, ReasonAttestedServingVerified, true},
		"identity of another Machine":  {&checks.Failure{Reason: "IdentityClaimedByOtherMachine", Message: "recorded for ns/worker-1"}, "IdentityClaimedByOtherMachine", false},
		"record store down is retried": {errors.New("apiserver unavailable"), "", false},
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			req, _ := signertest.Request{NodeName: "worker-0", ProviderID: "test:///worker-0", DNSNames: []string{"worker-0"}}.Build(t)
			csr := signertest.CSR("serve", req)
			csr.Spec.SignerName = attestor.ServingSignerName(insecure.Name)
			csr.Spec.Usages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth}
			csr.Spec.Username, csr.Spec.Groups = "system:node:worker-0", []string{"system:nodes", "system:authenticated"}
			client := fake.NewSimpleClientset(csr)
			certPEM, keyPEM, err := NewCA("serving", time.Now(), time.Hour)
			if err != nil {
				t.Fatal(err)
			}
			ca, err := issue.LoadCA(certPEM, keyPEM)
			if err != nil {
				t.Fatal(err)
			}
			b := &binder{err: tc.bindErr}
			s := &AttestedSigner{
				Client: client, Cluster: "ns/wl", Provider: insecure.Name, Verifier: stableVerifier{}, Authorized: []string{insecure.Name},
				Machines: oneMachine{&Machine{Namespace: "ns", Name: "worker-0", UID: "uid-0", ProviderID: "test:///worker-0", DNSNames: []string{"worker-0"}, IPs: []net.IP{}}},
				CA:       ca, MaxLifetime: time.Hour, Identities: b,
			}
			err = s.Sync(ctx, csr)
			if len(b.bound) != 1 || b.bound[0] != "ns/worker-0=test:hw-1" {
				t.Fatalf("bound %v, want the Machine bound to the proven identity", b.bound)
			}
			got, _ := client.CertificatesV1().CertificateSigningRequests().Get(ctx, "serve", metav1.GetOptions{})
			if tc.wantReason == "" {
				if err == nil || len(got.Status.Conditions) != 0 {
					t.Fatalf("transient error: err=%v conditions=%v; want a retry and no decision", err, got.Status.Conditions)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(got.Status.Conditions) == 0 || got.Status.Conditions[0].Reason != tc.wantReason {
				t.Fatalf("conditions %v, want reason %s", got.Status.Conditions, tc.wantReason)
			}
			if (len(got.Status.Certificate) > 0) != tc.wantCert {
				t.Fatalf("certificate issued: %v, want %v", len(got.Status.Certificate) > 0, tc.wantCert)
			}
		})
	}
}
