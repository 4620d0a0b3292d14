// Package gcp emulates, on 127.0.0.1, the Google endpoints the GCP attestor
// talks to: the GCE metadata server's instance identity token endpoint and
// the project ID, zone and instance name (all require Metadata-Flavor:
// Google), and a JWKS publishing the signing key, served over HTTPS.
// Tokens are RS256 JWTs shaped like Google's, signed by a key generated when
// the emulator starts.
package gcp

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
)

// Instance describes the emulated VM.
type Instance struct {
	ProjectID     string
	ProjectNumber int64
	Zone          string
	InstanceName  string
	InstanceID    string
}

// DefaultInstance is used for zero fields of the instance given to New.
var DefaultInstance = Instance{
	ProjectID:     "test-project",
	ProjectNumber: 123456789012,
	Zone:          "europe-test1-b",
	InstanceName:  "node-a",
	InstanceID:    "4567890123456789012",
}

// Emulator is a running metadata server and JWKS.
type Emulator struct {
	Instance Instance
	// MetadataURL is the base URL of the metadata server (plain HTTP).
	MetadataURL string
	// JWKSURL is the JWKS (HTTPS); JWKSCAPEM is the certificate its TLS
	// server presents.
	JWKSURL   string
	JWKSCAPEM []byte

	mu       sync.Mutex
	now      func() time.Time
	lifetime time.Duration
	key      *rsa.PrivateKey
	kid      string
	fetches  int
	tlsCert  *tls.Certificate
}

// JWKSFetches returns how many times the JWKS was fetched.
func (e *Emulator) JWKSFetches() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.fetches
}

// New starts an emulator for inst (zero fields from DefaultInstance) and
// stops it when the test ends.
func New(t testing.TB, inst Instance) *Emulator {
	t.Helper()
	if inst.ProjectID == "" {
		inst.ProjectID = DefaultInstance.ProjectID
	}
	if inst.ProjectNumber == 0 {
		inst.ProjectNumber = DefaultInstance.ProjectNumber
	}
	if inst.Zone == "" {
		inst.Zone = DefaultInstance.Zone
	}
	if inst.InstanceName == "" {
		inst.InstanceName = DefaultInstance.InstanceName
	}
	if inst.InstanceID == "" {
		inst.InstanceID = DefaultInstance.InstanceID
	}
	e := &Emulator{Instance: inst, now: time.Now, lifetime: time.Hour}
	e.RotateKey(t)
	md := httptest.NewServer(http.HandlerFunc(e.serveMetadata))
	t.Cleanup(md.Close)
	e.MetadataURL = md.URL
	e.RotateTLS(t)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
		e.mu.Lock()
		defer e.mu.Unlock()
		return e.tlsCert, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	jwks := &http.Server{Handler: http.HandlerFunc(e.serveJWKS)}
	// Every fetch is a new TLS handshake, so a rotated certificate is
	// presented to the very next client.
	jwks.SetKeepAlivesEnabled(false)
	go func() { _ = jwks.Serve(ln) }()
	t.Cleanup(func() { _ = jwks.Close() })
	e.JWKSURL = "https://" + ln.Addr().String() + "/oauth2/v3/certs"
	return e
}

// RotateTLS gives the JWKS server a new self-signed certificate (for
// 127.0.0.1), as a CA rotation of the upstream would, and returns its PEM,
// also in JWKSCAPEM: clients that trust only the old one fail from the
// next connection on.
func (e *Emulator) RotateTLS(t testing.TB) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: "jwks emulator"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, DNSNames: []string{"localhost"},
		IsCA: true, BasicConstraintsValid: true,
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	p := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	e.mu.Lock()
	defer e.mu.Unlock()
	e.tlsCert = &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	e.JWKSCAPEM = p
	return p
}

// RotateKey replaces the signing key; the JWKS publishes only the new one.
func (e *Emulator) RotateKey(t testing.TB) {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 20)
	_, _ = rand.Read(b)
	e.mu.Lock()
	defer e.mu.Unlock()
	e.key, e.kid = key, hex.EncodeToString(b)
}

