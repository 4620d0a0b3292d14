// Package app is the node-attestation-controller command: its options and
// flags, the table of attestors it knows, and the controller-runtime
// Manager it runs on the Cluster API management cluster.
package app

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
	"sigs.k8s.io/kubelet-authenticator/attestor/tlsconfig"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
	"sigs.k8s.io/kubelet-authenticator/signer/challengekey"
	"sigs.k8s.io/kubelet-authenticator/signer/shard"
)

// Defaults of Options.
const (
	// DefaultMaxClientCertificateLifetime caps kubelet client certificates.
	//
	// Seven days: kubelet (and the agent) renew at 70-90% of a
	// certificate's life, so the management cluster may be unreachable for
	// about a day and a half before nodes lose their credentials, while a
	// certificate taken from a node that is gone stays useful for at most a
	// week, not the year kube-controller-manager signs for by default.
	// Shorter is safer but makes every node depend on the management
	// cluster's uptime.
	DefaultMaxClientCertificateLifetime = 7 * 24 * time.Hour
	// MinClientCertificateLifetime is Kubernetes' minimum
	// spec.expirationSeconds (10 minutes).
	MinClientCertificateLifetime = 10 * time.Minute
	// MaxClientCertificateLifetime is the largest cap accepted: a year, what
	// kube-controller-manager would sign without attestation.
	MaxClientCertificateLifetime = 365 * 24 * time.Hour
	// DefaultWorkersPerCluster, DefaultWorkloadClientQPS and
	// DefaultWorkloadClientBurst let one workload cluster's scale-up be
	// signed at up to 150 CSRs/s (every signed CSR costs two requests to
	// the workload API server: the approval, the certificate; a TPM join
	// four, on two CSRs: the challenge, closing the answered request, the
	// approval, the certificate).
	// They load only that cluster's own API server, which its joining
	// nodes write to anyway; the shared management API server stays under
	// --kube-api-qps whatever the worker count (docs/performance.md).
	DefaultWorkersPerCluster   = 8
	DefaultWorkloadClientQPS   = 300
	DefaultWorkloadClientBurst = 600
	// DefaultLeaderElectionID names the Lease.
	DefaultLeaderElectionID = "node-attestation-controller.kubelet-authenticator.x-k8s.io"
)

// inClusterNamespaceFile holds the namespace of a pod's service account.
const inClusterNamespaceFile = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// Verifiers is the table of attestors the signer knows: provider name →
// verifier half, built from the one provider table (attestor/providers)
// with the configuration the options give each: the TPM one from its flags
// (it reads, or creates, its challenge key Secret through c, and keeps
// the returned keys current and rotated until ctx ends), the cloud ones from the
// attestor configuration file, the test-only ones from their test flags.
// A provider that needs a configuration and has none is not served. A
// Cluster authorizes a subset of them.
func (o *Options) Verifiers(ctx context.Context, c client.Client) (map[string]attestor.Verifier, attestor.ChallengeKeys, error) {
	tpmConfig, key, err := o.tpmVerifierConfig(ctx, c)
	if err != nil {
		return nil, nil, fmt.Errorf("tpm attestor: %w", err)
	}
	configs, err := o.attestorConfigSections() // aws, azure, gcp (cloud.go)
	if err != nil {
		return nil, nil, err
	}
	configs[tpm.Name] = tpmConfig
	for name, cfg := range o.testVerifierConfigs() { // null, in test builds only (testattestors_*.go)
		configs[name] = cfg
	}
	table, live, err := o.verifiersFrom(ctx, c, configs)
	if err != nil {
		return nil, nil, err
	}
	if err := o.keepUpstreamsCurrent(ctx, c, live); err != nil { // upstreams.go
		return nil, nil, err
	}
	return table, key, nil
}

