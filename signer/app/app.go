package app

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"sigs.k8s.io/kubelet-authenticator/api/v1alpha1"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
	"sigs.k8s.io/kubelet-authenticator/version"
)

// NewCommand returns the node-attestation-controller command.
func NewCommand() *cobra.Command {
	o := NewOptions()
	cmd := &cobra.Command{
		Use:   "node-attestation-controller",
		Short: "Approve and sign attested kubelet client certificates for Cluster API workload clusters",
		Long: `node-attestation-controller runs on a Cluster API management cluster. For
every Cluster annotated kubelet-authenticator.x-k8s.io/enabled=true it watches
the workload cluster's CertificateSigningRequests for the
cluster.x-k8s.io/kube-apiserver-client-kubelet-<provider> signers, checks each
one and its attestation against the Machine Cluster API created, and signs it
with the cluster's CA, or denies it with a reason.`,
		SilenceUsage: true,
		Version:      version.String(),
		Args:         cobra.NoArgs,
		RunE:         runE(o),
	}
	o.AddFlags(cmd.Flags())
	cmd.AddCommand(NewStandaloneCommand())
	cmd.AddCommand(&cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run:   func(cmd *cobra.Command, _ []string) { fmt.Fprintln(cmd.OutOrStdout(), version.String()) },
	})
	return cmd
}

// Scheme returns the scheme the manager uses: Kubernetes and Cluster API
// core v1beta2 types, and this project's API (api/v1alpha1).
func Scheme() (*runtime.Scheme, error) {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		return nil, err
	}
	if err := v1alpha1.AddToScheme(s); err != nil {
		return nil, err
	}
	if err := clusterv1.AddToScheme(s); err != nil {
		return nil, err
	}
	return s, nil
}

// Run runs the controller until ctx is done. Options must be complete and
// valid.
func (o *Options) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	ctrl.SetLogger(logger)
	scheme, err := Scheme()
	if err != nil {
		return err
	}
	mgr, err := o.newManager(scheme)
	if err != nil {
		return err
	}
	metrics, err := newDecisionMetrics(ctrlmetrics.Registry)
	if err != nil {
		return err
	}
	direct, err := client.New(o.RESTConfig, client.Options{Scheme: scheme})
	if err != nil {
		return fmt.Errorf("unable to create the management cluster client: %w", err)
	}
	verifiers, challengeKeys, err := o.Verifiers(ctx, direct)
	if err != nil {
		return err
	}
	events, stopEvents, err := newEventRecorder(o.RESTConfig, scheme) // observe.go
	if err != nil {
		return err
	}
	defer stopEvents()
	// Trust-on-first-use records live in the controller's own namespace,
	// where tenants cannot write (signer/tofu).
	identities := &tofu.Store{Namespace: o.namespace(), Client: mgr.GetClient(), Reader: mgr.GetAPIReader()}
	r := &capi.ClusterReconciler{
		Client:        mgr.GetClient(),
		APIReader:     mgr.GetAPIReader(),
		Verifiers:     verifiers,
		ClientOnly:    []string{insecure.Name},
		ChallengeKeys: challengeKeys,
		Identities:    identities,
		MaxLifetime:   o.MaxClientCertificateLifetime,
		Metrics:       metrics,
		Events:        events,
		Workers:       o.WorkersPerCluster,
		ClientQPS:     o.WorkloadClientQPS,
		ClientBurst:   o.WorkloadClientBurst,
		RecheckPeriod: o.ClusterRecheckPeriod,
		RESTConfig:    o.WorkloadRESTConfig,
		Namespace:     o.namespace(),
	}
	// The test-only pod certificate timing, in test builds (testattestors_*.go).
	o.testAttestorOptions.configure(r)
	if err := o.fleetOptions.configure(r, ctrlmetrics.Registry); err != nil { // fleet.go
		return err
	}
	if err := o.boundsOptions.configure(r, ctrlmetrics.Registry); err != nil { // bounds.go
		return err
	}
	unregisterShards, err := o.shardOptions.configure(r, direct, o.namespace(), o.LeaderElectionID, ctrlmetrics.Registry) // shard.go
	if err != nil {
		return err
	}
	defer unregisterShards()
	unregister, err := registerFleetMetrics(ctrlmetrics.Registry, r)
	if err != nil {
		return err
	}
	defer unregister()
	// One Machine deletion hook: the Machine's trust-on-first-use records
	// go, and its node names are revoked in its workload cluster.
	if err := (&tofu.Cleaner{Store: identities, Deleted: r.MachineDeleted}).SetupWithManager(ctx, mgr); err != nil {
		return err
	}
	if err := r.SetupWithManager(ctx, mgr); err != nil {
		return fmt.Errorf("unable to set up the Cluster reconciler: %w", err)
	}
	var replica string
	if r.Shards != nil {
		replica = r.Shards.Identity
	}
	logger.Info("Starting", "leaderElect", o.LeaderElect, "sharding", o.Sharding, "replica", replica, "watchFilter", o.WatchFilter,
		"maxClientCertificateLifetime", o.MaxClientCertificateLifetime)
	return mgr.Start(ctx)
}

