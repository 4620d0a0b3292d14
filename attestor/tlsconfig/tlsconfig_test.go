package tlsconfig

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestProfiles(t *testing.T) {
	tests := []struct {
		profile *SecurityProfile
		min     uint16
	}{
		{nil, tls.VersionTLS12},
		{&SecurityProfile{Type: ProfileOld}, tls.VersionTLS10},
		{&SecurityProfile{Type: ProfileIntermediate}, tls.VersionTLS12},
		{&SecurityProfile{Type: ProfileModern}, tls.VersionTLS13},
		{&SecurityProfile{Type: ProfileCustom, Custom: &CustomProfile{MinTLSVersion: "VersionTLS12", Ciphers: []string{"TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"}}}, tls.VersionTLS12},
	}
	for _, tc := range tests {
		c, err := (&Config{SecurityProfile: tc.profile}).TLSConfig()
		if err != nil {
			t.Fatalf("%+v: %v", tc.profile, err)
		}
		if c.MinVersion != tc.min {
			t.Fatalf("%+v: MinVersion %x, want %x", tc.profile, c.MinVersion, tc.min)
		}
		if c.RootCAs != nil {
			t.Fatalf("%+v: roots set without trustedCA", tc.profile)
		}
	}
}

func TestValidateReportsEverything(t *testing.T) {
	c := &Config{
		TrustedCA:       &CABundle{File: "a", ConfigMap: &ConfigMapReference{Name: "b"}},
		SecurityProfile: &SecurityProfile{Type: ProfileCustom, Custom: &CustomProfile{MinTLSVersion: "TLS9", Ciphers: []string{"NOPE"}}},
	}
	err := c.Validate()
	for _, want := range []string{"only one of file and configMap", "minTLSVersion", "NOPE"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("Validate = %v, want it to mention %q", err, want)
		}
	}
	if err := (&Config{SecurityProfile: &SecurityProfile{Type: "Paranoid"}}).Validate(); err == nil {
		t.Fatal("unknown profile accepted")
	}
	if _, err := (&Config{TrustedCA: &CABundle{ConfigMap: &ConfigMapReference{Name: "ca"}}}).TLSConfig(); err == nil {
		t.Fatal("unresolved ConfigMap reference accepted")
	}
}

