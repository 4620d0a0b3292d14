package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"math"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	certificatesv1beta1 "k8s.io/api/certificates/v1beta1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/status"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// shortLivedSigner approves and signs every pending CSR of signerName with
// the control plane's CA (or ca, when set), issuing certificates valid for
// lifetime (far below the API's 10-minute minimum for
// spec.expirationSeconds, which a signer is free to undercut). It stands in
// for the controller so that renewals come every few seconds. With serving
// set it issues serving certificates: server auth, the request's SANs.
type shortLivedSigner struct {
	cp       *harness.ControlPlane
	signer   string
	lifetime time.Duration
	ca       *harness.CA
	serving  bool
	signed   atomic.Int64
	mu       sync.Mutex
	latency  []time.Duration // CSR creation to issuance
}

func (s *shortLivedSigner) run(ctx context.Context, t *testing.T) {
	csrs := s.cp.Client.CertificatesV1().CertificateSigningRequests()
	for ctx.Err() == nil {
		list, err := csrs.List(ctx, metav1.ListOptions{})
		if err != nil {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		for i := range list.Items {
			c := &list.Items[i]
			if c.Spec.SignerName != s.signer || len(c.Status.Certificate) > 0 {
				continue
			}
			if err := s.sign(ctx, c); err != nil && ctx.Err() == nil {
				t.Logf("in-test signer: %s: %v", c.Name, err)
			}
		}
		w, err := csrs.Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
		if err != nil {
			continue
		}
		for ev := range w.ResultChan() {
			c, ok := ev.Object.(*certificatesv1.CertificateSigningRequest)
			if !ok || c.Spec.SignerName != s.signer || len(c.Status.Certificate) > 0 {
				continue
			}
			if err := s.sign(ctx, c); err != nil && ctx.Err() == nil && !apierrors.IsConflict(err) {
				t.Logf("in-test signer: %s: %v", c.Name, err)
			}
		}
	}
}

func (s *shortLivedSigner) sign(ctx context.Context, c *certificatesv1.CertificateSigningRequest) error {
	csrs := s.cp.Client.CertificatesV1().CertificateSigningRequests()
	req, err := attestor.ParseRequest(c.Spec.Request)
	if err != nil {
		return err
	}
	approved := false
	for _, cond := range c.Status.Conditions {
		approved = approved || cond.Type == certificatesv1.CertificateApproved
	}
	if !approved {
		c.Status.Conditions = append(c.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
			Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue, Reason: "InTestSigner", Message: "short-lived test certificate",
		})
		if c, err = csrs.UpdateApproval(ctx, c.Name, c, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	notBefore := time.Now().Truncate(time.Second)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(0).SetBytes(randomBytes(16)),
		Subject:      pkix.Name{CommonName: req.CSR.Subject.CommonName, Organization: req.CSR.Subject.Organization},
		NotBefore:    notBefore,
		NotAfter:     notBefore.Add(s.lifetime),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if s.serving {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.DNSNames, tmpl.IPAddresses = req.CSR.DNSNames, req.CSR.IPAddresses
	}
	ca := s.ca
	if ca == nil {
		ca = s.cp.CA
	}
	for _, ext := range req.CSR.Extensions {
		if ext.Id.Equal(attestor.OIDProviderID) {
			tmpl.ExtraExtensions = append(tmpl.ExtraExtensions, ext)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, req.CSR.PublicKey, ca.Key)
	if err != nil {
		return err
	}
	c.Status.Certificate = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if _, err := csrs.UpdateStatus(ctx, c, metav1.UpdateOptions{}); err != nil {
		return err
	}
	s.signed.Add(1)
	s.mu.Lock()
	s.latency = append(s.latency, time.Since(c.CreationTimestamp.Time))
	s.mu.Unlock()
	return nil
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	b[0] &= 0x7f
	return b
}

// notifySocket is a NOTIFY_SOCKET the test listens on, as systemd does.
type notifySocket struct {
	path string
	mu   sync.Mutex
	msgs []string
}

func listenNotify(t *testing.T) *notifySocket {
	t.Helper()
	// Unix socket paths are short; t.TempDir may be too long.
	dir, err := os.MkdirTemp("", "sdn")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	n := &notifySocket{path: filepath.Join(dir, "notify")}
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: n.path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	go func() {
		buf := make([]byte, 4096)
		for {
			k, err := conn.Read(buf)
			if err != nil {
				return
			}
			n.mu.Lock()
			n.msgs = append(n.msgs, string(buf[:k]))
			n.mu.Unlock()
		}
	}()
	return n
}

// count returns how many messages contain line as one of their lines.
func (n *notifySocket) count(line string) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	c := 0
	for _, m := range n.msgs {
		for _, l := range strings.Split(m, "\n") {
			if l == line || strings.HasSuffix(line, "=") && strings.HasPrefix(l, line) {
				c++
			}
		}
	}
	return c
}

func (n *notifySocket) last(prefix string) string {
	n.mu.Lock()
	defer n.mu.Unlock()
	for i := len(n.msgs) - 1; i >= 0; i-- {
		for _, l := range strings.Split(n.msgs[i], "\n") {
			if strings.HasPrefix(l, prefix) {
				return l
			}
		}
	}
	return ""
}

func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func scrape(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s: %s", url, resp.Status, b)
	}
	return string(b)
}

func metricValue(body, name string) float64 {
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 2 && f[0] == name {
			v, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				return math.NaN()
			}
			return v
		}
	}
	return -1
}