// newManager returns the controller-runtime manager: leader election, the
// metrics and health endpoints, and a cache of only what the signer reads.
func (o *Options) newManager(scheme *runtime.Scheme) (ctrl.Manager, error) {
	mgr, err := ctrl.NewManager(o.RESTConfig, ctrl.Options{
		Scheme:                        scheme,
		LeaderElection:                o.LeaderElect,
		LeaderElectionID:              o.LeaderElectionID,
		LeaderElectionNamespace:       o.LeaderElectionNamespace,
		LeaderElectionReleaseOnCancel: true,
		Metrics:                       o.metricsServer(), // diagnostics.go
		HealthProbeBindAddress:        o.HealthProbeBindAddress,
		PprofBindAddress:              o.ProfilerAddress,
		// Secrets are read one by one from the API server, never listed,
		// watched or cached: the controller may get the Secrets it needs,
		// not list every Secret of the management cluster.
		// What tenants write on their Clusters, Machines and infrastructure
		// objects beyond what the signer reads is not cached.
		Cache:      capi.CacheOptions(),
		Client:     client.Options{Cache: &client.CacheOptions{DisableFor: []client.Object{&corev1.Secret{}, &corev1.ConfigMap{}}}},
		Controller: config.Controller{SkipNameValidation: &o.SkipControllerNameValidation},
	})
	if err != nil {
		return nil, fmt.Errorf("unable to create the manager: %w", err)
	}
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return nil, err
	}
	if err := mgr.AddReadyzCheck("ping", healthz.Ping); err != nil {
		return nil, err
	}
	return mgr, nil
}

// decisionMetrics counts CSR decisions; it implements controller.Metrics
// and, through csrMetrics (observe.go), the controller's optional metrics.
type decisionMetrics struct {
	decisions *prometheus.CounterVec
	*csrMetrics
}

func newDecisionMetrics(reg prometheus.Registerer) (*decisionMetrics, error) {
	cv := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "kubelet_authenticator",
		Subsystem: "signer",
		Name:      "csr_decisions_total",
		Help: "Decisions on kubelet client CertificateSigningRequests, by workload cluster, decision (approved, denied, failed, challenged, " +
			"retried) and reason.",
	}, []string{"cluster", "decision", "reason"})
	if err := reg.Register(cv); err != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) {
			return nil, fmt.Errorf("unable to register metrics: %w", err)
		}
		existing, ok := are.ExistingCollector.(*prometheus.CounterVec)
		if !ok {
			return nil, fmt.Errorf("unable to register metrics: %w", err)
		}
		cv = existing
	}
	csr, err := newCSRMetrics(reg)
	if err != nil {
		return nil, err
	}
	return &decisionMetrics{decisions: cv, csrMetrics: csr}, nil
}

// Decision implements controller.Metrics.
func (m *decisionMetrics) Decision(cluster, decision, reason string) {
	m.decisions.WithLabelValues(cluster, decision, reason).Inc()
}

// runner is what a command runs: logging applied, options completed,
// validated, then run.
type runner interface {
	applyLogging() error
	Complete() error
	Validate() error
	Run(ctx context.Context) error
}

// runE completes and validates o, then runs it until SIGINT or SIGTERM.
func runE(o runner) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, _ []string) error {
		if err := o.applyLogging(); err != nil {
			return err
		}
		defer flushLogs()
		if err := o.Complete(); err != nil {
			return err
		}
		if err := o.Validate(); err != nil {
			return err
		}
		ctx, cancel := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
		defer cancel()
		setMemoryLimit(ctx) // bounds.go
		return o.Run(ctx)
	}
}
