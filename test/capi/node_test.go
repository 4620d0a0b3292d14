package capi

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// fleet boots the VMs the provider creates: each from its Machine's
// bootstrap data, in a directory of its own that stands for the node's root
// file system.
type fleet struct {
	dir            string // nodes' roots live under it
	binDir, k8sBin string
	repo           string
	mgmt           *harness.Management
	wl             *harness.ControlPlane
	ns             string
	p              *provider

	mu    sync.Mutex
	nodes map[string]*node
	// issued is when the test first saw each node's client certificate
	// issued (by node name); denied lists CSRs denied or failed.
	issued map[string]time.Time
	// firstCSR is the first issued CSR of each node.
	firstCSR map[string]certificatesv1.CertificateSigningRequest
	denied   []string
	seeds    int
}

// node is a booted machine.
type node struct {
	Name, Machine, Root string
	// kubelet is the hollow kubelet; runcmd the cloud-init commands after
	// kubeadm (nil on the control-plane node).
	kubelet, runcmd *harness.Process
}

// stop terminates the node's processes (the instance is gone). Safe from
// any goroutine.
func (f *fleet) stop(name string) {
	f.mu.Lock()
	n := f.nodes[name]
	f.mu.Unlock()
	if n == nil {
		return
	}
	for _, p := range []*harness.Process{n.runcmd, n.kubelet} {
		if p != nil {
			p.Stop(10 * time.Second)
		}
	}
}

// wait polls cond until it holds, booting the VMs the provider has created
// and noting CSR outcomes on every round.
func (f *fleet) wait(t *testing.T, timeout time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	start := time.Now()
	harness.WaitFor(t, timeout, func() (bool, error) {
		f.bootPending(t)
		f.observeCSRs(t)
		ok, err := cond()
		if err != nil {
			return false, fmt.Errorf("%s: %w (provider: %s)", what, err, f.p.status())
		}
		if !ok {
			return false, fmt.Errorf("%s: not yet (provider: %s)", what, f.p.status())
		}
		return true, nil
	})
	t.Logf("%s: after %s", what, time.Since(start).Round(100*time.Millisecond))
}

func (f *fleet) bootPending(t *testing.T) {
	t.Helper()
	for _, v := range f.p.vms() {
		f.mu.Lock()
		_, booted := f.nodes[v.Name]
		f.mu.Unlock()
		if !booted {
			f.boot(t, v)
		}
	}
}

// observeCSRs notes when each node's client certificate was first seen
// issued, and every CSR denied or failed.
func (f *fleet) observeCSRs(t *testing.T) {
	t.Helper()
	list, err := f.wl.Client.CertificatesV1().CertificateSigningRequests().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		return // the next round will see them
	}
	now := time.Now()
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range list.Items {
		for _, cond := range c.Status.Conditions {
			// A TPM node's first CSR carries the challenge; the controller
			// closes it with ChallengeAnswered once the second one is signed.
			if cond.Type == certificatesv1.CertificateDenied && cond.Reason == attestor.ReasonChallengeAnswered {
				continue
			}
			if cond.Type == certificatesv1.CertificateDenied || cond.Type == certificatesv1.CertificateFailed {
				msg := fmt.Sprintf("%s (%s): %s %s: %s", c.Name, c.Spec.SignerName, cond.Type, cond.Reason, cond.Message)
				if !slices.Contains(f.denied, msg) {
					f.denied = append(f.denied, msg)
				}
			}
		}
		if len(c.Status.Certificate) == 0 {
			continue
		}
		r, err := attestor.ParseRequest(c.Spec.Request)
		if err != nil {
			continue
		}
		name := strings.TrimPrefix(r.CSR.Subject.CommonName, attestor.NodeUserPrefix)
		if _, seen := f.issued[name]; !seen {
			f.issued[name] = now
			f.firstCSR[name] = c
		}
	}
}

