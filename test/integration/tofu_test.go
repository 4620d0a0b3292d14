package integration

import (
	"context"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// tofuHome is the controller's namespace in these tests (runSigner's
// --leader-election-namespace).
const tofuHome = metav1.NamespaceSystem

func engineMachine(m *clusterv1.Machine) *engine.Machine {
	return &engine.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID, ProviderID: m.Spec.ProviderID}
}

// denialReason returns the reason of a denial, "" for nil, and fails on a
// transient error.
func denialReason(t *testing.T, err error) string {
	t.Helper()
	r, _, ok := attestor.Denial(err)
	if !ok && err != nil {
		t.Fatalf("transient error: %v", err)
	}
	return r
}

// TestTrustOnFirstUse records identities on a real API server with the
// Cluster API CRDs: first use binds, the record is in the controller's
// namespace, a restarted store (a new process) keeps the binding, and of
// two stores racing to bind one identity to two Machines exactly one wins.
func TestTrustOnFirstUse(t *testing.T) {
	harness.Binaries(t)
	mgmt := harness.StartManagement(t)
	ctx := context.Background()
	machine := func(name string) *engine.Machine {
		return engineMachine(mgmt.CreateMachine(t, signerNS, signerCluster, name, "test:///"+name, true, name))
	}
	if err := mgmt.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: signerNS}}); err != nil {
		t.Fatal(err)
	}
	m1, m2, m3, m4 := machine("m1"), machine("m2"), machine("m3"), machine("m4")
	store := func() *tofu.Store { return &tofu.Store{Namespace: tofuHome, Client: mgmt.Client, Reader: mgmt.Client} }

	if err := store().Bind(ctx, m1, "tpm:ek-sha256:aa"); err != nil {
		t.Fatal(err)
	}
	var rec corev1.ConfigMap
	if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: tofuHome, Name: tofu.Name("tpm:ek-sha256:aa")}, &rec); err != nil {
		t.Fatalf("no record in the controller's namespace: %v", err)
	}
	if rec.Data[tofu.KeyMachineNamespace] != signerNS || rec.Data[tofu.KeyMachineUID] != string(m1.UID) {
		t.Fatalf("record %+v", rec.Data)
	}
	// A new store, as after a controller restart or a leader change.
	if err := store().Bind(ctx, m1, "tpm:ek-sha256:aa"); err != nil {
		t.Fatalf("renewal: %v", err)
	}
	if got := denialReason(t, store().Bind(ctx, m2, "tpm:ek-sha256:aa")); got != attestor.ReasonIdentityClaimedByOtherMachine {
		t.Errorf("same identity, another Machine: %q", got)
	}
	if got := denialReason(t, store().Bind(ctx, m1, "tpm:ek-sha256:bb")); got != attestor.ReasonMachineIdentityMismatch {
		t.Errorf("another identity, same Machine: %q", got)
	}

	// Two processes race for one identity.
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, m := range []*engine.Machine{m3, m4} {
		wg.Go(func() { errs[i] = store().Bind(ctx, m, "tpm:ek-sha256:cc") })
	}
	wg.Wait()
	wins := 0
	for _, err := range errs {
		if err == nil {
			wins++
		} else if got := denialReason(t, err); got != attestor.ReasonIdentityClaimedByOtherMachine {
			t.Errorf("loser: %q", got)
		}
	}
	if wins != 1 {
		t.Errorf("%d Machines bound one identity: %v", wins, errs)
	}
}

