package tofu

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
)

const (
	ek1 = "tpm:ek-sha256:1111"
	ek2 = "tpm:ek-sha256:2222"
	// home is the controller's namespace.
	home = "kubelet-authenticator-system"
)

func scheme(t *testing.T) *runtime.Scheme {
	t.Helper()
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if err := clusterv1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	return s
}

func machine(ns, name, uid string) (*clusterv1.Machine, *engine.Machine) {
	return &clusterv1.Machine{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid)}},
		&engine.Machine{Namespace: ns, Name: name, UID: types.UID(uid)}
}

func newStore(c client.Client) *Store { return &Store{Namespace: home, Client: c, Reader: c} }

func wantReason(t *testing.T, err error, reason string) string {
	t.Helper()
	r, msg, ok := attestor.Denial(err)
	if !ok || r != reason {
		t.Fatalf("got %v, want a denial %s", err, reason)
	}
	return msg
}

func TestBind(t *testing.T) {
	ctx := context.Background()
	m1obj, m1 := machine("fleet", "m1", "uid-1")
	m2obj, m2 := machine("fleet", "m2", "uid-2")
	m3obj, m3 := machine("other-tenant", "m3", "uid-3")
	c := fake.NewClientBuilder().WithScheme(scheme(t)).WithObjects(m1obj, m2obj, m3obj).Build()
	s := newStore(c)

	if err := s.Bind(ctx, m1, ek1); err != nil {
		t.Fatalf("first use: %v", err)
	}
	var rec corev1.ConfigMap
	if err := c.Get(ctx, types.NamespacedName{Namespace: home, Name: Name(ek1)}, &rec); err != nil {
		t.Fatalf("no record in the controller's namespace: %v", err)
	}
	if rec.Data[KeyIdentity] != ek1 || rec.Data[KeyMachineNamespace] != "fleet" || rec.Data[KeyMachine] != "m1" ||
		rec.Labels[LabelMachineUID] != "uid-1" || len(rec.OwnerReferences) != 0 || len(Name(ek1)) > 253 {
		t.Errorf("record = %+v", rec)
	}
	var inFleet corev1.ConfigMapList
	if err := c.List(ctx, &inFleet, client.InNamespace("fleet")); err != nil || len(inFleet.Items) != 0 {
		t.Errorf("records in the Machine's namespace: %v %v", inFleet.Items, err)
	}

	// A fresh Store (a restarted controller) decides from the API alone.
	s = newStore(c)
	if err := s.Bind(ctx, m1, ek1); err != nil {
		t.Fatalf("same identity, same Machine (renewal): %v", err)
	}
	wantReason(t, s.Bind(ctx, m2, ek1), attestor.ReasonIdentityClaimedByOtherMachine)
	wantReason(t, s.Bind(ctx, m3, ek1), attestor.ReasonIdentityClaimedByOtherMachine)
	msg := wantReason(t, s.Bind(ctx, m1, ek2), attestor.ReasonMachineIdentityMismatch)
	if !strings.Contains(msg, Name(ek1)) {
		t.Errorf("the mismatch does not say which record to look at: %s", msg)
	}
	if err := s.Bind(ctx, m2, ek2); err != nil {
		t.Fatalf("another Machine's own identity: %v", err)
	}
}

// TestClaimedByOtherNamesNoOne: the denial a requester sees (it becomes the
// workload cluster's CSR condition and the Machine's Event) names neither
// the other Machine nor its namespace; the controller's log names both
// (issue 14.6).
func TestClaimedByOtherNamesNoOne(t *testing.T) {
	victimObj, victim := machine("tenant-a", "secret-project-m1", "uid-a")
	reqObj, req := machine("tenant-b", "m1", "uid-b")
	c := fake.NewClientBuilder().WithScheme(scheme(t)).WithObjects(victimObj, reqObj).Build()
	s := newStore(c)
	if err := s.Bind(context.Background(), victim, ek1); err != nil {
		t.Fatal(err)
	}
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.BufferLogs(true)))
	ctx := klog.NewContext(context.Background(), logger)
	msg := wantReason(t, s.Bind(ctx, req, ek1), attestor.ReasonIdentityClaimedByOtherMachine)
	for _, leak := range []string{"tenant-a", "secret-project-m1", "uid-a", Name(ek1)} {
		if strings.Contains(msg, leak) {
			t.Errorf("the denial names %q: %s", leak, msg)
		}
	}
	if msg != ClaimedByOtherMessage(DefaultAdministrator) {
		t.Errorf("message %q", msg)
	}
	logs := logger.GetSink().(ktesting.Underlier).GetBuffer().String()
	for _, want := range []string{"tenant-a/secret-project-m1", "tenant-b/m1", Name(ek1)} {
		if !strings.Contains(logs, want) {
			t.Errorf("the log does not name %q:\n%s", want, logs)
		}
	}
}

func TestBindStaleRecord(t *testing.T) {
	ctx := context.Background()
	// Machine m1 was deleted and recreated under the same name with the
	// same device; the cleaner has not removed the old record yet.
	newObj, newM := machine("fleet", "m1", "uid-new")
	_, oldM := machine("fleet", "m1", "uid-old")
	c := fake.NewClientBuilder().WithScheme(scheme(t)).WithObjects(newObj).Build()
	s := newStore(c)
	if err := s.Bind(ctx, oldM, ek1); err != nil {
		t.Fatal(err)
	}
	err := s.Bind(ctx, newM, ek1)
	if _, _, denied := attestor.Denial(err); err == nil || denied {
		t.Fatalf("stale record: got %v, want a transient error (retry)", err)
	}
	if err := s.Bind(ctx, newM, ek1); err != nil {
		t.Fatalf("after the stale record was removed: %v", err)
	}
}

