// Command kubelet-authenticator is the node binary: kubelet's exec credential
// plugin, the node agent, and status.
package main

import (
	"context"
	"os"

	"sigs.k8s.io/kubelet-authenticator/agent/app"
)

func main() {
	os.Exit(app.Main(context.Background(), os.Args[1:]))
}
