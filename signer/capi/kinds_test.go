package capi

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/discovery"
	clocktesting "k8s.io/utils/clock/testing"
)

// countingMapper counts the lookups that reach it.
type countingMapper struct {
	meta.RESTMapper
	calls atomic.Int32
}

func (c *countingMapper) RESTMapping(gk schema.GroupKind, versions ...string) (*meta.RESTMapping, error) {
	c.calls.Add(1)
	return c.RESTMapper.RESTMapping(gk, versions...)
}

// listing is a discover function over a set the test changes, counting
// its calls; fail makes it fail.
type listing struct {
	mu    sync.Mutex
	kinds sets.Set[string]
	fail  error
	calls int
	// gate, when set, holds each listing until it is closed.
	gate chan struct{}
}

func (l *listing) discover() (sets.Set[string], error) {
	l.mu.Lock()
	l.calls++
	gate := l.gate
	l.mu.Unlock()
	if gate != nil {
		<-gate
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.fail != nil {
		return nil, l.fail
	}
	return l.kinds.Clone(), nil
}

func (l *listing) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.calls
}

// TestServedKinds: kinds tenants name that nobody serves cost one listing
// a minute between them, however many, and never reach the RESTMapper; a
// served kind is resolved whatever unserved kinds were asked before it; a
// kind installed later is found once the list is a minute old; a listing
// that fails is an error, never "not served".
func TestServedKinds(t *testing.T) {
	served := schema.GroupVersionKind{Group: infrastructureGroup, Version: "v1beta1", Kind: "TestMachine"}
	other := schema.GroupVersionKind{Group: "example.com", Version: "v1", Kind: "Other"}
	base := meta.NewDefaultRESTMapper([]schema.GroupVersion{served.GroupVersion(), other.GroupVersion()})
	base.Add(served, meta.RESTScopeNamespace)
	base.Add(other, meta.RESTScopeNamespace)
	mapper := &countingMapper{RESTMapper: base}
	list := &listing{kinds: sets.New(served.Kind)}
	now := time.Unix(1_000_000, 0)
	clk := clocktesting.NewFakePassiveClock(now)
	k := newServedKinds(mapper, infrastructureGroup, list.discover, clk)

	for i := range 1000 {
		gk := schema.GroupKind{Group: infrastructureGroup, Kind: fmt.Sprintf("NoSuchMachine%d", i)}
		if _, err := k.RESTMapping(gk); !meta.IsNoMatchError(err) {
			t.Fatalf("unserved kind %s: %v, want a no-match error", gk.Kind, err)
		}
	}
	if got := list.count(); got != 1 {
		t.Errorf("1000 unserved kinds listed the served kinds %d times, want 1", got)
	}
	if got := mapper.calls.Load(); got != 0 {
		t.Errorf("unserved kinds reached the RESTMapper %d times, want 0", got)
	}
	for range 3 {
		if m, err := k.RESTMapping(served.GroupKind()); err != nil || m.GroupVersionKind != served {
			t.Fatalf("served kind after unserved ones: %v, %v", m, err)
		}
	}
	if got := mapper.calls.Load(); got != 3 {
		t.Errorf("served kind: %d lookups reached the RESTMapper, want 3", got)
	}
	if _, err := k.RESTMapping(other.GroupKind()); err != nil {
		t.Fatalf("another group: %v", err)
	}
	if got := list.count(); got != 1 {
		t.Errorf("served kinds and other groups listed again (%d listings), want none", got)
	}

	// Installed after the list was taken: found once it is a minute old.
	installed := schema.GroupVersionKind{Group: infrastructureGroup, Version: "v1beta1", Kind: "NewMachine"}
	base.Add(installed, meta.RESTScopeNamespace)
	list.mu.Lock()
	list.kinds.Insert(installed.Kind)
	list.mu.Unlock()
	if _, err := k.RESTMapping(installed.GroupKind()); !meta.IsNoMatchError(err) {
		t.Fatalf("within the minute: %v, want not served", err)
	}
	clk.SetTime(now.Add(kindsRefresh))
	if m, err := k.RESTMapping(installed.GroupKind()); err != nil || m.GroupVersionKind != installed {
		t.Fatalf("after a minute: %v, %v", m, err)
	}
	if got := list.count(); got != 2 {
		t.Errorf("%d listings, want 2", got)
	}

	// A listing that fails: an error for the kinds not on the list, and
	// the next lookup lists again; the kinds on the list still resolve.
	list.mu.Lock()
	list.fail = errors.New("the management API server is down")
	list.mu.Unlock()
	clk.SetTime(now.Add(2 * kindsRefresh))
	for range 2 {
		if _, err := k.RESTMapping(schema.GroupKind{Group: infrastructureGroup, Kind: "Unknown"}); err == nil || meta.IsNoMatchError(err) {
			t.Fatalf("listing failed: %v, want an error that is not a no-match", err)
		}
	}
	if got := list.count(); got != 4 {
		t.Errorf("%d listings, want 4: a failed listing is tried again", got)
	}
	if _, err := k.RESTMapping(served.GroupKind()); err != nil {
		t.Fatalf("a listed kind while listing fails: %v", err)
	}
	list.mu.Lock()
	list.fail = nil
	list.mu.Unlock()
	if _, err := k.RESTMapping(schema.GroupKind{Group: infrastructureGroup, Kind: "Unknown"}); !meta.IsNoMatchError(err) {
		t.Fatalf("listing recovered: %v, want not served", err)
	}
}

