package harness

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Timeouts of the harness. The machines tests run on are small and shared.
const (
	etcdReadyTimeout      = 30 * time.Second
	apiServerReadyTimeout = 90 * time.Second
	apiServerStopGrace    = 10 * time.Second
	etcdStopGrace         = 5 * time.Second
	startAttempts         = 3
)

// ServiceClusterIPRange is the --service-cluster-ip-range of every control plane.
const ServiceClusterIPRange = "10.96.0.0/12"

// ServiceAccountIssuer is the --service-account-issuer of every control plane
// (kubeadm's default).
const ServiceAccountIssuer = "https://kubernetes.default.svc.cluster.local"

// ControlPlane is a running etcd and kube-apiserver on 127.0.0.1, owned by one test.
type ControlPlane struct {
	// Name names the control plane in logs and kubeconfigs.
	Name string
	// URL is the kube-apiserver's address, https://127.0.0.1:<port>.
	URL string
	// Dir is the control plane's own temporary directory (PKI, data, logs).
	Dir string
	// CACertPEM is the cluster CA: it signs the kube-apiserver serving
	// certificate and is its --client-ca-file, like Cluster API's <cluster>-ca.
	CACertPEM []byte
	// CAKeyPEM is the CA's private key, SEC 1 ("EC PRIVATE KEY") PEM.
	CAKeyPEM []byte
	// CA is the cluster CA, parsed; it can issue more certificates.
	CA *CA
	// CACertFile and CAKeyFile hold CACertPEM and CAKeyPEM on disk (for
	// example for kube-controller-manager --cluster-signing-*-file).
	CACertFile, CAKeyFile string
	// AdminConfig authenticates with a client certificate in system:masters.
	AdminConfig *rest.Config
	// AdminKubeconfig is the path of a kubeconfig file for AdminConfig (usable by kubectl).
	AdminKubeconfig string
	// Client is a clientset for AdminConfig.
	Client kubernetes.Interface

	adminCertPEM, adminKeyPEM []byte
	etcd, apiServer           *Process
	apiServerExtra            []string // the extra flags kube-apiserver runs with
	mu                        sync.Mutex
	others                    []*Process // started against this control plane, stopped before it
	etcdURL                   string
	stopOnce                  sync.Once
}

// Option changes how StartControlPlane starts a control plane.
type Option func(*options)

type options struct {
	apiServerArgs []string
	audit         bool // WithAuditLog (audit.go)
}

// WithAPIServerArgs adds kube-apiserver flags, written "--name=value". A flag
// the harness sets itself is replaced; --feature-gates and --runtime-config
// are added to the harness's own list.
func WithAPIServerArgs(args ...string) Option {
	return func(o *options) { o.apiServerArgs = append(o.apiServerArgs, args...) }
}

// WithPodCertificates turns on the PodCertificateRequest API
// (certificates.k8s.io/v1beta1, beta and off by default in 1.36). The
// node authorizer's selector checks (AuthorizeNodeWithSelectors) and
// MutatingAdmissionPolicy are GA and on in 1.36: no flag.
func WithPodCertificates() Option {
	return WithAPIServerArgs("--feature-gates=PodCertificateRequest=true",
		"--runtime-config=certificates.k8s.io/v1beta1/podcertificaterequests=true")
}

