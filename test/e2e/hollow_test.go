package e2e

import (
	"bytes"
	"os/exec"
	"path/filepath"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// hollowKubeletTLS returns kubemark's hollow kubelet built to serve HTTPS
// with kubelet's tlsCertFile/tlsPrivateKeyFile handling
// (test/tools/install-hollow-kubelet-tls.sh): kubemark's own binary passes
// its kubelet no TLS options and serves plain HTTP.
func hollowKubeletTLS(t *testing.T) string {
	t.Helper()
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.Command("bash", filepath.Join(root, "test", "tools", "install-hollow-kubelet-tls.sh"))
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("unable to build hollow-kubelet-tls: %v\n%s", err, stderr.String())
	}
	return lastLine(stdout.String())
}
