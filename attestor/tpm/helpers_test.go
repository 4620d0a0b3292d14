package tpm

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	realdatapkg "sigs.k8s.io/kubelet-authenticator/test/realdata"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// testNow is the fixed clock of tests that do not exercise real
// certificates' validity.
var testNow = time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)

const (
	testNode       = "node-a"
	testProviderID = "metal://rack1/node-a"
	testBootstrap  = "system:bootstrap:abcdef"
)

var testHMACKey = []byte("0123456789abcdef0123456789abcdef-test-controller-key")

// clock is a settable fake clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// csrFor makes a CSR for the kubelet client certificate with key.
func csrFor(t testing.TB, key *ecdsa.PrivateKey, node, providerID string) ([]byte, *x509.CertificateRequest) {
	t.Helper()
	ext, err := attestor.ProviderIDExtension(providerID)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:         pkix.Name{CommonName: "system:node:" + node, Organization: []string{"system:nodes"}},
		ExtraExtensions: []pkix.Extension{ext},
	}, key)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		t.Fatal(err)
	}
	return der, csr
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// cluster is a fake workload cluster's CSR store.
type cluster struct {
	mu   sync.Mutex
	csrs map[string]*attestor.CSRRecord
	// err, when set, is what LookupCSR returns (a transient failure).
	err error
}

func newCluster() *cluster { return &cluster{csrs: map[string]*attestor.CSRRecord{}} }

func (c *cluster) lookup(_ context.Context, name string) (*attestor.CSRRecord, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return nil, c.err
	}
	r, ok := c.csrs[name]
	if !ok {
		return nil, fmt.Errorf("csr %q: %w", name, attestor.ErrCSRNotFound)
	}
	cp := *r
	cp.Annotations = map[string]string{}
	for k, v := range r.Annotations {
		cp.Annotations[k] = v
	}
	return &cp, nil
}

func (c *cluster) put(r *attestor.CSRRecord) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.csrs[r.Name] = r
}

func (c *cluster) get(name string) *attestor.CSRRecord {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.csrs[name]
}

// filed is a CSR as the node filed it and the signer sees it.
type filed struct {
	record *attestor.CSRRecord
	parsed *attestor.AttestedRequest
}

// file encodes a CSR with evidence into spec.request, stores it and parses
// it back the way the signer does.
func (c *cluster) file(t testing.TB, name, username string, csrDER []byte, ev attestor.Evidence) *filed {
	t.Helper()
	req, err := attestor.EncodeRequest(csrDER, Name, ev)
	if err != nil {
		t.Fatal(err)
	}
	parsed, err := attestor.ParseRequest(req)
	if err != nil {
		t.Fatal(err)
	}
	ann := map[string]string{}
	if v, err := EndorsementKeyAnnotation(ev); err != nil {
		t.Fatal(err)
	} else if v != "" {
		ann[attestor.AnnotationEndorsementKey] = v
	}
	r := &attestor.CSRRecord{
		Name:        name,
		UID:         "uid-" + name,
		Username:    username,
		SignerName:  attestor.ClientSignerName(Name),
		Request:     req,
		Annotations: ann,
	}
	c.put(r)
	return &filed{record: r, parsed: parsed}
}

// verifyRequest is what the signer hands a verifier for f.
func (c *cluster) verifyRequest(f *filed, machine map[string]string) *attestor.VerifyRequest {
	pid, _ := attestor.ProviderIDFromExtensions(f.parsed.CSR.Extensions)
	return &attestor.VerifyRequest{
		Evidence:           f.parsed.Evidence,
		Version:            f.parsed.Version,
		Binding:            attestor.Binding(f.parsed.CSR.RawSubjectPublicKeyInfo),
		CSR:                f.parsed.CSR,
		NodeName:           strings.TrimPrefix(f.parsed.CSR.Subject.CommonName, "system:node:"),
		ProviderID:         pid,
		CSRName:            f.record.Name,
		CSRUID:             f.record.UID,
		Username:           f.record.Username,
		Annotations:        f.record.Annotations,
		MachineAnnotations: machine,
		LookupCSR:          c.lookup,
	}
}

