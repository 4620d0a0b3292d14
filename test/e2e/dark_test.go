//go:build tpmsimulator

package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/credential"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
	"sigs.k8s.io/kubelet-authenticator/test/scenario"
)

// TestWayBackWhenEverythingExpired: a node was cut off from the management
// cluster for longer than its certificate lives, and its bootstrap token
// expired too. The node says so and what to do; after the documented way
// back (docs/troubleshooting.md#a-node-whose-certificate-and-bootstrap-token-expired:
// a new bootstrap token in the node's bootstrap kubeconfig) it attests
// again with the same TPM, is matched to the same Machine, and talks as
// itself.
func TestWayBackWhenEverythingExpired(t *testing.T) {
	caDir, _ := manufacturerCA(t, "Trusted TPM Maker")
	env := scenario.Start(t, scenario.Options{Attestors: "tpm", ControllerArgs: tpmSignerArgs(filepath.Join(caDir, tpmtest.BundleFile), time.Minute)})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	// The node has its own bootstrap kubeconfig, as every node does.
	bootstrap := filepath.Join(t.TempDir(), "bootstrap-kubeconfig")
	copyFile(t, env.BootstrapKubeconfig, bootstrap)
	n := env.NewNode(t, "far", "test:///fleet/far", "tpm", simulatorConfig(41, caDir), "")
	rewrite(t, n.ConfigPath, env.BootstrapKubeconfig, bootstrap)
	env.Machine(t, n)
	if r := n.Credential(ctx); r.Err != nil {
		t.Fatalf("first join: %v\n%s\ncontroller log:\n%s", r.Err, r.Stderr, harness.LastLines(env.ControllerLog(), 40))
	}
	first, err := (cache.Dir{Path: n.CacheDir}).Load()
	if err != nil {
		t.Fatal(err)
	}

	// Everything expires: the node's certificate (what a week cut off
	// from the management cluster does) and its bootstrap token.
	id := strings.SplitN(env.Token, ".", 2)[0]
	patch := `{"stringData":{"expiration":"` + time.Now().Add(-time.Minute).UTC().Format(time.RFC3339) + `"}}`
	if _, err := env.Workload.Client.CoreV1().Secrets(metav1.NamespaceSystem).Patch(ctx, "bootstrap-token-"+id, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}

	// kube-apiserver caches a token it authenticated for a few seconds.
	bootstrapClient := kubernetes.NewForConfigOrDie(env.Workload.RESTConfigFor(t, clientcmdapi.AuthInfo{Token: env.Token}))
	harness.WaitFor(t, time.Minute, func() (bool, error) {
		_, err := harness.WhoAmI(ctx, bootstrapClient)
		return apierrors.IsUnauthorized(err), nil
	})
	expired, err := env.Workload.CA.Sign(harness.CertSpec{CommonName: "system:node:far", Organization: []string{attestor.NodesGroup}, NotAfter: time.Now().Add(-time.Minute)}, first.Key.Public())
	if err != nil {
		t.Fatal(err)
	}
	if err := (cache.Dir{Path: n.CacheDir}).Store(expired, first.KeyPEM); err != nil {
		t.Fatal(err)
	}
	// The node cannot get a credential, and says why and what to do.
	var r scenario.Result
	harness.WaitFor(t, time.Minute, func() (bool, error) {
		r = n.Credential(ctx, "--timeout=20s", "--verbose")
		if r.Err == nil {
			return false, fmt.Errorf("the credential call still succeeds: %s", r.Stderr)
		}
		return true, nil
	})
	for _, want := range []string{"expired at", "refused the bootstrap credential", credential.RecoveryDoc} {
		if !strings.Contains(r.Stderr, want) {
			t.Errorf("the failing credential call does not say %q:\n%s", want, r.Stderr)
		}
	}

	// The way back: a new bootstrap token in the node's bootstrap kubeconfig.
	token := env.Workload.CreateBootstrapToken(t)
	copyFile(t, env.Workload.BootstrapKubeconfig(t, token), bootstrap)
	r = n.Credential(ctx)
	if r.Err != nil {
		t.Fatalf("after a new bootstrap token: %v\n%s\ncontroller log:\n%s", r.Err, r.Stderr, harness.LastLines(env.ControllerLog(), 40))
	}
	r = n.Kubectl(ctx, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
	if r.Err != nil || strings.TrimSpace(r.Stdout) != "system:node:far" {
		t.Fatalf("after the way back the node is %q (%v)\n%s", r.Stdout, r.Err, r.Stderr)
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

func rewrite(t *testing.T, path, old, replacement string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), old) {
		t.Fatalf("%s does not name %s", path, old)
	}
	if err := os.WriteFile(path, []byte(strings.ReplaceAll(string(b), old, replacement)), 0o600); err != nil {
		t.Fatal(err)
	}
}
