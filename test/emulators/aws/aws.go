// Package aws emulates, on 127.0.0.1, the AWS services the AWS attestor
// talks to: the instance metadata service (IMDSv2 only: a session token is
// required) and STS GetCallerIdentity (SigV4 checked against test
// credentials). The instance identity document is signed, as AWS does, with
// an rsa2048 PKCS#7 by a self-signed per-region certificate generated when
// the emulator starts.
package aws

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/smallstep/pkcs7"
)

// Instance describes the emulated EC2 instance.
type Instance struct {
	AccountID        string
	Region           string
	AvailabilityZone string
	InstanceID       string
	// Role is the instance profile role name.
	Role string
}

// DefaultInstance is used for zero fields of Options.Instance.
var DefaultInstance = Instance{
	AccountID:        "111122223333",
	Region:           "eu-test-1",
	AvailabilityZone: "eu-test-1a",
	InstanceID:       "i-0123456789abcdef0",
	Role:             "node-role",
}

// Emulator is a running IMDS + STS pair.
type Emulator struct {
	Instance Instance
	// IMDSURL is the base URL of the metadata service (plain HTTP).
	IMDSURL string
	// STSURL is the base URL of STS (HTTPS), STSHost its host:port and
	// STSCAPEM the PEM of the certificate its TLS server presents.
	STSURL   string
	STSHost  string
	STSCAPEM []byte
	// RegionCert and RegionCertPEM are the emulated region's rsa2048
	// certificate; RegionKey signs documents.
	RegionCert    *x509.Certificate
	RegionCertPEM []byte
	RegionKey     *rsa.PrivateKey
	// Document is the instance identity document IMDS serves.
	Document []byte

	mu      sync.Mutex
	now     func() time.Time
	tokens  map[string]time.Time
	creds   map[string]credential // access key -> credential
	current string                // access key IMDS hands out
	calls   int
}

// STSCalls returns how many GetCallerIdentity calls STS answered.
func (e *Emulator) STSCalls() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.calls
}

type credential struct {
	secret, token string
	// caller is the ARN GetCallerIdentity reports for this credential.
	arn string
}

// New starts an emulator for inst (zero fields from DefaultInstance) and
// stops it when the test ends.
func New(t testing.TB, inst Instance) *Emulator {
	t.Helper()
	fill := func(s *string, d string) {
		if *s == "" {
			*s = d
		}
	}
	fill(&inst.AccountID, DefaultInstance.AccountID)
	fill(&inst.Region, DefaultInstance.Region)
	fill(&inst.AvailabilityZone, inst.Region+"a")
	fill(&inst.InstanceID, DefaultInstance.InstanceID)
	fill(&inst.Role, DefaultInstance.Role)
	e := &Emulator{Instance: inst, now: time.Now, tokens: map[string]time.Time{}, creds: map[string]credential{}}

	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject: pkix.Name{Country: []string{"US"}, Province: []string{"Washington State"}, Locality: []string{"Seattle"},
			Organization: []string{"Amazon Web Services LLC"}},
		NotBefore: time.Now().Add(-time.Hour),
		NotAfter:  time.Now().Add(100 * 365 * 24 * time.Hour),
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	e.RegionCert, _ = x509.ParseCertificate(der)
	e.RegionKey = key
	e.RegionCertPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})

	e.Document, _ = json.MarshalIndent(map[string]any{
		"accountId":        inst.AccountID,
		"architecture":     "x86_64",
		"availabilityZone": inst.AvailabilityZone,
		"billingProducts":  nil,
		"imageId":          "ami-0123456789abcdef0",
		"instanceId":       inst.InstanceID,
		"instanceType":     "m5.large",
		"pendingTime":      time.Now().UTC().Format(time.RFC3339),
		"privateIp":        "10.0.0.10",
		"region":           inst.Region,
		"version":          "2017-09-30",
	}, "", "  ")
	e.current = e.AddCredential(fmt.Sprintf("arn:aws:sts::%s:assumed-role/%s/%s", inst.AccountID, inst.Role, inst.InstanceID))

	imds := httptest.NewServer(http.HandlerFunc(e.serveIMDS))
	t.Cleanup(imds.Close)
	e.IMDSURL = imds.URL
	sts := httptest.NewTLSServer(http.HandlerFunc(e.serveSTS))
	t.Cleanup(sts.Close)
	e.STSURL = sts.URL
	e.STSHost = strings.TrimPrefix(sts.URL, "https://")
	e.STSCAPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: sts.Certificate().Raw})
	return e
}

