package harness

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// TestManagementAndWorkload starts a management and a workload control plane
// and checks everything other tests rely on, then that Stop leaves no process.
func TestManagementAndWorkload(t *testing.T) {
	start := time.Now()
	wl := StartControlPlane(t, "workload")
	t.Logf("workload control plane ready in %s", time.Since(start).Round(time.Millisecond))
	start = time.Now()
	m := StartManagement(t)
	t.Logf("management control plane with Cluster API CRDs ready in %s", time.Since(start).Round(time.Millisecond))
	ctx := context.Background()

	t.Run("kubectl with admin kubeconfig", func(t *testing.T) {
		out, err := exec.Command(filepath.Join(Binaries(t), "kubectl"), "--kubeconfig", wl.AdminKubeconfig, "get", "ns", "-o", "name").CombinedOutput()
		if err != nil {
			t.Fatalf("kubectl get ns: %v\n%s", err, out)
		}
		if !strings.Contains(string(out), "namespace/kube-system") {
			t.Errorf("kubectl get ns does not list kube-system:\n%s", out)
		}
	})

	t.Run("admin is system:masters", func(t *testing.T) {
		user, err := WhoAmI(ctx, wl.Client)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(user.Groups, "system:masters") {
			t.Errorf("admin user %+v is not in system:masters", user)
		}
	})

	t.Run("bootstrap token", func(t *testing.T) {
		token := wl.CreateBootstrapToken(t)
		id, _, _ := strings.Cut(token, ".")
		if len(id) != 6 || len(token) != 23 {
			t.Fatalf("token %q is not of the form abcdef.0123456789abcdef", token)
		}
		cfg, err := clientcmd.BuildConfigFromFlags("", wl.BootstrapKubeconfig(t, token))
		if err != nil {
			t.Fatal(err)
		}
		client, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		user, err := WhoAmI(ctx, client)
		if err != nil {
			t.Fatal(err)
		}
		if user.Username != attestor.BootstrapUserPrefix+id {
			t.Errorf("token authenticates as %q, want system:bootstrap:%s", user.Username, id)
		}
		for _, g := range []string{attestor.BootstrappersGroup, "system:bootstrappers:kubeadm:default-node-token"} {
			if !slices.Contains(user.Groups, g) {
				t.Errorf("token user groups %v lack %s", user.Groups, g)
			}
		}
		// system:node-bootstrapper lets it create CSRs, and nothing approves them.
		if _, err := client.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{}); err != nil {
			t.Errorf("bootstrap token cannot list CSRs: %v", err)
		}
		if _, err := client.CoreV1().Secrets(metav1.NamespaceSystem).List(ctx, metav1.ListOptions{}); err == nil {
			t.Errorf("bootstrap token can list Secrets in kube-system")
		}
		crbs, err := wl.Client.RbacV1().ClusterRoleBindings().List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, crb := range crbs.Items {
			if strings.Contains(crb.RoleRef.Name, "certificatesigningrequests:nodeclient") {
				t.Errorf("auto-approve binding %s exists", crb.Name)
			}
		}
	})

	t.Run("ClusterTrustBundle API served", func(t *testing.T) {
		resources, err := wl.Client.Discovery().ServerResourcesForGroupVersion(certificatesv1beta1.SchemeGroupVersion.String())
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(resources.APIResources, func(r metav1.APIResource) bool { return r.Name == "clustertrustbundles" }) {
			t.Fatalf("certificates.k8s.io/v1beta1 does not serve clustertrustbundles: %+v", resources.APIResources)
		}
		_, err = wl.Client.CertificatesV1beta1().ClusterTrustBundles().Create(ctx, &certificatesv1beta1.ClusterTrustBundle{
			ObjectMeta: metav1.ObjectMeta{Name: "harness-test"},
			Spec:       certificatesv1beta1.ClusterTrustBundleSpec{TrustBundle: string(wl.CACertPEM)},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Errorf("unable to create ClusterTrustBundle: %v", err)
		}
	})

	t.Run("Cluster API CRDs served", func(t *testing.T) {
		for _, kind := range []string{"ClusterList", "MachineList", "MachineSetList", "MachineDeploymentList", "MachinePoolList"} {
			list := &unstructured.UnstructuredList{}
			list.SetAPIVersion(clusterv1.GroupVersion.String())
			list.SetKind(kind)
			if err := m.Client.List(ctx, list); err != nil {
				t.Errorf("unable to list %s: %v", kind, err)
			}
		}
	})

	t.Run("workload cluster secrets", func(t *testing.T) {
		annotations := map[string]string{"kubelet-authenticator.x-k8s.io/enabled": "true"}
		cluster := m.AddWorkloadCluster(t, "capi-system-test", "wl1", wl, annotations)
		if cluster.Annotations["kubelet-authenticator.x-k8s.io/enabled"] != "true" || cluster.UID == "" {
			t.Errorf("cluster not created as asked: %+v", cluster.ObjectMeta)
		}
		for _, name := range []string{"wl1-kubeconfig", "wl1-ca"} {
			var s corev1.Secret
			if err := m.Client.Get(ctx, types.NamespacedName{Namespace: "capi-system-test", Name: name}, &s); err != nil {
				t.Fatal(err)
			}
			if s.Type != clusterv1.ClusterSecretType || s.Labels[clusterv1.ClusterNameLabel] != "wl1" {
				t.Errorf("secret %s: type %q labels %v", name, s.Type, s.Labels)
			}
			if name == "wl1-ca" {
				if string(s.Data["tls.crt"]) != string(wl.CACertPEM) || string(s.Data["tls.key"]) != string(wl.CAKeyPEM) {
					t.Errorf("secret wl1-ca does not hold the workload CA")
				}
				continue
			}
			// The kubeconfig reaches the workload cluster as an admin.
			cfg, err := clientcmd.RESTConfigFromKubeConfig(s.Data["value"])
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Host != wl.URL {
				t.Errorf("kubeconfig server %q, want %q", cfg.Host, wl.URL)
			}
			client, err := kubernetes.NewForConfig(cfg)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := client.CoreV1().Secrets(metav1.NamespaceSystem).List(ctx, metav1.ListOptions{}); err != nil {
				t.Errorf("kubeconfig from wl1-kubeconfig cannot list kube-system secrets: %v", err)
			}
		}
	})

	t.Run("machine", func(t *testing.T) {
		m.CreateMachine(t, "capi-system-test", "wl1", "wl1-md-0-abc", "aws:///us-east-1a/i-0abc", true, "ip-10-0-0-1.ec2.internal", "node-1")
		m.CreateMachine(t, "capi-system-test", "wl1", "wl1-md-0-def", "aws:///us-east-1a/i-0def", false)
		var got clusterv1.Machine
		if err := m.Client.Get(ctx, types.NamespacedName{Namespace: "capi-system-test", Name: "wl1-md-0-abc"}, &got); err != nil {
			t.Fatal(err)
		}
		if got.Spec.ProviderID != "aws:///us-east-1a/i-0abc" || got.Spec.ClusterName != "wl1" || got.Labels[clusterv1.ClusterNameLabel] != "wl1" {
			t.Errorf("machine spec %+v labels %v", got.Spec, got.Labels)
		}
		if b := got.Status.Initialization.BootstrapDataSecretCreated; b == nil || !*b {
			t.Errorf("bootstrapDataSecretCreated = %v, want true", b)
		}
		want := clusterv1.MachineAddresses{{Type: clusterv1.MachineHostName, Address: "ip-10-0-0-1.ec2.internal"}, {Type: clusterv1.MachineHostName, Address: "node-1"}}
		if !slices.Equal(got.Status.Addresses, want) {
			t.Errorf("addresses %v, want %v", got.Status.Addresses, want)
		}
		var list clusterv1.MachineList
		if err := m.Client.List(ctx, &list, client.InNamespace("capi-system-test"), client.MatchingLabels{clusterv1.ClusterNameLabel: "wl1"}); err != nil {
			t.Fatal(err)
		}
		if len(list.Items) != 2 {
			t.Fatalf("listed %d machines, want 2", len(list.Items))
		}
		for _, item := range list.Items {
			if item.Name == "wl1-md-0-def" {
				if b := item.Status.Initialization.BootstrapDataSecretCreated; b == nil || *b {
					t.Errorf("bootstrapDataSecretCreated = %v, want false", b)
				}
			}
		}
	})

	t.Run("node authorization and NodeRestriction", func(t *testing.T) {
		certPEM, keyPEM := wl.IssueClientCert(t, "system:node:node-a", attestor.NodesGroup)
		client, err := kubernetes.NewForConfig(wl.RESTConfigFor(t, clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}))
		if err != nil {
			t.Fatal(err)
		}
		node := func(name string) *corev1.Node { return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}} }
		if _, err := client.CoreV1().Nodes().Create(ctx, node("node-a"), metav1.CreateOptions{}); err != nil {
			t.Errorf("node-a cannot register itself: %v", err)
		}
		if _, err := client.CoreV1().Nodes().Create(ctx, node("node-b"), metav1.CreateOptions{}); !apierrors.IsForbidden(err) {
			t.Errorf("node-a registering node-b: err = %v, want Forbidden", err)
		}
	})

	t.Run("kube-controller-manager signs approved CSRs with the cluster CA", func(t *testing.T) {
		wl.StartControllerManager(t, "csrsigning")
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "alice"}}, key)
		if err != nil {
			t.Fatal(err)
		}
		csrs := wl.Client.CertificatesV1().CertificateSigningRequests()
		csr, err := csrs.Create(ctx, &certificatesv1.CertificateSigningRequest{
			ObjectMeta: metav1.ObjectMeta{Name: "alice"},
			Spec: certificatesv1.CertificateSigningRequestSpec{
				Request:    pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}),
				SignerName: certificatesv1.KubeAPIServerClientSignerName,
				Usages:     []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		csr.Status.Conditions = append(csr.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
			Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue, Reason: "HarnessTest",
		})
		if _, err := csrs.UpdateApproval(ctx, csr.Name, csr, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		WaitFor(t, 60*time.Second, func() (bool, error) {
			csr, err = csrs.Get(ctx, csr.Name, metav1.GetOptions{})
			return err == nil && len(csr.Status.Certificate) > 0, err
		})
		block, _ := pem.Decode(csr.Status.Certificate)
		if block == nil {
			t.Fatalf("issued certificate is not PEM: %q", csr.Status.Certificate)
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		if err := cert.CheckSignatureFrom(wl.CA.Cert); err != nil {
			t.Errorf("issued certificate not signed by the cluster CA: %v", err)
		}
	})

	t.Run("stop leaves no process", func(t *testing.T) {
		var procs []*Process
		for _, cp := range []*ControlPlane{wl, m.ControlPlane} {
			procs = append(procs, cp.Processes()...)
		}
		if len(procs) != 5 {
			t.Fatalf("%d processes, want 5 (etcd, kube-apiserver twice, kube-controller-manager)", len(procs))
		}
		start := time.Now()
		wl.Stop()
		m.Stop()
		m.Stop() // idempotent
		t.Logf("both control planes stopped in %s", time.Since(start).Round(time.Millisecond))
		for _, p := range procs {
			if exited, _ := p.Exited(); !exited {
				t.Errorf("%s (pid %d) still running", p.Name, p.PID())
			}
			if err := syscall.Kill(p.PID(), 0); !errors.Is(err, syscall.ESRCH) {
				t.Errorf("%s (pid %d): kill -0 = %v, want ESRCH", p.Name, p.PID(), err)
			}
			if err := syscall.Kill(-p.PID(), 0); !errors.Is(err, syscall.ESRCH) {
				t.Errorf("%s process group %d: kill -0 = %v, want ESRCH", p.Name, p.PID(), err)
			}
		}
	})
}