// verifiersFrom builds the verifier of every provider in the table that
// needs no configuration or has one in configs, and returns the upstreams
// their clients follow. ConfigMap CA bundles of outbound TLS settings are
// read through c, from the controller's namespace unless the reference
// names one.
func (o *Options) verifiersFrom(ctx context.Context, c client.Client, configs map[string]any) (map[string]attestor.Verifier, *upstreams, error) {
	live, err := o.newUpstreams()
	if err != nil {
		return nil, nil, err
	}
	env := providers.VerifierEnv{ResolveTLS: func(section string, t *tlsconfig.Config) (*tlsconfig.Config, error) {
		return live.add(section, func() (*tlsconfig.Config, error) { return o.resolveTLS(ctx, c, t) })
	}}
	table := map[string]attestor.Verifier{}
	var errs []error
	for _, d := range providers.All() {
		cfg, ok := configs[d.Name]
		if !ok && d.NewVerifierConfig != nil {
			continue
		}
		v, err := d.NewVerifier(cfg, env)
		if err != nil {
			errs = append(errs, prefixed(d.Name+" attestor", err)...)
			continue
		}
		table[d.Name] = v
	}
	return table, live, errors.Join(errs...)
}

// Options are the controller's settings.
type Options struct {
	// Kubeconfig is the management cluster's kubeconfig; "" means in-cluster.
	Kubeconfig string
	// LeaderElect runs one active replica; LeaderElectionNamespace and
	// LeaderElectionID name its Lease.
	LeaderElect             bool
	LeaderElectionNamespace string
	LeaderElectionID        string
	// MaxClientCertificateLifetime caps issued certificates' lifetime.
	MaxClientCertificateLifetime time.Duration
	// MetricsBindAddress and HealthProbeBindAddress are host:port, or "0" to
	// disable.
	MetricsBindAddress     string
	HealthProbeBindAddress string
	// WorkersPerCluster is the number of CSR workers per workload cluster.
	WorkersPerCluster int
	// KubeAPIQPS and KubeAPIBurst rate-limit the management cluster client.
	KubeAPIQPS   float32
	KubeAPIBurst int
	// WorkloadClientQPS and WorkloadClientBurst rate-limit each workload
	// cluster's client.
	WorkloadClientQPS   float32
	WorkloadClientBurst int
	// ClusterRecheckPeriod is how often opted-in Clusters' Secrets are read
	// again.
	ClusterRecheckPeriod time.Duration
	// TPM configures the TPM attestor.
	TPM TPMOptions

	// RESTConfig is the management cluster's client config. Complete loads
	// it from Kubeconfig unless it is already set (tests set it).
	RESTConfig *rest.Config
	// WorkloadRESTConfig, when set, adjusts each workload cluster's client
	// config (tests).
	WorkloadRESTConfig func(*rest.Config)
	// SkipControllerNameValidation lets Run be called more than once in a
	// process (tests); controller-runtime otherwise refuses a second
	// controller of the same name.
	SkipControllerNameValidation bool

	// fleetOptions: workload probe and lockdown periods (fleet.go).
	fleetOptions
	// boundsOptions: what each workload cluster may make the controller
	// hold or wait for (bounds.go).
	boundsOptions
	// cloudOptions: --attestor-config, the cloud attestors (cloud.go).
	cloudOptions
	// testAttestorOptions: --null-versions and --test-pod-certificate-*,
	// in test builds only (testattestors_*.go).
	testAttestorOptions
	// diagnosticsOptions: logging flags, how /metrics is secured
	// (diagnostics.go).
	diagnosticsOptions
	// shardOptions: --sharding, --watch-filter (shard.go).
	shardOptions

	completeErr error
}

