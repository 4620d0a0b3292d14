//go:build tpmsimulator

package e2e

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/agent/serving"
	"sigs.k8s.io/kubelet-authenticator/agent/status"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// servedCertificate connects to the kubelet's HTTPS port as kube-apiserver
// does (verifying with roots) and returns the certificate it serves.
func servedCertificate(addr string, roots *x509.CertPool) (*x509.Certificate, error) {
	host, _, _ := net.SplitHostPort(addr)
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, &tls.Config{RootCAs: roots, ServerName: host})
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0], nil
}

// TestServingCertificate: a TPM node's agent requests kubelet's serving
// certificate from the attested serving signer as the node, installs it
// where kubelet's tlsCertFile/tlsPrivateKeyFile name it, and projects the
// controller's serving CA; kube-apiserver, given that projected CA as
// --kubelet-certificate-authority, refuses the hollow kubelet while it
// serves a certificate of another CA and reaches it through the agent's;
// when the addresses to request change, the agent replaces the certificate
// and kubelet serves the new one without a restart; a denied renewal
// leaves the installed one served; short-lived certificates are renewed on
// the client certificate's schedule and each is served by the same kubelet.
func TestServingCertificate(t *testing.T) {
	hollow := hollowKubeletTLS(t)
	caDir, _ := manufacturerCA(t, "Trusted TPM Maker")
	env := scenario.Start(t, scenario.Options{Attestors: "tpm", ControllerArgs: tpmSignerArgs(filepath.Join(caDir, tpmtest.BundleFile), time.Minute)})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	// The address kubelet reports as the node's InternalIP (no --node-ip,
	// no cloud provider), which the agent discovers the same way.
	hostIP, err := utilnet.ChooseHostInterface()
	if err != nil {
		t.Skipf("no host address to serve on: %v", err)
	}
	const name = "serving-1"
	internalDNS := name + ".internal"
	caPath := filepath.Join(env.Dir, "control-plane", "kubelet-serving-ca", "ca.crt")
	metricsAddr := freeAddr(t)
	n := env.NewNode(t, name, "test:///fleet/"+name, "tpm", simulatorConfig(11, caDir), fmt.Sprintf(`serving:
  enabled: true
trustBundles:
- signerName: %s
  path: %s
agent:
  metricsBindAddress: %q
`, attestor.ServingSignerName(tpm.Name), caPath, metricsAddr))
	// The infrastructure provider records the Machine's addresses.
	m := env.Mgmt.CreateMachine(t, env.Namespace, env.Cluster, "machine-"+name, n.ProviderID, true, name)
	m.Status.Addresses = append(m.Status.Addresses,
		clusterv1.MachineAddress{Type: clusterv1.MachineInternalIP, Address: hostIP.String()},
		clusterv1.MachineAddress{Type: clusterv1.MachineInternalDNS, Address: internalDNS})
	if err := env.Mgmt.Client.Status().Update(ctx, m); err != nil {
		t.Fatal(err)
	}

	agent := harness.StartProcess(t, "agent", filepath.Join(n.Dir, "agent.log"), filepath.Join(env.BinDir, "kubelet-authenticator"),
		"agent", "--config="+n.ConfigPath, "-v=2")
	servingPath := filepath.Join(n.CacheDir, "kubelet-server-current.pem")
	start := time.Now()
	var first *x509.Certificate
	harness.WaitFor(t, 3*time.Minute, func() (bool, error) {
		cred, err := serving.Load(servingPath, name)
		if err != nil {
			return false, nil
		}
		first = cred.Leaf
		return true, nil
	})
	t.Logf("serving certificate installed %s after the agent started (client certificate first, both through the TPM's two rounds)", time.Since(start).Round(time.Millisecond))
	harness.WaitFor(t, time.Minute, func() (bool, error) {
		_, err := os.Stat(caPath)
		return err == nil, nil
	})
	caPEM, err := os.ReadFile(caPath)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatalf("projected serving CA %s holds no certificate", caPath)
	}

	t.Run("the agent's serving certificate", func(t *testing.T) {
		st, err := os.Stat(servingPath)
		if err != nil || st.Mode().Perm() != 0o600 {
			t.Fatalf("%s mode %v, %v", servingPath, st.Mode().Perm(), err)
		}
		if _, err := first.Verify(x509.VerifyOptions{Roots: roots, DNSName: hostIP.String(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Fatalf("does not verify with the projected serving CA for %s: %v", hostIP, err)
		}
		if !slices.Equal(first.DNSNames, []string{name}) || len(first.IPAddresses) != 1 || !first.IPAddresses[0].Equal(hostIP) {
			t.Errorf("SANs DNS %v IP %v, want the node name and %s", first.DNSNames, first.IPAddresses, hostIP)
		}
		if pid, err := attestor.ProviderIDFromExtensions(first.Extensions); err != nil || pid != n.ProviderID {
			t.Errorf("provider ID %q, %v", pid, err)
		}
		// Filed as the node itself, to the attested serving signer, with
		// the TPM's challenge answered in a second request.
		var filed []certificatesv1.CertificateSigningRequest
		for _, c := range nodeCSRs(t, env, name) {
			if c.Spec.SignerName == attestor.ServingSignerName(tpm.Name) {
				filed = append(filed, c)
			}
		}
		if len(filed) != 2 {
			t.Fatalf("%d serving CSRs, want the challenged one and its answer", len(filed))
		}
		// One answer, one certificate: the challenged request is closed.
		issued, answered := 0, 0
		for _, c := range filed {
			if len(c.Status.Certificate) > 0 {
				issued++
			}
			if denied(&c) == attestor.ReasonChallengeAnswered {
				answered++
			}
		}
		if issued != 1 || answered != 1 {
			t.Errorf("serving CSRs: %d issued, %d closed %s; want one each", issued, answered, attestor.ReasonChallengeAnswered)
		}
		for _, c := range filed {
			if c.Spec.Username != attestor.NodeUserPrefix+name {
				t.Errorf("serving CSR %s filed by %q, want the node", c.Name, c.Spec.Username)
			}
			if !slices.Equal(c.Spec.Usages, []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageServerAuth}) {
				t.Errorf("serving CSR %s usages %v", c.Name, c.Spec.Usages)
			}
		}
	})

	// The control plane's operator hands kube-apiserver the projected
	// serving CA, and has it reach kubelets at their InternalIP.
	env.Workload.RestartAPIServer(t, "--kubelet-certificate-authority="+caPath, "--kubelet-preferred-address-types=InternalIP")
	port := harness.FreePort(t)
	kubelet := harness.StartProcess(t, "hollow-kubelet-tls", filepath.Join(n.Dir, "kubelet.log"), hollow,
		"--kubeconfig="+n.Kubeconfig, "--name="+name, "--kubelet-port="+strconv.Itoa(port),
		"--tls-cert-file="+servingPath, "--tls-private-key-file="+servingPath, "--v=2")
	kubeletAddr := net.JoinHostPort(hostIP.String(), strconv.Itoa(port))
	harness.WaitFor(t, 3*time.Minute, func() (bool, error) {
		node, err := env.Workload.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
				return true, nil
			}
		}
		return false, nil
	})
	proxyHealthz := func() (string, error) {
		b, err := env.Workload.Client.CoreV1().RESTClient().Get().AbsPath("/api/v1/nodes", name, "proxy", "healthz").DoRaw(ctx)
		return string(b), err
	}

	t.Run("a kubelet certificate from another CA is refused", func(t *testing.T) {
		saved, err := os.ReadFile(servingPath)
		if err != nil {
			t.Fatal(err)
		}
		// The cluster CA, which kube-apiserver trusts for clients, is not
		// the serving CA; same node, same addresses.
		certPEM, keyPEM, err := env.Workload.CA.Issue(harness.CertSpec{CommonName: attestor.NodeUserPrefix + name, Organization: []string{attestor.NodesGroup},
			DNSNames: []string{name}, IPs: []net.IP{hostIP}, Server: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(servingPath+".other", append(certPEM, keyPEM...), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(servingPath+".other", servingPath); err != nil {
			t.Fatal(err)
		}
		defer func() {
			// The agent's pair back, served again.
			if err := os.WriteFile(servingPath+".back", saved, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(servingPath+".back", servingPath); err != nil {
				t.Fatal(err)
			}
			harness.WaitFor(t, 2*time.Minute, func() (bool, error) {
				served, err := servedCertificate(kubeletAddr, roots)
				return err == nil && served.Equal(first), nil
			})
		}()
		// kubelet reloads it (no restart)...
		harness.WaitFor(t, 2*time.Minute, func() (bool, error) {
			_, err := servedCertificate(kubeletAddr, roots)
			var unknown x509.UnknownAuthorityError
			return errors.As(err, &unknown), nil
		})
		// ...and kube-apiserver, which has not talked to this kubelet yet
		// (a connection it keeps would stay verified), will not.
		body, err := proxyHealthz()
		if err == nil || !strings.Contains(body, "x509") {
			t.Fatalf("kube-apiserver reached a kubelet serving a certificate of another CA, or failed otherwise: %v: %s", err, body)
		}
		t.Logf("refused: %v: %s", err, strings.TrimSpace(body))
	})

	t.Run("kube-apiserver reaches kubelet with the serving CA", func(t *testing.T) {
		served, err := servedCertificate(kubeletAddr, roots)
		if err != nil {
			t.Fatalf("kubelet's HTTPS port: %v", err)
		}
		if !served.Equal(first) {
			t.Fatalf("kubelet serves serial %s, not the agent's %s", served.SerialNumber, first.SerialNumber)
		}
		var body string
		harness.WaitFor(t, time.Minute, func() (bool, error) {
			body, err = proxyHealthz()
			return err == nil, nil
		})
		if strings.TrimSpace(body) != "ok" {
			t.Fatalf("kubelet /healthz through kube-apiserver: %q", body)
		}
	})

	t.Run("changed addresses: a new certificate, served without restarting kubelet", func(t *testing.T) {
		cfg, err := os.ReadFile(n.ConfigPath)
		if err != nil {
			t.Fatal(err)
		}
		cfg = bytes.Replace(cfg, []byte("serving:\n  enabled: true\n"), fmt.Appendf(nil, "serving:\n  enabled: true\n  dnsNames: [%s, %s]\n  ipAddresses: [%q]\n", name, internalDNS, hostIP), 1)
		if err := os.WriteFile(n.ConfigPath, cfg, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(agent.PID(), syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		var second *x509.Certificate
		harness.WaitFor(t, 3*time.Minute, func() (bool, error) {
			cred, err := serving.Load(servingPath, name)
			if err != nil || !slices.Contains(cred.Leaf.DNSNames, internalDNS) {
				return false, nil
			}
			second = cred.Leaf
			return true, nil
		})
		if _, err := second.Verify(x509.VerifyOptions{Roots: roots, DNSName: internalDNS, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Fatalf("new certificate does not verify with the serving CA for %s: %v", internalDNS, err)
		}
		installed := time.Since(start)
		harness.WaitFor(t, 2*time.Minute, func() (bool, error) {
			served, err := servedCertificate(kubeletAddr, roots)
			return err == nil && served.Equal(second), nil
		})
		t.Logf("new certificate installed %s after SIGHUP; kubelet served it %s after the test saw it on disk", installed.Round(time.Millisecond), (time.Since(start) - installed).Round(time.Millisecond))
		if exited, err := kubelet.Exited(); exited {
			t.Fatalf("kubelet exited: %v", err)
		}
		if body, err := proxyHealthz(); err != nil || strings.TrimSpace(body) != "ok" {
			t.Fatalf("kubelet /healthz through kube-apiserver after rotation: %q, %v", body, err)
		}
	})

	t.Run("a denied renewal keeps the installed certificate served", func(t *testing.T) {
		before, err := serving.Load(servingPath, name)
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := os.ReadFile(n.ConfigPath)
		if err != nil {
			t.Fatal(err)
		}
		// An address that is not the Machine's: the controller denies it.
		bad := bytes.Replace(cfg, []byte("dnsNames: ["+name+", "+internalDNS+"]"), []byte("dnsNames: ["+name+", "+internalDNS+", kubernetes.default.svc]"), 1)
		if bytes.Equal(bad, cfg) {
			t.Fatal("config does not hold the dnsNames line")
		}
		if err := os.WriteFile(n.ConfigPath, bad, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(agent.PID(), syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		var st *status.State
		harness.WaitFor(t, 2*time.Minute, func() (bool, error) {
			st, err = status.LoadState(n.CacheDir)
			return err == nil && st.ServingRenewal.ConsecutiveFailures > 0, nil
		})
		if !strings.Contains(st.ServingRenewal.Last.Error, attestor.ReasonSANNotMachineAddress) {
			t.Errorf("status's last serving renewal error %q does not give the reason %s", st.ServingRenewal.Last.Error, attestor.ReasonSANNotMachineAddress)
		}
		after, err := serving.Load(servingPath, name)
		if err != nil || !after.Leaf.Equal(before.Leaf) {
			t.Fatalf("a denied renewal changed the installed certificate: %v", err)
		}
		if served, err := servedCertificate(kubeletAddr, roots); err != nil || !served.Equal(before.Leaf) {
			t.Fatalf("kubelet no longer serves the installed certificate: %v", err)
		}
		if body, err := proxyHealthz(); err != nil || strings.TrimSpace(body) != "ok" {
			t.Fatalf("kubelet /healthz through kube-apiserver: %q, %v", body, err)
		}
		if err := os.WriteFile(n.ConfigPath, cfg, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(agent.PID(), syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("status and metrics report it", func(t *testing.T) {
		// The renewal denied just before is the last serving renewal:
		// status exits 3 (a usable identity that needs attention).
		out, err := exec.Command(filepath.Join(env.BinDir, "kubelet-authenticator"), "status", "--config="+n.ConfigPath, "-o", "json").Output()
		var exit *exec.ExitError
		if err != nil && (!errors.As(err, &exit) || exit.ExitCode() != 3) {
			t.Fatalf("status: %v, want exit status 3", err)
		}
		var rep status.Report
		if err := json.Unmarshal(out, &rep); err != nil {
			t.Fatal(err)
		}
		if rep.Serving == nil || rep.Serving.Path != servingPath || !slices.Contains(rep.Serving.DNSNames, internalDNS) || !rep.Serving.Usable {
			t.Fatalf("status serving: %+v (error %q)", rep.Serving, rep.ServingError)
		}
		if rep.Agent == nil || rep.Agent.ServingRenewal.LastSuccess.IsZero() {
			t.Fatalf("status agent serving renewal: %+v", rep.Agent)
		}
		body := scrape(t, "http://"+metricsAddr+"/metrics")
		if v := metricValue(body, `kubelet_authenticator_serving_certificate_renewals_total{result="success"}`); v < 2 {
			t.Errorf("serving renewals (success) = %v, want at least 2", v)
		}
		if v := metricValue(body, `kubelet_authenticator_serving_certificate_renewals_total{result="failure"}`); v < 1 {
			t.Errorf("serving renewals (failure) = %v, want at least 1", v)
		}
		if v := metricValue(body, "kubelet_authenticator_serving_certificate_ttl_seconds"); v <= 0 {
			t.Errorf("serving certificate TTL = %v", v)
		}
	})

	t.Run("short-lived certificates: renewed on schedule, each served without restarting kubelet", func(t *testing.T) {
		// An in-test signer with the controller's serving CA stands in for
		// the controller (whose certificates live at least 10 minutes), so
		// that the agent's renewal point, 70% to 90% of the lifetime, comes
		// every few seconds.
		env.StopController()
		var sec corev1.Secret
		if err := env.Mgmt.Client.Get(ctx, client.ObjectKey{Namespace: env.Namespace, Name: env.Cluster + capi.ServingCASecretSuffix}, &sec); err != nil {
			t.Fatal(err)
		}
		pair, err := tls.X509KeyPair(sec.Data[corev1.TLSCertKey], sec.Data[corev1.TLSPrivateKeyKey])
		if err != nil {
			t.Fatal(err)
		}
		key, ok := pair.PrivateKey.(*ecdsa.PrivateKey)
		if !ok {
			t.Fatalf("serving CA key is a %T", pair.PrivateKey)
		}
		const lifetime = 20 * time.Second
		signer := &shortLivedSigner{cp: env.Workload, signer: attestor.ServingSignerName(tpm.Name), lifetime: lifetime,
			ca: &harness.CA{Cert: pair.Leaf, Key: key}, serving: true}
		sctx, stop := context.WithCancel(ctx)
		signerDone := make(chan struct{})
		go func() { defer close(signerDone); signer.run(sctx, t) }()
		defer func() { stop(); <-signerDone }()

		// Back to the discovered addresses: replaced at once, by a
		// short-lived certificate.
		cfg, err := os.ReadFile(n.ConfigPath)
		if err != nil {
			t.Fatal(err)
		}
		cfg = bytes.Replace(cfg, fmt.Appendf(nil, "  dnsNames: [%s, %s]\n  ipAddresses: [%q]\n", name, internalDNS, hostIP), nil, 1)
		if err := os.WriteFile(n.ConfigPath, cfg, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(agent.PID(), syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		var serials []string
		start := time.Now()
		harness.WaitFor(t, 3*time.Minute, func() (bool, error) {
			// What is on disk is what the same kubelet serves, and
			// kube-apiserver verifies it.
			cred, err := serving.Load(servingPath, name)
			if err != nil || cred.Leaf.NotAfter.Sub(cred.Leaf.NotBefore) > lifetime {
				return false, nil
			}
			served, err := servedCertificate(kubeletAddr, roots)
			if err != nil || !served.Equal(cred.Leaf) || slices.Contains(serials, served.SerialNumber.String()) {
				return false, nil
			}
			if body, err := proxyHealthz(); err != nil || strings.TrimSpace(body) != "ok" {
				t.Fatalf("kubelet /healthz through kube-apiserver with certificate %d: %q, %v", len(serials)+1, body, err)
			}
			serials = append(serials, served.SerialNumber.String())
			t.Logf("certificate %d (valid %s) served %s after SIGHUP", len(serials), served.NotAfter.Sub(served.NotBefore), time.Since(start).Round(time.Millisecond))
			return len(serials) >= 3, nil
		})
		if exited, err := kubelet.Exited(); exited {
			t.Fatalf("kubelet exited: %v", err)
		}
	})
}
