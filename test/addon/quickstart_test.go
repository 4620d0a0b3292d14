package addon

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// The quickstart's placeholders, which a reader replaces with their own
// values and the test with its own.
const (
	quickstart          = "docs/quickstart.md"
	placeholderRegistry = "registry.example.com"
	placeholderClone    = "/path/to/kubelet-authenticator"
	// The Cluster the page opts in (its NAMESPACE and CLUSTER).
	quickstartNamespace = "default"
	quickstartCluster   = "my-cluster"
	releaseVersion      = "v0.1.0"
)

// quickstartBlock matches a fenced block the page marks for this test.
var quickstartBlock = regexp.MustCompile("(?s)<!-- quickstart: ([a-z-]+) -->\n```(sh|yaml)\n(.*?)```\n")

// quickstartBlocks returns the marked blocks of docs/quickstart.md by name.
func quickstartBlocks(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), quickstart))
	if err != nil {
		t.Fatal(err)
	}
	blocks := map[string]string{}
	for _, m := range quickstartBlock.FindAllStringSubmatch(string(b), -1) {
		if _, dup := blocks[m[1]]; dup {
			t.Fatalf("%s marks two blocks %q", quickstart, m[1])
		}
		blocks[m[1]] = m[3]
	}
	for _, want := range []string{"build", "helm", "clusterctl-config", "clusterctl", "check-install", "template", "opt-in", "check"} {
		if _, ok := blocks[want]; !ok {
			t.Fatalf("%s has no block marked <!-- quickstart: %s --> (followed by a ```sh or ```yaml block)", quickstart, want)
		}
	}
	return blocks
}

// session runs a page's shell blocks one after the other as a reader would
// in one terminal: in the clone, with what earlier blocks exported.
type session struct {
	t        *testing.T
	dir, env string
	base     []string
	registry string
}

func (s *session) run(block string) string {
	s.t.Helper()
	script := "set -euo pipefail\nsource " + s.env + "\n" +
		strings.ReplaceAll(block, placeholderRegistry, s.registry) +
		"\nexport -p > " + s.env + "\n"
	cmd := exec.Command("bash", "-c", script)
	cmd.Dir = s.dir
	cmd.Env = s.base
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	err := cmd.Run()
	s.t.Logf("$ %s(%s)\n%s", block, time.Since(start).Round(time.Second), harness.LastLines(out.String(), 15))
	if err != nil {
		s.t.Fatalf("the quickstart's block failed: %v\n%s\n%s", err, block, out.String())
	}
	return out.String()
}

// cloneRepository copies the files of the checkout (tracked ones and new
// ones git does not ignore) into a new directory: the reader's clone, which
// the page's make commands write bin/ into.
func cloneRepository(t *testing.T) string {
	t.Helper()
	root := repoRoot(t)
	out, err := exec.Command("git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard").Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	dst := filepath.Join(t.TempDir(), "kubelet-authenticator")
	for _, f := range strings.Split(strings.TrimRight(string(out), "\x00"), "\x00") {
		src := filepath.Join(root, f)
		fi, err := os.Lstat(src)
		if os.IsNotExist(err) {
			continue // deleted, not yet committed
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dst, f)), 0o755); err != nil {
			t.Fatal(err)
		}
		if fi.Mode()&os.ModeSymlink != 0 {
			target, err := os.Readlink(src)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(target, filepath.Join(dst, f)); err != nil {
				t.Fatal(err)
			}
			continue
		}
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, f), b, fi.Mode().Perm()); err != nil {
			t.Fatal(err)
		}
	}
	return dst
}

// certManagerCRDs stand in for cert-manager, which `clusterctl init`
// installs with the core provider and checks for before it installs any
// provider (it creates an Issuer and a Certificate, then deletes them). The
// controller does not use cert-manager.
const certManagerCRDs = `
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: issuers.cert-manager.io
spec:
  group: cert-manager.io
  names: {kind: Issuer, listKind: IssuerList, plural: issuers, singular: issuer}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: certificates.cert-manager.io
spec:
  group: cert-manager.io
  names: {kind: Certificate, listKind: CertificateList, plural: certificates, singular: certificate}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
`

