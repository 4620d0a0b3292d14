package controller

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"

	certificatesv1 "k8s.io/api/certificates/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"

	"sigs.k8s.io/kubelet-authenticator/signer/periodic"
)

// listFunc lists the CSRs of one signer name: the API server filters it
// by spec.signerName, so other signers' requests are never sent to (or
// held by) this controller.
//
// Its lists are paged (pageSize, 0: unpaged). A relist at the last
// resource version the reflector saw (which it does after its watch was
// refused as too old, say when the API server's watch cache was
// re-initialised) asks for a state at least that new: with a limit and no
// match, the API server would answer the exact, old state, whose watch is
// refused again, and the store would never see a newer request. A
// continuation page that expired fails the list (the reflector lists
// again from the start) rather than letting client-go fall back to one
// unpaged list.
func listFunc(client Client, signer string, pageSize int64) func(context.Context, metav1.ListOptions) (runtime.Object, error) {
	selector := fields.OneTermEqualSelector("spec.signerName", signer).String()
	csrs := client.CertificatesV1().CertificateSigningRequests()
	return func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
		o.FieldSelector = selector
		if pageSize > 0 {
			o.Limit = pageSize
			if o.Continue == "" && o.ResourceVersion != "" && o.ResourceVersion != "0" && o.ResourceVersionMatch == "" {
				o.ResourceVersionMatch = metav1.ResourceVersionMatchNotOlderThan
			}
		}
		list, err := csrs.List(ctx, o)
		if err != nil && o.Continue != "" && apierrors.IsResourceExpired(err) {
			return nil, fmt.Errorf("listing certificate signing requests anew: a page expired: %s", err.Error())
		}
		return list, err
	}
}

// newReflector returns the reflector that keeps store current with the
// CSRs of one signer name, listed by listFunc and watched with the same
// field selector.
//
// It never streams its initial list as a watch (client-go's WatchList):
// that stream is held in a store of the reflector's own until it ends,
// which neither the cache budget nor a page's size bounds.
func newReflector(client Client, signer string, pageSize int64, store *csrStore) *cache.Reflector {
	selector := fields.OneTermEqualSelector("spec.signerName", signer).String()
	csrs := client.CertificatesV1().CertificateSigningRequests()
	lw := &cache.ListWatch{
		ListWithContextFunc: listFunc(client, signer, pageSize),
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = selector
			return csrs.Watch(ctx, o)
		},
	}
	return cache.NewReflectorWithOptions(cache.ToListWatcherWithWatchListSemantics(lw, noWatchList{}),
		&certificatesv1.CertificateSigningRequest{}, store, cache.ReflectorOptions{Name: "csrs " + signer})
}

// noWatchList tells client-go's reflectors not to stream the initial list
// (watchlist.DoesClientNotSupportWatchListSemantics).
type noWatchList struct{}

func (noWatchList) IsWatchListSemanticsUnSupported() bool { return true }

// startCaches fills the stores until ctx is done or the returned function
// is called, which returns once nothing runs for them any more: a
// reflector per watched signer name; the others listed at once and every
// SweepPeriod (sweep.go); every pending request queued again every
// ResyncPeriod.
func (c *Controller) startCaches(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, signer := range c.watched {
		r := newReflector(c.cfg.Client, signer, c.cfg.ListPageSize, c.stores[signer])
		wg.Go(func() { r.RunWithContext(ctx) })
	}
	// Each controller lists at its own phase: the controllers of a fleet
	// started together do not list at the same moments.
	sweepEvery := c.cfg.SweepPeriod + rand.N(c.cfg.SweepPeriod/4+1)
	loops := []<-chan struct{}{
		periodic.Every(ctx, sweepEvery, c.sweep),
		periodic.Every(ctx, c.cfg.ResyncPeriod, func(context.Context) bool { c.Resync(); return true }),
	}
	return func() {
		cancel()
		wg.Wait()
		for _, done := range loops {
			<-done
		}
	}
}
