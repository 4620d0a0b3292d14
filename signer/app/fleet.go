package app

import (
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"

	"sigs.k8s.io/kubelet-authenticator/signer/capi"
)

// fleetOptions are the settings of the per-workload-cluster loops.
type fleetOptions struct {
	// ProbePeriod is how often each workload API server is probed.
	ProbePeriod time.Duration
	// LockdownPeriod is how often lockdown is enforced again.
	LockdownPeriod time.Duration
}

func (o *fleetOptions) addFlags(fs *pflag.FlagSet) {
	if o.ProbePeriod == 0 {
		o.ProbePeriod = capi.DefaultProbePeriod
	}
	if o.LockdownPeriod == 0 {
		o.LockdownPeriod = capi.DefaultLockdownPeriod
	}
	fs.DurationVar(&o.ProbePeriod, "workload-probe-period", o.ProbePeriod, "How often each workload cluster's API server is probed (kubelet_authenticator_signer_workload_cluster_connected).")
	fs.DurationVar(&o.LockdownPeriod, "lockdown-period", o.LockdownPeriod,
		"How often, in Clusters annotated "+capi.AnnotationLockdown+"=true, kubeadm's CSR auto-approve bindings are removed again.")
}

func (o *fleetOptions) validate() []error {
	var errs []error
	if o.ProbePeriod != 0 && o.ProbePeriod < time.Second {
		errs = append(errs, fmt.Errorf("--workload-probe-period %s must be at least 1s", o.ProbePeriod))
	}
	if o.LockdownPeriod != 0 && o.LockdownPeriod < time.Second {
		errs = append(errs, fmt.Errorf("--lockdown-period %s must be at least 1s", o.LockdownPeriod))
	}
	return errs
}

// fleetCollector exports, at scrape time, the state of every workload
// cluster the controller serves; a Cluster that is deleted or opts out
// disappears from it.
type fleetCollector struct {
	statuses func() []capi.ClusterStatus

	connected, lastContact, synced, queue, lockdown, lockdownRemoved, generation *prometheus.Desc
}

func newFleetCollector(statuses func() []capi.ClusterStatus) *fleetCollector {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc("kubelet_authenticator_signer_"+name, help, []string{"cluster"}, nil)
	}
	return &fleetCollector{
		statuses:        statuses,
		connected:       d("workload_cluster_connected", "1 when the last probe of the workload cluster's API server succeeded, 0 otherwise."),
		lastContact:     d("workload_cluster_last_contact_timestamp_seconds", "When the workload cluster's API server last answered a probe (Unix seconds; 0: never)."),
		synced:          d("workload_cluster_synced", "1 once the CSR controller has listed the workload cluster's CSRs."),
		queue:           d("csr_queue_depth", "CSRs of the workload cluster waiting to be decided."),
		lockdown:        d("workload_cluster_lockdown", "1 when kubeadm's CSR auto-approve bindings are kept removed in the workload cluster."),
		lockdownRemoved: d("lockdown_bindings_removed", "Auto-approve ClusterRoleBindings removed from the workload cluster since its controller started."),
		generation:      d("workload_controller_generation", "How many CSR controllers were started for the Cluster (one more per kubeconfig, CA or setting change)."),
	}
}

// Describe implements prometheus.Collector.
func (c *fleetCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.connected, c.lastContact, c.synced, c.queue, c.lockdown, c.lockdownRemoved, c.generation} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *fleetCollector) Collect(ch chan<- prometheus.Metric) {
	b := func(v bool) float64 {
		if v {
			return 1
		}
		return 0
	}
	for _, s := range c.statuses() {
		cl := s.Cluster.String()
		var last float64
		if !s.LastContact.IsZero() {
			last = float64(s.LastContact.UnixNano()) / 1e9
		}
		ch <- prometheus.MustNewConstMetric(c.connected, prometheus.GaugeValue, b(s.Connected), cl)
		ch <- prometheus.MustNewConstMetric(c.lastContact, prometheus.GaugeValue, last, cl)
		ch <- prometheus.MustNewConstMetric(c.synced, prometheus.GaugeValue, b(s.Synced), cl)
		ch <- prometheus.MustNewConstMetric(c.queue, prometheus.GaugeValue, float64(s.QueueDepth), cl)
		ch <- prometheus.MustNewConstMetric(c.lockdown, prometheus.GaugeValue, b(s.Lockdown), cl)
		ch <- prometheus.MustNewConstMetric(c.lockdownRemoved, prometheus.CounterValue, float64(s.LockdownRemoved), cl)
		ch <- prometheus.MustNewConstMetric(c.generation, prometheus.GaugeValue, float64(s.Generation), cl)
	}
}

// statuser reports the status of the clusters served.
type statuser interface{ Statuses() []capi.ClusterStatus }

type statusesFunc func() []capi.ClusterStatus

func (f statusesFunc) Statuses() []capi.ClusterStatus { return f() }

// registerFleetMetrics registers the fleet collector of r with reg and
// returns a function that unregisters it.
func registerFleetMetrics(reg prometheus.Registerer, r statuser) (func(), error) {
	c := newFleetCollector(r.Statuses)
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) {
			return nil, fmt.Errorf("unable to register fleet metrics: %w", err)
		}
		// A previous Run in this process (tests) left its collector: replace it.
		reg.Unregister(are.ExistingCollector)
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("unable to register fleet metrics: %w", err)
		}
	}
	return func() { reg.Unregister(c) }, nil
}
