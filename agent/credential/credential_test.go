package credential

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"maps"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientauthv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"

	"sigs.k8s.io/kubelet-authenticator/agent/cache"
	"sigs.k8s.io/kubelet-authenticator/agent/config"
	"sigs.k8s.io/kubelet-authenticator/agent/csr"
	"sigs.k8s.io/kubelet-authenticator/agent/kube"
	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/test/harness"
)

// These tests run Source against a real kube-apiserver (test/harness): the
// node files CSRs with the bootstrap token (or its own certificate), and a
// small signer in the test decides on them the way the controller would,
// so that what is checked is the node's side of the protocol: which CSRs it
// files, what it does with a denial, a challenge or a failure.

const (
	testProvider   = "testprovider"
	testSignerName = "cluster.x-k8s.io/kube-apiserver-client-kubelet-" + testProvider
	testNode       = "node-1"
	testPID        = "test:///fleet/node-1"
)

// testEvidence is the test attestor's evidence: the binding it was asked
// to commit to and, in a second round, the challenge it answers.
type testEvidence struct {
	Version string `json:"version"`
	Binding string `json:"binding"`
	Answer  string `json:"answer,omitempty"`
}

// testAttestor produces testEvidence in the versions it is given, newest
// first, and records what it was asked.
type testAttestor struct {
	versions []string
	fail     error

	mu         sync.Mutex
	asked      []string // Request.Version of every Attest call
	challenges []attestor.Challenge
}

func (a *testAttestor) Versions() []string { return slices.Clone(a.versions) }

func (a *testAttestor) Attest(_ context.Context, req *attestor.Request) (*attestor.Attestation, error) {
	a.mu.Lock()
	a.asked = append(a.asked, req.Version)
	a.mu.Unlock()
	if a.fail != nil {
		return nil, a.fail
	}
	v := req.Version
	if v == "" {
		v = a.versions[0]
	}
	return attestor.Encode(v, testEvidence{Version: v, Binding: base64.StdEncoding.EncodeToString(req.Binding)})
}

// respondingAttestor adds the second round (attestor.Responder).
type respondingAttestor struct{ *testAttestor }

func (a respondingAttestor) Respond(_ context.Context, req *attestor.Request, ch *attestor.Challenge) (*attestor.Attestation, error) {
	a.mu.Lock()
	a.challenges = append(a.challenges, *ch)
	a.mu.Unlock()
	return attestor.Encode(a.versions[0], testEvidence{Version: a.versions[0], Binding: base64.StdEncoding.EncodeToString(req.Binding), Answer: "answer to " + string(ch.Data)})
}

// decision is what the test signer does with one pending CSR.
type decision struct {
	sign        bool
	deny        string // reason
	annotations map[string]string
}

// testSigner polls the CSRs of testSignerName and applies decide to each one
// not yet decided, recording every CSR it saw.
type testSigner struct {
	cp     *harness.ControlPlane
	decide func(*certificatesv1.CertificateSigningRequest, *attestor.AttestedRequest, testEvidence) decision

	mu   sync.Mutex
	seen map[string]*certificatesv1.CertificateSigningRequest
}

