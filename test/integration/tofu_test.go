package integration

import (
	"context"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestTrustOnFirstUse records identities on a real API server with the
// Cluster API CRDs: first use binds, the record is owned by the Machine,
// a restarted store (a new process) keeps the binding, and of two stores
// racing to bind one identity to two Machines exactly one wins.
func TestTrustOnFirstUse(t *testing.T) {
	harness.Binaries(t)
	mgmt := harness.StartManagement(t)
	ctx := context.Background()
	machine := func(name string) *engine.Machine {
		m := mgmt.CreateMachine(t, signerNS, signerCluster, name, "test:///"+name, true, name)
		return &engine.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID, ProviderID: m.Spec.ProviderID}
	}
	if err := mgmt.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: signerNS}}); err != nil {
		t.Fatal(err)
	}
	m1, m2, m3, m4 := machine("m1"), machine("m2"), machine("m3"), machine("m4")
	store := func() *tofu.Store { return &tofu.Store{Client: mgmt.Client, Reader: mgmt.Client} }
	denied := func(err error) string {
		r, _, ok := attestor.Denial(err)
		if !ok && err != nil {
			t.Fatalf("transient error: %v", err)
		}
		return r
	}

	if err := store().Bind(ctx, m1, "tpm:ek-sha256:aa"); err != nil {
		t.Fatal(err)
	}
	var rec corev1.ConfigMap
	if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: signerNS, Name: tofu.Name("tpm:ek-sha256:aa")}, &rec); err != nil {
		t.Fatal(err)
	}
	if o := rec.OwnerReferences; len(o) != 1 || o[0].UID != m1.UID || o[0].Kind != "Machine" || o[0].APIVersion != clusterv1.GroupVersion.String() {
		t.Fatalf("record owners %+v, want Machine m1 (garbage-collected with it)", o)
	}
	// A new store, as after a controller restart or a leader change.
	if err := store().Bind(ctx, m1, "tpm:ek-sha256:aa"); err != nil {
		t.Fatalf("renewal: %v", err)
	}
	if got := denied(store().Bind(ctx, m2, "tpm:ek-sha256:aa")); got != attestor.ReasonIdentityClaimedByOtherMachine {
		t.Errorf("same identity, another Machine: %q", got)
	}
	if got := denied(store().Bind(ctx, m1, "tpm:ek-sha256:bb")); got != attestor.ReasonMachineIdentityMismatch {
		t.Errorf("another identity, same Machine: %q", got)
	}

	// Two processes race for one identity.
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, m := range []*engine.Machine{m3, m4} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = store().Bind(ctx, m, "tpm:ek-sha256:cc")
		}()
	}
	wg.Wait()
	wins := 0
	for _, err := range errs {
		if err == nil {
			wins++
		} else if got := denied(err); got != attestor.ReasonIdentityClaimedByOtherMachine {
			t.Errorf("loser: %q", got)
		}
	}
	if wins != 1 {
		t.Errorf("%d Machines bound one identity: %v", wins, errs)
	}
}
