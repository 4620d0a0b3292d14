// Package providers is the one table of attestation providers both
// binaries read: for each provider its name, the type of its node
// configuration section and the constructor of its node half, the type of
// its verifier configuration and the constructor of its verifier half.
//
// Release providers are one line each in release below. Test-only
// providers enter through Register, called only from files with the build
// tag testattestors, so a release build's table, and the configuration
// schemas built from it, do not know them.
package providers

import (
	"fmt"
	"slices"
	"sort"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/aws"
	"sigs.k8s.io/kubelet-authenticator/attestor/azure"
	"sigs.k8s.io/kubelet-authenticator/attestor/gcp"
	"sigs.k8s.io/kubelet-authenticator/attestor/insecure"
	"sigs.k8s.io/kubelet-authenticator/attestor/tlsconfig"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm"
)

// NodeEnv is what the node binary lends a node half: access to hardware
// the table itself must not link (the controller links this package too).
type NodeEnv struct {
	// OpenTPM returns how to open the TPM a device specification names
	// and whether the host's measured-boot event log describes that TPM.
	OpenTPM func(device string) (open tpm.Opener, hostEventLog bool, err error)
}

// VerifierEnv is what the controller lends a verifier half.
type VerifierEnv struct {
	// ResolveTLS returns the outbound settings of one upstream, named by
	// where they sit in the controller's AttestorConfig ("aws.sts.tls"),
	// with their ConfigMap CA bundle, if any, read in, and, in the
	// controller, bound to a tlsconfig.Upstream it keeps current. Nil
	// leaves the settings as they are.
	ResolveTLS func(section string, t *tlsconfig.Config) (*tlsconfig.Config, error)
}

// The sections of the controller's AttestorConfig that configure an
// upstream.
const (
	AWSSTSTLS       = "aws.sts.tls"
	AzureIssuersTLS = "azure.issuers.tls"
	GCPJWKSTLS      = "gcp.jwks.tls"
)

func (e VerifierEnv) resolveTLS(section string, t *tlsconfig.Config) (*tlsconfig.Config, error) {
	if e.ResolveTLS == nil {
		return t, nil
	}
	return e.ResolveTLS(section, t)
}

// Descriptor describes one provider.
type Descriptor struct {
	// Name is the provider name: the attestor field of the node
	// configuration and the suffix of its signer names.
	Name string
	// TestOnly marks a provider only test builds contain.
	TestOnly bool

	// NodeSection is the key of the provider's section of the node
	// configuration; empty when it has none.
	NodeSection string
	// NewNodeConfig returns a pointer to a new zero node configuration;
	// nil when the provider has none.
	NewNodeConfig func() any
	// NewAttestor builds the node half from a value of the node
	// configuration type (not a pointer; nil when it has none).
	NewAttestor func(cfg any, env NodeEnv) (attestor.Attestor, error)

	// VerifierSection is the key of the provider's section of the
	// controller's AttestorConfig file; empty when the provider is
	// configured by flags, or needs no configuration.
	VerifierSection string
	// NewVerifierConfig returns a pointer to a new zero verifier
	// configuration; nil when the provider needs none (it is then always
	// served).
	NewVerifierConfig func() any
	// NewVerifier builds the verifier half from a value of the verifier
	// configuration type (nil when it has none).
	NewVerifier func(cfg any, env VerifierEnv) (attestor.Verifier, error)
}

// release is the table of released providers: one line each.
var release = []Descriptor{
	Provider(insecure.Name, "", insecureAttestor, "", insecureVerifier),
	Provider(tpm.Name, "tpm", tpmAttestor, "", tpmVerifier),
	Provider(aws.Name, "aws", plain(aws.NewAttestor), "aws", awsVerifier),
	Provider(azure.Name, "azure", plain(azure.NewAttestor), "azure", azureVerifier),
	Provider(gcp.Name, "gcp", plain(gcp.NewAttestor), "gcp", gcpVerifier),
}

// registered holds the providers Register added (test builds).
var registered []Descriptor

// Register adds a test-only provider. Only files with the build tag
// testattestors call it, from init.
func Register(d Descriptor) {
	d.TestOnly = true
	if _, ok := Lookup(d.Name); ok {
		panic(fmt.Sprintf("providers: %q registered twice", d.Name))
	}
	registered = append(registered, d)
}

