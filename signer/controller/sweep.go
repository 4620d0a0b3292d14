package controller

import (
	"context"

	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
)

// sweep lists the CSRs of the signer names the controller does not watch:
// those of attestors the Cluster does not authorize, and refused ones
// (engine.Profile.Serves). Every request to them is denied, so a watch
// each, open for every workload cluster, would cost far more than they
// are worth; a list every SweepPeriod finds them (and, as any request, a
// denial names why). A list that fails is tried again next time.
func (c *Controller) sweep(ctx context.Context) bool {
	logger := klog.FromContext(ctx)
	for _, signer := range c.swept {
		if err := c.sweepOne(ctx, signer); err != nil && ctx.Err() == nil {
			logger.Info("Unable to list the requests of a signer name not served, will list again", "signer", signer,
				"in", c.cfg.SweepPeriod.String(), "err", err.Error())
		}
	}
	return true
}

// sweepOne lists the CSRs of signer into its store, page by page, and no
// more of them than the cache budget allows.
func (c *Controller) sweepOne(ctx context.Context, signer string) error {
	list := listFunc(c.cfg.Client, signer, c.cfg.ListPageSize)
	var items []any
	opts := metav1.ListOptions{}
	for {
		obj, err := list(ctx, opts)
		if err != nil {
			return err
		}
		page, ok := obj.(*certificatesv1.CertificateSigningRequestList)
		if !ok {
			return nil
		}
		for i := range page.Items {
			csr := page.Items[i] // not a pointer into the page: it is not kept
			items = append(items, &csr)
		}
		if page.Continue == "" || (c.cfg.MaxCachedCSRs > 0 && len(items) >= c.cfg.MaxCachedCSRs) {
			return c.stores[signer].Replace(items, page.ResourceVersion)
		}
		opts.Continue = page.Continue
	}
}
