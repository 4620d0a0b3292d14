package capi

import (
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/utils/clock"
)

// kindMissTTL is how long a kind the management cluster does not serve is
// taken as not served before discovery is asked again.
const kindMissTTL = time.Minute

// kindMisses remembers, for kindMissTTL, the infrastructure kinds the
// management cluster does not serve. A Machine's infrastructureRef is the
// tenant's to write: a kind nobody serves would otherwise send every
// decision for that Machine to discovery, and the manager's RESTMapper
// rediscovers under one lock, which holds every other cluster's decisions
// behind it. A kind installed meanwhile is found once its miss expires.
type kindMisses struct {
	meta.RESTMapper
	clock clock.PassiveClock

	mu     sync.Mutex
	misses map[schema.GroupKind]time.Time
}

func newKindMisses(m meta.RESTMapper, clk clock.PassiveClock) *kindMisses {
	return &kindMisses{RESTMapper: m, clock: clk, misses: map[schema.GroupKind]time.Time{}}
}

// RESTMapping answers a recent miss without discovery.
func (k *kindMisses) RESTMapping(gk schema.GroupKind, versions ...string) (*meta.RESTMapping, error) {
	k.mu.Lock()
	at, missed := k.misses[gk]
	if missed && k.clock.Now().Sub(at) >= kindMissTTL {
		delete(k.misses, gk)
		missed = false
	}
	k.mu.Unlock()
	if missed {
		return nil, &meta.NoKindMatchError{GroupKind: gk, SearchedVersions: versions}
	}
	mapping, err := k.RESTMapper.RESTMapping(gk, versions...)
	if meta.IsNoMatchError(err) {
		k.mu.Lock()
		k.misses[gk] = k.clock.Now()
		k.mu.Unlock()
	}
	return mapping, err
}
