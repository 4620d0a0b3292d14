//go:build !tpmsimulator

package app

import (
	"errors"

	"sigs.k8s.io/kubelet-authenticator/agent/config"

	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
)

// simulatorDevice is the tpm.device value of the in-process simulator.
const simulatorDevice = "simulator"

// simulatorOpener is unavailable in release builds: they never link the
// TPM simulator, and their configuration schema has no tpm.simulator.
func simulatorOpener(*config.NodeConfig) (tpm.Opener, error) {
	return nil, errors.New(`tpm device "simulator" is only available in test builds (build tag tpmsimulator)`)
}
