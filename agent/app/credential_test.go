package app

import (
	"bytes"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// cachedCredential is what Main prints for args without building the
// command tree, when the call is one it takes and the cache answers it.
func cachedCredential(args []string, execInfo string, now time.Time) ([]byte, bool) {
	call, ok := parseCredentialCall(args, execInfo)
	if !ok {
		return nil, false
	}
	return answerFromCache(call.cfg, call.apiVersion(), now)
}

// TestCachedCredential: Main answers a fresh cache before building the
// command tree, with the credential command's own flags and config loader,
// and prints what the command prints; a call it does not take as it is
// (an unknown flag, an exec info it cannot read, a configuration that does
// not load) is left to the command, and one it takes whose cache is not
// fresh (another node, due for renewal) goes on to renew.
func TestCachedCredential(t *testing.T) {
	cfgPath, _ := freshNode(t, "")
	dir := filepath.Dir(cfgPath)
	now := time.Now()
	v1beta1 := `{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential","spec":{"interactive":false}}`

	out, ok := cachedCredential([]string{"credential", "--config", cfgPath, "-v=2", "--timeout=1m"}, v1beta1, now)
	if !ok {
		t.Fatal("a fresh cache was not answered")
	}
	var ec struct {
		APIVersion string
		Status     struct{ ExpirationTimestamp, ClientCertificateData, ClientKeyData string }
	}
	if err := json.Unmarshal(out, &ec); err != nil {
		t.Fatal(err)
	}
	if ec.APIVersion != "client.authentication.k8s.io/v1beta1" || !bytes.Contains([]byte(ec.Status.ClientKeyData), []byte("PRIVATE KEY")) || ec.Status.ExpirationTimestamp == "" {
		t.Errorf("ExecCredential %+v", ec)
	}

	for name, args := range map[string][]string{
		"unknown flag":    {"credential", "--config=" + cfgPath, "--bogus"},
		"argument":        {"credential", "--config=" + cfgPath, "extra"},
		"missing config":  {"credential", "--config=" + filepath.Join(dir, "none.yaml")},
		"another command": {"status", "--config=" + cfgPath},
	} {
		if _, ok := parseCredentialCall(args, ""); ok {
			t.Errorf("%s: taken before the command tree", name)
		}
	}
	if _, ok := parseCredentialCall([]string{"credential", "--config=" + cfgPath}, `{"apiVersion":"client.authentication.k8s.io/v2"}`); ok {
		t.Error("bad exec info: taken before the command tree")
	}

	for name, tc := range map[string]struct {
		args     []string
		execInfo string
		at       time.Time
	}{
		"unknown flag":    {[]string{"credential", "--config=" + cfgPath, "--bogus"}, "", now},
		"argument":        {[]string{"credential", "--config=" + cfgPath, "extra"}, "", now},
		"other node":      {[]string{"credential", "--config=" + cfgPath, "--node-name=n2"}, "", now},
		"due for renewal": {[]string{"credential", "--config=" + cfgPath}, "", now.Add(55 * time.Minute)},
		"bad exec info":   {[]string{"credential", "--config=" + cfgPath}, `{"apiVersion":"client.authentication.k8s.io/v2"}`, now},
		"missing config":  {[]string{"credential", "--config=" + filepath.Join(dir, "none.yaml")}, "", now},
		"another command": {[]string{"status", "--config=" + cfgPath}, "", now},
	} {
		if _, ok := cachedCredential(tc.args, tc.execInfo, tc.at); ok {
			t.Errorf("%s: answered from the cache", name)
		}
	}
}

// TestCredentialLog: with -v the credential call logs one line a step on
// stderr, its message and key="value" pairs; without, nothing (a failure
// is then the one line Main prints).
func TestCredentialLog(t *testing.T) {
	for _, level := range []int{0, 1} {
		var stderr bytes.Buffer
		(&credentialCall{logLevel: level}).logger(&stderr).Info("Re-filing with another evidence version", "rejected", "v2", "next", "v1")
		out := stderr.String()
		if level == 0 {
			if out != "" {
				t.Errorf("-v=0 logged %q", out)
			}
			continue
		}
		if strings.Count(out, "\n") != 1 {
			t.Errorf("-v=%d: not one line: %q", level, out)
		}
		for _, want := range []string{`"Re-filing with another evidence version"`, `logger="kubelet-authenticator"`, `rejected="v2"`, `next="v1"`} {
			if !strings.Contains(out, want) {
				t.Errorf("-v=%d: %q does not say %s", level, out, want)
			}
		}
	}
}
