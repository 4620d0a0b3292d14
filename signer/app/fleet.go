package app

import (
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/controller"
	"sigs.k8s.io/kubelet-authenticator/signer/scoped"
	"sigs.k8s.io/kubelet-authenticator/signer/trust"
)

// fleetOptions are the settings of the per-workload-cluster loops.
type fleetOptions struct {
	// ProbePeriod is how often each workload API server is probed.
	ProbePeriod time.Duration
	// LockdownPeriod is how often lockdown is enforced again.
	LockdownPeriod time.Duration
	// UnauthorizedListPeriod is how often the requests to signer names no
	// request can be signed through (attestors a Cluster does not
	// authorize, refused ones) are listed to be denied; they are not
	// watched.
	UnauthorizedListPeriod time.Duration
	// ServingCALifetime and ServingCARotateBefore are the lifetime of a
	// serving CA and how long before its expiry the next one is made
	// (package trust; 0 means its defaults).
	ServingCALifetime     time.Duration
	ServingCARotateBefore time.Duration
	// Clock decides serving CA rotation; nil means the real clock (tests
	// set a fake one).
	Clock clock.PassiveClock
	// TokenLifetime and TokenRenewBefore: the tokens of the controller's
	// own identity in each workload cluster (package scoped).
	TokenLifetime    time.Duration
	TokenRenewBefore time.Duration
}

func (o *fleetOptions) addFlags(fs *pflag.FlagSet) {
	if o.ProbePeriod == 0 {
		o.ProbePeriod = capi.DefaultProbePeriod
	}
	if o.LockdownPeriod == 0 {
		o.LockdownPeriod = capi.DefaultLockdownPeriod
	}
	fs.DurationVar(&o.ProbePeriod, "workload-probe-period", o.ProbePeriod,
		"How often each workload cluster's API server is probed (kubelet_authenticator_signer_workload_cluster_connected).")
	fs.DurationVar(&o.LockdownPeriod, "lockdown-period", o.LockdownPeriod,
		"How often, in Clusters annotated "+capi.AnnotationLockdown+"=true, kubeadm's CSR auto-approve bindings are removed again.")
	if o.UnauthorizedListPeriod == 0 {
		o.UnauthorizedListPeriod = controller.DefaultSweepPeriod
	}
	fs.DurationVar(&o.UnauthorizedListPeriod, "unauthorized-list-period", o.UnauthorizedListPeriod,
		"How often each workload cluster's requests to attestors its Cluster does not authorize are listed, to be denied: they are not watched, "+
			"so that a Cluster costs a watch per signer name it can be signed through, not one per signer name served.")
	if o.ServingCALifetime == 0 {
		o.ServingCALifetime = trust.DefaultLifetime
	}
	if o.ServingCARotateBefore == 0 {
		o.ServingCARotateBefore = trust.DefaultRotateBefore
	}
	fs.DurationVar(&o.ServingCALifetime, "serving-ca-lifetime", o.ServingCALifetime,
		"Validity of each serving CA the controller makes for a workload cluster (it signs the attested cluster.x-k8s.io/kubelet-serving-<provider> certificates).")
	fs.DurationVar(&o.ServingCARotateBefore, "serving-ca-rotate-before", o.ServingCARotateBefore,
		"How long before the signing serving CA expires the next one is made; "+
			"both are published as ClusterTrustBundles until the old one expires, and new certificates are signed by the new one only.")
	if o.TokenLifetime == 0 {
		o.TokenLifetime = scoped.DefaultTokenLifetime
	}
	if o.TokenRenewBefore == 0 {
		o.TokenRenewBefore = scoped.DefaultRenewBefore
	}
	fs.DurationVar(&o.TokenLifetime, "workload-token-lifetime", o.TokenLifetime,
		"Lifetime of the tokens of the controller's own ServiceAccount in each workload cluster (min 10m). The controller installs that ServiceAccount, "+
			"bound to deploy/workload's rules, with the cluster's admin kubeconfig, and works only through its tokens.")
	fs.DurationVar(&o.TokenRenewBefore, "workload-token-renew-before", o.TokenRenewBefore,
		"How long before its expiry a workload cluster token is renewed, "+
			"never sooner than a minute after the last renewal ("+
			"kubelet_authenticator_signer_workload_token_expiry_timestamp_seconds says when the current one expires).")
}

// configure applies the options to r and registers the serving CA rotation
// counter with reg.
func (o *fleetOptions) configure(r *capi.ClusterReconciler, reg prometheus.Registerer) error {
	r.ProbePeriod, r.LockdownPeriod, r.UnauthorizedListPeriod = o.ProbePeriod, o.LockdownPeriod, o.UnauthorizedListPeriod
	r.ServingCA = trust.Policy{Lifetime: o.ServingCALifetime, RotateBefore: o.ServingCARotateBefore}
	r.Clock = o.Clock
	r.TokenLifetime, r.TokenRenewBefore = o.TokenLifetime, o.TokenRenewBefore
	m, err := newRotationMetrics(reg)
	if err != nil {
		return err
	}
	r.TrustMetrics = m
	im, err := newIdentityMetrics(reg)
	if err != nil {
		return err
	}
	r.IdentityMetrics = im
	return nil
}

