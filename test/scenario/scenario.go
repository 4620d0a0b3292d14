// Package scenario sets up the whole product for end-to-end tests, the demo
// and the benchmarks: a management cluster with the Cluster API CRDs, a
// workload cluster opted in to attestation, the real node-attestation-controller
// binary watching it, and a node: a config file, a bootstrap token
// kubeconfig, and a kubeconfig whose user runs the real kubelet-authenticator
// binary as its exec credential plugin.
package scenario

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// ControllerNamespace is the controller's own namespace in a scenario: its
// leader election Lease, key Secret and trust-on-first-use records.
const ControllerNamespace = "default"

// Annotations that opt a Cluster in.
const (
	AnnotationEnabled    = "kubelet-authenticator.x-k8s.io/enabled"
	AnnotationAttestors  = "kubelet-authenticator.x-k8s.io/authorized-attestors"
	DefaultNamespace     = "fleet"
	DefaultClusterName   = "workload"
	controllerBinaryName = "node-attestation-controller"
	nodeBinaryName       = "kubelet-authenticator"
)

// BinaryTags are the build tags of the binaries Binaries builds: the
// in-process TPM simulator and the test-only attestors (null). Release
// builds use none.
const BinaryTags = "tpmsimulator testattestors"

var built struct {
	sync.Mutex
	dir string
}

// Binaries builds the node binary kubelet-authenticator and
// node-attestation-controller (CGO_ENABLED=0, as released), all with the
// test build tags (BinaryTags), once per test process and returns the
// directory holding them.
func Binaries(tb testing.TB) string {
	tb.Helper()
	built.Lock()
	defer built.Unlock()
	if built.dir != "" {
		return built.dir
	}
	root, err := harness.RepoRoot()
	if err != nil {
		tb.Fatal(err)
	}
	removeStaleBinaries(tb)
	dir, err := os.MkdirTemp("", fmt.Sprintf("%s%d-", binariesPrefix, os.Getpid()))
	if err != nil {
		tb.Fatal(err)
	}
	for _, b := range []struct {
		name, pkg string
		env       []string
		tags      string
	}{
		{nodeBinaryName, "./cmd/kubelet-authenticator", nil, BinaryTags},
		{controllerBinaryName, "./cmd/node-attestation-controller", []string{"CGO_ENABLED=0"}, BinaryTags},
	} {
		cmd := exec.Command("go", "build", "-tags", b.tags, "-o", filepath.Join(dir, b.name), b.pkg)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), b.env...)
		if out, err := cmd.CombinedOutput(); err != nil {
			tb.Fatalf("unable to build %s: %v\n%s", b.name, err, out)
		}
	}
	built.dir = dir
	return dir
}

// binariesPrefix starts the name of the directory Binaries builds into
// (about 117 MB), followed by the test process's ID. Nothing removes it
// when that process ends (a test cannot outlive it), so each Binaries
// removes those of processes that have ended.
const binariesPrefix = "ka-bin-"

// removeStaleBinaries removes the binaries' directories of test processes
// that no longer run. A directory whose process ID is in use is kept,
// whoever uses it now.
func removeStaleBinaries(tb testing.TB) {
	tb.Helper()
	tmp := os.TempDir()
	entries, err := os.ReadDir(tmp)
	if err != nil {
		tb.Logf("unable to look for stale test binaries in %s: %v", tmp, err)
		return
	}
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), binariesPrefix)
		if !ok || !e.IsDir() {
			continue
		}
		pid, _, ok := strings.Cut(rest, "-")
		if !ok || pid == "" || strings.TrimLeft(pid, "0123456789") != "" {
			// Named before the process ID was in the name: removed once
			// a day old, when no test process can still use it.
			if info, err := e.Info(); err != nil || time.Since(info.ModTime()) < 24*time.Hour {
				continue
			}
		} else if _, err := os.Stat(filepath.Join("/proc", pid)); err == nil || !errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err := os.RemoveAll(filepath.Join(tmp, e.Name())); err != nil {
			tb.Logf("unable to remove stale test binaries: %v", err)
		}
	}
}

