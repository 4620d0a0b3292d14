// Package e2e runs the product end to end on real components: kube-apiserver
// and etcd, the node-attestation-controller and kubelet-authenticator
// binaries, kubectl, and kubemark's hollow kubelet.
package e2e

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientauthv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// execCredential is what the exec plugin prints, read as client-go reads
// it, but strictly: no field client-go does not know.
type execCredential = clientauthv1.ExecCredential

func parseExecCredential(t *testing.T, r scenario.Result) (*execCredential, *x509.Certificate) {
	t.Helper()
	if r.Err != nil {
		t.Fatalf("credential failed: %v\nstderr: %s", r.Err, r.Stderr)
	}
	var ec execCredential
	dec := json.NewDecoder(strings.NewReader(r.Stdout))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&ec); err != nil {
		t.Fatalf("stdout is not only an ExecCredential: %v\n%s", err, r.Stdout)
	}
	if ec.APIVersion != "client.authentication.k8s.io/v1" || ec.Kind != "ExecCredential" {
		t.Fatalf("unexpected ExecCredential header %q %q", ec.APIVersion, ec.Kind)
	}
	if ec.Status == nil || ec.Status.ExpirationTimestamp == nil {
		t.Fatalf("ExecCredential without a status or its expiration:\n%s", r.Stdout)
	}
	blk, _ := pem.Decode([]byte(ec.Status.ClientCertificateData))
	if blk == nil {
		t.Fatal("no certificate in ExecCredential")
	}
	cert, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return &ec, cert
}

func nodeCSRs(t *testing.T, env *scenario.Env, node string) []certificatesv1.CertificateSigningRequest {
	t.Helper()
	list, err := env.Workload.Client.CertificatesV1().CertificateSigningRequests().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []certificatesv1.CertificateSigningRequest
	for _, c := range list.Items {
		r, err := attestor.ParseRequest(c.Spec.Request)
		if err == nil && r.CSR.Subject.CommonName == attestor.NodeUserPrefix+node {
			out = append(out, c)
		}
	}
	return out
}

