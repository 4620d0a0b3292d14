package controller

import (
	"bytes"
	"fmt"
	"maps"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
)

// hugeMetadata gives csr as much metadata as the API server accepts of a
// requester: 250 KiB of annotations, 4,000 labels, 2,000 finalizers.
func hugeMetadata(csr *certificatesv1.CertificateSigningRequest) {
	if csr.Annotations == nil {
		csr.Annotations = map[string]string{}
	}
	for i := range 250 {
		csr.Annotations[fmt.Sprintf("example.com/padding-%03d", i)] = strings.Repeat("a", 1000)
	}
	csr.Labels = map[string]string{}
	for i := range 4000 {
		csr.Labels[fmt.Sprintf("example.com/label-%04d", i)] = fmt.Sprintf("value-%04d", i)
	}
	for i := range 2000 {
		csr.Finalizers = append(csr.Finalizers, fmt.Sprintf("example.com/finalizer-%04d", i))
	}
}

// TestForgetUnread: what a requester writes on its request beyond what the
// signer reads is not cached, and what the signer reads is cached as
// written (or cut just past the size it reads, so that the request is
// denied for its size).
func TestForgetUnread(t *testing.T) {
	req, _ := signertest.Request{NodeName: "node-1", ProviderID: pid}.Build(t)
	created := metav1.Now()
	deleting := metav1.Now()
	base := func() *certificatesv1.CertificateSigningRequest {
		csr := &certificatesv1.CertificateSigningRequest{
			ObjectMeta: metav1.ObjectMeta{
				Name: "csr-1", GenerateName: strings.Repeat("g", 200), UID: "uid-1", ResourceVersion: "42", Generation: 3,
				CreationTimestamp: created, DeletionTimestamp: &deleting,
				Annotations: map[string]string{
					attestor.AnnotationChallenge:         "challenge",
					attestor.AnnotationChallengeSeal:     "v1.1.mac",
					attestor.AnnotationSupportedVersions: "v1,v2",
					attestor.AnnotationEndorsementKey:    strings.Repeat("e", attestor.MaxAnnotationSize+100),
				},
				OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "ConfigMap", Name: "x", UID: "u"}},
				ManagedFields:   []metav1.ManagedFieldsEntry{{Manager: "kubectl", FieldsV1: metav1.NewFieldsV1(strings.Repeat("{}", 1000))}},
			},
			Spec: certificatesv1.CertificateSigningRequestSpec{
				SignerName: attestor.ClientSignerName("fake"), Username: "system:bootstrap:abcdef", UID: "user-uid",
				Groups: []string{attestor.BootstrappersGroup}, Usages: signertest.ClientUsages, Request: req,
			},
		}
		hugeMetadata(csr)
		return csr
	}
	const bound = 24 << 10 // the kept annotations, the request and the rest

	t.Run("pending", func(t *testing.T) {
		in := base()
		before := in.Size()
		out, err := forgetUnread(in)
		if err != nil {
			t.Fatal(err)
		}
		csr := out.(*certificatesv1.CertificateSigningRequest)
		if len(csr.Labels) != 0 || len(csr.Finalizers) != 0 || len(csr.OwnerReferences) != 0 || len(csr.ManagedFields) != 0 || csr.GenerateName != "" {
			t.Errorf("cached %d labels, %d finalizers, %d owner references, %d managed fields, generateName %q; want none",
				len(csr.Labels), len(csr.Finalizers), len(csr.OwnerReferences), len(csr.ManagedFields), csr.GenerateName)
		}
		want := map[string]int{
			attestor.AnnotationChallenge:         len("challenge"),
			attestor.AnnotationChallengeSeal:     len("v1.1.mac"),
			attestor.AnnotationSupportedVersions: len("v1,v2"),
			attestor.AnnotationEndorsementKey:    attestor.MaxAnnotationSize + 1,
			annotationMetadataCut:                len("true"),
		}
		if len(csr.Annotations) != len(want) {
			t.Errorf("cached %d annotations, want the %d the signer reads and the cut's mark", len(csr.Annotations), len(want))
		}
		if updateBody(csr) != nil {
			t.Error("an update can be built from a copy whose metadata the cache cut: it would write the requester's metadata away")
		}
		for k, n := range want {
			if len(csr.Annotations[k]) != n {
				t.Errorf("annotation %s cached with %d bytes, want %d", k, len(csr.Annotations[k]), n)
			}
		}
		if csr.Annotations[attestor.AnnotationChallengeSeal] != "v1.1.mac" {
			t.Errorf("the seal was cached as %q", csr.Annotations[attestor.AnnotationChallengeSeal])
		}
		if csr.Name != "csr-1" || csr.UID != types.UID("uid-1") || csr.ResourceVersion != "42" || !csr.CreationTimestamp.Equal(&created) || csr.DeletionTimestamp == nil {
			t.Errorf("identity and version not kept: %+v", csr.ObjectMeta)
		}
		if !bytes.Equal(csr.Spec.Request, req) || csr.Spec.Username != "system:bootstrap:abcdef" || csr.Spec.SignerName != attestor.ClientSignerName("fake") {
			t.Errorf("the spec was changed: %+v", csr.Spec)
		}
		if after := csr.Size(); after > bound {
			t.Errorf("a pending request with huge metadata is cached with %d bytes (%d as filed), want at most %d", after, before, bound)
		} else {
			t.Logf("a pending request with huge metadata: %d bytes as filed, %d cached", before, after)
		}
	})

	t.Run("decided", func(t *testing.T) {
		in := base()
		in.Status.Conditions = []certificatesv1.CertificateSigningRequestCondition{{Type: certificatesv1.CertificateDenied, Status: corev1.ConditionTrue, Reason: "X"}}
		out, _ := forgetUnread(in)
		csr := out.(*certificatesv1.CertificateSigningRequest)
		if csr.Spec.Request != nil || len(csr.Labels) != 0 || len(csr.Finalizers) != 0 {
			t.Errorf("a decided request cached with %d request bytes, %d labels, %d finalizers; want none", len(csr.Spec.Request), len(csr.Labels), len(csr.Finalizers))
		}
		if len(csr.Status.Conditions) != 1 {
			t.Errorf("conditions not kept: %+v", csr.Status)
		}
	})

	t.Run("oversized request", func(t *testing.T) {
		in := base()
		in.Spec.Request = bytes.Repeat([]byte("x"), 3<<20)
		decoded := in.Spec.Request
		out, _ := forgetUnread(in)
		csr := out.(*certificatesv1.CertificateSigningRequest)
		if n := len(csr.Spec.Request); n != attestor.MaxRequestSize+1 {
			t.Errorf("an oversized request is cached with %d bytes, want %d", n, attestor.MaxRequestSize+1)
		}
		// A cut that shares the decoded array keeps all 3 MiB of it alive.
		if &csr.Spec.Request[0] == &decoded[0] {
			t.Error("the cached request shares the decoded request's array")
		}
	})

	t.Run("no annotations of the signer's", func(t *testing.T) {
		in := base()
		for _, k := range attestor.RequestAnnotations() {
			delete(in.Annotations, k)
		}
		out, _ := forgetUnread(in)
		if a := out.(*certificatesv1.CertificateSigningRequest).Annotations; len(a) != 1 || a[annotationMetadataCut] == "" {
			t.Errorf("cached annotations %v, want only the cut's mark", a)
		}
	})

	// A request with no metadata beyond what the signer reads, as the
	// node agent files them: cached without a mark, and written by
	// updates that carry its metadata as filed.
	for _, annotated := range []bool{false, true} {
		t.Run(fmt.Sprintf("nothing to cut, annotated %v", annotated), func(t *testing.T) {
			in := &certificatesv1.CertificateSigningRequest{
				ObjectMeta: metav1.ObjectMeta{Name: "csr-2", UID: "uid-2", ResourceVersion: "43",
					ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubelet-authenticator"}}},
				Spec: certificatesv1.CertificateSigningRequestSpec{SignerName: attestor.ClientSignerName("fake"), Request: req},
			}
			if annotated {
				in.Annotations = map[string]string{attestor.AnnotationSupportedVersions: "v1,v2"}
			}
			filed := maps.Clone(in.Annotations)
			out, _ := forgetUnread(in)
			csr := out.(*certificatesv1.CertificateSigningRequest)
			if !maps.Equal(csr.Annotations, filed) {
				t.Errorf("cached annotations %v, want %v", csr.Annotations, filed)
			}
			body := updateBody(csr)
			if body == nil {
				t.Fatal("no update from a copy that holds all of the request's metadata")
			}
			if body.Name != "csr-2" || body.UID != "uid-2" || body.ResourceVersion != "43" || !maps.Equal(body.Annotations, filed) ||
				body.Spec.Request != nil || body.ManagedFields != nil {
				t.Errorf("update body %+v: want the request's name, UID, version and annotations, no spec, no managed fields", body)
			}
		})
	}
}

