//go:build testattestors

package app

import (
	"fmt"

	"github.com/spf13/pflag"

	"sigs.k8s.io/kubelet-authenticator/attestor/null"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
)

// testAttestorOptions configures the test-only attestors and the test-only
// pod certificate timing (build tag testattestors).
type testAttestorOptions struct {
	// NullVersions, when set, serves the null rubber-stamp attestor,
	// accepting these evidence versions (newest first).
	NullVersions []string
	// PodCertificateTiming moves pod certificates' notBefore and
	// beginRefreshAt to the earliest kube-apiserver accepts, so that a
	// test sees kubelet refresh them within minutes.
	PodCertificateTiming podcert.Timing
}

func (o *testAttestorOptions) addFlags(fs *pflag.FlagSet) {
	fs.StringSliceVar(&o.NullVersions, "null-versions", o.NullVersions,
		"Serve the null rubber-stamp attestor (test builds only), accepting these evidence versions, newest first. Empty: not served.")
	fs.DurationVar(&o.PodCertificateTiming.Backdate, "test-pod-certificate-backdate", 0,
		"How far before now pod certificates start (test builds only), under 5m. 0: the signer's one minute.")
	fs.DurationVar(&o.PodCertificateTiming.RefreshAfter, "test-pod-certificate-refresh-after", 0,
		"How long after notBefore pod certificates' beginRefreshAt is (test builds only), 10m to 50m. 0: half the lifetime.")
}

func (o *testAttestorOptions) validate() []error {
	var errs []error
	if err := o.PodCertificateTiming.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("--test-pod-certificate-backdate, --test-pod-certificate-refresh-after: %w", err))
	}
	if len(o.NullVersions) == 0 {
		return errs
	}
	if _, err := null.NewVerifier(o.NullVersions); err != nil {
		errs = append(errs, fmt.Errorf("--null-versions: %w", err))
	}
	return errs
}

// configure sets the test-only pod certificate timing on r.
func (o *testAttestorOptions) configure(r *capi.ClusterReconciler) {
	r.PodCertificateTiming = o.PodCertificateTiming
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
