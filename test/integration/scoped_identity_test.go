package integration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/deploy/workload"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/scoped"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestScopedWorkloadIdentity is issue 14.2, workload side: given Cluster
// API's admin kubeconfig, the controller uses it only to install its own
// ServiceAccount (deploy/workload) and to request that ServiceAccount's
// tokens. The workload API server's audit log shows every other request
// of the controller, a node's join among them, made as the ServiceAccount
// and none of them forbidden; the token is renewed before it expires; and
// a ServiceAccount deleted from the workload cluster is installed again,
// with an Event on the Cluster, after which nodes still join.
func TestScopedWorkloadIdentity(t *testing.T) {
	harness.Binaries(t)
	ctx := context.Background()
	mgmt := harness.StartManagement(t)
	wl := harness.StartControlPlane(t, "workload", harness.WithAuditLog())
	mgmt.AddWorkloadCluster(t, signerNS, signerCluster, wl, map[string]string{
		capi.AnnotationEnabled:             "true",
		capi.AnnotationAuthorizedAttestors: "insecure",
	})
	// Cluster API's admin kubeconfig (system:masters), under a user name of
	// its own, so that the audit log tells the controller's admin requests
	// from the test's (which are kubernetes-admin's).
	const adminUser = "capi-admin-for-wl"
	certPEM, keyPEM := wl.IssueClientCert(t, adminUser, "system:masters")
	var kc corev1.Secret
	if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: signerNS, Name: signerCluster + capi.KubeconfigSecretSuffix}, &kc); err != nil {
		t.Fatal(err)
	}
	kc.Data[capi.KubeconfigSecretKey] = wl.KubeconfigFor("", clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM})
	if err := mgmt.Client.Update(ctx, &kc); err != nil {
		t.Fatal(err)
	}
	manifests, err := workload.Load()
	if err != nil {
		t.Fatal(err)
	}
	sa := manifests.ServiceAccount
	saUser := "system:serviceaccount:" + sa.Namespace + ":" + sa.Name

	// The API server's shortest token lifetime, renewed 5 s into it, or as
	// soon as scoped.MinRenewInterval allows: the test sees a renewal
	// without waiting for an expiry.
	runSigner(t, mgmt, func(o *app.Options) {
		o.TokenLifetime, o.TokenRenewBefore = scoped.MinTokenLifetime, scoped.MinTokenLifetime-5*time.Second
	})
	e := &signerEnv{mgmt: mgmt, wl: wl, bootstrap: wl.BootstrapClient(t)}
	cluster := signerNS + "/" + signerCluster

	e.joinMachine(t, "worker-0")
	firstSA, err := wl.Client.CoreV1().ServiceAccounts(sa.Namespace).Get(ctx, sa.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the controller's ServiceAccount is not installed: %v", err)
	}
	if firstSA.ManagedFields == nil || !slices.ContainsFunc(firstSA.ManagedFields, func(f metav1.ManagedFieldsEntry) bool {
		return f.Manager == scoped.FieldManager && f.Operation == metav1.ManagedFieldsOperationApply
	}) {
		t.Errorf("the ServiceAccount was not applied server-side by %s: %+v", scoped.FieldManager, firstSA.ManagedFields)
	}

	// Renewed, and reported.
	harness.WaitFor(t, scoped.MinRenewInterval+60*time.Second, func() (bool, error) {
		n, _ := gauge(t, "kubelet_authenticator_signer_workload_token_renewals_total", cluster)
		return n >= 1, nil
	})
	if v, ok := gauge(t, "kubelet_authenticator_signer_workload_scoped_identity", cluster); !ok || v != 1 {
		t.Errorf("workload_scoped_identity = %v (%t), want 1", v, ok)
	}
	if v, ok := gauge(t, "kubelet_authenticator_signer_workload_token_expiry_timestamp_seconds", cluster); !ok ||
		time.Unix(int64(v), 0).Before(time.Now()) || time.Unix(int64(v), 0).After(time.Now().Add(scoped.MinTokenLifetime)) {
		t.Errorf("workload_token_expiry_timestamp_seconds = %v (%t), want within the next %s", v, ok, scoped.MinTokenLifetime)
	}

	// Deleted behind the controller's back: installed again, and said so.
	if err := wl.Client.CoreV1().ServiceAccounts(sa.Namespace).Delete(ctx, sa.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 90*time.Second, func() (bool, error) {
		var events corev1.EventList
		if err := mgmt.Client.List(ctx, &events, client.InNamespace(signerNS)); err != nil {
			return false, err
		}
		for _, e := range events.Items {
			if e.Reason == capi.ReasonScopedIdentityReinstalled && e.InvolvedObject.Kind == "Cluster" && e.InvolvedObject.Name == signerCluster {
				return true, nil
			}
		}
		return false, nil
	})
	again, err := wl.Client.CoreV1().ServiceAccounts(sa.Namespace).Get(ctx, sa.Name, metav1.GetOptions{})
	if err != nil || again.UID == firstSA.UID {
		t.Fatalf("the ServiceAccount was not installed again: %v", err)
	}
	e.joinMachine(t, "worker-1")

	// The audit log: who did what.
	allowed := map[string]bool{} // the install: resource/namespace/name
	for _, o := range manifests.Objects {
		gvr, _ := workload.Resource(o.GroupVersionKind())
		allowed[gvr.Resource+"/"+o.GetNamespace()+"/"+o.GetName()] = true
	}
	var tokenRequests, installs, scopedRequests int
	var csrWrites []string
	for _, e := range wl.AuditEvents(t) {
		ref := e.ObjectRef
		switch e.User.Username {
		case adminUser:
			switch {
			case ref != nil && e.Verb == "create" && ref.Resource == "serviceaccounts" && ref.Subresource == "token" &&
				ref.Namespace == sa.Namespace && ref.Name == sa.Name:
				tokenRequests++
			case ref != nil && e.Verb == "patch" && ref.Subresource == "" && allowed[ref.Resource+"/"+ref.Namespace+"/"+ref.Name]:
				installs++
			case ref != nil && e.Verb == "create" && ref.Resource == "selfsubjectaccessreviews":
			default:
				t.Errorf("the controller used the admin credential for more than installing its identity: %s %s (%d)", e.Verb, e.RequestURI, e.Code())
			}
		case saUser:
			scopedRequests++
			if e.Code() == 403 {
				t.Errorf("the scoped identity was forbidden %s %s: deploy/workload lacks a rule", e.Verb, e.RequestURI)
			}
			if ref != nil && ref.Resource == "certificatesigningrequests" && (ref.Subresource == "approval" || ref.Subresource == "status") {
				csrWrites = append(csrWrites, ref.Name+"/"+ref.Subresource)
			}
		default:
			if strings.HasPrefix(e.UserAgent, "node-attestation-controller") && e.Code() != 401 {
				t.Errorf("a request of the controller as %q: %s %s", e.User.Username, e.Verb, e.RequestURI)
			}
		}
	}
	t.Logf("audit: %d requests as %s, admin: %d token requests, %d applies", scopedRequests, saUser, tokenRequests, installs)
	if tokenRequests < 3 {
		t.Errorf("%d token requests, want the first, a renewal and the re-installation's", tokenRequests)
	}
	for _, w := range []string{"worker-0/approval", "worker-0/status", "worker-1/approval", "worker-1/status"} {
		if !slices.Contains(csrWrites, w) {
			t.Errorf("no %s write of a CSR by %s (got %v): the node's join was not made as the scoped identity", w, saUser, csrWrites)
		}
	}

	// An admin kubeconfig whose server cannot be reached: the identity
	// cannot be installed, which the Cluster's Events and the metrics say.
	if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: signerNS, Name: kc.Name}, &kc); err != nil {
		t.Fatal(err)
	}
	kc.Data[capi.KubeconfigSecretKey] = wl.KubeconfigFor(fmt.Sprintf("https://127.0.0.1:%d", harness.FreePort(t)),
		clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM})
	if err := mgmt.Client.Update(ctx, &kc); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 90*time.Second, func() (bool, error) {
		n, _ := gauge(t, "kubelet_authenticator_signer_workload_identity_failures_total", cluster)
		if n < 1 {
			return false, nil
		}
		var events corev1.EventList
		if err := mgmt.Client.List(ctx, &events, client.InNamespace(signerNS)); err != nil {
			return false, err
		}
		for _, e := range events.Items {
			if e.Reason == capi.ReasonScopedIdentityFailed && e.InvolvedObject.Name == signerCluster && e.Type == corev1.EventTypeWarning {
				t.Logf("Event %s: %s", e.Reason, e.Message)
				return true, nil
			}
		}
		return false, nil
	})
	if v, ok := gauge(t, "kubelet_authenticator_signer_workload_cluster_connected", cluster); !ok || v != 0 {
		t.Errorf("workload_cluster_connected = %v (%t), want 0 while the identity is not installed", v, ok)
	}
}
