package app

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/client-go/util/connrotation"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/kube"
	"sigs.k8s.io/kubelet-authenticator/agent/status"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// freshNode writes a node config for the insecure attestor whose cache
// holds a client certificate valid for an hour, so that an agent started
// on it has nothing to renew and needs no API server. extra is appended to
// the config.
func freshNode(t *testing.T, extra string) (cfgPath, cacheDir string) {
	t.Helper()
	dir := t.TempDir()
	cacheDir = filepath.Join(dir, "cache")
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	now := time.Now()
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "system:node:n1", Organization: []string{attestor.NodesGroup}},
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalPKCS8PrivateKey(key)
	if err := (cache.Dir{Path: cacheDir}).Store(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder})); err != nil {
		t.Fatal(err)
	}
	cfgPath = filepath.Join(dir, "config.yaml")
	cfg := "apiVersion: " + config.APIVersion + "\nkind: " + config.Kind + "\nnodeName: n1\nproviderID: test:///n1\nattestor: insecure\ncacheDir: " + cacheDir + "\n" + extra
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return cfgPath, cacheDir
}

// startAgent runs the agent command in this process until the test ends;
// the returned channel receives what it returned.
func startAgent(t *testing.T, args ...string) <-chan error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := NewCommand(io.Discard, io.Discard)
	cmd.SetArgs(append([]string{"agent"}, args...))
	done := make(chan error, 1)
	go func() { done <- cmd.ExecuteContext(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("the agent did not stop")
		}
	})
	return done
}

// eventually polls cond every 50ms for up to d.
func eventually(t *testing.T, d time.Duration, what string, cond func() error) {
	t.Helper()
	var err error
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if err = cond(); err == nil {
			return
		}
	}
	t.Fatalf("%s: %v", what, err)
}

func get(c *http.Client, url string) (string, error) {
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return string(b), fmt.Errorf("%s: %s: %s", url, resp.Status, b)
	}
	return string(b), err
}

func unixClient(path string) *http.Client {
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", path)
		},
	}}
}

// TestAgentOutlivesMetricsSquatter: a local user who binds the configured
// TCP metrics address first neither stops the agent nor keeps it from
// serving once the address is free; meanwhile the renewal loop runs and
// status says why there are no metrics.
func TestAgentOutlivesMetricsSquatter(t *testing.T) {
	squatter, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := squatter.Addr().String()
	cfgPath, cacheDir := freshNode(t, "agent:\n  metricsBindAddress: "+addr+"\n")
	done := startAgent(t, "--config="+cfgPath)

	eventually(t, 10*time.Second, "status reports the listener problem", func() error {
		select {
		case err := <-done:
			return fmt.Errorf("the agent exited: %w", err)
		default:
		}
		st, err := status.LoadState(cacheDir)
		if err != nil {
			return err
		}
		if st.Renewal.NextAttempt.IsZero() {
			return fmt.Errorf("no renewal scheduled yet")
		}
		if !strings.Contains(st.MetricsError, "address already in use") || st.MetricsAddress != "" {
			return fmt.Errorf("metrics %q, error %q", st.MetricsAddress, st.MetricsError)
		}
		return nil
	})
	var text strings.Builder
	cfg := &config.NodeConfig{NodeName: "n1", CacheDir: cacheDir}
	if err := status.Collect(cfg, time.Now()).WriteText(&text, time.Now()); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(text.String(), "NOT SERVING") {
		t.Errorf("status does not show the listener problem:\n%s", text.String())
	}

	// The squatter leaves: the agent takes the address over.
	if err := squatter.Close(); err != nil {
		t.Fatal(err)
	}
	c := &http.Client{Timeout: 5 * time.Second}
	eventually(t, 15*time.Second, "/healthz once the address is free", func() error {
		body, err := get(c, "http://"+addr+"/healthz")
		if err == nil && strings.TrimSpace(body) != "ok" {
			return fmt.Errorf("/healthz: %q", body)
		}
		return err
	})
	eventually(t, 5*time.Second, "status clears the listener problem", func() error {
		st, err := status.LoadState(cacheDir)
		if err != nil {
			return err
		}
		if st.MetricsError != "" || st.MetricsAddress != addr {
			return fmt.Errorf("metrics %q, error %q", st.MetricsAddress, st.MetricsError)
		}
		return nil
	})
}

// TestAgentUnixSocket: the default is a unix socket; with a unix: bind address the agent
// serves on a socket only its owner can connect to, replacing the socket a
// former run left.
func TestAgentUnixSocket(t *testing.T) {
	if !strings.HasPrefix(config.DefaultMetricsBindAddress, "unix:/run/kubelet-authenticator/") {
		t.Errorf("default metrics address %s is not a unix socket in the agent's runtime directory", config.DefaultMetricsBindAddress)
	}
	sock := filepath.Join(t.TempDir(), "metrics.sock")
	old, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	old.(*net.UnixListener).SetUnlinkOnClose(false)
	_ = old.Close() // a stale socket file stays behind
	cfgPath, _ := freshNode(t, "agent:\n  metricsBindAddress: unix:"+sock+"\n")
	startAgent(t, "--config="+cfgPath)
	eventually(t, 10*time.Second, "/healthz on the unix socket", func() error {
		_, err := get(unixClient(sock), "http://agent/healthz")
		return err
	})
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Errorf("metrics socket mode %v, want a socket 0600", fi.Mode())
	}
}

