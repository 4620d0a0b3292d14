// Package deploy tests the management-cluster manifests in deploy/: that
// they render, that a real kube-apiserver accepts them (Pod Security
// "restricted" included), that what they configure matches the
// controller's flags, and that the RBAC they grant is all the controller
// needs: the real binary, run with a token of the ServiceAccount, signs a
// CSR in a workload cluster that it reaches with deploy/workload's role.
package deploy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	certificatesv1 "k8s.io/api/certificates/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/signer/app"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/lockdown"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// Names the manifests use.
const (
	namespace      = "kubelet-authenticator-system"
	serviceAccount = "node-attestation-controller"
	deployment     = "node-attestation-controller"
	// workloadUser is the subject of deploy/workload's ClusterRoleBinding.
	workloadUser = "kubelet-authenticator:node-attestation-controller"
)

// manifests is a rendered kustomization.
type manifests struct {
	yaml    []byte
	objects []*unstructured.Unstructured
}

// render runs `kubectl kustomize` (the kustomize built into kubectl) on a
// directory of deploy/.
func render(t *testing.T, dir string) *manifests {
	t.Helper()
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out := kubectl(t, "", nil, "kustomize", filepath.Join(root, "deploy", dir))
	m := &manifests{yaml: out}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096)
	for {
		var u unstructured.Unstructured
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			t.Fatalf("deploy/%s: %v", dir, err)
		}
		if len(u.Object) > 0 {
			m.objects = append(m.objects, &u)
		}
	}
	return m
}

// get converts the one object of kind and name into out.
func (m *manifests) get(t *testing.T, kind, name string, out any) {
	t.Helper()
	for _, u := range m.objects {
		if u.GetKind() == kind && u.GetName() == name {
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, out); err != nil {
				t.Fatalf("%s %s: %v", kind, name, err)
			}
			return
		}
	}
	t.Fatalf("no %s %s in the manifests", kind, name)
}

func (m *manifests) kinds() map[string]bool {
	k := map[string]bool{}
	for _, u := range m.objects {
		k[u.GetKind()] = true
	}
	return k
}

