package app

import (
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
network. -o json prints the same as JSON.`,
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
			if output == "json" {
				return rep.WriteJSON(stdout)
			}
			return rep.WriteText(stdout, now)
		},
	}
	o.AddFlags(cmd.Flags())
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output format: text or json")
	return cmd
}
