// Package bench measures the node binary and the controller against what
// Kubernetes does without them, each figure beside its baseline from the
// same run (docs/performance.md explains them all):
//
//   - BenchmarkCachedPath: the exec plugin's cached path as a whole process
//     against the floor (a minimal Go binary printing a fixed ExecCredential);
//   - BenchmarkKubeletBootstrapLimiter: the client-side limiters behind
//     kubelet TLS bootstrap's 400 ms back to back;
//   - BenchmarkColdPath: a node from nothing to a certificate with every
//     attestor, against kubelet's TLS bootstrap through kube-controller-manager,
//     spaced and back to back, interleaved;
//   - BenchmarkFleetJoin: a thousand exec-plugin processes joining 50 at a
//     time, against tuned and default kube-controller-manager, with a plot;
//   - BenchmarkFleetJoinTPM: the same with TPM nodes, each on its own swtpm,
//     all at once, first join and rejoin, and where a join's time goes;
//   - BenchmarkSignerThroughput, BenchmarkSignerMemory, BenchmarkSignerClusters:
//     the controller's signing rate, and its memory per Machine and per
//     workload cluster;
//   - BenchmarkAgentRSS: the agent's steady-state memory.
//
// Each benchmark reports medians and p99s (ms/median, ms/p99) and, for whole
// processes, the peak resident set size (MiB/peak-rss).
package bench

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

type sample struct {
	wall []time.Duration
	rss  int64 // KiB
}

func (s *sample) median() time.Duration {
	w := slices.Clone(s.wall)
	slices.Sort(w)
	return w[len(w)/2]
}

func (s *sample) p99() time.Duration {
	w := slices.Clone(s.wall)
	slices.Sort(w)
	return w[len(w)*99/100]
}

func (s *sample) report(b *testing.B, prefix string) {
	if len(s.wall) == 0 {
		return
	}
	b.ReportMetric(ms(s.median()), prefix+"ms/median")
	b.ReportMetric(ms(s.p99()), prefix+"ms/p99")
	if s.rss > 0 {
		b.ReportMetric(float64(s.rss)/1024, prefix+"MiB/peak-rss")
	}
}

func runProcess(b *testing.B, s *sample, env []string, bin string, args ...string) {
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	start := time.Now()
	out, err := cmd.Output()
	s.wall = append(s.wall, time.Since(start))
	if err != nil || len(out) == 0 {
		b.Fatalf("%s: %v", bin, err)
	}
}

// peakRSS runs the command under GNU time, which forks it from a small
// process: a child forked straight from the (large) test binary inherits
// the parent's resident set in its ru_maxrss.
func peakRSS(b *testing.B, env []string, bin string, args ...string) int64 {
	cmd := exec.Command("/usr/bin/time", append([]string{"-f", "%M", bin}, args...)...)
	cmd.Env = env
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		b.Fatalf("/usr/bin/time %s: %v\n%s", bin, err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
	kib, err := strconv.ParseInt(lines[len(lines)-1], 10, 64)
	if err != nil {
		b.Fatalf("unexpected /usr/bin/time output %q", stderr.String())
	}
	return kib
}

// BenchmarkCachedPath runs kubelet-authenticator credential with a fresh
// cached certificate and the floor binary alternately, so both see the same
// machine load, and reports each one's median and p99 wall time, peak RSS,
// and the ratio of the medians. The node binary is built as make build
// builds it (no build tags, CGO_ENABLED=0, stripped): the one binary kubelet
// runs, whose every linked package is initialised on every call.
func BenchmarkCachedPath(b *testing.B) {
	floor := buildRelease(b, "./floor")
	plugin := buildRelease(b, "../../cmd/kubelet-authenticator")
	dir := b.TempDir()
	cacheDir := filepath.Join(dir, "cache")
	writeCachedCredential(b, cacheDir)
	cfgPath := filepath.Join(dir, "config.yaml")
	cfg := fmt.Sprintf("apiVersion: %s\nkind: %s\nnodeName: node-1\nproviderID: test:///node-1\nattestor: insecure\ncacheDir: %s\n", config.APIVersion, config.Kind, cacheDir)
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		b.Fatal(err)
	}
	env := []string{`KUBERNETES_EXEC_INFO={"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","spec":{"interactive":false}}`}
	args := []string{"credential", "--config=" + cfgPath}
	var p, f sample
	for b.Loop() {
		runProcess(b, &f, env, floor)
		runProcess(b, &p, env, plugin, args...)
	}
	b.StopTimer()
	p.rss = peakRSS(b, env, plugin, args...)
	f.rss = peakRSS(b, env, floor)
	p.report(b, "plugin-")
	f.report(b, "floor-")
	b.ReportMetric(float64(p.median())/float64(f.median()), "x-floor")
}

// buildRelease builds the command pkg (relative to this package) as make
// build builds release binaries (no build tags, CGO_ENABLED=0, stripped)
// and returns its path.
func buildRelease(b *testing.B, pkg string) string {
	b.Helper()
	out := filepath.Join(b.TempDir(), filepath.Base(pkg))
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if o, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("build %s: %v\n%s", pkg, err, o)
	}
	return out
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// writeCachedCredential writes a fresh self-signed client certificate into
// the cache, as a previous cold call would have left it.
func writeCachedCredential(b *testing.B, dir string) {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "system:node:node-1", Organization: []string{attestor.NodesGroup}},
		NotBefore:    time.Now().Add(-time.Minute),
		NotAfter:     time.Now().Add(24 * time.Hour),
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		b.Fatal(err)
	}
	kder, _ := x509.MarshalPKCS8PrivateKey(key)
	if err := (cache.Dir{Path: dir}).Store(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder})); err != nil {
		b.Fatal(err)
	}
}
