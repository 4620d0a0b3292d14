package harness

import (
	"net/url"
	"path/filepath"
	"strconv"
	"testing"
)

// RestartAPIServer stops kube-apiserver and starts it again on the same
// address, against the same etcd and PKI, with extra ("--name=value")
// added to the flags it ran with, as an operator changing kube-apiserver's
// flags does. Clients keep their URL and reconnect. Its log starts anew.
func (cp *ControlPlane) RestartAPIServer(tb testing.TB, extra ...string) {
	tb.Helper()
	u, err := url.Parse(cp.URL)
	if err != nil {
		tb.Fatalf("control plane %s: %v", cp.Name, err)
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		tb.Fatalf("control plane %s: %v", cp.Name, err)
	}
	cp.apiServer.Stop(apiServerStopGrace)
	flags := append(append([]string(nil), cp.apiServerExtra...), extra...)
	p, err := startProcess("kube-apiserver", filepath.Join(cp.Dir, "kube-apiserver.log"), filepath.Join(Binaries(tb), "kube-apiserver"), cp.apiServerArgs(port,
		flags)...)
	if err != nil {
		tb.Fatalf("control plane %s: %v", cp.Name, err)
	}
	cp.apiServer, cp.apiServerExtra = p, flags
	if err := cp.waitAPIServerReady(p); err != nil {
		tb.Fatalf("control plane %s: restarted kube-apiserver: %v", cp.Name, err)
	}
}
