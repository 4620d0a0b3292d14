package capi

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"

	"sigs.k8s.io/kubelet-authenticator/signer/scoped"
)

// Reasons of the Events on a Cluster about the controller's own identity
// in its workload cluster (package scoped).
const (
	// ReasonScopedIdentityFailed (Warning): installing the identity or
	// getting a token for it failed; it is retried with backoff, and no
	// steady-state work is done with the admin credential meanwhile.
	ReasonScopedIdentityFailed = "ScopedIdentityFailed"
	// ReasonScopedIdentityReinstalled (Warning): the controller's
	// ServiceAccount had been deleted from the workload cluster and was
	// installed again.
	ReasonScopedIdentityReinstalled = "ScopedIdentityReinstalled"
	// ReasonScopedIdentityNotInstalled (Normal): the kubeconfig's user may
	// not request tokens (it is not an admin), so the controller works as
	// that user, as given.
	ReasonScopedIdentityNotInstalled = "ScopedIdentityNotInstalled"
)

// IdentityMetrics counts what keeping its identity in each workload
// cluster costs the controller. Package app implements it.
type IdentityMetrics interface {
	// TokenRenewed counts a token renewed for cluster.
	TokenRenewed(cluster string)
	// IdentityFailed counts a failed step (scoped.StepCheck, StepInstall,
	// StepToken) for cluster.
	IdentityFailed(cluster, step string)
}

// connect installs the controller's identity in the workload cluster
// (package scoped), retrying with backoff and reporting each failure (log,
// Event, metric), until it succeeds or ctx is done; it reports whether it
// succeeded. A credential that may not request tokens is no admin: the
// clients then work as that credential, as given, and it says so.
func (r *ClusterReconciler) connect(ctx context.Context, logger klog.Logger, cluster *clusterv1.Cluster, id *scoped.Identity, obs *identityObserver) bool {
	retry := time.Second
	for {
		err := id.Connect(ctx)
		if ctx.Err() != nil {
			return false
		}
		switch {
		case err == nil:
			obs.st.update(func(s *ClusterStatus) { s.ScopedIdentity, s.TokenExpiry, s.IdentityError = true, id.Expiry(), "" })
			obs.shortReported.Store(false)
			logger.Info("Installed the controller's identity in the workload cluster: working through its tokens", "serviceAccount", id.ServiceAccount(), "tokenExpires",
				id.Expiry())
			return true
		case errors.Is(err, scoped.ErrNotAdmin):
			obs.st.update(func(s *ClusterStatus) { s.ScopedIdentity, s.IdentityError = false, "" })
			logger.Info("The workload kubeconfig's user may not request tokens for the controller's ServiceAccount, so it is not an admin: " +
				"working as that user, as given; it needs deploy/workload's rules")
			r.clusterEvent(cluster, corev1.EventTypeNormal, ReasonScopedIdentityNotInstalled,
				"The user of Secret %s may not request tokens for the controller's ServiceAccount: "+
					"the controller works as that user, which needs the rules of deploy/workload",
				cluster.Name+KubeconfigSecretSuffix)
			return true
		}
		if boundsExceeded(err) {
			// The workload is stopped and connected to again later
			// (bounds.go): no retry here.
			obs.st.update(func(s *ClusterStatus) { s.IdentityError = err.Error() })
			return false
		}
		step := scoped.StepInstall
		var e *scoped.Error
		if errors.As(err, &e) {
			step = e.Step
		}
		wait := retry
		if errors.Is(err, scoped.ErrShortLifetime) {
			// The server's error, not a blip: no sooner than a renewal
			// would be.
			wait = max(wait, scoped.MinRenewInterval)
		}
		obs.Failed(step, err, wait)
		select {
		case <-ctx.Done():
			return false
		case <-time.After(wait):
		}
		retry = min(2*retry, time.Minute)
	}
}

// identityObserver reports what one workload cluster's Identity does: in
// its status, metrics, log and Events on the Cluster. It implements
// scoped.Observer.
type identityObserver struct {
	r       *ClusterReconciler
	logger  klog.Logger
	cluster *clusterv1.Cluster
	st      *state
	// shortReported: a token refused as too short-lived has been reported
	// by an Event since the last good one; the server's setting does not
	// change by the minute, so it is reported once.
	shortReported atomic.Bool
}

// Renewed implements scoped.Observer.
func (o *identityObserver) Renewed(expiry time.Time, rejected, reinstalled bool) {
	o.st.update(func(s *ClusterStatus) {
		s.TokenExpiry, s.TokenRenewals, s.IdentityError = expiry, s.TokenRenewals+1, ""
	})
	o.shortReported.Store(false)
	if m := o.r.IdentityMetrics; m != nil {
		m.TokenRenewed(o.name())
	}
	if reinstalled {
		o.logger.Info("The controller's ServiceAccount had been deleted from the workload cluster: installed it again", "tokenExpires", expiry)
		o.r.clusterEvent(o.cluster, corev1.EventTypeWarning, ReasonScopedIdentityReinstalled,
			"The controller's ServiceAccount had been deleted from the workload cluster; installed it again with the admin credential")
	} else if rejected {
		o.logger.Info("The workload API server rejected the controller's token: renewed it", "tokenExpires", expiry)
	} else {
		o.logger.V(2).Info("Renewed the controller's token", "tokenExpires", expiry)
	}
}

// Failed implements scoped.Observer.
func (o *identityObserver) Failed(step string, err error, retry time.Duration) {
	o.st.update(func(s *ClusterStatus) { s.IdentityError = err.Error() })
	if m := o.r.IdentityMetrics; m != nil {
		m.IdentityFailed(o.name(), step)
	}
	o.logger.Info("Unable to keep the controller's identity in the workload cluster, will retry", "step", step, "err", err.Error(), "retryIn", retry)
	if errors.Is(err, scoped.ErrShortLifetime) && o.shortReported.Swap(true) {
		return
	}
	o.r.clusterEvent(o.cluster, corev1.EventTypeWarning, ReasonScopedIdentityFailed,
		"Unable to %s the controller's identity in the workload cluster (retried; nothing else is done with the admin credential meanwhile): %v", stepVerb(step), err)
}

func (o *identityObserver) name() string { return o.cluster.Namespace + "/" + o.cluster.Name }

func stepVerb(step string) string {
	switch step {
	case scoped.StepCheck:
		return "check the credential for"
	case scoped.StepToken:
		return "get a token for"
	default:
		return "install"
	}
}

// clusterEvent records an Event on cluster, when r records Events.
func (r *ClusterReconciler) clusterEvent(cluster *clusterv1.Cluster, typ, reason, format string, args ...any) {
	if r.Events == nil {
		return
	}
	ref := &corev1.ObjectReference{APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Namespace: cluster.Namespace, Name: cluster.Name,
		UID: cluster.UID}
	r.Events.Eventf(ref, typ, reason, format, args...)
}