// ShareKey makes e sign with other's current key, as Google signs the
// tokens of every project with the same published keys: a verifier that
// trusts other's JWKS accepts e's tokens' signatures.
func (e *Emulator) ShareKey(other *Emulator) {
	other.mu.Lock()
	key, kid := other.key, other.kid
	other.mu.Unlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.key, e.kid = key, kid
}

// SetClock sets the clock tokens are issued with.
func (e *Emulator) SetClock(now func() time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.now = now
}

// Sign signs claims as Google does (RS256, kid, typ JWT).
func (e *Emulator) Sign(claims any) (string, error) {
	e.mu.Lock()
	key, kid := e.key, e.kid
	e.mu.Unlock()
	return SignWith(claims, key, kid)
}

// SignWith signs claims with any RSA key.
func SignWith(claims any, key *rsa.PrivateKey, kid string) (string, error) {
	s, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: key},
		(&jose.SignerOptions{}).WithType("JWT").WithHeader("kid", kid))
	if err != nil {
		return "", err
	}
	payload, err := json.Marshal(claims)
	if err != nil {
		return "", err
	}
	jws, err := s.Sign(payload)
	if err != nil {
		return "", err
	}
	return jws.CompactSerialize()
}

// Claims returns the claims of a token for audience, as the metadata
// server issues it with format=full.
func (e *Emulator) Claims(audience string) map[string]any {
	e.mu.Lock()
	now, life := e.now(), e.lifetime
	e.mu.Unlock()
	return map[string]any{
		"iss": "https://accounts.google.com", "aud": audience,
		"azp": "112233445566778899000", "sub": "112233445566778899000",
		"email":          e.Instance.InstanceName + "@" + e.Instance.ProjectID + ".iam.gserviceaccount.com",
		"email_verified": true,
		"iat":            now.Unix(), "exp": now.Add(life).Unix(),
		"google": map[string]any{"compute_engine": map[string]any{
			"instance_creation_timestamp": now.Add(-time.Hour).Unix(),
			"instance_id":                 e.Instance.InstanceID,
			"instance_name":               e.Instance.InstanceName,
			"project_id":                  e.Instance.ProjectID,
			"project_number":              e.Instance.ProjectNumber,
			"zone":                        e.Instance.Zone,
		}},
	}
}

func (e *Emulator) serveMetadata(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Metadata-Flavor") != "Google" || r.Header.Get("X-Forwarded-For") != "" {
		http.Error(w, "Missing required header: Metadata-Flavor", http.StatusForbidden)
		return
	}
	w.Header().Set("Metadata-Flavor", "Google")
	switch r.URL.Path {
	case "/computeMetadata/v1/project/project-id":
		_, _ = w.Write([]byte(e.Instance.ProjectID))
		return
	case "/computeMetadata/v1/instance/zone":
		_, _ = fmt.Fprintf(w, "projects/%d/zones/%s", e.Instance.ProjectNumber, e.Instance.Zone)
		return
	case "/computeMetadata/v1/instance/name":
		_, _ = w.Write([]byte(e.Instance.InstanceName))
		return
	case "/computeMetadata/v1/instance/service-accounts/default/identity":
	default:
		http.NotFound(w, r)
		return
	}
	aud := r.URL.Query().Get("audience")
	if aud == "" {
		http.Error(w, "non-empty audience parameter required", http.StatusBadRequest)
		return
	}
	claims := e.Claims(aud)
	if r.URL.Query().Get("format") != "full" {
		delete(claims, "google")
	}
	tok, err := e.Sign(claims)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	_, _ = w.Write([]byte(tok))
}

func (e *Emulator) serveJWKS(w http.ResponseWriter, r *http.Request) {
	e.mu.Lock()
	e.fetches++
	set := jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &e.key.PublicKey, KeyID: e.kid, Algorithm: "RS256", Use: "sig"}}}
	e.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(set)
}
