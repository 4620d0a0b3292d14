// Package config is the node's configuration file: one YAML document read
// by every subcommand of kubelet-authenticator, with flags overriding it.
package config

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/aws"
	"sigs.k8s.io/kubelet-authenticator/attestor/azure"
	"sigs.k8s.io/kubelet-authenticator/attestor/gcp"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
)

// APIVersion and Kind identify the configuration document.
const (
	APIVersion = "kubelet-authenticator.x-k8s.io/v1alpha1"
	Kind       = "NodeConfig"
)

// Defaults.
const (
	DefaultPath                = "/etc/kubelet-authenticator/config.yaml"
	DefaultCacheDir            = "/var/lib/kubelet-authenticator"
	DefaultBootstrapKubeconfig = "/etc/kubernetes/bootstrap-kubelet.conf"
	DefaultRequestTimeout      = 5 * time.Minute
	DefaultAttestor            = "tpm"
	// DefaultMetricsBindAddress is where the agent serves /metrics and
	// /healthz unless configured otherwise or socket-activated: a unix
	// socket in a root-owned directory, which no other local user can
	// create first or connect to (see docs/node-configuration.md).
	DefaultMetricsBindAddress = "unix:" + DefaultMetricsSocket
	// DefaultMetricsSocket is the path of the default metrics socket, the
	// same one kubelet-authenticator-metrics.socket listens on.
	DefaultMetricsSocket       = "/run/kubelet-authenticator/metrics.sock"
	DefaultRenewalRetryInitial = 10 * time.Second
	DefaultRenewalRetryMax     = 5 * time.Minute
	DefaultMaxTrustBundles     = 100
	DefaultMaxTrustBundleBytes = 1 << 20
)

// Duration is a time.Duration written as a Go duration string ("5m").
type Duration struct{ time.Duration }

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	s := strings.Trim(string(b), `"`)
	if s == "" || s == "null" {
		d.Duration = 0
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("invalid duration %q: %w", s, err)
	}
	d.Duration = v
	return nil
}

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) { return []byte(`"` + d.String() + `"`), nil }

// NodeConfig is the node's configuration.
type NodeConfig struct {
	APIVersion string `json:"apiVersion,omitempty"`
	Kind       string `json:"kind,omitempty"`

	// NodeName is the name kubelet registers as. Default: the host name.
	NodeName string `json:"nodeName,omitempty"`
	// ProviderID is the provider ID the CSR claims; it must equal the
	// Machine's spec.providerID. Cloud attestors can derive it.
	ProviderID string `json:"providerID,omitempty"`
	// Attestor names the provider that proves this node: tpm, aws, azure,
	// gcp or insecure. Default: tpm.
	Attestor string `json:"attestor,omitempty"`
	// SignerName overrides the signer name. Default:
	// cluster.x-k8s.io/kube-apiserver-client-kubelet-<attestor>.
	SignerName string `json:"signerName,omitempty"`
	// BootstrapKubeconfig holds the bootstrap credential (a bootstrap
	// token) used to file the first CSR.
	BootstrapKubeconfig string `json:"bootstrapKubeconfig,omitempty"`
	// CacheDir holds the client certificate, its key and the lock.
	CacheDir string `json:"cacheDir,omitempty"`
	// RequestTimeout bounds how long a CSR is waited for.
	RequestTimeout Duration `json:"requestTimeout,omitempty"`
	// CertificateLifetime is the lifetime requested for client
	// certificates (spec.expirationSeconds); 0 leaves it to the signer.
	CertificateLifetime Duration `json:"certificateLifetime,omitempty"`

	// TPM configures the tpm attestor.
	TPM TPMConfig `json:"tpm,omitempty"`
	// AWS, Azure and GCP configure the cloud attestors (cloud.go).
	AWS   aws.AttestorConfig   `json:"aws,omitempty"`
	Azure azure.AttestorConfig `json:"azure,omitempty"`
	GCP   gcp.AttestorConfig   `json:"gcp,omitempty"`
	// Extensions holds the sections only some builds know (extensions.go):
	// test builds' null attestor (nullAttestor) and TPM simulator
	// (tpm.simulator), by dotted path. A release build's schema has no
	// such field: it refuses them as unknown.
	Extensions map[string]json.RawMessage `json:"-"`

	// Agent configures the long-running agent (`kubelet-authenticator agent`).
	Agent AgentConfig `json:"agent,omitempty"`
	// TrustBundles lists the ClusterTrustBundle projections the agent keeps
	// current on disk, each in a directory of its own.
	TrustBundles []TrustBundleProjection `json:"trustBundles,omitempty"`
	// Serving configures kubelet's serving certificate, which the agent
	// requests, renews and installs when enabled.
	Serving ServingConfig `json:"serving,omitempty"`
}