// StartControlPlane starts etcd and kube-apiserver on free ports of 127.0.0.1
// with a new PKI, and returns once /readyz answers ok. The kube-apiserver
// runs with Node,RBAC authorization, NodeRestriction, bootstrap token
// authentication and the ClusterTrustBundle API (certificates.k8s.io/v1beta1).
// A cleanup stops it (kube-apiserver first, then etcd) and, if the test
// failed, logs the last lines of both logs.
func StartControlPlane(tb testing.TB, name string, opts ...Option) *ControlPlane {
	tb.Helper()
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	bin := Binaries(tb)
	cp := &ControlPlane{Name: name, Dir: tb.TempDir()}
	tb.Cleanup(func() {
		cp.Stop()
		if tb.Failed() {
			cp.DumpLogs(tb)
		}
	})
	if err := cp.writePKI(); err != nil {
		tb.Fatalf("control plane %s: %v", name, err)
	}
	if err := cp.startEtcd(bin); err != nil {
		tb.Fatalf("control plane %s: %v", name, err)
	}
	if o.audit {
		args, err := cp.auditArgs()
		if err != nil {
			tb.Fatalf("control plane %s: %v", name, err)
		}
		o.apiServerArgs = append(args, o.apiServerArgs...)
	}
	if err := cp.startAPIServer(bin, o.apiServerArgs); err != nil {
		tb.Fatalf("control plane %s: %v", name, err)
	}
	if err := cp.ensureSystemNamespaces(); err != nil {
		tb.Fatalf("control plane %s: %v", name, err)
	}
	cp.AdminKubeconfig = filepath.Join(cp.Dir, "admin.kubeconfig")
	admin := clientcmdapi.AuthInfo{ClientCertificateData: cp.adminCertPEM, ClientKeyData: cp.adminKeyPEM}
	kubeconfig := buildKubeconfig(cp.Name, cp.URL, cp.CACertPEM, "kubernetes-admin", admin)
	if err := os.WriteFile(cp.AdminKubeconfig, kubeconfig, 0o600); err != nil {
		tb.Fatalf("control plane %s: unable to write admin kubeconfig: %v", name, err)
	}
	return cp
}

// writePKI makes the cluster CA, the kube-apiserver serving certificate, the
// admin client certificate and the service-account key, and writes what the
// processes read into Dir/pki.
func (cp *ControlPlane) writePKI() error {
	pki := filepath.Join(cp.Dir, "pki")
	if err := os.MkdirAll(pki, 0o700); err != nil {
		return fmt.Errorf("unable to create PKI directory: %w", err)
	}
	ca, err := NewCA(cp.Name + "-ca")
	if err != nil {
		return err
	}
	cp.CA, cp.CACertPEM, cp.CAKeyPEM = ca, ca.CertPEM, ca.KeyPEM
	servingCert, servingKey, err := ca.Issue(CertSpec{
		CommonName: "kube-apiserver",
		DNSNames:   []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		IPs:        []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback, net.IPv4(10, 96, 0, 1)},
		Server:     true,
	})
	if err != nil {
		return err
	}
	cp.adminCertPEM, cp.adminKeyPEM, err = ca.Issue(CertSpec{CommonName: "kubernetes-admin", Organization: []string{"system:masters"}})
	if err != nil {
		return err
	}
	saKey, saPub, err := newServiceAccountKey()
	if err != nil {
		return err
	}
	cp.CACertFile, cp.CAKeyFile = filepath.Join(pki, "ca.crt"), filepath.Join(pki, "ca.key")
	for file, data := range map[string][]byte{
		"ca.crt":        ca.CertPEM,
		"ca.key":        ca.KeyPEM,
		"apiserver.crt": servingCert,
		"apiserver.key": servingKey,
		"sa.key":        saKey,
		"sa.pub":        saPub,
	} {
		if err := os.WriteFile(filepath.Join(pki, file), data, 0o600); err != nil {
			return fmt.Errorf("unable to write %s: %w", file, err)
		}
	}
	return nil
}

// startEtcd starts etcd and waits until it reports healthy, retrying with
// new ports when one was taken in the meantime.
func (cp *ControlPlane) startEtcd(bin string) error {
	var err error
	for range startAttempts {
		if err = cp.tryStartEtcd(bin); !errors.Is(err, errAddressInUse) {
			return err
		}
	}
	return err
}

