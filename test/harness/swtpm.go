package harness

import (
	"net"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/device"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// StartSwtpm manufactures a swtpm (libtpms) TPM with
// test/tools/swtpm-provision.sh, its EK certificates issued by a self-made
// manufacturer CA, and runs it on a Unix socket until the test ends. With
// bootLog, a measured-boot event log, its PCRs hold the boot that log
// records (tpmtest.ExtendEventLog); without, they are at zero. It returns
// the socket's path and the path of the manufacturer CA bundle. A missing
// swtpm is a failure: test/tools/apt-packages.txt lists it.
func StartSwtpm(tb testing.TB, bootLog []byte) (sock, bundle string) {
	tb.Helper()
	for _, tool := range []string{"swtpm", "swtpm_setup", "swtpm_localca"} {
		if _, err := exec.LookPath(tool); err != nil {
			tb.Fatalf("%s not found: install the packages in test/tools/apt-packages.txt", tool)
		}
	}
	root, err := RepoRoot()
	if err != nil {
		tb.Fatal(err)
	}
	dir := tb.TempDir()
	if out, err := exec.Command(filepath.Join(root, "test", "tools", "swtpm-provision.sh"), dir).CombinedOutput(); err != nil {
		tb.Fatalf("swtpm-provision.sh: %v\n%s", err, out)
	}
	sock = filepath.Join(dir, "tpm.sock")
	StartProcess(tb, "swtpm", filepath.Join(dir, "swtpm.log"), "swtpm", "socket", "--tpm2",
		"--tpmstate", "dir="+filepath.Join(dir, "state"),
		"--server", "type=unixio,path="+sock,
		"--ctrl", "type=unixio,path="+filepath.Join(dir, "ctrl.sock"),
		"--flags", "not-need-init,startup-clear")
	// The socket file appears before swtpm listens on it: wait until it
	// answers a connection.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			tb.Fatal("swtpm did not listen on its socket")
		}
	}
	if bootLog != nil {
		// swtpm serves one connection at a time: this one closes before
		// a node opens the TPM.
		tp, err := device.Open("unix://" + sock)
		if err != nil {
			tb.Fatal(err)
		}
		err = tpmtest.ExtendEventLog(tp, bootLog)
		tp.Close()
		if err != nil {
			tb.Fatal(err)
		}
	}
	return sock, filepath.Join(dir, "manufacturer-ca.pem")
}