// TestAgentRenewsWhileClientsWork runs the real agent binary (a systemd
// Type=notify service: READY, STATUS, WATCHDOG, RELOADING, STOPPING on a
// NOTIFY_SOCKET the test listens on) against a real kube-apiserver whose
// in-test signer issues 4-second certificates, while a client-go client
// authenticating through the exec-plugin kubeconfig (the node binary, as
// kubelet runs it) keeps making requests: many renewals in a row, no failed
// request. The agent also projects a ClusterTrustBundle as the node, picks
// up a second projection on SIGHUP, serves metrics and /healthz, records
// state for `status`, and stops on SIGTERM leaving no half-written file.
func TestAgentRenewsWhileClientsWork(t *testing.T) {
	if testing.Short() {
		t.Skip("needs kube-apiserver and the built binaries")
	}
	bin := scenario.Binaries(t)
	cp := harness.StartControlPlane(t, "agent")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	signer := &shortLivedSigner{cp: cp, signer: attestor.ClientSignerName("insecure"), lifetime: 4 * time.Second}
	signerDone := make(chan struct{})
	go func() { defer close(signerDone); signer.run(ctx, t) }()
	defer func() { cancel(); <-signerDone }()

	ca1, _ := harness.NewCA("bundle-1")
	ca2, _ := harness.NewCA("bundle-2")
	ctbs := cp.Client.CertificatesV1beta1().ClusterTrustBundles()
	for name, pemData := range map[string][]byte{"root": ca1.CertPEM, "extra": ca2.CertPEM} {
		if _, err := ctbs.Create(ctx, &certificatesv1beta1.ClusterTrustBundle{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec:       certificatesv1beta1.ClusterTrustBundleSpec{TrustBundle: string(pemData)},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	dir := t.TempDir()
	cacheDir := filepath.Join(dir, "cache")
	bundleDir := filepath.Join(dir, "trust-bundles")
	metricsAddr := freeAddr(t)
	// A local user holds the metrics address before the agent starts: the
	// agent must still get its certificate and project bundles, and say
	// why it does not serve metrics.
	squatter, err := net.Listen("tcp", metricsAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer squatter.Close()
	configPath := filepath.Join(dir, "config.yaml")
	writeConfig := func(projections ...string) {
		t.Helper()
		cfg := fmt.Sprintf(`apiVersion: %s
kind: %s
nodeName: node-1
providerID: "insecure:///node-1"
attestor: insecure
bootstrapKubeconfig: %s
cacheDir: %s
requestTimeout: 30s
agent:
  metricsBindAddress: %s
  renewalRetryInitial: 200ms
  renewalRetryMax: 2s
trustBundles:
`, config.APIVersion, config.Kind, cp.BootstrapKubeconfig(t, cp.CreateBootstrapToken(t)), cacheDir, metricsAddr)
		for _, name := range projections {
			cfg += fmt.Sprintf("- name: %s\n  path: %s\n", name, filepath.Join(bundleDir, name, "ca.crt"))
		}
		if err := os.WriteFile(configPath, []byte(cfg), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeConfig("root")

	sd := listenNotify(t)
	logPath := filepath.Join(dir, "agent.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	agent := exec.Command(filepath.Join(bin, "kubelet-authenticator"), "agent", "--config="+configPath, "-v=2")
	agent.Env = append(os.Environ(), "NOTIFY_SOCKET="+sd.path, "WATCHDOG_USEC=400000")
	agent.Stdout, agent.Stderr = logFile, logFile
	agent.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- agent.Wait() }()
	defer func() {
		if agent.ProcessState == nil {
			_ = agent.Process.Kill()
			<-exited
		}
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("agent log:\n%s", b)
		}
	}()

	eventually(t, 30*time.Second, "READY=1", func() bool { return sd.count("READY=1") >= 1 })
	t.Logf("agent ready (first certificate via the bootstrap token) in %s; %s", time.Since(start).Round(time.Millisecond), sd.last("STATUS="))
	rootPath := filepath.Join(bundleDir, "root", "ca.crt")
	eventually(t, 10*time.Second, "the root bundle on disk", func() bool {
		b, err := os.ReadFile(rootPath)
		return err == nil && bytes.Equal(b, ca1.CertPEM)
	})
	eventually(t, 10*time.Second, "status reporting the squatted metrics address", func() bool {
		st, err := status.LoadState(cacheDir)
		return err == nil && strings.Contains(st.MetricsError, "address already in use")
	})
	if line := sd.last("STATUS="); !strings.Contains(line, "metrics listener failing") {
		t.Errorf("systemd STATUS does not mention the metrics listener: %q", line)
	}
	if err := squatter.Close(); err != nil {
		t.Fatal(err)
	}

	// A client as kubelet has one: the exec plugin.
	kc := cp.KubeconfigFor("", clientcmdapi.AuthInfo{Exec: &clientcmdapi.ExecConfig{
		APIVersion: "client.authentication.k8s.io/v1", Command: filepath.Join(bin, "kubelet-authenticator"),
		Args: []string{"credential", "--config=" + configPath}, InteractiveMode: clientcmdapi.NeverExecInteractiveMode, ProvideClusterInfo: true,
	}})
	restCfg, err := clientcmd.RESTConfigFromKubeConfig(kc)
	if err != nil {
		t.Fatal(err)
	}
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		t.Fatal(err)
	}
	var requests, failures, resets atomic.Int64
	var firstFailure atomic.Value
	clientDone := make(chan struct{})
	clientCtx, stopClient := context.WithCancel(ctx)
	go func() {
		defer close(clientDone)
		for clientCtx.Err() == nil {
			user, err := harness.WhoAmI(clientCtx, client)
			if err != nil && (utilnet.IsProbableEOF(err) || utilnet.IsConnectionReset(err)) {
				// client-go closes every connection when the exec plugin hands it
				// a new certificate, so that the new one is presented at once
				// (kubelet's own certificate manager does the same); a request in
				// flight on such a connection fails at the transport and is sent
				// again, as kubelet's loops do. An authentication failure is never
				// retried here.
				resets.Add(1)
				user, err = harness.WhoAmI(clientCtx, client)
			}
			if clientCtx.Err() != nil {
				return
			}
			requests.Add(1)
			if err == nil && user.Username != "system:node:node-1" {
				err = fmt.Errorf("authenticated as %q", user.Username)
			}
			if err != nil {
				failures.Add(1)
				firstFailure.CompareAndSwap(nil, err.Error())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()

	// Renewals in a row; a bundle update lands meanwhile.
	const renewals = 6
	signedAtStart := signer.signed.Load()
	eventually(t, 60*time.Second, fmt.Sprintf("%d renewals", renewals), func() bool { return signer.signed.Load()-signedAtStart >= renewals })
	root, _ := ctbs.Get(ctx, "root", metav1.GetOptions{})
	root.Spec.TrustBundle = string(ca1.CertPEM) + string(ca2.CertPEM)
	if _, err := ctbs.Update(ctx, root, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the updated root bundle", func() bool {
		b, _ := os.ReadFile(rootPath)
		return bytes.Count(b, []byte("BEGIN CERTIFICATE")) == 2
	})
	stopClient()
	<-clientDone
	if failures.Load() != 0 {
		t.Fatalf("%d of %d requests failed during renewals (first: %v)", failures.Load(), requests.Load(), firstFailure.Load())
	}
	if resets.Load() > signer.signed.Load() {
		t.Fatalf("%d connection resets for %d certificates: more than one per credential change", resets.Load(), signer.signed.Load())
	}
	t.Logf("%d certificates issued while %d requests through the exec plugin all succeeded (%d resent after client-go closed connections on a credential change)", signer.signed.Load(), requests.Load(), resets.Load())

	// Metrics, health, status: the agent took the address over once the
	// squatter left.
	eventually(t, 20*time.Second, "metrics served after the squatter left", func() bool {
		resp, err := http.Get("http://" + metricsAddr + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	body := scrape(t, "http://"+metricsAddr+"/metrics")
	ok := metricValue(body, `kubelet_authenticator_client_certificate_renewals_total{result="success"}`)
	if ok < renewals {
		t.Errorf("renewals_total{success} = %v, want >= %d", ok, renewals)
	}
	sum := metricValue(body, "kubelet_authenticator_client_certificate_renewal_duration_seconds_sum")
	cnt := metricValue(body, "kubelet_authenticator_client_certificate_renewal_duration_seconds_count")
	asum := metricValue(body, `kubelet_authenticator_attestation_duration_seconds_sum{result="success"}`)
	acnt := metricValue(body, `kubelet_authenticator_attestation_duration_seconds_count{result="success"}`)
	if ttl := metricValue(body, "kubelet_authenticator_client_certificate_ttl_seconds"); ttl <= 0 || ttl > 4 {
		t.Errorf("client_certificate_ttl_seconds = %v", ttl)
	}
	if v := metricValue(body, fmt.Sprintf(`kubelet_authenticator_trust_bundle_stale{path=%q}`, rootPath)); v != 0 {
		t.Errorf("trust_bundle_stale = %v, want 0", v)
	}
	if s := scrape(t, "http://"+metricsAddr+"/healthz"); strings.TrimSpace(s) != "ok" {
		t.Errorf("/healthz: %q", s)
	}
	var signLat time.Duration
	signer.mu.Lock()
	for _, l := range signer.latency {
		signLat += l
	}
	signLat /= time.Duration(len(signer.latency))
	signer.mu.Unlock()
	rss := ""
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", agent.Process.Pid)); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "VmRSS:") || strings.HasPrefix(l, "VmHWM:") {
				rss += strings.Join(strings.Fields(l), " ") + " "
			}
		}
	}
	t.Logf("renewal latency (attest+CSR+sign+store): mean %s over %v renewals; attestation mean %s; CSR created-to-issued mean %s; agent %s",
		time.Duration(sum/cnt*float64(time.Second)).Round(time.Millisecond), cnt,
		time.Duration(asum/acnt*float64(time.Second)).Round(time.Microsecond), signLat.Round(time.Millisecond), rss)

	out, err := exec.Command(filepath.Join(bin, "kubelet-authenticator"), "status", "--config="+configPath, "-o", "json").Output()
	if err != nil {
		t.Fatalf("status: %v", err)
	}
	var rep status.Report
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("status -o json: %v\n%s", err, out)
	}
	if rep.Certificate == nil || rep.Certificate.ProviderID != "insecure:///node-1" || !strings.Contains(rep.Certificate.Subject, "system:node:node-1") ||
		rep.Agent == nil || !rep.Agent.Renewal.Last.Success || !rep.Agent.Attestation.Success ||
		len(rep.TrustBundles) != 1 || rep.TrustBundles[0].Stale || rep.TrustBundles[0].Certificates != 2 {
		t.Errorf("status -o json:\n%s", out)
	}
	text, err := exec.Command(filepath.Join(bin, "kubelet-authenticator"), "status", "--config="+configPath).Output()
	if err != nil || !strings.Contains(string(text), "insecure:///node-1") {
		t.Errorf("status: %v\n%s", err, text)
	}
	t.Logf("status:\n%s", text)

	// SIGHUP: a second projection.
	writeConfig("root", "extra")
	if err := agent.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "RELOADING=1 then READY=1", func() bool { return sd.count("RELOADING=1") == 1 && sd.count("READY=1") >= 2 })
	eventually(t, 10*time.Second, "the extra bundle after SIGHUP", func() bool {
		b, err := os.ReadFile(filepath.Join(bundleDir, "extra", "ca.crt"))
		return err == nil && bytes.Equal(b, ca2.CertPEM)
	})
	// An invalid config on SIGHUP is refused; the agent keeps running.
	good, _ := os.ReadFile(configPath)
	if err := os.WriteFile(configPath, append(good, []byte("bogus: true\n")...), 0o600); err != nil {
		t.Fatal(err)
	}
	_ = agent.Process.Signal(syscall.SIGHUP)
	time.Sleep(300 * time.Millisecond)
	if sd.count("RELOADING=1") != 1 {
		t.Error("an invalid configuration was reloaded")
	}
	if sd.count("WATCHDOG=1") == 0 {
		t.Error("no WATCHDOG=1 with WATCHDOG_USEC set")
	}
	if sd.count("STATUS=") == 0 {
		t.Error("no STATUS=")
	}

	// SIGTERM: clean stop, exit 0, nothing half-written.
	if err := agent.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("agent exited with %v after SIGTERM", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("agent did not stop within 15s of SIGTERM")
	}
	if sd.count("STOPPING=1") != 1 {
		t.Error("no STOPPING=1")
	}
	_ = filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err == nil && (strings.Contains(fi.Name(), ".tmp-") || fi.Name() == "..data_tmp" || strings.HasSuffix(fi.Name(), ".link-tmp")) {
			t.Errorf("left behind: %s", p)
		}
		return nil
	})
	if _, err := os.ReadFile(filepath.Join(cacheDir, status.StateFile)); err != nil {
		t.Error(err)
	}
}
