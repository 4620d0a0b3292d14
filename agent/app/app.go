// Package app builds the kubelet-authenticator command: the exec credential
// plugin kubelet calls, the agent that runs beside kubelet, and status.
package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/version"
)

// NewCommand returns the root command.
func NewCommand(stdout, stderr io.Writer) *cobra.Command {
	root := &cobra.Command{
		Use:   "kubelet-authenticator",
		Short: "Attested kubelet client (and serving) certificates and trust bundles for a Kubernetes node",
		Long: `kubelet-authenticator proves what this node is (its TPM, or its cloud
provider's signed identity) inside the certificate signing request that gets
kubelet its client certificate, so that a bootstrap token alone cannot
register a node.

  credential   the client-go exec credential plugin kubelet's kubeconfig runs
  agent        the service beside kubelet: renewal, kubelet's serving
               certificate (serving.enabled), trust bundles, metrics
  status       the certificate, the last renewal, the trust bundles
  version      print the version`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       version.String(),
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	// --version without a shorthand: -v is the log level wherever it
	// exists (credential, agent), as in kubectl and Cluster API.
	root.Flags().Bool("version", false, "print the version")
	root.AddCommand(newCredentialCommand(stdout, stderr))
	root.AddCommand(newAgentCommand())
	root.AddCommand(newStatusCommand(stdout))
	root.AddCommand(&cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run:   func(cmd *cobra.Command, _ []string) { fmt.Fprintln(stdout, version.String()) },
	})
	return root
}

// Main runs the command and returns the process exit code. Errors are
// printed as one line on stderr.
func Main(ctx context.Context, args []string) int {
	var err error
	if call, ok := parseCredentialCall(args, os.Getenv("KUBERNETES_EXEC_INFO")); ok {
		err = call.run(ctx, os.Stdout, os.Stderr, time.Now())
	} else {
		cmd := NewCommand(os.Stdout, os.Stderr)
		cmd.SetArgs(args)
		err = cmd.ExecuteContext(ctx)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-authenticator: error: %s\n", oneLine(err))
		var ex *exitError
		if errors.As(err, &ex) {
			return ex.code
		}
		return 1
	}
	return 0
}

type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func oneLine(err error) string {
	s := []rune(err.Error())
	for i, r := range s {
		if r == '\n' {
			s[i] = ';'
		}
	}
	return string(s)
}

// nodeOptions are the settings every node subcommand shares: a config file
// and flags that override it.
type nodeOptions struct {
	configPath string
	override   config.NodeConfig
	flags      *pflag.FlagSet
}

func (o *nodeOptions) AddFlags(fs *pflag.FlagSet) {
	o.addLocationFlags(fs)
	fs.StringVar(&o.override.ProviderID, "provider-id", "", "provider ID to claim; must equal the Machine's spec.providerID")
	fs.StringVar(&o.override.Attestor, "attestor", "", "attestor proving this node: tpm, aws, azure, gcp, insecure (default tpm)")
	fs.StringVar(&o.override.SignerName, "signer-name", "", "signer name (default cluster.x-k8s.io/kube-apiserver-client-kubelet-<attestor>)")
	fs.StringVar(&o.override.BootstrapKubeconfig, "bootstrap-kubeconfig", "",
		"kubeconfig holding the bootstrap credential (default "+config.DefaultBootstrapKubeconfig+")")
	fs.DurationVar(&o.override.RequestTimeout.Duration, "timeout", 0, "how long to wait for the certificate signing request to be signed (default 5m)")
	fs.DurationVar(&o.override.CertificateLifetime.Duration, "certificate-lifetime", 0, "client certificate lifetime to request (default: the signer's)")
}

// addLocationFlags adds the flags that say which node and which files: all
// status needs.
func (o *nodeOptions) addLocationFlags(fs *pflag.FlagSet) {
	o.flags = fs
	fs.StringVar(&o.configPath, "config", config.DefaultPath, "path of the node configuration file (YAML, kind NodeConfig)")
	fs.StringVar(&o.override.NodeName, "node-name", "", "node name to register as (default: the host name)")
	fs.StringVar(&o.override.CacheDir, "cache-dir", "", "directory holding the client certificate, key and lock (default "+config.DefaultCacheDir+")")
}

// Complete loads the config file, applies flags over it and fills defaults.
func (o *nodeOptions) Complete() (*config.NodeConfig, error) {
	c, err := config.Load(o.configPath)
	if err != nil {
		return nil, err
	}
	set := func(name string, dst *string, v string) {
		if o.flags.Changed(name) {
			*dst = v
		}
	}
	set("node-name", &c.NodeName, o.override.NodeName)
	set("provider-id", &c.ProviderID, o.override.ProviderID)
	set("attestor", &c.Attestor, o.override.Attestor)
	set("signer-name", &c.SignerName, o.override.SignerName)
	set("bootstrap-kubeconfig", &c.BootstrapKubeconfig, o.override.BootstrapKubeconfig)
	set("cache-dir", &c.CacheDir, o.override.CacheDir)
	if o.flags.Changed("timeout") {
		c.RequestTimeout = o.override.RequestTimeout
	}
	if o.flags.Changed("certificate-lifetime") {
		c.CertificateLifetime = o.override.CertificateLifetime
	}
	c.Default()
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("invalid configuration: %w", err)
	}
	return c, nil
}
