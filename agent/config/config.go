// Package config is the node's configuration file: one YAML document read
// by every subcommand of kubelet-authenticator, with flags overriding it.
package config

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

	"sigs.k8s.io/kubelet-authenticator/agent/fastpath"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// APIVersion and Kind identify the configuration document.
const (
	APIVersion = "kubelet-authenticator.x-k8s.io/v1alpha1"
	Kind       = "NodeConfig"
)

// Defaults.
const (
	DefaultPath                = fastpath.DefaultConfigPath
	DefaultCacheDir            = fastpath.DefaultCacheDir
	DefaultBootstrapKubeconfig = "/etc/kubernetes/bootstrap-kubelet.conf"
	DefaultRequestTimeout      = 5 * time.Minute
	DefaultAttestor            = "tpm"
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
}

// TPMConfig configures the tpm attestor.
type TPMConfig struct {
	// Device is the TPM to use: a character device (default /dev/tpmrm0,
	// the kernel's resource manager), unix:///path or tcp://host:port for a
	// socket TPM such as swtpm. Test builds also accept "simulator".
	Device string `json:"device,omitempty"`
	// EndorsementKeys lists EK kinds to prefer (rsa2048, ecc-p256,
	// ecc-p384); by default the first with a certificate in that order.
	EndorsementKeys []string `json:"endorsementKeys,omitempty"`
	// Simulator configures the in-process simulator (test builds only):
	// a fixed seed stands for one machine's TPM, and its EK certificate is
	// issued at start by the manufacturer CA saved in ManufacturerCADir.
	Simulator *TPMSimulatorConfig `json:"simulator,omitempty"`
}

// TPMSimulatorConfig configures the in-process TPM simulator.
type TPMSimulatorConfig struct {
	Seed              int64  `json:"seed"`
	ManufacturerCADir string `json:"manufacturerCADir"`
}

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
	if err := yaml.UnmarshalStrict(data, c); err != nil {
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
	return errors.Join(errs...)
}
