//go:build testattestors

package providers

import (
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/null"
)

// The test composition point: test builds add the null rubber-stamp
// attestor, configured by the node configuration's nullAttestor section
// and, on the controller, by --null-versions.
func init() {
	Register(Provider(null.Name, "nullAttestor",
		func(c null.Config, _ NodeEnv) (attestor.Attestor, error) {
			return null.NewAttestor(c.Versions, c.Stable)
		},
		"", func(c null.VerifierConfig, _ VerifierEnv) (attestor.Verifier, error) {
			return null.NewVerifier(c.Versions)
		}))
}
