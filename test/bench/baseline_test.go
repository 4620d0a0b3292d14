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
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/certificate/csr"
	"k8s.io/client-go/util/flowcontrol"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// kcmCSRControllers are the only kube-controller-manager controllers the
// baseline runs: the approver of kubelet client CSRs and the signers. An
// idle kube-controller-manager with nothing else to do is its fastest
// honest configuration for a single join.
const kcmCSRControllers = "csrapproving,csrsigning"

// kcmTunedArgs lift kube-controller-manager's own client rate limit
// (default --kube-api-qps 20, --kube-api-burst 30): every kubelet join
// costs it three requests (a SubjectAccessReview, the approval, the
// certificate), so a fleet joining at once is throttled at about 7 joins/s
// by its defaults.
var kcmTunedArgs = []string{"--kube-api-qps=1000", "--kube-api-burst=2000"}

// startKCM runs kube-controller-manager's CSR controllers against wl, signing
// with wl's cluster CA, with its default flags but for extra. It is stopped
// when the benchmark ends, or earlier by Stop.
func startKCM(b *testing.B, wl *harness.ControlPlane, logName string, extra ...string) *harness.Process {
	b.Helper()
	args := append([]string{
		"--kubeconfig=" + wl.AdminKubeconfig,
		"--authentication-kubeconfig=" + wl.AdminKubeconfig,
		"--authorization-kubeconfig=" + wl.AdminKubeconfig,
		"--controllers=" + kcmCSRControllers,
		"--cluster-signing-cert-file=" + wl.CACertFile,
		"--cluster-signing-key-file=" + wl.CAKeyFile,
		"--leader-elect=false",
		fmt.Sprintf("--secure-port=%d", harness.FreePort(b)),
		"--bind-address=127.0.0.1",
	}, extra...)
	return harness.StartProcess(b, "kube-controller-manager", filepath.Join(b.TempDir(), logName),
		filepath.Join(harness.Binaries(b), "kube-controller-manager"), args...)
}

// autoApprove binds kubeadm's auto-approve role for bootstrap tokens, so
// kube-controller-manager's csrapproving approves kubelet client CSRs. It
// may be called more than once.
func autoApprove(b *testing.B, wl *harness.ControlPlane) {
	b.Helper()
	_, err := wl.Client.RbacV1().ClusterRoleBindings().Create(context.Background(), &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "kubeadm:node-autoapprove-bootstrap"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "system:certificates.k8s.io:certificatesigningrequests:nodeclient"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: "system:bootstrappers:kubeadm:default-node-token"}},
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		b.Fatal(err)
	}
}

// kubeletJoin is kubelet's TLS bootstrap of one node, in process: a new P-256
// key, client-go's csr.RequestCertificate and csr.WaitForCertificate (what
// kubelet's bootstrap package calls) through client, approved and signed by
// kube-controller-manager. A nil client means a new one from cfg, as each
// kubelet process has its own (client-go's default rate limit, 5 requests/s
// with a burst of 10, full at start; its own TLS connection).
func kubeletJoin(ctx context.Context, cfg *rest.Config, client kubernetes.Interface, nodeName string) error {
	if client == nil {
		// A transport of its own, so a new TLS connection, as a new kubelet
		// opens: client-go's transport cache would otherwise hand every
		// in-process join the benchmark's pooled connection. A config with
		// a Proxy function is never cached.
		c := rest.CopyConfig(cfg)
		c.Proxy = http.ProxyFromEnvironment
		hc, err := rest.HTTPClientFor(c)
		if err != nil {
			return err
		}
		defer hc.CloseIdleConnections()
		if client, err = kubernetes.NewForConfigAndClient(c, hc); err != nil {
			return err
		}
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: attestor.NodeUserPrefix + nodeName, Organization: []string{attestor.NodesGroup}},
	}, key)
	if err != nil {
		return err
	}
	name, uid, err := csr.RequestCertificateWithContext(ctx, client, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}), "",
		certificatesv1.KubeAPIServerClientKubeletSignerName,
		nil, []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}, key)
	if err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if _, err := csr.WaitForCertificate(wctx, client, name, uid); err != nil {
		return fmt.Errorf("kube-controller-manager did not sign %s: %w", name, err)
	}
	return nil
}

// meteredLimiter is client-go's token bucket rate limiter that also adds up
// how long requests waited in it.
type meteredLimiter struct {
	flowcontrol.RateLimiter
	mu     sync.Mutex
	waited time.Duration
}

func newMeteredLimiter(qps float32, burst int) *meteredLimiter {
	return &meteredLimiter{RateLimiter: flowcontrol.NewTokenBucketRateLimiter(qps, burst)}
}

func (m *meteredLimiter) Wait(ctx context.Context) error {
	start := time.Now()
	err := m.RateLimiter.Wait(ctx)
	m.mu.Lock()
	m.waited += time.Since(start)
	m.mu.Unlock()
	return err
}

// take returns the wait added up since the last take.
func (m *meteredLimiter) take() time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	w := m.waited
	m.waited = 0
	return w
}

