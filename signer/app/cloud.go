package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"sigs.k8s.io/kubelet-authenticator/attestor/aws"
	"sigs.k8s.io/kubelet-authenticator/attestor/azure"
	"sigs.k8s.io/kubelet-authenticator/attestor/gcp"
	"sigs.k8s.io/kubelet-authenticator/attestor/providers"
	"sigs.k8s.io/kubelet-authenticator/attestor/tlsconfig"
)

// APIVersion and kind of the attestor configuration file.
const (
	AttestorConfigAPIVersion = "kubelet-authenticator.x-k8s.io/v1alpha1"
	AttestorConfigKind       = "AttestorConfig"
)

// AttestorConfig is the file --attestor-config names: the verifier settings
// of the cloud attestors, one section each, in the providers' own
// VerifierConfig types. A provider without a section is not served: the
// controller does not watch its signer name, and its requests stay pending
// for another signer. A file, not flags: allowlists, CA bundles and
// per-upstream TLS settings are lists and nested objects, and one file is
// one ConfigMap to mount.
type AttestorConfig struct {
	APIVersion string `json:"apiVersion,omitempty"`
	Kind       string `json:"kind,omitempty"`

	AWS   *aws.VerifierConfig   `json:"aws,omitempty"`
	Azure *azure.VerifierConfig `json:"azure,omitempty"`
	GCP   *gcp.VerifierConfig   `json:"gcp,omitempty"`
}

// LoadAttestorConfig reads and parses an attestor configuration file,
// rejecting unknown fields.
func LoadAttestorConfig(path string) (*AttestorConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("unable to read %s: %w", path, err)
	}
	c := &AttestorConfig{}
	if err := yaml.UnmarshalStrict(data, c); err != nil {
		return nil, fmt.Errorf("unable to parse %s: %w", path, err)
	}
	return c, nil
}

// Validate reports every structural problem at once; what needs files or
// the management cluster (certificates, ConfigMap CA bundles) is checked
// when the verifiers are built.
func (c *AttestorConfig) Validate() error {
	var errs []error
	if c.APIVersion != "" && c.APIVersion != AttestorConfigAPIVersion {
		errs = append(errs, fmt.Errorf("apiVersion %q, want %q", c.APIVersion, AttestorConfigAPIVersion))
	}
	if c.Kind != "" && c.Kind != AttestorConfigKind {
		errs = append(errs, fmt.Errorf("kind %q, want %q", c.Kind, AttestorConfigKind))
	}
	if c.AWS == nil && c.Azure == nil && c.GCP == nil {
		errs = append(errs, errors.New("configures no attestor: add an aws, azure or gcp section"))
	}
	if c.AWS != nil {
		if len(c.AWS.Accounts) == 0 {
			errs = append(errs, errors.New("aws.accounts: at least one AWS account ID is required"))
		}
		if len(c.AWS.AllowedRoles) == 0 {
			errs = append(errs, errors.New("aws.allowedRoles: list the IAM role (name or ARN) of your nodes' instance profile, "+
				"e.g. nodes.cluster-api-provider-aws.sigs.k8s.io for Cluster API Provider AWS"))
		}
	}
	if c.Azure != nil {
		if len(c.Azure.Subscriptions) == 0 {
			errs = append(errs, errors.New("azure.subscriptions: at least one subscription ID is required"))
		}
	}
	if c.GCP != nil {
		if len(c.GCP.Projects) == 0 {
			errs = append(errs, errors.New("gcp.projects: at least one project ID is required"))
		}
	}
	for _, section := range slices.Sorted(maps.Keys(c.tlsFields())) {
		if err := (*c.tlsFields()[section]).Validate(); err != nil {
			errs = append(errs, prefixed(section, err)...)
		}
	}
	return errors.Join(errs...)
}

// tlsFields returns the outbound settings of every upstream of the
// providers c has a section for, by section name (providers.AWSSTSTLS...):
// where to read them, and where to clear them.
func (c *AttestorConfig) tlsFields() map[string]**tlsconfig.Config {
	out := map[string]**tlsconfig.Config{}
	if c.AWS != nil {
		out[providers.AWSSTSTLS] = &c.AWS.STS.TLS
	}
	if c.Azure != nil {
		out[providers.AzureIssuersTLS] = &c.Azure.Issuers.TLS
	}
	if c.GCP != nil {
		out[providers.GCPJWKSTLS] = &c.GCP.JWKS.TLS
	}
	return out
}

// withoutTLS returns c without its tls blocks, serialized: what a change
// of which needs a restart.
func (c *AttestorConfig) withoutTLS() ([]byte, error) {
	data, err := json.Marshal(c)
	if err != nil {
		return nil, err
	}
	var cp AttestorConfig
	if err := json.Unmarshal(data, &cp); err != nil {
		return nil, err
	}
	for _, f := range cp.tlsFields() {
		*f = nil
	}
	return json.Marshal(&cp)
}

