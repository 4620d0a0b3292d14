package app

import (
	"bytes"
	"context"
	"errors"
	"os"
	"strings"
	"testing"

	"sigs.k8s.io/kubelet-authenticator/version"
)

// execute runs the command tree with args and returns its output and the
// exit code Main would return.
func execute(args ...string) (stdout, stderr string, code int) {
	var out, errOut bytes.Buffer
	cmd := NewCommand(&out, &errOut)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	var ex *exitError
	switch {
	case err == nil:
		code = 0
	case errors.As(err, &ex):
		code = ex.code
	default:
		code = 1
	}
	if err != nil {
		errOut.WriteString(err.Error())
	}
	return out.String(), errOut.String(), code
}

// TestStatusExitCode: a script or a health check can tell from status's
// exit code whether the node has a usable identity.
func TestStatusExitCode(t *testing.T) {
	cfgPath, cacheDir := freshNode(t, "")
	if out, errOut, code := execute("status", "--config", cfgPath); code != 0 {
		t.Fatalf("a fresh certificate: exit %d\n%s%s", code, out, errOut)
	}
	if err := os.RemoveAll(cacheDir); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := execute("status", "--config", cfgPath)
	if code != 2 || !strings.Contains(errOut, "no usable client certificate") || !strings.Contains(out, "no client certificate") {
		t.Fatalf("no certificate: exit %d, want 2\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
	if _, _, code := execute("status", "--config", cfgPath, "-o", "json"); code != 2 {
		t.Fatalf("no certificate, -o json: exit %d, want 2", code)
	}
}

// TestStatusFlags: status takes only the flags it uses.
func TestStatusFlags(t *testing.T) {
	cfgPath, _ := freshNode(t, "")
	for _, flag := range []string{"--timeout=1m", "--attestor=tpm", "--provider-id=x", "--certificate-lifetime=1h", "--bootstrap-kubeconfig=/x", "--signer-name=x"} {
		if _, errOut, code := execute("status", "--config", cfgPath, flag); code == 0 || !strings.Contains(errOut, "unknown flag") {
			t.Errorf("status %s: exit %d, %q; want an unknown flag", flag, code, errOut)
		}
	}
	if _, errOut, code := execute("status", "--config", cfgPath, "--node-name=n1", "--cache-dir="+t.TempDir()); code != 2 {
		t.Errorf("status with an empty --cache-dir: exit %d, want 2 (%s)", code, errOut)
	}
}

// TestVerbosityFlag: -v is the log level wherever it exists and never the
// version; the root prints the version with --version only.
func TestVerbosityFlag(t *testing.T) {
	if out, _, code := execute("--version"); code != 0 || !strings.Contains(out, version.String()) {
		t.Errorf("--version: exit %d, %q", code, out)
	}
	if out, errOut, code := execute("-v"); code == 0 || strings.Contains(out, version.String()) {
		t.Errorf("the root's -v printed the version (exit %d): %q %q", code, out, errOut)
	}
	for _, cmd := range []string{"credential", "agent"} {
		c, _, err := NewCommand(nil, nil).Find([]string{cmd})
		if err != nil {
			t.Fatal(err)
		}
		f := c.Flags().Lookup("v")
		if f == nil || f.Shorthand != "v" || f.Value.Type() == "bool" {
			t.Errorf("%s: -v is %+v, want the log level", cmd, f)
		}
	}
	for _, tc := range []struct {
		args  []string
		level int
	}{
		{[]string{"-v=2"}, 2},
		{[]string{"--verbose"}, 1},
		{[]string{"--verbose", "-v=3"}, 3},
		{nil, 0},
	} {
		call, ok := parseCredentialCall(append([]string{"credential", "--config", mustConfig(t)}, tc.args...), "")
		if !ok {
			t.Errorf("credential %q: not a credential call", tc.args)
		} else if call.logLevel != tc.level {
			t.Errorf("credential %q: log level %d, want %d", tc.args, call.logLevel, tc.level)
		}
	}
}

func mustConfig(t *testing.T) string {
	cfgPath, _ := freshNode(t, "")
	return cfgPath
}
