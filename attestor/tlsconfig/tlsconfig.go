// Package tlsconfig is the one outbound TLS configuration type used by every
// HTTPS client the agent or the controller opens to something outside the
// cluster (STS, JWKS, certificate-issuer URLs). Each upstream carries its own
// Config, so trusting one upstream's private CA never makes another upstream
// trust it.
//
// A Config has three knobs: TrustedCA, a PEM bundle that replaces (is not
// merged with) the system roots when set; SecurityProfile, which picks the
// minimum TLS version and the TLS 1.2 cipher suites (Old, Intermediate,
// Modern, or Custom), after the Mozilla server-side TLS profiles; and Proxy,
// the HTTP CONNECT proxy connections to this upstream go through (the
// environment's by default, none, or a URL of its own).
//
// An Upstream is the live form of one upstream's Config: clients made from
// it open new connections with whatever Config was last set on it, so the
// application can apply a changed Config without a restart
// (docs/outbound-tls.md).
package tlsconfig

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Config is the outbound TLS configuration of one upstream.
type Config struct {
	// TrustedCA, when set, is the only set of roots the client trusts for
	// this upstream; the system roots are not consulted.
	TrustedCA *CABundle `json:"trustedCA,omitempty"`
	// SecurityProfile picks the TLS versions and cipher suites; nil means
	// Intermediate.
	SecurityProfile *SecurityProfile `json:"securityProfile,omitempty"`
	// Proxy is how connections to this upstream leave the process. Empty:
	// the proxy the process environment names (HTTPS_PROXY, HTTP_PROXY for
	// plain http URLs, NO_PROXY, as Go reads them once per process).
	// "none": directly, whatever the environment says. Otherwise an http://
	// or https:// URL of a proxy (scheme, host and port only; user:password@
	// sends them as Basic proxy authorization and is never logged): every
	// connection to this upstream, NO_PROXY notwithstanding, goes through it,
	// https ones tunnelled with HTTP CONNECT so that TLS still runs end to end
	// between the controller and the upstream.
	Proxy string `json:"proxy,omitempty"`

	// upstream, when set (WithUpstream), is the live configuration clients
	// made by HTTPClient follow instead of this value.
	upstream *Upstream
}

// ProxyNone is the Proxy value that connects directly.
const ProxyNone = "none"

// MaxBundleBytes bounds a trustedCA file.
const MaxBundleBytes = 1 << 20

// CABundle names a PEM bundle of CA certificates: a file, or a ConfigMap
// whose key "ca-bundle.crt" holds it. Exactly one of File and ConfigMap is
// set. A ConfigMap reference is resolved by the application, which stores the
// bundle in PEM before calling TLSConfig.
type CABundle struct {
	// File is a path to a PEM file.
	File string `json:"file,omitempty"`
	// ConfigMap references a ConfigMap holding the bundle under
	// ConfigMapKey.
	ConfigMap *ConfigMapReference `json:"configMap,omitempty"`
	// PEM is the resolved bundle. It is never read from configuration.
	PEM []byte `json:"-"`
}

// ConfigMapKey is the key of a ConfigMap that holds a CA bundle.
const ConfigMapKey = "ca-bundle.crt"

// ConfigMapReference names a ConfigMap. An empty Namespace means the
// namespace the application runs in.
type ConfigMapReference struct {
	Name      string `json:"name"`
	Namespace string `json:"namespace,omitempty"`
}

// ProfileType names a security profile.
type ProfileType string

// The security profiles.
const (
	// ProfileOld accepts TLS 1.0 and later with legacy CBC cipher suites,
	// for upstreams that cannot do better.
	ProfileOld ProfileType = "Old"
	// ProfileIntermediate accepts TLS 1.2 and later with forward-secret
	// AEAD cipher suites. It is the default.
	ProfileIntermediate ProfileType = "Intermediate"
	// ProfileModern accepts TLS 1.3 only.
	ProfileModern ProfileType = "Modern"
	// ProfileCustom uses SecurityProfile.Custom.
	ProfileCustom ProfileType = "Custom"
)

// SecurityProfile selects the minimum TLS version and cipher suites.
type SecurityProfile struct {
	Type ProfileType `json:"type"`
	// Custom is required when Type is Custom and forbidden otherwise.
	Custom *CustomProfile `json:"custom,omitempty"`
}