// NewOptions returns Options with defaults.
func NewOptions() *Options {
	return &Options{
		LeaderElect:                  true,
		LeaderElectionID:             DefaultLeaderElectionID,
		MaxClientCertificateLifetime: DefaultMaxClientCertificateLifetime,
		MetricsBindAddress:           DefaultMetricsBindAddress,
		HealthProbeBindAddress:       ":8081",
		WorkersPerCluster:            DefaultWorkersPerCluster,
		KubeAPIQPS:                   50,
		KubeAPIBurst:                 100,
		WorkloadClientQPS:            DefaultWorkloadClientQPS,
		WorkloadClientBurst:          DefaultWorkloadClientBurst,
		ClusterRecheckPeriod:         5 * time.Minute,
		TPM: TPMOptions{KeySecretName: DefaultTPMKeySecretName, ChallengeTTL: tpm.DefaultChallengeTTL,
			KeyRotationInterval: challengekey.DefaultRotationInterval},
		boundsOptions: defaultBoundsOptions(),
		cloudOptions:  cloudOptions{UpstreamReloadInterval: DefaultUpstreamReloadInterval},
		shardOptions:  shardOptions{ShardLeaseDuration: shard.DefaultLeaseDuration},
	}
}

// AddFlags adds the options' flags to fs.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	o.fleetOptions.addFlags(fs)
	o.boundsOptions.addFlags(fs)
	o.cloudOptions.addFlags(fs)
	o.testAttestorOptions.addFlags(fs)
	o.diagnosticsOptions.addFlags(fs)
	o.shardOptions.addFlags(fs)
	fs.StringVar(&o.Kubeconfig, "kubeconfig", o.Kubeconfig, "Kubeconfig of the Cluster API management cluster. Empty: the in-cluster service account.")
	fs.BoolVar(&o.LeaderElect, "leader-elect", o.LeaderElect, "Elect a leader so that one replica is active.")
	fs.StringVar(&o.LeaderElectionNamespace, "leader-election-namespace", o.LeaderElectionNamespace,
		"The controller's own namespace: the leader election Lease and the trust-on-first-use records are kept there. Empty: the pod's namespace.")
	fs.StringVar(&o.LeaderElectionID, "leader-election-id", o.LeaderElectionID, "Name of the leader election Lease.")
	fs.DurationVar(&o.MaxClientCertificateLifetime, "max-client-certificate-lifetime", o.MaxClientCertificateLifetime,
		"Longest lifetime of an issued kubelet client certificate; a shorter spec.expirationSeconds wins, and no certificate outlives the cluster CA.")
	fs.StringVar(&o.MetricsBindAddress, "metrics-bind-address", o.MetricsBindAddress,
		"Address of the Prometheus metrics endpoint (HTTPS unless --insecure-diagnostics); \"0\" disables it.")
	fs.StringVar(&o.HealthProbeBindAddress, "health-probe-bind-address", o.HealthProbeBindAddress,
		"Address of the /healthz and /readyz endpoints; \"0\" disables them.")
	fs.IntVar(&o.WorkersPerCluster, "workers-per-cluster", o.WorkersPerCluster, "Concurrent CSR workers per workload cluster.")
	fs.Float32Var(&o.KubeAPIQPS, "kube-api-qps", o.KubeAPIQPS, "Requests per second to the management cluster's API server.")
	fs.IntVar(&o.KubeAPIBurst, "kube-api-burst", o.KubeAPIBurst, "Burst of requests to the management cluster's API server.")
	fs.Float32Var(&o.WorkloadClientQPS, "workload-client-qps", o.WorkloadClientQPS,
		"Requests per second to each workload API server (every signed CSR costs two: the approval and the certificate; a TPM join four).")
	fs.IntVar(&o.WorkloadClientBurst, "workload-client-burst", o.WorkloadClientBurst, "Burst of requests to each workload API server.")
	fs.DurationVar(&o.ClusterRecheckPeriod, "cluster-recheck-period", o.ClusterRecheckPeriod,
		"How often an opted-in Cluster's kubeconfig and CA Secrets are read again.")
	o.TPM.AddFlags(fs)
}