// SetClock sets the clock STS checks request expiry with.
func (e *Emulator) SetClock(now func() time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.now = now
}

// AddCredential registers a new STS credential that GetCallerIdentity
// reports as arn, and returns its access key ID.
func (e *Emulator) AddCredential(arn string) string {
	e.mu.Lock()
	defer e.mu.Unlock()
	id := "ASIA" + strings.ToUpper(randHex(8))
	e.creds[id] = credential{secret: randHex(20), token: "FwoG" + base64.StdEncoding.EncodeToString([]byte(randHex(24))), arn: arn}
	return id
}

// UseCredential makes IMDS hand out the credential with access key id.
func (e *Emulator) UseCredential(id string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.current = id
}

// SetDocument replaces the served document (it is signed when served).
func (e *Emulator) SetDocument(doc []byte) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.Document = doc
}

// Sign returns the DER PKCS#7 SignedData of doc by the region certificate,
// shaped like AWS's rsa2048 signature (SHA-256, content embedded).
func (e *Emulator) Sign(doc []byte) ([]byte, error) {
	return SignWith(doc, e.RegionCert, e.RegionKey)
}

// SignWith signs doc as the rsa2048 endpoint does, with any key.
func SignWith(doc []byte, cert *x509.Certificate, key *rsa.PrivateKey) ([]byte, error) {
	sd, err := pkcs7.NewSignedData(doc)
	if err != nil {
		return nil, err
	}
	sd.SetDigestAlgorithm(pkcs7.OIDDigestAlgorithmSHA256)
	if err := sd.AddSigner(cert, key, pkcs7.SignerInfoConfig{}); err != nil {
		return nil, err
	}
	return sd.Finish()
}

// WriteCertDir writes the region certificate as <region>.pem into a new
// temporary directory and returns it, for the verifier's certificatesDir.
func (e *Emulator) WriteCertDir(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, e.Instance.Region+".pem"), e.RegionCertPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func (e *Emulator) serveIMDS(w http.ResponseWriter, r *http.Request) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if r.URL.Path == "/latest/api/token" {
		if r.Method != http.MethodPut {
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		ttl, err := strconv.Atoi(r.Header.Get("X-aws-ec2-metadata-token-ttl-seconds"))
		if err != nil || ttl < 1 || ttl > 21600 {
			http.Error(w, "bad ttl", http.StatusBadRequest)
			return
		}
		tok := randHex(16)
		e.tokens[tok] = time.Now().Add(time.Duration(ttl) * time.Second)
		fmt.Fprint(w, tok)
		return
	}
	if r.Method != http.MethodGet {
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	exp, ok := e.tokens[r.Header.Get("X-aws-ec2-metadata-token")]
	if !ok || time.Now().After(exp) {
		http.Error(w, "Unauthorized", http.StatusUnauthorized)
		return
	}
	const credBase = "/latest/meta-data/iam/security-credentials/"
	switch r.URL.Path {
	case "/latest/dynamic/instance-identity/document":
		_, _ = w.Write(e.Document)
	case "/latest/dynamic/instance-identity/rsa2048":
		sig, err := e.Sign(e.Document)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		b64 := base64.StdEncoding.EncodeToString(sig)
		for len(b64) > 64 {
			fmt.Fprintln(w, b64[:64])
			b64 = b64[64:]
		}
		fmt.Fprint(w, b64)
	case credBase:
		fmt.Fprint(w, e.Instance.Role)
	case credBase + e.Instance.Role:
		c := e.creds[e.current]
		_ = json.NewEncoder(w).Encode(map[string]string{
			"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": e.current,
			"SecretAccessKey": c.secret, "Token": c.token,
			"LastUpdated": time.Now().UTC().Format(time.RFC3339),
			"Expiration":  time.Now().Add(6 * time.Hour).UTC().Format(time.RFC3339),
		})
	default:
		http.NotFound(w, r)
	}
}

func stsFail(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "text/xml")
	w.WriteHeader(status)
	fmt.Fprintf(w, `<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error><Type>Sender</Type><Code>%s</Code><Message>%s</Message></Error><RequestId>%s</RequestId></ErrorResponse>`, code, msg, randHex(8)) //nolint:lll // STS's error document, as AWS sends it
}

