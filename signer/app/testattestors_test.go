//go:build testattestors

package app

import (
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"sigs.k8s.io/kubelet-authenticator/attestor/null"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/podcert"
)

// TestNullVerifierFromTable: --null-versions serves the test-only null
// attestor, built by the provider table; without it, it is not served.
func TestNullVerifierFromTable(t *testing.T) {
	o := NewOptions()
	o.LeaderElectionNamespace = "capi-system"
	c := fake.NewClientBuilder().Build()
	v, _, err := o.Verifiers(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := v[null.Name]; ok {
		t.Error("null served without --null-versions")
	}
	o.NullVersions = []string{"v2", "v1"}
	if v, _, err = o.Verifiers(context.Background(), c); err != nil {
		t.Fatal(err)
	}
	nv, ok := v[null.Name].(*null.Verifier)
	if !ok {
		t.Fatalf("no null verifier: %v", v)
	}
	if got := nv.Versions(); !reflect.DeepEqual(got, []string{"v2", "v1"}) {
		t.Errorf("null verifier versions = %v", got)
	}
}

// TestPodCertificateTimingFlags: the test-only pod certificate timing is
// set from its flags on the reconciler, and a timing kube-apiserver would
// refuse the certificates of is refused at startup.
func TestPodCertificateTimingFlags(t *testing.T) {
	o := NewOptions()
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	o.AddFlags(fs)
	if err := fs.Parse([]string{"--test-pod-certificate-backdate=4m30s", "--test-pod-certificate-refresh-after=10m"}); err != nil {
		t.Fatal(err)
	}
	if errs := o.testAttestorOptions.validate(); len(errs) > 0 {
		t.Fatal(errs)
	}
	r := &capi.ClusterReconciler{}
	o.testAttestorOptions.configure(r)
	if want := (podcert.Timing{Backdate: 4*time.Minute + 30*time.Second, RefreshAfter: 10 * time.Minute}); r.PodCertificateTiming != want {
		t.Errorf("timing %+v, want %+v", r.PodCertificateTiming, want)
	}
	if err := fs.Parse([]string{"--test-pod-certificate-backdate=5m"}); err != nil {
		t.Fatal(err)
	}
	if errs := o.testAttestorOptions.validate(); len(errs) != 1 || !strings.Contains(errs[0].Error(), "--test-pod-certificate-backdate") {
		t.Errorf("a backdate of 5m: %v, want refused", errs)
	}
}
