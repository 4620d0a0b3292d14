package app

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/controller"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/lockdown"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
	"sigs.k8s.io/kubelet-authenticator/signer/standalone"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
	"sigs.k8s.io/kubelet-authenticator/signer/trust"
)

// StandaloneCluster names the served cluster in metrics and logs in
// standalone mode.
const StandaloneCluster = "standalone"

// StandaloneOptions are the settings of standalone mode: the controller's
// own, where --kubeconfig is the cluster it serves, plus where the CA and
// the allowlist are.
type StandaloneOptions struct {
	*Options
	// CACertFile and CAKeyFile hold the CA kube-apiserver trusts for client
	// certificates; or CASecret ("namespace/name", tls.crt and tls.key).
	CACertFile, CAKeyFile string
	CASecret              string
	// Allowlist is the allowlist ConfigMap, "namespace/name".
	Allowlist string
	// AuthorizedAttestors lists the providers whose evidence is accepted.
	AuthorizedAttestors []string
	// PolicyFiles are policy documents by provider (the TPM boot-state
	// policy), read at start.
	PolicyFiles map[string]string
	// RevocationPeriod is how often the allowlist is compared with the
	// certificates issued, to revoke the entries taken out.
	RevocationPeriod time.Duration
	// ServingCASecret is the Secret ("namespace/name") where the
	// controller keeps the serving CAs it makes and rotates (package
	// trust); they sign the attested serving certificates.
	ServingCASecret string
	// ApproveKubeletServing approves kubelet's own
	// kubernetes.io/kubelet-serving requests whose names and addresses are
	// the allowlist entry's (kube-controller-manager signs them).
	ApproveKubeletServing bool
	// Lockdown disarms kubeadm's bootstrap auto-approve bindings in the
	// cluster (package lockdown); off, what it disarmed is restored.
	Lockdown bool

	caSecret, allowlist, servingCASecret types.NamespacedName
}

// NewStandaloneOptions returns StandaloneOptions with defaults.
func NewStandaloneOptions() *StandaloneOptions {
	return &StandaloneOptions{Options: NewOptions(), Allowlist: "kube-system/kubelet-authenticator-allowlist",
		ServingCASecret: "kube-system/kubelet-authenticator-serving-ca", RevocationPeriod: standalone.DefaultRevocationPeriod}
}

// clusterAPIOnly reports whether a flag of Options configures what only
// Cluster API mode has (workload clusters reached through a tenant's
// kubeconfig, Clusters to recheck): standalone mode does not take it.
func clusterAPIOnly(name string) bool {
	if name == "cluster-recheck-period" {
		return true
	}
	return strings.HasPrefix(name, "workload-")
}