// limiterBlock is how many joins one variant of BenchmarkKubeletBootstrapLimiter
// runs back to back: enough to drain both the bootstrap client's burst
// (10 requests, 2 a join) and kube-controller-manager's (30, 3 a join),
// so that most joins see the steady state.
const limiterBlock = 30

// limiterRest lets both buckets fill again between blocks.
const limiterRest = 2 * time.Second

// BenchmarkKubeletBootstrapLimiter finds the limiters behind kubelet TLS
// bootstrap's ~400 ms when joins run back to back. kube-controller-manager
// signs, first with its default flags, then with its client limit lifted
// (kcmTunedArgs), while the bootstrap client is, in turn, in blocks of
// limiterBlock back-to-back joins:
//
//   - shared-5qps: one client for every join with client-go's default rate
//     limit (5 requests/s, burst 10), as the old baseline reused it;
//   - shared-unthrottled: the same client with only that limit lifted;
//   - fresh-client: a new client per join (client-go's default limit, a
//     full bucket, its own connection), as each kubelet process has.
//
// A join costs the bootstrap client three requests: the create, the v1
// probe List of csr.WaitForCertificate, and its watch. client-go throttles
// the first two (a watch takes no token), so a shared client at 5/s
// settles at 400 ms a join. kube-controller-manager spends three requests
// a join (a SubjectAccessReview, the approval, the certificate) at its
// default 20/s, burst 30: long back-to-back runs settle at 150 ms a join
// whatever the bootstrap client does. It reports each pair's median join
// and the median time a join's requests waited in the bootstrap client's
// rate limiter (ms-limiter-wait/median).
func BenchmarkKubeletBootstrapLimiter(b *testing.B) {
	wl := harness.StartControlPlane(b, "workload")
	autoApprove(b, wl)
	boot := wl.BootstrapKubeconfig(b, wl.CreateBootstrapToken(b))
	cfg := restConfigFromFile(b, boot)
	ctx := context.Background()

	type variant struct {
		name    string
		limiter *meteredLimiter
		client  kubernetes.Interface
		join, w map[string]*sample // by kube-controller-manager configuration
	}
	mk := func(name string, qps float32, burst int) *variant {
		v := &variant{name: name, join: map[string]*sample{}, w: map[string]*sample{}}
		if qps == 0 {
			return v
		}
		v.limiter = newMeteredLimiter(qps, burst)
		c := rest.CopyConfig(cfg)
		c.RateLimiter = v.limiter
		client, err := kubernetes.NewForConfig(c)
		if err != nil {
			b.Fatal(err)
		}
		v.client = client
		return v
	}
	variants := []*variant{
		mk("shared-5qps", rest.DefaultQPS, rest.DefaultBurst),
		mk("shared-unthrottled", 1e6, 1e6),
		mk("fresh-client", 0, 0),
	}
	kcms := []struct {
		name string
		args []string
	}{{"kcm-default", nil}, {"kcm-tuned", kcmTunedArgs}}
	n := 0
	for b.Loop() {
		for _, k := range kcms {
			p := startKCM(b, wl, k.name+".log", k.args...)
			harness.WaitFor(b, time.Minute, func() (bool, error) {
				return kubeletJoin(ctx, cfg, nil, "warm-"+k.name) == nil, nil
			})
			for _, v := range variants {
				time.Sleep(limiterRest)
				if v.join[k.name] == nil {
					v.join[k.name], v.w[k.name] = &sample{}, &sample{}
				}
				for range limiterBlock {
					n++
					if v.limiter != nil {
						v.limiter.take()
					}
					start := time.Now()
					if err := kubeletJoin(ctx, cfg, v.client, fmt.Sprintf("limiter-%05d", n)); err != nil {
						b.Fatal(err)
					}
					v.join[k.name].wall = append(v.join[k.name].wall, time.Since(start))
					if v.limiter != nil {
						v.w[k.name].wall = append(v.w[k.name].wall, v.limiter.take())
					}
				}
			}
			p.Stop(10 * time.Second)
		}
	}
	b.StopTimer()
	fmt.Printf("kubelet TLS bootstrap, %d joins back to back per block:\n  %-19s", limiterBlock, "bootstrap client")
	for _, k := range kcms {
		fmt.Printf(" %26s", k.name+" median (p99)")
	}
	fmt.Printf("   %s\n", "waited in the bootstrap client's limiter (median)")
	for _, v := range variants {
		fmt.Printf("  %-19s", v.name)
		for _, k := range kcms {
			j := v.join[k.name]
			j.report(b, v.name+"-"+k.name+"-")
			fmt.Printf(" %15.1fms (%6.1fms)", ms(j.median()), ms(j.p99()))
		}
		for _, k := range kcms {
			if w := v.w[k.name]; len(w.wall) > 0 {
				b.ReportMetric(ms(w.median()), v.name+"-"+k.name+"-ms-limiter-wait/median")
				fmt.Printf("   %s %.1fms", k.name, ms(w.median()))
			}
		}
		fmt.Println()
	}
}

// restConfigFromFile loads a kubeconfig file.
func restConfigFromFile(b *testing.B, path string) *rest.Config {
	b.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		b.Fatal(err)
	}
	return cfg
}
