package app

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/credential"
)

func newCredentialCommand(stdout, stderr io.Writer) *cobra.Command {
	o := &nodeOptions{}
	verbose := false
	cmd := &cobra.Command{
		Use:   "credential",
		Short: "Exec credential plugin: print kubelet's client certificate as an ExecCredential",
		Long: `credential is the client-go exec credential plugin (client.authentication.k8s.io/v1)
named in kubelet's kubeconfig. It prints only the ExecCredential JSON on
stdout.

When the cached certificate is fresh it is returned at once. Otherwise the
command takes the cache lock, attests, files a certificate signing request
with the bootstrap credential (or, to renew, with the current certificate),
waits for the signer (bounded by --timeout), stores the key and certificate
(0600) and returns them. A failed renewal keeps a still-valid certificate.

kubeconfig user entry:

  exec:
    apiVersion: client.authentication.k8s.io/v1
    command: /usr/local/bin/kubelet-authenticator
    args: ["credential"]
    interactiveMode: Never
    provideClusterInfo: true`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			info, err := credential.ExecInfo(os.Getenv("KUBERNETES_EXEC_INFO"))
			if err != nil {
				return err
			}
			cfg, err := o.Complete()
			if err != nil {
				return err
			}
			apiVersion := ""
			if info != nil {
				apiVersion = info.APIVersion
			}
			// The path kubelet takes most: a fresh cached certificate,
			// answered from the cache file's header; no X.509 parsing, no
			// attestor, no lock, no network.
			if certPEM, keyPEM, expires, ok := (cache.Dir{Path: cfg.CacheDir}).Fresh(cfg.NodeName, time.Now()); ok {
				out, err := credential.MarshalPEM(apiVersion, certPEM, keyPEM, expires)
				if err != nil {
					return err
				}
				_, err = stdout.Write(out)
				return err
			}
			src := &credential.Source{Config: cfg}
			if verbose {
				src.Logf = func(format string, args ...any) {
					fmt.Fprintf(stderr, "kubelet-authenticator: "+format+"\n", args...)
				}
			}
			if info != nil {
				src.Cluster = info.Spec.Cluster
			}
			if src.Attestor, err = newAttestor(cfg); err != nil {
				return err
			}
			// Get looks at the cache again, under the lock, and renews only
			// if it must.
			cred, expires, err := src.Get(cmd.Context())
			if err != nil {
				return err
			}
			out, err := credential.Marshal(apiVersion, cred, expires)
			if err != nil {
				return err
			}
			_, err = stdout.Write(out)
			return err
		},
	}
	o.AddFlags(cmd.Flags())
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "log progress (attestation, CSR name, signer decision) on stderr; by default a failure is one line and success prints nothing there")
	return cmd
}
