package app

import (
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"sigs.k8s.io/kubelet-authenticator/agent/status"
)

func newStatusCommand(stdout io.Writer) *cobra.Command {
	o := &nodeOptions{}
	var output string
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the client certificate, the agent's last attestation and renewal, and the projected trust bundles",
		Long: `status shows what this node's credential looks like: the cached client
certificate (subject, provider ID, issuer, expiry, when it is renewed), the
agent's last attestation and renewal results, and each configured trust
bundle projection (its sources, certificate count, last update, and whether
it is stale). It reads the cache directory and the files; it needs no
network. -o json prints the same as JSON.

Exit status, for scripts and health checks:
  0  the node has a usable client certificate and nothing needs attention
  1  status could not run (unreadable or invalid configuration)
  2  no usable client certificate: none, unreadable, expired or about to
  3  a usable client certificate, but something needs attention: its
     renewal is overdue or failing, the serving certificate is missing or
     unusable, or a trust bundle is stale`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if output != "text" && output != "json" {
				return fmt.Errorf("--output %q: want text or json", output)
			}
			cfg, err := o.Complete()
			if err != nil {
				return err
			}
			now := time.Now()
			rep := status.Collect(cfg, now)
			write := rep.WriteText
			if output == "json" {
				write = func(w io.Writer, _ time.Time) error { return rep.WriteJSON(w) }
			}
			if err := write(stdout, now); err != nil {
				return err
			}
			if code, why := rep.Health(); code != status.Healthy {
				return &exitError{code: int(code), err: errors.New(why)}
			}
			return nil
		},
	}
	o.addLocationFlags(cmd.Flags())
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output format: text or json")
	return cmd
}
