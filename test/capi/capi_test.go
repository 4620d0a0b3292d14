package capi

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// kubeadmConfigTemplate is the KubeadmConfigTemplate docs/install.md tells
// users to write; the test creates exactly this file.
const kubeadmConfigTemplate = "docs/examples/kubeadmconfigtemplate.yaml"

// Generous bounds for a loaded 2-core machine.
const (
	joinTimeout    = 6 * time.Minute
	rolloutTimeout = 10 * time.Minute
)

func keyOf(ns, name string) types.NamespacedName {
	return types.NamespacedName{Namespace: ns, Name: name}
}

// TestMachineDeploymentLifecycle runs Cluster API's own controllers (core
// manager and CABPK) with the node-attestation-controller: a
// MachineDeployment of three Machines, bootstrapped with the documented
// KubeadmConfigTemplate, joins through attestation and reaches Running; a
// scale-down and a rollout delete Machines through Cluster API, new ones
// join, no legitimate node is denied, and no trust-on-first-use record of a
// deleted Machine remains.
func TestMachineDeploymentLifecycle(t *testing.T) {
	capiBin := harness.ClusterAPIBinaries(t)
	if capiBin == "" {
		t.Skipf("%s is unset: run test/tools/install-capi.sh and export %s=<the directory it prints> (make test does)", harness.ClusterAPIBinariesEnv, harness.ClusterAPIBinariesEnv)
	}
	if testing.Short() {
		t.Skip("starts two control planes and the Cluster API controllers")
	}
	ctx := context.Background()
	repo, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	const ns, clusterName = "fleet", "workload"

	binDir := scenario.Binaries(t)
	wl := harness.StartControlPlane(t, clusterName)
	mgmt := harness.StartManagement(t)
	mgmt.InstallCRDs(t, "testdata")
	mgmt.StartClusterAPI(t, capiBin)
	dyn, err := dynamic.NewForConfig(mgmt.AdminConfig)
	if err != nil {
		t.Fatal(err)
	}

	// What `kubeadm init` sets up in the workload cluster for joining
	// nodes: bootstrap tokens may file node CSRs (CABPK creates the tokens).
	if _, err := wl.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "kubeadm:kubelet-bootstrap"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "system:node-bootstrapper"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: "system:bootstrappers:kubeadm:default-node-token"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	// The Cluster, its infrastructure, opted in as the README says.
	if _, err := mgmt.ControlPlane.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	createUnstructured(t, dyn, testClusters, ns, "TestCluster", clusterName, map[string]any{})
	// Its policy: the spec of its ClusterAttestation (docs/status.md).
	createUnstructured(t, dyn, v1alpha1.GroupVersion.WithResource("clusterattestations"), ns, "ClusterAttestation", clusterName,
		map[string]any{"authorizedAttestors": []any{"insecure", "tpm"}})
	mgmt.CreateWorkloadCluster(t, &clusterv1.Cluster{
		ObjectMeta: metav1.ObjectMeta{Name: clusterName, Namespace: ns, Annotations: map[string]string{
			scenario.AnnotationEnabled: "true",
		}},
		Spec: clusterv1.ClusterSpec{
			InfrastructureRef: clusterv1.ContractVersionedObjectReference{APIGroup: infraGroup, Kind: "TestCluster", Name: clusterName},
		},
	}, wl)

	f := &fleet{dir: t.TempDir(), binDir: binDir, k8sBin: harness.Binaries(t), repo: repo, mgmt: mgmt, wl: wl, ns: ns,
		nodes: map[string]*node{}, issued: map[string]time.Time{}, firstCSR: map[string]certificatesv1.CertificateSigningRequest{}}
	f.p = &provider{dyn: dyn, mgmt: mgmt.Client, ns: ns, workload: wl.URL, stopVM: f.stop, created: map[string]vm{}}
	pctx, stopProvider := context.WithCancel(ctx)
	providerDone := make(chan struct{})
	go func() { defer close(providerDone); f.p.run(pctx) }()
	t.Cleanup(func() { stopProvider(); <-providerDone })

	env := &scenario.Env{Mgmt: mgmt, Workload: wl, Namespace: ns, Cluster: clusterName, BinDir: binDir, K8sBin: f.k8sBin, Dir: t.TempDir()}
	tpmCA, err := tpmtest.NewManufacturerCA("Test TPM Maker", time.Now().Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	tpmCADir := t.TempDir()
	if err := tpmCA.Save(tpmCADir); err != nil {
		t.Fatal(err)
	}
	env.StartController(t, "--tpm-manufacturer-ca="+filepath.Join(tpmCADir, tpmtest.BundleFile))
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("controller log:\n%s", harness.LastLines(env.ControllerLog(), 60))
		}
	})

	f.wait(t, joinTimeout, "Cluster infrastructure provisioned", func() (bool, error) {
		var c clusterv1.Cluster
		if err := mgmt.Client.Get(ctx, keyOf(ns, clusterName), &c); err != nil {
			return false, err
		}
		return ptr.Deref(c.Status.Initialization.InfrastructureProvisioned, false) && c.Spec.ControlPlaneEndpoint.IsValid(), nil
	})

	// The control plane. CABPK writes join data only once the Cluster's
	// ControlPlaneInitialized condition is true (the condition, not
	// status.initialization.controlPlaneInitialized, which only a
	// control-plane provider's object sets). Without a control-plane
	// provider (no spec.controlPlaneRef), Cluster API v1.14's Cluster
	// controller sets the condition when a Machine labelled
	// cluster.x-k8s.io/control-plane has a nodeRef. So: one such Machine,
	// whose bootstrap data is a Secret given as is (the node `kubeadm init`
	// made), whose infrastructure is a TestMachine, and whose node is a hollow
	// kubelet with a certificate from the cluster CA, as kubeadm init issues
	// it. Cluster API finds the Node by its provider ID and sets the nodeRef.
	cpName := clusterName + "-control-plane-0"
	if err := mgmt.Client.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: cpName + "-bootstrap", Namespace: ns, Labels: map[string]string{clusterv1.ClusterNameLabel: clusterName}},
		Type:       clusterv1.ClusterSecretType,
		Data:       map[string][]byte{"value": []byte("#cloud-config\n# kubeadm init ran on this node\n"), "format": []byte("cloud-config")},
	}); err != nil {
		t.Fatal(err)
	}
	createUnstructured(t, dyn, testMachines, ns, "TestMachine", cpName, map[string]any{})
	if err := mgmt.Client.Create(ctx, &clusterv1.Machine{
		ObjectMeta: metav1.ObjectMeta{Name: cpName, Namespace: ns, Labels: map[string]string{
			clusterv1.ClusterNameLabel: clusterName, clusterv1.MachineControlPlaneLabel: "",
		}},
		Spec: clusterv1.MachineSpec{
			ClusterName:       clusterName,
			Version:           "v1.36.3",
			Bootstrap:         clusterv1.Bootstrap{DataSecretName: ptr.To(cpName + "-bootstrap")},
			InfrastructureRef: clusterv1.ContractVersionedObjectReference{APIGroup: infraGroup, Kind: "TestMachine", Name: cpName},
		},
	}); err != nil {
		t.Fatal(err)
	}
	// Cluster API's webhooks are served: a Machine read as v1beta1 goes
	// through the conversion webhook, and a Machine with a version that is
	// no version is refused by the validating webhook.
	v1beta1Machines := schema.GroupVersionResource{Group: clusterv1.GroupVersion.Group, Version: "v1beta1", Resource: "machines"}
	quiet := rest.CopyConfig(mgmt.AdminConfig)
	quiet.WarningHandler = rest.NoWarnings{} // v1beta1 is deprecated; read on purpose
	dynQuiet, err := dynamic.NewForConfig(quiet)
	if err != nil {
		t.Fatal(err)
	}
	old, err := dynQuiet.Resource(v1beta1Machines).Namespace(ns).Get(ctx, cpName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("unable to read a Machine as v1beta1 (conversion webhook): %v", err)
	}
	if kind, _, _ := unstructured.NestedString(old.Object, "spec", "infrastructureRef", "kind"); old.GetAPIVersion() != "cluster.x-k8s.io/v1beta1" || kind != "TestMachine" {
		t.Fatalf("Machine read as v1beta1: %s, infrastructureRef kind %q", old.GetAPIVersion(), kind)
	}
	err = mgmt.Client.Create(ctx, &clusterv1.Machine{
		ObjectMeta: metav1.ObjectMeta{Name: "no-version", Namespace: ns},
		Spec: clusterv1.MachineSpec{
			ClusterName:       clusterName,
			Version:           "not-a-version",
			Bootstrap:         clusterv1.Bootstrap{DataSecretName: ptr.To("none")},
			InfrastructureRef: clusterv1.ContractVersionedObjectReference{APIGroup: infraGroup, Kind: "TestMachine", Name: "none"},
		},
	})
	if err == nil || !strings.Contains(err.Error(), "admission webhook") {
		t.Fatalf("a Machine with version %q: %v, want a denial by Cluster API's validating webhook", "not-a-version", err)
	}

	f.wait(t, joinTimeout, "control plane initialized", func() (bool, error) {
		var c clusterv1.Cluster
		if err := mgmt.Client.Get(ctx, keyOf(ns, clusterName), &c); err != nil {
			return false, err
		}
		return meta.IsStatusConditionTrue(c.Status.Conditions, clusterv1.ClusterControlPlaneInitializedCondition), nil
	})

	// The workers: the documented KubeadmConfigTemplate, verbatim.
	b, err := os.ReadFile(filepath.Join(repo, kubeadmConfigTemplate))
	if err != nil {
		t.Fatal(err)
	}
	kct := &unstructured.Unstructured{}
	if err := yaml.Unmarshal(b, &kct.Object); err != nil {
		t.Fatalf("%s: %v", kubeadmConfigTemplate, err)
	}
	kct.SetNamespace(ns)
	if err := mgmt.Client.Create(ctx, kct); err != nil {
		t.Fatalf("unable to create the KubeadmConfigTemplate of %s: %v", kubeadmConfigTemplate, err)
	}
	for _, tmpl := range []string{"workers-a", "workers-b"} {
		createUnstructured(t, dyn, testTemplate, ns, "TestMachineTemplate", tmpl, map[string]any{"template": map[string]any{"spec": map[string]any{}}})
	}
	md := &clusterv1.MachineDeployment{
		ObjectMeta: metav1.ObjectMeta{Name: "md-0", Namespace: ns},
		Spec: clusterv1.MachineDeploymentSpec{
			ClusterName: clusterName,
			Replicas:    ptr.To[int32](3),
			Template: clusterv1.MachineTemplateSpec{
				Spec: clusterv1.MachineSpec{
					ClusterName: clusterName,
					Version:     "v1.36.3",
					Bootstrap: clusterv1.Bootstrap{ConfigRef: clusterv1.ContractVersionedObjectReference{
						APIGroup: "bootstrap.cluster.x-k8s.io", Kind: "KubeadmConfigTemplate", Name: kct.GetName(),
					}},
					InfrastructureRef: clusterv1.ContractVersionedObjectReference{APIGroup: infraGroup, Kind: "TestMachineTemplate", Name: "workers-a"},
				},
			},
		},
	}
	if err := mgmt.Client.Create(ctx, md); err != nil {
		t.Fatalf("unable to create MachineDeployment: %v", err)
	}

	// Three Machines, made by the MachineSet controller, reach Running.
	first := f.waitRunning(t, md, "insecure", 3, nil, joinTimeout)
	f.reportJoinTimes(t, first)

	t.Run("scale down", func(t *testing.T) {
		patchReplicas(t, mgmt.Client, md, 2)
		var kept []clusterv1.Machine
		f.wait(t, rolloutTimeout, "MachineDeployment scaled to 2", func() (bool, error) {
			ms, err := deploymentMachines(ctx, mgmt.Client, md)
			if err != nil {
				return false, err
			}
			kept = ms
			return len(ms) == 2, nil
		})
		gone := subtract(first, kept)
		if len(gone) != 1 {
			t.Fatalf("scale-down from 3 to 2 deleted %d of the first Machines", len(gone))
		}
		f.waitGone(t, gone)
		f.checkNoDenials(t, env)
	})

	t.Run("rollout", func(t *testing.T) {
		before, err := deploymentMachines(ctx, mgmt.Client, md)
		if err != nil {
			t.Fatal(err)
		}
		patch := client.MergeFrom(md.DeepCopy())
		md.Spec.Template.Spec.InfrastructureRef.Name = "workers-b"
		if err := mgmt.Client.Patch(ctx, md, patch); err != nil {
			t.Fatal(err)
		}
		after := f.waitRunning(t, md, "insecure", 2, before, rolloutTimeout)
		f.reportJoinTimes(t, after)
		f.waitGone(t, before)
		f.checkNoDenials(t, env)
	})

	// The same template with the tpm attestor (each instance's TPM is the
	// simulator of a test build, its seed from the instance metadata): trust
	// on first use records the TPM's EK for the Machine, and the record goes
	// when Cluster API deletes the Machine.
	t.Run("trust-on-first-use record goes with its Machine", func(t *testing.T) {
		const insecureLine = "          attestor: insecure\n"
		if strings.Count(string(b), insecureLine) != 1 {
			t.Fatalf("%s no longer has the line %q this test turns into the tpm attestor", kubeadmConfigTemplate, insecureLine)
		}
		tpmTemplate := strings.Replace(string(b), insecureLine, fmt.Sprintf(`          attestor: tpm
          tpm:
            device: simulator
            simulator:
              seed: {{ ds.meta_data.tpm_seed }}
              manufacturerCADir: %s
`, tpmCADir), 1)
		kct := &unstructured.Unstructured{}
		if err := yaml.Unmarshal([]byte(tpmTemplate), &kct.Object); err != nil {
			t.Fatal(err)
		}
		kct.SetNamespace(ns)
		kct.SetName("workers-tpm")
		if err := mgmt.Client.Create(ctx, kct); err != nil {
			t.Fatal(err)
		}
		mdTPM := &clusterv1.MachineDeployment{
			ObjectMeta: metav1.ObjectMeta{Name: "md-tpm", Namespace: ns},
			Spec:       *md.Spec.DeepCopy(),
		}
		mdTPM.Spec.Replicas = ptr.To[int32](1)
		mdTPM.Spec.Selector = metav1.LabelSelector{}
		mdTPM.Spec.Template.Labels = nil
		mdTPM.Spec.Template.Spec.Bootstrap.ConfigRef.Name = kct.GetName()
		if err := mgmt.Client.Create(ctx, mdTPM); err != nil {
			t.Fatal(err)
		}
		ms := f.waitRunning(t, mdTPM, "tpm", 1, nil, joinTimeout)
		f.reportJoinTimes(t, ms)
		var recs corev1.ConfigMapList
		if err := mgmt.Client.List(ctx, &recs, client.InNamespace(scenario.ControllerNamespace), client.MatchingLabels{tofu.LabelMachineUID: string(ms[0].UID)}); err != nil {
			t.Fatal(err)
		}
		if len(recs.Items) != 1 || !strings.HasPrefix(recs.Items[0].Name, tofu.NamePrefix) || !strings.HasPrefix(recs.Items[0].Data[tofu.KeyIdentity], tpm.StablePrefix) {
			t.Fatalf("Machine %s joined with its TPM; want one trust-on-first-use record of its EK, have %d: %+v", ms[0].Name, len(recs.Items), recs.Items)
		}
		patchReplicas(t, mgmt.Client, mdTPM, 0)
		f.waitGone(t, ms)
		f.checkNoDenials(t, env)
	})
}