// boot starts the VM v. The control-plane machine stands for the node
// `kubeadm init` made: kubeadm issues its kubelet a certificate from the
// cluster CA itself (no token, no CSR), which the test does with the
// workload cluster's CA. A worker boots from its bootstrap data.
func (f *fleet) boot(t *testing.T, v vm) {
	t.Helper()
	root := filepath.Join(f.dir, v.Name)
	if err := os.MkdirAll(root, 0o700); err != nil {
		t.Fatal(err)
	}
	n := &node{Name: v.Name, Machine: v.Machine, Root: root}
	f.mu.Lock()
	f.nodes[v.Name] = n
	f.mu.Unlock()
	if v.ControlPlane {
		certPEM, keyPEM := f.wl.IssueClientCert(t, attestor.NodeUserPrefix+v.Name, attestor.NodesGroup)
		kubeconfig := filepath.Join(root, "kubelet.conf")
		if err := os.WriteFile(kubeconfig, f.wl.KubeconfigFor("", clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}), 0o600); err != nil {
			t.Fatal(err)
		}
		n.kubelet = f.startKubelet(t, v.Name, root, kubeconfig)
		return
	}

	var secret corev1.Secret
	if err := f.mgmt.Client.Get(context.Background(), keyOf(f.ns, v.BootstrapSecret), &secret); err != nil {
		t.Fatalf("node %s: unable to read its bootstrap data: %v", v.Name, err)
	}
	if format := string(secret.Data["format"]); format != "cloud-config" {
		t.Fatalf("node %s: bootstrap data format %q, want cloud-config", v.Name, format)
	}
	// The platform's instance metadata. tpm_seed stands for the instance's
	// own TPM: the in-process simulator of a test build, one per instance.
	f.mu.Lock()
	f.seeds++
	seed := f.seeds
	f.mu.Unlock()
	ud, err := parseUserData(secret.Data["value"], map[string]string{"local_hostname": v.Name, "instance_id": v.Name, "tpm_seed": strconv.Itoa(seed)})
	if err != nil {
		t.Fatalf("node %s: %v\nuser data:\n%s", v.Name, err, secret.Data["value"])
	}
	for _, file := range ud.WriteFiles {
		if err := file.writeUnder(root); err != nil {
			t.Fatalf("node %s: %v", v.Name, err)
		}
	}

	// runcmd: the preKubeadmCommands, kubeadm join, the postKubeadmCommands.
	join := slices.IndexFunc(ud.Runcmd, func(c string) bool { return strings.HasPrefix(c, "kubeadm join ") })
	if join < 0 {
		t.Fatalf("node %s: no kubeadm join in runcmd %q", v.Name, ud.Runcmd)
	}
	script := "set -e\n"
	for _, c := range ud.Runcmd[:join] {
		script += rewritePaths(c, root) + "\n"
	}
	if out, err := exec.Command("sh", "-c", script).CombinedOutput(); err != nil {
		t.Fatalf("node %s: preKubeadmCommands: %v\n%s", v.Name, err, out)
	}
	f.kubeadmJoin(t, v.Name, root, ud.Runcmd[join])
	f.installImage(t, root)
	f.prepareKubelet(t, v.Name, root)
	n.kubelet = f.startKubelet(t, v.Name, root, filepath.Join(root, "etc", "kubernetes", "kubelet.conf"))

	script = "set -e\n"
	for _, c := range ud.Runcmd[join+1:] {
		script += rewritePaths(c, root) + "\n"
	}
	scriptPath := filepath.Join(root, "runcmd.sh")
	if err := os.WriteFile(scriptPath, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	n.runcmd = harness.StartProcess(t, "runcmd "+v.Name, filepath.Join(root, "runcmd.log"), "/bin/sh", scriptPath)
}

// startKubelet runs kubemark's hollow kubelet as node name with kubeconfig.
func (f *fleet) startKubelet(t *testing.T, name, root, kubeconfig string) *harness.Process {
	t.Helper()
	return harness.StartProcess(t, "kubelet "+name, filepath.Join(root, "kubelet.log"), filepath.Join(f.k8sBin, "kubemark"),
		"--morph=kubelet", "--name="+name, "--kubeconfig="+kubeconfig, "--use-host-image-service=false",
		fmt.Sprintf("--kubelet-port=%d", harness.FreePort(t)), fmt.Sprintf("--kubelet-read-only-port=%d", harness.FreePort(t)),
		"--v=1")
}