// ServingConfig configures kubelet's serving certificate: requested by the
// agent as the node itself (its client certificate) from the attested
// serving signer, with this node's evidence, and written where kubelet's
// tlsCertFile and tlsPrivateKeyFile name it.
type ServingConfig struct {
	// Enabled turns it on. Default: off (kubelet must be configured to
	// read the file, and the attestor must be one that vouches for serving
	// certificates: not insecure).
	Enabled bool `json:"enabled,omitempty"`
	// SignerName overrides the signer name. Default:
	// cluster.x-k8s.io/kubelet-serving-<attestor>.
	SignerName string `json:"signerName,omitempty"`
	// Path is the file holding the certificate chain followed by its key
	// (0600, replaced atomically): set kubelet's tlsCertFile and
	// tlsPrivateKeyFile both to it. Default:
	// <cacheDir>/kubelet-server-current.pem.
	Path string `json:"path,omitempty"`
	// DNSNames and IPAddresses are the subject alternative names to
	// request; the signer issues only addresses of the node's Machine.
	// When both are empty they are discovered: the node name, and the
	// address kubelet reports as the node's InternalIP when it has no
	// --node-ip or cloud provider (the address of the interface with the
	// default route).
	DNSNames    []string `json:"dnsNames,omitempty"`
	IPAddresses []string `json:"ipAddresses,omitempty"`
	// CertificateLifetime is the lifetime requested (spec.expirationSeconds);
	// 0 leaves it to the signer. Renewal follows the client certificate's
	// rule: at a random point between 70% and 90% of the lifetime.
	CertificateLifetime Duration `json:"certificateLifetime,omitempty"`
}

// DefaultServingFile is the name of the serving certificate file in the
// cache directory when serving.path is not set: the name kubelet's own
// serving certificate rotation uses.
const DefaultServingFile = "kubelet-server-current.pem"

// AgentConfig configures the agent.
type AgentConfig struct {
	// MetricsBindAddress is where the agent serves /metrics and /healthz
	// when systemd does not pass it a listening socket: "unix:" and an
	// absolute path (the socket is created 0600), or host:port (opt-in:
	// any local user can reach it, and one who binds it first keeps the
	// agent from serving there). "0" turns the server off. Default:
	// unix:/run/kubelet-authenticator/metrics.sock.
	MetricsBindAddress string `json:"metricsBindAddress,omitempty"`
	// RenewalRetryInitial is the wait after a first failed renewal; it
	// doubles with every further failure up to RenewalRetryMax.
	// Defaults: 10s and 5m.
	RenewalRetryInitial Duration `json:"renewalRetryInitial,omitempty"`
	RenewalRetryMax     Duration `json:"renewalRetryMax,omitempty"`
	// MaxTrustBundles and MaxTrustBundleBytes cap what one projection
	// takes in: how many ClusterTrustBundles it selects and the sum of
	// their spec.trustBundle sizes. Over either, the projection keeps its
	// last good content and reports why. Defaults: 100 and 1 MiB.
	MaxTrustBundles     int   `json:"maxTrustBundles,omitempty"`
	MaxTrustBundleBytes int64 `json:"maxTrustBundleBytes,omitempty"`
}

