package app

import (
	"bytes"
	"encoding/json"
	"path/filepath"
	"testing"
	"time"
)

// TestCachedCredential: Main answers a fresh cache before building the
// command tree, with the credential command's own flags and config loader,
// and prints what the command prints; anything it does not take as it is
// (an unknown flag, another node, a stale cache, an exec info it cannot
// read) is left to the command.
func TestCachedCredential(t *testing.T) {
	cfgPath, _ := freshNode(t, "")
	dir := filepath.Dir(cfgPath)
	now := time.Now()
	v1beta1 := `{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential","spec":{"interactive":false}}`

	out, ok := cachedCredential([]string{"credential", "--config", cfgPath, "-v", "--timeout=1m"}, v1beta1, now)
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