// kubeadmJoin does what `kubeadm join` (phases preflight through
// kubelet-start) does for the node's kubelet with the JoinConfiguration
// CABPK wrote: token discovery pinned to the CA hashes, and
// /etc/kubernetes/bootstrap-kubelet.conf with the bootstrap token.
// kubelet-wait-bootstrap must be skipped (docs/install.md), and is.
func (f *fleet) kubeadmJoin(t *testing.T, name, root, command string) {
	t.Helper()
	fields := strings.Fields(command)
	i := slices.Index(fields, "--config")
	if i < 0 || i+1 >= len(fields) {
		t.Fatalf("node %s: kubeadm join without --config: %q", name, command)
	}
	b, err := os.ReadFile(filepath.Join(root, fields[i+1]))
	if err != nil {
		t.Fatalf("node %s: %v", name, err)
	}
	var jc joinConfiguration
	for _, doc := range bytes.Split(b, []byte("\n---")) {
		var probe metav1.TypeMeta
		if yaml.Unmarshal(doc, &probe) == nil && probe.Kind == "JoinConfiguration" {
			if err := yaml.Unmarshal(doc, &jc); err != nil {
				t.Fatalf("node %s: JoinConfiguration: %v", name, err)
			}
		}
	}
	bt := jc.Discovery.BootstrapToken
	switch {
	case jc.APIVersion != "kubeadm.k8s.io/v1beta4":
		t.Fatalf("node %s: JoinConfiguration %q, want kubeadm.k8s.io/v1beta4:\n%s", name, jc.APIVersion, b)
	case bt.APIServerEndpoint == "" || bt.Token == "" || len(bt.CACertHashes) == 0:
		t.Fatalf("node %s: JoinConfiguration has no token discovery with CA pins:\n%s", name, b)
	case !slices.Contains(jc.SkipPhases, "kubelet-wait-bootstrap"):
		t.Fatalf("node %s: JoinConfiguration does not skip kubelet-wait-bootstrap (docs/install.md):\n%s", name, b)
	case jc.NodeRegistration.Name != name:
		t.Fatalf("node %s: JoinConfiguration registers node %q", name, jc.NodeRegistration.Name)
	}
	// Discovery: the cluster CA must match a pin CABPK took from <cluster>-ca.
	blk, _ := pem.Decode(f.wl.CACertPEM)
	ca, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(ca.RawSubjectPublicKeyInfo)
	if pin := "sha256:" + hex.EncodeToString(sum[:]); !slices.Contains(bt.CACertHashes, pin) {
		t.Fatalf("node %s: the cluster CA (%s) matches none of the JoinConfiguration's caCertHashes %q", name, pin, bt.CACertHashes)
	}
	kc := clientcmdapi.NewConfig()
	kc.Clusters["kubernetes"] = &clientcmdapi.Cluster{Server: "https://" + bt.APIServerEndpoint, CertificateAuthorityData: f.wl.CACertPEM}
	kc.AuthInfos["tls-bootstrap-token-user"] = &clientcmdapi.AuthInfo{Token: bt.Token}
	kc.Contexts["tls-bootstrap-token-user@kubernetes"] = &clientcmdapi.Context{Cluster: "kubernetes", AuthInfo: "tls-bootstrap-token-user"}
	kc.CurrentContext = "tls-bootstrap-token-user@kubernetes"
	out, err := clientcmd.Write(*kc)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(root, "etc", "kubernetes", "bootstrap-kubelet.conf")
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, out, 0o600); err != nil {
		t.Fatal(err)
	}
}

// joinConfiguration is the part of kubeadm's JoinConfiguration this test reads.
type joinConfiguration struct {
	APIVersion string `json:"apiVersion"`
	Discovery  struct {
		BootstrapToken struct {
			APIServerEndpoint string   `json:"apiServerEndpoint"`
			Token             string   `json:"token"`
			CACertHashes      []string `json:"caCertHashes"`
		} `json:"bootstrapToken"`
	} `json:"discovery"`
	NodeRegistration struct {
		Name string `json:"name"`
	} `json:"nodeRegistration"`
	SkipPhases []string `json:"skipPhases"`
}

// installImage puts what the machine image provides (docs/install.md, "What
// goes on a node") under root: the node binary, here a script that runs the
// test build with its default paths moved under root, and the kubelet
// kubeconfig template from systemd/.
func (f *fleet) installImage(t *testing.T, root string) {
	t.Helper()
	bin := filepath.Join(root, "usr", "local", "bin", "kubelet-authenticator")
	wrapper := fmt.Sprintf(`#!/bin/sh
# kubelet-authenticator, with /etc, /var and /run under this node's root.
exec %s "$@" --config=%s --bootstrap-kubeconfig=%s --cache-dir=%s
`, filepath.Join(f.binDir, "kubelet-authenticator"),
		filepath.Join(root, "etc", "kubelet-authenticator", "config.yaml"),
		filepath.Join(root, "etc", "kubernetes", "bootstrap-kubelet.conf"),
		filepath.Join(root, "var", "lib", "kubelet-authenticator"))
	if err := os.MkdirAll(filepath.Dir(bin), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, []byte(wrapper), 0o755); err != nil {
		t.Fatal(err)
	}
	tmpl, err := os.ReadFile(filepath.Join(f.repo, "systemd", "kubelet-kubeconfig.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc", "kubelet-authenticator", "kubelet-kubeconfig.yaml"), tmpl, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "var", "lib", "kubelet-authenticator"), 0o700); err != nil {
		t.Fatal(err)
	}
}