// serveSTS answers a SigV4 query-presigned GetCallerIdentity.
func (e *Emulator) serveSTS(w http.ResponseWriter, r *http.Request) {
	e.mu.Lock()
	defer e.mu.Unlock()
	q := r.URL.Query()
	if r.Method != http.MethodGet || q.Get("Action") != "GetCallerIdentity" || q.Get("Version") != "2011-06-15" {
		stsFail(w, http.StatusBadRequest, "InvalidAction", "only a GET GetCallerIdentity is emulated")
		return
	}
	if q.Get("X-Amz-Algorithm") != "AWS4-HMAC-SHA256" {
		stsFail(w, http.StatusBadRequest, "IncompleteSignature", "unsupported algorithm")
		return
	}
	scope := strings.Split(q.Get("X-Amz-Credential"), "/")
	if len(scope) != 5 || scope[3] != "sts" || scope[4] != "aws4_request" {
		stsFail(w, http.StatusBadRequest, "IncompleteSignature", "bad credential scope")
		return
	}
	cred, ok := e.creds[scope[0]]
	if !ok {
		stsFail(w, http.StatusForbidden, "InvalidClientTokenId", "The security token included in the request is invalid.")
		return
	}
	if q.Get("X-Amz-Security-Token") != cred.token {
		stsFail(w, http.StatusForbidden, "InvalidClientTokenId", "The security token included in the request is invalid.")
		return
	}
	date, err := time.Parse("20060102T150405Z", q.Get("X-Amz-Date"))
	expires, err2 := strconv.Atoi(q.Get("X-Amz-Expires"))
	if err != nil || err2 != nil || date.Format("20060102") != scope[1] {
		stsFail(w, http.StatusBadRequest, "IncompleteSignature", "bad date or expiry")
		return
	}
	if e.now().After(date.Add(time.Duration(expires) * time.Second)) {
		stsFail(w, http.StatusForbidden, "AccessDenied", "Request has expired")
		return
	}
	// Canonical request, built independently of the attestor's signer.
	signed := strings.Split(q.Get("X-Amz-SignedHeaders"), ";")
	var hdrs strings.Builder
	for _, h := range signed {
		val := r.Header.Get(h)
		if h == "host" {
			val = r.Host
		}
		hdrs.WriteString(h + ":" + strings.TrimSpace(val) + "\n")
	}
	cq := url.Values{}
	for k, vs := range q {
		if k != "X-Amz-Signature" {
			cq[k] = vs
		}
	}
	canonQuery := strings.ReplaceAll(cq.Encode(), "+", "%20")
	creq := "GET\n/\n" + canonQuery + "\n" + hdrs.String() + "\n" + q.Get("X-Amz-SignedHeaders") + "\n" + hex.EncodeToString(sha256Sum(nil))
	toSign := "AWS4-HMAC-SHA256\n" + q.Get("X-Amz-Date") + "\n" + strings.Join(scope[1:], "/") + "\n" + hex.EncodeToString(sha256Sum([]byte(creq)))
	k := []byte("AWS4" + cred.secret)
	for _, part := range scope[1:] {
		k = mac(k, part)
	}
	want := hex.EncodeToString(mac(k, toSign))
	if !hmac.Equal([]byte(want), []byte(q.Get("X-Amz-Signature"))) {
		stsFail(w, http.StatusForbidden, "SignatureDoesNotMatch", "The request signature we calculated does not match the signature you provided.")
		return
	}
	e.calls++
	account := strings.Split(cred.arn, ":")[4]
	w.Header().Set("Content-Type", "text/xml")
	fmt.Fprintf(w, `<GetCallerIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
  <GetCallerIdentityResult>
    <Arn>%s</Arn>
    <UserId>AROAEXAMPLE:%s</UserId>
    <Account>%s</Account>
  </GetCallerIdentityResult>
  <ResponseMetadata><RequestId>%s</RequestId></ResponseMetadata>
</GetCallerIdentityResponse>
`, cred.arn, cred.arn[strings.LastIndex(cred.arn, "/")+1:], account, randHex(8))
}

func sha256Sum(b []byte) []byte { s := sha256.Sum256(b); return s[:] }

func mac(k []byte, s string) []byte {
	m := hmac.New(sha256.New, k)
	m.Write([]byte(s))
	return m.Sum(nil)
}