func startSigner(t *testing.T, cp *harness.ControlPlane, decide func(*certificatesv1.CertificateSigningRequest, *attestor.AttestedRequest, testEvidence) decision) *testSigner {
	t.Helper()
	s := &testSigner{cp: cp, decide: decide, seen: map[string]*certificatesv1.CertificateSigningRequest{}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			s.pass(ctx, t)
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return s
}

func (s *testSigner) pass(ctx context.Context, t *testing.T) {
	csrs := s.cp.Client.CertificatesV1().CertificateSigningRequests()
	list, err := csrs.List(ctx, metav1.ListOptions{})
	if err != nil {
		return
	}
	for i := range list.Items {
		c := &list.Items[i]
		if c.Spec.SignerName != testSignerName || len(c.Status.Conditions) > 0 {
			continue
		}
		s.mu.Lock()
		s.seen[c.Name] = c.DeepCopy()
		s.mu.Unlock()
		req, err := attestor.ParseRequest(c.Spec.Request)
		if err != nil {
			t.Errorf("the node filed a CSR that does not parse: %v", err)
			continue
		}
		var ev testEvidence
		if err := attestor.DecodeEvidence(req.Evidence, &ev); err != nil {
			t.Errorf("the node filed evidence that does not decode: %v", err)
			continue
		}
		d := s.decide(c, req, ev)
		if len(d.annotations) > 0 {
			if c.Annotations == nil {
				c.Annotations = map[string]string{}
			}
			for k, v := range d.annotations {
				c.Annotations[k] = v
			}
			if c, err = csrs.Update(ctx, c, metav1.UpdateOptions{}); err != nil {
				continue
			}
		}
		switch {
		case d.deny != "":
			c.Status.Conditions = append(c.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
				Type: certificatesv1.CertificateDenied, Status: corev1.ConditionTrue, Reason: d.deny, Message: "test signer"})
			_, _ = csrs.UpdateApproval(ctx, c.Name, c, metav1.UpdateOptions{})
		case d.sign:
			c.Status.Conditions = append(c.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
				Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue, Reason: "TestSigner", Message: "test signer"})
			if c, err = csrs.UpdateApproval(ctx, c.Name, c, metav1.UpdateOptions{}); err != nil {
				continue
			}
			c.Status.Certificate = signFor(t, s.cp, req.CSR, time.Now().Add(-time.Minute), time.Now().Add(time.Hour))
			_, _ = csrs.UpdateStatus(ctx, c, metav1.UpdateOptions{})
		}
	}
}

func (s *testSigner) filed() map[string]*certificatesv1.CertificateSigningRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.seen)
}

// signFor issues a kubelet client certificate for the CSR's key and subject
// from the cluster CA.
func signFor(t *testing.T, cp *harness.ControlPlane, req *x509.CertificateRequest, notBefore, notAfter time.Time) []byte {
	t.Helper()
	serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: req.Subject.CommonName, Organization: req.Subject.Organization},
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, cp.CA.Cert, req.PublicKey, cp.CA.Key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

// newSource returns a Source for testNode that files CSRs to cp with a
// bootstrap token.
func newSource(t *testing.T, cp *harness.ControlPlane, a attestor.Attestor) *Source {
	t.Helper()
	cfg := &config.NodeConfig{
		NodeName:            testNode,
		ProviderID:          testPID,
		Attestor:            testProvider,
		SignerName:          testSignerName,
		BootstrapKubeconfig: cp.BootstrapKubeconfig(t, cp.CreateBootstrapToken(t)),
		CacheDir:            filepath.Join(t.TempDir(), "cache"),
	}
	cfg.RequestTimeout.Duration = 30 * time.Second
	return &Source{Config: cfg, Attestor: a}
}

// logged is a context whose logger writes to the test's log, where the
// Source's progress lines show.
func logged(t *testing.T) context.Context {
	_, ctx := ktesting.NewTestContext(t)
	return ctx
}

func startControlPlane(t *testing.T) *harness.ControlPlane {
	t.Helper()
	if testing.Short() {
		t.Skip("needs kube-apiserver")
	}
	return harness.StartControlPlane(t, "credential")
}

