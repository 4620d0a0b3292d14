package capi

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// TestInstallDocShowsTheTestedTemplate: the KubeadmConfigTemplate
// docs/install.md tells users to write is, verbatim, the file
// TestMachineDeploymentLifecycle creates, so the page cannot drift from what
// is tested with the real Cluster API controllers.
func TestInstallDocShowsTheTestedTemplate(t *testing.T) {
	root, err := harness.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := os.ReadFile(filepath.Join(root, kubeadmConfigTemplate))
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(root, "docs", "install.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(doc), "```yaml\n"+string(tmpl)+"```\n") {
		t.Fatalf("docs/install.md does not show %s verbatim in a ```yaml block", kubeadmConfigTemplate)
	}
	if strings.Count(string(doc), "kind: KubeadmConfigTemplate") != 1 {
		t.Fatalf("docs/install.md shows more than one KubeadmConfigTemplate; show the tested one only")
	}
}