// CustomProfile is an explicit minimum TLS version and cipher suite list.
type CustomProfile struct {
	// MinTLSVersion is one of VersionTLS10, VersionTLS11, VersionTLS12,
	// VersionTLS13.
	MinTLSVersion string `json:"minTLSVersion"`
	// Ciphers are IANA cipher suite names as Go spells them (for example
	// TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256). They apply to TLS 1.2 and
	// earlier; TLS 1.3 suites are not configurable. Empty means Go's
	// defaults.
	Ciphers []string `json:"ciphers,omitempty"`
}

var intermediateCiphers = []uint16{
	tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
	tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
	tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
	tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
	tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
	tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
}

var oldCiphers = append(append([]uint16{}, intermediateCiphers...),
	tls.TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256,
	tls.TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256,
	tls.TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA,
	tls.TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA,
	tls.TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA,
	tls.TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA,
	tls.TLS_RSA_WITH_AES_128_GCM_SHA256,
	tls.TLS_RSA_WITH_AES_256_GCM_SHA384,
	tls.TLS_RSA_WITH_AES_128_CBC_SHA256,
	tls.TLS_RSA_WITH_AES_128_CBC_SHA,
	tls.TLS_RSA_WITH_AES_256_CBC_SHA,
)

var tlsVersions = map[string]uint16{
	"VersionTLS10": tls.VersionTLS10,
	"VersionTLS11": tls.VersionTLS11,
	"VersionTLS12": tls.VersionTLS12,
	"VersionTLS13": tls.VersionTLS13,
}

// Validate reports every problem of c at once, without reading files.
func (c *Config) Validate() error {
	if c == nil {
		return nil
	}
	var errs []error
	if ca := c.TrustedCA; ca != nil {
		switch {
		case ca.File != "" && ca.ConfigMap != nil:
			errs = append(errs, errors.New("trustedCA: set only one of file and configMap"))
		case ca.File == "" && ca.ConfigMap == nil && len(ca.PEM) == 0:
			errs = append(errs, errors.New("trustedCA: set file or configMap"))
		case ca.ConfigMap != nil && ca.ConfigMap.Name == "":
			errs = append(errs, errors.New("trustedCA.configMap: name is required"))
		}
	}
	if _, err := c.proxyURL(); err != nil {
		errs = append(errs, err)
	}
	if p := c.SecurityProfile; p != nil {
		switch p.Type {
		case ProfileOld, ProfileIntermediate, ProfileModern:
			if p.Custom != nil {
				errs = append(errs, fmt.Errorf("securityProfile: custom is only allowed with type %s", ProfileCustom))
			}
		case ProfileCustom:
			if p.Custom == nil {
				errs = append(errs, errors.New("securityProfile: type Custom needs custom"))
				break
			}
			if _, ok := tlsVersions[p.Custom.MinTLSVersion]; !ok {
				errs = append(errs, fmt.Errorf("securityProfile.custom.minTLSVersion: %q is not one of VersionTLS10, VersionTLS11, VersionTLS12, VersionTLS13",
					p.Custom.MinTLSVersion))
			}
			if _, err := cipherIDs(p.Custom.Ciphers); err != nil {
				errs = append(errs, fmt.Errorf("securityProfile.custom.ciphers: %w", err))
			}
		default:
			errs = append(errs, fmt.Errorf("securityProfile.type: %q is not one of Old, Intermediate, Modern, Custom", p.Type))
		}
	}
	return errors.Join(errs...)
}

func cipherIDs(names []string) ([]uint16, error) {
	known := map[string]uint16{}
	for _, s := range tls.CipherSuites() {
		known[s.Name] = s.ID
	}
	for _, s := range tls.InsecureCipherSuites() {
		known[s.Name] = s.ID
	}
	var ids []uint16
	var unknown []string
	for _, n := range names {
		id, ok := known[n]
		if !ok {
			unknown = append(unknown, n)
			continue
		}
		ids = append(ids, id)
	}
	if len(unknown) > 0 {
		return nil, fmt.Errorf("unknown cipher suites: %s", strings.Join(unknown, ", "))
	}
	return ids, nil
}

