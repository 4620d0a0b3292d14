package capi

import (
	"cmp"
	"context"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/signer/lockdown"
	"sigs.k8s.io/kubelet-authenticator/signer/periodic"
)

// lockdown enforces lockdown in one workload cluster until ctx is done,
// on a timer (it returns at once).
func (r *ClusterReconciler) lockdown(ctx context.Context, logger klog.Logger, cs lockdown.Client, st *state) {
	lockdown.Run(ctx, cs, cmp.Or(r.LockdownPeriod, DefaultLockdownPeriod), func(removed []string, err error) {
		if ctx.Err() != nil {
			return
		}
		st.update(func(s *ClusterStatus) {
			s.LockdownRemoved += len(removed)
			s.LockdownEnforced = err == nil
			s.LockdownError = ""
			if err != nil {
				s.LockdownError = err.Error()
			}
		})
		if len(removed) > 0 {
			logger.Info("Lockdown disarmed CSR auto-approve bindings", "clusterRoleBindings", removed)
		}
		if err != nil {
			logger.Info("Lockdown not enforced yet, will retry", "err", err.Error())
		}
	})
}

// unlock restores, once, what lockdown disarmed in a Cluster that no
// longer asks for it, retrying until it succeeds or ctx is done, on a
// timer (it returns at once).
//
// Restoring re-arms kube-controller-manager's approval of plain bootstrap
// requests, so it waits for a policy that says so. It is held while the
// policy authorizes no attestor (authorized false): that is a Cluster
// whose policy is missing, such as a Cluster moved by clusterctl without
// its ClusterAttestation, or being written, not one whose operator lifted
// lockdown. And it is held while the Cluster is paused: clusterctl move
// creates the Cluster, paused, before the objects that hold its policy.
func (r *ClusterReconciler) unlock(ctx context.Context, logger klog.Logger, cs lockdown.Client, st *state, nn types.NamespacedName, authorized bool) {
	if !authorized {
		const held = "the Cluster's policy authorizes no attestor"
		logger.Info("Lockdown not lifted: " + held)
		st.update(func(s *ClusterStatus) { s.LockdownHeld = held })
		return
	}
	loggedPause := false
	periodic.Every(ctx, cmp.Or(r.LockdownPeriod, DefaultLockdownPeriod), func(ctx context.Context) bool {
		var cluster clusterv1.Cluster
		if err := r.Client.Get(ctx, nn, &cluster); err != nil {
			if ctx.Err() != nil {
				return false
			}
			logger.Info("Lockdown not lifted yet, will retry", "err", err.Error())
			return true
		}
		if paused(&cluster) {
			const held = "the Cluster is paused"
			if !loggedPause {
				logger.Info("Lockdown not lifted while the Cluster is paused")
				loggedPause = true
			}
			st.update(func(s *ClusterStatus) { s.LockdownHeld = held })
			return true
		}
		st.update(func(s *ClusterStatus) { s.LockdownHeld = "" })
		restored, err := lockdown.Restore(ctx, cs)
		if ctx.Err() != nil {
			return false
		}
		if len(restored) > 0 {
			logger.Info("Lockdown lifted: restored CSR auto-approve bindings", "clusterRoleBindings", restored)
		}
		if err != nil {
			st.update(func(s *ClusterStatus) { s.LockdownError = err.Error() })
			logger.Info("Lockdown not lifted yet, will retry", "err", err.Error())
			return true
		}
		st.update(func(s *ClusterStatus) { s.LockdownEnforced, s.LockdownError = false, "" })
		return false // done: nothing more until the controller restarts
	})
}
