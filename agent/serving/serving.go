// Package serving keeps kubelet's serving certificate on the node: the agent
// requests it from the attested serving signer
// (cluster.x-k8s.io/kubelet-serving-<attestor>) as the node itself, with its
// client certificate and fresh evidence bound to a key made on the node, for
// the node's own addresses, and writes the chain and key to the one file
// kubelet's tlsCertFile and tlsPrivateKeyFile name. kubelet reloads that file
// when it changes (ReloadKubeletServerCertificateFile, on by default since
// Kubernetes 1.31).
//
// The CSR exchange is agent/credential's (the same steps as the client
// certificate: pending key, evidence, version negotiation, challenge round);
// the schedule is agent/daemon's loop with the client certificate's renewal
// rule. This package adds what differs: the SANs, where the pair is written,
// and when an installed certificate no longer matches the configuration.
package serving

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/credential"
	"sigs.k8s.io/kubelet-authenticator/agent/csr"
	"sigs.k8s.io/kubelet-authenticator/agent/rotation"
	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// PendingKeyFile is the file, in the cache directory, that keeps the key of
// a serving CSR in flight, so that a retry finds the same request.
const PendingKeyFile = "kubelet-server-pending.key"

// ErrNotFound is returned by Load when no serving certificate is installed.
var ErrNotFound = errors.New("no serving certificate installed")

// errOtherSANs is the refusal of a certificate for other addresses than
// requested: the request in flight was filed before the addresses changed.
var errOtherSANs = errors.New("the signer issued other addresses than requested")

// Manager requests, checks and installs the serving certificate. It
// implements daemon.Renewer; its Load and Stale are the loop's.
type Manager struct {
	Config *config.NodeConfig
	// Source files the CSR (its attestor, timeouts and logging).
	Source *credential.Source
	// HostAddress finds the node's primary address when none are
	// configured; nil means DefaultRouteAddress (the interface with the
	// default route, as kubelet picks its InternalIP without --node-ip).
	HostAddress func() (net.IP, error)
	// Clock tells the time; nil means the real clock.
	Clock clock.PassiveClock
}

func (m *Manager) now() time.Time {
	if m.Clock != nil {
		return m.Clock.Now()
	}
	return time.Now()
}

// Addresses returns the subject alternative names to request: the
// configured ones, or else the node name and the node's primary address.
func (m *Manager) Addresses() (dnsNames []string, ips []net.IP, err error) {
	s := m.Config.Serving
	if len(s.DNSNames)+len(s.IPAddresses) > 0 {
		for _, a := range s.IPAddresses {
			ip := net.ParseIP(a)
			if ip == nil {
				return nil, nil, fmt.Errorf("serving.ipAddresses: %q is not an IP address", a)
			}
			ips = append(ips, ip)
		}
		return slices.Clone(s.DNSNames), ips, nil
	}
	find := m.HostAddress
	if find == nil {
		find = DefaultRouteAddress
	}
	ip, err := find()
	if err != nil {
		return nil, nil, fmt.Errorf("unable to discover the node's address (set serving.ipAddresses): %w", err)
	}
	return []string{m.Config.NodeName}, []net.IP{ip}, nil
}

// Load reads the installed serving certificate and key.
func (m *Manager) Load() (*cache.Credential, error) {
	return Load(m.Config.Serving.Path, m.Config.NodeName)
}

// Load reads the serving certificate chain and key at path and checks that
// they belong together and are a serving certificate of node nodeName.
func Load(path, nodeName string) (*cache.Credential, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("unable to read the serving certificate: %w", err)
	}
	cred, err := cache.ParseCredential(data)
	if err != nil {
		return nil, fmt.Errorf("serving certificate %s: %w", path, err)
	}
	if err := check(cred.Leaf, nodeName); err != nil {
		return nil, fmt.Errorf("serving certificate %s: %w", path, err)
	}
	return cred, nil
}

func check(c *x509.Certificate, nodeName string) error {
	if c.Subject.CommonName != attestor.NodeUserPrefix+nodeName {
		return fmt.Errorf("it is for %q, not system:node:%s", c.Subject.CommonName, nodeName)
	}
	if !slices.Contains(c.ExtKeyUsage, x509.ExtKeyUsageServerAuth) {
		return errors.New("it is not for server authentication")
	}
	return nil
}

// Stale reports whether c does not carry exactly the addresses to request
// now (the configuration or the node's address changed): it is replaced at
// once. When the addresses cannot be discovered, nothing is stale.
func (m *Manager) Stale(c *x509.Certificate) bool {
	dnsNames, ips, err := m.Addresses()
	return err == nil && !sameSANs(c, dnsNames, ips)
}

