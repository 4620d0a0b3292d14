package config

import (
	"fmt"
	"reflect"

	"sigs.k8s.io/kubelet-authenticator/attestor/azure"
	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
)

// validateProviders checks the provider sections: the one the attestor
// field selects, and any other that is set (a machine image may carry all
// of them). Each provider's own constructor, from the provider table, does
// the checking, so the config file and the attestor agree on what is
// valid; it touches no network and opens no TPM.
func (c *NodeConfig) validateProviders() []error {
	var errs []error
	noTPM := providers.NodeEnv{OpenTPM: func(string) (tpm.Opener, bool, error) { return nil, true, nil }}
	for _, d := range providers.All() {
		if d.NodeSection == "" {
			continue
		}
		section, err := c.ProviderSection(d)
		if err == nil {
			if !c.sectionSet(d, section) && c.Attestor != d.Name {
				continue
			}
			_, err = d.NewAttestor(section, noTPM)
		}
		for _, e := range unjoin(err) {
			errs = append(errs, fmt.Errorf("%s: %w", d.Name, e))
		}
	}
	// The Azure attested document names the subscription and vmId but not
	// the resource group or VM name of the provider ID, so the node cannot
	// derive it: it comes from the configuration (Cluster API's Azure
	// provider knows it when it writes the bootstrap data).
	if c.Attestor == azure.Name && c.ProviderID == "" {
		errs = append(errs, fmt.Errorf("providerID is required with attestor azure ("+
			"azure:///subscriptions/<id>/resourceGroups/<group>/providers/Microsoft.Compute/virtualMachines/<name>, the Machine's spec.providerID)"))
	}
	return errs
}

// sectionSet reports whether the configuration sets provider d's section.
func (c *NodeConfig) sectionSet(d providers.Descriptor, section any) bool {
	if _, ok := c.Extensions[d.NodeSection]; ok {
		return true
	}
	v := reflect.ValueOf(section)
	if v.Kind() == reflect.Pointer {
		v = v.Elem()
	}
	return v.IsValid() && !v.IsZero()
}

// unjoin splits an errors.Join result into its errors; nil into none.
func unjoin(err error) []error {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}