// AddFlags adds the options' flags to fs: the controller's own, but for
// those of Cluster API mode only, and standalone mode's.
func (o *StandaloneOptions) AddFlags(fs *pflag.FlagSet) {
	all := pflag.NewFlagSet("standalone", pflag.ContinueOnError)
	o.Options.AddFlags(all)
	all.VisitAll(func(f *pflag.Flag) {
		if !clusterAPIOnly(f.Name) {
			fs.AddFlag(f)
		}
	})
	if f := fs.Lookup("kubeconfig"); f != nil {
		f.Usage = "Kubeconfig of the cluster the controller serves (and runs in). Empty: the in-cluster service account."
	}
	if f := fs.Lookup("lockdown-period"); f != nil {
		f.Usage = "How often, with --lockdown, kubeadm's CSR auto-approve bindings are disarmed again (kubeadm upgrade writes them anew)."
	}
	if f := fs.Lookup("serving-ca-lifetime"); f != nil {
		f.Usage = "Validity of each serving CA the controller makes (it signs the attested cluster.x-k8s.io/kubelet-serving-<provider> certificates)."
	}
	fs.StringVar(&o.CACertFile, "ca-cert-file", o.CACertFile,
		"PEM file of the CA kube-apiserver trusts for client certificates (its --client-ca-file CA). With --ca-key-file; or use --ca-secret.")
	fs.StringVar(&o.CAKeyFile, "ca-key-file", o.CAKeyFile, "PEM file of the CA's private key.")
	fs.StringVar(&o.CASecret, "ca-secret", o.CASecret, "Secret namespace/name holding the CA (tls.crt, tls.key), instead of --ca-cert-file and --ca-key-file.")
	fs.StringVar(&o.Allowlist, "allowlist-configmap", o.Allowlist,
		"ConfigMap namespace/name whose key "+standalone.AllowlistKey+" lists the nodes that may join: nodes: [{nodeName, providerID, identity}].")
	fs.StringSliceVar(&o.AuthorizedAttestors, "authorized-attestors", o.AuthorizedAttestors, "Attestors whose evidence is accepted (e.g. tpm,aws).")
	fs.DurationVar(&o.RevocationPeriod, "revocation-period", o.RevocationPeriod,
		"How often the allowlist is compared with the certificates issued: "+
			"the certificates of a node whose entry was taken out (or given another provider ID) are refused by the cluster's admission policy within this period.")
	fs.StringVar(&o.ServingCASecret, "serving-ca-secret", o.ServingCASecret,
		"Secret namespace/name where the controller keeps the serving CAs it makes, rotates and publishes as ClusterTrustBundles; "+
			"they sign the attested cluster.x-k8s.io/kubelet-serving-<provider> certificates of allowlisted nodes.")
	fs.BoolVar(&o.ApproveKubeletServing, "approve-kubelet-serving", o.ApproveKubeletServing,
		"Approve kubelet's own kubernetes.io/kubelet-serving requests (ServerTLSBootstrap) of a node whose every name and address is in its allowlist entry ("+
			"dnsNames, ips); kube-controller-manager signs them.")
	fs.BoolVar(&o.Lockdown, "lockdown", o.Lockdown,
		"Disarm kubeadm's CSR auto-approve bindings (subjects kept in an annotation, restored when the flag is off again), so that a node joins only by attesting; "+
			"nodes keep renewing their own certificates.")
	fs.StringToStringVar(&o.PolicyFiles, "attestor-policy", o.PolicyFiles,
		"Policy document of an attestor, as <provider>=<file> ("+
			"e.g. tpm=/etc/kubelet-authenticator/tpm-policy.yaml for the TPM boot-state policy). Repeatable. Without one, the attestor applies no policy.")
}

// Validate reports every problem with the options at once.
func (o *StandaloneOptions) Validate() error {
	errs := []error{o.Options.Validate()}
	switch {
	case o.CASecret != "" && (o.CACertFile != "" || o.CAKeyFile != ""):
		errs = append(errs, errors.New("--ca-secret and --ca-cert-file/--ca-key-file are exclusive"))
	case o.CASecret != "":
		nn, err := namespacedName(o.CASecret)
		if err != nil {
			errs = append(errs, fmt.Errorf("--ca-secret: %w", err))
		}
		o.caSecret = nn
	case o.CACertFile == "" || o.CAKeyFile == "":
		errs = append(errs, errors.New("a CA is required: --ca-cert-file and --ca-key-file, or --ca-secret"))
	}
	nn, err := namespacedName(o.Allowlist)
	if err != nil {
		errs = append(errs, fmt.Errorf("--allowlist-configmap: %w", err))
	}
	o.allowlist = nn
	if o.servingCASecret, err = namespacedName(o.ServingCASecret); err != nil {
		errs = append(errs, fmt.Errorf("--serving-ca-secret: %w", err))
	}
	if o.RevocationPeriod <= 0 {
		errs = append(errs, fmt.Errorf("--revocation-period must be positive, not %s", o.RevocationPeriod))
	}
	if len(o.AuthorizedAttestors) == 0 {
		errs = append(errs, errors.New("--authorized-attestors must name at least one attestor"))
	}
	return errors.Join(errs...)
}

func namespacedName(s string) (types.NamespacedName, error) {
	ns, name, ok := strings.Cut(s, "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return types.NamespacedName{}, fmt.Errorf("%q is not namespace/name", s)
	}
	return types.NamespacedName{Namespace: ns, Name: name}, nil
}

// NewStandaloneCommand returns the `standalone` subcommand.
func NewStandaloneCommand() *cobra.Command {
	o := NewStandaloneOptions()
	cmd := &cobra.Command{
		Use:   "standalone",
		Short: "Sign attested kubelet client certificates for the cluster the controller runs in, without Cluster API",
		Long: `standalone runs the signer in the cluster it serves (kubeadm or bare metal):
nodes are matched against an allowlist ConfigMap instead of Cluster API
Machines, and certificates are signed with a CA from files or a Secret.`,
		SilenceUsage: true,
		Args:         cobra.NoArgs,
		RunE:         runE(o),
	}
	o.AddFlags(cmd.Flags())
	return cmd
}

