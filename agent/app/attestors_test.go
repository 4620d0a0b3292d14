//go:build testattestors && tpmsimulator

package app

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
)

func loadConfig(t *testing.T, doc string) *config.NodeConfig {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := config.Load(p)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestNewAttestorFromTable: the node half comes from the provider table,
// test-only providers included, configured by their own section.
func TestNewAttestorFromTable(t *testing.T) {
	c := loadConfig(t, "attestor: \"null\"\nproviderID: test:///n1\nnullAttestor:\n  versions: [v2, v1]\n")
	a, err := newAttestor(c)
	if err != nil {
		t.Fatal(err)
	}
	if got := a.Versions(); !reflect.DeepEqual(got, []string{"v2", "v1"}) {
		t.Errorf("null attestor versions = %v, want the configured [v2 v1]", got)
	}

	c.Attestor = "tmp"
	if _, err := newAttestor(c); err == nil || !strings.Contains(err.Error(), `attestor "tmp" is not available`) || !strings.Contains(err.Error(), "aws, azure, gcp, insecure, null, tpm") {
		t.Errorf("unknown attestor: %v", err)
	}
}

// TestSimulatorSection: tpm.simulator, which only this build's schema
// knows, is read strictly and keeps a 64-bit seed exact.
func TestSimulatorSection(t *testing.T) {
	c := loadConfig(t, "tpm:\n  device: simulator\n  simulator:\n    seed: 9007199254740993\n    manufacturerCADir: /nonexistent\n")
	var s simulatorConfig
	if ok, err := c.Extension(simulatorSection, &s); !ok || err != nil {
		t.Fatalf("tpm.simulator: present %v, %v", ok, err)
	}
	if s.Seed != 9007199254740993 || s.ManufacturerCADir != "/nonexistent" {
		t.Errorf("tpm.simulator = %+v", s)
	}
	if c.TPM.Device != "simulator" {
		t.Errorf("tpm.device = %q", c.TPM.Device)
	}
	if _, err := simulatorOpener(c); err == nil || !strings.Contains(err.Error(), "manufacturer CA") {
		t.Errorf("simulator with a missing CA directory: %v", err)
	}

	c = loadConfig(t, "tpm:\n  device: simulator\n  simulator:\n    sead: 1\n")
	if _, err := simulatorOpener(c); err == nil || !strings.Contains(err.Error(), `unknown field "sead"`) {
		t.Errorf("misspelt simulator field: %v", err)
	}
}
