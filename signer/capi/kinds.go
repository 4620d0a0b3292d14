package capi

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/discovery"
	"k8s.io/utils/clock"
)

// kindsRefresh is how old the list of the infrastructure kinds the
// management cluster serves may be when it answers that a kind is not
// served.
const kindsRefresh = time.Minute

// discoveryTimeout bounds one listing of the served kinds; lookups wait
// for the listing in flight.
const discoveryTimeout = 30 * time.Second

// servedKinds resolves the kinds Machines' infrastructure references name.
//
// A Machine's infrastructureRef is the tenant's to write. Asked for a kind
// it does not know, the manager's RESTMapper runs discovery again, under
// one lock that holds every other Cluster's decisions behind it and
// through the management client they share. So a kind reaches the
// RESTMapper only if the management cluster serves it, and whether it does
// is answered from one list of the infrastructure group's kinds, taken at
// most once a kindsRefresh: however many kinds tenants name, they cost at
// most one discovery a minute between them. A kind installed meanwhile is
// found once the list is that old. A list that could not be taken is an
// error (the decision is retried), never "not served": an unserved kind
// means no endorsement key pin is read.
type servedKinds struct {
	meta.RESTMapper
	// group is the API group whose kinds are listed; lookups of any other
	// group go to the RESTMapper.
	group    string
	discover func() (sets.Set[string], error)
	clock    clock.PassiveClock

	mu       sync.Mutex
	kinds    sets.Set[string] // nil until listed
	listedAt time.Time
	// listing is closed when the listing in flight ends.
	listing chan struct{}
}

func newServedKinds(m meta.RESTMapper, group string, discover func() (sets.Set[string], error), clk clock.PassiveClock) *servedKinds {
	return &servedKinds{RESTMapper: m, group: group, discover: discover, clock: clk}
}

// RESTMapping answers a kind of the group that is not served without the
// RESTMapper.
func (k *servedKinds) RESTMapping(gk schema.GroupKind, versions ...string) (*meta.RESTMapping, error) {
	if gk.Group == k.group {
		served, err := k.serves(gk.Kind)
		if err != nil {
			return nil, err
		}
		if !served {
			return nil, &meta.NoKindMatchError{GroupKind: gk, SearchedVersions: versions}
		}
	}
	return k.RESTMapper.RESTMapping(gk, versions...)
}

// serves reports whether kind is in the list, listing again first when it
// is not and the list is older than kindsRefresh. One listing runs at a
// time; lookups meanwhile wait for it.
func (k *servedKinds) serves(kind string) (bool, error) {
	for {
		k.mu.Lock()
		if k.kinds.Has(kind) {
			k.mu.Unlock()
			return true, nil
		}
		if k.kinds != nil && k.clock.Since(k.listedAt) < kindsRefresh {
			k.mu.Unlock()
			return false, nil
		}
		if wait := k.listing; wait != nil {
			k.mu.Unlock()
			<-wait
			k.mu.Lock()
			failed := k.kinds == nil || k.clock.Since(k.listedAt) >= kindsRefresh
			k.mu.Unlock()
			if failed {
				return false, fmt.Errorf("unable to list the %s kinds the management cluster serves", k.group)
			}
			continue
		}
		done := make(chan struct{})
		k.listing = done
		k.mu.Unlock()

		kinds, err := k.discover()
		k.mu.Lock()
		if err == nil {
			k.kinds, k.listedAt = kinds, k.clock.Now()
		}
		k.listing = nil
		close(done)
		k.mu.Unlock()
		if err != nil {
			return false, fmt.Errorf("unable to list the %s kinds the management cluster serves: %w", k.group, err)
		}
		return kinds.Has(kind), nil
	}
}

// discoverKinds lists the kinds dc's API server serves in group, in any
// version, subresources left out. A failure to discover that group is an
// error; other groups' failures (an aggregated API that is down) are
// not this list's business.
func discoverKinds(dc discovery.DiscoveryInterface, group string) func() (sets.Set[string], error) {
	return func() (sets.Set[string], error) {
		_, lists, err := dc.ServerGroupsAndResources()
		if err != nil {
			var failed *discovery.ErrGroupDiscoveryFailed
			if !errors.As(err, &failed) {
				return nil, err
			}
			for gv, gerr := range failed.Groups {
				if gv.Group == group {
					return nil, fmt.Errorf("discovery of %s: %w", gv, gerr)
				}
			}
		}
		kinds := sets.New[string]()
		for _, l := range lists {
			gv, err := schema.ParseGroupVersion(l.GroupVersion)
			if err != nil || gv.Group != group {
				continue
			}
			for _, r := range l.APIResources {
				if !strings.Contains(r.Name, "/") {
					kinds.Insert(r.Kind)
				}
			}
		}
		return kinds, nil
	}
}