// TestAgentSocketActivation: sockets systemd passes (LISTEN_FDS,
// LISTEN_PID) are served in place of agent.metricsBindAddress. The agent
// runs as a child of this test so that LISTEN_PID names it.
func TestAgentSocketActivation(t *testing.T) {
	if os.Getenv("KA_TEST_AGENT_CHILD") == "1" {
		os.Exit(Main(context.Background(), strings.Fields(os.Getenv("KA_TEST_AGENT_ARGS"))))
	}
	dir := t.TempDir()
	activated := filepath.Join(dir, "activated.sock")
	configured := filepath.Join(dir, "configured.sock")
	l, err := net.Listen("unix", activated)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	f, err := l.(*net.UnixListener).File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cfgPath, _ := freshNode(t, "agent:\n  metricsBindAddress: unix:"+configured+"\n")

	// sh sets LISTEN_PID to its own pid, which exec hands to the agent.
	cmd := exec.Command("/bin/sh", "-c", `LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" -test.run='^TestAgentSocketActivation$'`, os.Args[0])
	cmd.Env = append(os.Environ(), "KA_TEST_AGENT_CHILD=1", "KA_TEST_AGENT_ARGS=agent --config="+cfgPath)
	cmd.ExtraFiles = []*os.File{f} // fd 3, SD_LISTEN_FDS_START
	cmd.Stderr = &testWriter{t}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	})
	eventually(t, 20*time.Second, "/metrics on the activated socket", func() error {
		body, err := get(unixClient(activated), "http://agent/metrics")
		if err == nil && !strings.Contains(body, "kubelet_authenticator_client_certificate_expiration_timestamp_seconds") {
			return fmt.Errorf("/metrics: %q", body)
		}
		return err
	})
	if _, err := os.Stat(configured); err == nil {
		t.Error("the agent listened on agent.metricsBindAddress although systemd passed a socket")
	}
}

type testWriter struct{ t *testing.T }

func (w *testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestAgentRefusesInsecureBootstrapKubeconfig: while the bootstrap
// kubeconfig exists it names the node's cluster; with
// insecure-skip-tls-verify it would let anyone between the node and its API
// server answer the trust bundle fetches, whose CAs land in host trust
// paths. The agent refuses it with an error naming the setting, and the
// server named there never receives a request.
func TestAgentRefusesInsecureBootstrapKubeconfig(t *testing.T) {
	var requests atomic.Int64
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		http.Error(w, "not here", http.StatusForbidden)
	}))
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	bootstrap := filepath.Join(dir, "bootstrap-kubelet.conf")
	kubeconfig := "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: " + srv.URL + "\n    insecure-skip-tls-verify: true\n" +
		"contexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\nusers:\n- name: u\n  user: {token: abcdef.0123456789abcdef}\n"
	if err := os.WriteFile(bootstrap, []byte(kubeconfig), 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "metrics.sock")
	bundle := filepath.Join(dir, "bundles", "ca.crt")
	cfgPath, _ := freshNode(t, "bootstrapKubeconfig: "+bootstrap+"\nagent:\n  metricsBindAddress: unix:"+sock+
		"\ntrustBundles:\n- name: root\n  path: "+bundle+"\n")

	cfg, err := config.Load(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	_, err = nodeRESTConfig(cfg, connrotation.NewDialer((&net.Dialer{}).DialContext))
	if !errors.Is(err, kube.ErrInsecureSkipTLSVerify) || !strings.Contains(err.Error(), "remove insecure-skip-tls-verify") || !strings.Contains(err.Error(), bootstrap) {
		t.Fatalf("trust bundle client configuration from a bootstrap kubeconfig with insecure-skip-tls-verify: %v", err)
	}

	startAgent(t, "--config="+cfgPath)
	eventually(t, 10*time.Second, "the projection reported stale", func() error {
		body, err := get(unixClient(sock), "http://agent/metrics")
		if err != nil {
			return err
		}
		if !strings.Contains(body, `trust_bundle_stale{path="`+bundle+`"} 1`) {
			return errors.New("not stale yet")
		}
		return nil
	})
	time.Sleep(2 * time.Second) // the agent retries from 1s on
	if n := requests.Load(); n != 0 {
		t.Fatalf("the server of a bootstrap kubeconfig with insecure-skip-tls-verify received %d requests", n)
	}
	if _, err := os.Stat(bundle); err == nil {
		t.Fatal("a trust bundle was written")
	}
}
