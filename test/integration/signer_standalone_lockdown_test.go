package integration

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/klog/v2/ktesting"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/lockdown"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/signer/standalone"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestSignerStandaloneLockdown: --lockdown in standalone mode closes, in
// the cluster the controller runs in, kube-controller-manager's
// auto-approval of a plain kubelet TLS bootstrap (a bootstrap-token holder
// gets no certificate for a node it names), keeps it closed when kubeadm
// writes the binding anew, leaves a control-plane node's renewal of its
// own certificate open, still issues to an attested node in the
// allowlist, and restarted without --lockdown gives the binding back.
func TestSignerStandaloneLockdown(t *testing.T) {
	harness.Binaries(t)
	ctx := context.Background()
	wl := harness.StartControlPlane(t, "standalone-lockdown")
	ns := metav1.NamespaceSystem
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "kubelet-authenticator-allowlist"}, Data: map[string]string{standalone.AllowlistKey: `nodes:
- nodeName: attested-0
  providerID: test:///a0
`}}
	if _, err := wl.Client.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	wl.KubeadmAutoApprove(t)
	wl.StartControllerManager(t, "csrapproving", "csrsigning")
	bootstrap := wl.BootstrapClient(t)
	cpCert, cpKey := wl.IssueClientCert(t, "system:node:control-plane-0", "system:nodes")
	controlPlane, err := kubernetes.NewForConfig(wl.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: cpCert, ClientKeyData: cpKey}))
	if err != nil {
		t.Fatal(err)
	}
	options := func(lock bool) *app.StandaloneOptions {
		o := app.NewStandaloneOptions()
		o.UnauthorizedListPeriod = unauthorizedListPeriod
		o.RESTConfig = wl.AdminConfig
		o.LeaderElectionNamespace = ns
		o.MetricsBindAddress, o.HealthProbeBindAddress = "0", "0"
		o.MaxClientCertificateLifetime = 24 * time.Hour
		o.CACertFile, o.CAKeyFile = wl.CACertFile, wl.CAKeyFile
		o.AuthorizedAttestors = []string{"insecure"}
		o.Lockdown, o.LockdownPeriod = lock, time.Second
		return o
	}
	subjects := func(name string) []rbacv1.Subject {
		t.Helper()
		b, err := wl.Client.RbacV1().ClusterRoleBindings().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return b.Subjects
	}
	disarmed := func() {
		t.Helper()
		harness.WaitFor(t, 20*time.Second, func() (bool, error) {
			return len(subjects(lockdown.KubeadmAutoApproveBootstrap)) == 0, nil
		})
	}

	if !issued(harness.PlainBootstrap(t, bootstrap, "plain-0", 30*time.Second)) {
		t.Fatal("before lockdown, kube-controller-manager did not approve and sign a plain kubelet TLS bootstrap")
	}

	// Run with --lockdown until stop.
	o := options(true)
	if err := o.Complete(); err != nil {
		t.Fatal(err)
	}
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	_, tctx := ktesting.NewTestContext(t)
	runCtx, stop := context.WithCancel(tctx)
	done := make(chan error, 1)
	go func() { done <- o.Run(runCtx) }()
	stopped := false
	stopController := func() {
		if stopped {
			return
		}
		stopped = true
		stop()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("controller: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("controller did not stop within 30s")
		}
	}
	t.Cleanup(stopController)

	disarmed()
	// Kept disarmed: kubeadm upgrade writes the binding anew.
	b, err := wl.Client.RbacV1().ClusterRoleBindings().Get(ctx, lockdown.KubeadmAutoApproveBootstrap, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b.Annotations = nil
	b.Subjects = []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: "system:bootstrappers:kubeadm:default-node-token"}}
	if _, err := wl.Client.RbacV1().ClusterRoleBindings().Update(ctx, b, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	disarmed()
	if v, ok := gauge(t, "kubelet_authenticator_signer_lockdown_bindings_removed", "/"+app.StandaloneCluster); !ok || v < 2 {
		t.Errorf("lockdown_bindings_removed = %v (present %t), want at least 2", v, ok)
	}
	if got := subjects(lockdown.KubeadmAutoApproveRotation); len(got) != 1 || got[0].Name != "system:nodes" {
		t.Errorf("the renewal binding's subjects: %v, want system:nodes kept", got)
	}

	// Red team: a bootstrap-token holder files a plain kubelet client CSR
	// for a node of its choosing; nobody approves it.
	if issued(harness.PlainBootstrap(t, bootstrap, "plain-1", 8*time.Second)) {
		t.Fatal("after lockdown, a plain kubelet TLS bootstrap was still approved")
	}
	if !issued(harness.PlainBootstrap(t, controlPlane, "control-plane-0", 30*time.Second)) {
		t.Fatal("after lockdown, the control-plane node could not renew its own certificate")
	}
	e := &signerEnv{wl: wl, bootstrap: bootstrap}
	req, _ := signertest.Request{NodeName: "attested-0", ProviderID: "test:///a0"}.Build(t)
	e.file(t, signertest.CSR("attested-0", req))
	e.expectIssued(t, "attested-0", "attested-0", "test:///a0", 24*time.Hour)
	// A node the allowlist does not name is denied, with the way in.
	stranger, _ := signertest.Request{NodeName: "stranger-0", ProviderID: "test:///s0"}.Build(t)
	e.file(t, signertest.CSR("stranger-0", stranger))
	e.expectDenied(t, "stranger-0", attestor.ReasonNodeNotAllowed)

	// Restarted without --lockdown: the bootstrap binding has its subjects
	// back.
	stopController()
	runOptions(t, options(false))
	harness.WaitFor(t, 20*time.Second, func() (bool, error) {
		return len(subjects(lockdown.KubeadmAutoApproveBootstrap)) == 1, nil
	})
	if !issued(harness.PlainBootstrap(t, bootstrap, "plain-2", 30*time.Second)) {
		t.Fatal("after lockdown was lifted, a plain kubelet TLS bootstrap was not approved")
	}
}
