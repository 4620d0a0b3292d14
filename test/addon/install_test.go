package addon

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/lockdown"
	"sigs.k8s.io/kubelet-authenticator/signer/signertest"
	"sigs.k8s.io/kubelet-authenticator/signer/standalone"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestInstallOnManagementCluster applies what clusterctl installs and what
// the chart renders, server-side, to a real management kube-apiserver (the
// second apply changes no field the first one set: they agree), and runs
// the real controller binary from the installed Deployment's arguments with
// the operator asking for JSON logs (a clusterctl variable) and a token of
// the installed ServiceAccount. Every line it logs is a JSON object; its
// /metrics answers over HTTPS, with the certificate it was given, a token
// bound to the metrics-reader ClusterRole and nobody else: 403 for another
// token, 401 without one. The installed pod passes Pod Security
// "restricted".
func TestInstallOnManagementCluster(t *testing.T) {
	tl := getTools(t)
	r := newRepository(t, tl)
	components, comps := r.components(t)
	chartYAML, charted := chart(t, tl, namespace)
	bin := buildController(t)

	mgmt := harness.StartManagement(t)
	kubectl := func(stdin []byte, args ...string) []byte {
		t.Helper()
		return run(t, nil, stdin, tl.kubectl, append([]string{"--kubeconfig", mgmt.AdminKubeconfig}, args...)...)
	}
	// Without --force-conflicts: the chart's apply fails if it sets any
	// field to another value than the components did.
	kubectl(components, "apply", "--server-side", "--field-manager=clusterctl", "-f", "-")
	kubectl(chartYAML, "apply", "--server-side", "--field-manager=helm", "-f", "-")
	for what, objs := range map[string]objects{"components": comps, "chart": charted} {
		for _, u := range objs {
			ref := strings.ToLower(u.GetKind()) + "/" + u.GetName()
			args := []string{"get", "-o", "name", ref}
			if !slices.Contains(clusterScoped, u.GetKind()) {
				args = append(args, "-n", u.GetNamespace())
			}
			if out := strings.TrimSpace(string(kubectl(nil, args...))); out == "" {
				t.Errorf("%s: %s %s is not on the server", what, u.GetKind(), u.GetName())
			}
		}
	}
	ctx := context.Background()
	cs := mgmt.ControlPlane.Client
	d, err := cs.AppsV1().Deployments(namespace).Get(ctx, deployment, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := d.Labels["clusterctl.cluster.x-k8s.io"]; !ok || d.Labels["app.kubernetes.io/managed-by"] != "Helm" {
		t.Errorf("Deployment labels %v: want both clusterctl's and Helm's", d.Labels)
	}
	// The installed pod passes the namespace's Pod Security level
	// (restricted, from the components' Namespace).
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: deployment + "-", Namespace: namespace, Labels: d.Spec.Template.Labels},
		Spec:       *d.Spec.Template.Spec.DeepCopy(),
	}
	if _, err := cs.CoreV1().Pods(namespace).Create(ctx, pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
		t.Errorf("the installed Deployment's pod is not admitted: %v", err)
	}
	if ns, err := cs.CoreV1().Namespaces().Get(ctx, namespace, metav1.GetOptions{}); err != nil || ns.Labels["pod-security.kubernetes.io/enforce"] != "restricted" {
		t.Errorf("namespace %s does not enforce Pod Security restricted: %v", namespace, err)
	}

	// The operator asks for JSON logs through clusterctl's variable.
	_, jsonComps := r.components(t, "KUBELET_AUTHENTICATOR_LOGGING_FORMAT=json")
	var jd appsv1.Deployment
	jsonComps.get(t, "Deployment", deployment, &jd)

	dir := t.TempDir()
	// The metrics certificate, as a mounted kubernetes.io/tls Secret would
	// give it (--metrics-cert-dir), from a CA the scraper trusts.
	ca, err := harness.NewCA("metrics-ca")
	if err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM, err := ca.Issue(harness.CertSpec{CommonName: "node-attestation-controller-metrics", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, Server: true})
	if err != nil {
		t.Fatal(err)
	}
	certDir := filepath.Join(dir, "metrics-certs")
	if err := os.Mkdir(certDir, 0o700); err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(certDir, "tls.crt"), certPEM)
	write(t, filepath.Join(certDir, "tls.key"), keyPEM)

	token := func(ns, sa string) string {
		t.Helper()
		if _, err := cs.CoreV1().ServiceAccounts(ns).Get(ctx, sa, metav1.GetOptions{}); err != nil {
			if _, err := cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		exp := int64(3600)
		tr, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa,
			&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return tr.Status.Token
	}
	kubeconfig := filepath.Join(dir, "sa.kubeconfig")
	write(t, kubeconfig, mgmt.KubeconfigFor("", clientcmdapi.AuthInfo{Token: token(namespace, "node-attestation-controller")}))

	metricsPort, healthPort := harness.FreePort(t), harness.FreePort(t)
	args := append(append([]string(nil), jd.Spec.Template.Spec.Containers[0].Args...),
		"--kubeconfig="+kubeconfig,
		"--leader-election-namespace="+namespace,
		fmt.Sprintf("--metrics-bind-address=127.0.0.1:%d", metricsPort),
		fmt.Sprintf("--health-probe-bind-address=127.0.0.1:%d", healthPort),
		"--metrics-cert-dir="+certDir)
	logPath := filepath.Join(dir, "controller.log")
	proc := harness.StartProcess(t, "node-attestation-controller", logPath, bin, args...)
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		if exited, err := proc.Exited(); exited {
			return false, fmt.Errorf("the controller exited: %w", err)
		}
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/readyz", healthPort))
		if err != nil {
			return false, err
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})

	// Metrics: HTTPS with the given certificate; a reader, a stranger,
	// nobody.
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca.CertPEM)
	scraper := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}}
	scrape := func(token string) (int, string, error) {
		req, err := http.NewRequest(http.MethodGet, fmt.Sprintf("https://127.0.0.1:%d/metrics", metricsPort), nil)
		if err != nil {
			return 0, "", err
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := scraper.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), err
	}
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "monitoring"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	reader, stranger := token("monitoring", "prometheus"), token("monitoring", "stranger")
	if _, err := cs.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "prometheus-reads-node-attestation-controller"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "kubelet-authenticator:node-attestation-controller-metrics-reader"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: "monitoring", Name: "prometheus"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var body string
	// RBAC takes a moment to reach the authorizer's cache.
	harness.WaitFor(t, 60*time.Second, func() (bool, error) {
		code, b, err := scrape(reader)
		if err != nil {
			return false, err
		}
		body = b
		if code != http.StatusOK {
			return false, fmt.Errorf("the metrics reader got %d: %s", code, b)
		}
		return true, nil
	})
	for _, want := range []string{"# TYPE controller_runtime_", "# TYPE leader_election_master_status"} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	for who, c := range map[string]struct {
		token string
		want  int
	}{"a token not bound to the metrics reader": {stranger, http.StatusForbidden}, "no token": {"", http.StatusUnauthorized}} {
		code, b, err := scrape(c.token)
		if err != nil || code != c.want {
			t.Errorf("%s: /metrics answered %d (%v): %s; want %d", who, code, err, b, c.want)
		}
	}
	// Plain HTTP is not served.
	if resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", metricsPort)); err == nil {
		if resp.StatusCode == http.StatusOK {
			t.Error("/metrics answered plain HTTP")
		}
		resp.Body.Close()
	}

	// JSON logs: every line an object with a message, the controller's own
	// start-up among them.
	proc.Stop(10 * time.Second)
	f, err := os.Open(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var lines, starting int
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "+ ") { // the harness's command line
			continue
		}
		lines++
		var entry map[string]any
		if err := json.Unmarshal([]byte(line), &entry); err != nil {
			t.Errorf("log line %d is not JSON (%v): %s", lines, err, line)
			continue
		}
		if _, ok := entry["msg"]; !ok {
			t.Errorf("log line %d has no msg: %s", lines, line)
		}
		if entry["msg"] == "Starting" && entry["leaderElect"] == true {
			starting++
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if lines == 0 || starting != 1 {
		t.Errorf("%d log lines, %d of them the controller's JSON \"Starting\" line, want one", lines, starting)
	}
}

