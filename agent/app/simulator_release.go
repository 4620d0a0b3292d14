//go:build !tpmsimulator

package app

import (
	"errors"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
)

// simulatorOpener is unavailable in release builds: they never link the
// TPM simulator.
func simulatorOpener(*config.TPMSimulatorConfig) (tpm.Opener, error) {
	return nil, errors.New(`tpm device "simulator" is only available in test builds (build tag tpmsimulator)`)
}
