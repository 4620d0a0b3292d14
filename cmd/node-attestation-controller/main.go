// Command node-attestation-controller approves and signs attested kubelet
// client certificates for Cluster API workload clusters. See signer/app.
package main

import (
	"os"

	"sigs.k8s.io/kubelet-authenticator/signer/app"
)

func main() {
	if err := app.NewCommand().Execute(); err != nil {
		os.Exit(1)
	}
}