func TestEndToEnd(t *testing.T) {
	env := scenario.Start(t, scenario.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	t.Run("bootstrap token alone registers the node as itself", func(t *testing.T) {
		n := env.NewNode(t, "node-1", "test:///fleet/node-1", "insecure")
		env.Machine(t, n)

		r := n.Kubectl(ctx, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
		if r.Err != nil {
			t.Fatalf("kubectl auth whoami: %v\n%s\ncontroller log:\n%s", r.Err, r.Stderr, env.ControllerLog())
		}
		if got := strings.TrimSpace(r.Stdout); got != "system:node:node-1" {
			t.Fatalf("API server sees %q, want system:node:node-1", got)
		}

		csrs := nodeCSRs(t, env, "node-1")
		if len(csrs) != 1 {
			t.Fatalf("%d CSRs for node-1, want 1", len(csrs))
		}
		c := csrs[0]
		if c.Spec.SignerName != attestor.ClientSignerName("insecure") {
			t.Fatalf("signer %q", c.Spec.SignerName)
		}
		if !strings.HasPrefix(c.Spec.Username, attestor.BootstrapUserPrefix) {
			t.Fatalf("CSR filed by %q, want the bootstrap token", c.Spec.Username)
		}
		// The issued certificate chains to the cluster CA and carries the
		// provider ID, and nothing the request asked for beyond it.
		cred, err := (cache.Dir{Path: n.CacheDir}).Load()
		if err != nil {
			t.Fatal(err)
		}
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(env.Workload.CACertPEM)
		if _, err := cred.Leaf.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
			t.Fatalf("issued certificate does not verify against the cluster CA: %v", err)
		}
		if pid, err := attestor.ProviderIDFromExtensions(cred.Leaf.Extensions); err != nil || pid != n.ProviderID {
			t.Fatalf("provider ID in certificate = %q, %v", pid, err)
		}
		for _, f := range []string{cache.CurrentFile} {
			st, err := os.Stat(filepath.Join(n.CacheDir, f))
			if err != nil || st.Mode().Perm() != 0o600 {
				t.Fatalf("%s mode %v, %v", f, st.Mode().Perm(), err)
			}
		}
		if _, err := os.Stat(filepath.Join(n.CacheDir, cache.PendingKeyFile)); !os.IsNotExist(err) {
			t.Fatal("pending key left behind after issuance")
		}

		// The cached path returns the same certificate and files nothing.
		ec, cert := parseExecCredential(t, n.Credential(ctx))
		if !cert.Equal(cred.Leaf) {
			t.Fatal("cached call returned a different certificate")
		}
		if !ec.Status.ExpirationTimestamp.Time.Before(cert.NotAfter) || !ec.Status.ExpirationTimestamp.After(time.Now()) {
			t.Fatalf("expirationTimestamp %v not inside the certificate's validity (until %v)", ec.Status.ExpirationTimestamp, cert.NotAfter)
		}
		if got := len(nodeCSRs(t, env, "node-1")); got != 1 {
			t.Fatalf("cached call filed a CSR: %d CSRs", got)
		}
	})

	t.Run("hollow kubelet registers its Node and goes Ready", func(t *testing.T) {
		n := env.NewNode(t, "hollow-1", "test:///fleet/hollow-1", "insecure")
		env.Machine(t, n)
		harness.StartProcess(t, "kubemark", filepath.Join(n.Dir, "kubemark.log"), filepath.Join(env.K8sBin, "kubemark"),
			"--morph=kubelet", "--name="+n.Name, "--kubeconfig="+n.Kubeconfig, "--use-host-image-service=false",
			fmt.Sprintf("--kubelet-port=%d", harness.FreePort(t)), fmt.Sprintf("--kubelet-read-only-port=%d", harness.FreePort(t)),
			"--v=2")
		harness.WaitFor(t, 3*time.Minute, func() (bool, error) {
			node, err := env.Workload.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
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
		if got := len(nodeCSRs(t, env, n.Name)); got != 1 {
			t.Fatalf("hollow kubelet's node filed %d CSRs, want 1", got)
		}
	})

	t.Run("concurrent invocations file one CSR", func(t *testing.T) {
		n := env.NewNode(t, "node-2", "test:///fleet/node-2", "insecure")
		env.Machine(t, n)
		const parallel = 6
		results := make([]scenario.Result, parallel)
		var wg sync.WaitGroup
		for i := range parallel {
			wg.Add(1)
			go func() { defer wg.Done(); results[i] = n.Credential(ctx) }()
		}
		wg.Wait()
		var first *x509.Certificate
		for _, r := range results {
			_, cert := parseExecCredential(t, r)
			if first == nil {
				first = cert
			} else if !cert.Equal(first) {
				t.Fatal("concurrent invocations returned different certificates")
			}
		}
		if got := len(nodeCSRs(t, env, n.Name)); got != 1 {
			t.Fatalf("%d concurrent invocations filed %d CSRs, want 1", parallel, got)
		}
	})

	t.Run("a node with no Machine is denied with the signer's reason", func(t *testing.T) {
		n := env.NewNode(t, "intruder", "test:///fleet/intruder", "insecure")
		r := n.Credential(ctx)
		if r.Err == nil {
			t.Fatalf("credential succeeded for a node with no Machine: %s", r.Stdout)
		}
		if r.Stdout != "" {
			t.Fatalf("failure printed on stdout: %q", r.Stdout)
		}
		last := lastLine(r.Stderr)
		if !strings.Contains(last, "denied") || !strings.Contains(last, "Machine") {
			t.Fatalf("last stderr line does not give the denial and its reason: %q", last)
		}
	})

	t.Run("a timeout keeps the pending CSR and a retry finds it", func(t *testing.T) {
		n := env.NewNode(t, "node-3", "test:///fleet/node-3", "insecure")
		// Bootstrap not ready: the signer retries rather than denies.
		env.Mgmt.CreateMachine(t, env.Namespace, env.Cluster, "machine-node-3", n.ProviderID, false, n.Name)
		r := n.Credential(ctx, "--timeout=3s")
		if r.Err == nil {
			t.Fatal("credential succeeded before the Machine's bootstrap was ready")
		}
		if last := lastLine(r.Stderr); !strings.Contains(last, "timed out") {
			t.Fatalf("last stderr line does not say it timed out: %q", last)
		}
		before := nodeCSRs(t, env, n.Name)
		if len(before) != 1 {
			t.Fatalf("%d CSRs after the timeout, want 1", len(before))
		}
		if _, err := os.Stat(filepath.Join(n.CacheDir, cache.PendingKeyFile)); err != nil {
			t.Fatalf("pending key not kept after a timeout: %v", err)
		}
		markBootstrapReady(t, env, "machine-node-3")
		_, cert := parseExecCredential(t, n.Credential(ctx))
		after := nodeCSRs(t, env, n.Name)
		if len(after) != 1 || after[0].Name != before[0].Name {
			t.Fatalf("retry filed a new CSR instead of finding %s", before[0].Name)
		}
		if cert.Subject.CommonName != "system:node:node-3" {
			t.Fatalf("certificate for %q", cert.Subject.CommonName)
		}
	})

	t.Run("an unreadable config fails with one clear line", func(t *testing.T) {
		n := env.NewNode(t, "node-4", "test:///fleet/node-4", "insecure")
		r := n.Credential(ctx, "--config="+filepath.Join(n.Dir, "missing.yaml"))
		if r.Err == nil || r.Stdout != "" {
			t.Fatalf("err=%v stdout=%q", r.Err, r.Stdout)
		}
		if lines := strings.Split(strings.TrimSpace(r.Stderr), "\n"); len(lines) != 1 || !strings.Contains(lines[0], "unable to read config") {
			t.Fatalf("stderr is not one clear line: %q", r.Stderr)
		}
	})
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// markBootstrapReady flips a Machine's bootstrap readiness, as the bootstrap
// provider would once the data Secret exists.
func markBootstrapReady(t *testing.T, env *scenario.Env, name string) {
	t.Helper()
	ctx := context.Background()
	m := &clusterv1.Machine{}
	if err := env.Mgmt.Client.Get(ctx, client.ObjectKey{Namespace: env.Namespace, Name: name}, m); err != nil {
		t.Fatal(err)
	}
	ready := true
	m.Status.Initialization.BootstrapDataSecretCreated = &ready
	for i := range m.Status.Conditions {
		if m.Status.Conditions[i].Type == clusterv1.MachineBootstrapConfigReadyCondition {
			m.Status.Conditions[i].Status = metav1.ConditionTrue
			m.Status.Conditions[i].Reason = clusterv1.MachineBootstrapDataSecretProvidedReason
		}
	}
	if err := env.Mgmt.Client.Status().Update(ctx, m); err != nil {
		t.Fatal(err)
	}
}
