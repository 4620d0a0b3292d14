// Package bench measures the exec plugin: its cached path as a whole process
// against the floor (a minimal Go binary printing a fixed ExecCredential),
// and its cold path (no cache to certificate, through the real controller)
// against kubelet's own TLS bootstrap through kube-controller-manager's
// csrapproving and csrsigning controllers on the same API server.
//
// Each benchmark reports the median wall time per call (ms/median) and, for
// whole processes, the peak resident set size (MiB/peak-rss).
package bench

import (
	"context"
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

	certificatesv1 "k8s.io/api/certificates/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/util/certificate/csr"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
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
	bins := b.TempDir()
	floor := filepath.Join(bins, "floor")
	plugin := filepath.Join(bins, "kubelet-authenticator")
	for _, build := range []struct{ out, pkg string }{{floor, "./floor"}, {plugin, "../../cmd/kubelet-authenticator"}} {
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", build.out, build.pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("build %s: %v\n%s", build.pkg, err, out)
		}
	}
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

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// BenchmarkColdPath obtains a certificate from nothing: our exec plugin
// through the real controller (insecure attestor), against kubelet's TLS
// bootstrap (client-go's csr.RequestCertificate + WaitForCertificate, what
// kubelet runs) approved and signed by kube-controller-manager.
func BenchmarkColdPath(b *testing.B) {
	env := scenario.Start(b, scenario.Options{})
	ctx := context.Background()

	b.Run("kubelet-authenticator", func(b *testing.B) {
		n := env.NewNode(b, "cold-1", "test:///fleet/cold-1", "insecure")
		env.Machine(b, n)
		var s sample
		for b.Loop() {
			if err := os.RemoveAll(n.CacheDir); err != nil {
				b.Fatal(err)
			}
			r := n.Credential(ctx)
			if r.Err != nil {
				b.Fatalf("credential: %v\n%s", r.Err, r.Stderr)
			}
			s.wall = append(s.wall, r.Took)
		}
		s.report(b, "")
	})

	b.Run("kubelet-tls-bootstrap-kcm", func(b *testing.B) {
		wl := env.Workload
		autoApprove(b, wl)
		harness.StartProcess(b, "kube-controller-manager", filepath.Join(env.Dir, "kcm.log"),
			filepath.Join(env.K8sBin, "kube-controller-manager"),
			"--kubeconfig="+wl.AdminKubeconfig,
			"--authentication-kubeconfig="+wl.AdminKubeconfig,
			"--authorization-kubeconfig="+wl.AdminKubeconfig,
			"--controllers=csrapproving,csrsigning",
			"--cluster-signing-cert-file="+wl.CACertFile,
			"--cluster-signing-key-file="+wl.CAKeyFile,
			"--leader-elect=false",
			fmt.Sprintf("--secure-port=%d", harness.FreePort(b)),
			"--bind-address=127.0.0.1")
		client, err := kubernetes.NewForConfig(wl.RESTConfigFor(b, clientcmdapi.AuthInfo{Token: env.Token}))
		if err != nil {
			b.Fatal(err)
		}
		var s sample
		for b.Loop() {
			start := time.Now()
			key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
				Subject: pkix.Name{CommonName: "system:node:cold-2", Organization: []string{"system:nodes"}},
			}, key)
			if err != nil {
				b.Fatal(err)
			}
			name, uid, err := csr.RequestCertificate(client, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}), "",
				certificatesv1.KubeAPIServerClientKubeletSignerName,
				nil, []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}, key)
			if err != nil {
				b.Fatal(err)
			}
			wctx, cancel := context.WithTimeout(ctx, time.Minute)
			_, err = csr.WaitForCertificate(wctx, client, name, uid)
			cancel()
			if err != nil {
				b.Fatalf("kcm did not sign %s: %v", name, err)
			}
			s.wall = append(s.wall, time.Since(start))
		}
		s.report(b, "")
	})
}

// autoApprove binds kubeadm's auto-approve role for bootstrap tokens, so
// kube-controller-manager's csrapproving approves kubelet client CSRs.
func autoApprove(b *testing.B, wl *harness.ControlPlane) {
	_, err := wl.Client.RbacV1().ClusterRoleBindings().Create(context.Background(), &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "kubeadm:node-autoapprove-bootstrap"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "system:certificates.k8s.io:certificatesigningrequests:nodeclient"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: "system:bootstrappers:kubeadm:default-node-token"}},
	}, metav1.CreateOptions{})
	if err != nil {
		b.Fatal(err)
	}
}

// writeCachedCredential writes a fresh self-signed client certificate into
// the cache, as a previous cold call would have left it.
func writeCachedCredential(b *testing.B, dir string) {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "system:node:node-1", Organization: []string{"system:nodes"}},
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