// waitRunning waits until md has exactly want Machines, none of them in
// exclude, every one Running with a nodeRef and a certificate from the
// attestor's signer, and returns them.
func (f *fleet) waitRunning(t *testing.T, md *clusterv1.MachineDeployment, attestorName string, want int, exclude []clusterv1.Machine, timeout time.Duration) []clusterv1.Machine {
	t.Helper()
	var ms []clusterv1.Machine
	f.wait(t, timeout, fmt.Sprintf("%d new Machines of %s Running", want, md.Name), func() (bool, error) {
		var err error
		ms, err = deploymentMachines(context.Background(), f.mgmt.Client, md)
		if err != nil {
			return false, err
		}
		if len(ms) != want {
			return false, fmt.Errorf("%d Machines", len(ms))
		}
		for _, m := range ms {
			if slices.ContainsFunc(exclude, func(o clusterv1.Machine) bool { return o.UID == m.UID }) {
				return false, fmt.Errorf("old Machine %s still there", m.Name)
			}
			if m.Status.Phase != string(clusterv1.MachinePhaseRunning) || !m.Status.NodeRef.IsDefined() {
				return false, fmt.Errorf("Machine %s in phase %q, nodeRef %q", m.Name, m.Status.Phase, m.Status.NodeRef.Name)
			}
		}
		return true, nil
	})
	for _, m := range ms {
		if m.Status.NodeRef.Name != m.Name || m.Spec.ProviderID != providerIDScheme+m.Name {
			t.Fatalf("Machine %s: node %q, provider ID %q", m.Name, m.Status.NodeRef.Name, m.Spec.ProviderID)
		}
		f.mu.Lock()
		n := f.nodes[m.Name]
		f.mu.Unlock()
		if n == nil || n.runcmd == nil {
			t.Fatalf("Machine %s is Running but its node did not boot from its bootstrap data", m.Name)
		}
	}
	// Each node's certificate came from the controller, for the signer of
	// the template's attestor, on a CSR the bootstrap token filed.
	for _, m := range ms {
		f.mu.Lock()
		c, ok := f.firstCSR[m.Name]
		f.mu.Unlock()
		if !ok {
			t.Fatalf("Machine %s is Running but no certificate was seen issued for its node", m.Name)
		}
		if c.Spec.SignerName != attestor.ClientSignerName(attestorName) || !strings.HasPrefix(c.Spec.Username, attestor.BootstrapUserPrefix) {
			t.Fatalf("node %s got its first certificate from signer %q on a CSR by %q", m.Name, c.Spec.SignerName, c.Spec.Username)
		}
	}
	// postKubeadmCommands: `credential` got the certificate and the token went.
	for _, m := range ms {
		f.mu.Lock()
		n := f.nodes[m.Name]
		f.mu.Unlock()
		select {
		case <-n.runcmd.Done():
		case <-time.After(2 * time.Minute):
			t.Fatalf("node %s: postKubeadmCommands still running", m.Name)
		}
		if exited, err := n.runcmd.Exited(); !exited || err != nil {
			b, _ := os.ReadFile(n.runcmd.LogPath)
			t.Fatalf("node %s: postKubeadmCommands failed: %v\n%s", m.Name, err, b)
		}
		if _, err := os.Stat(filepath.Join(n.Root, "etc", "kubernetes", "bootstrap-kubelet.conf")); !os.IsNotExist(err) {
			t.Fatalf("node %s: the bootstrap kubeconfig is still on disk after the first certificate (%v)", m.Name, err)
		}
	}
	return ms
}

