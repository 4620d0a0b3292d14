package capi

import (
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// countingMapper counts the lookups that reach it.
type countingMapper struct {
	meta.RESTMapper
	calls int
}

func (c *countingMapper) RESTMapping(gk schema.GroupKind, versions ...string) (*meta.RESTMapping, error) {
	c.calls++
	return c.RESTMapper.RESTMapping(gk, versions...)
}

// TestKindMisses: a kind the management cluster does not serve is looked up
// once a minute, not once per decision; a served kind is always looked up,
// and a kind installed after a miss is found once the miss expires.
func TestKindMisses(t *testing.T) {
	served := schema.GroupVersionKind{Group: infrastructureGroup, Version: "v1beta1", Kind: "TestMachine"}
	base := meta.NewDefaultRESTMapper([]schema.GroupVersion{served.GroupVersion()})
	base.Add(served, meta.RESTScopeNamespace)
	counting := &countingMapper{RESTMapper: base}
	now := time.Unix(1_000_000, 0)
	clk := clocktesting.NewFakePassiveClock(now)
	k := newKindMisses(counting, clk)

	unknown := schema.GroupKind{Group: infrastructureGroup, Kind: "NoSuchMachine"}
	for range 100 {
		if _, err := k.RESTMapping(unknown); !meta.IsNoMatchError(err) {
			t.Fatalf("unknown kind: %v, want a no-match error", err)
		}
	}
	if counting.calls != 1 {
		t.Errorf("100 lookups of an unserved kind asked discovery %d times, want 1", counting.calls)
	}
	for range 3 {
		if _, err := k.RESTMapping(served.GroupKind()); err != nil {
			t.Fatal(err)
		}
	}
	if counting.calls != 4 {
		t.Errorf("served kind: %d lookups in all, want every one to reach the mapper (4)", counting.calls)
	}

	// The kind is installed; after the miss expires it is found.
	installed := schema.GroupVersionKind{Group: infrastructureGroup, Version: "v1beta1", Kind: "NoSuchMachine"}
	base.Add(installed, meta.RESTScopeNamespace)
	if _, err := k.RESTMapping(unknown); !meta.IsNoMatchError(err) {
		t.Fatalf("within the minute: %v, want the remembered miss", err)
	}
	clk.SetTime(now.Add(kindMissTTL))
	if m, err := k.RESTMapping(unknown); err != nil || m.GroupVersionKind != installed {
		t.Fatalf("after the miss expired: %v, %v", m, err)
	}
}
