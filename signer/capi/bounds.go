package capi

import (
	"errors"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/event"

	"sigs.k8s.io/kubelet-authenticator/signer/bounds"
)

// Defaults of the bounds of each workload cluster (package bounds holds
// those of a single request).
const (
	// DefaultMaxCachedCSRs and DefaultMaxCachedCSRBytes are the budget of
	// CSRs the controller caches for one workload cluster: far more than
	// a bootstrap storm of a few thousand nodes leaves pending (a pending
	// request is cached with at most attestor.MaxRequestSize of its
	// spec.request, a decided one without).
	DefaultMaxCachedCSRs     = 20000
	DefaultMaxCachedCSRBytes = 256 << 20
	// DefaultBoundsRetry and DefaultMaxBoundsRetry bound the backoff of a
	// cluster that exceeded a bound: it is connected to again after
	// DefaultBoundsRetry, doubling to DefaultMaxBoundsRetry while it goes
	// on exceeding them.
	DefaultBoundsRetry    = 30 * time.Second
	DefaultMaxBoundsRetry = 10 * time.Minute
)

// ReasonWorkloadBoundsExceeded is the reason of the Warning Event on a
// Cluster whose workload API server exceeded a bound of the controller
// (package bounds), and of its ClusterAttestation's Ready condition while
// it waits to be connected to again.
const ReasonWorkloadBoundsExceeded = "WorkloadBoundsExceeded"

// ConditionWorkloadWithinBounds is false while a Cluster waits to be
// connected to again after its workload API server exceeded a bound; its
// reason names the bound (bounds.LimitResponseSize, ...).
const ConditionWorkloadWithinBounds = "WorkloadWithinBounds"

// BoundsMetrics counts the workload clusters that exceed a bound. Package
// app implements it.
type BoundsMetrics interface {
	// BoundExceeded counts cluster exceeding limit (bounds.LimitResponseSize, ...).
	BoundExceeded(cluster, limit string)
}

// boundsBackoff is a Cluster over bounds: when it is connected to again,
// and what it exceeded.
type boundsBackoff struct {
	until time.Time
	retry time.Duration
	err   *bounds.ExceededError
}

// overBounds reports a workload's bound exceeded to the reconciler, once
// per workload: its controller is then stopped (everything it cached
// goes) and started again after a backoff.
type overBounds struct {
	r       *ClusterReconciler
	logger  klog.Logger
	cluster *clusterv1.Cluster
	once    sync.Once
	mu      sync.Mutex
	w       *workload // nil until the workload runs
	early   *bounds.ExceededError
}

// exceeded implements the callback of bounds.Limits.Wrap and of the CSR
// controller's cache budget.
func (o *overBounds) exceeded(err *bounds.ExceededError) {
	o.mu.Lock()
	w := o.w
	if w == nil {
		o.early = err
	}
	o.mu.Unlock()
	if w != nil {
		o.once.Do(func() { go o.r.exceeded(o.logger, o.cluster, w, err) })
	}
}

// running is called once w runs: a bound exceeded before is reported now.
func (o *overBounds) running(w *workload) {
	o.mu.Lock()
	o.w = w
	err := o.early
	o.mu.Unlock()
	if err != nil {
		o.exceeded(err)
	}
}

// budgetExceeded is the controller.Config.OverBudget of a workload.
func (o *overBounds) budgetExceeded(objects int, bytes int64) {
	limit, bound := bounds.LimitCachedCSRs, fmt.Sprintf("%d CSRs", o.r.maxCachedCSRs())
	if objects < o.r.maxCachedCSRs() {
		limit, bound = bounds.LimitCachedBytes, fmt.Sprintf("%d bytes", o.r.maxCachedCSRBytes())
	}
	o.exceeded(&bounds.ExceededError{Limit: limit, Bound: bound})
}

func (r *ClusterReconciler) maxCachedCSRs() int {
	if r.MaxCachedCSRs > 0 {
		return r.MaxCachedCSRs
	}
	return DefaultMaxCachedCSRs
}

func (r *ClusterReconciler) maxCachedCSRBytes() int64 {
	if r.MaxCachedCSRBytes > 0 {
		return r.MaxCachedCSRBytes
	}
	return DefaultMaxCachedCSRBytes
}

// reasonBounds is why a workload's controller is stopped when its cluster
// exceeded a bound.
const reasonBounds = "workload cluster exceeded a bound"

// exceeded stops w, the workload of cluster, which exceeded a bound, and
// has the Cluster reconciled again after a backoff; it says so (log,
// Event, metric, ClusterAttestation).
func (r *ClusterReconciler) exceeded(logger klog.Logger, cluster *clusterv1.Cluster, w *workload, err *bounds.ExceededError) {
	nn := types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name}
	minRetry, maxRetry := r.BoundsRetry, r.MaxBoundsRetry
	if minRetry <= 0 {
		minRetry = DefaultBoundsRetry
	}
	if maxRetry <= 0 {
		maxRetry = DefaultMaxBoundsRetry
	}
	r.mu.Lock()
	if r.running[nn] != w { // stopped or replaced meanwhile
		r.mu.Unlock()
		return
	}
	retry := minRetry
	// A cluster that stayed within bounds longer than the longest backoff
	// starts over.
	if b := r.backoff[nn]; b != nil && time.Since(w.started) < maxRetry {
		retry = min(2*b.retry, maxRetry)
	}
	b := &boundsBackoff{until: time.Now().Add(retry), retry: retry, err: err}
	r.backoff[nn] = b
	r.idle[nn] = r.boundsIdle(cluster, b)
	r.mu.Unlock()

	logger.Info("The workload API server exceeded a bound of the controller: stopped serving the cluster, will connect again later",
		"limit", err.Limit, "bound", err.Bound, "request", err.Request, "retryIn", retry)
	r.clusterEvent(cluster, corev1.EventTypeWarning, ReasonWorkloadBoundsExceeded,
		"%v; nothing it sent is kept, and it is connected to again in %s", err, retry)
	if r.BoundsMetrics != nil {
		r.BoundsMetrics.BoundExceeded(nn.String(), err.Limit)
	}
	r.stop(logger, nn, reasonBounds)
	time.AfterFunc(retry, func() {
		select {
		case r.wake <- event.GenericEvent{Object: cluster}:
		case <-r.base.Done():
		}
	})
}

// boundsIdle is what a Cluster's ClusterAttestation says while it waits
// to be connected to again.
func (r *ClusterReconciler) boundsIdle(cluster *clusterv1.Cluster, b *boundsBackoff) idleCluster {
	return idleCluster{uid: cluster.UID, generation: cluster.Generation, optedIn: true, reason: ReasonWorkloadBoundsExceeded,
		message: fmt.Sprintf("%v; connected to again at %s", b.err, b.until.UTC().Format(time.RFC3339)), bound: b.err.Limit}
}

// inBackoff returns how long cluster still waits to be connected to again
// after exceeding a bound (0: it does not), and records why it is idle.
func (r *ClusterReconciler) inBackoff(cluster *clusterv1.Cluster) time.Duration {
	nn := types.NamespacedName{Namespace: cluster.Namespace, Name: cluster.Name}
	r.mu.Lock()
	defer r.mu.Unlock()
	b := r.backoff[nn]
	if b == nil {
		return 0
	}
	d := time.Until(b.until)
	if d <= 0 {
		return 0
	}
	r.idle[nn] = r.boundsIdle(cluster, b)
	return d
}

// boundsExceeded reports whether err is a bound exceeded.
func boundsExceeded(err error) bool {
	var e *bounds.ExceededError
	return errors.As(err, &e)
}