// TrustBundleProjection selects ClusterTrustBundle objects and names the
// file their certificates are written to. Exactly one of Name and
// SignerName is set.
type TrustBundleProjection struct {
	// Name selects one ClusterTrustBundle by name.
	Name string `json:"name,omitempty"`
	// SignerName selects the ClusterTrustBundles linked to this signer
	// (spec.signerName), narrowed by LabelSelector.
	SignerName string `json:"signerName,omitempty"`
	// LabelSelector narrows SignerName; unset or empty matches every
	// bundle of the signer. Only with SignerName.
	LabelSelector *metav1.LabelSelector `json:"labelSelector,omitempty"`
	// Path is the absolute path of the file consumers read, e.g.
	// /etc/kubernetes/trust-bundles/cluster/ca.crt. The agent owns its
	// directory: it is written like kubelet's AtomicWriter writes a volume
	// (the file is a symlink into ..data/, swapped atomically), so no other
	// projection may use the same directory.
	Path string `json:"path"`
	// PostUpdateCommand, when set, runs (argv, no shell) after each change
	// of the file, with TRUST_BUNDLE_PATH set to Path.
	PostUpdateCommand []string `json:"postUpdateCommand,omitempty"`
}

// Key identifies a projection in logs, metrics and status: its path.
func (p TrustBundleProjection) Key() string { return p.Path }

// TPMConfig configures the tpm attestor: the provider's own node
// configuration type.
type TPMConfig = tpm.NodeConfig

// Load reads the file at path. A missing file at the default path is not an
// error (every setting may come from flags); elsewhere it is.
func Load(path string) (*NodeConfig, error) {
	c := &NodeConfig{}
	if path == "" {
		return c, nil
	}
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) && path == DefaultPath {
		return c, nil
	}
	if err != nil {
		return nil, fmt.Errorf("unable to read config: %w", err)
	}
	if err := decode(data, c); err != nil {
		return nil, fmt.Errorf("unable to parse config %s: %w", path, err)
	}
	if c.APIVersion != "" && c.APIVersion != APIVersion {
		return nil, fmt.Errorf("config %s: apiVersion %q, want %q", path, c.APIVersion, APIVersion)
	}
	if c.Kind != "" && c.Kind != Kind {
		return nil, fmt.Errorf("config %s: kind %q, want %q", path, c.Kind, Kind)
	}
	return c, nil
}

// Default fills unset fields.
func (c *NodeConfig) Default() {
	if c.NodeName == "" {
		if h, err := os.Hostname(); err == nil {
			c.NodeName = strings.ToLower(h)
		}
	}
	if c.Attestor == "" {
		c.Attestor = DefaultAttestor
	}
	if c.SignerName == "" {
		c.SignerName = attestor.ClientSignerName(c.Attestor)
	}
	if c.BootstrapKubeconfig == "" {
		c.BootstrapKubeconfig = DefaultBootstrapKubeconfig
	}
	if c.CacheDir == "" {
		c.CacheDir = DefaultCacheDir
	}
	if c.RequestTimeout.Duration == 0 {
		c.RequestTimeout.Duration = DefaultRequestTimeout
	}
	if c.Serving.SignerName == "" {
		c.Serving.SignerName = attestor.ServingSignerName(c.Attestor)
	}
	if c.Serving.Path == "" && c.CacheDir != "" {
		c.Serving.Path = filepath.Join(c.CacheDir, DefaultServingFile)
	}
	if c.Agent.MetricsBindAddress == "" {
		c.Agent.MetricsBindAddress = DefaultMetricsBindAddress
	}
	if c.Agent.MaxTrustBundles == 0 {
		c.Agent.MaxTrustBundles = DefaultMaxTrustBundles
	}
	if c.Agent.MaxTrustBundleBytes == 0 {
		c.Agent.MaxTrustBundleBytes = DefaultMaxTrustBundleBytes
	}
	if c.Agent.RenewalRetryInitial.Duration == 0 {
		c.Agent.RenewalRetryInitial.Duration = DefaultRenewalRetryInitial
	}
	if c.Agent.RenewalRetryMax.Duration == 0 {
		c.Agent.RenewalRetryMax.Duration = DefaultRenewalRetryMax
	}
}

