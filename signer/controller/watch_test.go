package controller

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestWatchesOnlyItsSignerNames: requests to other signers, however many
// and however large, never reach the controller's caches (the API server
// filters the watch by spec.signerName), and a decided request of ours is
// cached without its spec.request.
func TestWatchesOnlyItsSignerNames(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "watch")
	ctx := context.Background()
	api := cp.Client.CertificatesV1().CertificateSigningRequests()
	big := bytes.Repeat([]byte("x"), 200<<10)
	const others = 20
	for i := range others {
		req, _ := signertest.Request{NodeName: "other", ProviderID: "fake:///other"}.Build(t)
		csr := &certificatesv1.CertificateSigningRequest{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("other-%d", i), Annotations: map[string]string{"padding": string(big)}},
			Spec: certificatesv1.CertificateSigningRequestSpec{SignerName: "example.com/someone-else", Request: req,
				Usages: []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}},
		}
		if _, err := api.Create(ctx, csr, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	ours, _ := signertest.Request{NodeName: "node-1", ProviderID: pid}.Build(t)
	mine := &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{Name: "ours"},
		Spec: certificatesv1.CertificateSigningRequestSpec{SignerName: "cluster.x-k8s.io/kube-apiserver-client-kubelet-fake", Request: ours,
			Usages: []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}},
	}
	created, err := api.Create(ctx, mine, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	created.Status.Conditions = append(created.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
		Type: certificatesv1.CertificateDenied, Status: "True", Reason: "Test", Message: "decided before the controller starts"})
	if _, err := api.UpdateApproval(ctx, "ours", created, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	r := newRig(t, false, func(c *Config) { c.Client = cp.Client })
	deadline := time.Now().Add(30 * time.Second)
	for {
		var cached []any
		for _, inf := range r.c.informers {
			cached = append(cached, inf.GetStore().List()...)
		}
		if len(cached) == 1 {
			csr := cached[0].(*certificatesv1.CertificateSigningRequest)
			if csr.Name != "ours" || len(csr.Spec.Request) != 0 {
				t.Fatalf("cached %s with a %d-byte request, want ours without its request", csr.Name, len(csr.Spec.Request))
			}
			return
		}
		if len(cached) > 1 || time.Now().After(deadline) {
			t.Fatalf("the controller caches %d requests, want only its own one", len(cached))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