// Run runs the standalone controller until ctx is done. Options must be
// complete and valid. It sets up in phases, then runs the manager: the
// leader signs (standaloneRun.lead), every replica serves metrics and
// probes.
func (o *StandaloneOptions) Run(ctx context.Context) error {
	r := &standaloneRun{o: o, logger: klog.FromContext(ctx)}
	ctrl.SetLogger(r.logger)
	for _, phase := range []func(context.Context) error{r.newManager, r.newClients, r.loadAttestors, r.addRunnables} {
		if err := phase(ctx); err != nil {
			return err
		}
	}
	unregister, err := registerFleetMetrics(ctrlmetrics.Registry, statusesFunc(r.statuses))
	if err != nil {
		return err
	}
	defer unregister()
	r.logger.Info("Starting in standalone mode", "leaderElect", o.LeaderElect, "maxClientCertificateLifetime", o.MaxClientCertificateLifetime,
		"lockdown", o.Lockdown, "approveKubeletServing", o.ApproveKubeletServing)
	return r.mgr.Start(ctx)
}

// standaloneRun is what Run sets up, phase by phase.
type standaloneRun struct {
	o      *StandaloneOptions
	logger klog.Logger

	mgr    manager.Manager
	scheme *runtime.Scheme
	cs     kubernetes.Interface
	direct client.Client
	pub    *trust.Publisher

	verifiers     map[string]attestor.Verifier
	challengeKeys attestor.ChallengeKeys
	policies      map[string][]byte
	metrics       *decisionMetrics
	rotations     trust.Metrics

	matcher    *standalone.Matcher
	identities *tofu.Store

	running atomic.Pointer[controller.Controller]
	mu      sync.Mutex
	status  capi.ClusterStatus // what the leader did; metrics read it
}

// newManager makes the manager: leader election, metrics and probes.
func (r *standaloneRun) newManager(context.Context) error {
	r.scheme = runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(r.scheme); err != nil {
		return err
	}
	mgr, err := ctrl.NewManager(r.o.RESTConfig, ctrl.Options{
		Scheme:                        r.scheme,
		LeaderElection:                r.o.LeaderElect,
		LeaderElectionID:              r.o.LeaderElectionID,
		LeaderElectionNamespace:       r.o.LeaderElectionNamespace,
		LeaderElectionReleaseOnCancel: true,
		Metrics:                       r.o.metricsServer(), // diagnostics.go
		HealthProbeBindAddress:        r.o.HealthProbeBindAddress,
		PprofBindAddress:              r.o.ProfilerAddress,
	})
	if err != nil {
		return fmt.Errorf("unable to create the manager: %w", err)
	}
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return err
	}
	if err := mgr.AddReadyzCheck("ping", healthz.Ping); err != nil {
		return err
	}
	r.mgr = mgr
	return nil
}

// newClients makes the clients of the cluster served (it is the one the
// controller runs in).
func (r *standaloneRun) newClients(context.Context) error {
	var err error
	if r.cs, err = kubernetes.NewForConfig(r.o.RESTConfig); err != nil {
		return fmt.Errorf("unable to create the cluster client: %w", err)
	}
	if r.direct, err = client.New(r.o.RESTConfig, client.Options{Scheme: r.scheme}); err != nil {
		return fmt.Errorf("unable to create the cluster client: %w", err)
	}
	return nil
}

// loadAttestors makes the verifiers, reads their policy documents, and
// makes the publisher of the serving CAs for their serving signer names.
func (r *standaloneRun) loadAttestors(ctx context.Context) error {
	var err error
	if r.verifiers, r.challengeKeys, err = r.o.Verifiers(ctx, r.direct); err != nil {
		return err
	}
	r.policies = map[string][]byte{}
	for p, f := range r.o.PolicyFiles {
		if _, ok := r.verifiers[p]; !ok {
			return fmt.Errorf("--attestor-policy %s=%s: no attestor %q", p, f, p)
		}
		if r.policies[p], err = os.ReadFile(f); err != nil {
			return fmt.Errorf("--attestor-policy: %w", err)
		}
	}
	if r.metrics, err = newDecisionMetrics(ctrlmetrics.Registry); err != nil {
		return err
	}
	rotations, err := newRotationMetrics(ctrlmetrics.Registry)
	if err != nil {
		return err
	}
	r.rotations = rotations
	if r.pub, err = trust.NewPublisher(r.o.RESTConfig, r.servingSignerNames()); err != nil {
		return fmt.Errorf("unable to create the cluster client: %w", err)
	}
	return nil
}

