//go:build testattestors

package integration

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/klog/v2/ktesting"
	clocktesting "k8s.io/utils/clock/testing"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/trustbundle"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/null"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/signer/trust"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestSignerServingCARotation runs a whole serving CA rotation with a fake
// clock and a 10h CA that is replaced 4h before it expires, against real
// API servers: the controller publishes its serving CA as signer-linked
// ClusterTrustBundles, the agent's projection (agent/trustbundle, as node
// worker-0) writes them to a file, and at every step a client trusting only
// that file verifies the serving certificates issued before and after the
// rotation. The controller is restarted in the middle of the rotation, with
// the new CA's bundle deleted as if it had died before publishing it: the
// state is in the API, not in memory.
func TestSignerServingCARotation(t *testing.T) {
	harness.Binaries(t)
	ctx := context.Background()
	mgmt := harness.StartManagement(t)
	wl := harness.StartControlPlane(t, "workload")
	const ns, name = "signer-trust", "wl"
	mgmt.AddWorkloadCluster(t, ns, name, wl, map[string]string{
		capi.AnnotationEnabled:             "true",
		capi.AnnotationAuthorizedAttestors: "null",
	})
	clusterKey := ns + "/" + name
	t0 := time.Now().Truncate(time.Second)
	clk := clocktesting.NewFakeClock(t0)
	signer := func() (stop func()) {
		return startStoppableSigner(t, mgmt, func(o *app.Options) {
			o.Clock = clk
			o.NullVersions = []string{"v1"}
			o.ServingCALifetime, o.ServingCARotateBefore = 10*time.Hour, 4*time.Hour
		})
	}
	stop := signer()

	m := mgmt.CreateMachine(t, ns, name, "worker-0", "test:///0", true, "worker-0")
	m.Status.Addresses = append(m.Status.Addresses, clusterv1.MachineAddress{Type: clusterv1.MachineInternalIP, Address: "10.0.0.5"})
	if err := mgmt.Client.Status().Update(ctx, m); err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM := wl.IssueClientCert(t, "system:node:worker-0", attestor.NodesGroup)
	nodeCfg := wl.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM})
	node, err := kubernetes.NewForConfig(nodeCfg)
	if err != nil {
		t.Fatal(err)
	}

	// The node agent's projection of the serving signer's bundles.
	// null stands in for a provider that vouches for a node (insecure has
	// no serving signer).
	servingSigner := attestor.ServingSignerName(null.Name)
	nullEvidence, err := json.Marshal(null.Evidence{Version: "v1", ProviderID: "test:///0"})
	if err != nil {
		t.Fatal(err)
	}
	bundlePath := filepath.Join(t.TempDir(), "kubelet-serving", "ca.crt")
	pctx, cancel := context.WithCancel(ctx)
	projDone := make(chan error, 1)
	go func() {
		projDone <- (&trustbundle.Manager{Config: nodeCfg, Projections: []config.TrustBundleProjection{{SignerName: servingSigner, Path: bundlePath}}}).Run(pctx)
	}()
	defer func() {
		cancel()
		if err := <-projDone; err != nil {
			t.Error(err)
		}
	}()

	servingCA := func() (signing *x509.Certificate, previous []*x509.Certificate) {
		t.Helper()
		var s corev1.Secret
		if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: name + capi.ServingCASecretSuffix}, &s); err != nil {
			t.Fatal(err)
		}
		certs := parseCerts(t, s.Data[corev1.TLSCertKey])
		return certs[0], parseCerts(t, s.Data[trust.SecretPreviousKey])
	}
	// expectPublished waits until exactly cas are published and projected.
	expectPublished := func(cas ...*x509.Certificate) {
		t.Helper()
		want := make([]string, len(cas))
		for i, c := range cas {
			want[i] = trust.BundleName(servingSigner, c)
		}
		slices.Sort(want)
		var got []string
		var file []*x509.Certificate
		err := pollFor(60*time.Second, func() bool {
			list, err := wl.Client.CertificatesV1beta1().ClusterTrustBundles().List(ctx, metav1.ListOptions{LabelSelector: trust.LabelServingCA + "=true"})
			if err != nil {
				return false
			}
			got = got[:0]
			for _, o := range list.Items {
				if o.Spec.SignerName == servingSigner {
					got = append(got, o.Name)
				}
			}
			data, _ := os.ReadFile(bundlePath)
			file = parseCerts(t, data)
			return slices.Equal(got, want) && len(file) == len(cas) && slices.ContainsFunc(file, cas[0].Equal) && slices.ContainsFunc(file, cas[len(cas)-1].Equal)
		})
		if err != nil {
			t.Fatalf("published %q, projected %d certificates; want %q\ncontroller status: %+v", got, len(file), want, gaugeDump(t, clusterKey))
		}
	}
	poke := 0
	reconcileNow := func() { // the Cluster changes: the controller looks at it now, not at its next recheck
		t.Helper()
		poke++
		var c clusterv1.Cluster
		if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &c); err != nil {
			t.Fatal(err)
		}
		patch := client.MergeFrom(c.DeepCopy())
		c.Annotations["test.kubelet-authenticator.x-k8s.io/poke"] = fmt.Sprint(poke)
		if err := mgmt.Client.Patch(ctx, &c, patch); err != nil {
			t.Fatal(err)
		}
	}
	csrs := 0
	issue := func() *x509.Certificate {
		t.Helper()
		csrs++
		req, _ := signertest.Request{NodeName: "worker-0", ProviderID: "test:///0", DNSNames: []string{"worker-0"}, Provider: null.Name, Evidence: nullEvidence}.Build(t)
		csr := servingCSR(fmt.Sprintf("serving-%d", csrs), servingSigner, req)
		if _, err := node.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		var out *certificatesv1.CertificateSigningRequest
		harness.WaitFor(t, 60*time.Second, func() (bool, error) {
			var err error
			out, err = wl.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, csr.Name, metav1.GetOptions{})
			return err == nil && (len(out.Status.Certificate) > 0 || condition(out, certificatesv1.CertificateDenied) != nil), err
		})
		if len(out.Status.Certificate) == 0 {
			t.Fatalf("CSR %s not issued: %+v", csr.Name, out.Status.Conditions)
		}
		return parseCert(t, out.Status.Certificate)
	}
	// verify checks leaves as a client trusting only the projected file
	// would, at the fake time.
	verify := func(step string, leaves ...*x509.Certificate) {
		t.Helper()
		data, err := os.ReadFile(bundlePath)
		if err != nil {
			t.Fatal(err)
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(data) {
			t.Fatalf("%s: the projected bundle holds no certificate", step)
		}
		for i, l := range leaves {
			if _, err := l.Verify(x509.VerifyOptions{Roots: roots, CurrentTime: clk.Now(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
				t.Errorf("%s: leaf %d (issued by %q) does not verify against the projected bundle: %v", step, i, l.Issuer.CommonName, err)
			}
		}
	}
	signedBy := func(leaf, ca *x509.Certificate) bool { return leaf.CheckSignatureFrom(ca) == nil }
	rotations := func() float64 {
		v, _ := gauge(t, "kubelet_authenticator_signer_serving_ca_rotations_total", clusterKey)
		return v
	}
	rotationsBefore := rotations()

	// 1. The first CA, published and projected; a leaf verifies.
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: name + capi.ServingCASecretSuffix}, &corev1.Secret{})
		return err == nil, nil
	})
	ca1, prev := servingCA()
	if len(prev) != 0 || ca1.NotAfter.Sub(t0) != 10*time.Hour {
		t.Fatalf("first serving CA expires %s with %d older ones", ca1.NotAfter, len(prev))
	}
	expectPublished(ca1)
	leaf1 := issue()
	if !signedBy(leaf1, ca1) {
		t.Fatal("leaf 1 not signed by the first CA")
	}
	verify("first CA", leaf1)

	// 2. Four hours before it expires: a new CA signs, both are published.
	clk.SetTime(t0.Add(6*time.Hour + time.Minute))
	reconcileNow()
	var ca2 *x509.Certificate
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		ca2, prev = servingCA()
		return !ca2.Equal(ca1), nil
	})
	if len(prev) != 1 || !prev[0].Equal(ca1) {
		t.Fatalf("after rotation the Secret keeps %d older CAs, want the first", len(prev))
	}
	expectPublished(ca2, ca1)
	leaf2 := issue()
	if !signedBy(leaf2, ca2) || signedBy(leaf2, ca1) {
		t.Fatal("leaf 2 not signed by the new CA only")
	}
	verify("rotation, both CAs published", leaf1, leaf2)
	if got := rotations() - rotationsBefore; got != 1 {
		t.Errorf("%v rotations counted, want 1", got)
	}

	// 3. Restart mid-rotation. While the controller is down, time passes
	// and the new CA's bundle disappears (as if the controller had died
	// between storing the CA and publishing it).
	stop()
	clk.SetTime(t0.Add(8 * time.Hour))
	if err := wl.Client.CertificatesV1beta1().ClusterTrustBundles().Delete(ctx, trust.BundleName(servingSigner, ca2), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	signer() // stopped by the test's cleanup
	expectPublished(ca2, ca1)
	if now, _ := servingCA(); !now.Equal(ca2) {
		t.Fatal("the restarted controller made another CA")
	}
	leaf3 := issue()
	if !signedBy(leaf3, ca2) {
		t.Fatal("leaf 3 not signed by the new CA")
	}
	verify("after the restart", leaf1, leaf2, leaf3)

	// 4. The old CA expires: its bundle goes, the new one stays, leaves of
	// the new CA keep verifying.
	clk.SetTime(t0.Add(10*time.Hour + time.Minute))
	reconcileNow()
	expectPublished(ca2)
	if signing, prev := servingCA(); !signing.Equal(ca2) || len(prev) != 0 {
		t.Fatalf("after the old CA expired: signing %q, %d older kept", signing.Subject.CommonName, len(prev))
	}
	leaf4 := issue()
	verify("old CA expired", leaf2, leaf3, leaf4)
	if leaf1.NotAfter.After(ca1.NotAfter) {
		t.Errorf("leaf 1 outlives its CA: %s > %s", leaf1.NotAfter, ca1.NotAfter)
	}

	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		exp, ok1 := gauge(t, "kubelet_authenticator_signer_serving_ca_expiry_timestamp_seconds", clusterKey)
		n, ok2 := gauge(t, "kubelet_authenticator_signer_serving_cas", clusterKey)
		pub, ok3 := gauge(t, "kubelet_authenticator_signer_serving_ca_trust_bundles_published", clusterKey)
		return ok1 && ok2 && ok3 && exp == float64(ca2.NotAfter.Unix()) && n == 1 && pub == 1, nil
	})
	if got := rotations() - rotationsBefore; got != 1 {
		t.Errorf("%v rotations counted, want 1", got)
	}
}

