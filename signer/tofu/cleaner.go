package tofu

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// DefaultSweepPeriod is how often Cleaner looks for records whose Machine
// is gone without its deletion having been seen.
const DefaultSweepPeriod = 10 * time.Minute

// Cleaner removes the records of deleted Machines: at once when the
// manager's Machine informer reports a deletion, and by a sweep of every
// record when it starts (deletions while no leader ran) and every
// SweepPeriod. It runs on the leader only. Records are removed when the
// Machine object is gone, not when its deletion starts: a draining Machine's
// node still renews.
type Cleaner struct {
	Store *Store
	// Machines is where a sweep looks Machines up first (the manager's
	// cache, set by SetupWithManager); nil means the Store's Reader only.
	Machines client.Reader
	// SweepPeriod; 0 means DefaultSweepPeriod.
	SweepPeriod time.Duration
	// Deleted, when set, is also called with every Machine the informer
	// reports deleted (revocation of its node name, signer/capi), so that
	// one hook reacts to Machine deletions.
	Deleted func(machine client.Object)

	queue workqueue.TypedRateLimitingInterface[types.UID]
}

// SetupWithManager watches Machine deletions through mgr's cache and adds
// the Cleaner to mgr.
func (c *Cleaner) SetupWithManager(ctx context.Context, mgr ctrl.Manager) error {
	if c.Store == nil || c.Store.Namespace == "" {
		return fmt.Errorf("trust-on-first-use cleaner: no store namespace")
	}
	c.newQueue()
	c.Machines = mgr.GetCache()
	informer, err := mgr.GetCache().GetInformer(ctx, &clusterv1.Machine{})
	if err != nil {
		return fmt.Errorf("unable to watch Machines: %w", err)
	}
	if _, err := informer.AddEventHandler(toolscache.ResourceEventHandlerFuncs{DeleteFunc: c.deleted}); err != nil {
		return fmt.Errorf("unable to watch Machine deletions: %w", err)
	}
	return mgr.Add(c)
}

func (c *Cleaner) newQueue() {
	c.queue = workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[types.UID](),
		workqueue.TypedRateLimitingQueueConfig[types.UID]{Name: "tofu-cleaner"})
}

func (c *Cleaner) deleted(obj any) {
	if t, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	if o, ok := obj.(client.Object); ok && o.GetUID() != "" {
		c.queue.Add(o.GetUID())
		if c.Deleted != nil {
			c.Deleted(o)
		}
	}
}

// NeedLeaderElection implements manager.LeaderElectionRunnable.
func (c *Cleaner) NeedLeaderElection() bool { return true }

// Start implements manager.Runnable. A Cleaner added to a manager without
// SetupWithManager (standalone mode, whose owners are allowlist entries)
// only sweeps.
func (c *Cleaner) Start(ctx context.Context) error {
	if c.queue == nil {
		c.newQueue()
	}
	logger := klog.FromContext(ctx).WithName("tofu-cleaner")
	go func() {
		<-ctx.Done()
		c.queue.ShutDown()
	}()
	go func() {
		t := time.NewTicker(cmp.Or(c.SweepPeriod, DefaultSweepPeriod))
		defer t.Stop()
		for {
			removed, err := c.Store.Sweep(ctx, c.Machines)
			if len(removed) > 0 {
				logger.Info("Removed the trust-on-first-use records of deleted Machines", "records", removed)
			}
			if err != nil && ctx.Err() == nil {
				logger.Error(err, "Trust-on-first-use sweep incomplete; next one in a period")
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	for {
		uid, shutdown := c.queue.Get()
		if shutdown {
			return nil
		}
		if err := c.Store.Forget(ctx, uid); err != nil && ctx.Err() == nil {
			logger.Error(err, "Unable to remove a deleted Machine's trust-on-first-use records, will retry", "machineUID", uid)
			c.queue.AddRateLimited(uid)
		} else {
			c.queue.Forget(uid)
		}
		c.queue.Done(uid)
	}
}
