//go:build testattestors

package app

import (
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/null"
)

// testAttestors lists the test-only node halves (build tag testattestors):
// the null rubber-stamp attestor, configured by the node config's null
// section.
func testAttestors() map[string]attestorFactory {
	return map[string]attestorFactory{
		null.Name: func(c *config.NodeConfig) (attestor.Attestor, error) {
			var nc config.NullConfig
			if c.Null != nil {
				nc = *c.Null
			}
			return null.NewAttestor(nc.Versions, nc.Stable)
		},
	}
}
