package controller

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

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
		for _, store := range r.c.stores {
			for _, obj := range store.List() {
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
	store := r.c.stores[signer]
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

// TestRelistAfterWatchRefused: when the API server refuses to resume a
// watch because its watch cache started over past the informer's resource
// version (which a loaded API server does when its own watch of etcd
// fails), the informer lists again, in pages, and sees the requests filed
// since. Its relist must ask for a state at least as new as the one it
// had: a paged list at that exact old resource version comes back as old,
// its watch is refused again, and a new request is never seen.
func TestRelistAfterWatchRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	cp := harness.StartControlPlane(t, "relist")
	ctx := context.Background()
	api := cp.Client.CertificatesV1().CertificateSigningRequests()
	reset := &watchCacheReset{}
	cfg := rest.CopyConfig(cp.AdminConfig)
	cfg.Wrap(reset.wrap)
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	signer := attestor.ClientSignerName("fake")
	file := func(name string) {
		t.Helper()
		req, _ := signertest.Request{NodeName: name, ProviderID: pid}.Build(t)
		csr := signertest.CSR(name, req)
		csr.Spec.SignerName = signer
		if _, err := api.Create(ctx, csr, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 5 {
		file(fmt.Sprintf("before-%d", i))
	}
	r := newRig(t, false, func(c *Config) { c.Client = cs; c.ListPageSize = 2 })
	store := r.c.stores[signer]
	cached := func(name string) bool {
		_, ok, _ := store.GetByKey(name)
		return ok
	}
	for i := range 5 {
		if name := fmt.Sprintf("before-%d", i); !cached(name) {
			t.Fatalf("%s is not cached after the informer synced", name)
		}
	}

	// The API server's watch cache starts over at a resource version past
	// the informer's (a write elsewhere moved it on): the informer's watch
	// ends, and resuming it is refused. (A watch that ends within its first
	// second is listed again at once by client-go, which would not resume
	// it: let the watch run a little first. It starts after the list, later
	// still on a loaded machine.)
	deadline := time.Now().Add(30 * time.Second)
	for reset.watchingFor() < 2*time.Second {
		if time.Now().After(deadline) {
			t.Fatal("the informer has not watched for 2 s, 30 s after it synced")
		}
		time.Sleep(50 * time.Millisecond)
	}
	moved, err := cp.Client.CoreV1().ConfigMaps("default").Create(ctx,
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "elsewhere"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	reset.startOver(t, moved.ResourceVersion)
	file("after")
	deadline = time.Now().Add(30 * time.Second)
	for !cached("after") {
		if time.Now().After(deadline) {
			t.Fatalf("a request filed after the watch was refused is not cached 30 s later (watches refused: %d)", reset.refused.Load())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if reset.refused.Load() == 0 {
		t.Fatal("no watch was refused: the test did not exercise a relist")
	}
	for i := range 5 {
		if name := fmt.Sprintf("before-%d", i); !cached(name) {
			t.Errorf("%s is no longer cached after the relist", name)
		}
	}
}

// watchCacheReset stands for an API server whose watch cache started over:
// it ends the watches under way and refuses (410 Gone, as kube-apiserver
// does) every watch from a resource version older than the new start.
type watchCacheReset struct {
	mu      sync.Mutex
	floor   uint64
	cancels []context.CancelFunc
	started time.Time // when the latest watch let through started
	refused atomic.Int32
}

// watchingFor is how long the latest watch let through has run; zero
// before any.
func (w *watchCacheReset) watchingFor() time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.started.IsZero() {
		return 0
	}
	return time.Since(w.started)
}

func (w *watchCacheReset) startOver(t *testing.T, rv string) {
	floor, err := strconv.ParseUint(rv, 10, 64)
	if err != nil {
		t.Fatalf("resource version %q: %v", rv, err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.floor = floor
	for _, cancel := range w.cancels {
		cancel()
	}
	w.cancels = nil
}

func (w *watchCacheReset) wrap(next http.RoundTripper) http.RoundTripper {
	return roundTripper(func(req *http.Request) (*http.Response, error) {
		q := req.URL.Query()
		if q.Get("watch") != "true" {
			return next.RoundTrip(req)
		}
		rv, _ := strconv.ParseUint(q.Get("resourceVersion"), 10, 64)
		w.mu.Lock()
		floor := w.floor
		w.mu.Unlock()
		if rv < floor {
			w.refused.Add(1)
			body := fmt.Sprintf(`{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: %d (%d)","reason":"Expired","code":410}`, rv, floor)
			return &http.Response{StatusCode: http.StatusGone, Header: http.Header{"Content-Type": []string{"application/json"}},
				Body: io.NopCloser(strings.NewReader(body)), ContentLength: int64(len(body)), Request: req}, nil
		}
		ctx, cancel := context.WithCancel(req.Context())
		w.mu.Lock()
		w.cancels = append(w.cancels, cancel)
		w.started = time.Now()
		w.mu.Unlock()
		resp, err := next.RoundTrip(req.WithContext(ctx))
		if err != nil {
			cancel()
			return nil, err
		}
		resp.Body = &endedBody{ReadCloser: resp.Body, ctx: ctx}
		return resp, nil
	})
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// endedBody is a watch that the server ended: its stream ends cleanly.
type endedBody struct {
	io.ReadCloser
	ctx context.Context
}

func (b *endedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil && b.ctx.Err() != nil {
		return n, io.EOF
	}
	return n, err
}
