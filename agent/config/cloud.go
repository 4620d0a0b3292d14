package config

import (
	"fmt"

	"sigs.k8s.io/kubelet-authenticator/attestor/aws"
	"sigs.k8s.io/kubelet-authenticator/attestor/azure"
	"sigs.k8s.io/kubelet-authenticator/attestor/gcp"
)

// validateCloud checks the cloud attestor sections: the one the attestor
// field selects, and any other that is set (a machine image may carry all
// of them). Each provider's own constructor does the checking, so the
// config file and the attestor agree on what is valid; it touches no
// network.
func (c *NodeConfig) validateCloud() []error {
	var errs []error
	check := func(name string, set bool, build func() error) {
		if !set && c.Attestor != name {
			return
		}
		if err := build(); err != nil {
			for _, e := range unjoin(err) {
				errs = append(errs, fmt.Errorf("%s: %w", name, e))
			}
		}
	}
	check(aws.Name, c.AWS != aws.AttestorConfig{}, func() error { _, err := aws.NewAttestor(c.AWS); return err })
	check(azure.Name, c.Azure != azure.AttestorConfig{}, func() error { _, err := azure.NewAttestor(c.Azure); return err })
	check(gcp.Name, c.GCP != gcp.AttestorConfig{}, func() error { _, err := gcp.NewAttestor(c.GCP); return err })
	// The Azure attested document names the subscription and vmId but not
	// the resource group or VM name of the provider ID, so the node cannot
	// derive it: it comes from the configuration (Cluster API's Azure
	// provider knows it when it writes the bootstrap data).
	if c.Attestor == azure.Name && c.ProviderID == "" {
		errs = append(errs, fmt.Errorf("providerID is required with attestor azure (azure:///subscriptions/<id>/resourceGroups/<group>/providers/Microsoft.Compute/virtualMachines/<name>, the Machine's spec.providerID)"))
	}
	return errs
}

// unjoin splits an errors.Join result into its errors.
func unjoin(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}