// TestDispatch: every queued request is decided once, never more than
// Workers at a time; a worker left idle ends within the linger, so that an
// idle workload cluster runs none; and a shut-down queue ends every worker
// at once, however long the linger.
func TestDispatch(t *testing.T) {
	for _, linger := range []time.Duration{20 * time.Millisecond, time.Hour} {
		t.Run(linger.String(), func(t *testing.T) {
			before := runtime.NumGoroutine()
			q := newRetryQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[key](time.Millisecond, time.Second))
			const workers, n = 3, 200
			var mu sync.Mutex
			running, most := 0, 0
			decided := map[key]int{}
			done := make(chan struct{})
			go func() {
				defer close(done)
				dispatch(q, workers, linger, func(k key) {
					defer q.Done(k)
					mu.Lock()
					running++
					most = max(most, running)
					decided[k]++
					mu.Unlock()
					time.Sleep(100 * time.Microsecond)
					mu.Lock()
					running--
					mu.Unlock()
				})
			}()
			for i := range n {
				q.Add(key{signer: "s", name: strconv.Itoa(i)})
			}
			waitFor(t, func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(decided) == n
			})
			mu.Lock()
			for k, times := range decided {
				if times != 1 {
					t.Errorf("%s decided %d times", k.name, times)
				}
			}
			if most > workers {
				t.Errorf("%d requests decided at once, want at most %d", most, workers)
			}
			mu.Unlock()
			// The dispatcher waits for the queue: its goroutine and no worker.
			if linger < time.Second {
				waitFor(t, func() bool { return runtime.NumGoroutine() <= before+1 })
			}
			q.ShutDown()
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				t.Fatal("dispatch did not end when the queue was shut down")
			}
			waitFor(t, func() bool { return runtime.NumGoroutine() <= before })
		})
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines; condition not met within 5s", runtime.NumGoroutine())
		}
	}
}

// BenchmarkDispatch decides requests whose work grows the stack as a
// decision does (TLS, HTTP/2, ASN.1 and ECDSA calls), one worker at a
// time: on a fresh goroutine each (no linger) or on workers that wait for
// the next one.
func BenchmarkDispatch(b *testing.B) {
	for _, bc := range []struct {
		name   string
		linger time.Duration
	}{{"fresh", 0}, {"linger", workerLinger}} {
		b.Run(bc.name, func(b *testing.B) {
			q := newRetryQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[key](time.Millisecond, time.Second))
			for i := range b.N {
				q.Add(key{signer: "s", name: strconv.Itoa(i)})
			}
			q.ShutDown()
			b.ResetTimer()
			dispatch(q, 1, bc.linger, func(k key) {
				deepStack(64)
				q.Done(k)
			})
		})
	}
}

// deepStack uses about depth KiB of stack.
//
//go:noinline
func deepStack(depth int) byte {
	var pad [1024]byte
	pad[depth%len(pad)] = byte(depth)
	if depth == 0 {
		return pad[0]
	}
	return deepStack(depth-1) + pad[depth%len(pad)]
}
