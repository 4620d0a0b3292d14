package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/KimMachineGun/automemlimit/memlimit"
	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"k8s.io/klog/v2"

	"sigs.k8s.io/kubelet-authenticator/signer/bounds"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
)

// boundsOptions bound what each workload cluster (tenant input) can make
// the controller hold or wait for (packages bounds and capi).
type boundsOptions struct {
	WorkloadMaxResponseBytes  int64
	WorkloadMaxEventBytes     int64
	WorkloadRequestTimeout    time.Duration
	WorkloadWatchIdleTimeout  time.Duration
	WorkloadMaxCachedCSRs     int
	WorkloadMaxCachedCSRBytes int64
	// WorkloadBoundsRetry is the first wait before a cluster that
	// exceeded a bound is connected to again (doubling to 10m).
	WorkloadBoundsRetry time.Duration
}

func defaultBoundsOptions() boundsOptions {
	l := bounds.Limits{}.Complete()
	return boundsOptions{
		WorkloadMaxResponseBytes: l.MaxResponseBytes, WorkloadMaxEventBytes: l.MaxEventBytes,
		WorkloadRequestTimeout: l.RequestTimeout, WorkloadWatchIdleTimeout: l.WatchIdleTimeout,
		WorkloadMaxCachedCSRs: capi.DefaultMaxCachedCSRs, WorkloadMaxCachedCSRBytes: capi.DefaultMaxCachedCSRBytes,
		WorkloadBoundsRetry: capi.DefaultBoundsRetry,
	}
}

func (o *boundsOptions) addFlags(fs *pflag.FlagSet) {
	fs.Int64Var(&o.WorkloadMaxResponseBytes, "workload-max-response-bytes", o.WorkloadMaxResponseBytes,
		"Largest answer read from a workload API server (a page of a list is one answer); "+
			"a larger one marks the cluster unhealthy (WorkloadBoundsExceeded) and it is connected to again later.")
	fs.Int64Var(&o.WorkloadMaxEventBytes, "workload-max-event-bytes", o.WorkloadMaxEventBytes,
		"Largest watch event read from a workload API server; a larger one marks the cluster unhealthy.")
	fs.DurationVar(&o.WorkloadRequestTimeout, "workload-request-timeout", o.WorkloadRequestTimeout,
		"Longest a request to a workload API server may take, from sending it to the end of its answer, and a watch event from its first byte to its last; "+
			"a slower one marks the cluster unhealthy.")
	fs.DurationVar(&o.WorkloadWatchIdleTimeout, "workload-watch-idle-timeout", o.WorkloadWatchIdleTimeout,
		"Longest a watch of a workload API server may go without a complete event (an API server ends a watch within 10m); a longer one marks the cluster unhealthy.")
	fs.IntVar(&o.WorkloadMaxCachedCSRs, "workload-max-cached-csrs", o.WorkloadMaxCachedCSRs,
		"Most CSRs of the controller's signer names cached per workload cluster; reaching it marks the cluster unhealthy instead of growing.")
	fs.Int64Var(&o.WorkloadMaxCachedCSRBytes, "workload-max-cached-csr-bytes", o.WorkloadMaxCachedCSRBytes,
		"Most bytes of CSRs cached per workload cluster; reaching it marks the cluster unhealthy instead of growing.")
	fs.DurationVar(&o.WorkloadBoundsRetry, "workload-bounds-retry", o.WorkloadBoundsRetry,
		"How soon a workload cluster that exceeded a bound is connected to again; doubled, up to 10m, each time it exceeds one again.")
}

func (o *boundsOptions) validate() []error {
	var errs []error
	if o.WorkloadMaxResponseBytes < 64<<10 || o.WorkloadMaxEventBytes < 64<<10 {
		errs = append(errs, fmt.Errorf("--workload-max-response-bytes (%d) and --workload-max-event-bytes (%d) must be at least 65536", o.WorkloadMaxResponseBytes,
			o.WorkloadMaxEventBytes))
	}
	if o.WorkloadRequestTimeout < time.Second || o.WorkloadWatchIdleTimeout < time.Second || o.WorkloadBoundsRetry < time.Second {
		errs = append(errs, fmt.Errorf("--workload-request-timeout (%s), --workload-watch-idle-timeout (%s) and --workload-bounds-retry (%s) must be at least 1s",
			o.WorkloadRequestTimeout, o.WorkloadWatchIdleTimeout, o.WorkloadBoundsRetry))
	}
	if o.WorkloadMaxCachedCSRs < 1 || o.WorkloadMaxCachedCSRBytes < 1 {
		errs = append(errs, fmt.Errorf("--workload-max-cached-csrs (%d) and --workload-max-cached-csr-bytes (%d) must be positive", o.WorkloadMaxCachedCSRs,
			o.WorkloadMaxCachedCSRBytes))
	}
	return errs
}

// configure applies the options to r and registers the bounds counter
// with reg.
func (o *boundsOptions) configure(r *capi.ClusterReconciler, reg prometheus.Registerer) error {
	r.Limits = bounds.Limits{MaxResponseBytes: o.WorkloadMaxResponseBytes, MaxEventBytes: o.WorkloadMaxEventBytes,
		RequestTimeout: o.WorkloadRequestTimeout, WatchIdleTimeout: o.WorkloadWatchIdleTimeout}
	r.MaxCachedCSRs, r.MaxCachedCSRBytes = o.WorkloadMaxCachedCSRs, o.WorkloadMaxCachedCSRBytes
	r.BoundsRetry = o.WorkloadBoundsRetry
	r.MaxBoundsRetry = max(capi.DefaultMaxBoundsRetry, o.WorkloadBoundsRetry)
	m, err := registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "kubelet_authenticator",
		Subsystem: "signer",
		Name:      "workload_bounds_exceeded_total",
		Help: "Times a workload cluster exceeded a bound of the controller (an answer, a watch event or the CSR cache too large, " +
			"a request or a watch too slow), by workload cluster and bound; each stops serving the cluster until it is connected to again.",
	}, []string{"cluster", "limit"}))
	if err != nil {
		return err
	}
	r.BoundsMetrics = boundsMetrics{m}
	return nil
}

// boundsMetrics implements capi.BoundsMetrics.
type boundsMetrics struct{ exceeded *prometheus.CounterVec }

// BoundExceeded implements capi.BoundsMetrics.
func (m boundsMetrics) BoundExceeded(cluster, limit string) {
	m.exceeded.WithLabelValues(cluster, limit).Inc()
}

// setMemoryLimit sets the Go runtime's soft memory limit to 90% of the
// container's cgroup memory limit (github.com/KimMachineGun/automemlimit),
// and follows it when the container is resized: the garbage collector
// then works harder as the process nears the limit instead of letting the
// kernel kill it. GOMEMLIMIT, when set, wins; AUTOMEMLIMIT=off turns it
// off, AUTOMEMLIMIT=<ratio> changes the share.
func setMemoryLimit(ctx context.Context) {
	logger := klog.FromContext(ctx)
	limit, err := memlimit.Set(
		memlimit.WithRefreshInterval(ctx, time.Minute),
		memlimit.WithLogger(slog.New(logr.ToSlogHandler(logger.V(2)))),
	)
	switch {
	case err != nil && !errors.Is(err, memlimit.ErrNoLimit):
		logger.Info("Unable to set the Go memory limit from the container's", "err", err.Error())
	case limit <= 0 || limit == math.MaxInt64:
		logger.Info("No memory limit: the container has none, and GOMEMLIMIT is not set")
	default:
		logger.Info("Go memory limit set", "bytes", limit)
	}
}
