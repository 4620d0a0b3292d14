package harness

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Process is a child process started by the harness. It runs in a process
// group of its own and is killed by the kernel (SIGKILL) when the test binary
// dies, so that no test can leak it. Its stdout and stderr go to LogPath.
type Process struct {
	Name    string
	LogPath string

	cmd      *exec.Cmd
	done     chan struct{}
	waitErr  error
	stopOnce sync.Once
}

// StartProcess starts bin with args as a child process whose output goes to
// logPath, and registers a cleanup that stops it (SIGTERM, then SIGKILL after
// 10 s) and, if the test failed, logs the tail of its output. It fails the
// test if the process cannot be started.
func StartProcess(tb testing.TB, name, logPath, bin string, args ...string) *Process {
	tb.Helper()
	p, err := startProcess(name, logPath, bin, args...)
	if err != nil {
		tb.Fatalf("unable to start %s: %v", name, err)
	}
	tb.Cleanup(func() {
		p.Stop(10 * time.Second)
		if tb.Failed() {
			tb.Logf("last lines of %s log %s:\n%s", name, logPath, tailFile(logPath, logTailLines))
		}
	})
	return p
}

// startProcess starts bin in a new process group with SIGKILL as its parent
// death signal. Pdeathsig fires when the OS thread that forked the child
// exits; Go only ends threads whose goroutine locked them and exited, which
// the harness never does, so in practice it fires when the test binary dies.
func startProcess(name, logPath, bin string, args ...string) (*Process, error) {
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("unable to open log file for %s: %w", name, err)
	}
	defer logFile.Close() // the child holds its own descriptor
	fmt.Fprintf(logFile, "+ %s %s\n", bin, strings.Join(args, " "))

	cmd := exec.Command(bin, args...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("unable to start %s: %w", bin, err)
	}
	p := &Process{Name: name, LogPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// PID returns the process ID (also its process group ID).
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Done is closed when the process has exited and been reaped.
func (p *Process) Done() <-chan struct{} { return p.done }

// Exited reports whether the process has exited, and how.
func (p *Process) Exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.waitErr
	default:
		return false, nil
	}
}

// Stop sends SIGTERM to the process group, waits up to grace for the process
// to exit, then sends SIGKILL to the group and waits for it. Whatever else is
// left in the group is killed too. Stop is idempotent and safe to call from
// several goroutines; every call returns once the process is gone.
func (p *Process) Stop(grace time.Duration) {
	p.stopOnce.Do(func() {
		pgid := p.PID()
		select {
		case <-p.done:
		default:
			_ = syscall.Kill(-pgid, syscall.SIGTERM)
			select {
			case <-p.done:
			case <-time.After(grace):
				_ = syscall.Kill(-pgid, syscall.SIGKILL)
				<-p.done
			}
		}
		// Anything the process started and left behind in its group.
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
	})
	<-p.done
}

// logTailLines is how many lines of each log are shown when a test fails.
const logTailLines = 60

// tailFile returns the last n lines of the file at path, or why it cannot.
func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(unable to read log: %v)", err)
	}
	return LastLines(string(b), n)
}

// errAddressInUse is returned when a child could not bind its port because
// something else took it between FreePort and the child's bind.
var errAddressInUse = errors.New("address already in use")

// exitError describes a process that exited while the harness waited for it
// to become ready, with errAddressInUse wrapped in when its log says so.
func (p *Process) exitError() error {
	_, waitErr := p.Exited()
	b, _ := os.ReadFile(p.LogPath)
	err := fmt.Errorf("%s exited before it was ready (%w); last lines of %s:\n%s", p.Name, waitErr, p.LogPath, tailFile(p.LogPath, 5))
	if bytes.Contains(b, []byte("address already in use")) {
		return fmt.Errorf("%w: %w", errAddressInUse, err)
	}
	return err
}
