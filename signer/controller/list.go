package controller

import (
	"context"
	"fmt"
	"sync"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// newInformer returns the informer of the CSRs of one signer name: the API
// server filters both its list and its watch by spec.signerName, so other
// signers' requests are never sent to (or held by) this controller.
//
// Its lists are paged (pageSize, 0: unpaged). A relist at the last
// resource version the informer saw (which the reflector does after its
// watch was refused as too old, say when the API server's watch cache was
// re-initialised) asks for a state at least that new: with a limit and no
// match, the API server would answer the exact, old state, whose watch
// is refused again, and the informer would never see a newer request. A
// continuation page that expired fails the list (the informer lists again
// from the start) rather than letting client-go fall back to one unpaged
// list.
//
// It never streams its initial list as a watch (client-go's WatchList):
// that stream is held in a store of the reflector's own until it ends,
// which neither the cache budget nor a page's size bounds.
func newInformer(client kubernetes.Interface, signer string, pageSize int64, resync time.Duration) cache.SharedIndexInformer {
	selector := fields.OneTermEqualSelector("spec.signerName", signer).String()
	csrs := client.CertificatesV1().CertificateSigningRequests()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
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
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = selector
			return csrs.Watch(ctx, o)
		},
	}
	return cache.NewSharedIndexInformerWithOptions(
		cache.ToListWatcherWithWatchListSemantics(lw, noWatchList{}),
		&certificatesv1.CertificateSigningRequest{},
		cache.SharedIndexInformerOptions{ResyncPeriod: resync, Indexers: cache.Indexers{}})
}

// noWatchList tells client-go's reflectors not to stream the initial list
// (watchlist.DoesClientNotSupportWatchListSemantics).
type noWatchList struct{}

func (noWatchList) IsWatchListSemanticsUnSupported() bool { return true }

// startInformers runs the controller's informers until ctx is done or the
// returned function is called; that function returns once they stopped.
func (c *Controller) startInformers(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, inf := range c.informers {
		wg.Go(func() { inf.RunWithContext(ctx) })
	}
	return func() {
		cancel()
		wg.Wait()
	}
}