// kubectl runs the kubectl of the Kubernetes binaries.
func kubectl(t *testing.T, kubeconfig string, stdin []byte, args ...string) []byte {
	t.Helper()
	if kubeconfig != "" {
		args = append([]string{"--kubeconfig", kubeconfig}, args...)
	}
	cmd := exec.Command(filepath.Join(harness.Binaries(t), "kubectl"), args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return out
}

// apply applies m server-side, as the deploy/ README says to.
func apply(t *testing.T, kubeconfig string, m *manifests) {
	t.Helper()
	kubectl(t, kubeconfig, m.yaml, "apply", "--server-side", "--field-manager=kubelet-authenticator-test", "-f", "-")
}

// TestManifests renders deploy/ and its attestor-config example, applies
// them to a real management cluster, and checks that what they configure
// agrees with the controller: its flags parse, the probes, metrics port and
// Lease are the ones the flags set, the pod passes Pod Security
// "restricted", the example AttestorConfig is valid.
func TestManifests(t *testing.T) {
	harness.Binaries(t)
	base := render(t, ".")
	withConfig := render(t, "examples/attestor-config")
	workload := render(t, "workload")

	for _, kind := range []string{"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Deployment", "Service", "PodDisruptionBudget",
		"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "CustomResourceDefinition"} {
		if !base.kinds()[kind] {
			t.Errorf("deploy/ has no %s", kind)
		}
	}

	var d appsv1.Deployment
	withConfig.get(t, "Deployment", deployment, &d)
	if d.Namespace != namespace || d.Spec.Replicas == nil || *d.Spec.Replicas != 2 {
		t.Errorf("Deployment %s/%s replicas %v, want 2 in %s", d.Namespace, d.Name, d.Spec.Replicas, namespace)
	}
	pod := d.Spec.Template.Spec
	if len(pod.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(pod.Containers))
	}
	c := pod.Containers[0]

	// The arguments are the controller's flags, and say what the probes,
	// ports and RBAC assume.
	fs := app.NewCommand().Flags()
	if err := fs.Parse(c.Args); err != nil {
		t.Fatalf("container args %q: %v", c.Args, err)
	}
	flag := func(name string) string {
		f := fs.Lookup(name)
		if f == nil {
			t.Fatalf("no flag --%s", name)
		}
		return f.Value.String()
	}
	if flag("leader-elect") != "true" {
		t.Error("--leader-elect is not true")
	}
	port := func(name string) int32 {
		for _, p := range c.Ports {
			if p.Name == name {
				return p.ContainerPort
			}
		}
		t.Fatalf("no container port %q", name)
		return 0
	}
	if got, want := flag("health-probe-bind-address"), fmt.Sprintf(":%d", port("health")); got != want {
		t.Errorf("--health-probe-bind-address %s, container port health %s", got, want)
	}
	if got, want := flag("metrics-bind-address"), fmt.Sprintf(":%d", port("metrics")); got != want {
		t.Errorf("--metrics-bind-address %s, container port metrics %s", got, want)
	}
	for probe, want := range map[*corev1.Probe]string{c.LivenessProbe: "/healthz", c.ReadinessProbe: "/readyz"} {
		if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Path != want || probe.HTTPGet.Port.String() != "health" {
			t.Errorf("probe %+v, want GET %s on port health", probe, want)
		}
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() {
		t.Error("no CPU or memory request")
	}
	sc := c.SecurityContext
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" {
		t.Errorf("container securityContext %+v", sc)
	}
	psc := pod.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser != 65532 ||
		psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod securityContext %+v", psc)
	}
	if pod.ServiceAccountName != serviceAccount {
		t.Errorf("serviceAccountName %q", pod.ServiceAccountName)
	}

	// The example AttestorConfig is what --attestor-config reads.
	var cms corev1.ConfigMapList
	for _, u := range withConfig.objects {
		if u.GetKind() == "ConfigMap" {
			var cm corev1.ConfigMap
			withConfig.get(t, "ConfigMap", u.GetName(), &cm)
			cms.Items = append(cms.Items, cm)
		}
	}
	if len(cms.Items) != 1 {
		t.Fatalf("%d ConfigMaps in the attestor-config example, want 1", len(cms.Items))
	}
	cfgPath := filepath.Join(t.TempDir(), "attestor-config.yaml")
	if err := os.WriteFile(cfgPath, []byte(cms.Items[0].Data["attestor-config.yaml"]), 0o600); err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(flag("attestor-config"), "/attestor-config.yaml") {
		t.Errorf("--attestor-config %q", flag("attestor-config"))
	}
	ac, err := app.LoadAttestorConfig(cfgPath)
	if err == nil {
		err = ac.Validate()
	}
	if err != nil {
		t.Errorf("example AttestorConfig: %v", err)
	}

	// The Service, the PDB and the Lease match the pods and the flags.
	var svc corev1.Service
	base.get(t, "Service", "node-attestation-controller-metrics", &svc)
	var pdb policyv1.PodDisruptionBudget
	base.get(t, "PodDisruptionBudget", deployment, &pdb)
	podLabels := d.Spec.Template.Labels
	for what, sel := range map[string]map[string]string{"Service": svc.Spec.Selector, "PodDisruptionBudget": pdb.Spec.Selector.MatchLabels} {
		for k, v := range sel {
			if podLabels[k] != v {
				t.Errorf("%s selects %s=%s, the pods have %q", what, k, v, podLabels[k])
			}
		}
	}
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].TargetPort.String() != "metrics" {
		t.Errorf("Service ports %+v, want the metrics port", svc.Spec.Ports)
	}
	var role rbacv1.Role
	base.get(t, "Role", deployment, &role)
	leaseNamed := false
	for _, r := range role.Rules {
		for _, n := range r.ResourceNames {
			leaseNamed = leaseNamed || (n == flag("leader-election-id") && n == app.DefaultLeaderElectionID)
		}
	}
	if !leaseNamed {
		t.Errorf("the Role does not name the Lease %s", flag("leader-election-id"))
	}

	// A real API server accepts all of it, and admits the pod under the
	// namespace's Pod Security level.
	mgmt := harness.StartManagement(t)
	apply(t, mgmt.AdminKubeconfig, base)
	apply(t, mgmt.AdminKubeconfig, withConfig)
	wl := harness.StartControlPlane(t, "workload")
	apply(t, wl.AdminKubeconfig, workload)

	ctx := context.Background()
	got, err := mgmt.ControlPlane.Client.AppsV1().Deployments(namespace).Get(ctx, deployment, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Spec.Template.Spec.Volumes == nil || !strings.Contains(strings.Join(got.Spec.Template.Spec.Containers[0].Args, " "), "--attestor-config=") {
		t.Error("the applied Deployment lacks the attestor configuration of the example")
	}
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: deployment + "-", Namespace: namespace, Labels: d.Spec.Template.Labels},
		Spec:       *got.Spec.Template.Spec.DeepCopy(),
	}
	if _, err := mgmt.ControlPlane.Client.CoreV1().Pods(namespace).Create(ctx, p, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
		t.Errorf("the Deployment's pod is not admitted: %v", err)
	}
	ns, err := mgmt.ControlPlane.Client.CoreV1().Namespaces().Get(ctx, namespace, metav1.GetOptions{})
	if err != nil || ns.Labels["pod-security.kubernetes.io/enforce"] != "restricted" {
		t.Errorf("namespace %s does not enforce Pod Security restricted: %v", namespace, err)
	}
}

