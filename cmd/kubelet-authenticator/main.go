// Command kubelet-authenticator is the node binary kubelet's kubeconfig and
// the systemd unit name. It is a launcher: the exec credential plugin's
// cached path (a fresh certificate in the cache) is answered here, linking
// nothing but agent/fastpath, so that the call kubelet makes most costs
// about what starting any Go program costs. Every other call is handed, with
// the same arguments and environment, to kubelet-authenticator-core,
// installed next to this binary or in /usr/libexec/kubelet-authenticator.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"sigs.k8s.io/kubelet-authenticator/agent/fastpath"
)

const core = "kubelet-authenticator-core"

func main() {
	if out, ok := fastpath.Credential(os.Args[1:], os.Getenv("KUBERNETES_EXEC_INFO"), time.Now()); ok {
		if _, err := os.Stdout.Write(out); err != nil {
			os.Exit(1)
		}
		return
	}
	var candidates []string
	if exe, err := os.Executable(); err == nil {
		candidates = append(candidates, filepath.Join(filepath.Dir(exe), core))
	}
	candidates = append(candidates, filepath.Join("/usr/libexec/kubelet-authenticator", core))
	for _, path := range candidates {
		if _, err := os.Stat(path); err != nil {
			continue
		}
		err := syscall.Exec(path, append([]string{path}, os.Args[1:]...), os.Environ())
		fmt.Fprintf(os.Stderr, "kubelet-authenticator: error: unable to run %s: %v\n", path, err)
		os.Exit(1)
	}
	fmt.Fprintf(os.Stderr, "kubelet-authenticator: error: %s not found (looked in %v)\n", core, candidates)
	os.Exit(1)
}