func TestForgetAndSweep(t *testing.T) {
	ctx := context.Background()
	m1obj, m1 := machine("fleet", "m1", "uid-1")
	_, m2 := machine("fleet", "m2", "uid-2") // deleted while no one watched
	_, m3 := machine("fleet", "m3", "uid-3")
	c := fake.NewClientBuilder().WithScheme(scheme(t)).WithObjects(m1obj).Build()
	s := newStore(c)
	for _, b := range []struct {
		m  *engine.Machine
		id string
	}{{m1, ek1}, {m2, ek2}, {m3, "tpm:ek-sha256:3333"}} {
		// Bind reads the Machine only on a conflict: records of absent
		// Machines can be made here.
		if err := s.Bind(ctx, b.m, b.id); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Forget(ctx, m3.UID); err != nil {
		t.Fatal(err)
	}
	removed, err := s.Sweep(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 1 || removed[0] != Name(ek2) {
		t.Errorf("sweep removed %v, want m2's record", removed)
	}
	var left corev1.ConfigMapList
	if err := c.List(ctx, &left, client.InNamespace(home)); err != nil {
		t.Fatal(err)
	}
	if len(left.Items) != 1 || left.Items[0].Name != Name(ek1) {
		t.Errorf("records left: %v, want m1's only", left.Items)
	}
}

func TestBindNeedsNamespace(t *testing.T) {
	_, m1 := machine("fleet", "m1", "uid-1")
	c := fake.NewClientBuilder().WithScheme(scheme(t)).Build()
	err := (&Store{Client: c, Reader: c}).Bind(context.Background(), m1, ek1)
	if _, _, denied := attestor.Denial(err); err == nil || denied {
		t.Fatalf("got %v, want a configuration error", err)
	}
}

func TestBindTransientErrors(t *testing.T) {
	ctx := context.Background()
	_, m1 := machine("fleet", "m1", "uid-1")
	boom := errors.New("connection refused")
	c := fake.NewClientBuilder().WithScheme(scheme(t)).WithInterceptorFuncs(interceptor.Funcs{
		Create: func(context.Context, client.WithWatch, client.Object, ...client.CreateOption) error { return boom },
	}).Build()
	err := newStore(c).Bind(ctx, m1, ek1)
	if _, _, denied := attestor.Denial(err); !errors.Is(err, boom) || denied {
		t.Fatalf("got %v, want the transient error, not a denial", err)
	}
}

func TestBindLostRace(t *testing.T) {
	ctx := context.Background()
	m1obj, m1 := machine("fleet", "m1", "uid-1")
	m2obj, m2 := machine("other-tenant", "m2", "uid-2")
	base := fake.NewClientBuilder().WithScheme(scheme(t)).WithObjects(m1obj, m2obj).Build()
	// Another process creates m2's record of ek1 between our read and our
	// create.
	raced := false
	c := interceptor.NewClient(base, interceptor.Funcs{
		Create: func(ctx context.Context, cl client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
			if !raced {
				raced = true
				if err := newStore(base).Bind(ctx, m2, ek1); err != nil {
					t.Fatal(err)
				}
			}
			return cl.Create(ctx, obj, opts...)
		},
	})
	wantReason(t, newStore(c).Bind(ctx, m1, ek1), attestor.ReasonIdentityClaimedByOtherMachine)
}

// TestBindMachinesAtOnce: the first joins of a fleet are recorded at once,
// not one Machine after the other (the record of one Machine is read while
// another Machine's read has not returned), while two first uses of one
// Machine stay one after the other. (uid-1 and uid-2 hash to different
// stripes of the lock; Machines sharing a stripe wait for each other.)
func TestBindMachinesAtOnce(t *testing.T) {
	ctx := context.Background()
	m1obj, m1 := machine("fleet", "m1", "uid-1")
	m2obj, m2 := machine("fleet", "m2", "uid-2")
	release := make(chan struct{})
	unblock := sync.OnceFunc(func() { close(release) })
	t.Cleanup(unblock)
	reading := make(chan struct{}, 2)
	c := fake.NewClientBuilder().WithScheme(scheme(t)).WithObjects(m1obj, m2obj).
		WithInterceptorFuncs(interceptor.Funcs{Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
			if key.Name == Name(ek1) {
				reading <- struct{}{}
				<-release // m1's read of its record hangs until m2 is bound
			}
			return c.Get(ctx, key, obj, opts...)
		}}).Build()
	s := newStore(c)
	done := make(chan error, 1)
	go func() { done <- s.Bind(ctx, m1, ek1) }()
	<-reading
	bound := make(chan error, 1)
	go func() { bound <- s.Bind(ctx, m2, ek2) }()
	select {
	case err := <-bound:
		if err != nil {
			t.Fatalf("Machine m2: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Machine m2's first use waited for Machine m1's")
	}
	unblock()
	if err := <-done; err != nil {
		t.Fatalf("Machine m1: %v", err)
	}

	// One Machine, two identities at once: one record stands.
	_, m3 := machine("fleet", "m3", "uid-3")
	errs := make(chan error, 2)
	for _, id := range []string{"tpm:ek-sha256:3333", "tpm:ek-sha256:4444"} {
		go func() { errs <- s.Bind(ctx, m3, id) }()
	}
	denied := 0
	for range 2 {
		if err := <-errs; err != nil {
			wantReason(t, err, attestor.ReasonMachineIdentityMismatch)
			denied++
		}
	}
	if denied != 1 {
		t.Errorf("two identities of one Machine at once: %d denied, want 1", denied)
	}
}