// roundTrip runs the whole protocol through the wire format: the node
// attests, files CSR #1; the signer challenges; the node answers on CSR #2
// with the same key; the signer proves the identity.
func roundTrip(t testing.TB, node *Attestor, v *Verifier, machine map[string]string) *attestor.Identity {
	t.Helper()
	ctx := context.Background()
	c := newCluster()
	key := newKey(t)
	csr1DER, csr1 := csrFor(t, key, testNode, testProviderID)
	req := &attestor.Request{
		NodeName:   testNode,
		ProviderID: testProviderID,
		Binding:    attestor.Binding(csr1.RawSubjectPublicKeyInfo),
		SPKI:       csr1.RawSubjectPublicKeyInfo,
		Key:        key,
	}
	ev, err := node.Attest(ctx, req)
	if err != nil {
		t.Fatalf("Attest: %v", err)
	}
	first := c.file(t, "csr-1", testBootstrap, csr1DER, ev)
	res, err := v.Verify(ctx, c.verifyRequest(first, machine))
	if err != nil {
		t.Fatalf("Verify round 1: %v", err)
	}
	if res.Identity != nil || len(res.Challenge) == 0 {
		t.Fatalf("round 1 gave %+v, want a challenge", res)
	}
	first.record.Annotations[attestor.AnnotationChallenge] = string(res.Challenge)

	ev2, err := node.Respond(ctx, req, &attestor.Challenge{CSRName: first.record.Name, CSRUID: first.record.UID, Data: res.Challenge})
	if err != nil {
		t.Fatalf("Respond: %v", err)
	}
	if strings.Contains(string(ev2), "secret") {
		t.Fatalf("second-round evidence mentions a secret: %s", ev2)
	}
	csr2DER, _ := csrFor(t, key, testNode, testProviderID)
	second := c.file(t, "csr-2", testBootstrap, csr2DER, ev2)
	res2, err := v.Verify(ctx, c.verifyRequest(second, machine))
	if err != nil {
		t.Fatalf("Verify round 2: %v", err)
	}
	if res2.Identity == nil || res2.Challenge != nil {
		t.Fatalf("round 2 gave %+v, want an identity", res2)
	}
	if res2.Identity.ProviderID != testProviderID {
		t.Errorf("identity provider ID %q, want %q", res2.Identity.ProviderID, testProviderID)
	}
	// The controller now denies CSR #1 (ChallengeAnswered): a second
	// answer to the same challenge is refused.
	first.record.Denied = true
	_, err = v.Verify(ctx, c.verifyRequest(second, machine))
	wantReason(t, err, ReasonChallengeUsed)
	return res2.Identity
}

// wantReason fails unless err is a denial with reason.
func wantReason(t testing.TB, err error, reason string) {
	t.Helper()
	d, ok := attestor.AsDenial(err)
	if !ok {
		t.Fatalf("got error %v, want a denial %s", err, reason)
	}
	if d.Reason != reason {
		t.Fatalf("got denial %s (%s), want %s", d.Reason, d.Message, reason)
	}
}

// newTestVerifier builds a verifier with a fixed clock.
func newTestVerifier(t testing.TB, cfg VerifierConfig) *Verifier {
	t.Helper()
	if cfg.HMACKey == nil {
		cfg.HMACKey = testHMACKey
	}
	if cfg.Now == nil {
		cfg.Now = func() time.Time { return testNow }
	}
	v, err := NewVerifier(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// transientHandles lists the TPM's loaded transient objects and sessions,
// for leak checks.
func transientHandles(t testing.TB, tp transport.TPM) []tpm2.TPMHandle {
	t.Helper()
	var out []tpm2.TPMHandle
	for _, first := range []uint32{0x80000000, 0x02000000, 0x03000000} {
		rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapHandles, Property: first, PropertyCount: 64}.Execute(tp)
		if err != nil {
			t.Fatalf("GetCapability: %v", err)
		}
		hs, err := rsp.CapabilityData.Data.Handles()
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range hs.Handle {
			if uint32(h)>>24 == first>>24 {
				out = append(out, h)
			}
		}
	}
	return out
}

// repoRoot is the directory holding go.mod.
func repoRoot(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("unable to locate the test source")
	}
	dir := filepath.Dir(file)
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("unable to find the repository root (go.mod)")
		}
		dir = parent
	}
}

// realData is ../shared/realdata next to the repository. Its absence is a
// failure: these tests are what shows real EK certificates verify.
func realData(t testing.TB) string {
	t.Helper()
	return realdatapkg.Dir(t)
}

var errTransient = errors.New("apiserver unavailable")