// TLSConfig builds the client TLS configuration. A ConfigMap reference must
// have been resolved into TrustedCA.PEM first.
func (c *Config) TLSConfig() (*tls.Config, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	out := &tls.Config{MinVersion: tls.VersionTLS12, CipherSuites: intermediateCiphers}
	if c == nil {
		return out, nil
	}
	if p := c.SecurityProfile; p != nil {
		switch p.Type {
		case ProfileOld:
			out.MinVersion, out.CipherSuites = tls.VersionTLS10, oldCiphers
		case ProfileModern:
			out.MinVersion, out.CipherSuites = tls.VersionTLS13, nil
		case ProfileCustom:
			out.MinVersion = tlsVersions[p.Custom.MinTLSVersion]
			ids, _ := cipherIDs(p.Custom.Ciphers)
			out.CipherSuites = ids
		}
	}
	if ca := c.TrustedCA; ca != nil {
		data := ca.PEM
		if len(data) == 0 {
			if ca.File == "" {
				return nil, fmt.Errorf("trustedCA: ConfigMap %s/%s has not been resolved", ca.ConfigMap.Namespace, ca.ConfigMap.Name)
			}
			var err error
			if data, err = readBundle(ca.File); err != nil {
				return nil, err
			}
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(data) {
			return nil, errors.New("trustedCA: no PEM certificates found in the bundle")
		}
		out.RootCAs = pool
	}
	return out, nil
}

// proxyURL parses Proxy: nil for the environment's or none. Its errors
// never repeat credentials.
func (c *Config) proxyURL() (*url.URL, error) {
	if c == nil || c.Proxy == "" || c.Proxy == ProxyNone {
		return nil, nil
	}
	u, err := url.Parse(c.Proxy)
	if err != nil {
		// url.Parse's error quotes the input, credentials included.
		return nil, errors.New(`proxy: not a URL; want "none" or http(s)://host:port`)
	}
	shown := redact(u)
	var errs []error
	if u.Scheme != "http" && u.Scheme != "https" {
		errs = append(errs, fmt.Errorf("proxy %s: scheme %q, want http or https", shown, u.Scheme))
	}
	if u.Opaque != "" || u.Hostname() == "" {
		errs = append(errs, fmt.Errorf("proxy %s: names no host", shown))
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			errs = append(errs, fmt.Errorf("proxy %s: port %q is not 1-65535", shown, p))
		}
	}
	if (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" || u.ForceQuery {
		errs = append(errs, fmt.Errorf("proxy %s: only scheme, host and port are allowed (no path, query or fragment)", shown))
	}
	if u.User != nil && u.User.Username() == "" {
		errs = append(errs, fmt.Errorf("proxy %s: credentials with an empty user name", shown))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return u, nil
}

// redact returns u without its credentials, for messages.
func redact(u *url.URL) string {
	r := *u
	if r.User != nil {
		r.User = url.User("REDACTED")
	}
	r.Path, r.RawPath, r.RawQuery, r.Fragment = "", "", "", ""
	return r.String()
}

// ProxyString says where connections go, fit for a log line: "environment",
// "none", or the proxy URL with its credentials redacted.
func (c *Config) ProxyString() string {
	switch {
	case c == nil || c.Proxy == "":
		return "environment"
	case c.Proxy == ProxyNone:
		return ProxyNone
	}
	u, err := c.proxyURL()
	if err != nil || u == nil {
		return "invalid"
	}
	return redact(u)
}

// proxyFunc is the transport's Proxy for c.
func (c *Config) proxyFunc() (func(*http.Request) (*url.URL, error), error) {
	if c == nil || c.Proxy == "" {
		return http.ProxyFromEnvironment, nil
	}
	if c.Proxy == ProxyNone {
		return nil, nil
	}
	u, err := c.proxyURL()
	if err != nil {
		return nil, err
	}
	return http.ProxyURL(u), nil
}

// readBundle reads a trustedCA file, at most MaxBundleBytes of it.
func readBundle(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("unable to read trusted CA bundle: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxBundleBytes+1))
	if err != nil {
		return nil, fmt.Errorf("unable to read trusted CA bundle: %w", err)
	}
	if len(data) > MaxBundleBytes {
		return nil, fmt.Errorf("trusted CA bundle %s is larger than %d bytes", path, MaxBundleBytes)
	}
	return data, nil
}

// Load returns a copy of c with its trustedCA file, if any, read into
// TrustedCA.PEM. A ConfigMap bundle is read by the application before.
func (c *Config) Load() (*Config, error) {
	if c == nil || c.TrustedCA == nil || c.TrustedCA.File == "" {
		return c, nil
	}
	data, err := readBundle(c.TrustedCA.File)
	if err != nil {
		return nil, err
	}
	out := *c
	ca := *c.TrustedCA
	ca.PEM = data
	out.TrustedCA = &ca
	return &out, nil
}

// WithUpstream returns a copy of c whose HTTPClient follows u: what is set
// on u later applies to the client's new connections.
func (c *Config) WithUpstream(u *Upstream) *Config {
	out := Config{}
	if c != nil {
		out = *c
	}
	out.upstream = u
	return &out
}

// HTTPClient returns an HTTP client for this upstream: the given overall
// timeout, no redirects followed (a verifier must talk to the host it
// checked, not wherever that host points), and the transport of the
// Upstream c was given by WithUpstream, or else of c as it is now (its
// trustedCA file read once, here).
func (c *Config) HTTPClient(timeout time.Duration) (*http.Client, error) {
	u := (*Upstream)(nil)
	if c != nil {
		u = c.upstream
	}
	if u == nil {
		var err error
		if u, err = NewUpstream(c); err != nil {
			return nil, err
		}
	}
	return &http.Client{
		Transport: u,
		Timeout:   timeout,
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}, nil
}

// Upstream is the live outbound configuration of one upstream: an HTTP
// transport rebuilt whenever Set is given a Config that differs from the
// current one (its trustedCA file's content included). Requests in flight
// finish on the connections they have; connections made with the previous
// Config are closed once idle, so every new connection uses the new one.
type Upstream struct {
	mu      sync.Mutex
	sum     [sha256.Size]byte
	config  *Config
	current *http.Transport
}

// NewUpstream returns an Upstream that starts with c, which must load.
func NewUpstream(c *Config) (*Upstream, error) {
	u := &Upstream{}
	if _, err := u.Set(c); err != nil {
		return nil, err
	}
	return u, nil
}

// Set validates and loads c (reading its trustedCA file again) and, when it
// differs from the current Config, makes it the Config of new connections.
// A Config that does not validate or load changes nothing: the last good
// one stays in use, and the error says why.
func (u *Upstream) Set(c *Config) (changed bool, err error) {
	if err := c.Validate(); err != nil {
		return false, err
	}
	loaded, err := c.Load()
	if err != nil {
		return false, err
	}
	sum, err := loaded.sum()
	if err != nil {
		return false, err
	}
	u.mu.Lock()
	same := u.current != nil && sum == u.sum
	u.mu.Unlock()
	if same {
		return false, nil
	}
	tc, err := loaded.TLSConfig()
	if err != nil {
		return false, err
	}
	proxy, err := loaded.proxyFunc()
	if err != nil {
		return false, err
	}
	next := http.DefaultTransport.(*http.Transport).Clone()
	next.TLSClientConfig = tc
	next.Proxy = proxy
	u.mu.Lock()
	old := u.current
	u.current, u.sum, u.config = next, sum, loaded
	u.mu.Unlock()
	if old != nil {
		old.CloseIdleConnections()
	}
	return true, nil
}

// Config returns the Config in use, its trustedCA bundle loaded.
func (u *Upstream) Config() *Config {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.config
}

// RoundTrip implements http.RoundTripper with the current transport.
func (u *Upstream) RoundTrip(req *http.Request) (*http.Response, error) {
	u.mu.Lock()
	tr := u.current
	u.mu.Unlock()
	return tr.RoundTrip(req)
}

// CloseIdleConnections lets http.Client.CloseIdleConnections reach the
// current transport.
func (u *Upstream) CloseIdleConnections() {
	u.mu.Lock()
	tr := u.current
	u.mu.Unlock()
	tr.CloseIdleConnections()
}

// sum identifies a loaded Config: its settings and its bundle's content.
func (c *Config) sum() ([sha256.Size]byte, error) {
	var pem []byte
	if c != nil && c.TrustedCA != nil {
		pem = c.TrustedCA.PEM
	}
	data, err := json.Marshal(struct {
		Config *Config
		PEM    []byte
	}{c, pem})
	if err != nil {
		return [sha256.Size]byte{}, fmt.Errorf("unable to hash the TLS configuration: %w", err)
	}
	return sha256.Sum256(data), nil
}
