package providers

import (
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/attestor/aws"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
)

func TestReleaseTable(t *testing.T) {
	for _, name := range []string{"aws", "azure", "gcp", "insecure", "tpm"} {
		d, ok := Lookup(name)
		if !ok || d.TestOnly {
			t.Errorf("release provider %s: %+v, %v", name, d, ok)
		}
	}
	d, _ := Lookup(insecure.Name)
	if d.NewNodeConfig != nil || d.NewVerifierConfig != nil {
		t.Error("insecure takes a configuration")
	}
	if _, err := d.NewVerifier(nil, VerifierEnv{}); err != nil {
		t.Error(err)
	}
}

// TestConfigTypeChecked: a constructor given a configuration of another
// provider's type says so instead of building with zero values.
func TestConfigTypeChecked(t *testing.T) {
	d, _ := Lookup(aws.Name)
	_, err := d.NewVerifier(tpm.VerifierConfig{}, VerifierEnv{})
	if err == nil || !strings.Contains(err.Error(), "want aws.VerifierConfig") {
		t.Errorf("aws verifier from a tpm configuration: %v", err)
	}
}

// TestTPMNeedsTheNodeEnv: the table opens a TPM only through the node's
// environment, and the host's event log is dropped for a TPM it does not
// describe.
func TestTPMNeedsTheNodeEnv(t *testing.T) {
	d, _ := Lookup(tpm.Name)
	if _, err := d.NewAttestor(tpm.NodeConfig{}, NodeEnv{}); err == nil {
		t.Error("tpm attestor without a way to open a TPM")
	}
	var asked string
	_, err := d.NewAttestor(tpm.NodeConfig{Device: "unix:///x"}, NodeEnv{OpenTPM: func(dev string) (tpm.Opener, bool, error) {
		asked = dev
		return nil, false, nil
	}})
	if err != nil || asked != "unix:///x" {
		t.Errorf("OpenTPM asked for %q: %v", asked, err)
	}
}
