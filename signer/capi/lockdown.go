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
// requests, so each run reads the Cluster and its policy again (from the
// cache) and restores only when restoreHeld finds no reason to wait. The
// policy this controller was started with is not enough: an edit that
// unpauses the Cluster and takes its last authorized attestor away at once
// reaches this loop as an unpaused Cluster before the reconcile that
// replaces the controller.
func (r *ClusterReconciler) unlock(ctx context.Context, logger klog.Logger, cs lockdown.Client, st *state, nn types.NamespacedName) {
	var loggedHeld string
	periodic.Every(ctx, cmp.Or(r.LockdownPeriod, DefaultLockdownPeriod), func(ctx context.Context) bool {
		var cluster clusterv1.Cluster
		err := r.Client.Get(ctx, nn, &cluster)
		var policy ClusterPolicy
		if err == nil {
			policy, _, err = r.readPolicy(ctx, &cluster)
		}
		if err != nil {
			if ctx.Err() != nil {
				return false
			}
			logger.Info("Lockdown not lifted yet, will retry", "err", err.Error())
			return true
		}
		if held := restoreHeld(&cluster, policy); held != "" {
			if held != loggedHeld {
				logger.Info("Lockdown not lifted: " + held)
				loggedHeld = held
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

// restoreHeld says why what lockdown disarmed in cluster must not be
// restored under policy, or "" when it may be. It is held while the
// Cluster is paused (clusterctl move creates it paused, before the objects
// that hold its policy), while the policy asks for lockdown, and while it
// authorizes no attestor: that is a Cluster whose policy is missing (moved
// without its ClusterAttestation, or being written), not one whose
// operator lifted lockdown.
func restoreHeld(cluster *clusterv1.Cluster, policy ClusterPolicy) string {
	switch {
	case paused(cluster):
		return "the Cluster is paused"
	case policy.Lockdown:
		return "the Cluster's policy asks for lockdown"
	case len(policy.AuthorizedAttestors) == 0:
		return "the Cluster's policy authorizes no attestor"
	}
	return ""
}
