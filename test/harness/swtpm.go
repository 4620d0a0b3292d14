package harness

import (
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/device"
	"sigs.k8s.io/kubelet-authenticator/attestor/tpm/tpmtest"
)

// Swtpm is a running swtpm (libtpms) TPM.
type Swtpm struct {
	// Sock is the path of its command socket (device "unix://" + Sock).
	Sock string
	// Bundle is the path of its manufacturer CA bundle (root and
	// intermediate), what a verifier trusts.
	Bundle string
	// Process is the swtpm process.
	Process *Process
}

// StartSwtpm manufactures a swtpm (libtpms) TPM with
// test/tools/swtpm-provision.sh, its EK certificates issued by a self-made
// manufacturer CA, and runs it on a Unix socket until the test ends. With
// bootLog, a measured-boot event log, its PCRs hold the boot that log
// records (tpmtest.ExtendEventLog); without, they are at zero. It returns
// the socket's path and the path of the manufacturer CA bundle. A missing
// swtpm is a failure: test/tools/apt-packages.txt lists it.
func StartSwtpm(tb testing.TB, bootLog []byte) (sock, bundle string) {
	tb.Helper()
	s := startSwtpm(tb, tb.TempDir(), "", bootLog)
	return s.Sock, s.Bundle
}

// StartSwtpms manufactures n swtpm TPMs, as StartSwtpm does, whose EK
// certificates one manufacturer CA issues (a vendor's chips in a fleet:
// one bundle to trust), and runs each until the test ends. Their PCRs are
// at zero.
func StartSwtpms(tb testing.TB, n int) []*Swtpm {
	tb.Helper()
	return ProvisionSwtpms(tb, n)()
}

// ProvisionSwtpms manufactures n swtpm TPMs as StartSwtpms does, in the
// background (it costs about a second of CPU each), while the test goes
// on starting what else it needs; the function it returns waits for them,
// runs each until the test ends, and returns them. It must be called
// from the test's goroutine.
func ProvisionSwtpms(tb testing.TB, n int) func() []*Swtpm {
	tb.Helper()
	caDir := tb.TempDir()
	dirs := make([]string, n)
	for i := range dirs {
		dirs[i] = tb.TempDir()
	}
	finished := make(chan struct{})
	var err error
	go func() {
		defer close(finished)
		if n == 0 {
			return
		}
		// The first creates the CA; the rest share it, provisioned two
		// at a time (swtpm_localca locks the CA directory).
		if err = provisionSwtpm(dirs[0], caDir); err != nil {
			return
		}
		var g errgroup.Group
		g.SetLimit(2)
		for i := 1; i < n; i++ {
			g.Go(func() error { return provisionSwtpm(dirs[i], caDir) })
		}
		err = g.Wait()
	}()
	// A test that ends first still waits, before its directories go.
	tb.Cleanup(func() { <-finished })
	return func() []*Swtpm {
		tb.Helper()
		<-finished
		if err != nil {
			tb.Fatal(err)
		}
		tpms := make([]*Swtpm, n)
		for i := range tpms {
			tpms[i] = runSwtpm(tb, dirs[i], nil)
		}
		return tpms
	}
}

// startSwtpm provisions a TPM in dir (its manufacturer CA in caDir, or its
// own when empty) and runs it.
func startSwtpm(tb testing.TB, dir, caDir string, bootLog []byte) *Swtpm {
	tb.Helper()
	if err := provisionSwtpm(dir, caDir); err != nil {
		tb.Fatal(err)
	}
	return runSwtpm(tb, dir, bootLog)
}

// provisionSwtpm runs test/tools/swtpm-provision.sh dir [caDir].
func provisionSwtpm(dir, caDir string) error {
	for _, tool := range []string{"swtpm", "swtpm_setup", "swtpm_localca"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s not found: install the packages in test/tools/apt-packages.txt", tool)
		}
	}
	root, err := RepoRoot()
	if err != nil {
		return err
	}
	args := []string{dir}
	if caDir != "" {
		args = append(args, caDir)
	}
	if out, err := exec.Command(filepath.Join(root, "test", "tools", "swtpm-provision.sh"), args...).CombinedOutput(); err != nil {
		return fmt.Errorf("swtpm-provision.sh: %w\n%s", err, out)
	}
	return nil
}

// runSwtpm runs the TPM provisioned in dir on dir/tpm.sock until the test
// ends, its PCRs extended with bootLog's boot if given.
func runSwtpm(tb testing.TB, dir string, bootLog []byte) *Swtpm {
	tb.Helper()
	sock := filepath.Join(dir, "tpm.sock")
	p := StartProcess(tb, "swtpm", filepath.Join(dir, "swtpm.log"), "swtpm", "socket", "--tpm2",
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
	return &Swtpm{Sock: sock, Bundle: filepath.Join(dir, "manufacturer-ca.pem"), Process: p}
}
