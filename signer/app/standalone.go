package app

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/signer/capi"
	"sigs.k8s.io/kubelet-authenticator/signer/controller"
	"sigs.k8s.io/kubelet-authenticator/signer/engine"
	"sigs.k8s.io/kubelet-authenticator/signer/issue"
	"sigs.k8s.io/kubelet-authenticator/signer/revoke"
	"sigs.k8s.io/kubelet-authenticator/signer/standalone"
	"sigs.k8s.io/kubelet-authenticator/signer/tofu"
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

	caSecret, allowlist types.NamespacedName
}

// NewStandaloneOptions returns StandaloneOptions with defaults.
func NewStandaloneOptions() *StandaloneOptions {
	return &StandaloneOptions{Options: NewOptions(), Allowlist: "kube-system/kubelet-authenticator-allowlist",
		RevocationPeriod: standalone.DefaultRevocationPeriod}
}

// clusterAPIOnly reports whether a flag of Options configures what only
// Cluster API mode has (workload clusters reached through a tenant's
// kubeconfig, Cluster annotations, the managed serving CA): standalone mode
// does not take it.
func clusterAPIOnly(name string) bool {
	switch name {
	case "cluster-recheck-period", "lockdown-period", "serving-ca-lifetime", "serving-ca-rotate-before":
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
	fs.StringVar(&o.CACertFile, "ca-cert-file", o.CACertFile, "PEM file of the CA kube-apiserver trusts for client certificates (its --client-ca-file CA). With --ca-key-file; or use --ca-secret.")
	fs.StringVar(&o.CAKeyFile, "ca-key-file", o.CAKeyFile, "PEM file of the CA's private key.")
	fs.StringVar(&o.CASecret, "ca-secret", o.CASecret, "Secret namespace/name holding the CA (tls.crt, tls.key), instead of --ca-cert-file and --ca-key-file.")
	fs.StringVar(&o.Allowlist, "allowlist-configmap", o.Allowlist, "ConfigMap namespace/name whose key "+standalone.AllowlistKey+" lists the nodes that may join: nodes: [{nodeName, providerID, identity}].")
	fs.StringSliceVar(&o.AuthorizedAttestors, "authorized-attestors", o.AuthorizedAttestors, "Attestors whose evidence is accepted (e.g. tpm,aws).")
	fs.DurationVar(&o.RevocationPeriod, "revocation-period", o.RevocationPeriod, "How often the allowlist is compared with the certificates issued: the certificates of a node whose entry was taken out (or given another provider ID) are refused by the cluster's admission policy within this period.")
	fs.StringToStringVar(&o.PolicyFiles, "attestor-policy", o.PolicyFiles, "Policy document of an attestor, as <provider>=<file> (e.g. tpm=/etc/kubelet-authenticator/tpm-policy.yaml for the TPM boot-state policy). Repeatable. Without one, the attestor applies no policy.")
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
// complete and valid.
func (o *StandaloneOptions) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	ctrl.SetLogger(logger)
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return err
	}
	mgr, err := ctrl.NewManager(o.RESTConfig, ctrl.Options{
		Scheme:                        scheme,
		LeaderElection:                o.LeaderElect,
		LeaderElectionID:              o.LeaderElectionID,
		LeaderElectionNamespace:       o.LeaderElectionNamespace,
		LeaderElectionReleaseOnCancel: true,
		Metrics:                       o.metricsServer(), // diagnostics.go
		HealthProbeBindAddress:        o.HealthProbeBindAddress,
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
	cs, err := kubernetes.NewForConfig(o.RESTConfig)
	if err != nil {
		return fmt.Errorf("unable to create the cluster client: %w", err)
	}
	direct, err := client.New(o.RESTConfig, client.Options{Scheme: scheme})
	if err != nil {
		return fmt.Errorf("unable to create the cluster client: %w", err)
	}
	verifiers, challengeKeys, err := o.Verifiers(ctx, direct)
	if err != nil {
		return err
	}
	policies := map[string][]byte{}
	for p, f := range o.PolicyFiles {
		if _, ok := verifiers[p]; !ok {
			return fmt.Errorf("--attestor-policy %s=%s: no attestor %q", p, f, p)
		}
		if policies[p], err = os.ReadFile(f); err != nil {
			return fmt.Errorf("--attestor-policy: %w", err)
		}
	}
	metrics, err := newDecisionMetrics(ctrlmetrics.Registry)
	if err != nil {
		return err
	}
	// Trust on first use, as with Cluster API: the first stable identity
	// an allowlist entry's node proves is recorded in the controller's
	// namespace, and from then on belongs to that entry only. Records of
	// entries taken out of the allowlist are swept away.
	matcher := &standalone.Matcher{Client: cs, ConfigMap: o.allowlist}
	identities := &tofu.Store{Namespace: o.LeaderElectionNamespace, Client: direct, Reader: direct, Owners: matcher}
	if err := mgr.Add(&tofu.Cleaner{Store: identities}); err != nil {
		return err
	}
	var running atomic.Pointer[controller.Controller]
	err = mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
		// The CA is read once this replica leads: a Secret it cannot read
		// yet stops the replica (and restarts it), not the others.
		ca, err := standalone.LoadCA(ctx, cs, o.CACertFile, o.CAKeyFile, o.caSecret)
		if err != nil {
			return err
		}
		// A node whose entry leaves the allowlist loses its certificates'
		// access before they expire, as a deleted Machine's node does.
		revocations := &standalone.Revocations{Matcher: matcher,
			Revoker: &revoke.Revoker{Client: cs, Lifetime: o.MaxClientCertificateLifetime}}
		go revocations.Run(ctx, o.RevocationPeriod)
		c, err := controller.New(controller.Config{
			Cluster: StandaloneCluster,
			Client:  cs,
			Engine: engine.Config{
				Profiles: engine.Profiles(engine.ProfileSet{
					Verifiers:  verifiers,
					ClientOnly: []string{insecure.Name},
					Client:     &issue.Signer{CA: ca, MaxLifetime: o.MaxClientCertificateLifetime},
				}),
				Authorized: o.AuthorizedAttestors,
				Policies:   policies,
				// The cluster is the one this signer runs in: its CA
				// names it, and no other cluster shares its challenge key.
				ClusterCAs:    [][]byte{ca.Cert.Raw},
				Machines:      matcher,
				Identities:    identities,
				ChallengeKeys: challengeKeys,
			},
			Metrics: metrics,
			Workers: o.WorkersPerCluster,
			Issuing: revocations,
		})
		if err != nil {
			return err
		}
		logger.Info("Signing for the cluster the controller runs in", "allowlist", o.allowlist, "authorizedAttestors", o.AuthorizedAttestors, "caExpires", ca.Cert.NotAfter)
		running.Store(c)
		return c.Run(ctx)
	}))
	if err != nil {
		return err
	}
	unregister, err := registerFleetMetrics(ctrlmetrics.Registry, statusesFunc(func() []capi.ClusterStatus {
		c := running.Load()
		if c == nil {
			return nil
		}
		synced := c.HasSynced()
		return []capi.ClusterStatus{{Cluster: types.NamespacedName{Name: StandaloneCluster}, Connected: synced, Synced: synced, QueueDepth: c.QueueLen(), Generation: 1}}
	}))
	if err != nil {
		return err
	}
	defer unregister()
	logger.Info("Starting in standalone mode", "leaderElect", o.LeaderElect, "maxClientCertificateLifetime", o.MaxClientCertificateLifetime)
	return mgr.Start(ctx)
}