// startStoppableSigner runs the controller in-process against mgmt until stop is
// called (or the test ends); adjust changes its options first.
func startStoppableSigner(t *testing.T, mgmt *harness.Management, adjust func(*app.Options)) (stop func()) {
	t.Helper()
	o := app.NewOptions()
	o.UnauthorizedListPeriod = unauthorizedListPeriod
	o.RESTConfig = mgmt.AdminConfig
	o.LeaderElectionNamespace = metav1.NamespaceSystem
	o.MetricsBindAddress, o.HealthProbeBindAddress = "0", "0"
	o.MaxClientCertificateLifetime = 24 * time.Hour
	o.SkipControllerNameValidation = true
	o.ClusterRecheckPeriod = 10 * time.Second
	adjust(o)
	if err := o.Complete(); err != nil {
		t.Fatal(err)
	}
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	_, tctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(tctx)
	done := make(chan error, 1)
	go func() { done <- o.Run(ctx) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("controller: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("controller did not stop within 30s")
		}
	}
	t.Cleanup(stop)
	return stop
}

func gaugeDump(t *testing.T, cluster string) map[string]float64 {
	out := map[string]float64{}
	for _, n := range []string{"serving_ca_expiry_timestamp_seconds", "serving_cas", "serving_ca_trust_bundles_published", "workload_controller_generation"} {
		if v, ok := gauge(t, "kubelet_authenticator_signer_"+n, cluster); ok {
			out[n] = v
		}
	}
	return out
}
