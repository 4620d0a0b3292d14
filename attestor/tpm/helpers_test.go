package tpm

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

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
)

var testHMACKey = []byte("0123456789abcdef0123456789abcdef-test-controller-key")

// csrFor makes a CSR for the kubelet client certificate with key.
func csrFor(t testing.TB, key *ecdsa.PrivateKey, node, providerID string) ([]byte, *x509.CertificateRequest) {
	t.Helper()
	ext, err := attestor.ProviderIDExtension(providerID)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:         pkix.Name{CommonName: attestor.NodeUserPrefix + node, Organization: []string{attestor.NodesGroup}},
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

// engine plays the signer's part around a verifier the way the signer
// does it: it files CSRs, writes the challenge a first round gets, and when
// a response names the CSR it answers, hands that round back to the
// verifier. The signer's own checks of the challenged round (requester,
// key, expiry, single use) are not the verifier's and are not repeated here.
type engine struct {
	v       *Verifier
	machine map[string]string
	csrs    map[string]*filed
	// policy is the Cluster's TPM boot policy the signer hands over.
	policy []byte
}

func newEngine(v *Verifier, machine map[string]string) *engine {
	return &engine{v: v, machine: machine, csrs: map[string]*filed{}}
}

// filed is a CSR as the node filed it and the signer sees it.
type filed struct {
	name, uid   string
	parsed      *attestor.AttestedRequest
	annotations map[string]string
	// challenge is what the signer wrote on it.
	challenge *attestor.Challenge
}

// file encodes a CSR with evidence into spec.request, parses it back the
// way the signer does, and stores it with the annotations the node set.
func (e *engine) file(t testing.TB, name string, csrDER []byte, ev attestor.Evidence, annotations map[string]string) *filed {
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
	for k, v := range annotations {
		ann[k] = v
	}
	f := &filed{name: name, uid: "uid-" + name, parsed: parsed, annotations: ann}
	e.csrs[name] = f
	return f
}

// request is what the signer hands the verifier for f.
func (e *engine) request(f *filed) *attestor.VerifyRequest {
	pid, _ := attestor.ProviderIDFromExtensions(f.parsed.CSR.Extensions)
	return &attestor.VerifyRequest{
		Evidence:           f.parsed.Evidence,
		Version:            f.parsed.Version,
		Binding:            attestor.Binding(f.parsed.CSR.RawSubjectPublicKeyInfo),
		CSR:                f.parsed.CSR,
		NodeName:           strings.TrimPrefix(f.parsed.CSR.Subject.CommonName, attestor.NodeUserPrefix),
		ProviderID:         pid,
		UID:                f.uid,
		Annotations:        f.annotations,
		MachineAnnotations: e.machine,
		Policy:             e.policy,
		ClusterCAs:         [][]byte{testClusterCA},
		ClusterUID:         testClusterUID,
	}
}

// testClusterCA is the workload cluster's CA certificate (DER) the tests'
// evidence v3 names; testClusterUID the Cluster's UID.
var testClusterCA = func() []byte {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		panic(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubernetes"},
		NotBefore: testNow.Add(-time.Hour), NotAfter: testNow.Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, k.Public(), k)
	if err != nil {
		panic(err)
	}
	return der
}()

const testClusterUID = "cluster-uid"

// round is f as the signer hands it over as the answered round.
func (f *filed) round() *attestor.Round {
	ann := map[string]string{}
	for k, v := range f.annotations {
		ann[k] = v
	}
	return &attestor.Round{
		Name: f.name, UID: f.uid, CSR: f.parsed.CSR,
		Evidence: f.parsed.Evidence, Version: f.parsed.Version,
		Annotations: ann, Challenge: f.challenge,
	}
}

// verify runs f through the verifier as the signer does: a challenge is
// written on f; an answer is verified again with the round it names.
func (e *engine) verify(t testing.TB, f *filed) (*attestor.Result, error) {
	t.Helper()
	res, err := e.v.Verify(context.Background(), e.request(f))
	if err != nil {
		return nil, err
	}
	switch {
	case res.Challenge != nil:
		if res.Identity != nil || res.Answers != "" {
			t.Fatalf("result %+v sets more than the challenge", res)
		}
		if len(res.Challenge.Data) == 0 || res.Challenge.Expires.IsZero() {
			t.Fatalf("challenge %+v lacks data or expiry", res.Challenge)
		}
		f.challenge = res.Challenge
		f.annotations[attestor.AnnotationChallenge] = string(res.Challenge.Data)
		return res, nil
	case res.Answers != "":
		if res.Identity != nil {
			t.Fatalf("result %+v sets an identity with Answers", res)
		}
		first, ok := e.csrs[res.Answers]
		if !ok {
			return nil, attestor.Deny(attestor.ReasonChallengeNotFound, "CSR %q does not exist", res.Answers)
		}
		req := e.request(f)
		req.Answered = first.round()
		return e.v.Verify(context.Background(), req)
	}
	return res, nil
}

// roundTrip runs the whole protocol through the wire format: the node
// attests, files CSR #1 with the annotations it returned; the signer
// challenges; the node answers on CSR #2 with the same key; the signer
// proves the identity.
func roundTrip(t testing.TB, node *Attestor, v *Verifier, machine map[string]string) *attestor.Identity {
	t.Helper()
	return roundTripPolicy(t, node, v, machine, nil)
}

// roundTripPolicy is roundTrip under a Cluster's TPM boot policy.
func roundTripPolicy(t testing.TB, node *Attestor, v *Verifier, machine map[string]string, policy []byte) *attestor.Identity {
	t.Helper()
	ctx := context.Background()
	e := newEngine(v, machine)
	e.policy = policy
	key := newKey(t)
	csr1DER, csr1 := csrFor(t, key, testNode, testProviderID)
	req := &attestor.Request{
		NodeName:   testNode,
		ProviderID: testProviderID,
		Binding:    attestor.Binding(csr1.RawSubjectPublicKeyInfo),
		SPKI:       csr1.RawSubjectPublicKeyInfo,
		ClusterCA:  testClusterCA,
	}
	att, err := node.Attest(ctx, req)
	if err != nil {
		t.Fatalf("Attest: %v", err)
	}
	if att.Version != VersionV4 {
		t.Fatalf("Attest produced version %q, want %s", att.Version, VersionV4)
	}
	if want, err := EndorsementKeyAnnotation(att.Evidence); err != nil || att.Annotations[attestor.AnnotationEndorsementKey] != want {
		t.Fatalf("Attest returned annotations %v, want the EK %q (%v)", att.Annotations, want, err)
	}
	first := e.file(t, "csr-1", csr1DER, att.Evidence, att.Annotations)
	res, err := e.verify(t, first)
	if err != nil {
		t.Fatalf("Verify round 1: %v", err)
	}
	if res.Challenge == nil {
		t.Fatalf("round 1 gave %+v, want a challenge", res)
	}

	att2, err := node.Respond(ctx, req, &attestor.Challenge{CSRName: first.name, CSRUID: first.uid, Data: res.Challenge.Data, Expires: res.Challenge.Expires})
	if err != nil {
		t.Fatalf("Respond: %v", err)
	}
	if strings.Contains(string(att2.Evidence), "secret") {
		t.Fatalf("second-round evidence mentions a secret: %s", att2.Evidence)
	}
	if att2.Version != VersionV4 {
		t.Fatalf("Respond produced version %q, want %s", att2.Version, VersionV4)
	}
	csr2DER, _ := csrFor(t, key, testNode, testProviderID)
	second := e.file(t, "csr-2", csr2DER, att2.Evidence, att2.Annotations)
	// The response alone names the challenged CSR.
	res2, err := v.Verify(ctx, e.request(second))
	if err != nil || res2.Answers != first.name || res2.Identity != nil || res2.Challenge != nil {
		t.Fatalf("response without the answered round gave %+v, %v; want Answers %q", res2, err, first.name)
	}
	res2, err = e.verify(t, second)
	if err != nil {
		t.Fatalf("Verify round 2: %v", err)
	}
	if res2.Identity == nil || res2.Challenge != nil || res2.Answers != "" {
		t.Fatalf("round 2 gave %+v, want an identity", res2)
	}
	if res2.Identity.ProviderID != testProviderID {
		t.Errorf("identity provider ID %q, want %q", res2.Identity.ProviderID, testProviderID)
	}
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
	if cfg.Clock == nil {
		cfg.Clock = clocktesting.NewFakePassiveClock(testNow)
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
