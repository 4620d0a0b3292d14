package app

import (
	"fmt"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/device"
)

// attestors lists the node halves this binary can use, by provider name.
var attestors = map[string]func(*config.NodeConfig) (attestor.Attestor, error){
	insecure.Name: func(*config.NodeConfig) (attestor.Attestor, error) { return insecure.Attestor{}, nil },
	"tpm":         newTPMAttestor,
}

func newTPMAttestor(c *config.NodeConfig) (attestor.Attestor, error) {
	var prefer []tpm.EKKind
	for _, k := range c.TPM.EndorsementKeys {
		prefer = append(prefer, tpm.EKKind(k))
	}
	open := device.Opener(c.TPM.Device)
	if c.TPM.Device == "simulator" {
		var err error
		if open, err = simulatorOpener(c.TPM.Simulator); err != nil {
			return nil, err
		}
	}
	return tpm.NewAttestor(open, prefer...)
}

func newAttestor(c *config.NodeConfig) (attestor.Attestor, error) {
	mk, ok := attestors[c.Attestor]
	if !ok {
		return nil, fmt.Errorf("attestor %q is not available in this binary", c.Attestor)
	}
	return mk(c)
}
