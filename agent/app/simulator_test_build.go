//go:build tpmsimulator

package app

import (
	"errors"
	"fmt"

	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// simulatorOpener opens the in-process simulator (test and demo builds):
// seeded so that every invocation sees the same EK, its EK certificate
// issued by the manufacturer CA in the configured directory.
func simulatorOpener(c *config.TPMSimulatorConfig) (tpm.Opener, error) {
	if c == nil || c.ManufacturerCADir == "" {
		return nil, errors.New("tpm.simulator.manufacturerCADir is required with the simulator")
	}
	ca, err := tpmtest.Load(c.ManufacturerCADir)
	if err != nil {
		return nil, fmt.Errorf("unable to load the simulator's manufacturer CA: %w", err)
	}
	var sim transport.TPMCloser
	return func() (transport.TPMCloser, error) {
		if sim == nil {
			if sim, err = tpmsim.OpenProvisioned(c.Seed, ca); err != nil {
				return nil, err
			}
		}
		// One simulator per process: keep it open across both rounds.
		return tpmsim.NopCloser(sim), nil
	}, nil
}
