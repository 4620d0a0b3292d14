//go:build !testattestors

package app

import (
	"github.com/spf13/pflag"
)

// testAttestorOptions is empty in release builds: they never contain the
// null rubber-stamp attestor, nor its flag.
type testAttestorOptions struct{}

func (*testAttestorOptions) addFlags(*pflag.FlagSet) {}

func (*testAttestorOptions) validate() []error { return nil }

func (*testAttestorOptions) testVerifierConfigs() map[string]any { return nil }
