package controller

import (
	"context"
	"crypto/x509"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	k8stesting "k8s.io/client-go/testing"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

// recorder is the revocation hook over the workload cluster's record, as
// both modes keep it; it notes whether a request it is told of was still
// undenied then.
type recorder struct {
	cs        kubernetes.Interface
	rv        *revoke.Revoker
	undenied  atomic.Int32 // denials told of while their request was undenied
	denyingOf atomic.Value // the last request told of
}

func (h *recorder) Issuing(ctx context.Context, node string, m *engine.Machine, cert *x509.Certificate, att revoke.Attestation) error {
	_, err := h.rv.Accept(ctx, node, revoke.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID}, cert, att)
	return err
}

func (h *recorder) Denying(ctx context.Context, node, request, reason string) error {
	h.denyingOf.Store(request)
	csr, err := h.cs.CertificatesV1().CertificateSigningRequests().Get(ctx, request, metav1.GetOptions{})
	if err != nil {
		return err
	}
	if !engine.HasCondition(csr, certificatesv1.CertificateDenied) {
		h.undenied.Add(1)
	}
	return h.rv.Deny(ctx, node, request, reason)
}

// TestDeniedRenewalRecorded: a denied renewal of a node's client
// certificate is recorded in revocation's record before the denial is
// written (the pod signer reads it after the workload cluster deleted the
// request); when the record cannot be written, the request stays undenied
// and is decided again; a bootstrap request's denial is not recorded.
func TestDeniedRenewalRecorded(t *testing.T) {
	var failWrites atomic.Bool
	var hook *recorder
	r := newRig(t, false, func(c *Config) {
		cs := c.Client.(kubernetes.Interface)
		hook = &recorder{cs: cs, rv: &revoke.Revoker{Client: cs, Lifetime: time.Hour}}
		c.Issuing = hook
	})
	r.cs.PrependReactor("*", "configmaps", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if failWrites.Load() && (a.GetVerb() == "update" || a.GetVerb() == "create") {
			return true, nil, errors.New("etcd is on fire")
		}
		return false, nil, nil
	})
	denied := func() []revoke.Denial {
		t.Helper()
		s, err := revoke.Read(r.ctx, r.cs.CoreV1())
		if err != nil {
			t.Fatal(err)
		}
		return s.Denied
	}

	// node-1 holds a certificate the controller issued.
	if _, err := hook.rv.Accept(r.ctx, "node-1", revoke.Machine{Namespace: theMachine.Namespace, Name: theMachine.Name, UID: theMachine.UID},
		&x509.Certificate{Raw: []byte("node-1's certificate"), NotAfter: time.Now().Add(time.Hour)}, revoke.Attestation{Provider: "fake"}); err != nil {
		t.Fatal(err)
	}
	// A renewal filed with node-1's credential that fails its checks (it
	// asks for another node's name).
	r.fileWith("renewal", signertest.Request{NodeName: "node-2", ProviderID: pid}, challengeEvidence{Version: "v1", ProviderID: pid},
		func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Username, c.Spec.Groups = attestor.NodeUserPrefix+"node-1", []string{attestor.NodesGroup, "system:authenticated"}
		})

	failWrites.Store(true)
	for range 2 {
		if _, err := r.sync("renewal"); err == nil || !strings.Contains(err.Error(), "not recorded") {
			t.Fatalf("sync with the record unwritable = %v, want a retry", err)
		}
	}
	if got := cond(r.get("renewal")); got != "pending" {
		t.Fatalf("renewal %s without its record, want pending", got)
	}
	failWrites.Store(false)
	if _, err := r.sync("renewal"); err != nil {
		t.Fatal(err)
	}
	got := r.get("renewal")
	if !strings.HasPrefix(cond(got), "Denied/") {
		t.Fatalf("renewal %s, want Denied", cond(got))
	}
	reason := engine.FindCondition(got, certificatesv1.CertificateDenied).Reason
	if d := denied(); len(d) != 1 || d[0].Node != "node-1" || d[0].Request != "renewal" || d[0].Reason != reason {
		t.Fatalf("record holds denials %+v, want node-1's renewal denied %s", d, reason)
	}
	if n := hook.undenied.Load(); n != 3 {
		t.Errorf("the hook was told of the denial %d times before it was written, want 3 (two failed, one written)", n)
	}

	// A request filed with a bootstrap token is not a renewal: its denial
	// is not recorded.
	r.fileWith("join", signertest.Request{NodeName: "node-1", ProviderID: pid}, challengeEvidence{Version: "v1", ProviderID: pid},
		func(c *certificatesv1.CertificateSigningRequest) {
			c.Spec.Usages = []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth}
		})
	if _, err := r.sync("join"); err != nil {
		t.Fatal(err)
	}
	if got := cond(r.get("join")); !strings.HasPrefix(got, "Denied/") {
		t.Fatalf("bootstrap request %s, want Denied", got)
	}
	if req := hook.denyingOf.Load(); req != "renewal" {
		t.Errorf("the hook was told of the denial of %v", req)
	}
}