// addRunnables adds what runs: the sweep of trust-on-first-use records
// and, on the leader, the signer.
func (r *standaloneRun) addRunnables(context.Context) error {
	// Trust on first use, as with Cluster API: the first stable identity
	// an allowlist entry's node proves is recorded in the controller's
	// namespace, and from then on belongs to that entry only. Records of
	// entries taken out of the allowlist are swept away.
	r.matcher = &standalone.Matcher{Client: r.cs, ConfigMap: r.o.allowlist}
	r.identities = &tofu.Store{Namespace: r.o.LeaderElectionNamespace, Client: r.direct, Reader: r.direct, Owners: r.matcher,
		Administrator: "the cluster's administrator"}
	if err := r.mgr.Add(&tofu.Cleaner{Store: r.identities}); err != nil {
		return err
	}
	return r.mgr.Add(manager.RunnableFunc(r.lead))
}

// lead signs for the cluster while this replica leads: it loads the
// client CA, keeps revocation and lockdown, and runs the CSR controller
// with the current serving CAs, starting it anew whenever they change.
func (r *standaloneRun) lead(ctx context.Context) error {
	// The CA is read once this replica leads: a Secret it cannot read
	// yet stops the replica (and restarts it), not the others.
	ca, err := standalone.LoadCA(ctx, r.cs, r.o.CACertFile, r.o.CAKeyFile, r.o.caSecret)
	if err != nil {
		return err
	}
	// A node whose entry leaves the allowlist loses its certificates'
	// access before they expire, as a deleted Machine's node does.
	revocations := &standalone.Revocations{Matcher: r.matcher,
		Revoker: &revoke.Revoker{Client: r.cs, Lifetime: r.o.MaxClientCertificateLifetime}}
	go revocations.Run(ctx, r.o.RevocationPeriod)
	go r.keepLockdown(ctx)
	for ctx.Err() == nil {
		servingCAs, err := r.servingCAs(ctx)
		if err != nil {
			r.logger.Error(err, "Serving CA not ready; next try in a few seconds")
			select {
			case <-ctx.Done():
			case <-time.After(5 * time.Second):
			}
			continue
		}
		if err := r.serve(ctx, ca, servingCAs, revocations); err != nil {
			return err
		}
	}
	return nil
}

// servingCAs returns the serving CAs, making, rotating and dropping them
// as the policy says (package trust), as Cluster API mode does for each
// workload cluster.
func (r *standaloneRun) servingCAs(ctx context.Context) (*trust.Authority, error) {
	store := &trust.Store{Client: r.direct, Reader: r.direct, Clock: r.o.Clock, Metrics: r.rotations,
		Policy: trust.Policy{Lifetime: r.o.ServingCALifetime, RotateBefore: r.o.ServingCARotateBefore}}
	return store.Ensure(ctx, trust.SecretRef{NamespacedName: r.o.servingCASecret, Cluster: StandaloneCluster,
		Labels: map[string]string{"app.kubernetes.io/part-of": "kubelet-authenticator"}})
}

