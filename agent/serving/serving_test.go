package serving

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// issue returns a PEM certificate for cn with the SANs and usage, and its
// PEM key.
func issue(t *testing.T, cn string, usage x509.ExtKeyUsage, dnsNames []string, ips []net.IP) (certPEM, keyPEM []byte) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "serving CA"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: cn, Organization: []string{attestor.NodesGroup}},
		ExtKeyUsage: []x509.ExtKeyUsage{usage}, KeyUsage: x509.KeyUsageDigitalSignature, DNSNames: dnsNames, IPAddresses: ips,
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.Public(), caKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalPKCS8PrivateKey(key)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder})
}

func manager(t *testing.T, s config.ServingConfig) *Manager {
	t.Helper()
	dir := t.TempDir()
	cfg := &config.NodeConfig{NodeName: "n1", Attestor: "tpm", CacheDir: filepath.Join(dir, "cache"), Serving: s}
	cfg.Default()
	return &Manager{Config: cfg, HostAddress: func() (net.IP, error) { return net.ParseIP("192.0.2.7"), nil }}
}

// TestAddresses: configured SANs are taken as they are; with none, the
// node name and its primary address.
func TestAddresses(t *testing.T) {
	m := manager(t, config.ServingConfig{Enabled: true})
	dns, ips, err := m.Addresses()
	if err != nil || len(dns) != 1 || dns[0] != "n1" || len(ips) != 1 || !ips[0].Equal(net.ParseIP("192.0.2.7")) {
		t.Fatalf("discovered %v %v %v", dns, ips, err)
	}
	m.HostAddress = func() (net.IP, error) { return nil, errors.New("no default route") }
	if _, _, err := m.Addresses(); err == nil || !strings.Contains(err.Error(), "set serving.ipAddresses") {
		t.Fatalf("discovery failure: %v", err)
	}
	m = manager(t, config.ServingConfig{Enabled: true, DNSNames: []string{"n1.internal"}, IPAddresses: []string{"10.0.0.5"}})
	dns, ips, err = m.Addresses()
	if err != nil || len(dns) != 1 || dns[0] != "n1.internal" || len(ips) != 1 || !ips[0].Equal(net.ParseIP("10.0.0.5")) {
		t.Fatalf("configured %v %v %v", dns, ips, err)
	}
}

// TestInstallAndLoad: what the signer issued is installed in one 0600 file
// kubelet reads as tlsCertFile and tlsPrivateKeyFile; a certificate for
// other addresses, another node or client auth is refused and the installed
// one stays; Stale tells when the addresses to request changed.
func TestInstallAndLoad(t *testing.T) {
	m := manager(t, config.ServingConfig{Enabled: true})
	if _, err := m.Load(); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Load with nothing installed: %v", err)
	}
	dns, ips, _ := m.Addresses()
	certPEM, keyPEM := issue(t, "system:node:n1", x509.ExtKeyUsageServerAuth, dns, ips)
	if err := m.install(certPEM, keyPEM, dns, ips); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(m.Config.Serving.Path)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("serving file mode %v, %v", st.Mode().Perm(), err)
	}
	cred, err := m.Load()
	if err != nil {
		t.Fatal(err)
	}
	if m.Stale(cred.Leaf) {
		t.Fatal("a certificate with exactly the addresses to request is stale")
	}
	for name, c := range map[string]struct {
		cn    string
		usage x509.ExtKeyUsage
		dns   []string
		want  string
	}{
		"other addresses": {"system:node:n1", x509.ExtKeyUsageServerAuth, []string{"evil.example.com"}, errOtherSANs.Error()},
		"other node":      {"system:node:n2", x509.ExtKeyUsageServerAuth, dns, `not system:node:n1`},
		"client usage":    {"system:node:n1", x509.ExtKeyUsageClientAuth, dns, "not for server authentication"},
	} {
		c2, k2 := issue(t, c.cn, c.usage, c.dns, ips)
		if err := m.install(c2, k2, dns, ips); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: install error %v, want %q", name, err, c.want)
		}
	}
	if again, err := m.Load(); err != nil || !again.Leaf.Equal(cred.Leaf) {
		t.Fatalf("a refused certificate replaced the installed one: %v", err)
	}
	// The node's address changed: the installed certificate is stale.
	m.HostAddress = func() (net.IP, error) { return net.ParseIP("192.0.2.8"), nil }
	if !m.Stale(cred.Leaf) {
		t.Fatal("a certificate for the old address is not stale")
	}
	// A file that is not a serving certificate of this node is reported.
	c3, k3 := issue(t, "system:node:n1", x509.ExtKeyUsageClientAuth, dns, ips)
	if err := os.WriteFile(m.Config.Serving.Path, append(c3, k3...), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Load(); err == nil || errors.Is(err, ErrNotFound) {
		t.Fatalf("Load of a client certificate: %v", err)
	}
}

func TestSameSANs(t *testing.T) {
	c := &x509.Certificate{DNSNames: []string{"N1", "n1.internal"}, IPAddresses: []net.IP{net.ParseIP("10.0.0.5").To4(), net.ParseIP("fd00::5")}}
	if !sameSANs(c, []string{"n1.internal", "n1"}, []net.IP{net.ParseIP("fd00::5"), net.ParseIP("10.0.0.5")}) {
		t.Error("same SANs in another order and case differ")
	}
	if sameSANs(c, []string{"n1"}, []net.IP{net.ParseIP("10.0.0.5"), net.ParseIP("fd00::5")}) {
		t.Error("a missing DNS name is not a difference")
	}
	if sameSANs(c, []string{"n1", "n1.internal"}, []net.IP{net.ParseIP("10.0.0.6"), net.ParseIP("fd00::5")}) {
		t.Error("another IP is not a difference")
	}
}