func (cp *ControlPlane) tryStartEtcd(bin string) error {
	clientPort, err := freePort()
	if err != nil {
		return err
	}
	peerPort, err := freePort()
	if err != nil {
		return err
	}
	clientURL := fmt.Sprintf("http://127.0.0.1:%d", clientPort)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	dataDir := filepath.Join(cp.Dir, "etcd-data")
	if err := os.RemoveAll(dataDir); err != nil {
		return fmt.Errorf("unable to clear etcd data directory: %w", err)
	}
	p, err := startProcess("etcd", filepath.Join(cp.Dir, "etcd.log"), filepath.Join(bin, "etcd"),
		"--name="+cp.Name,
		"--data-dir="+dataDir,
		"--listen-client-urls="+clientURL,
		"--advertise-client-urls="+clientURL,
		"--listen-peer-urls="+peerURL,
		"--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster="+cp.Name+"="+peerURL,
		"--initial-cluster-state=new",
		"--unsafe-no-fsync=true", // test data; saves most of the disk time
		"--log-level=warn",
	)
	if err != nil {
		return err
	}
	cp.etcd, cp.etcdURL = p, clientURL

	httpClient := &http.Client{Timeout: 2 * time.Second}
	err = poll(context.Background(), etcdReadyTimeout, func() (bool, error) {
		if exited, _ := p.Exited(); exited {
			return false, &stopPolling{p.exitError()}
		}
		resp, err := httpClient.Get(clientURL + "/health")
		if err != nil {
			return false, err
		}
		defer resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
	if exited, _ := p.Exited(); exited {
		return p.exitError()
	}
	if err != nil {
		return fmt.Errorf("etcd not healthy: %w", err)
	}
	return nil
}

// apiServerArgs returns kube-apiserver's flags for the given port, with
// extra ("--name=value") replacing or, for list-valued flags, extending them.
func (cp *ControlPlane) apiServerArgs(port int, extra []string) []string {
	pki := filepath.Join(cp.Dir, "pki")
	flags := map[string]string{
		"advertise-address":                "127.0.0.1",
		"bind-address":                     "127.0.0.1",
		"secure-port":                      strconv.Itoa(port),
		"etcd-servers":                     cp.etcdURL,
		"tls-cert-file":                    filepath.Join(pki, "apiserver.crt"),
		"tls-private-key-file":             filepath.Join(pki, "apiserver.key"),
		"client-ca-file":                   filepath.Join(pki, "ca.crt"),
		"service-account-key-file":         filepath.Join(pki, "sa.pub"),
		"service-account-signing-key-file": filepath.Join(pki, "sa.key"),
		"service-account-issuer":           ServiceAccountIssuer,
		"service-cluster-ip-range":         ServiceClusterIPRange,
		"authorization-mode":               "Node,RBAC",
		"enable-admission-plugins":         "NodeRestriction",
		"enable-bootstrap-token-auth":      "true",
		"allow-privileged":                 "true",
		// ClusterTrustBundle is beta and off by default in 1.36; its API is
		// certificates.k8s.io/v1beta1 and needs both the gate and runtime-config.
		"feature-gates":  "ClusterTrustBundle=true,ClusterTrustBundleProjection=true",
		"runtime-config": "certificates.k8s.io/v1beta1/clustertrustbundles=true",
		"profiling":      "false",
		"v":              "1",
	}
	for _, arg := range extra {
		k, v, _ := strings.Cut(strings.TrimLeft(arg, "-"), "=")
		if old, ok := flags[k]; ok && (k == "feature-gates" || k == "runtime-config") {
			v = old + "," + v
		}
		flags[k] = v
	}
	keys := make([]string, 0, len(flags))
	for k := range flags {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	args := make([]string, 0, len(keys))
	for _, k := range keys {
		args = append(args, "--"+k+"="+flags[k])
	}
	return args
}

// startAPIServer starts kube-apiserver and waits until /readyz answers ok,
// retrying with a new port when its port was taken in the meantime.
func (cp *ControlPlane) startAPIServer(bin string, extra []string) error {
	var err error
	for range startAttempts {
		if err = cp.tryStartAPIServer(bin, extra); !errors.Is(err, errAddressInUse) {
			return err
		}
	}
	return err
}

func (cp *ControlPlane) tryStartAPIServer(bin string, extra []string) error {
	port, err := freePort()
	if err != nil {
		return err
	}
	p, err := startProcess("kube-apiserver", filepath.Join(cp.Dir, "kube-apiserver.log"), filepath.Join(bin, "kube-apiserver"), cp.apiServerArgs(port, extra)...)
	if err != nil {
		return err
	}
	cp.apiServer = p
	cp.URL = fmt.Sprintf("https://127.0.0.1:%d", port)
	cp.AdminConfig = &rest.Config{
		Host: cp.URL,
		TLSClientConfig: rest.TLSClientConfig{
			CAData:   cp.CACertPEM,
			CertData: cp.adminCertPEM,
			KeyData:  cp.adminKeyPEM,
		},
		QPS:   200,
		Burst: 400,
	}
	client, err := kubernetes.NewForConfig(cp.AdminConfig)
	if err != nil {
		return fmt.Errorf("unable to create admin client: %w", err)
	}
	cp.Client = client
	cp.apiServerExtra = extra
	return cp.waitAPIServerReady(p)
}

// waitAPIServerReady waits until kube-apiserver process p answers /readyz.
func (cp *ControlPlane) waitAPIServerReady(p *Process) error {
	err := poll(context.Background(), apiServerReadyTimeout, func() (bool, error) {
		if exited, _ := p.Exited(); exited {
			return false, &stopPolling{p.exitError()}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := cp.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err == nil, err
	})
	if exited, _ := p.Exited(); exited {
		return p.exitError()
	}
	if err != nil {
		return fmt.Errorf("kube-apiserver not ready: %w", err)
	}
	return nil
}

// ensureSystemNamespaces creates the namespaces kube-apiserver's own
// controller creates shortly after start, so that tests need not wait for it.
func (cp *ControlPlane) ensureSystemNamespaces() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, ns := range []string{metav1.NamespaceSystem, metav1.NamespacePublic, corev1.NamespaceNodeLease, metav1.NamespaceDefault} {
		if err := ensureNamespace(ctx, cp.Client, ns); err != nil {
			return err
		}
	}
	return nil
}

func ensureNamespace(ctx context.Context, client kubernetes.Interface, name string) error {
	_, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("unable to create namespace %s: %w", name, err)
	}
	return nil
}

// Stop stops kube-apiserver (SIGTERM, SIGKILL after 10 s), then etcd. It is
// idempotent; the test's cleanup calls it too.
func (cp *ControlPlane) Stop() {
	cp.stopOnce.Do(func() {
		cp.mu.Lock()
		others := cp.others
		cp.mu.Unlock()
		for _, p := range others {
			p.Stop(apiServerStopGrace)
		}
		if cp.apiServer != nil {
			cp.apiServer.Stop(apiServerStopGrace)
		}
		if cp.etcd != nil {
			cp.etcd.Stop(etcdStopGrace)
		}
	})
}

// Processes returns the control plane's processes that were started:
// the others started against it (kube-controller-manager, the Cluster API
// managers), kube-apiserver and etcd.
func (cp *ControlPlane) Processes() []*Process {
	cp.mu.Lock()
	ps := append([]*Process(nil), cp.others...)
	cp.mu.Unlock()
	for _, p := range []*Process{cp.apiServer, cp.etcd} {
		if p != nil {
			ps = append(ps, p)
		}
	}
	return ps
}

// Logs returns the paths of the kube-apiserver and etcd logs (and of
// kube-controller-manager's, if started), separated by spaces, for failure diagnosis.
func (cp *ControlPlane) Logs() string {
	paths := []string{filepath.Join(cp.Dir, "kube-apiserver.log"), filepath.Join(cp.Dir, "etcd.log")}
	cp.mu.Lock()
	for _, p := range cp.others {
		paths = append(paths, p.LogPath)
	}
	cp.mu.Unlock()
	return strings.Join(paths, " ")
}

// StartControllerManager starts kube-controller-manager against the control
// plane as admin, without leader election or serving, running the given
// controllers (kube-controller-manager's --controllers names, e.g.
// "csrsigning"; all default ones when none are given). Its CSR signers sign
// with the cluster CA. It is stopped before kube-apiserver by Stop and by the
// test's cleanup. It returns at once; wait for the effect you need.
func (cp *ControlPlane) StartControllerManager(tb testing.TB, controllers ...string) *Process {
	tb.Helper()
	if len(controllers) == 0 {
		controllers = []string{"*"}
	}
	pki := filepath.Join(cp.Dir, "pki")
	p, err := startProcess("kube-controller-manager", filepath.Join(cp.Dir, "kube-controller-manager.log"), filepath.Join(Binaries(tb), "kube-controller-manager"),
		"--kubeconfig="+cp.AdminKubeconfig,
		"--controllers="+strings.Join(controllers, ","),
		"--leader-elect=false",
		"--secure-port=0",
		"--cluster-name="+cp.Name,
		"--cluster-signing-cert-file="+cp.CACertFile,
		"--cluster-signing-key-file="+cp.CAKeyFile,
		"--root-ca-file="+cp.CACertFile,
		"--service-account-private-key-file="+filepath.Join(pki, "sa.key"),
		"--service-cluster-ip-range="+ServiceClusterIPRange,
		"--v=1",
	)
	if err != nil {
		tb.Fatalf("control plane %s: %v", cp.Name, err)
	}
	cp.mu.Lock()
	cp.others = append(cp.others, p)
	cp.mu.Unlock()
	tb.Cleanup(func() { p.Stop(apiServerStopGrace) }) // also when Stop is never called
	return p
}

// DumpLogs logs the last lines of the kube-apiserver and etcd logs.
func (cp *ControlPlane) DumpLogs(tb testing.TB) {
	tb.Helper()
	for _, path := range strings.Fields(cp.Logs()) {
		if _, err := os.Stat(path); err == nil {
			tb.Logf("control plane %s: last lines of %s:\n%s", cp.Name, path, tailFile(path, logTailLines))
		}
	}
}

// KubeconfigFor returns a kubeconfig that reaches server (cp.URL when empty),
// trusts the cluster CA and authenticates as user.
func (cp *ControlPlane) KubeconfigFor(server string, user clientcmdapi.AuthInfo) []byte {
	if server == "" {
		server = cp.URL
	}
	return buildKubeconfig(cp.Name, server, cp.CACertPEM, "user", user)
}

// RESTConfigFor returns a client configuration for cp.URL that trusts the
// cluster CA and authenticates as user.
func (cp *ControlPlane) RESTConfigFor(tb testing.TB, user clientcmdapi.AuthInfo) *rest.Config {
	tb.Helper()
	cfg, err := clientcmd.RESTConfigFromKubeConfig(cp.KubeconfigFor("", user))
	if err != nil {
		tb.Fatalf("unable to build client configuration: %v", err)
	}
	return cfg
}

// IssueClientCert issues a client certificate from the cluster CA for the
// given user name and groups, and returns it and its key PEM encoded.
func (cp *ControlPlane) IssueClientCert(tb testing.TB, commonName string, organizations ...string) (certPEM, keyPEM []byte) {
	tb.Helper()
	certPEM, keyPEM, err := cp.CA.Issue(CertSpec{CommonName: commonName, Organization: organizations})
	if err != nil {
		tb.Fatal(err)
	}
	return certPEM, keyPEM
}

// buildKubeconfig returns a one-cluster, one-user kubeconfig whose current
// context is "<userName>@<clusterName>".
func buildKubeconfig(clusterName, server string, caPEM []byte, userName string, user clientcmdapi.AuthInfo) []byte {
	contextName := userName + "@" + clusterName
	cfg := clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{clusterName: {Server: server, CertificateAuthorityData: caPEM}},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{userName: &user},
		Contexts:       map[string]*clientcmdapi.Context{contextName: {Cluster: clusterName, AuthInfo: userName}},
		CurrentContext: contextName,
	}
	b, err := clientcmd.Write(cfg)
	if err != nil {
		// Only unserializable input fails, and every field here serializes.
		panic(fmt.Sprintf("unable to serialize kubeconfig: %v", err))
	}
	return b
}

// Bootstrap token layout, as kubeadm writes it.
const (
	bootstrapTokenGroup      = "system:bootstrappers:kubeadm:default-node-token"
	bootstrapTokenBinding    = "kubeadm:kubelet-bootstrap"
	nodeBootstrapperRole     = "system:node-bootstrapper"
	bootstrapTokenChars      = "abcdefghijklmnopqrstuvwxyz0123456789"
	bootstrapTokenSecretType = corev1.SecretTypeBootstrapToken
)

// CreateBootstrapToken creates a bootstrap token the way kubeadm does and
// returns it as "<id>.<secret>": the Secret bootstrap-token-<id> in
// kube-system (usage-bootstrap-authentication, usage-bootstrap-signing,
// auth-extra-groups=system:bootstrappers:kubeadm:default-node-token,
// expiration an hour ahead) and the ClusterRoleBinding kubeadm:kubelet-bootstrap
// of ClusterRole system:node-bootstrapper to that group. It does not create
// kubeadm's CSR auto-approve bindings. It returns once kube-apiserver
// authenticates the token as system:bootstrap:<id>.
func (cp *ControlPlane) CreateBootstrapToken(tb testing.TB) string {
	tb.Helper()
	ctx := context.Background()
	id, secret := randomString(tb, 6), randomString(tb, 16)
	token := id + "." + secret
	_, err := cp.Client.CoreV1().Secrets(metav1.NamespaceSystem).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "bootstrap-token-" + id, Namespace: metav1.NamespaceSystem},
		Type:       bootstrapTokenSecretType,
		Data: map[string][]byte{
			"token-id":                       []byte(id),
			"token-secret":                   []byte(secret),
			"expiration":                     []byte(time.Now().Add(time.Hour).UTC().Format(time.RFC3339)),
			"usage-bootstrap-authentication": []byte("true"),
			"usage-bootstrap-signing":        []byte("true"),
			"auth-extra-groups":              []byte(bootstrapTokenGroup),
		},
	}, metav1.CreateOptions{})
	if err != nil {
		tb.Fatalf("unable to create bootstrap token secret: %v", err)
	}
	_, err = cp.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: bootstrapTokenBinding},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: nodeBootstrapperRole},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: bootstrapTokenGroup}},
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		tb.Fatalf("unable to create ClusterRoleBinding %s: %v", bootstrapTokenBinding, err)
	}

	// kube-apiserver reads token Secrets through an informer: wait until it has seen this one.
	client, err := kubernetes.NewForConfig(cp.RESTConfigFor(tb, clientcmdapi.AuthInfo{Token: token}))
	if err != nil {
		tb.Fatalf("unable to create bootstrap token client: %v", err)
	}
	want := attestor.BootstrapUserPrefix + id
	WaitFor(tb, 30*time.Second, func() (bool, error) {
		user, err := WhoAmI(ctx, client)
		if err != nil {
			return false, err
		}
		if user.Username != want {
			return false, fmt.Errorf("token authenticated as %q, want %q", user.Username, want)
		}
		return true, nil
	})
	return token
}