// TestTrustedCAReplacesSystemRoots: a client trusts exactly its own bundle.
func TestTrustedCAReplacesSystemRoots(t *testing.T) {
	a := httptest.NewTLSServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer a.Close()
	b := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	b.TLS = &tls.Config{Certificates: []tls.Certificate{selfSigned(t)}}
	b.StartTLS()
	defer b.Close()
	file := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: a.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	client, err := (&Config{TrustedCA: &CABundle{File: file}}).HTTPClient(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Get(a.URL)
	if err != nil {
		t.Fatalf("upstream with the trusted CA: %v", err)
	}
	resp.Body.Close()
	if _, err := client.Get(b.URL); err == nil {
		t.Fatal("upstream signed by another CA was trusted")
	}
	other, err := (&Config{}).HTTPClient(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.Get(a.URL); err == nil {
		t.Fatal("a client without trustedCA trusted another upstream's private CA")
	}
}

// selfSigned returns a certificate for 127.0.0.1 unlike httptest's shared
// one.
func selfSigned(t *testing.T) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "other"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

func TestNoRedirects(t *testing.T) {
	srv := httptest.NewServer(http.RedirectHandler("https://elsewhere.example/", http.StatusFound))
	defer srv.Close()
	client, err := (*Config)(nil).HTTPClient(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusFound {
		t.Fatalf("redirect followed: %s", resp.Status)
	}
}

// systemRootsHelperEnv marks the child process of
// TestTrustedCAIsNotMergedWithSystemRoots.
const systemRootsHelperEnv = "KA_TLSCONFIG_SYSTEM_ROOTS_HELPER"

// TestTrustedCAIsNotMergedWithSystemRoots: an upstream whose certificate
// chains to a system root is refused by a client configured with another
// trustedCA. Go reads the system roots once per process, so the check runs
// in a child process whose system roots (SSL_CERT_FILE) are a CA this test
// made: a TLSConfig that merged trustedCA into the system pool would let
// the child reach the server that CA signed.
func TestTrustedCAIsNotMergedWithSystemRoots(t *testing.T) {
	if os.Getenv(systemRootsHelperEnv) != "" {
		t.Skip("run by the parent test")
	}
	sysCert := selfSigned(t)
	sysSrv := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	sysSrv.TLS = &tls.Config{Certificates: []tls.Certificate{sysCert}}
	sysSrv.StartTLS()
	defer sysSrv.Close()
	own := httptest.NewTLSServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer own.Close()

	dir := t.TempDir()
	sysPEM := filepath.Join(dir, "system.pem")
	ownPEM := filepath.Join(dir, "own.pem")
	if err := os.WriteFile(sysPEM, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: sysCert.Certificate[0]}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ownPEM, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: own.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestSystemRootsChild$", "-test.v")
	cmd.Env = append(os.Environ(), systemRootsHelperEnv+"=1", "SSL_CERT_FILE="+sysPEM, "SSL_CERT_DIR="+dir+"/none",
		"KA_SYSTEM_URL="+sysSrv.URL, "KA_OWN_URL="+own.URL, "KA_OWN_CA="+ownPEM)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestSystemRootsChild") {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

// TestSystemRootsChild runs only as TestTrustedCAIsNotMergedWithSystemRoots'
// child process.
func TestSystemRootsChild(t *testing.T) {
	if os.Getenv(systemRootsHelperEnv) == "" {
		t.Skip("run only as the child of TestTrustedCAIsNotMergedWithSystemRoots")
	}
	get := func(c *Config, url string) error {
		client, err := c.HTTPClient(5 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := client.Get(url)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	sysURL, ownURL := os.Getenv("KA_SYSTEM_URL"), os.Getenv("KA_OWN_URL")
	// Premise: without trustedCA the client trusts the system roots, here
	// the test's CA.
	if err := get(nil, sysURL); err != nil {
		t.Fatalf("the system roots (SSL_CERT_FILE) are not in use: %v", err)
	}
	withCA := &Config{TrustedCA: &CABundle{File: os.Getenv("KA_OWN_CA")}}
	if err := get(withCA, ownURL); err != nil {
		t.Fatalf("upstream signed by trustedCA: %v", err)
	}
	if err := get(withCA, sysURL); err == nil {
		t.Fatal("a client with trustedCA still trusted a system root: the bundle was merged into the system roots instead of replacing them")
	}
}

// TestTrustedCAFileReloaded (issue 13.7): when an upstream rotates its CA
// and the bundle file is updated, the next request trusts the new CA
// without a new client; an unreadable or empty bundle keeps the last good
// one.
func TestTrustedCAFileReloaded(t *testing.T) {
	var mu sync.Mutex
	cert := selfSigned(t)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
		mu.Lock()
		defer mu.Unlock()
		c := cert
		return &c, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	url := "https://" + ln.Addr().String()

	file := filepath.Join(t.TempDir(), "ca.pem")
	writeCA := func(c tls.Certificate) {
		t.Helper()
		if err := os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Certificate[0]}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeCA(cert)
	client, err := (&Config{TrustedCA: &CABundle{File: file}}).HTTPClient(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	get := func() error {
		resp, err := client.Get(url)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	if err := get(); err != nil {
		t.Fatalf("before rotation: %v", err)
	}

	rotated := selfSigned(t)
	mu.Lock()
	cert = rotated
	mu.Unlock()
	client.CloseIdleConnections()
	if err := get(); err == nil {
		t.Fatal("the rotated server was trusted before the bundle changed")
	}
	writeCA(rotated)
	time.Sleep(ReloadInterval + 100*time.Millisecond)
	if err := get(); err != nil {
		t.Fatalf("after the bundle file changed: %v", err)
	}

	// A bundle that is briefly broken (a half-written file) keeps the last
	// good one.
	if err := os.WriteFile(file, []byte("not PEM"), 0o600); err != nil {
		t.Fatal(err)
	}
	time.Sleep(ReloadInterval + 100*time.Millisecond)
	client.CloseIdleConnections()
	if err := get(); err != nil {
		t.Fatalf("a broken bundle replaced the last good one: %v", err)
	}
}