// serve runs the CSR controller with servingCAs until they change next
// (or ctx is done): the CAs are published as ClusterTrustBundles first, so
// that a new CA signs only once it is published.
func (r *standaloneRun) serve(ctx context.Context, ca *issue.CA, servingCAs *trust.Authority, revocations *standalone.Revocations) error {
	sctx, cancel := context.WithDeadline(ctx, later(servingCAs.NextChange, time.Now().Add(time.Minute)))
	defer cancel()
	r.update(func(s *capi.ClusterStatus) {
		s.ServingCAExpiry, s.ServingCAs, s.Generation = servingCAs.Signing.Cert.NotAfter, len(servingCAs.Trusted), s.Generation+1
	})
	published := make(chan struct{})
	r.pub.Keep(sctx, servingCAs.Trusted, capi.DefaultRecheckPeriod, published, func(err error) {
		r.update(func(s *capi.ClusterStatus) { s.TrustBundlesPublished = err == nil })
		if err != nil {
			r.logger.Info("Serving CAs not published as ClusterTrustBundles yet, will retry", "err", err.Error())
		}
	})
	select {
	case <-published:
	case <-sctx.Done():
		return nil
	}
	c, err := controller.New(controller.Config{
		Cluster: StandaloneCluster,
		Client:  r.cs,
		Engine: engine.Config{
			Profiles: engine.Profiles(engine.ProfileSet{
				Verifiers:      r.verifiers,
				ClientOnly:     []string{insecure.Name},
				Client:         &issue.Signer{CA: ca, MaxLifetime: r.o.MaxClientCertificateLifetime},
				Serving:        &issue.Signer{CA: servingCAs.Signing, Serving: true, MaxLifetime: r.o.MaxClientCertificateLifetime},
				KubeletServing: r.o.ApproveKubeletServing,
			}),
			Authorized: r.o.AuthorizedAttestors,
			Policies:   r.policies,
			// The cluster is the one this signer runs in: its CA
			// names it, and no other cluster shares its challenge key.
			ClusterCAs:    [][]byte{ca.Cert.Raw},
			Machines:      r.matcher,
			Identities:    r.identities,
			ChallengeKeys: r.challengeKeys,
		},
		Metrics:     r.metrics,
		Workers:     r.o.WorkersPerCluster,
		SweepPeriod: r.o.UnauthorizedListPeriod,
		Issuing:     revocations,
	})
	if err != nil {
		return err
	}
	r.logger.Info("Signing for the cluster the controller runs in", "allowlist", r.o.allowlist, "authorizedAttestors", r.o.AuthorizedAttestors,
		"caExpires", ca.Cert.NotAfter, "servingCAExpires", servingCAs.Signing.Cert.NotAfter, "servingCAs", len(servingCAs.Trusted))
	r.running.Store(c)
	if err := c.Run(sctx); err != nil && ctx.Err() == nil && sctx.Err() == nil {
		return err
	}
	return nil
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// keepLockdown applies --lockdown in the cluster, as Cluster API mode
// applies a Cluster's spec.lockdown (package lockdown, the same rule):
// on, kubeadm's bootstrap auto-approve bindings are disarmed every
// --lockdown-period; off, what an earlier run disarmed is restored once.
func (r *standaloneRun) keepLockdown(ctx context.Context) {
	logger := r.logger.WithValues("cluster", StandaloneCluster)
	if r.o.Lockdown {
		r.update(func(s *capi.ClusterStatus) { s.Lockdown = true })
		<-lockdown.Run(ctx, r.cs, r.o.LockdownPeriod, func(disarmed []string, err error) {
			r.update(func(s *capi.ClusterStatus) {
				s.LockdownRemoved += len(disarmed)
				s.LockdownEnforced, s.LockdownError = err == nil, ""
				if err != nil {
					s.LockdownError = err.Error()
				}
			})
			if len(disarmed) > 0 {
				logger.Info("Lockdown disarmed CSR auto-approve bindings: a node joins only by attesting", "clusterRoleBindings", disarmed)
			}
			if err != nil && ctx.Err() == nil {
				logger.Info("Lockdown not enforced yet, will retry", "err", err.Error())
			}
		})
		return
	}
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		restored, err := lockdown.Restore(ctx, r.cs)
		if len(restored) > 0 {
			logger.Info("Lockdown lifted: restored CSR auto-approve bindings", "clusterRoleBindings", restored)
		}
		if err != nil {
			if ctx.Err() == nil {
				logger.Info("Lockdown not lifted yet, will retry", "err", err.Error())
			}
			return
		}
		<-ctx.Done() // done: nothing more until the controller restarts
	}, r.o.LockdownPeriod)
}

func (r *standaloneRun) update(f func(*capi.ClusterStatus)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(&r.status)
}

// statuses reports the cluster served, as Cluster API mode reports each
// workload cluster, for the fleet metrics.
func (r *standaloneRun) statuses() []capi.ClusterStatus {
	c := r.running.Load()
	if c == nil {
		return nil
	}
	r.mu.Lock()
	s := r.status
	r.mu.Unlock()
	s.Cluster = types.NamespacedName{Name: StandaloneCluster}
	s.Connected, s.Synced, s.QueueDepth = c.HasSynced(), c.HasSynced(), c.QueueLen()
	return []capi.ClusterStatus{s}
}

// servingSignerNames are the attested serving signer names of the
// authorized attestors the signer knows: the names the serving CAs are
// published for.
func (r *standaloneRun) servingSignerNames() []string {
	var out []string
	for _, p := range r.o.AuthorizedAttestors {
		if _, ok := r.verifiers[p]; ok {
			out = append(out, attestor.ServingSignerName(p))
		}
	}
	slices.Sort(out)
	return out
}
