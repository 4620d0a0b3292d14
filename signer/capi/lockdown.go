package capi

import (
	"cmp"
	"context"

	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/signer/lockdown"
)

// AnnotationLockdown, "true" on an opted-in Cluster, makes the controller
// remove kubeadm's CSR auto-approve bindings from the workload cluster and
// keep them removed, so that only attested nodes get client certificates.
// Turning it off again does not restore them.
const AnnotationLockdown = "kubelet-authenticator.x-k8s.io/lockdown"

// Lockdown reports whether cluster asks for lockdown.
func Lockdown(cluster *clusterv1.Cluster) bool {
	return cluster.Annotations[AnnotationLockdown] == "true"
}

// lockdown enforces lockdown in one workload cluster until ctx is done.
func (r *ClusterReconciler) lockdown(ctx context.Context, logger klog.Logger, cs kubernetes.Interface, st *state) {
	lockdown.Run(ctx, cs, cmp.Or(r.LockdownPeriod, DefaultLockdownPeriod), func(removed []string, err error) {
		if ctx.Err() != nil {
			return
		}
		st.update(func(s *ClusterStatus) {
			s.LockdownRemoved += len(removed)
			s.LockdownError = ""
			if err != nil {
				s.LockdownError = err.Error()
			}
		})
		if len(removed) > 0 {
			logger.Info("Lockdown removed CSR auto-approve bindings", "clusterRoleBindings", removed)
		}
		if err != nil {
			logger.Info("Lockdown not enforced yet, will retry", "err", err.Error())
		}
	})
}
