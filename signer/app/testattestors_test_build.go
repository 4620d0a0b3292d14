//go:build testattestors

package app

import (
	"fmt"

	"github.com/spf13/pflag"

	"sigs.k8s.io/kubelet-authenticator/attestor/null"
)

// testAttestorOptions configures the test-only attestors (build tag
// testattestors).
type testAttestorOptions struct {
	// NullVersions, when set, serves the null rubber-stamp attestor,
	// accepting these evidence versions (newest first).
	NullVersions []string
}

func (o *testAttestorOptions) addFlags(fs *pflag.FlagSet) {
	fs.StringSliceVar(&o.NullVersions, "null-versions", o.NullVersions,
		"Serve the null rubber-stamp attestor (test builds only), accepting these evidence versions, newest first. Empty: not served.")
}

func (o *testAttestorOptions) validate() []error {
	if len(o.NullVersions) == 0 {
		return nil
	}
	if _, err := null.NewVerifier(o.NullVersions); err != nil {
		return []error{fmt.Errorf("--null-versions: %w", err)}
	}
	return nil
}

// testVerifierConfigs configures the null verifier when --null-versions is
// set; the provider table (attestor/providers, build tag testattestors)
// builds it.
func (o *testAttestorOptions) testVerifierConfigs() map[string]any {
	if len(o.NullVersions) == 0 {
		return nil
	}
	return map[string]any{null.Name: null.VerifierConfig{Versions: o.NullVersions}}
}