// Validate reports every problem at once.
func (c *NodeConfig) Validate() error {
	var errs []error
	if c.NodeName == "" {
		errs = append(errs, errors.New("nodeName is required (no host name to default to)"))
	}
	if !attestor.ValidProviderName(c.Attestor) {
		errs = append(errs, fmt.Errorf("attestor %q is not a valid provider name", c.Attestor))
	}
	if c.SignerName != "" && !strings.Contains(strings.SplitN(c.SignerName, "/", 2)[0], ".") {
		errs = append(errs, fmt.Errorf("signerName %q must be <domain>/<path> with a dotted domain", c.SignerName))
	}
	if c.RequestTimeout.Duration < 0 {
		errs = append(errs, errors.New("requestTimeout must not be negative"))
	}
	if c.CertificateLifetime.Duration != 0 && c.CertificateLifetime.Duration < 10*time.Minute {
		errs = append(errs, errors.New("certificateLifetime must be at least 10m (the API server's minimum) or unset"))
	}
	if c.CacheDir == "" {
		errs = append(errs, errors.New("cacheDir is required"))
	}
	errs = append(errs, c.Agent.validate()...)
	errs = append(errs, c.validateServing()...)
	errs = append(errs, c.validateProviders()...)
	dirs := map[string]int{}
	for i, p := range c.TrustBundles {
		errs = append(errs, p.validate(i)...)
		if p.Path == "" {
			continue
		}
		dir := filepath.Dir(filepath.Clean(p.Path))
		if j, ok := dirs[dir]; ok {
			errs = append(errs, fmt.Errorf("trustBundles[%d].path: directory %s is already used by trustBundles[%d]; each projection needs a directory of its own", i,
				dir, j))
		} else {
			dirs[dir] = i
		}
		if c.CacheDir != "" && (dir == filepath.Clean(c.CacheDir) || strings.HasPrefix(dir, filepath.Clean(c.CacheDir)+"/")) {
			errs = append(errs, fmt.Errorf("trustBundles[%d].path must not be inside cacheDir %s", i, c.CacheDir))
		}
	}
	return errors.Join(errs...)
}

func (c *NodeConfig) validateServing() []error {
	s := c.Serving
	if !s.Enabled {
		return nil
	}
	var errs []error
	if c.Attestor == "insecure" {
		errs = append(errs, errors.New("serving.enabled: attestor insecure issues client certificates only ("+
			"it proves nothing beyond a bootstrap token and a claimed provider ID); "+
			"use a hardware or cloud attestor, or leave kubelet's serving certificate to kubelet"))
	}
	if s.SignerName != "" && !strings.Contains(strings.SplitN(s.SignerName, "/", 2)[0], ".") {
		errs = append(errs, fmt.Errorf("serving.signerName %q must be <domain>/<path> with a dotted domain", s.SignerName))
	}
	switch {
	case s.Path == "":
		errs = append(errs, errors.New("serving.path is required"))
	case !filepath.IsAbs(s.Path) || filepath.Clean(s.Path) != s.Path:
		errs = append(errs, fmt.Errorf("serving.path %q must be a clean absolute path", s.Path))
	case c.CacheDir != "" && filepath.Dir(s.Path) == filepath.Clean(c.CacheDir) && filepath.Base(s.Path) != DefaultServingFile:
		errs = append(errs, fmt.Errorf("serving.path %q: in the cache directory, only %s is the serving certificate's", s.Path, DefaultServingFile))
	}
	for i, n := range s.DNSNames {
		for _, msg := range validation.IsDNS1123Subdomain(n) {
			errs = append(errs, fmt.Errorf("serving.dnsNames[%d] %q: %s", i, n, msg))
		}
	}
	for i, a := range s.IPAddresses {
		if ip := net.ParseIP(a); ip == nil || ip.IsUnspecified() {
			errs = append(errs, fmt.Errorf("serving.ipAddresses[%d] %q is not an IP address", i, a))
		}
	}
	if d := s.CertificateLifetime.Duration; d != 0 && d < 10*time.Minute {
		errs = append(errs, errors.New("serving.certificateLifetime must be at least 10m (the API server's minimum) or unset"))
	}
	return errs
}

