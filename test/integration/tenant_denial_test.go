//go:build testattestors

package integration

import (
	"context"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/null"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestDenialNamesNoOtherTenant is issue 14.6: two tenants' workload
// clusters, one device. The first tenant's node binds it; the second
// tenant's node presenting the same device is denied
// IdentityClaimedByOtherMachine, and neither its CSR's condition in its
// workload cluster nor the Event on its Machine names the first tenant's
// Machine or namespace.
func TestDenialNamesNoOtherTenant(t *testing.T) {
	harness.Binaries(t)
	mgmt := harness.StartManagement(t)
	wlA, wlB := harness.StartControlPlane(t, "workload-a"), harness.StartControlPlane(t, "workload-b")
	annotations := map[string]string{capi.AnnotationEnabled: "true", capi.AnnotationAuthorizedAttestors: null.Name}
	mgmt.AddWorkloadCluster(t, "tenant-secret-a", "cluster-a", wlA, annotations)
	mgmt.AddWorkloadCluster(t, "tenant-b", "cluster-b", wlB, annotations)
	mgmt.CreateMachine(t, "tenant-secret-a", "cluster-a", "machine-secret-a", "test:///a1", true, "node-a")
	mgmt.CreateMachine(t, "tenant-b", "cluster-b", "machine-b", "test:///b1", true, "node-b")
	runSigner(t, mgmt, func(o *app.Options) { o.NullVersions = []string{"v1"} })

	ctx := context.Background()
	file := func(wl *harness.ControlPlane, node, pid string) {
		t.Helper()
		att, err := attestor.Encode("v1", null.Evidence{Version: "v1", ProviderID: pid, Stable: "shared-device"})
		if err != nil {
			t.Fatal(err)
		}
		req, _ := signertest.Request{NodeName: node, ProviderID: pid, Provider: null.Name, Evidence: att.Evidence}.Build(t)
		csr := signertest.CSR(node, req)
		csr.Spec.SignerName = attestor.ClientSignerName(null.Name)
		csr.Spec.Username, csr.Spec.Groups = "", nil
		if _, err := wl.BootstrapClient(t).CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	decided := func(wl *harness.ControlPlane, name string) *certificatesv1.CertificateSigningRequest {
		t.Helper()
		var got *certificatesv1.CertificateSigningRequest
		harness.WaitFor(t, 60*time.Second, func() (bool, error) {
			csr, err := wl.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			got = csr
			return len(csr.Status.Certificate) > 0 || len(csr.Status.Conditions) > 0 && csr.Status.Conditions[0].Type == certificatesv1.CertificateDenied, nil
		})
		return got
	}

	file(wlA, "node-a", "test:///a1")
	if csr := decided(wlA, "node-a"); len(csr.Status.Certificate) == 0 {
		t.Fatalf("tenant a's node: %+v", csr.Status.Conditions)
	}
	file(wlB, "node-b", "test:///b1")
	csr := decided(wlB, "node-b")
	var denied *certificatesv1.CertificateSigningRequestCondition
	for i, c := range csr.Status.Conditions {
		if c.Type == certificatesv1.CertificateDenied {
			denied = &csr.Status.Conditions[i]
		}
	}
	if denied == nil || denied.Reason != attestor.ReasonIdentityClaimedByOtherMachine {
		t.Fatalf("tenant b's node: %+v, want denied %s", csr.Status.Conditions, attestor.ReasonIdentityClaimedByOtherMachine)
	}
	leaks := []string{"tenant-secret-a", "machine-secret-a", "cluster-a", tofu.NamePrefix}
	for _, leak := range leaks {
		if strings.Contains(denied.Message, leak) {
			t.Errorf("the denial in tenant b's workload cluster names %q: %s", leak, denied.Message)
		}
	}
	if !strings.Contains(denied.Message, "another Machine") {
		t.Errorf("the denial does not say the device is bound elsewhere: %s", denied.Message)
	}
	// Tenant b reads the Events in its namespace: the one on its Machine
	// names no one else either.
	var found bool
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		var events corev1.EventList
		if err := mgmt.Client.List(ctx, &events, client.InNamespace("tenant-b")); err != nil {
			return false, err
		}
		for _, e := range events.Items {
			if e.Reason != attestor.ReasonIdentityClaimedByOtherMachine {
				continue
			}
			found = true
			for _, leak := range leaks {
				if strings.Contains(e.Message, leak) {
					t.Errorf("the Event in tenant b's namespace names %q: %s", leak, e.Message)
				}
			}
		}
		return found, nil
	})
}
