//go:build testattestors

package app

import (
	"context"
	"reflect"
	"testing"

	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"sigs.k8s.io/kubelet-authenticator/attestor/null"
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