// Env is a running scenario.
type Env struct {
	Mgmt     *harness.Management
	Workload *harness.ControlPlane
	// Namespace and Cluster name the Cluster object on the management side.
	Namespace, Cluster string
	// BinDir holds the project's binaries; K8sBin the Kubernetes ones.
	BinDir, K8sBin string
	// Token is the workload cluster's bootstrap token and BootstrapKubeconfig
	// a kubeconfig that uses it.
	Token, BootstrapKubeconfig string
	// Dir is the scenario's scratch directory.
	Dir string

	controller *harness.Process
}

// Options shape a scenario.
type Options struct {
	// Attestors authorized on the Cluster; default "insecure".
	Attestors string
	// ControllerArgs are extra flags for the controller.
	ControllerArgs []string
	// NoController leaves the controller stopped (StartController starts it).
	NoController bool
	// Workload are options of the workload cluster's control plane.
	Workload []harness.Option
}

// Start brings up the scenario. Everything stops when the test ends.
func Start(tb testing.TB, o Options) *Env {
	tb.Helper()
	if o.Attestors == "" {
		o.Attestors = "insecure"
	}
	e := &Env{Namespace: DefaultNamespace, Cluster: DefaultClusterName, Dir: tb.TempDir()}
	e.BinDir = Binaries(tb)
	e.K8sBin = harness.Binaries(tb)
	e.Mgmt = harness.StartManagement(tb)
	e.Workload = harness.StartControlPlane(tb, e.Cluster, o.Workload...)
	e.Mgmt.AddWorkloadCluster(tb, e.Namespace, e.Cluster, e.Workload, map[string]string{
		AnnotationEnabled:   "true",
		AnnotationAttestors: o.Attestors,
	})
	e.Token = e.Workload.CreateBootstrapToken(tb)
	e.BootstrapKubeconfig = e.Workload.BootstrapKubeconfig(tb, e.Token)
	if !o.NoController {
		e.StartController(tb, o.ControllerArgs...)
	}
	return e
}

// StartController runs the node-attestation-controller binary against the
// management cluster.
func (e *Env) StartController(tb testing.TB, extra ...string) *harness.Process {
	tb.Helper()
	args := append([]string{
		"--kubeconfig=" + e.Mgmt.AdminKubeconfig,
		"--leader-election-namespace=" + ControllerNamespace,
		"--metrics-bind-address=0",
		"--health-probe-bind-address=0",
		"-v=2",
	}, extra...)
	e.controller = harness.StartProcess(tb, controllerBinaryName, filepath.Join(e.Dir, "controller.log"),
		filepath.Join(e.BinDir, controllerBinaryName), args...)
	return e.controller
}

// StopController stops the running controller (SIGTERM, then SIGKILL after
// 10 s), as a crash or a rollout would.
func (e *Env) StopController() {
	if e.controller != nil {
		e.controller.Stop(10 * time.Second)
		e.controller = nil
	}
}

// ControllerPID returns the running controller's process ID.
func (e *Env) ControllerPID() int {
	if e.controller == nil {
		return 0
	}
	return e.controller.PID()
}

// ControllerLog returns the controller's log so far.
func (e *Env) ControllerLog() string {
	b, _ := os.ReadFile(filepath.Join(e.Dir, "controller.log"))
	return string(b)
}

// Node is one node's files.
type Node struct {
	Name, ProviderID string
	// Dir holds the node's files; CacheDir its credential cache.
	Dir, CacheDir string
	// ConfigPath is its NodeConfig and Kubeconfig the exec-plugin kubeconfig.
	ConfigPath, Kubeconfig string
	env                    *Env
}