// TestVersionNegotiation: a signer that does not accept the attestor's
// newest evidence version denies the CSR with UnsupportedEvidenceVersion and
// lists what it accepts; the node files again, once, in the newest version
// both support, and gets its certificate.
func TestVersionNegotiation(t *testing.T) {
	cp := startControlPlane(t)
	a := &testAttestor{versions: []string{"v3", "v2", "v1"}}
	var mu sync.Mutex
	supported := []string{"v1", "v2"}
	signer := startSigner(t, cp, func(_ *certificatesv1.CertificateSigningRequest, _ *attestor.AttestedRequest, ev testEvidence) decision {
		mu.Lock()
		defer mu.Unlock()
		if !slices.Contains(supported, ev.Version) {
			return decision{deny: attestor.ReasonUnsupportedEvidenceVersion, annotations: map[string]string{attestor.AnnotationSupportedVersions: strings.Join(supported, ",")}}
		}
		return decision{sign: true}
	})
	src := newSource(t, cp, a)
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.BufferLogs(true)))
	cred, _, err := src.Get(klog.NewContext(context.Background(), logger))
	if err != nil {
		t.Fatal(err)
	}
	if cred.Leaf.Subject.CommonName != attestor.NodeUserPrefix+testNode {
		t.Fatalf("certificate for %q", cred.Leaf.Subject.CommonName)
	}
	// The node's log says what it did: the version the signer rejected
	// and the one it filed next.
	log := logger.GetSink().(ktesting.Underlier).GetBuffer().String()
	for _, want := range []string{"Re-filing with another evidence version", `rejected="v3"`, `next="v2"`} {
		if !strings.Contains(log, want) {
			t.Errorf("the log does not say %s:\n%s", want, log)
		}
	}
	if want := []string{"", "v2"}; !slices.Equal(a.asked, want) {
		t.Errorf("attestor asked for versions %q, want %q (newest first, then the newest the signer accepts)", a.asked, want)
	}
	var versions []string
	for _, c := range signer.filed() {
		req, _ := attestor.ParseRequest(c.Spec.Request)
		versions = append(versions, req.Version)
	}
	slices.Sort(versions)
	if want := []string{"v2", "v3"}; !slices.Equal(versions, want) {
		t.Errorf("CSRs filed with evidence versions %q, want %q", versions, want)
	}

	// No version in common: the error says what each side speaks, and no
	// third CSR is filed.
	mu.Lock()
	supported = []string{"v9"}
	mu.Unlock()
	_, _, err = newSource(t, cp, &testAttestor{versions: []string{"v2", "v1"}}).Get(logged(t))
	if err == nil || !strings.Contains(err.Error(), "no evidence version in common") || !strings.Contains(err.Error(), "v9") {
		t.Fatalf("no common version: %v", err)
	}
}