// reportJoinTimes logs, for each Machine, the time from its creation (the
// API server's, whole seconds) to the moment the test first saw its node's
// client certificate issued.
func (f *fleet) reportJoinTimes(t *testing.T, ms []clusterv1.Machine) {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	var secs []float64
	for _, m := range ms {
		at, ok := f.issued[m.Name]
		if !ok {
			t.Fatalf("Machine %s is Running but no certificate was seen issued for its node", m.Name)
		}
		d := at.Sub(m.CreationTimestamp.Time).Seconds()
		secs = append(secs, d)
		t.Logf("Machine %s: created to certificate issued: %.1f s", m.Name, d)
	}
	sort.Float64s(secs)
	t.Logf("machine-created-to-certificate-issued seconds: min %.1f median %.1f max %.1f (n=%d, real Cluster API core manager + CABPK)",
		secs[0], secs[len(secs)/2], secs[len(secs)-1], len(secs))
}

// waitGone waits until Cluster API has deleted the Machines, their Nodes and
// their infrastructure, and checks that the controller has removed every
// trust-on-first-use record of them.
func (f *fleet) waitGone(t *testing.T, gone []clusterv1.Machine) {
	t.Helper()
	ctx := context.Background()
	for _, m := range gone {
		f.wait(t, rolloutTimeout, "Machine "+m.Name+" deleted with its Node", func() (bool, error) {
			err := f.mgmt.Client.Get(ctx, keyOf(m.Namespace, m.Name), &clusterv1.Machine{})
			if !apierrors.IsNotFound(err) {
				return false, fmt.Errorf("Machine still there (%w)", err)
			}
			if _, err := f.wl.Client.CoreV1().Nodes().Get(ctx, m.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				return false, fmt.Errorf("Node still there (%w)", err)
			}
			return true, nil
		})
		f.wait(t, 2*time.Minute, "trust-on-first-use records of "+m.Name+" removed", func() (bool, error) {
			var list corev1.ConfigMapList
			if err := f.mgmt.Client.List(ctx, &list, client.InNamespace(scenario.ControllerNamespace), client.MatchingLabels{tofu.LabelMachineUID: string(m.UID)}); err != nil {
				return false, err
			}
			return len(list.Items) == 0, nil
		})
	}
}

