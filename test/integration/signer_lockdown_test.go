package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/lockdown"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// issued reports whether harness.PlainBootstrap's request got a certificate.
func issued(_ string, ok bool) bool { return ok }

// TestSignerLockdown is issue 13.5: lockdown closes kube-controller-manager's
// auto-approval of kubelet TLS bootstrap (and keeps it closed when kubeadm
// writes the binding anew), while a control-plane node that kubeadm joined,
// which does not attest, keeps renewing its own certificate through
// kube-controller-manager (selfnodeclient), attested nodes still get
// certificates, and lifting lockdown restores the bootstrap binding.
func TestSignerLockdown(t *testing.T) {
	harness.Binaries(t)
	ctx := context.Background()
	mgmt := harness.StartManagement(t)
	wl := harness.StartControlPlane(t, "workload")
	mgmt.AddWorkloadCluster(t, signerNS, signerCluster, wl, map[string]string{
		capi.AnnotationEnabled:             "true",
		capi.AnnotationAuthorizedAttestors: "insecure",
	})
	wl.KubeadmAutoApprove(t)
	wl.StartControllerManager(t, "csrapproving", "csrsigning")
	bootstrap := wl.BootstrapClient(t)
	// A control-plane node kubeadm joined: its kubelet holds a client
	// certificate for its own name, and renews it itself.
	cpCert, cpKey := wl.IssueClientCert(t, "system:node:control-plane-0", attestor.NodesGroup)
	controlPlane, err := kubernetes.NewForConfig(wl.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: cpCert, ClientKeyData: cpKey}))
	if err != nil {
		t.Fatal(err)
	}
	runSigner(t, mgmt, func(o *app.Options) { o.LockdownPeriod = time.Second })

	if !issued(harness.PlainBootstrap(t, bootstrap, "plain-0", 30*time.Second)) {
		t.Fatal("before lockdown, kube-controller-manager did not approve and sign a plain kubelet TLS bootstrap")
	}

	e := &signerEnv{mgmt: mgmt, wl: wl, bootstrap: bootstrap}
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
	e.editCluster(t, func(c *clusterv1.Cluster) { c.Annotations[capi.AnnotationLockdown] = "true" })
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
	// The controller counts a disarm once its write is answered, so the
	// count may trail the binding the test has just seen emptied.
	var removed float64
	var present bool
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if removed, present = gauge(t, "kubelet_authenticator_signer_lockdown_bindings_removed", signerNS+"/"+signerCluster); present && removed >= 2 {
			break
		}
	}
	if !present || removed < 2 {
		t.Errorf("lockdown_bindings_removed = %v (present %t), want at least 2", removed, present)
	}
	if got := subjects(lockdown.KubeadmAutoApproveRotation); len(got) != 1 || got[0].Name != attestor.NodesGroup {
		t.Errorf("the renewal binding's subjects: %v, want system:nodes kept", got)
	}

	if issued(harness.PlainBootstrap(t, bootstrap, "plain-1", 8*time.Second)) {
		t.Fatal("after lockdown, a plain kubelet TLS bootstrap was still approved")
	}
	if !issued(harness.PlainBootstrap(t, controlPlane, "control-plane-0", 30*time.Second)) {
		t.Fatal("after lockdown, the control-plane node could not renew its own certificate")
	}

	mgmt.CreateMachine(t, signerNS, signerCluster, "attested-0", "test:///a0", true)
	req, _ := signertest.Request{NodeName: "attested-0", ProviderID: "test:///a0"}.Build(t)
	e.file(t, signertest.CSR("attested-0", req))
	e.expectIssued(t, "attested-0", "attested-0", "test:///a0", 24*time.Hour)

	// Lockdown is not lifted while the Cluster is paused (clusterctl move
	// creates it paused, before the objects that hold its policy), nor
	// under a policy that authorizes no attestor (a Cluster moved without
	// its ClusterAttestation): either would re-arm plain bootstrap for a
	// policy nobody wrote. The status says why.
	held := func(why string) {
		t.Helper()
		time.Sleep(5 * time.Second) // the controller restarted, five lockdown periods
		if got := subjects(lockdown.KubeadmAutoApproveBootstrap); len(got) != 0 {
			t.Fatalf("lockdown lifted while %s: the bootstrap binding's subjects are %v", why, got)
		}
		e.waitAttestation(t, "lockdown held while "+why, func(st v1alpha1.ClusterAttestationStatus) string {
			if lacking := hasCondition(st, capi.ConditionLockdownApplied, metav1.ConditionFalse, "RestoreHeld"); lacking != "" {
				return lacking
			}
			if c := meta.FindStatusCondition(st.Conditions, capi.ConditionLockdownApplied); !strings.Contains(c.Message, why) {
				return "the condition's message does not say " + why + ": " + c.Message
			}
			return ""
		})
	}
	e.editCluster(t, func(c *clusterv1.Cluster) {
		c.Spec.Paused = ptr.To(true)
		c.Annotations[capi.AnnotationLockdown] = "false"
	})
	held("the Cluster is paused")
	e.editCluster(t, func(c *clusterv1.Cluster) {
		c.Spec.Paused = ptr.To(false)
		delete(c.Annotations, capi.AnnotationAuthorizedAttestors)
	})
	held("the Cluster's policy authorizes no attestor")

	// Lifted by a policy that says so: the bootstrap binding has its
	// subjects back.
	e.editCluster(t, func(c *clusterv1.Cluster) { c.Annotations[capi.AnnotationAuthorizedAttestors] = "insecure" })
	harness.WaitFor(t, 20*time.Second, func() (bool, error) {
		return len(subjects(lockdown.KubeadmAutoApproveBootstrap)) == 1, nil
	})
	if !issued(harness.PlainBootstrap(t, bootstrap, "plain-2", 30*time.Second)) {
		t.Fatal("after lockdown was lifted, a plain kubelet TLS bootstrap was not approved")
	}
}