// TestQuickstart follows docs/quickstart.md with its own blocks: it builds
// and pushes the controller's image to a registry on 127.0.0.1 and writes
// the release artifacts (make push-images release-manifests, linux/amd64
// only); installs with `helm install` on one management cluster and with
// `clusterctl init --addon` on another, and checks that each installs the
// image that was pushed; then, on the second, applies the documented
// KubeadmConfigTemplate, opts a Cluster in, runs the controller binary the
// page built with the installed Deployment's arguments and ServiceAccount
// (the test's clusters run no pods), and reads `kubectl get
// clusterattestations` until the Cluster is reachable and its signers served.
// That the template's nodes join is TestMachineDeploymentLifecycle's part
// (test/capi), with Cluster API's own controllers.
func TestQuickstart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the release, starts three control planes")
	}
	tl := getTools(t)
	capiBin := harness.ClusterAPIBinaries(t)
	if capiBin == "" {
		t.Fatalf("%s is unset: run test/tools/install-capi.sh and export %s=<the directory it prints> (make test does)", harness.ClusterAPIBinariesEnv, harness.ClusterAPIBinariesEnv)
	}
	blocks := quickstartBlocks(t)

	reg := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(reg.Close)
	regHost := strings.TrimPrefix(reg.URL, "http://")
	clone := cloneRepository(t)
	home := filepath.Join(t.TempDir(), "home")
	if err := os.MkdirAll(filepath.Join(home, ".config", "cluster-api"), 0o700); err != nil {
		t.Fatal(err)
	}
	newSession := func(t *testing.T, kubeconfig string) *session {
		env := filepath.Join(t.TempDir(), "env.sh")
		write(t, env, nil)
		return &session{t: t, dir: clone, env: env, registry: regHost, base: []string{
			"PATH=" + strings.Join([]string{filepath.Dir(tl.kubectl), filepath.Dir(tl.helm), filepath.Dir(tl.clusterctl), os.Getenv("PATH")}, ":"),
			"HOME=" + home,
			"KUBECONFIG=" + kubeconfig,
			// The toolchain's caches, shared with the rest of the suite.
			"GOCACHE=" + goEnv(t, "GOCACHE"), "GOMODCACHE=" + goEnv(t, "GOMODCACHE"), "GOPATH=" + goEnv(t, "GOPATH"),
			"GOFLAGS=" + os.Getenv("GOFLAGS"), "GOPROXY=" + goEnv(t, "GOPROXY"), "GOTOOLCHAIN=local",
			"KA_CACHE=" + os.Getenv("KA_CACHE"), "XDG_CACHE_HOME=" + filepath.Join(os.Getenv("HOME"), ".cache"),
			// One platform: the second would double the build and show nothing new.
			"PLATFORMS=linux/amd64",
			"CLUSTERCTL_DISABLE_VERSIONCHECK=true",
		}}
	}
	image := regHost + "/kubelet-authenticator/node-attestation-controller:" + releaseVersion

	// 1. Build and push.
	newSession(t, "").run(blocks["build"])
	p, err := layout.FromPath(filepath.Join(clone, "bin", "images", "node-attestation-controller"))
	if err != nil {
		t.Fatal(err)
	}
	local, err := p.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	im, err := local.IndexManifest()
	if err != nil || len(im.Manifests) != 1 || im.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != image {
		t.Fatalf("bin/images/node-attestation-controller: %+v (%v), want one index named %s", im, err, image)
	}
	ref, err := name.ParseReference(image)
	if err != nil {
		t.Fatal(err)
	}
	pushed, err := remote.Index(ref)
	if err != nil {
		t.Fatalf("%s was not pushed: %v", image, err)
	}
	if d, err := pushed.Digest(); err != nil || d != im.Manifests[0].Digest {
		t.Fatalf("the registry holds %s at %s (%v), make images built %s", image, d, err, im.Manifests[0].Digest)
	}
	for _, f := range []string{"bin/release/kubelet-authenticator-0.1.0.tgz", "bin/release/addon-kubelet-authenticator/" + releaseVersion + "/addon-components.yaml",
		"bin/release/addon-kubelet-authenticator/" + releaseVersion + "/metadata.yaml", "bin/release/addon-components.yaml", "bin/linux_amd64/kubelet-authenticator"} {
		if _, err := os.Stat(filepath.Join(clone, f)); err != nil {
			t.Fatalf("the build step did not write %s: %v", f, err)
		}
	}
	checkInstalledImage := func(t *testing.T, s *session) {
		t.Helper()
		if got := strings.TrimSpace(s.run(blocks["check-install"])); got != image {
			t.Fatalf("the installed Deployment runs %q, want the pushed %s", got, image)
		}
	}

	// 2a. Helm.
	t.Run("helm install", func(t *testing.T) {
		mgmt := harness.StartManagement(t)
		s := newSession(t, mgmt.AdminKubeconfig)
		s.run(blocks["helm"])
		checkInstalledImage(t, s)
		if out := run(t, nil, nil, tl.helm, "--kubeconfig", mgmt.AdminKubeconfig, "status", "kubelet-authenticator", "-n", namespace); !bytes.Contains(out, []byte("STATUS: deployed")) {
			t.Fatalf("helm status:\n%s", out)
		}
	})

	// 2b. clusterctl, on a management cluster as `clusterctl init` left it:
	// the core provider in clusterctl's inventory and cert-manager's API.
	mgmt := harness.StartManagement(t)
	kubectl := func(stdin []byte, args ...string) []byte {
		t.Helper()
		return run(t, nil, stdin, tl.kubectl, append([]string{"--kubeconfig", mgmt.AdminKubeconfig}, args...)...)
	}
	capiDir, err := harness.ModuleDir(harness.ClusterAPIModule, harness.ClusterAPIVersion)
	if err != nil {
		t.Fatal(err)
	}
	kubectl(nil, "apply", "--server-side", "-f", filepath.Join(capiDir, "cmd", "clusterctl", "config", "manifest", "clusterctl-api.yaml"))
	kubectl([]byte(certManagerCRDs), "apply", "--server-side", "-f", "-")
	kubectl(nil, "wait", "--for=condition=Established", "crd/providers.clusterctl.cluster.x-k8s.io", "crd/issuers.cert-manager.io", "crd/certificates.cert-manager.io")
	kubectl([]byte(fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata:
  name: capi-system
---
apiVersion: clusterctl.cluster.x-k8s.io/v1alpha3
kind: Provider
metadata:
  name: cluster-api
  namespace: capi-system
  labels:
    clusterctl.cluster.x-k8s.io: ""
    cluster.x-k8s.io/provider: cluster-api
providerName: cluster-api
type: CoreProvider
version: %s
`, harness.ClusterAPIVersion)), "apply", "--server-side", "-f", "-")
	// clusterctl reads the core provider's metadata (its contract) from its
	// repository: a local one here, GitHub for a reader.
	coreRepo := filepath.Join(t.TempDir(), "cluster-api", harness.ClusterAPIVersion)
	if err := os.MkdirAll(coreRepo, 0o755); err != nil {
		t.Fatal(err)
	}
	md, err := os.ReadFile(filepath.Join(capiBin, "metadata.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(coreRepo, "metadata.yaml"), md)
	write(t, filepath.Join(coreRepo, "core-components.yaml"), []byte("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: capi-system\n"))
	// The reader adds the page's provider entry to clusterctl.yaml.
	var cfg struct {
		Providers []map[string]string `json:"providers"`
	}
	if err := yaml.Unmarshal([]byte(strings.ReplaceAll(blocks["clusterctl-config"], placeholderClone, clone)), &cfg); err != nil || len(cfg.Providers) != 1 {
		t.Fatalf("the page's clusterctl configuration %v: %q", err, blocks["clusterctl-config"])
	}
	cfg.Providers = append(cfg.Providers, map[string]string{"name": "cluster-api", "type": "CoreProvider", "url": "file://" + filepath.Join(coreRepo, "core-components.yaml")})
	b, err := yaml.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(home, ".config", "cluster-api", "clusterctl.yaml"), b)

	s := newSession(t, mgmt.AdminKubeconfig)
	s.run(blocks["clusterctl"])
	checkInstalledImage(t, s)
	if out := kubectl(nil, "get", "providers.clusterctl.cluster.x-k8s.io", "-A", "-o", "jsonpath={range .items[*]}{.type}/{.providerName}@{.version}{\"\\n\"}{end}"); !bytes.Contains(out, []byte("AddonProvider/kubelet-authenticator@"+releaseVersion)) {
		t.Fatalf("clusterctl's inventory lacks the add-on:\n%s", out)
	}

	// 4. The KubeadmConfigTemplate, into CABPK's API.
	mgmt.InstallCRDs(t, filepath.Join(capiBin, "config", "bootstrap", "crd", "bases"))
	wl := harness.StartControlPlane(t, quickstartCluster)
	mgmt.AddWorkloadCluster(t, quickstartNamespace, quickstartCluster, wl, nil)
	s.run(blocks["template"])
	kubectl(nil, "get", "-n", quickstartNamespace, "kubeadmconfigtemplates.bootstrap.cluster.x-k8s.io", "workers-attested")

	// 5. Opt in; the controller the page built runs as the installed
	// Deployment would.
	s.run(blocks["opt-in"])
	runInstalledController(t, mgmt.ControlPlane, filepath.Join(clone, "bin", "linux_amd64", "node-attestation-controller"))

	// 6. Check.
	harness.WaitFor(t, 2*time.Minute, func() (bool, error) {
		got, err := exec.Command(tl.kubectl, "--kubeconfig", mgmt.AdminKubeconfig, "get", "clusterattestations", "-n", quickstartNamespace, quickstartCluster,
			"-o", `jsonpath={.status.conditions[?(@.type=="WorkloadReachable")].status}/{.status.conditions[?(@.type=="SignersServed")].status}`).Output()
		if err != nil {
			return false, fmt.Errorf("kubectl get clusterattestations: %w", err)
		}
		if string(got) != "True/True" {
			return false, fmt.Errorf("ClusterAttestation reachable/signers %q", got)
		}
		return true, nil
	})
	out := s.run(blocks["check"])
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[1], quickstartCluster+" ") {
		t.Fatalf("kubectl get clusterattestations printed:\n%s\nwant a header and %s", out, quickstartCluster)
	}
	header, row := strings.Fields(lines[0]), strings.Fields(lines[1])
	for i, col := range header {
		if col == "REACHABLE" && (i >= len(row) || row[i] != "True") {
			t.Errorf("kubectl get clusterattestations: REACHABLE is not True:\n%s", out)
		}
	}
}

func goEnv(t *testing.T, key string) string {
	t.Helper()
	out, err := exec.Command("go", "env", key).Output()
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(out))
}

// runInstalledController runs bin with the arguments of the Deployment
// installed in cp, then extra (the addresses and settings a test needs),
// and a token of its ServiceAccount, as its pod would, and waits until it
// is ready. It returns the controller's log file.
func runInstalledController(t *testing.T, cp *harness.ControlPlane, bin string, extra ...string) string {
	t.Helper()
	ctx := context.Background()
	cs := cp.Client
	d, err := cs.AppsV1().Deployments(namespace).Get(ctx, deployment, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	exp := int64(3600)
	tr, err := cs.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, d.Spec.Template.Spec.ServiceAccountName,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "sa.kubeconfig")
	write(t, kubeconfig, cp.KubeconfigFor("", clientcmdapi.AuthInfo{Token: tr.Status.Token}))
	metricsPort, healthPort := harness.FreePort(t), harness.FreePort(t)
	args := append(append([]string(nil), d.Spec.Template.Spec.Containers[0].Args...),
		"--kubeconfig="+kubeconfig,
		"--leader-election-namespace="+namespace,
		fmt.Sprintf("--metrics-bind-address=127.0.0.1:%d", metricsPort),
		fmt.Sprintf("--health-probe-bind-address=127.0.0.1:%d", healthPort))
	args = append(args, extra...)
	logPath := filepath.Join(dir, "controller.log")
	proc := harness.StartProcess(t, "node-attestation-controller", logPath, bin, args...)
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("controller log:\n%s", harness.LastLines(string(b), 40))
		}
	})
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
	return logPath
}