// BootstrapKubeconfig writes a kubeconfig that authenticates with the
// bootstrap token (named like kubeadm's bootstrap-kubelet.conf) and returns its path.
func (cp *ControlPlane) BootstrapKubeconfig(tb testing.TB, token string) string {
	tb.Helper()
	id, _, _ := strings.Cut(token, ".")
	path := filepath.Join(cp.Dir, "bootstrap-"+id+".kubeconfig")
	b := buildKubeconfig("kubernetes", cp.URL, cp.CACertPEM, "tls-bootstrap-token-user", clientcmdapi.AuthInfo{Token: token})
	if err := os.WriteFile(path, b, 0o600); err != nil {
		tb.Fatalf("unable to write bootstrap kubeconfig: %v", err)
	}
	return path
}

// BootstrapClient returns a client that authenticates with a new bootstrap
// token, as a joining node does.
func (cp *ControlPlane) BootstrapClient(tb testing.TB) kubernetes.Interface {
	tb.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", cp.BootstrapKubeconfig(tb, cp.CreateBootstrapToken(tb)))
	if err != nil {
		tb.Fatalf("unable to load bootstrap kubeconfig: %v", err)
	}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		tb.Fatalf("unable to create bootstrap client: %v", err)
	}
	return c
}

// WhoAmI returns the user kube-apiserver authenticates client as (a SelfSubjectReview).
func WhoAmI(ctx context.Context, client kubernetes.Interface) (authenticationv1.UserInfo, error) {
	review, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return authenticationv1.UserInfo{}, fmt.Errorf("unable to create SelfSubjectReview: %w", err)
	}
	return review.Status.UserInfo, nil
}

func randomString(tb testing.TB, n int) string {
	tb.Helper()
	b := make([]byte, n)
	alphabet := big.NewInt(int64(len(bootstrapTokenChars)))
	for i := range b {
		j, err := rand.Int(rand.Reader, alphabet)
		if err != nil {
			tb.Fatalf("unable to generate random string: %v", err)
		}
		b[i] = bootstrapTokenChars[j.Int64()]
	}
	return string(b)
}
