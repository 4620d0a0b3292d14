package controller

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
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

	// A pending request of ours far larger than the signer reads.
	huge, _ := signertest.Request{NodeName: "node-1", ProviderID: pid, Trailer: bytes.Repeat([]byte("garbage\n"), 128<<10)}.Build(t)
	mine.ObjectMeta.Name, mine.Spec.Request = "ours-huge", huge
	if _, err := api.Create(ctx, mine, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	r := newRig(t, false, func(c *Config) { c.Client = cp.Client })
	deadline := time.Now().Add(30 * time.Second)
	for {
		cached := map[string]int{}
		for _, inf := range r.c.informers {
			for _, obj := range inf.GetStore().List() {
				csr := obj.(*certificatesv1.CertificateSigningRequest)
				cached[csr.Name] = len(csr.Spec.Request)
			}
		}
		if len(cached) == 2 {
			if n, ok := cached["ours"]; !ok || n != 0 {
				t.Errorf("the decided request is cached with %d request bytes (present: %t), want none", n, ok)
			}
			if n, ok := cached["ours-huge"]; !ok || n > attestor.MaxRequestSize+1 {
				t.Errorf("the oversized request is cached with %d request bytes (present: %t), want at most %d", n, ok, attestor.MaxRequestSize+1)
			}
			break
		}
		if len(cached) > 2 || time.Now().After(deadline) {
			t.Fatalf("the controller caches %v, want only its own two requests", cached)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The oversized request is denied for its size.
	if _, err := r.c.sync(r.ctx, key{signer: mine.Spec.SignerName, name: "ours-huge"}); err != nil {
		t.Fatal(err)
	}
	got, err := api.Get(ctx, "ours-huge", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if d := engine.FindCondition(got, certificatesv1.CertificateDenied); d == nil || !strings.Contains(d.Message, attestor.ReasonMalformedRequest+": spec.request does not follow the wire contract: request is larger than") {
		t.Errorf("oversized request: %+v, want denied %s for its size", got.Status.Conditions, attestor.ReasonMalformedRequest)
	}
}

// TestCachedMetadataBound: requests carrying all the metadata the API
// server lets a requester write (250 KiB of annotations, 4,000 labels,
// 2,000 finalizers) cost the controller's cache only what the signer reads
// of them, measured on the heap; and deciding them leaves their metadata,
// which the controller never cached, as the requester wrote it.
func TestCachedMetadataBound(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "metadata")
	ctx := context.Background()
	api := cp.Client.CertificatesV1().CertificateSigningRequests()
	const n = 20
	signer := attestor.ClientSignerName("fake")
	heap := func() uint64 {
		var m runtime.MemStats
		runtime.GC()
		runtime.GC()
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	// The controller watches before the requests come, and a few are
	// cached before the heap is read: what the others add to it is what
	// one more costs, not the controller's set-up or its watch's buffers
	// (which grow once to the largest event).
	r := newRig(t, false, func(c *Config) { c.Client = cp.Client })
	store := r.c.informers[signer].GetStore()
	filed := 0
	file := func(from, to int) {
		t.Helper()
		for i := from; i < to; i++ {
			req, _ := signertest.Request{NodeName: fmt.Sprintf("node-%d", i), ProviderID: pid}.Build(t)
			csr := signertest.CSR(fmt.Sprintf("huge-%02d", i), req)
			csr.Spec.SignerName = signer
			hugeMetadata(csr)
			filed = csr.Size()
			if _, err := api.Create(ctx, csr, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		deadline := time.Now().Add(30 * time.Second)
		for len(store.List()) < to {
			if time.Now().After(deadline) {
				t.Fatalf("the controller caches %d of the %d requests", len(store.List()), to)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	const warm = 4
	file(0, warm)
	before := heap()
	file(warm, warm+n)
	objs := store.List()
	after := heap()
	largest := 0
	for _, o := range objs {
		largest = max(largest, o.(*certificatesv1.CertificateSigningRequest).Size())
	}
	perRequest := (int64(after) - int64(before)) / n
	t.Logf("%d requests of %d bytes as filed: %d bytes of heap each in the controller (largest cached object %d bytes)", n, filed, perRequest, largest)
	const bound = 32 << 10
	if perRequest > bound || largest > bound {
		t.Errorf("a request with huge metadata costs the controller %d bytes of heap (largest cached object %d bytes), want at most %d", perRequest, largest, bound)
	}
	runtime.KeepAlive(r)

	// Deciding them writes from the cached copies: what was not cached is
	// not written away.
	for _, o := range objs {
		name := o.(*certificatesv1.CertificateSigningRequest).Name
		if _, err := r.c.sync(r.ctx, key{signer: signer, name: name}); err != nil {
			t.Fatal(err)
		}
		got, err := api.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !engine.Decided(got) {
			t.Errorf("%s not decided: %+v", name, got.Status)
		}
		if len(got.Labels) != 4000 || len(got.Finalizers) != 2000 || len(got.Annotations) != 250 {
			t.Errorf("%s has %d labels, %d finalizers, %d annotations after the decision, want them as filed (4000, 2000, 250)", name, len(got.Labels), len(got.Finalizers), len(got.Annotations))
		}
	}
}
