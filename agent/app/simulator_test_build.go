//go:build tpmsimulator

package app

import (
	"errors"
	"fmt"
	"sync"

	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmsim"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// simulatorDevice is the tpm.device value of the in-process simulator.
const simulatorDevice = "simulator"

// simulatorSection is the node configuration section of the simulator: an
// extension only this build's schema knows.
const simulatorSection = "tpm.simulator"

func init() { config.RegisterExtension("tpm", "simulator") }

// simulatorConfig configures the in-process TPM simulator: a fixed seed
// stands for one machine's TPM, and its EK certificate is issued at start
// by the manufacturer CA saved in ManufacturerCADir.
type simulatorConfig struct {
	Seed              int64  `json:"seed"`
	ManufacturerCADir string `json:"manufacturerCADir"`
}

// simulatorOpener opens the in-process simulator (test and demo builds):
// seeded so that every invocation sees the same EK, its EK certificate
// issued by the manufacturer CA in the configured directory.
func simulatorOpener(nc *config.NodeConfig) (tpm.Opener, error) {
	c := &simulatorConfig{}
	if _, err := nc.Extension(simulatorSection, c); err != nil {
		return nil, err
	}
	if c.ManufacturerCADir == "" {
		return nil, errors.New("tpm.simulator.manufacturerCADir is required with the simulator")
	}
	ca, err := tpmtest.Load(c.ManufacturerCADir)
	if err != nil {
		return nil, fmt.Errorf("unable to load the simulator's manufacturer CA: %w", err)
	}
	return func() (transport.TPMCloser, error) {
		sim, err := processSimulator(c.Seed, ca)
		if err != nil {
			return nil, err
		}
		// One simulator per process: keep it open across both rounds.
		return tpmsim.NopCloser(sim), nil
	}, nil
}

// simulator is the process's one simulator: the reference TPM's state is
// global, and opening a second one waits (ignoring any context) until the
// first is closed. An agent that reloads its configuration builds a new
// attestor and keeps using this one.
var simulator struct {
	sync.Mutex
	seed int64
	sim  transport.TPMCloser
}

func processSimulator(seed int64, ca *tpmtest.ManufacturerCA) (transport.TPMCloser, error) {
	simulator.Lock()
	defer simulator.Unlock()
	if simulator.sim == nil {
		sim, err := tpmsim.OpenProvisioned(seed, ca)
		if err != nil {
			return nil, err
		}
		simulator.seed, simulator.sim = seed, sim
	}
	if simulator.seed != seed {
		return nil, fmt.Errorf("the in-process TPM simulator runs one TPM per process (seed %d); restart to change tpm.simulator.seed", simulator.seed)
	}
	return simulator.sim, nil
}