// TestTrustOnFirstUseTenant is issue 13.4: a tenant who administers its own
// namespace on the shared management cluster (user tenant-a, bound to the
// admin ClusterRole there) can neither make a stolen identity acceptable
// for another tenant's Machine nor get another tenant's Machine denied:
// it cannot touch the records in the controller's namespace, and records
// it writes in its own namespace (the old layout) are not read. Then the
// controller removes a deleted Machine's records: at once when it sees the
// deletion, and at start for Machines deleted while it was not running.
func TestTrustOnFirstUseTenant(t *testing.T) {
	harness.Binaries(t)
	mgmt := harness.StartManagement(t)
	ctx := context.Background()
	for _, ns := range []string{"tenant-a", "tenant-b"} {
		if err := mgmt.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := mgmt.Client.Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Namespace: "tenant-a", Name: "tenant-a-admin"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "admin"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: "tenant-a"}},
	}); err != nil {
		t.Fatal(err)
	}
	// admin is an aggregated ClusterRole: kube-controller-manager fills it.
	mgmt.StartControllerManager(t, "clusterrole-aggregation")
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		var admin rbacv1.ClusterRole
		err := mgmt.Client.Get(ctx, types.NamespacedName{Name: "admin"}, &admin)
		return err == nil && len(admin.Rules) > 0, err
	})
	certPEM, keyPEM := mgmt.IssueClientCert(t, "tenant-a")
	tenant, err := client.New(mgmt.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}),
		client.Options{Scheme: mgmt.Client.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	a1 := mgmt.CreateMachine(t, "tenant-a", "a", "a1", "test:///a1", true)
	b1 := mgmt.CreateMachine(t, "tenant-b", "b", "b1", "test:///b1", true)
	b2 := mgmt.CreateMachine(t, "tenant-b", "b", "b2", "test:///b2", true)
	const (
		tenantEK = "tpm:ek-sha256:a1a1" // the tenant's own TPM
		b1EK     = "tpm:ek-sha256:b1b1"
		b2EK     = "tpm:ek-sha256:b2b2" // known to the tenant (EKs are no secret), not yet bound
	)
	store := &tofu.Store{Namespace: tofuHome, Client: mgmt.Client, Reader: mgmt.Client}
	if err := store.Bind(ctx, engineMachine(b1), b1EK); err != nil {
		t.Fatal(err)
	}

	// The tenant is admin of its namespace (it writes ConfigMaps there) and
	// nothing in the controller's.
	record := func(ns, identity string, m *clusterv1.Machine) *corev1.ConfigMap {
		return &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: tofu.Name(identity), Labels: map[string]string{
				tofu.LabelIdentity: tofu.Name(identity)[len(tofu.NamePrefix):][:63], tofu.LabelMachineUID: string(m.UID),
			}},
			Data: map[string]string{tofu.KeyIdentity: identity, tofu.KeyMachineNamespace: m.Namespace, tofu.KeyMachine: m.Name, tofu.KeyMachineUID: string(m.UID)},
		}
	}
	if err := tenant.Create(ctx, record(tofuHome, tenantEK, b1)); !apierrors.IsForbidden(err) {
		t.Errorf("tenant creates a record in the controller's namespace: %v, want forbidden", err)
	}
	b1Record := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: tofuHome, Name: tofu.Name(b1EK)}}
	if err := tenant.Delete(ctx, b1Record); !apierrors.IsForbidden(err) {
		t.Errorf("tenant deletes b1's record: %v, want forbidden", err)
	}
	if err := tenant.Get(ctx, client.ObjectKeyFromObject(b1Record), &corev1.ConfigMap{}); !apierrors.IsForbidden(err) {
		t.Errorf("tenant reads b1's record: %v, want forbidden", err)
	}
	// Records in the old layout, in the tenant's own namespace: its TPM
	// for b1 (a stolen identity), and b2's EK for its own a1 (to have b2
	// denied).
	for _, r := range []*corev1.ConfigMap{record("tenant-a", tenantEK, b1), record("tenant-a", b2EK, a1)} {
		if err := tenant.Create(ctx, r); err != nil {
			t.Fatalf("tenant creates %s in its namespace: %v", r.Name, err)
		}
	}

	if got := denialReason(t, store.Bind(ctx, engineMachine(b1), tenantEK)); got != attestor.ReasonMachineIdentityMismatch {
		t.Errorf("the tenant's TPM for tenant-b's Machine b1: %q, want %s", got, attestor.ReasonMachineIdentityMismatch)
	}
	if err := store.Bind(ctx, engineMachine(b2), b2EK); err != nil {
		t.Errorf("tenant-b's Machine b2 with its own TPM: %v, want bound", err)
	}
	if got := denialReason(t, store.Bind(ctx, engineMachine(a1), b1EK)); got != attestor.ReasonIdentityClaimedByOtherMachine {
		t.Errorf("b1's TPM for the tenant's Machine a1: %q", got)
	}
	if err := store.Bind(ctx, engineMachine(a1), tenantEK); err != nil {
		t.Errorf("the tenant's own Machine and TPM: %v", err)
	}

	// Cleanup. b2 is deleted before the controller runs (its sweep at start
	// removes the record), b1 while it runs (the deletion is seen).
	if err := mgmt.Client.Delete(ctx, b2); err != nil {
		t.Fatal(err)
	}
	runSigner(t, mgmt, func(o *app.Options) { o.LeaderElectionNamespace = tofuHome })
	gone := func(identity string) {
		t.Helper()
		harness.WaitFor(t, 30*time.Second, func() (bool, error) {
			err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: tofuHome, Name: tofu.Name(identity)}, &corev1.ConfigMap{})
			return apierrors.IsNotFound(err), client.IgnoreNotFound(err)
		})
	}
	gone(b2EK)
	if err := mgmt.Client.Delete(ctx, b1); err != nil {
		t.Fatal(err)
	}
	gone(b1EK)
	if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: tofuHome, Name: tofu.Name(tenantEK)}, &corev1.ConfigMap{}); err != nil {
		t.Errorf("a1's record (its Machine exists): %v", err)
	}
	// The identity is free for another Machine.
	b3 := mgmt.CreateMachine(t, "tenant-b", "b", "b3", "test:///b3", true)
	if err := store.Bind(ctx, engineMachine(b3), b1EK); err != nil {
		t.Errorf("b1's device for the new Machine b3: %v", err)
	}
}