// All returns every provider this binary contains, sorted by name.
func All() []Descriptor {
	out := append(slices.Clone(release), registered...)
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Lookup returns the provider named name.
func Lookup(name string) (Descriptor, bool) {
	for _, d := range append(slices.Clone(release), registered...) {
		if d.Name == name {
			return d, true
		}
	}
	return Descriptor{}, false
}

// Names returns the names of every provider this binary contains, sorted.
func Names() []string {
	var names []string
	for _, d := range All() {
		names = append(names, d.Name)
	}
	return names
}

// None is the configuration type of a half that takes none.
type None struct{}

// Provider builds a descriptor from typed constructors: N is the node
// configuration type, V the verifier configuration type (None for none).
func Provider[N, V any](name, nodeSection string, newAttestor func(N, NodeEnv) (attestor.Attestor, error),
	verifierSection string, newVerifier func(V, VerifierEnv) (attestor.Verifier, error)) Descriptor {
	d := Descriptor{Name: name, NodeSection: nodeSection, VerifierSection: verifierSection}
	if _, none := any(*new(N)).(None); !none {
		d.NewNodeConfig = func() any { return new(N) }
	}
	if _, none := any(*new(V)).(None); !none {
		d.NewVerifierConfig = func() any { return new(V) }
	}
	d.NewAttestor = func(cfg any, env NodeEnv) (attestor.Attestor, error) {
		c, err := value[N](name, "node", cfg)
		if err != nil {
			return nil, err
		}
		return newAttestor(c, env)
	}
	d.NewVerifier = func(cfg any, env VerifierEnv) (attestor.Verifier, error) {
		c, err := value[V](name, "verifier", cfg)
		if err != nil {
			return nil, err
		}
		return newVerifier(c, env)
	}
	return d
}

// value converts cfg (nil, T or *T) to T.
func value[T any](name, half string, cfg any) (T, error) {
	var zero T
	switch c := cfg.(type) {
	case nil:
		return zero, nil
	case T:
		return c, nil
	case *T:
		if c == nil {
			return zero, nil
		}
		return *c, nil
	}
	return zero, fmt.Errorf("%s attestor: %s configuration of type %T, want %T", name, half, cfg, zero)
}

// plain adapts a node constructor that needs nothing from the node.
func plain[N any, A attestor.Attestor](f func(N) (A, error)) func(N, NodeEnv) (attestor.Attestor, error) {
	return func(c N, _ NodeEnv) (attestor.Attestor, error) { return f(c) }
}

func insecureAttestor(None, NodeEnv) (attestor.Attestor, error) { return insecure.Attestor{}, nil }

func insecureVerifier(None, VerifierEnv) (attestor.Verifier, error) { return insecure.Verifier{}, nil }

func tpmAttestor(c tpm.NodeConfig, env NodeEnv) (attestor.Attestor, error) {
	if env.OpenTPM == nil {
		return nil, fmt.Errorf("tpm attestor: this binary cannot open a TPM")
	}
	open, hostLog, err := env.OpenTPM(c.Device)
	if err != nil {
		return nil, err
	}
	cfg := c.AttestorConfig()
	if !hostLog {
		// The host's own event log does not describe this TPM's PCRs.
		cfg.NoEventLog = true
	}
	return tpm.New(open, cfg)
}

func tpmVerifier(c tpm.VerifierConfig, _ VerifierEnv) (attestor.Verifier, error) {
	return tpm.NewVerifier(c)
}

func awsVerifier(c aws.VerifierConfig, env VerifierEnv) (attestor.Verifier, error) {
	var err error
	if c.STS.TLS, err = env.resolveTLS(AWSSTSTLS, c.STS.TLS); err != nil {
		return nil, fmt.Errorf("sts.tls: %w", err)
	}
	return aws.NewVerifier(c)
}

func azureVerifier(c azure.VerifierConfig, env VerifierEnv) (attestor.Verifier, error) {
	if !c.Issuers.Disabled {
		var err error
		if c.Issuers.TLS, err = env.resolveTLS(AzureIssuersTLS, c.Issuers.TLS); err != nil {
			return nil, fmt.Errorf("issuers.tls: %w", err)
		}
	}
	return azure.NewVerifier(c)
}

func gcpVerifier(c gcp.VerifierConfig, env VerifierEnv) (attestor.Verifier, error) {
	var err error
	if c.JWKS.TLS, err = env.resolveTLS(GCPJWKSTLS, c.JWKS.TLS); err != nil {
		return nil, fmt.Errorf("jwks.tls: %w", err)
	}
	return gcp.NewVerifier(c)
}