// Complete loads what the flags point to. Problems are reported by
// Validate, together with every other.
func (o *Options) Complete() error {
	if o.RESTConfig != nil {
		o.managementRateLimit()
		return nil
	}
	var err error
	defer o.managementRateLimit()
	if o.Kubeconfig != "" {
		o.RESTConfig, err = clientcmd.BuildConfigFromFlags("", o.Kubeconfig)
		if err != nil {
			o.completeErr = fmt.Errorf("--kubeconfig: unable to load %s: %w", o.Kubeconfig, err)
		}
		return nil
	}
	o.RESTConfig, err = rest.InClusterConfig()
	if err != nil {
		o.completeErr = fmt.Errorf("--kubeconfig: not running in a cluster (%w); point --kubeconfig at the management cluster", err)
	}
	return nil
}

// managementRateLimit sets the management cluster client's rate limits from
// the flags: client-go's default (5 QPS) would throttle every decision's
// trust-on-first-use reads.
func (o *Options) managementRateLimit() {
	if o.RESTConfig != nil {
		o.RESTConfig = rest.CopyConfig(o.RESTConfig)
		o.RESTConfig.QPS, o.RESTConfig.Burst = o.KubeAPIQPS, o.KubeAPIBurst
	}
}

// Validate reports every problem with the options at once.
func (o *Options) Validate() error {
	var errs []error
	if o.completeErr != nil {
		errs = append(errs, o.completeErr)
	} else if o.RESTConfig == nil {
		errs = append(errs, errors.New("no management cluster configuration: call Complete"))
	}
	if o.LeaderElect && o.LeaderElectionID == "" {
		errs = append(errs, errors.New("--leader-election-id must not be empty with --leader-elect"))
	}
	if o.LeaderElectionNamespace == "" {
		// The controller's own namespace holds the Lease and the
		// trust-on-first-use records.
		if _, err := os.Stat(inClusterNamespaceFile); err != nil {
			errs = append(errs, errors.New("--leader-election-namespace (the controller's own namespace: "+
				"its Lease and trust-on-first-use records) is required outside a cluster"))
		}
	}
	if l := o.MaxClientCertificateLifetime; l < MinClientCertificateLifetime || l > MaxClientCertificateLifetime {
		errs = append(errs, fmt.Errorf("--max-client-certificate-lifetime %s must be between %s and %s", l, MinClientCertificateLifetime,
			MaxClientCertificateLifetime))
	}
	for _, a := range []struct{ flag, addr string }{
		{"--metrics-bind-address", o.MetricsBindAddress},
		{"--health-probe-bind-address", o.HealthProbeBindAddress},
	} {
		flag, addr := a.flag, a.addr
		if addr == "0" {
			continue
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			errs = append(errs, fmt.Errorf("%s %q is not host:port or \"0\": %w", flag, addr, err))
		}
	}
	if o.KubeAPIQPS <= 0 || o.KubeAPIBurst < 1 {
		errs = append(errs, fmt.Errorf("--kube-api-qps (%v) and --kube-api-burst (%d) must be positive", o.KubeAPIQPS, o.KubeAPIBurst))
	}
	if o.WorkloadClientQPS <= 0 || o.WorkloadClientBurst < 1 {
		errs = append(errs, fmt.Errorf("--workload-client-qps (%v) and --workload-client-burst (%d) must be positive", o.WorkloadClientQPS, o.WorkloadClientBurst))
	}
	if o.WorkersPerCluster < 1 || o.WorkersPerCluster > 64 {
		errs = append(errs, fmt.Errorf("--workers-per-cluster %d must be between 1 and 64", o.WorkersPerCluster))
	}
	if o.ClusterRecheckPeriod < 10*time.Second {
		errs = append(errs, fmt.Errorf("--cluster-recheck-period %s must be at least 10s", o.ClusterRecheckPeriod))
	}
	errs = append(errs, o.TPM.validate()...)
	errs = append(errs, o.fleetOptions.validate()...)
	errs = append(errs, o.boundsOptions.validate()...)
	errs = append(errs, o.cloudOptions.validate()...)
	errs = append(errs, o.testAttestorOptions.validate()...)
	errs = append(errs, o.diagnosticsOptions.validate()...)
	errs = append(errs, o.shardOptions.validate(o.LeaderElectionID)...)
	return errors.Join(errs...)
}