// TestChallengeResponse: an attestor that answers a challenge files a
// first CSR, receives the signer's challenge from its annotation (with the
// CSR's name and UID), and files a second CSR over the same key carrying
// the answer; the certificate issued on the second is the one cached.
func TestChallengeResponse(t *testing.T) {
	cp := startControlPlane(t)
	a := respondingAttestor{&testAttestor{versions: []string{"v1"}}}
	var mu sync.Mutex
	var first *x509.CertificateRequest
	startSigner(t, cp, func(c *certificatesv1.CertificateSigningRequest, req *attestor.AttestedRequest, ev testEvidence) decision {
		mu.Lock()
		defer mu.Unlock()
		if ev.Answer == "" {
			if _, asked := c.Annotations[attestor.AnnotationChallenge]; asked {
				return decision{}
			}
			first = req.CSR
			return decision{annotations: map[string]string{attestor.AnnotationChallenge: "nonce-" + string(c.UID)}}
		}
		if first == nil || !bytes.Equal(req.CSR.RawSubjectPublicKeyInfo, first.RawSubjectPublicKeyInfo) {
			return decision{deny: "ChallengeKeyMismatch"}
		}
		return decision{sign: true}
	})
	src := newSource(t, cp, a)
	cred, _, err := src.Get(logged(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(a.challenges) != 1 {
		t.Fatalf("%d challenges answered, want 1", len(a.challenges))
	}
	ch := a.challenges[0]
	obj, err := cp.Client.CertificatesV1().CertificateSigningRequests().Get(context.Background(), ch.CSRName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the challenge names CSR %q: %v", ch.CSRName, err)
	}
	if ch.CSRUID != string(obj.UID) || string(ch.Data) != "nonce-"+string(obj.UID) {
		t.Errorf("challenge %+v, want UID %s and the annotation's data", ch, obj.UID)
	}
	pub, err := x509.MarshalPKIXPublicKey(cred.Leaf.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(pub, first.RawSubjectPublicKeyInfo) {
		t.Error("the cached certificate is not for the key of the challenged CSR")
	}
	if _, err := os.Stat(filepath.Join(src.Config.CacheDir, cache.PendingKeyFile)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pending key left behind: %v", err)
	}
}

// TestFailedRenewalKeepsCertificate: with a cached certificate past its
// renewal point but still valid, a renewal the signer denies (or an
// attestor that fails) leaves the cache as it was; Get hands the current
// certificate to kubelet and asks to be called again soon, Renew (the agent)
// reports the failure. Without a usable certificate the failure is an error.
func TestFailedRenewalKeepsCertificate(t *testing.T) {
	cp := startControlPlane(t)
	startSigner(t, cp, func(*certificatesv1.CertificateSigningRequest, *attestor.AttestedRequest, testEvidence) decision {
		return decision{deny: "TestDenied"}
	})
	for name, a := range map[string]*testAttestor{
		"denied":             {versions: []string{"v1"}},
		"attestation failed": {versions: []string{"v1"}, fail: errors.New("device gone")},
	} {
		t.Run(name, func(t *testing.T) {
			src := newSource(t, cp, a)
			dir := cache.Dir{Path: src.Config.CacheDir}
			if _, _, err := src.Get(logged(t)); err == nil {
				t.Fatal("no certificate and a failing renewal: Get succeeded")
			}

			// A certificate 90% through its life: usable, not fresh.
			key, err := csr.GenerateKey()
			if err != nil {
				t.Fatal(err)
			}
			now := time.Now()
			certPEM := signFor(t, cp, &x509.CertificateRequest{
				Subject:   pkix.Name{CommonName: attestor.NodeUserPrefix + testNode, Organization: []string{attestor.NodesGroup}},
				PublicKey: key.Public(),
			}, now.Add(-9*time.Hour), now.Add(time.Hour))
			der, _ := x509.MarshalPKCS8PrivateKey(key)
			if err := dir.Store(certPEM, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})); err != nil {
				t.Fatal(err)
			}
			before, err := os.ReadFile(filepath.Join(dir.Path, cache.CurrentFile))
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := src.Cached(); ok {
				t.Fatal("the test certificate is fresh; it must be due for renewal")
			}

			cred, retry, err := src.Get(logged(t))
			if err != nil {
				t.Fatalf("Get with a usable certificate and a failing renewal: %v", err)
			}
			if !bytes.Equal(cred.CertPEM, certPEM) {
				t.Error("Get did not return the current certificate")
			}
			if !retry.After(time.Now()) || retry.After(time.Now().Add(time.Minute+time.Second)) {
				t.Errorf("retry at %s: want within a minute, so that kubelet asks again soon", retry)
			}
			if _, _, err := src.Renew(logged(t)); err == nil {
				t.Error("Renew reported success for a failed renewal")
			}
			after, err := os.ReadFile(filepath.Join(dir.Path, cache.CurrentFile))
			if err != nil || !bytes.Equal(before, after) {
				t.Errorf("the cached credential changed after a failed renewal (%v)", err)
			}
		})
	}
}

// TestBootstrapTokenOnlyToItsServer: KUBERNETES_EXEC_INFO names the cluster
// of kubelet's kubeconfig, which may differ from the bootstrap
// kubeconfig's; the bootstrap token is sent only to the bootstrap
// kubeconfig's server (with its CA), so a server named in the exec info,
// even one the plugin is told not to verify, receives nothing.
func TestBootstrapTokenOnlyToItsServer(t *testing.T) {
	cp := startControlPlane(t)
	startSigner(t, cp, func(*certificatesv1.CertificateSigningRequest, *attestor.AttestedRequest, testEvidence) decision {
		return decision{sign: true}
	})
	var mu sync.Mutex
	var got []string
	other := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.Path+" Authorization="+r.Header.Get("Authorization"))
		mu.Unlock()
		http.Error(w, "not here", http.StatusForbidden)
	}))
	t.Cleanup(other.Close)

	src := newSource(t, cp, &testAttestor{versions: []string{"v1"}})
	src.Cluster = &clientauthv1.Cluster{Server: other.URL, InsecureSkipTLSVerify: true}
	if _, _, err := src.Get(logged(t)); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) > 0 {
		t.Fatalf("the exec info's server received %q", got)
	}
}