// buildController builds the controller as make build does (no tags).
func buildController(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "node-attestation-controller")
	cmd := exec.Command("go", "build", "-o", out, "./cmd/node-attestation-controller")
	cmd.Dir = repoRoot(t)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, b)
	}
	return out
}

// TestInstallStandalone installs the chart with `helm install` in
// standalone mode (docs/standalone.md) into a real cluster without Cluster
// API, adds what the operator adds (the client CA Secret, the allowlist),
// and runs the real controller binary from the installed Deployment's
// arguments with nothing but a token of its ServiceAccount: the allowlisted
// node joins (its bootstrap request is signed by the cluster's CA), a
// second registration of the joined node is denied NodeAlreadyJoined,
// lockdown disarms kubeadm's bootstrap auto-approve binding, and no request
// is forbidden, so the chart's RBAC is all standalone mode needs. Nothing
// of Cluster API mode is installed (no CRD, no admission policy), and the
// installed pod passes Pod Security "restricted".
func TestInstallStandalone(t *testing.T) {
	tl := getTools(t)
	bin := buildController(t)
	cp := harness.StartControlPlane(t, "standalone-helm")
	ctx := context.Background()
	cs := cp.Client
	kubectl := func(args ...string) []byte {
		t.Helper()
		return run(t, nil, nil, tl.kubectl, append([]string{"--kubeconfig", cp.AdminKubeconfig}, args...)...)
	}
	cp.KubeadmAutoApprove(t)

	// docs/standalone.md: the namespace, then helm install.
	kubectl("create", "namespace", namespace)
	kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
	run(t, nil, nil, tl.helm, append([]string{"--kubeconfig", cp.AdminKubeconfig, "install", "kubelet-authenticator",
		filepath.Join(repoRoot(t), "deploy", "helm", "kubelet-authenticator"), "-n", namespace,
		"--set", "standalone.authorizedAttestors={insecure}", "--set", "standalone.lockdown=true"}, standaloneValues...)...)
	if out := string(kubectl("get", "crd", "-o", "name")); strings.Contains(out, "kubelet-authenticator") {
		t.Errorf("a standalone install installs a CRD of Cluster API mode:\n%s", out)
	}
	if out := string(kubectl("get", "validatingadmissionpolicies", "-o", "name")); strings.Contains(out, "node-attestation-controller") {
		t.Errorf("a standalone install installs an admission policy of Cluster API mode:\n%s", out)
	}
	d, err := cs.AppsV1().Deployments(namespace).Get(ctx, deployment, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: deployment + "-", Namespace: namespace, Labels: d.Spec.Template.Labels},
		Spec:       *d.Spec.Template.Spec.DeepCopy(),
	}
	if _, err := cs.CoreV1().Pods(namespace).Create(ctx, pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
		t.Errorf("the installed Deployment's pod is not admitted: %v", err)
	}

	// What the operator adds (docs/standalone.md): the CA and the allowlist,
	// under the names the chart's defaults give.
	if _, err := cs.CoreV1().Secrets(namespace).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "cluster-ca"}, Type: corev1.SecretTypeTLS,
		Data: map[string][]byte{corev1.TLSCertKey: cp.CACertPEM, corev1.TLSPrivateKeyKey: cp.CAKeyPEM},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cs.CoreV1().ConfigMaps(namespace).Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "allowlist"},
		Data:       map[string]string{standalone.AllowlistKey: "nodes:\n- nodeName: node-1\n  providerID: test:///node-1\n"},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	logPath := runInstalledController(t, cp, bin, "--lockdown-period=1s", "-v=2")

	bootstrap := cp.BootstrapClient(t)
	join := func(name string) *certificatesv1.CertificateSigningRequest {
		t.Helper()
		req, _ := signertest.Request{NodeName: "node-1", ProviderID: "test:///node-1"}.Build(t)
		csr := signertest.CSR(name, req)
		csr.Spec.Username, csr.Spec.Groups = "", nil
		if _, err := bootstrap.CertificatesV1().CertificateSigningRequests().Create(ctx, csr, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		return harness.WaitForCSRDecision(t, cs, name, 60*time.Second)
	}
	got := join("node-1-join")
	if len(got.Status.Certificate) == 0 {
		t.Fatalf("the allowlisted node's request was not issued: %+v", got.Status.Conditions)
	}
	block, _ := pem.Decode(got.Status.Certificate)
	if block == nil {
		t.Fatal("the issued certificate is not PEM")
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(cp.CACertPEM)
	if _, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil || cert.Subject.CommonName != "system:node:node-1" {
		t.Errorf("the issued certificate (%s) does not chain to the cluster's client CA: %v", cert.Subject, err)
	}
	if _, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got = join("node-1-again")
	if c := harness.CSRCondition(got, certificatesv1.CertificateDenied); c == nil || c.Reason != attestor.ReasonNodeAlreadyJoined {
		t.Errorf("a second registration of the joined node: %+v, want denied %s", got.Status.Conditions, attestor.ReasonNodeAlreadyJoined)
	}

	// Lockdown, with the chart's RBAC (bind on the node-client ClusterRole).
	harness.WaitFor(t, 30*time.Second, func() (bool, error) {
		b, err := cs.RbacV1().ClusterRoleBindings().Get(ctx, lockdown.KubeadmAutoApproveBootstrap, metav1.GetOptions{})
		return err == nil && len(b.Subjects) == 0, err
	})

	b, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(strings.ToLower(string(b)), "forbidden") {
		t.Errorf("the controller logs a forbidden request:\n%s", harness.LastLines(string(b), 40))
	}
}