// cloudOptions is the --attestor-config flag and what it loaded.
type cloudOptions struct {
	// AttestorConfigFile is the path of an AttestorConfig; empty serves no
	// cloud attestor.
	AttestorConfigFile string
	// UpstreamReloadInterval is how often the outbound settings of the
	// cloud attestors' upstreams are read again (upstreams.go); 0 never.
	UpstreamReloadInterval time.Duration

	attestorConfig *AttestorConfig
}

// DefaultUpstreamReloadInterval is --upstream-reload-interval's default.
const DefaultUpstreamReloadInterval = 10 * time.Second

func (o *cloudOptions) addFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.AttestorConfigFile, "attestor-config", o.AttestorConfigFile,
		"YAML file (kind "+AttestorConfigKind+") configuring the cloud attestors: aws, azure and gcp sections, each with its allowlist, "+
			"trusted roots and outbound TLS. A provider without a section is not served.")
	fs.DurationVar(&o.UpstreamReloadInterval, "upstream-reload-interval", o.UpstreamReloadInterval,
		"How often the tls blocks of --attestor-config (proxy, securityProfile, trustedCA) and the trustedCA files and ConfigMaps they name are read again; "+
			"a change applies to new connections without a restart, an invalid one keeps the last good settings. 0 reads them only at start.")
}

// validate loads the file and reports its problems, prefixed with the flag.
func (o *cloudOptions) validate() []error {
	o.attestorConfig = nil
	if o.UpstreamReloadInterval < 0 || (o.UpstreamReloadInterval > 0 && o.UpstreamReloadInterval < time.Second) {
		return []error{fmt.Errorf("--upstream-reload-interval %s must be 0 or at least 1s", o.UpstreamReloadInterval)}
	}
	if o.AttestorConfigFile == "" {
		return nil
	}
	c, err := LoadAttestorConfig(o.AttestorConfigFile)
	if err == nil {
		err = c.Validate()
	}
	if err != nil {
		return prefixed("--attestor-config "+o.AttestorConfigFile, err)
	}
	o.attestorConfig = c
	return nil
}

// attestorConfigSections returns the verifier configurations the attestor
// configuration file holds, by provider name: the sections whose key is a
// provider's VerifierSection in the provider table.
func (o *Options) attestorConfigSections() (map[string]any, error) {
	if o.attestorConfig == nil && o.AttestorConfigFile != "" {
		// Validate was not called (a caller that builds Options itself).
		if errs := o.cloudOptions.validate(); len(errs) > 0 {
			return nil, errors.Join(errs...)
		}
	}
	out := map[string]any{}
	if o.attestorConfig == nil {
		return out, nil
	}
	v := reflect.ValueOf(o.attestorConfig).Elem()
	for _, d := range providers.All() {
		if d.VerifierSection == "" {
			continue
		}
		for i := 0; i < v.NumField(); i++ {
			name, _, _ := strings.Cut(v.Type().Field(i).Tag.Get("json"), ",")
			if f := v.Field(i); name == d.VerifierSection && f.Kind() == reflect.Pointer && !f.IsNil() {
				out[d.Name] = f.Interface()
			}
		}
	}
	return out, nil
}

// resolveTLS returns a copy of t whose ConfigMap CA bundle, if any, is read
// into TrustedCA.PEM (a trustedCA file is read by tlsconfig.Upstream.Set).
func (o *Options) resolveTLS(ctx context.Context, c client.Client, t *tlsconfig.Config) (*tlsconfig.Config, error) {
	if t == nil || t.TrustedCA == nil || t.TrustedCA.ConfigMap == nil {
		return t, nil
	}
	ref := t.TrustedCA.ConfigMap
	nn := types.NamespacedName{Namespace: ref.Namespace, Name: ref.Name}
	if nn.Namespace == "" {
		nn.Namespace = o.namespace()
	}
	if nn.Namespace == "" {
		return nil, fmt.Errorf("trustedCA.configMap %s names no namespace, and the controller's own is unknown outside a cluster without --leader-election-namespace",
			ref.Name)
	}
	var cm corev1.ConfigMap
	if err := c.Get(ctx, nn, &cm); err != nil {
		return nil, fmt.Errorf("unable to read trustedCA ConfigMap %s: %w", nn, err)
	}
	bundle, ok := cm.Data[tlsconfig.ConfigMapKey]
	if !ok {
		return nil, fmt.Errorf("trustedCA ConfigMap %s has no key %s", nn, tlsconfig.ConfigMapKey)
	}
	out := *t
	ca := *t.TrustedCA
	ca.PEM = []byte(bundle)
	out.TrustedCA = &ca
	return &out, nil
}

// prefixed splits a joined error and prefixes each part with what it is
// about.
func prefixed(what string, err error) []error {
	parts := []error{err}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		parts = j.Unwrap()
	}
	out := make([]error, 0, len(parts))
	for _, e := range parts {
		out = append(out, fmt.Errorf("%s: %w", what, e))
	}
	return out
}