// TestRBACIsSufficient runs two replicas of the real controller binary with
// the Deployment's arguments and nothing but a token of deploy/'s
// ServiceAccount, against a management cluster with an opted-in Cluster
// whose kubeconfig Secret names a user bound only to deploy/workload's
// role. One replica leads; a CSR is signed; the leader stops and the other
// takes over and signs the next one; the serving CA is published as a
// ClusterTrustBundle. Neither replica logs a forbidden request. The
// trust-on-first-use records (which the insecure attestor does not use) are
// exercised through the same token.
func TestRBACIsSufficient(t *testing.T) {
	harness.Binaries(t)
	bin := buildController(t)
	base, workload := render(t, "."), render(t, "workload")
	var d appsv1.Deployment
	base.get(t, "Deployment", deployment, &d)

	mgmt := harness.StartManagement(t)
	wl := harness.StartControlPlane(t, "workload")
	apply(t, mgmt.AdminKubeconfig, base)
	apply(t, wl.AdminKubeconfig, workload)

	const ns, cluster = "fleet", "wl1"
	mgmt.AddWorkloadCluster(t, ns, cluster, wl, map[string]string{
		capi.AnnotationEnabled:             "true",
		capi.AnnotationAuthorizedAttestors: "insecure",
	})
	// The Machines' infrastructure objects, as a provider keeps them: the
	// controller watches their metadata.
	mgmt.ServeInfrastructure(t, ns)
	// The workload cluster as deploy/workload's user, not as its admin.
	certPEM, keyPEM := wl.IssueClientCert(t, workloadUser)
	restricted := wl.KubeconfigFor("", clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM})
	ctx := context.Background()
	var kc corev1.Secret
	if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: cluster + capi.KubeconfigSecretSuffix}, &kc); err != nil {
		t.Fatal(err)
	}
	kc.Data[capi.KubeconfigSecretKey] = restricted
	if err := mgmt.Client.Update(ctx, &kc); err != nil {
		t.Fatal(err)
	}

	// The ServiceAccount's token, as a pod would have it.
	tr, err := mgmt.ControlPlane.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, serviceAccount,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr(int64(3600))}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(t.TempDir(), "sa.kubeconfig")
	if err := os.WriteFile(kubeconfig, mgmt.KubeconfigFor("", clientcmdapi.AuthInfo{Token: tr.Status.Token}), 0o600); err != nil {
		t.Fatal(err)
	}
	saConfig, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	sa, err := client.New(saConfig, client.Options{Scheme: mgmt.Client.Scheme()})
	if err != nil {
		t.Fatal(err)
	}

	// What the ServiceAccount cannot do (issue 14.2): list Secrets (it gets
	// the ones it needs by name), or write a tenant's Secret other than the
	// serving CA it keeps (admission.yaml; the policy takes a moment to be
	// enforced after it is created).
	if err := sa.List(ctx, &corev1.SecretList{}, client.InNamespace(ns)); !apierrors.IsForbidden(err) {
		t.Errorf("the ServiceAccount lists Secrets: %v, want forbidden", err)
	}
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		var s corev1.Secret
		if err := sa.Get(ctx, types.NamespacedName{Namespace: ns, Name: cluster + capi.KubeconfigSecretSuffix}, &s); err != nil {
			return false, err
		}
		s.Data["stolen"] = []byte("x")
		err := sa.Update(ctx, &s)
		if err == nil {
			return false, fmt.Errorf("the ServiceAccount rewrote the tenant's kubeconfig Secret")
		}
		return apierrors.IsInvalid(err) || apierrors.IsForbidden(err), nil
	})
	planted := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "planted"}, Type: corev1.SecretTypeTLS,
		Data: map[string][]byte{corev1.TLSCertKey: []byte("x"), corev1.TLSPrivateKeyKey: []byte("y")}}
	if err := sa.Create(ctx, planted); err == nil {
		t.Error("the ServiceAccount created a Secret in a tenant's namespace")
	}
	// Nor a ClusterAttestation that speaks for no Cluster, or for another.
	for _, owner := range []string{"", cluster} {
		att := &unstructured.Unstructured{}
		att.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
		att.SetNamespace(ns)
		att.SetName("planted")
		att.SetLabels(map[string]string{clusterv1.ClusterNameLabel: "planted"})
		if owner != "" {
			att.SetOwnerReferences([]metav1.OwnerReference{{APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: owner, UID: "x"}})
		}
		// The policy takes a moment to be enforced after it is created.
		harness.WaitFor(t, 30*time.Second, func() (bool, error) {
			err := sa.Create(ctx, att.DeepCopy())
			if err == nil {
				return false, mgmt.Client.Delete(ctx, att)
			}
			return apierrors.IsInvalid(err), nil
		})
	}

	// Two replicas with the Deployment's arguments; the pod's namespace
	// (from its service account) given as a flag, the ports made free.
	dir := t.TempDir()
	type replica struct {
		proc   *harness.Process
		log    string
		health int
	}
	start := func(i int) *replica {
		r := &replica{log: filepath.Join(dir, fmt.Sprintf("controller-%d.log", i)), health: harness.FreePort(t)}
		args := append(append([]string(nil), d.Spec.Template.Spec.Containers[0].Args...),
			"--kubeconfig="+kubeconfig,
			"--leader-election-namespace="+namespace,
			fmt.Sprintf("--metrics-bind-address=127.0.0.1:%d", harness.FreePort(t)),
			fmt.Sprintf("--health-probe-bind-address=127.0.0.1:%d", r.health),
			"-v=2")
		r.proc = harness.StartProcess(t, fmt.Sprintf("controller-%d", i), r.log, bin, args...)
		return r
	}
	replicas := []*replica{start(0), start(1)}
	for _, r := range replicas {
		for _, path := range []string{"/healthz", "/readyz"} {
			url := fmt.Sprintf("http://127.0.0.1:%d%s", r.health, path)
			harness.WaitFor(t, 30*time.Second, func() (bool, error) {
				resp, err := http.Get(url)
				if err != nil {
					return false, nil
				}
				resp.Body.Close()
				return resp.StatusCode == http.StatusOK, nil
			})
		}
	}

	// leader waits for the Lease to be held and for exactly one running
	// replica to say it acquired it, and returns that replica.
	leader := func() int {
		t.Helper()
		found := -1
		harness.WaitFor(t, 60*time.Second, func() (bool, error) {
			var l coordinationv1.Lease
			if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: namespace, Name: app.DefaultLeaderElectionID}, &l); err != nil {
				return false, client.IgnoreNotFound(err)
			}
			if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" {
				return false, nil
			}
			found = -1
			for i, r := range replicas {
				if r == nil || !strings.Contains(readFile(t, r.log), "Successfully acquired lease") {
					continue
				}
				if found >= 0 {
					return false, fmt.Errorf("replicas %d and %d both lead", found, i)
				}
				found = i
			}
			return found >= 0, nil
		})
		return found
	}

	bootstrap := bootstrapClient(t, wl)
	sign := func(node string) {
		t.Helper()
		pid := "test:///" + node
		mgmt.CreateMachine(t, ns, cluster, node, pid, true)
		req, _ := signertest.Request{NodeName: node, ProviderID: pid}.Build(t)
		csr := signertest.CSR(node, req)
		csr.Spec.Username, csr.Spec.Groups = "", nil
		if _, err := bootstrap.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		harness.WaitFor(t, 60*time.Second, func() (bool, error) {
			got, err := wl.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, node, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			for _, c := range got.Status.Conditions {
				if c.Type == certificatesv1.CertificateDenied || c.Type == certificatesv1.CertificateFailed {
					return false, fmt.Errorf("CSR %s: %s %s: %s", node, c.Type, c.Reason, c.Message)
				}
			}
			return len(got.Status.Certificate) > 0, nil
		})
	}

	first := leader()
	sign("node-1")
	t.Logf("replica %d leads and signed node-1", first)

	// The leader reports the Cluster in its ClusterAttestation, written
	// with the ServiceAccount's rights through admission.yaml's policy.
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		att := &unstructured.Unstructured{}
		att.SetGroupVersionKind(v1alpha1.ClusterAttestationGVK)
		if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: cluster}, att); err != nil {
			return false, client.IgnoreNotFound(err)
		}
		csr, _, _ := unstructured.NestedString(att.Object, "status", "lastDecision", "csr")
		outcome, _, _ := unstructured.NestedString(att.Object, "status", "lastDecision", "outcome")
		return csr == "node-1" && outcome == "approved", nil
	})

	// What the leader made with the ServiceAccount's rights: the serving CA
	// in the Cluster's namespace, the TPM key in its own.
	for _, nn := range []types.NamespacedName{
		{Namespace: ns, Name: cluster + capi.ServingCASecretSuffix},
		{Namespace: namespace, Name: app.DefaultTPMKeySecretName},
	} {
		if err := mgmt.Client.Get(ctx, nn, &corev1.Secret{}); err != nil {
			t.Errorf("secret %s: %v", nn, err)
		}
	}

	// The serving CA reached the workload cluster through the workload role
	// (create with the attest verb on the serving signer names).
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		ctbs, err := wl.Client.CertificatesV1beta1().ClusterTrustBundles().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, b := range ctbs.Items {
			if b.Spec.SignerName == "cluster.x-k8s.io/kubelet-serving-insecure" {
				return true, nil
			}
		}
		return false, nil
	})

	// The leader stops (a rollout); the standby takes the Lease and signs.
	replicas[first].proc.Stop(10 * time.Second)
	stopped := replicas[first]
	replicas[first] = nil
	second := leader()
	sign("node-2")
	t.Logf("replica %d took over and signed node-2", second)

	for _, r := range append(replicas, stopped) {
		if r == nil {
			continue
		}
		if log := readFile(t, r.log); strings.Contains(strings.ToLower(log), "forbidden") {
			t.Errorf("%s logs a forbidden request:\n%s", r.proc.Name, grep(log, "orbidden"))
		}
	}

	// Trust on first use through the ServiceAccount: a record is read,
	// created in the controller's namespace, and, once its Machine is
	// gone, deleted so that the identity can move to another Machine.
	store := &tofu.Store{Namespace: namespace, Client: sa, Reader: sa}
	m1 := mgmt.CreateMachine(t, ns, cluster, "tofu-1", "test:///tofu-1", true)
	m2 := mgmt.CreateMachine(t, ns, cluster, "tofu-2", "test:///tofu-2", true)
	cm := func(m *clusterv1.Machine) *engine.Machine {
		return &engine.Machine{Namespace: m.Namespace, Name: m.Name, UID: m.UID}
	}
	if err := store.Bind(ctx, cm(m1), "ek:abc"); err != nil {
		t.Fatalf("bind as the ServiceAccount: %v", err)
	}
	if err := mgmt.Client.Delete(ctx, m1); err != nil {
		t.Fatal(err)
	}
	// The leader's cleaner, with the ServiceAccount's rights, removes the
	// record of the deleted Machine.
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		err := sa.Get(ctx, types.NamespacedName{Namespace: namespace, Name: tofu.Name("ek:abc")}, &corev1.ConfigMap{})
		return apierrors.IsNotFound(err), client.IgnoreNotFound(err)
	})
	if err := store.Bind(ctx, cm(m2), "ek:abc"); err != nil {
		t.Fatalf("bind to the new Machine: %v", err)
	}

	// Lockdown through deploy/workload's role: kubeadm's bootstrap
	// auto-approve binding is disarmed (an update, which needs bind on its
	// ClusterRole) and restored when lockdown is lifted.
	bootstrapBinding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: lockdown.KubeadmAutoApproveBootstrap},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: lockdown.NodeClientRole},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: "system:bootstrappers:kubeadm:default-node-token"}},
	}
	if _, err := wl.Client.RbacV1().ClusterRoleBindings().Create(ctx, bootstrapBinding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	setLockdown := func(v string) {
		t.Helper()
		var c clusterv1.Cluster
		if err := mgmt.Client.Get(ctx, types.NamespacedName{Namespace: ns, Name: cluster}, &c); err != nil {
			t.Fatal(err)
		}
		c.Annotations[capi.AnnotationLockdown] = v
		if err := mgmt.Client.Update(ctx, &c); err != nil {
			t.Fatal(err)
		}
	}
	bootstrapSubjects := func(want int) {
		t.Helper()
		harness.WaitFor(t, 60*time.Second, func() (bool, error) {
			b, err := wl.Client.RbacV1().ClusterRoleBindings().Get(ctx, lockdown.KubeadmAutoApproveBootstrap, metav1.GetOptions{})
			return err == nil && len(b.Subjects) == want, err
		})
	}
	setLockdown("true")
	bootstrapSubjects(0)
	setLockdown("false")
	bootstrapSubjects(1)
	// Revocation through deploy/workload's role: the policy, its binding
	// and the controller's record are in place (docs/revocation.md).
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		if _, err := wl.Client.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Get(ctx, revoke.PolicyName, metav1.GetOptions{}); err != nil {
			return false, client.IgnoreNotFound(err)
		}
		_, err := wl.Client.CoreV1().ConfigMaps(revoke.Namespace).Get(ctx, revoke.ConfigMapName, metav1.GetOptions{})
		return err == nil, client.IgnoreNotFound(err)
	})
	if log := readFile(t, replicas[second].log); strings.Contains(strings.ToLower(log), "forbidden") {
		t.Errorf("%s logs a forbidden request:\n%s", replicas[second].proc.Name, grep(log, "orbidden"))
	}
}

// buildController builds node-attestation-controller as released
// (CGO_ENABLED=0).
func buildController(t *testing.T) string {
	t.Helper()
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "node-attestation-controller")
	cmd := exec.Command("go", "build", "-o", out, "./cmd/node-attestation-controller")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, b)
	}
	return out
}

// bootstrapClient returns a client of wl that authenticates with a new
// bootstrap token, as a joining node does.
func bootstrapClient(t *testing.T, wl *harness.ControlPlane) kubernetes.Interface {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", wl.BootstrapKubeconfig(t, wl.CreateBootstrapToken(t)))
	if err != nil {
		t.Fatal(err)
	}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(b)
}

func grep(s, substr string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, substr) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func ptr[T any](v T) *T { return &v }