// NewNode writes a node's config and kubeconfigs. It does not create a
// Machine (see Machine).
func (e *Env) NewNode(tb testing.TB, name, providerID, attestorName string, extraConfig ...string) *Node {
	tb.Helper()
	n := &Node{Name: name, ProviderID: providerID, Dir: filepath.Join(e.Dir, "node-"+name), env: e}
	n.CacheDir = filepath.Join(n.Dir, "cache")
	if err := os.MkdirAll(n.Dir, 0o700); err != nil {
		tb.Fatal(err)
	}
	n.ConfigPath = filepath.Join(n.Dir, "config.yaml")
	cfg := fmt.Sprintf(`apiVersion: %s
kind: %s
nodeName: %s
providerID: %q
attestor: %q
bootstrapKubeconfig: %s
cacheDir: %s
requestTimeout: 60s
`, config.APIVersion, config.Kind, name, providerID, attestorName, e.BootstrapKubeconfig, n.CacheDir)
	cfg += strings.Join(extraConfig, "\n")
	if err := os.WriteFile(n.ConfigPath, []byte(cfg), 0o600); err != nil {
		tb.Fatal(err)
	}
	n.Kubeconfig = filepath.Join(n.Dir, "kubelet.kubeconfig")
	kc := e.Workload.KubeconfigFor("", clientcmdapi.AuthInfo{Exec: &clientcmdapi.ExecConfig{
		APIVersion:         "client.authentication.k8s.io/v1",
		Command:            filepath.Join(e.BinDir, nodeBinaryName),
		Args:               []string{"credential", "--config=" + n.ConfigPath},
		InteractiveMode:    clientcmdapi.NeverExecInteractiveMode,
		ProvideClusterInfo: true,
	}})
	if err := os.WriteFile(n.Kubeconfig, kc, 0o600); err != nil {
		tb.Fatal(err)
	}
	return n
}

// Machine creates the node's Machine in the management cluster, bootstrap
// ready, claiming the node's name as its hostname.
func (e *Env) Machine(tb testing.TB, n *Node) {
	tb.Helper()
	e.Mgmt.CreateMachine(tb, e.Namespace, e.Cluster, "machine-"+n.Name, n.ProviderID, true, n.Name)
}

// Result is a finished command.
type Result struct {
	Stdout, Stderr string
	Err            error
	Took           time.Duration
}

// Credential runs `kubelet-authenticator credential` for the node, as
// kubelet would (KUBERNETES_EXEC_INFO with the cluster).
func (n *Node) Credential(ctx context.Context, extra ...string) Result {
	return n.CredentialWith(ctx, "", nil, extra...)
}

// CredentialWith runs `credential` for the node as Credential does, with
// binary in place of the scenario's build of the node binary (empty: that
// build; another path: an older release) and env added to its environment.
func (n *Node) CredentialWith(ctx context.Context, binary string, env []string, extra ...string) Result {
	if binary == "" {
		binary = filepath.Join(n.env.BinDir, nodeBinaryName)
	}
	info := fmt.Sprintf(`{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","spec":{"interactive":false,"cluster":{"server":%q,"certificate-authority-data":%q}}}`, //nolint:lll // KUBERNETES_EXEC_INFO as kubectl sets it
		n.env.Workload.URL, base64.StdEncoding.EncodeToString(n.env.Workload.CACertPEM))
	return run(ctx, append([]string{"KUBERNETES_EXEC_INFO=" + info}, env...), binary,
		append([]string{"credential", "--config=" + n.ConfigPath}, extra...)...)
}

// Kubectl runs the built kubectl with the node's exec-plugin kubeconfig.
func (n *Node) Kubectl(ctx context.Context, args ...string) Result {
	return run(ctx, nil, filepath.Join(n.env.K8sBin, "kubectl"), append([]string{"--kubeconfig=" + n.Kubeconfig}, args...)...)
}

func run(ctx context.Context, env []string, bin string, args ...string) Result {
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	return Result{Stdout: stdout.String(), Stderr: stderr.String(), Err: err, Took: time.Since(start)}
}
