package capi

import (
	"context"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/signer/trust"
)

// ServingCASecretSuffix names `<cluster>-kubelet-serving-ca`, the serving
// CAs the controller keeps for a workload cluster, in the Cluster's
// namespace and owned by the Cluster: tls.crt and tls.key sign, and
// trust.SecretPreviousKey holds the older CAs still published (package
// trust).
const ServingCASecretSuffix = "-kubelet-serving-ca"

// ensureServingCA returns the cluster's serving CAs, making, rotating and
// dropping them as the reconciler's policy says (package trust). Changes
// are atomic: when two callers race, both end up with what was written
// first.
func (r *ClusterReconciler) ensureServingCA(ctx context.Context, cluster *clusterv1.Cluster) (*trust.Authority, error) {
	store := &trust.Store{Client: r.Client, Reader: r.APIReader, Clock: r.Clock, Policy: r.ServingCA, Metrics: r.TrustMetrics}
	return store.Ensure(ctx, trust.SecretRef{
		NamespacedName: types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name + ServingCASecretSuffix},
		Cluster:        cluster.Namespace + "/" + cluster.Name,
		Labels:         map[string]string{clusterv1.ClusterNameLabel: cluster.Name},
		OwnerReferences: []metav1.OwnerReference{{
			APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: cluster.Name, UID: cluster.UID,
		}},
	})
}