func sameSANs(c *x509.Certificate, dnsNames []string, ips []net.IP) bool {
	norm := func(names []string) []string {
		out := make([]string, len(names))
		for i, n := range names {
			out[i] = strings.ToLower(n)
		}
		slices.Sort(out)
		return slices.Compact(out)
	}
	normIPs := func(ips []net.IP) [][]byte {
		out := make([][]byte, len(ips))
		for i, ip := range ips {
			if v4 := ip.To4(); v4 != nil {
				ip = v4
			}
			out[i] = ip
		}
		slices.SortFunc(out, bytes.Compare)
		return slices.CompactFunc(out, bytes.Equal)
	}
	return slices.Equal(norm(c.DNSNames), norm(dnsNames)) &&
		slices.EqualFunc(normIPs(c.IPAddresses), normIPs(ips), bytes.Equal)
}

// Renew requests a new serving certificate and installs it. It
// authenticates as the node with its current client certificate: the
// signer never issues a serving certificate to a bootstrap identity, so
// there is nothing to do before the node has one. A failure leaves the
// installed pair as it was.
func (m *Manager) Renew(ctx context.Context) (*cache.Credential, time.Time, error) {
	cfg := m.Config
	ctx, cancel := context.WithTimeout(ctx, cfg.RequestTimeout.Duration)
	defer cancel()
	client, err := cache.Dir{Path: cfg.CacheDir}.Load()
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("no client certificate to request the serving certificate with: %w", err)
	}
	if client.Leaf.Subject.CommonName != attestor.NodeUserPrefix+cfg.NodeName || !rotation.Usable(client.Leaf, m.now()) {
		return nil, time.Time{},
			fmt.Errorf("the client certificate (%s, valid until %s) is not usable for node %s; the serving certificate is requested by the node itself",
				client.Leaf.Subject.CommonName, client.Leaf.NotAfter.UTC().Format(time.RFC3339), cfg.NodeName)
	}
	restCfg, err := m.Source.NodeRESTConfig(client)
	if err != nil {
		return nil, time.Time{}, err
	}
	dnsNames, ips, err := m.Addresses()
	if err != nil {
		return nil, time.Time{}, err
	}
	err = m.Source.Obtain(ctx, restCfg, &credential.Request{
		SignerName: cfg.Serving.SignerName,
		Usages:     csr.ServingUsages,
		Lifetime:   cfg.Serving.CertificateLifetime.Duration,
		PKCS10: func(key *ecdsa.PrivateKey) ([]byte, error) {
			return csr.ServingPKCS10(key, cfg.NodeName, cfg.ProviderID, dnsNames, ips)
		},
		PendingKeyFile: PendingKeyFile,
		Store:          func(certPEM, keyPEM []byte) error { return m.install(certPEM, keyPEM, dnsNames, ips) },
	})
	if errors.Is(err, errOtherSANs) {
		// The pending key's request (same key, same name) carries the old
		// addresses: start afresh.
		_ = cache.Dir{Path: cfg.CacheDir}.ClearKey(PendingKeyFile)
	}
	if err != nil {
		return nil, time.Time{}, err
	}
	cred, err := m.Load()
	if err != nil {
		return nil, time.Time{}, err
	}
	return cred, rotation.Expiration(cred.Leaf), nil
}

// install checks what the signer issued against what was asked for and
// replaces the serving file atomically (0600): kubelet reads the old pair or
// the new one, never a mix.
func (m *Manager) install(certPEM, keyPEM []byte, dnsNames []string, ips []net.IP) error {
	body := append(append([]byte{}, certPEM...), keyPEM...)
	cred, err := cache.ParseCredential(body)
	if err != nil {
		return fmt.Errorf("refusing to install the serving certificate: %w", err)
	}
	if err := check(cred.Leaf, m.Config.NodeName); err != nil {
		return fmt.Errorf("refusing to install the serving certificate: %w", err)
	}
	if !sameSANs(cred.Leaf, dnsNames, ips) {
		return fmt.Errorf("refusing to install the serving certificate: %w: DNS %q IP %v, not the requested DNS %q IP %v",
			errOtherSANs, cred.Leaf.DNSNames, cred.Leaf.IPAddresses, dnsNames, ips)
	}
	path := m.Config.Serving.Path
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("unable to create the serving certificate's directory: %w", err)
	}
	return cache.WriteFileAtomic(path, body, 0o600)
}
