// Package harness starts real Kubernetes control planes (etcd and
// kube-apiserver built by test/tools/install-k8s.sh) on 127.0.0.1 for
// integration and end-to-end tests, with a self-made PKI, bootstrap tokens
// laid out like kubeadm's, and a Cluster API management cluster that serves the
// real Cluster API CRDs.
//
// Every control plane belongs to one test: it is stopped by t.Cleanup, its
// files live in a t.TempDir, and its processes run in process groups of their
// own that the kernel kills if the test binary dies. Nothing is shared between
// tests.
//
// A typical test:
//
//	wl := harness.StartControlPlane(t, "workload")
//	m := harness.StartManagement(t)
//	m.AddWorkloadCluster(t, "default", "wl1", wl, map[string]string{"kubelet-authenticator.x-k8s.io/enabled": "true"})
//	m.CreateMachine(t, "default", "wl1", "wl1-md-0-abc", "aws:///us-east-1a/i-0abc", true, "node-1")
//	token := wl.CreateBootstrapToken(t)
//	kubeconfig := wl.BootstrapKubeconfig(t, token)
//
// The binaries come from Binaries (KA_K8S_BIN, or test/tools/install-k8s.sh).
package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// binaryNames are the programs Binaries promises.
var binaryNames = []string{"kube-apiserver", "kube-controller-manager", "kubemark", "kubectl", "etcd"}

var binaries struct {
	sync.Mutex
	dir string
}

// Binaries returns the directory holding kube-apiserver,
// kube-controller-manager, kubemark, kubectl and etcd. The environment
// variable KA_K8S_BIN overrides; otherwise it runs test/tools/install-k8s.sh
// (which builds them once into a cache directory) and uses the last line of
// its output. It fails the test, never skips it, when they are unavailable.
func Binaries(tb testing.TB) string {
	tb.Helper()
	binaries.Lock()
	defer binaries.Unlock()
	if binaries.dir != "" {
		return binaries.dir
	}
	dir := os.Getenv("KA_K8S_BIN")
	if dir == "" {
		var err error
		dir, err = installBinaries()
		if err != nil {
			tb.Fatalf("Kubernetes binaries unavailable (set KA_K8S_BIN or run test/tools/install-k8s.sh): %v", err)
		}
	}
	var missing []string
	for _, b := range binaryNames {
		if fi, err := os.Stat(filepath.Join(dir, b)); err != nil || fi.Mode()&0o111 == 0 {
			missing = append(missing, b)
		}
	}
	if len(missing) > 0 {
		tb.Fatalf("Kubernetes binaries missing from %s: %s", dir, strings.Join(missing, ", "))
	}
	binaries.dir = dir
	return dir
}

// installBinaries runs test/tools/install-k8s.sh (which serializes builds
// with a lock file of its own) and returns its last line of output.
func installBinaries() (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	script := filepath.Join(root, "test", "tools", "install-k8s.sh")
	var stdout, stderr bytes.Buffer
	cmd := exec.Command("bash", script)
	cmd.Dir = root
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("%s failed: %w; stderr:\n%s", script, err, LastLines(stderr.String(), 30))
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	dir := strings.TrimSpace(lines[len(lines)-1])
	if dir == "" {
		return "", fmt.Errorf("%s printed no directory", script)
	}
	return dir, nil
}

// RepoRoot returns the root of the kubelet-authenticator repository: the
// directory of `go env GOMOD`, or else the one two levels above this file.
func RepoRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err == nil {
		if mod := strings.TrimSpace(string(out)); mod != "" && mod != os.DevNull {
			return filepath.Dir(mod), nil
		}
	}
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("unable to find the repository root: no go.mod and no caller information")
	}
	root := filepath.Join(filepath.Dir(file), "..", "..")
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		return "", fmt.Errorf("unable to find the repository root: %w", err)
	}
	return root, nil
}

// ModuleDir returns the directory of module path at version in the module
// cache, downloading it if needed (`go mod download -json`).
func ModuleDir(path, version string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	cmd := exec.Command("go", "mod", "download", "-json", path+"@"+version)
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("unable to download %s@%s: %w: %s%s", path, version, err, stderr.String(), out)
	}
	var info struct {
		Dir   string
		Error string
	}
	if err := json.Unmarshal(out, &info); err != nil {
		return "", fmt.Errorf("unable to parse go mod download output for %s@%s: %w", path, version, err)
	}
	if info.Error != "" || info.Dir == "" {
		return "", fmt.Errorf("unable to download %s@%s: %s", path, version, info.Error)
	}
	return info.Dir, nil
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago. Another
// process may take it before the caller binds it; the harness retries its own
// processes when that happens.
func FreePort(tb testing.TB) int {
	tb.Helper()
	port, err := freePort()
	if err != nil {
		tb.Fatalf("unable to find a free port: %v", err)
	}
	return port
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("unable to listen on 127.0.0.1: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// WaitFor calls cond every 100 ms until it returns true, and fails the test
// if that has not happened within timeout. An error from cond does not stop
// the wait (the thing waited for may not exist yet); the last one is reported
// if the wait times out.
func WaitFor(tb testing.TB, timeout time.Duration, cond func() (bool, error)) {
	tb.Helper()
	if err := poll(context.Background(), timeout, cond); err != nil {
		tb.Fatal(err)
	}
}

// poll is WaitFor returning an error.
func poll(ctx context.Context, timeout time.Duration, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var lastErr error
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		var stop *stopPolling
		if errors.As(err, &stop) {
			return stop.err
		}
		if err != nil {
			lastErr = err
		}
		select {
		case <-ctx.Done():
			if lastErr != nil {
				return fmt.Errorf("condition not met within %s: %w", timeout, lastErr)
			}
			return fmt.Errorf("condition not met within %s", timeout)
		case <-tick.C:
		}
	}
}

// stopPolling is an error that ends poll at once, returning err.
type stopPolling struct{ err error }

func (s *stopPolling) Error() string { return s.err.Error() }
func (s *stopPolling) Unwrap() error { return s.err }

// LastLines returns the last n lines of s, for failure messages that show
// the end of a log.
func LastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