func (a AgentConfig) validate() []error {
	var errs []error
	if path, ok := strings.CutPrefix(a.MetricsBindAddress, "unix:"); ok {
		if !filepath.IsAbs(path) || filepath.Clean(path) != path {
			errs = append(errs, fmt.Errorf("agent.metricsBindAddress %q: want unix: and a clean absolute path", a.MetricsBindAddress))
		}
	} else if addr := a.MetricsBindAddress; addr != "" && addr != "0" {
		if _, port, err := net.SplitHostPort(addr); err != nil {
			errs = append(errs, fmt.Errorf("agent.metricsBindAddress %q: %w", addr, err))
		} else if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
			errs = append(errs, fmt.Errorf("agent.metricsBindAddress %q: invalid port", addr))
		}
	}
	if a.RenewalRetryInitial.Duration < 0 || a.RenewalRetryMax.Duration < 0 {
		errs = append(errs, errors.New("agent.renewalRetryInitial and agent.renewalRetryMax must not be negative"))
	}
	if a.MaxTrustBundles < 0 || a.MaxTrustBundleBytes < 0 {
		errs = append(errs, errors.New("agent.maxTrustBundles and agent.maxTrustBundleBytes must not be negative"))
	}
	if a.RenewalRetryMax.Duration != 0 && a.RenewalRetryMax.Duration < a.RenewalRetryInitial.Duration {
		errs = append(errs, errors.New("agent.renewalRetryMax must not be less than agent.renewalRetryInitial"))
	}
	return errs
}

func (p TrustBundleProjection) validate(i int) []error {
	var errs []error
	field := func(f string) string { return fmt.Sprintf("trustBundles[%d].%s", i, f) }
	switch {
	case p.Name == "" && p.SignerName == "":
		errs = append(errs, fmt.Errorf("trustBundles[%d]: one of name and signerName is required", i))
	case p.Name != "" && p.SignerName != "":
		errs = append(errs, fmt.Errorf("trustBundles[%d]: name and signerName are mutually exclusive", i))
	}
	if p.Name != "" {
		for _, msg := range validation.IsDNS1123Subdomain(strings.ReplaceAll(p.Name, ":", "-")) {
			errs = append(errs, fmt.Errorf("%s %q: %s", field("name"), p.Name, msg))
		}
	}
	if p.SignerName != "" && !strings.Contains(strings.SplitN(p.SignerName, "/", 2)[0], ".") {
		errs = append(errs, fmt.Errorf("%s %q must be <domain>/<path> with a dotted domain", field("signerName"), p.SignerName))
	}
	if p.LabelSelector != nil {
		if p.SignerName == "" {
			errs = append(errs, fmt.Errorf("%s is only allowed with signerName", field("labelSelector")))
		}
		if _, err := metav1.LabelSelectorAsSelector(p.LabelSelector); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", field("labelSelector"), err))
		}
	}
	switch {
	case p.Path == "":
		errs = append(errs, fmt.Errorf("%s is required", field("path")))
	case !filepath.IsAbs(p.Path):
		errs = append(errs, fmt.Errorf("%s %q must be absolute", field("path"), p.Path))
	case filepath.Clean(p.Path) != p.Path:
		errs = append(errs, fmt.Errorf("%s %q must be clean (no trailing slash, . or ..)", field("path"), p.Path))
	case strings.HasPrefix(filepath.Base(p.Path), ".."):
		errs = append(errs, fmt.Errorf("%s %q: the file name must not start with \"..\"", field("path"), p.Path))
	case filepath.Dir(p.Path) == "/":
		errs = append(errs, fmt.Errorf("%s %q: the file must be in a directory of its own, not /", field("path"), p.Path))
	}
	if len(p.PostUpdateCommand) > 0 && p.PostUpdateCommand[0] == "" {
		errs = append(errs, fmt.Errorf("%s: the program must not be empty", field("postUpdateCommand")))
	}
	return errs
}
