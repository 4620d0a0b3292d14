package app

import (
	"context"
	"fmt"
	"time"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/aws"
	"sigs.k8s.io/kubelet-authenticator/attestor/azure"
	"sigs.k8s.io/kubelet-authenticator/attestor/gcp"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/device"
)

// attestorFactory builds a node half from the node's configuration.
type attestorFactory func(*config.NodeConfig) (attestor.Attestor, error)

// attestors lists the node halves this binary can use, by provider name:
// the released ones, plus the test-only ones in test builds
// (testAttestors, build tag testattestors).
func attestors() map[string]attestorFactory {
	table := map[string]attestorFactory{
		insecure.Name: func(*config.NodeConfig) (attestor.Attestor, error) { return insecure.Attestor{}, nil },
		"tpm":         newTPMAttestor,
		aws.Name:      func(c *config.NodeConfig) (attestor.Attestor, error) { return aws.NewAttestor(c.AWS) },
		azure.Name:    func(c *config.NodeConfig) (attestor.Attestor, error) { return azure.NewAttestor(c.Azure) },
		gcp.Name:      func(c *config.NodeConfig) (attestor.Attestor, error) { return gcp.NewAttestor(c.GCP) },
	}
	for name, mk := range testAttestors() {
		table[name] = mk
	}
	return table
}

// providerIDReader is implemented by node attestors that can read the
// machine's provider ID from their metadata service (aws, gcp).
type providerIDReader interface {
	ProviderID(ctx context.Context) (string, error)
}

// providerIDTimeout bounds reading the provider ID from a metadata service.
const providerIDTimeout = 30 * time.Second

func newTPMAttestor(c *config.NodeConfig) (attestor.Attestor, error) {
	var prefer []tpm.EKKind
	for _, k := range c.TPM.EndorsementKeys {
		prefer = append(prefer, tpm.EKKind(k))
	}
	cfg := tpm.AttestorConfig{EndorsementKeys: prefer, PCRBank: c.TPM.PCRBank, PCRs: c.TPM.PCRs, EventLogPath: c.TPM.EventLogPath, NoEventLog: c.TPM.NoEventLog}
	open := device.Opener(c.TPM.Device)
	if c.TPM.Device == "simulator" {
		var err error
		if open, err = simulatorOpener(c.TPM.Simulator); err != nil {
			return nil, err
		}
		// The host's own event log does not describe the simulator's PCRs.
		cfg.NoEventLog = true
	}
	return tpm.New(open, cfg)
}

func newAttestor(c *config.NodeConfig) (attestor.Attestor, error) {
	mk, ok := attestors()[c.Attestor]
	if !ok {
		return nil, fmt.Errorf("attestor %q is not available in this binary", c.Attestor)
	}
	a, err := mk(c)
	if err != nil {
		return nil, err
	}
	if err := deriveProviderID(c, a); err != nil {
		return nil, err
	}
	return a, nil
}

// deriveProviderID fills an unset providerID from the attestor's metadata
// service, where it has one (aws, gcp). It runs when the attestor is set up:
// when the agent starts and when the credential command must attest, never
// on the cached path. The derived value proves nothing by itself: the signer
// derives it again from the signed evidence and requires the Machine's
// spec.providerID to equal it.
func deriveProviderID(c *config.NodeConfig, a attestor.Attestor) error {
	if c.ProviderID != "" {
		return nil
	}
	r, ok := a.(providerIDReader)
	if !ok {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), providerIDTimeout)
	defer cancel()
	pid, err := r.ProviderID(ctx)
	if err != nil {
		return fmt.Errorf("providerID is not configured and the %s metadata service did not give it: %w", c.Attestor, err)
	}
	c.ProviderID = pid
	return nil
}
