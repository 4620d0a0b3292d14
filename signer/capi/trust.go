package capi

import (
	"context"
	"crypto/x509"
	"slices"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/signer/trust"
)

func (r *ClusterReconciler) now() time.Time {
	return r.clock().Now()
}

// clock returns the reconciler's clock, the real one when none is set.
func (r *ClusterReconciler) clock() clock.PassiveClock {
	if r.Clock == nil {
		return clock.RealClock{}
	}
	return r.Clock
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

// newPublisher returns the publisher of a workload cluster's CAs for the
// Cluster of UID owner (trust.Publisher.Owner).
func newPublisher(cfg *rest.Config, signerNames []string, owner types.UID) (*trust.Publisher, error) {
	pub, err := trust.NewPublisher(cfg, signerNames)
	if err != nil {
		return nil, err
	}
	pub.Owner = string(owner)
	return pub, nil
}

// keepPublished keeps cas published in the workload cluster (Publisher.Keep)
// and reports each outcome in the cluster's status.
func keepPublished(ctx context.Context, pub *trust.Publisher, cas []*x509.Certificate, st *state, period time.Duration, first chan<- struct{}) {
	pub.Keep(ctx, cas, period, first, func(err error) {
		st.update(func(s *ClusterStatus) {
			s.TrustBundlesPublished = err == nil
			s.TrustBundleError = ""
			if err != nil {
				s.TrustBundleError = err.Error()
			}
		})
	})
}