// TestRenewalWithoutBootstrapKubeconfig: operators delete the bootstrap
// kubeconfig once the node has joined; renewals, which authenticate as the
// node, keep reaching the cluster recorded when the certificate was issued.
func TestRenewalWithoutBootstrapKubeconfig(t *testing.T) {
	cp := startControlPlane(t)
	startSigner(t, cp, func(*certificatesv1.CertificateSigningRequest, *attestor.AttestedRequest, testEvidence) decision {
		return decision{sign: true}
	})
	src := newSource(t, cp, &testAttestor{versions: []string{"v1"}})
	first, _, err := src.Get(logged(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(src.Config.BootstrapKubeconfig); err != nil {
		t.Fatal(err)
	}
	c, err := ClusterConfig(src.Config)
	if err != nil {
		t.Fatal(err)
	}
	if c.Host != cp.URL || !bytes.Equal(c.CAData, cp.CACertPEM) || c.BearerToken != "" {
		t.Errorf("recorded cluster %s (CA %t, token %t), want %s with the cluster CA and no credential", c.Host, bytes.Equal(c.CAData, cp.CACertPEM), c.BearerToken != "", cp.URL)
	}
	recordPath := filepath.Join(src.Config.CacheDir, cache.ClusterFile)
	before, err := os.Stat(recordPath)
	if err != nil {
		t.Fatal(err)
	}
	second, _, err := src.Renew(logged(t))
	if err != nil {
		t.Fatalf("renewal as the node without the bootstrap kubeconfig: %v", err)
	}
	if second.Leaf.SerialNumber.Cmp(first.Leaf.SerialNumber) == 0 {
		t.Error("Renew returned the old certificate")
	}
	// The same cluster is not written again (an atomic write would have
	// replaced the file).
	after, err := os.Stat(recordPath)
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(before, after) {
		t.Error("renewal rewrote the unchanged cluster record")
	}
}

// TestInsecureSkipTLSVerifyRefused: a bootstrap kubeconfig (or kubelet's,
// in KUBERNETES_EXEC_INFO) with insecure-skip-tls-verify is refused for
// every connection the node makes as itself, with an error naming the
// setting: the bootstrap token and the node's certificate go only to a
// server the node has verified. The server named there receives nothing.
func TestInsecureSkipTLSVerifyRefused(t *testing.T) {
	var mu sync.Mutex
	var got []string
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.Path)
		mu.Unlock()
		http.Error(w, "not here", http.StatusForbidden)
	}))
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	bootstrap := filepath.Join(dir, "bootstrap-kubelet.conf")
	if err := os.WriteFile(bootstrap, []byte("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: "+srv.URL+"\n    insecure-skip-tls-verify: true\n"+
		"contexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\nusers:\n- name: u\n  user: {token: abcdef.0123456789abcdef}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := &config.NodeConfig{NodeName: testNode, ProviderID: testPID, Attestor: testProvider, SignerName: testSignerName,
		BootstrapKubeconfig: bootstrap, CacheDir: filepath.Join(dir, "cache")}
	cfg.RequestTimeout.Duration = 5 * time.Second
	src := &Source{Config: cfg, Attestor: &testAttestor{versions: []string{"v1"}}}
	refused := func(what string, err error, source string) {
		t.Helper()
		if !errors.Is(err, kube.ErrInsecureSkipTLSVerify) || !strings.Contains(err.Error(), "remove insecure-skip-tls-verify") || !strings.Contains(err.Error(), source) {
			t.Errorf("%s: %v, want a refusal naming insecure-skip-tls-verify in %s", what, err, source)
		}
	}

	_, _, err := src.Get(logged(t))
	refused("bootstrap", err, bootstrap)
	_, err = ClusterConfig(cfg)
	refused("the node's cluster (renewal, trust bundles)", err, bootstrap)

	// A renewal as the node, with its certificate, to the cluster of the
	// bootstrap kubeconfig or of kubelet's kubeconfig.
	current := &cache.Credential{CertPEM: []byte("node certificate"), KeyPEM: []byte("node key")}
	_, err = src.NodeRESTConfig(current)
	refused("renewal with the bootstrap kubeconfig's cluster", err, bootstrap)
	src.Cluster = &clientauthv1.Cluster{Server: srv.URL, InsecureSkipTLSVerify: true}
	_, err = src.NodeRESTConfig(current)
	refused("renewal with KUBERNETES_EXEC_INFO's cluster", err, "KUBERNETES_EXEC_INFO")

	mu.Lock()
	defer mu.Unlock()
	if len(got) > 0 {
		t.Fatalf("the server of an insecure-skip-tls-verify kubeconfig received %q", got)
	}
}
