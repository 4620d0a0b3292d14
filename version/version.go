// Package version reports the build's version, set at link time:
//
//	-ldflags "-X sigs.k8s.io/kubelet-authenticator/version.gitVersion=v0.1.0 -X sigs.k8s.io/kubelet-authenticator/version.gitCommit=..."
package version

import "runtime"

var (
	gitVersion = "v0.0.0-dev"
	gitCommit  = "unknown"
)

// String returns "<version> (commit <commit>, <go version>)".
func String() string {
	return gitVersion + " (commit " + gitCommit + ", " + runtime.Version() + ")"
}
