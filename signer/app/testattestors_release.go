//go:build !testattestors

package app

import (
	"github.com/spf13/pflag"

	"sigs.k8s.io/kubelet-authenticator/signer/capi"
)

// testAttestorOptions is empty in release builds: they never contain the
// null rubber-stamp attestor, nor its flag, nor the test-only pod
// certificate timing: their pod certificates are timed by the signer.
type testAttestorOptions struct{}

func (*testAttestorOptions) addFlags(*pflag.FlagSet) {}

func (*testAttestorOptions) validate() []error { return nil }

func (*testAttestorOptions) testVerifierConfigs() map[string]any { return nil }

func (*testAttestorOptions) configure(*capi.ClusterReconciler) {}
