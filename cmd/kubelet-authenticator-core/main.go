// Command kubelet-authenticator-core is the node's full implementation: the
// exec credential plugin's slow path (attest, file a CSR, wait), the agent
// and status. Users run it through the kubelet-authenticator launcher, which
// answers the plugin's cached path itself and executes this program for
// everything else.
package main

import (
	"context"
	"os"

	"sigs.k8s.io/kubelet-authenticator/agent/app"
)

func main() {
	os.Exit(app.Main(context.Background(), os.Args[1:]))
}
