package capi

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// LabelWatchFilter is Cluster API's label of the objects a controller
// started with --watch-filter=<value> serves.
const LabelWatchFilter = clusterv1.WatchLabel

// claimRetry is how soon a Cluster assigned to this replica whose claim
// another live replica still holds is looked at again.
const claimRetry = 2 * time.Second

// shardTimeout bounds the claim writes made while stopping.
const shardTimeout = 5 * time.Second

// filtered reports whether the Cluster is left to another controller by
// --watch-filter (Cluster API's convention: only Clusters labelled
// cluster.x-k8s.io/watch-filter=<value> are served).
func (r *ClusterReconciler) filtered(cluster *clusterv1.Cluster) bool {
	return r.WatchFilter != "" && cluster.Labels[LabelWatchFilter] != r.WatchFilter
}

// watchFilter is the predicate of --watch-filter on Cluster events.
func (r *ClusterReconciler) watchFilter() predicate.Predicate {
	return predicate.NewPredicateFuncs(func(o client.Object) bool {
		return r.WatchFilter == "" || o.GetLabels()[LabelWatchFilter] == r.WatchFilter
	})
}

// notAssigned stops serving a Cluster the ring assigns to another replica
// and releases its claim: the replica it is assigned to takes it then. It
// reports whether the Cluster is assigned elsewhere.
func (r *ClusterReconciler) notAssigned(ctx context.Context, logger klog.Logger, nn types.NamespacedName) (bool, error) {
	if r.Shards == nil || r.Shards.Mine(nn.String()) {
		return false, nil
	}
	r.stop(logger, nn, "assigned to replica "+r.Shards.Owner(nn.String()))
	r.setIdle(nn, nil) // its status is the new replica's to write
	return true, r.Shards.Release(ctx, nn.String())
}

// claim takes the Cluster's claim before serving it. It reports whether
// this replica holds it; when another live replica still does, the
// Cluster is looked at again shortly (that replica releases it once it
// sees the Cluster assigned elsewhere, or its membership expires).
//
// A claim this replica took and kept is known without a read (only this
// replica releases its claims, and it stops serving before any other can
// see its membership expire); after a break in its membership it reads the
// claim again, and stops serving a Cluster another replica took meanwhile.
func (r *ClusterReconciler) claim(ctx context.Context, logger klog.Logger, nn types.NamespacedName) (bool, reconcile.Result, error) {
	if r.Shards == nil {
		return true, reconcile.Result{}, nil
	}
	holder, err := r.Shards.Claim(ctx, nn.String())
	if err != nil {
		return false, reconcile.Result{}, err
	}
	if holder != r.Shards.Identity {
		r.stop(logger, nn, "served by replica "+holder)
		logger.V(2).Info("Waiting for the replica that serves the Cluster to hand it over", "servedBy", holder)
		r.setIdle(nn, nil)
		return false, reconcile.Result{RequeueAfter: claimRetry}, nil
	}
	return true, reconcile.Result{}, nil
}

// forget deletes the claim of a Cluster no replica serves (deleted,
// opted out) when it is assigned here.
func (r *ClusterReconciler) forget(ctx context.Context, nn types.NamespacedName) error {
	if r.Shards == nil {
		return nil
	}
	return r.Shards.Forget(ctx, nn.String())
}

// servedBy is the replica identity written in the status: this replica's
// when the Clusters are shared, empty otherwise.
func (r *ClusterReconciler) servedBy() string {
	if r.Shards == nil {
		return ""
	}
	return r.Shards.Identity
}

// reassign has every Cluster reconciled again: the ring's live members
// changed, so may every Cluster's assignment.
func (r *ClusterReconciler) reassign(ctx context.Context) {
	var list clusterv1.ClusterList
	if err := r.Client.List(ctx, &list); err != nil {
		klog.FromContext(ctx).Info("Unable to list the Clusters after the shard members changed, will retry at the next change", "err", err.Error())
		return
	}
	for i := range list.Items {
		select {
		case r.wake <- event.GenericEvent{Object: &list.Items[i]}:
		case <-ctx.Done():
			return
		}
	}
}

// leaveRing releases the claims this replica holds (its controllers are
// stopped) and deletes its membership Lease, so that its Clusters move at
// once rather than after the Lease expires.
func (r *ClusterReconciler) leaveRing(logger klog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), shardTimeout)
	defer cancel()
	if err := r.Shards.ReleaseAll(ctx); err != nil {
		logger.Info("Unable to release every claim: those Clusters move when this replica's membership expires", "err", err.Error())
	}
	if err := r.Shards.Leave(ctx); err != nil {
		logger.Info("Unable to leave the shard ring: its Clusters move when its membership expires", "err", err.Error())
	}
}

// servedMachineDeleted revokes a deleted Machine's node names when the
// Clusters are shared and its Cluster is assigned here. (The leader's
// trust-on-first-use cleaner records every deletion for the replica that
// serves the Cluster, see MachineDeleted; with a single active replica it
// is the only hook.)
func (r *ClusterReconciler) servedMachineDeleted(o client.Object) {
	if r.Shards == nil {
		return
	}
	name := o.GetLabels()[clusterv1.ClusterNameLabel]
	if name == "" || !r.Shards.Mine(types.NamespacedName{Namespace: o.GetNamespace(), Name: name}.String()) {
		return
	}
	r.MachineDeleted(o)
}
