package tofu

import (
	"context"
	"errors"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
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

func wantReason(t *testing.T, err error, reason string) {
	t.Helper()
	r, msg, ok := attestor.Denial(err)
	if !ok || r != reason {
		t.Fatalf("got %v, want a denial %s", err, reason)
	}
	if !strings.Contains(msg, "ConfigMap") {
		t.Errorf("the message does not say which record to look at: %s", msg)
	}
}

func TestBind(t *testing.T) {
	ctx := context.Background()
	m1obj, m1 := machine("fleet", "m1", "uid-1")
	m2obj, m2 := machine("fleet", "m2", "uid-2")
	m3obj, m3 := machine("other-tenant", "m3", "uid-3")
	c := fake.NewClientBuilder().WithScheme(scheme(t)).WithObjects(m1obj, m2obj, m3obj).Build()
	s := &Store{Client: c, Reader: c}

	if err := s.Bind(ctx, m1, ek1); err != nil {
		t.Fatalf("first use: %v", err)
	}
	var rec corev1.ConfigMap
	if err := c.Get(ctx, types.NamespacedName{Namespace: "fleet", Name: Name(ek1)}, &rec); err != nil {
		t.Fatalf("no record: %v", err)
	}
	if len(rec.OwnerReferences) != 1 || rec.OwnerReferences[0].UID != "uid-1" || rec.OwnerReferences[0].Kind != "Machine" ||
		rec.OwnerReferences[0].APIVersion != clusterv1.GroupVersion.String() {
		t.Errorf("record owners = %+v, want Machine m1", rec.OwnerReferences)
	}
	if rec.Data[KeyIdentity] != ek1 || rec.Labels[LabelMachineUID] != "uid-1" || len(Name(ek1)) > 253 {
		t.Errorf("record = %+v", rec)
	}

	// A fresh Store (a restarted controller) decides from the API alone.
	s = &Store{Client: c, Reader: c}
	if err := s.Bind(ctx, m1, ek1); err != nil {
		t.Fatalf("same identity, same Machine (renewal): %v", err)
	}
	wantReason(t, s.Bind(ctx, m2, ek1), ReasonIdentityClaimedByOtherMachine)
	wantReason(t, s.Bind(ctx, m3, ek1), ReasonIdentityClaimedByOtherMachine)
	wantReason(t, s.Bind(ctx, m1, ek2), ReasonMachineIdentityMismatch)
	if err := s.Bind(ctx, m2, ek2); err != nil {
		t.Fatalf("another Machine's own identity: %v", err)
	}
}

func TestBindStaleRecord(t *testing.T) {
	ctx := context.Background()
	// Machine m1 was deleted and recreated under the same name with the
	// same device; the garbage collector has not removed the old record.
	newObj, newM := machine("fleet", "m1", "uid-new")
	_, oldM := machine("fleet", "m1", "uid-old")
	c := fake.NewClientBuilder().WithScheme(scheme(t)).WithObjects(newObj).Build()
	s := &Store{Client: c, Reader: c}
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

func TestBindTransientErrors(t *testing.T) {
	ctx := context.Background()
	_, m1 := machine("fleet", "m1", "uid-1")
	boom := errors.New("connection refused")
	c := fake.NewClientBuilder().WithScheme(scheme(t)).WithInterceptorFuncs(interceptor.Funcs{
		Create: func(context.Context, client.WithWatch, client.Object, ...client.CreateOption) error { return boom },
	}).Build()
	s := &Store{Client: c, Reader: c}
	err := s.Bind(ctx, m1, ek1)
	if _, _, denied := attestor.Denial(err); !errors.Is(err, boom) || denied {
		t.Fatalf("got %v, want the transient error, not a denial", err)
	}
}

func TestBindLostRace(t *testing.T) {
	ctx := context.Background()
	m1obj, m1 := machine("fleet", "m1", "uid-1")
	m2obj, m2 := machine("fleet", "m2", "uid-2")
	base := fake.NewClientBuilder().WithScheme(scheme(t)).WithObjects(m1obj, m2obj).Build()
	// Another process creates m2's record of ek1 between our list and our
	// create.
	raced := false
	c := interceptor.NewClient(base, interceptor.Funcs{
		Create: func(ctx context.Context, cl client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
			if !raced {
				raced = true
				other := &Store{Client: base, Reader: base}
				if err := other.Bind(ctx, m2, ek1); err != nil {
					t.Fatal(err)
				}
			}
			return cl.Create(ctx, obj, opts...)
		},
	})
	s := &Store{Client: c, Reader: c}
	wantReason(t, s.Bind(ctx, m1, ek1), ReasonIdentityClaimedByOtherMachine)
}