func (o *fleetOptions) validate() []error {
	var errs []error
	if o.ProbePeriod != 0 && o.ProbePeriod < time.Second {
		errs = append(errs, fmt.Errorf("--workload-probe-period %s must be at least 1s", o.ProbePeriod))
	}
	if o.LockdownPeriod != 0 && o.LockdownPeriod < time.Second {
		errs = append(errs, fmt.Errorf("--lockdown-period %s must be at least 1s", o.LockdownPeriod))
	}
	if o.UnauthorizedListPeriod != 0 && o.UnauthorizedListPeriod < time.Second {
		errs = append(errs, fmt.Errorf("--unauthorized-list-period %s must be at least 1s", o.UnauthorizedListPeriod))
	}
	if err := (trust.Policy{Lifetime: o.ServingCALifetime, RotateBefore: o.ServingCARotateBefore}).Validate(); err != nil {
		errs = append(errs, fmt.Errorf("--serving-ca-lifetime, --serving-ca-rotate-before: %w", err))
	}
	if err := (&scoped.Config{TokenLifetime: o.TokenLifetime, RenewBefore: o.TokenRenewBefore}).Validate(); err != nil {
		errs = append(errs, fmt.Errorf("--workload-token-lifetime, --workload-token-renew-before: %w", err))
	}
	return errs
}

// fleetCollector exports, at scrape time, the state of every workload
// cluster the controller serves; a Cluster that is deleted or opts out
// disappears from it.
type fleetCollector struct {
	statuses func() []capi.ClusterStatus

	connected, lastContact, synced, queue, lockdown, lockdownRemoved, generation *prometheus.Desc
	servingCAExpiry, servingCAs, trustBundlesPublished                           *prometheus.Desc
	scopedIdentity, tokenExpiry, revokedNodes, revocationErrors                  *prometheus.Desc
	policyValid                                                                  *prometheus.Desc
}

func newFleetCollector(statuses func() []capi.ClusterStatus) *fleetCollector {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc("kubelet_authenticator_signer_"+name, help, []string{"cluster"}, nil)
	}
	return &fleetCollector{
		statuses:  statuses,
		connected: d("workload_cluster_connected", "1 when the last probe of the workload cluster's API server succeeded, 0 otherwise."),
		lastContact: d("workload_cluster_last_contact_timestamp_seconds",
			"When the workload cluster's API server last answered a probe (Unix seconds; 0: never)."),
		synced:          d("workload_cluster_synced", "1 once the CSR controller has listed the workload cluster's CSRs."),
		queue:           d("csr_queue_depth", "CSRs of the workload cluster waiting to be decided."),
		lockdown:        d("workload_cluster_lockdown", "1 when kubeadm's CSR auto-approve bindings are kept removed in the workload cluster."),
		lockdownRemoved: d("lockdown_bindings_removed", "Auto-approve ClusterRoleBindings removed from the workload cluster since its controller started."),
		generation: d("workload_controller_generation",
			"How many CSR controllers were started for the Cluster (one more per kubeconfig, CA or setting change)."),
		servingCAExpiry: d("serving_ca_expiry_timestamp_seconds",
			"When the serving CA that signs the workload cluster's attested serving certificates expires (Unix seconds)."),
		servingCAs: d("serving_cas", "Serving CAs published for the workload cluster (2 during a rotation)."),
		trustBundlesPublished: d("serving_ca_trust_bundles_published",
			"1 when the last publication of the serving CAs as ClusterTrustBundles in the workload cluster succeeded."),
		scopedIdentity: d("workload_scoped_identity",
			"1 when the controller works in the workload cluster through tokens of its own ServiceAccount, 0 when as the kubeconfig's (non-admin) user."),
		tokenExpiry: d("workload_token_expiry_timestamp_seconds",
			"When the token of the controller's ServiceAccount in the workload cluster expires (Unix seconds); alert when it comes near."),
		revokedNodes: d("revoked_node_names",
			"Node names of deleted Machines refused in the workload cluster until every certificate issued before their deletion has expired."),
		revocationErrors: d("revocation_write_errors_total",
			"Failed attempts to write the revoked node names (or their admission policy) to the workload cluster since its controller started; "+
				"a deleted Machine's node keeps access while they fail."),
		policyValid: d("cluster_policy_valid",
			"1 when the Cluster's policy has no problem, 0 when it has (listed in its ClusterAttestation's PolicyValid condition)."),
	}
}