// TestServedKindsConcurrent: lookups while a listing is in flight wait for
// it rather than list again, and are answered from it.
func TestServedKindsConcurrent(t *testing.T) {
	served := schema.GroupVersionKind{Group: infrastructureGroup, Version: "v1beta1", Kind: "TestMachine"}
	base := meta.NewDefaultRESTMapper([]schema.GroupVersion{served.GroupVersion()})
	base.Add(served, meta.RESTScopeNamespace)
	list := &listing{kinds: sets.New(served.Kind), gate: make(chan struct{})}
	k := newServedKinds(base, infrastructureGroup, list.discover, clocktesting.NewFakePassiveClock(time.Unix(1_000_000, 0)))

	var wg sync.WaitGroup
	errs := make([]error, 40)
	for i := range errs {
		wg.Go(func() {
			kind := served.Kind
			if i%2 == 1 {
				kind = fmt.Sprintf("NoSuch%d", i)
			}
			_, errs[i] = k.RESTMapping(schema.GroupKind{Group: infrastructureGroup, Kind: kind})
		})
	}
	for list.count() == 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	close(list.gate)
	wg.Wait()
	if got := list.count(); got != 1 {
		t.Errorf("40 concurrent lookups listed %d times, want 1", got)
	}
	for i, err := range errs {
		if i%2 == 0 && err != nil {
			t.Errorf("lookup %d of the served kind: %v", i, err)
		}
		if i%2 == 1 && !meta.IsNoMatchError(err) {
			t.Errorf("lookup %d of an unserved kind: %v, want not served", i, err)
		}
	}
}

// groupsAndResources is a discovery client whose ServerGroupsAndResources
// answers what the test says.
type groupsAndResources struct {
	discovery.DiscoveryInterface
	lists []*metav1.APIResourceList
	err   error
}

func (g *groupsAndResources) ServerGroupsAndResources() ([]*metav1.APIGroup, []*metav1.APIResourceList, error) {
	return nil, g.lists, g.err
}

// TestDiscoverKinds: the infrastructure group's kinds in every version,
// without subresources or other groups; a failure to discover that group
// is an error, another group's failure is not.
func TestDiscoverKinds(t *testing.T) {
	lists := []*metav1.APIResourceList{
		{GroupVersion: infrastructureGroup + "/v1beta1", APIResources: []metav1.APIResource{
			{Name: "dockermachines", Kind: "DockerMachine"}, {Name: "dockermachines/status", Kind: "DockerMachineStatusOnly"},
		}},
		{GroupVersion: infrastructureGroup + "/v1beta2", APIResources: []metav1.APIResource{{Name: "awsmachines", Kind: "AWSMachine"}}},
		{GroupVersion: "example.com/v1", APIResources: []metav1.APIResource{{Name: "others", Kind: "Other"}}},
	}
	otherDown := &discovery.ErrGroupDiscoveryFailed{Groups: map[schema.GroupVersion]error{{Group: "metrics.k8s.io", Version: "v1beta1"}: errors.New("503")}}
	infraDown := &discovery.ErrGroupDiscoveryFailed{Groups: map[schema.GroupVersion]error{{Group: infrastructureGroup, Version: "v1beta2"}: errors.New("503")}}
	for _, tc := range []struct {
		name    string
		err     error
		want    []string
		wantErr bool
	}{
		{name: "all served", want: []string{"AWSMachine", "DockerMachine"}},
		{name: "another group down", err: otherDown, want: []string{"AWSMachine", "DockerMachine"}},
		{name: "infrastructure group down", err: infraDown, wantErr: true},
		{name: "API server down", err: errors.New("connection refused"), wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := discoverKinds(&groupsAndResources{lists: lists, err: tc.err}, infrastructureGroup)()
			if tc.wantErr {
				if err == nil {
					t.Fatalf("kinds %v, want an error", sets.List(got))
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !got.Equal(sets.New(tc.want...)) {
				t.Errorf("kinds %v, want %v", sets.List(got), tc.want)
			}
		})
	}
}
