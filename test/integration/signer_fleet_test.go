package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestSignerManyClusters runs one controller for three workload clusters:
// one is killed and the others keep getting CSRs signed promptly; a
// rotated kubeconfig Secret is picked up (to a broken one, then to a new
// good one); a deleted Cluster's controller stops. The per-cluster metrics
// say so.
func TestSignerManyClusters(t *testing.T) {
	harness.Binaries(t)
	start := time.Now()
	mgmt := harness.StartManagement(t)
	const ns = "fleet"
	names := []string{"c0", "c1", "c2"}
	envs := map[string]*signerEnv{}
	for _, n := range names {
		wl := harness.StartControlPlane(t, n)
		mgmt.AddWorkloadCluster(t, ns, n, wl, map[string]string{
			capi.AnnotationEnabled:             "true",
			capi.AnnotationAuthorizedAttestors: "insecure",
		})
		envs[n] = &signerEnv{mgmt: mgmt, wl: wl, bootstrap: wl.BootstrapClient(t)}
	}
	t.Logf("4 control planes ready in %s", time.Since(start).Round(time.Millisecond))
	runSigner(t, mgmt, func(o *app.Options) { o.ProbePeriod = time.Second })

	csrs := 0
	sign := func(t *testing.T, cluster string, within time.Duration) {
		t.Helper()
		csrs++
		node, pid := fmt.Sprintf("%s-node-%d", cluster, csrs), fmt.Sprintf("test:///%s/%d", cluster, csrs)
		mgmt.CreateMachine(t, ns, cluster, node, pid, true)
		b, _ := signertest.Request{NodeName: node, ProviderID: pid}.Build(t)
		filed := time.Now()
		envs[cluster].file(t, signertest.CSR(node, b))
		envs[cluster].expectIssued(t, node, node, pid, 24*time.Hour)
		if took := time.Since(filed); took > within {
			t.Errorf("CSR in %s took %s to be signed, want under %s", cluster, took.Round(time.Millisecond), within)
		} else {
			t.Logf("CSR in %s signed in %s", cluster, took.Round(time.Millisecond))
		}
	}
	metric := func(name, cluster string) (float64, bool) {
		return gauge(t, "kubelet_authenticator_signer_"+name, ns+"/"+cluster)
	}
	// Secrets are not watched: a rotated kubeconfig is read at the next
	// recheck (10s here), and replacing a controller stuck on an
	// unreachable cluster waits up to 10s for it to stop.
	waitMetric := func(name, cluster string, want float64) {
		t.Helper()
		harness.WaitFor(t, 45*time.Second, func() (bool, error) {
			v, ok := metric(name, cluster)
			return ok && v == want, nil
		})
	}

	for _, n := range names {
		sign(t, n, 30*time.Second)
		waitMetric("workload_cluster_connected", n, 1)
	}

	// Kill c0: c1 and c2 keep being served promptly; c0 shows disconnected.
	envs["c0"].wl.Stop()
	waitMetric("workload_cluster_connected", "c0", 0)
	sign(t, "c1", 5*time.Second)
	sign(t, "c2", 5*time.Second)

	// Rotate c1's kubeconfig to one that reaches nothing: picked up
	// (generation 2), disconnected, CSRs wait.
	rotate := func(kubeconfig []byte) {
		t.Helper()
		setKubeconfig(t, mgmt, ns, "c1", kubeconfig)
	}
	c1 := envs["c1"].wl
	rotate(c1.KubeconfigFor(fmt.Sprintf("https://127.0.0.1:%d", harness.FreePort(t)), clientcmdapi.AuthInfo{Token: "nobody"}))
	waitMetric("workload_controller_generation", "c1", 2)
	waitMetric("workload_cluster_connected", "c1", 0)
	mgmt.CreateMachine(t, ns, "c1", "c1-waiting", "test:///c1/waiting", true)
	b, _ := signertest.Request{NodeName: "c1-waiting", ProviderID: "test:///c1/waiting"}.Build(t)
	envs["c1"].file(t, signertest.CSR("c1-waiting", b))
	sign(t, "c2", 5*time.Second) // still unaffected
	if csr := envs["c1"].get(t, "c1-waiting"); len(csr.Status.Conditions) > 0 {
		t.Fatalf("CSR decided through a kubeconfig that reaches nothing: %+v", csr.Status.Conditions)
	}

	// Rotate to a new, good credential: the waiting CSR is signed.
	certPEM, keyPEM := c1.IssueClientCert(t, "rotated-admin", "system:masters")
	rotate(c1.KubeconfigFor("", clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}))
	waitMetric("workload_controller_generation", "c1", 3)
	envs["c1"].expectIssued(t, "c1-waiting", "c1-waiting", "test:///c1/waiting", 24*time.Hour)
	waitMetric("workload_cluster_connected", "c1", 1)

	// Delete c2: its controller stops (its series go) and its CSRs are no
	// longer decided.
	if err := mgmt.Client.Delete(context.Background(), &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "c2"}}); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, 20*time.Second, func() (bool, error) {
		_, ok := metric("workload_cluster_connected", "c2")
		return !ok, nil
	})
	b, _ = signertest.Request{NodeName: "c2-after", ProviderID: "test:///c2/after"}.Build(t)
	envs["c2"].file(t, signertest.CSR("c2-after", b))
	time.Sleep(3 * time.Second)
	if csr := envs["c2"].get(t, "c2-after"); len(csr.Status.Conditions) > 0 {
		t.Fatalf("CSR of a deleted Cluster was decided: %+v", csr.Status.Conditions)
	}
	sign(t, "c1", 5*time.Second)
	if v, ok := metric("csr_queue_depth", "c1"); !ok || v != 0 {
		t.Errorf("queue depth of c1 = %v (present %t), want 0", v, ok)
	}
}
