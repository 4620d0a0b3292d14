package app

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
)

// TestCachedCredential: Main answers a fresh cache before building the
// command tree, with the credential command's own flags and config loader,
// and prints what the command prints; anything it does not take as it is
// (an unknown flag, another node, a stale cache, an exec info it cannot
// read) is left to the command.
func TestCachedCredential(t *testing.T) {
	dir := t.TempDir()
	cacheDir := filepath.Join(dir, "cache")
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	now := time.Now()
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "system:node:n1", Organization: []string{"system:nodes"}},
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalPKCS8PrivateKey(key)
	if err := (cache.Dir{Path: cacheDir}).Store(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder})); err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(dir, "config.yaml")
	cfg := "apiVersion: " + config.APIVersion + "\nkind: " + config.Kind + "\nnodeName: n1\nproviderID: test:///n1\nattestor: insecure\ncacheDir: " + cacheDir + "\n"
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
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