// checkNoDenials fails the test if any CSR was denied or failed, or the
// controller reported a Warning Event.
func (f *fleet) checkNoDenials(t *testing.T, env *scenario.Env) {
	t.Helper()
	f.observeCSRs(t)
	f.mu.Lock()
	denied := slices.Clone(f.denied)
	f.mu.Unlock()
	if len(denied) > 0 {
		t.Errorf("legitimate nodes were denied:\n%s", strings.Join(denied, "\n"))
	}
	events, err := f.mgmt.ControlPlane.Client.CoreV1().Events("").List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range events.Items {
		if e.Source.Component == "node-attestation-controller" && e.Type == corev1.EventTypeWarning {
			t.Errorf("controller Event %s on %s %s/%s: %s", e.Reason, e.InvolvedObject.Kind, e.InvolvedObject.Namespace, e.InvolvedObject.Name, e.Message)
		}
	}
}

// deploymentMachines lists md's Machines that are not being deleted.
func deploymentMachines(ctx context.Context, c client.Client, md *clusterv1.MachineDeployment) ([]clusterv1.Machine, error) {
	var list clusterv1.MachineList
	if err := c.List(ctx, &list, client.InNamespace(md.Namespace), client.MatchingLabels{clusterv1.MachineDeploymentNameLabel: md.Name}); err != nil {
		return nil, err
	}
	var out []clusterv1.Machine
	for _, m := range list.Items {
		if m.DeletionTimestamp.IsZero() {
			out = append(out, m)
		}
	}
	return out, nil
}

func patchReplicas(t *testing.T, c client.Client, md *clusterv1.MachineDeployment, n int32) {
	t.Helper()
	patch := client.MergeFrom(md.DeepCopy())
	md.Spec.Replicas = ptr.To(n)
	if err := c.Patch(context.Background(), md, patch); err != nil {
		t.Fatal(err)
	}
}

// subtract returns the Machines of a that are not in b.
func subtract(a, b []clusterv1.Machine) []clusterv1.Machine {
	var out []clusterv1.Machine
	for _, m := range a {
		if !slices.ContainsFunc(b, func(o clusterv1.Machine) bool { return o.UID == m.UID }) {
			out = append(out, m)
		}
	}
	return out
}

func createUnstructured(t *testing.T, dyn dynamic.Interface, gvr schema.GroupVersionResource, ns, kind, name string, spec map[string]any) {
	t.Helper()
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": gvr.GroupVersion().String(),
		"kind":       kind,
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec":       spec,
	}}
	if _, err := dyn.Resource(gvr).Namespace(ns).Create(context.Background(), obj, metav1.CreateOptions{}); err != nil {
		t.Fatalf("unable to create %s %s/%s: %v", kind, ns, name, err)
	}
}