// prepareKubelet runs systemd/prepare-kubelet (kubelet's ExecStartPre) with
// its paths under root, and points the exec plugin it names at root.
func (f *fleet) prepareKubelet(t *testing.T, name, root string) {
	t.Helper()
	cmd := exec.Command(filepath.Join(f.repo, "systemd", "prepare-kubelet"))
	cmd.Env = append(os.Environ(),
		"KA_NODE_CONFIG="+filepath.Join(root, "etc", "kubelet-authenticator", "config.yaml"),
		"KA_BOOTSTRAP_KUBECONFIG="+filepath.Join(root, "etc", "kubernetes", "bootstrap-kubelet.conf"),
		"KA_KUBELET_KUBECONFIG="+filepath.Join(root, "etc", "kubernetes", "kubelet.conf"),
		"KA_KUBECONFIG_TEMPLATE="+filepath.Join(root, "etc", "kubelet-authenticator", "kubelet-kubeconfig.yaml"),
		"KA_ENV_FILE="+filepath.Join(root, "run", "kubelet-authenticator", "kubelet.env"),
	)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("node %s: prepare-kubelet: %v\n%s", name, err, out)
	}
	env, err := os.ReadFile(filepath.Join(root, "run", "kubelet-authenticator", "kubelet.env"))
	if err != nil || !strings.Contains(string(env), "--rotate-certificates=false") {
		t.Fatalf("node %s: prepare-kubelet did not turn kubelet's rotation off: %q %v", name, env, err)
	}
	path := filepath.Join(root, "etc", "kubernetes", "kubelet.conf")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b = []byte(rewritePaths(string(b), root))
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// userData is the part of a cloud-config this test runs.
type userData struct {
	WriteFiles []writeFile `json:"write_files"`
	Runcmd     []string    `json:"runcmd"`
}

type writeFile struct {
	Path        string `json:"path"`
	Owner       string `json:"owner"`
	Permissions string `json:"permissions"`
	Encoding    string `json:"encoding"`
	Append      bool   `json:"append"`
	Content     string `json:"content"`
}

// jinjaVar is the one Jinja form cloud-init's templates use here: a
// datasource metadata variable.
var jinjaVar = regexp.MustCompile(`\{\{\s*ds\.meta_data\.([a-z_]+)\s*\}\}`)

// parseUserData renders CABPK's user data as cloud-init does (it is a Jinja
// template: "## template: jinja"), with metadata as the datasource's
// meta_data, and decodes the cloud-config.
func parseUserData(b []byte, metadata map[string]string) (*userData, error) {
	s := string(b)
	header, rest, ok := strings.Cut(s, "\n")
	if !ok || strings.TrimSpace(header) != "## template: jinja" {
		return nil, fmt.Errorf("user data is not a Jinja template (first line %q)", header)
	}
	var missing []string
	rest = jinjaVar.ReplaceAllStringFunc(rest, func(m string) string {
		key := jinjaVar.FindStringSubmatch(m)[1]
		v, ok := metadata[key]
		if !ok {
			missing = append(missing, key)
		}
		return v
	})
	if len(missing) > 0 {
		return nil, fmt.Errorf("user data uses metadata this platform does not serve: %q", missing)
	}
	if strings.Contains(rest, "{{") || strings.Contains(rest, "{%") {
		return nil, fmt.Errorf("user data has Jinja this test does not render")
	}
	if !strings.HasPrefix(rest, "#cloud-config\n") {
		return nil, fmt.Errorf("user data is not a cloud-config")
	}
	var ud userData
	if err := yaml.Unmarshal([]byte(rest), &ud); err != nil {
		return nil, fmt.Errorf("unable to decode the cloud-config: %w", err)
	}
	return &ud, nil
}

// writeUnder writes the file under root, as cloud-init's write_files would
// at its path (owners are left to the test's user).
func (w writeFile) writeUnder(root string) error {
	if !filepath.IsAbs(w.Path) || filepath.Clean(w.Path) != w.Path {
		return fmt.Errorf("write_files: path %q is not a clean absolute path", w.Path)
	}
	if w.Encoding != "" || w.Append {
		return fmt.Errorf("write_files: %s: encoding %q / append not supported here", w.Path, w.Encoding)
	}
	mode := os.FileMode(0o644)
	if w.Permissions != "" {
		m, err := strconv.ParseUint(w.Permissions, 8, 32)
		if err != nil {
			return fmt.Errorf("write_files: %s: permissions %q: %w", w.Path, w.Permissions, err)
		}
		mode = os.FileMode(m)
	}
	path := filepath.Join(root, w.Path)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, []byte(w.Content), mode)
}

// hostPath matches an absolute path under the directories a node's files
// and commands use, at the start of a word or after a quote or '='.
var hostPath = regexp.MustCompile(`(^|[\s'"=])(/(?:etc|usr|var|run)/)`)

// rewritePaths moves the absolute paths in s under root.
func rewritePaths(s, root string) string {
	return hostPath.ReplaceAllString(s, "${1}"+root+"${2}")
}
