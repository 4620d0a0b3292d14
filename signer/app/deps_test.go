package app

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestControllerLinksNoTPMTransport guards the controller binary: it builds
// with CGO_ENABLED=0 and links the TPM verifier (go-tpm's structures) but
// no way to open a TPM: no device or socket opener, no simulator.
func TestControllerLinksNoTPMTransport(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	cmd := exec.Command("go", "list", "-deps", "sigs.k8s.io/kubelet-authenticator/cmd/node-attestation-controller")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	deps := strings.Fields(string(out))
	var tpm bool
	for _, d := range deps {
		tpm = tpm || d == "sigs.k8s.io/kubelet-authenticator/attestor/tpm"
		for _, banned := range []string{
			"sigs.k8s.io/kubelet-authenticator/attestor/tpm/device",
			"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim",
			"github.com/google/go-tpm-tools",
			"github.com/google/go-tpm/tpm2/transport/linuxtpm",
			"github.com/google/go-tpm/tpm2/transport/simulator",
		} {
			if strings.HasPrefix(d, banned) {
				t.Errorf("the controller links %s", d)
			}
		}
	}
	if !tpm {
		t.Error("the controller does not link the TPM verifier")
	}
}
