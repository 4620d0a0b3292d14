package app

import (
	"context"
	"fmt"
	"strings"
	"time"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/device"
)

// providerIDReader is implemented by node attestors that can read the
// machine's provider ID from their metadata service (aws, gcp).
type providerIDReader interface {
	ProviderID(ctx context.Context) (string, error)
}

// providerIDTimeout bounds reading the provider ID from a metadata service.
const providerIDTimeout = 30 * time.Second

// newAttestor builds the node half the configuration names, from the one
// provider table (attestor/providers): its section of the configuration, a
// field of NodeConfig or, for a test-only provider, an extension.
func newAttestor(c *config.NodeConfig) (attestor.Attestor, error) {
	d, ok := providers.Lookup(c.Attestor)
	if !ok {
		return nil, fmt.Errorf("attestor %q is not available in this binary (it has %s)", c.Attestor, strings.Join(providers.Names(), ", "))
	}
	cfg, err := c.ProviderSection(d)
	if err != nil {
		return nil, err
	}
	a, err := d.NewAttestor(cfg, providers.NodeEnv{OpenTPM: func(spec string) (tpm.Opener, bool, error) { return openTPM(c, spec) }})
	if err != nil {
		return nil, err
	}
	if err := deriveProviderID(c, a); err != nil {
		return nil, err
	}
	return a, nil
}

// openTPM opens the TPM a device specification names: the host's device or
// a socket TPM, or in test builds the in-process simulator
// (simulator_*.go).
func openTPM(c *config.NodeConfig, spec string) (tpm.Opener, bool, error) {
	if spec == simulatorDevice {
		open, err := simulatorOpener(c)
		return open, false, err
	}
	return device.Opener(spec), true, nil
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
