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
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/test/connectproxy"
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

// rotatingServer is an HTTPS server on 127.0.0.1 whose certificate the
// test swaps.
type rotatingServer struct {
	URL  string
	Host string // host:port

	mu   sync.Mutex
	cert tls.Certificate
}

func newRotatingServer(t *testing.T) *rotatingServer {
	t.Helper()
	s := &rotatingServer{cert: selfSigned(t)}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
		s.mu.Lock()
		defer s.mu.Unlock()
		c := s.cert
		return &c, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	s.Host = ln.Addr().String()
	s.URL = "https://" + s.Host
	return s
}

// rotate gives the server a new self-signed certificate and returns it.
func (s *rotatingServer) rotate(t *testing.T) tls.Certificate {
	c := selfSigned(t)
	s.mu.Lock()
	s.cert = c
	s.mu.Unlock()
	return c
}

func (s *rotatingServer) certificate() tls.Certificate {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cert
}

func writeCA(t *testing.T, file string, c tls.Certificate) {
	t.Helper()
	if err := os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Certificate[0]}), 0o600); err != nil {
		t.Fatal(err)
	}
}

func get(client *http.Client, url string) error {
	resp, err := client.Get(url)
	if err == nil {
		resp.Body.Close()
	}
	return err
}

// TestTrustedCAFileReloaded (issue 13.7): when an upstream rotates its CA
// and the bundle file is updated, setting the Config again makes the same
// client trust the new CA; an unreadable or empty bundle keeps the last good
// one.
func TestTrustedCAFileReloaded(t *testing.T) {
	srv := newRotatingServer(t)
	file := filepath.Join(t.TempDir(), "ca.pem")
	writeCA(t, file, srv.certificate())
	cfg := &Config{TrustedCA: &CABundle{File: file}}
	u, err := NewUpstream(cfg)
	if err != nil {
		t.Fatal(err)
	}
	client, err := cfg.WithUpstream(u).HTTPClient(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := get(client, srv.URL); err != nil {
		t.Fatalf("before rotation: %v", err)
	}
	if changed, err := u.Set(cfg); changed || err != nil {
		t.Fatalf("Set with an unchanged file = %v, %v; want no change", changed, err)
	}

	rotated := srv.rotate(t)
	client.CloseIdleConnections()
	if err := get(client, srv.URL); err == nil {
		t.Fatal("the rotated server was trusted before the bundle changed")
	}
	writeCA(t, file, rotated)
	if changed, err := u.Set(cfg); !changed || err != nil {
		t.Fatalf("Set after the file changed = %v, %v; want a change", changed, err)
	}
	if err := get(client, srv.URL); err != nil {
		t.Fatalf("after the bundle file changed: %v", err)
	}

	// A bundle that is briefly broken (a half-written file) or gone keeps
	// the last good one.
	if err := os.WriteFile(file, []byte("not PEM"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := u.Set(cfg); err == nil || !strings.Contains(err.Error(), "no PEM certificates") {
		t.Fatalf("Set with a broken bundle = %v", err)
	}
	if err := os.Remove(file); err != nil {
		t.Fatal(err)
	}
	if _, err := u.Set(cfg); err == nil {
		t.Fatal("Set with a missing bundle succeeded")
	}
	client.CloseIdleConnections()
	if err := get(client, srv.URL); err != nil {
		t.Fatalf("a broken bundle replaced the last good one: %v", err)
	}
}

func TestProxyValidation(t *testing.T) {
	for _, tc := range []struct {
		proxy string
		want  string // "" when valid
	}{
		{"", ""},
		{"none", ""},
		{"http://proxy.example:3128", ""},
		{"https://proxy.example", ""},
		{"http://user:s3cret@proxy.example:3128/", ""},
		{"http://[::1]:3128", ""},
		{"socks5://user:s3cret@proxy.example:1080", `scheme "socks5"`},
		{"None", `scheme ""`},
		{"proxy.example:3128", `scheme "proxy.example"`},
		{"http://user:s3cret@proxy.example:3128/path?q=1", "only scheme, host and port"},
		{"http://user:s3cret@:3128", "names no host"},
		{"http://user:s3cret@proxy.example:99999", "not 1-65535"},
		{"http://:s3cret@proxy.example:3128", "empty user name"},
		{"http://user:s3cret@proxy example:3128", "not a URL"},
		{"http://user:s3cret%zz@proxy.example", "not a URL"},
	} {
		t.Run(tc.proxy, func(t *testing.T) {
			err := (&Config{Proxy: tc.proxy}).Validate()
			if tc.want == "" {
				if err != nil {
					t.Fatalf("Validate = %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate = %v, want it to mention %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "s3cret") {
				t.Fatalf("Validate repeats the proxy password: %v", err)
			}
		})
	}
	if got := (&Config{Proxy: "http://user:s3cret@proxy.example:3128"}).ProxyString(); got != "http://REDACTED@proxy.example:3128" {
		t.Errorf("ProxyString = %q", got)
	}
	for c, want := range map[*Config]string{nil: "environment", {}: "environment", {Proxy: "none"}: "none"} {
		if got := c.ProxyString(); got != want {
			t.Errorf("ProxyString(%+v) = %q, want %q", c, got, want)
		}
	}
}

// TestProxyPerUpstream: each upstream's connections go through the proxy
// its own Config names, tunnelled with CONNECT and still verified end to end
// against that upstream's trustedCA; "none" goes direct.
func TestProxyPerUpstream(t *testing.T) {
	a, b, direct := newRotatingServer(t), newRotatingServer(t), newRotatingServer(t)
	pa, pb := connectproxy.Start(t), connectproxy.Start(t, connectproxy.WithBasicAuth("ka", "s3cret"))
	dir := t.TempDir()
	client := func(srv *rotatingServer, proxy string) *http.Client {
		t.Helper()
		file := filepath.Join(dir, strings.ReplaceAll(srv.Host, ":", "_")+".pem")
		writeCA(t, file, srv.certificate())
		c, err := (&Config{TrustedCA: &CABundle{File: file}, Proxy: proxy}).HTTPClient(5 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	withCreds := *pb.URL
	withCreds.User = url.UserPassword("ka", "s3cret")
	ca, cb, cd := client(a, pa.URL.String()), client(b, withCreds.String()), client(direct, ProxyNone)
	for _, r := range []struct {
		c   *http.Client
		url string
	}{{ca, a.URL}, {cb, b.URL}, {cd, direct.URL}} {
		if err := get(r.c, r.url); err != nil {
			t.Fatalf("%s: %v", r.url, err)
		}
	}
	if pa.Tunnels(a.Host) != 1 || pa.Total() != 1 {
		t.Errorf("proxy A opened %d tunnels to A, %d in all; want 1 and 1", pa.Tunnels(a.Host), pa.Total())
	}
	if pb.Tunnels(b.Host) != 1 || pb.Total() != 1 {
		t.Errorf("proxy B opened %d tunnels to B, %d in all; want 1 and 1", pb.Tunnels(b.Host), pb.Total())
	}

	// The tunnel carries TLS end to end: through the proxy, a server whose
	// certificate is not the upstream's trustedCA is refused.
	a.rotate(t)
	ca.CloseIdleConnections()
	if err := get(ca, a.URL); err == nil {
		t.Fatal("through the proxy, a server outside trustedCA was trusted")
	}
	if pa.Tunnels(a.Host) != 2 {
		t.Errorf("proxy A opened %d tunnels to A, want 2", pa.Tunnels(a.Host))
	}

	// Wrong proxy credentials fail, and the error does not repeat them.
	wrong := *pb.URL
	wrong.User = url.UserPassword("ka", "wr0ng-s3cret")
	cw := client(b, wrong.String())
	err := get(cw, b.URL)
	if err == nil {
		t.Fatal("the proxy accepted wrong credentials")
	}
	if strings.Contains(err.Error(), "wr0ng") {
		t.Fatalf("the error repeats the proxy password: %v", err)
	}
}

// TestUpstreamSwitchesProxy: setting a new Config on an Upstream moves the
// same client's new connections to the new proxy and trust anchors; an
// invalid Config keeps the last good one working.
func TestUpstreamSwitchesProxy(t *testing.T) {
	srv := newRotatingServer(t)
	p1, p2 := connectproxy.Start(t), connectproxy.Start(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "ca.pem")
	writeCA(t, file, srv.certificate())
	first := &Config{TrustedCA: &CABundle{File: file}, Proxy: p1.URL.String()}
	u, err := NewUpstream(first)
	if err != nil {
		t.Fatal(err)
	}
	client, err := first.WithUpstream(u).HTTPClient(5 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := get(client, srv.URL); err != nil {
		t.Fatal(err)
	}

	rotated := srv.rotate(t)
	file2 := filepath.Join(dir, "ca2.pem")
	writeCA(t, file2, rotated)
	second := &Config{TrustedCA: &CABundle{File: file2}, Proxy: p2.URL.String(), SecurityProfile: &SecurityProfile{Type: ProfileModern}}
	if changed, err := u.Set(second); !changed || err != nil {
		t.Fatalf("Set = %v, %v", changed, err)
	}
	if err := get(client, srv.URL); err != nil {
		t.Fatalf("after the switch: %v", err)
	}
	if p1.Total() != 1 || p2.Tunnels(srv.Host) != 1 {
		t.Errorf("tunnels: first proxy %d, second %d; want 1 and 1", p1.Total(), p2.Tunnels(srv.Host))
	}

	for _, bad := range []*Config{
		{Proxy: "socks5://127.0.0.1:1"},
		{TrustedCA: &CABundle{File: filepath.Join(dir, "missing.pem")}},
		{SecurityProfile: &SecurityProfile{Type: "Paranoid"}},
	} {
		if _, err := u.Set(bad); err == nil {
			t.Fatalf("Set(%+v) succeeded", bad)
		}
	}
	client.CloseIdleConnections()
	if err := get(client, srv.URL); err != nil {
		t.Fatalf("an invalid Config replaced the last good one: %v", err)
	}
	if p2.Tunnels(srv.Host) != 2 || p1.Total() != 1 {
		t.Errorf("tunnels: first proxy %d, second %d; want 1 and 2", p1.Total(), p2.Tunnels(srv.Host))
	}
	if got := u.Config().Proxy; got != p2.URL.String() {
		t.Errorf("Config().Proxy = %q", got)
	}
}
