package capi

import (
	"cmp"
	"context"

	"k8s.io/klog/v2"

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
func (r *ClusterReconciler) unlock(ctx context.Context, logger klog.Logger, cs lockdown.Client, st *state) {
	periodic.Every(ctx, cmp.Or(r.LockdownPeriod, DefaultLockdownPeriod), func(ctx context.Context) bool {
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
