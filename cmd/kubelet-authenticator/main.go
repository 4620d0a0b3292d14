// Command kubelet-authenticator is the node binary: the exec credential
// plugin kubelet's kubeconfig runs (credential), the service beside kubelet
// (agent) and status. It is built from agent/app. The plugin's most frequent
// call, a fresh cached certificate, stays cheap through what the binary
// links (no clientset, no informers, no discovery client), not through a
// second binary; make bench measures it against a minimal Go program.
package main

import (
	"context"
	"os"

	"sigs.k8s.io/kubelet-authenticator/agent/app"
)

func main() {
	os.Exit(app.Main(context.Background(), os.Args[1:]))
}
