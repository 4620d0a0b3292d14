package capi

import (
	"context"
	"crypto/x509"
	"slices"
	"time"

	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/trust"
)

// publishTimeout bounds one publication of a cluster's serving CAs, so that
// an unreachable workload cluster does not hold up its CSR controller long.
const publishTimeout = 10 * time.Second

func (r *ClusterReconciler) now() time.Time {
	if r.Clock == nil {
		return time.Now()
	}
	return r.Clock.Now()
}

// servingSignerNames returns the attested serving signer names of the
// providers the Cluster authorizes and the signer knows: the names its
// serving CAs are published for.
func (r *ClusterReconciler) servingSignerNames(authorized []string) []string {
	var out []string
	for _, p := range authorized {
		if _, ok := r.Verifiers[p]; ok {
			out = append(out, attestor.ServingSignerName(p))
		}
	}
	slices.Sort(out)
	return out
}

// newPublisher returns the publisher of a workload cluster's serving CAs.
func newPublisher(cfg *rest.Config, signerNames []string) (*trust.Publisher, error) {
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &trust.Publisher{Client: dyn, Discovery: dc, SignerNames: signerNames}, nil
}

// keepPublished publishes cas in the workload cluster, then again every
// period (repairing what someone else changed), sooner after a failure,
// until ctx is done. first is closed after the first attempt, failed or
// not: the CSR controller starts then, so that a new CA signs only once it
// is published, while a cluster without the ClusterTrustBundle API still
// gets its certificates.
func keepPublished(ctx context.Context, pub *trust.Publisher, cas []*x509.Certificate, st *state, period time.Duration, first chan<- struct{}) {
	retry := time.Second
	for {
		pctx, cancel := context.WithTimeout(ctx, publishTimeout)
		err := pub.Publish(pctx, cas)
		cancel()
		if ctx.Err() != nil {
			return
		}
		st.update(func(s *ClusterStatus) {
			s.TrustBundlesPublished = err == nil
			s.TrustBundleError = ""
			if err != nil {
				s.TrustBundleError = err.Error()
			}
		})
		if first != nil {
			close(first)
			first = nil
		}
		next := period
		if err != nil {
			next, retry = min(retry, period), min(2*retry, period)
		} else {
			retry = time.Second
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(next):
		}
	}
}
