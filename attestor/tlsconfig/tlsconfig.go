// Package tlsconfig is the one outbound TLS configuration type used by every
// HTTPS client the agent or the controller opens to something outside the
// cluster (STS, JWKS, certificate-issuer URLs). Each upstream carries its own
// Config, so trusting one upstream's private CA never makes another upstream
// trust it.
//
// A Config has two knobs: TrustedCA, a PEM bundle that replaces (is not
// merged with) the system roots when set, and SecurityProfile, which picks
// the minimum TLS version and the TLS 1.2 cipher suites (Old, Intermediate,
// Modern, or Custom), after the Mozilla server-side TLS profiles. A
// TrustedCA file is read again when it changes, so a rotated CA needs no
// restart (docs/outbound-tls.md).
package tlsconfig

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"os"
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
}

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
				errs = append(errs, fmt.Errorf("securityProfile.custom.minTLSVersion: %q is not one of VersionTLS10, VersionTLS11, VersionTLS12, VersionTLS13", p.Custom.MinTLSVersion))
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
			if data, err = os.ReadFile(ca.File); err != nil {
				return nil, fmt.Errorf("unable to read trusted CA bundle: %w", err)
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

// HTTPClient returns an HTTP client for this upstream: its own transport
// with the TLS configuration, proxy from the environment, the given overall
// timeout, and no redirects followed (a verifier must talk to the host it
// checked, not wherever that host points).
//
// A trustedCA given as a file is read again when it changes (checked at
// most every ReloadInterval, before a request), so a rotated CA bundle
// takes effect without a restart; connections made with the old bundle are
// closed once idle. A bundle that cannot be read or holds no certificate
// leaves the last good one in use. The bundle must load when the client is
// made.
func (c *Config) HTTPClient(timeout time.Duration) (*http.Client, error) {
	tc, err := c.TLSConfig()
	if err != nil {
		return nil, err
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = tc
	var rt http.RoundTripper = tr
	if c != nil && c.TrustedCA != nil && c.TrustedCA.File != "" && len(c.TrustedCA.PEM) == 0 {
		data, err := os.ReadFile(c.TrustedCA.File)
		if err != nil {
			return nil, fmt.Errorf("unable to read trusted CA bundle: %w", err)
		}
		rt = &reloadingTransport{file: c.TrustedCA.File, sum: sha256.Sum256(data), checked: time.Now(), current: tr}
	}
	return &http.Client{
		Transport: rt,
		Timeout:   timeout,
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}, nil
}

// ReloadInterval is how often, at most, a client made by HTTPClient checks
// its trustedCA file for changes.
const ReloadInterval = time.Second

// reloadingTransport is a transport whose roots follow a CA bundle file.
type reloadingTransport struct {
	file string

	mu      sync.Mutex
	sum     [sha256.Size]byte
	checked time.Time
	current *http.Transport
}

func (r *reloadingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	return r.transport().RoundTrip(req)
}

// transport returns the transport for the bundle as it is now.
func (r *reloadingTransport) transport() *http.Transport {
	r.mu.Lock()
	defer r.mu.Unlock()
	if time.Since(r.checked) < ReloadInterval {
		return r.current
	}
	r.checked = time.Now()
	data, err := os.ReadFile(r.file)
	if err != nil {
		return r.current // keep the last good bundle
	}
	sum := sha256.Sum256(data)
	if sum == r.sum {
		return r.current
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		return r.current
	}
	next := r.current.Clone()
	next.TLSClientConfig = r.current.TLSClientConfig.Clone()
	next.TLSClientConfig.RootCAs = pool
	r.current.CloseIdleConnections()
	r.current, r.sum = next, sum
	return next
}

// CloseIdleConnections lets http.Client.CloseIdleConnections reach the
// current transport.
func (r *reloadingTransport) CloseIdleConnections() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.current.CloseIdleConnections()
}
