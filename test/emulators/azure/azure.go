// Package azure emulates, on 127.0.0.1, the Azure instance metadata
// service's attested document endpoint (requires the Metadata: true header).
// Documents are PKCS#7-signed, as IMDS does, by a certificate for
// metadata.azure.com issued by a self-made two-level CA (root and issuing
// CA, generated when the emulator starts); like IMDS, only the signing
// certificate is embedded.
package azure

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/smallstep/pkcs7"
)

// VM describes the emulated virtual machine.
type VM struct {
	SubscriptionID string
	VMID           string
	Region         string
}

// DefaultVM is used for zero fields of the VM given to New.
var DefaultVM = VM{
	SubscriptionID: "00000000-1111-2222-3333-444444444444",
	VMID:           "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
	Region:         "testregion",
}

// CA is a self-made certificate authority.
type CA struct {
	Cert *x509.Certificate
	Key  *rsa.PrivateKey
	PEM  []byte
}

// Emulator is a running IMDS.
type Emulator struct {
	VM VM
	// URL is the base URL of IMDS (plain HTTP).
	URL string
	// Root and Issuing are the CAs; Signer signs documents.
	Root, Issuing, Signer *CA

	mu       sync.Mutex
	now      func() time.Time
	lifetime time.Duration
}

// New starts an emulator for vm (zero fields from DefaultVM) and stops it
// when the test ends.
func New(t testing.TB, vm VM) *Emulator {
	t.Helper()
	if vm.SubscriptionID == "" {
		vm.SubscriptionID = DefaultVM.SubscriptionID
	}
	if vm.VMID == "" {
		vm.VMID = DefaultVM.VMID
	}
	if vm.Region == "" {
		vm.Region = DefaultVM.Region
	}
	e := &Emulator{VM: vm, now: time.Now, lifetime: 6 * time.Hour}
	e.Root = NewCA(t, nil, "Test TLS RSA Root G2", nil)
	e.Issuing = NewCA(t, e.Root, "Test Azure RSA TLS Issuing CA 01", nil)
	e.Signer = NewCA(t, e.Issuing, "metadata.azure.com", []string{vm.Region + ".metadata.azure.com", "metadata.azure.com"})
	srv := httptest.NewServer(http.HandlerFunc(e.serve))
	t.Cleanup(srv.Close)
	e.URL = srv.URL
	return e
}

// NewCA makes a certificate: a root when parent is nil, a CA when dnsNames
// is empty, otherwise a TLS server leaf for dnsNames.
func NewCA(t testing.TB, parent *CA, cn string, dnsNames []string) *CA {
	t.Helper()
	return NewCAWithIssuerURL(t, parent, cn, dnsNames, "")
}

// NewCAWithIssuerURL is NewCA with an Authority Information Access "CA
// Issuers" URL naming where the issuer's certificate is published, as
// Microsoft's IMDS signing certificates carry.
func NewCAWithIssuerURL(t testing.TB, parent *CA, cn string, dnsNames []string, issuerURL string) *CA {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{Country: []string{"US"}, Organization: []string{"Microsoft Corporation"}, CommonName: cn},
		NotBefore:    time.Now().Add(-24 * time.Hour),
		NotAfter:     time.Now().Add(365 * 24 * time.Hour),
	}
	if issuerURL != "" {
		tmpl.IssuingCertificateURL = []string{issuerURL}
	}
	if len(dnsNames) == 0 {
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
		tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign
	} else {
		tmpl.DNSNames = dnsNames
		tmpl.Subject.Province, tmpl.Subject.Locality = []string{"WA"}, []string{"Redmond"}
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	}
	issuer, signKey := tmpl, key
	if parent != nil {
		issuer, signKey = parent.Cert, parent.Key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, issuer, &key.PublicKey, signKey)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &CA{Cert: cert, Key: key, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// WriteFile writes c's certificate to a PEM file in a temporary directory
// and returns its path.
func (c *CA) WriteFile(t testing.TB) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(p, c.PEM, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// ServeIssuer makes the emulator's signing certificate name, in its
// Authority Information Access, the issuing CA's certificate (DER) at a
// new HTTP server on 127.0.0.1, as Microsoft publishes its issuing CAs.
// It returns the server's host:port and a counter of fetches.
func (e *Emulator) ServeIssuer(t testing.TB) (host string, fetches func() int) {
	t.Helper()
	var mu sync.Mutex
	n := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		n++
		mu.Unlock()
		w.Header().Set("Content-Type", "application/pkix-cert")
		_, _ = w.Write(e.Issuing.Cert.Raw)
	}))
	t.Cleanup(srv.Close)
	signer := NewCAWithIssuerURL(t, e.Issuing, "metadata.azure.com", []string{e.VM.Region + ".metadata.azure.com", "metadata.azure.com"},
		srv.URL+"/pkiops/certs/issuing.crt")
	e.mu.Lock()
	e.Signer = signer
	e.mu.Unlock()
	return srv.Listener.Addr().String(), func() int { mu.Lock(); defer mu.Unlock(); return n }
}

// SetClock sets the clock documents are stamped with.
func (e *Emulator) SetClock(now func() time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.now = now
}

// Content returns the attested data IMDS signs for nonce.
func (e *Emulator) Content(nonce string) []byte {
	e.mu.Lock()
	now, life := e.now().UTC(), e.lifetime
	e.mu.Unlock()
	const layout = "01/02/06 15:04:05 -0000"
	b, _ := json.Marshal(map[string]any{
		"licenseType": "", "nonce": nonce,
		"plan": map[string]string{"name": "", "product": "", "publisher": ""},
		"sku":  "22_04-lts-gen2", "subscriptionId": e.VM.SubscriptionID,
		"timeStamp": map[string]string{"createdOn": now.Format(layout), "expiresOn": now.Add(life).Format(layout)},
		"vmId":      e.VM.VMID,
	})
	return b
}

// Sign returns the base64 PKCS#7 of content by signer, embedding only the
// signer's certificate, as IMDS's "signature" field.
func Sign(content []byte, signer *CA) (string, error) {
	sd, err := pkcs7.NewSignedData(content)
	if err != nil {
		return "", err
	}
	sd.SetDigestAlgorithm(pkcs7.OIDDigestAlgorithmSHA256)
	if err := sd.AddSigner(signer.Cert, signer.Key, pkcs7.SignerInfoConfig{}); err != nil {
		return "", err
	}
	der, err := sd.Finish()
	if err != nil {
		return "", err
	}
	return base64.StdEncoding.EncodeToString(der), nil
}

func (e *Emulator) serve(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	if r.Header.Get("Metadata") != "true" {
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"error":"Bad request. Required metadata header not specified"}`))
		return
	}
	if r.URL.Path != "/metadata/attested/document" {
		http.NotFound(w, r)
		return
	}
	q := r.URL.Query()
	if q.Get("api-version") == "" {
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"error":"Bad request. api-version was not specified in the request"}`))
		return
	}
	nonce := q.Get("nonce")
	if len(nonce) > 32 {
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"error":"Bad request. Nonce is too long"}`))
		return
	}
	if nonce == "" {
		nonce = e.now().UTC().Format("20060102-150405")
	}
	e.mu.Lock()
	signer := e.Signer
	e.mu.Unlock()
	sig, err := Sign(e.Content(nonce), signer)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	_ = json.NewEncoder(w).Encode(map[string]string{"encoding": "pkcs7", "signature": sig})
}
