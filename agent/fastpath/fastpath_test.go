package fastpath

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const body = "-----BEGIN CERTIFICATE-----\nQUJD\n-----END CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----\nREVG\n-----END PRIVATE KEY-----\n"

func writeCache(t *testing.T, dir string, h Header) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, CurrentFile), append(h.Encode([]byte(body)), body...), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestHeaderRoundTripAndTamper(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	h := Header{Node: "n1", NotBefore: now, RenewBy: now.Add(time.Hour), Expiration: now.Add(50 * time.Minute)}
	data := append(h.Encode([]byte(body)), body...)
	got, b, err := Split(data)
	if err != nil || got != h || string(b) != body {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	for name, edit := range map[string]func(string) string{
		"renew-by pushed out": func(s string) string { return strings.Replace(s, "renew-by=", "renew-by=9", 1) },
		"node renamed":        func(s string) string { return strings.Replace(s, "node=n1", "node=n2", 1) },
		"body edited":         func(s string) string { return strings.Replace(s, "QUJD", "QUJE", 1) },
		"no header":           func(s string) string { return s[strings.IndexByte(s, '\n')+1:] },
	} {
		if _, _, err := Split([]byte(edit(string(data)))); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestCredential(t *testing.T) {
	dir := t.TempDir()
	cacheDir := filepath.Join(dir, "cache")
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte("nodeName: n1\ncacheDir: "+cacheDir+"\nattestor: tpm\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1_800_000_000, 0)
	writeCache(t, cacheDir, Header{Node: "n1", NotBefore: now.Add(-time.Hour), RenewBy: now.Add(time.Hour), Expiration: now.Add(50 * time.Minute)})

	out, ok := Credential([]string{"credential", "--config=" + cfg, "--timeout", "5m", "--verbose"}, `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","spec":{"interactive":false}}`, now)
	if !ok {
		t.Fatal("fresh cache not answered")
	}
	var ec struct {
		APIVersion, Kind string
		Status           struct{ ExpirationTimestamp, ClientCertificateData, ClientKeyData string }
	}
	if err := json.Unmarshal(out, &ec); err != nil {
		t.Fatal(err)
	}
	if ec.Kind != "ExecCredential" || ec.Status.ExpirationTimestamp != now.Add(50*time.Minute).UTC().Format(time.RFC3339) ||
		!strings.Contains(ec.Status.ClientCertificateData, "CERTIFICATE") || !strings.Contains(ec.Status.ClientKeyData, "PRIVATE KEY") ||
		strings.Contains(ec.Status.ClientCertificateData, "PRIVATE") {
		t.Fatalf("unexpected ExecCredential: %s", out)
	}

	miss := map[string]struct {
		args []string
		info string
		at   time.Time
	}{
		"past renew-by":   {[]string{"credential", "--config", cfg}, "", now.Add(61 * time.Minute)},
		"past expiration": {[]string{"credential", "--config", cfg}, "", now.Add(55 * time.Minute)},
		"not yet valid":   {[]string{"credential", "--config", cfg}, "", now.Add(-2 * time.Hour)},
		"other node":      {[]string{"credential", "--config", cfg, "--node-name=n2"}, "", now},
		"unknown flag":    {[]string{"credential", "--config", cfg, "--bogus"}, "", now},
		"help":            {[]string{"credential", "--help"}, "", now},
		"other command":   {[]string{"agent", "--config", cfg}, "", now},
		"missing config":  {[]string{"credential", "--config", cfg + ".missing"}, "", now},
		"other cache":     {[]string{"credential", "--config", cfg, "--cache-dir", dir}, "", now},
		"bad exec info":   {[]string{"credential", "--config", cfg}, `{"apiVersion":"client.authentication.k8s.io/v2"}`, now},
		"dangling flag":   {[]string{"credential", "--config"}, "", now},
		"positional":      {[]string{"credential", "extra"}, "", now},
	}
	for name, tc := range miss {
		if _, ok := Credential(tc.args, tc.info, tc.at); ok {
			t.Errorf("%s: answered from the cache", name)
		}
	}
}