// Describe implements prometheus.Collector.
func (c *fleetCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.connected, c.lastContact, c.synced, c.queue, c.lockdown, c.lockdownRemoved, c.generation,
		c.servingCAExpiry, c.servingCAs, c.trustBundlesPublished, c.scopedIdentity, c.tokenExpiry, c.revokedNodes, c.revocationErrors, c.policyValid} {
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
		ch <- prometheus.MustNewConstMetric(c.revokedNodes, prometheus.GaugeValue, float64(s.RevokedNodes), cl)
		ch <- prometheus.MustNewConstMetric(c.revocationErrors, prometheus.CounterValue, float64(s.RevocationErrors), cl)
		// Known once the cluster's serving CA is: a workload cluster
		// connected, or the standalone replica leading and its CA made.
		if !s.ServingCAExpiry.IsZero() {
			ch <- prometheus.MustNewConstMetric(c.servingCAExpiry, prometheus.GaugeValue, float64(s.ServingCAExpiry.Unix()), cl)
			ch <- prometheus.MustNewConstMetric(c.servingCAs, prometheus.GaugeValue, float64(s.ServingCAs), cl)
			ch <- prometheus.MustNewConstMetric(c.trustBundlesPublished, prometheus.GaugeValue, b(s.TrustBundlesPublished), cl)
			ch <- prometheus.MustNewConstMetric(c.scopedIdentity, prometheus.GaugeValue, b(s.ScopedIdentity), cl)
			ch <- prometheus.MustNewConstMetric(c.policyValid, prometheus.GaugeValue, b(s.PolicyErrors == ""), cl)
		}
		if !s.TokenExpiry.IsZero() {
			ch <- prometheus.MustNewConstMetric(c.tokenExpiry, prometheus.GaugeValue, float64(s.TokenExpiry.Unix()), cl)
		}
	}
}

// statusLister reports the status of the clusters served.
type statusLister interface{ Statuses() []capi.ClusterStatus }

type statusesFunc func() []capi.ClusterStatus

func (f statusesFunc) Statuses() []capi.ClusterStatus { return f() }

// registerFleetMetrics registers the fleet collector of r with reg and
// returns a function that unregisters it.
func registerFleetMetrics(reg prometheus.Registerer, r statusLister) (func(), error) {
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

// rotationMetrics counts serving CA rotations; it implements trust.Metrics.
type rotationMetrics struct{ rotations *prometheus.CounterVec }

func newRotationMetrics(reg prometheus.Registerer) (*rotationMetrics, error) {
	cv := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "kubelet_authenticator",
		Subsystem: "signer",
		Name:      "serving_ca_rotations_total",
		Help:      "Serving CAs made to replace one due for rotation, by workload cluster.",
	}, []string{"cluster"})
	if err := reg.Register(cv); err != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) {
			return nil, fmt.Errorf("unable to register serving CA metrics: %w", err)
		}
		existing, ok := are.ExistingCollector.(*prometheus.CounterVec)
		if !ok {
			return nil, fmt.Errorf("unable to register serving CA metrics: %w", err)
		}
		cv = existing // a previous Run in this process (tests)
	}
	return &rotationMetrics{rotations: cv}, nil
}

// Rotated implements trust.Metrics.
func (m *rotationMetrics) Rotated(cluster string) { m.rotations.WithLabelValues(cluster).Inc() }

// identityMetrics counts the renewals and failures of the controller's
// identity in the workload clusters; it implements capi.IdentityMetrics.
type identityMetrics struct{ renewals, failures *prometheus.CounterVec }

func newIdentityMetrics(reg prometheus.Registerer) (*identityMetrics, error) {
	renewals, err := registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "kubelet_authenticator",
		Subsystem: "signer",
		Name:      "workload_token_renewals_total",
		Help:      "Tokens of the controller's ServiceAccount renewed, by workload cluster.",
	}, []string{"cluster"}))
	if err != nil {
		return nil, err
	}
	failures, err := registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "kubelet_authenticator",
		Subsystem: "signer",
		Name:      "workload_identity_failures_total",
		Help: "Failed attempts to install the controller's ServiceAccount in a workload cluster or to get a token for it, " +
			"by workload cluster and step (check, install, token); each is retried.",
	}, []string{"cluster", "step"}))
	if err != nil {
		return nil, err
	}
	return &identityMetrics{renewals: renewals, failures: failures}, nil
}

// TokenRenewed implements capi.IdentityMetrics.
func (m *identityMetrics) TokenRenewed(cluster string) { m.renewals.WithLabelValues(cluster).Inc() }

// IdentityFailed implements capi.IdentityMetrics.
func (m *identityMetrics) IdentityFailed(cluster, step string) {
	m.failures.WithLabelValues(cluster, step).Inc()
}
