package aws

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"sigs.k8s.io/kubelet-authenticator/attestor/attestortest"
	realdatapkg "sigs.k8s.io/kubelet-authenticator/test/realdata"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tlsconfig"
	awsemu "sigs.k8s.io/kubelet-authenticator/test/emulators/aws"
)

type fixture struct {
	emu     *awsemu.Emulator
	att     *Attestor
	cfg     VerifierConfig
	binding []byte
}

func newFixture(t *testing.T, inst awsemu.Instance) *fixture {
	t.Helper()
	emu := awsemu.New(t, inst)
	att, err := NewAttestor(AttestorConfig{IMDSEndpoint: emu.IMDSURL, STSEndpoint: emu.STSURL})
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{
		emu: emu,
		att: att,
		cfg: VerifierConfig{
			CertificatesDir: emu.WriteCertDir(t),
			Accounts:        []string{emu.Instance.AccountID},
			AllowedRoles:    []string{emu.Instance.Role},
			STS: STSConfig{
				Hosts: []string{emu.STSHost},
				TLS:   &tlsconfig.Config{TrustedCA: &tlsconfig.CABundle{PEM: emu.STSCAPEM}},
			},
		},
		binding: attestortest.NewBinding(t),
	}
}

func (f *fixture) providerID() string {
	return "aws:///" + f.emu.Instance.AvailabilityZone + "/" + f.emu.Instance.InstanceID
}

func (f *fixture) attest(t *testing.T) attestor.Evidence {
	t.Helper()
	ev, err := f.att.Attest(context.Background(), &attestor.Request{NodeName: "node-a", ProviderID: f.providerID(), Binding: f.binding})
	if err != nil {
		t.Fatalf("Attest: %v", err)
	}
	return ev.Evidence
}

func (f *fixture) verifier(t *testing.T) *Verifier {
	t.Helper()
	v, err := NewVerifier(f.cfg)
	if err != nil {
		t.Fatalf("NewVerifier: %v", err)
	}
	return v
}

func (f *fixture) request(ev attestor.Evidence) *attestor.VerifyRequest {
	return &attestor.VerifyRequest{Evidence: ev, Version: VersionV1, Binding: f.binding, NodeName: "node-a", ProviderID: f.providerID()}
}

func editEvidence(t *testing.T, ev attestor.Evidence, edit func(*Evidence)) attestor.Evidence {
	t.Helper()
	var e Evidence
	if err := json.Unmarshal(ev, &e); err != nil {
		t.Fatal(err)
	}
	edit(&e)
	out, err := json.Marshal(e)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func editQuery(t *testing.T, raw string, edit func(url.Values)) string {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	edit(q)
	u.RawQuery = q.Encode()
	return u.String()
}

func TestRoundTrip(t *testing.T) {
	f := newFixture(t, awsemu.Instance{})
	ev := f.attest(t)
	if v, err := attestor.EvidenceVersion(ev); err != nil || v != VersionV1 {
		t.Fatalf("EvidenceVersion = %q, %v", v, err)
	}
	res, err := f.verifier(t).Verify(context.Background(), f.request(ev))
	if err != nil {
		t.Fatalf("Verify: %v", err)
	}
	want := attestor.Identity{ProviderID: f.providerID(), Stable: "aws:" + f.emu.Instance.AccountID + ":" + f.emu.Instance.InstanceID}
	if res.Identity == nil || *res.Identity != want || res.Challenge != nil {
		t.Fatalf("Verify = %+v, want identity %+v", res, want)
	}
	if f.emu.STSCalls() != 1 {
		t.Fatalf("STS was called %d times, want 1", f.emu.STSCalls())
	}
	// The request travels inside a CSR: check it survives the wire format.
	req, err := attestor.EncodeRequest([]byte{0x30, 0}, Name, ev)
	if err != nil || len(req) == 0 {
		t.Fatalf("EncodeRequest: %v", err)
	}
}

func TestAttestRequiresIMDSv2Token(t *testing.T) {
	emu := awsemu.New(t, awsemu.Instance{})
	resp, err := http.Get(emu.IMDSURL + "/latest/dynamic/instance-identity/document")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("IMDSv1 GET answered %s, want 401", resp.Status)
	}
}

func TestDenials(t *testing.T) {
	other := awsemu.New(t, awsemu.Instance{})
	tests := []struct {
		name   string
		reason string
		// setup may change the fixture before attesting; edit changes the
		// evidence and the request after.
		setup func(t *testing.T, f *fixture)
		edit  func(t *testing.T, f *fixture, v *Verifier, ev attestor.Evidence, in *attestor.VerifyRequest) attestor.Evidence
	}{
		{
			name: "signature by an untrusted CA", reason: ReasonUntrustedSigner,
			setup: func(t *testing.T, f *fixture) { f.cfg.CertificatesDir = other.WriteCertDir(t) },
		},
		{
			name: "signer certificate embedded by the attacker is ignored", reason: ReasonUntrustedSigner,
			edit: func(t *testing.T, f *fixture, _ *Verifier, ev attestor.Evidence, _ *attestor.VerifyRequest) attestor.Evidence {
				return editEvidence(t, ev, func(e *Evidence) {
					sig, err := awsemu.SignWith(e.Document, other.RegionCert, other.RegionKey)
					if err != nil {
						t.Fatal(err)
					}
					e.RSA2048 = sig
				})
			},
		},
		{
			name: "document altered after signing", reason: ReasonDocumentMismatch,
			edit: func(t *testing.T, f *fixture, _ *Verifier, ev attestor.Evidence, _ *attestor.VerifyRequest) attestor.Evidence {
				return editEvidence(t, ev, func(e *Evidence) {
					e.Document = bytes.Replace(e.Document, []byte(f.emu.Instance.InstanceID), []byte("i-0fffffffffffffff0"), 1)
				})
			},
		},
		{
			name: "signed content altered", reason: ReasonInvalidSignature,
			edit: func(t *testing.T, f *fixture, _ *Verifier, ev attestor.Evidence, _ *attestor.VerifyRequest) attestor.Evidence {
				return editEvidence(t, ev, func(e *Evidence) {
					from, to := []byte(f.emu.Instance.InstanceID), []byte("i-0fffffffffffffff0")
					e.RSA2048 = bytes.Replace(e.RSA2048, from, to, 1)
					e.Document = bytes.Replace(e.Document, from, to, 1)
				})
			},
		},
		{
			name: "region of the signing certificate differs", reason: ReasonRegionMismatch,
			setup: func(t *testing.T, f *fixture) {
				dir := t.TempDir()
				if err := os.WriteFile(filepath.Join(dir, "us-east-1.pem"), f.emu.RegionCertPEM, 0o600); err != nil {
					t.Fatal(err)
				}
				f.cfg.CertificatesDir = dir
			},
		},
		{
			name: "binding from another key", reason: ReasonBindingMismatch,
			edit: func(t *testing.T, f *fixture, _ *Verifier, ev attestor.Evidence, in *attestor.VerifyRequest) attestor.Evidence {
				in.Binding = attestortest.NewBinding(t)
				return ev
			},
		},
		{
			name: "binding header rewritten after signing", reason: ReasonSTSRejected,
			edit: func(t *testing.T, f *fixture, _ *Verifier, ev attestor.Evidence, in *attestor.VerifyRequest) attestor.Evidence {
				in.Binding = attestortest.NewBinding(t)
				return editEvidence(t, ev, func(e *Evidence) { e.STS.Headers[BindingHeader] = bindingHex(in.Binding) })
			},
		},
		{
			name: "expired presigned request", reason: ReasonPresignExpired,
			edit: func(t *testing.T, f *fixture, v *Verifier, ev attestor.Evidence, _ *attestor.VerifyRequest) attestor.Evidence {
				v.clock = clocktesting.NewFakePassiveClock(time.Now().Add(2 * time.Minute))
				return ev
			},
		},
		{
			name: "presigned request valid for more than 60 seconds", reason: ReasonPresignInvalid,
			edit: func(t *testing.T, f *fixture, _ *Verifier, ev attestor.Evidence, _ *attestor.VerifyRequest) attestor.Evidence {
				return editEvidence(t, ev, func(e *Evidence) {
					e.STS.URL = editQuery(t, e.STS.URL, func(q url.Values) { q.Set("X-Amz-Expires", "3600") })
				})
			},
		},
		{
			name: "presigned request without the binding header signed", reason: ReasonPresignInvalid,
			edit: func(t *testing.T, f *fixture, _ *Verifier, ev attestor.Evidence, _ *attestor.VerifyRequest) attestor.Evidence {
				return editEvidence(t, ev, func(e *Evidence) {
					e.STS.URL = editQuery(t, e.STS.URL, func(q url.Values) { q.Set("X-Amz-SignedHeaders", "host") })
				})
			},
		},
		{
			name: "presigned request for another action", reason: ReasonPresignInvalid,
			edit: func(t *testing.T, f *fixture, _ *Verifier, ev attestor.Evidence, _ *attestor.VerifyRequest) attestor.Evidence {
				return editEvidence(t, ev, func(e *Evidence) {
					e.STS.URL = editQuery(t, e.STS.URL, func(q url.Values) { q.Set("Action", "AssumeRole") })
				})
			},
		},
		{
			name: "presigned request to a host not on the allowlist", reason: ReasonSTSHostNotAllowed,
			setup: func(t *testing.T, f *fixture) { f.cfg.STS.Hosts = nil },
		},
		{
			name: "lookalike STS host", reason: ReasonSTSHostNotAllowed,
			setup: func(t *testing.T, f *fixture) { f.cfg.STS.Hosts = nil },
			edit: func(t *testing.T, f *fixture, _ *Verifier, ev attestor.Evidence, _ *attestor.VerifyRequest) attestor.Evidence {
				return editEvidence(t, ev, func(e *Evidence) {
					u, _ := url.Parse(e.STS.URL)
					u.Host = "sts.amazonaws.com.attacker.example"
					e.STS.URL = u.String()
				})
			},
		},
		{
			name: "wrong account", reason: ReasonAccountNotAllowed,
			setup: func(t *testing.T, f *fixture) { f.cfg.Accounts = []string{"999988887777"} },
		},
		{
			name: "provider ID not matching the document", reason: attestor.ReasonAttestedProviderIDMismatch,
			edit: func(t *testing.T, f *fixture, _ *Verifier, ev attestor.Evidence, in *attestor.VerifyRequest) attestor.Evidence {
				in.ProviderID = "aws:///" + f.emu.Instance.AvailabilityZone + "/i-0aaaaaaaaaaaaaaa0"
				return ev
			},
		},
		{
			name: "role session of another instance", reason: ReasonCallerMismatch,
			setup: func(t *testing.T, f *fixture) {
				id := f.emu.AddCredential("arn:aws:sts::" + f.emu.Instance.AccountID + ":assumed-role/node-role/i-0bbbbbbbbbbbbbbb0")
				f.emu.UseCredential(id)
			},
		},
		{
			// Issue 13.2: anyone who may assume some role in the account
			// can name the session after the victim instance.
			name: "session named after the instance, of another role", reason: ReasonCallerRoleNotAllowed,
			setup: func(t *testing.T, f *fixture) {
				id := f.emu.AddCredential("arn:aws:sts::" + f.emu.Instance.AccountID + ":assumed-role/ci-deployer/" + f.emu.Instance.InstanceID)
				f.emu.UseCredential(id)
			},
		},
		{
			name: "allowed role named by an ARN of another account", reason: ReasonCallerRoleNotAllowed,
			setup: func(t *testing.T, f *fixture) {
				f.cfg.AllowedRoles = []string{"arn:aws:iam::999988887777:role/" + f.emu.Instance.Role}
			},
		},
		{
			name: "not an assumed role", reason: ReasonCallerMismatch,
			setup: func(t *testing.T, f *fixture) {
				f.emu.UseCredential(f.emu.AddCredential("arn:aws:iam::" + f.emu.Instance.AccountID + ":user/" + f.emu.Instance.InstanceID))
			},
		},
		{
			name: "unknown evidence field", reason: attestor.ReasonEvidenceUnknownField,
			edit: func(t *testing.T, f *fixture, _ *Verifier, ev attestor.Evidence, _ *attestor.VerifyRequest) attestor.Evidence {
				return attestor.Evidence(strings.Replace(string(ev), `{`, `{"extra":1,`, 1))
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, awsemu.Instance{})
			if tc.setup != nil {
				tc.setup(t, f)
			}
			ev := f.attest(t)
			v := f.verifier(t)
			in := f.request(ev)
			if tc.edit != nil {
				in.Evidence = tc.edit(t, f, v, ev, in)
			}
			res, err := v.Verify(context.Background(), in)
			if err == nil {
				t.Fatalf("Verify accepted: %+v", res.Identity)
			}
			attestortest.WantDenial(t, err, tc.reason)
		})
	}
}

// TestAllowedRoles: a role is allowed by name in any allowed account, or
// by ARN (with or without a path) in its own account.
func TestAllowedRoles(t *testing.T) {
	for _, tc := range []struct {
		name    string
		allowed []string
		ok      bool
	}{
		{"by name", []string{"node-role"}, true},
		{"by ARN", []string{"arn:aws:iam::111122223333:role/node-role"}, true},
		{"by ARN with a path", []string{"arn:aws:iam::111122223333:role/capa/node-role"}, true},
		{"among others", []string{CAPANodesRole, "node-role"}, true},
		{"another role", []string{CAPANodesRole}, false},
		{"ARN in another partition", []string{"arn:aws-us-gov:iam::111122223333:role/node-role"}, false},
		{"name differing in case", []string{"Node-Role"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, awsemu.Instance{})
			f.cfg.AllowedRoles = tc.allowed
			_, err := f.verifier(t).Verify(context.Background(), f.request(f.attest(t)))
			if tc.ok && err != nil {
				t.Fatalf("Verify: %v", err)
			}
			if !tc.ok {
				attestortest.WantDenial(t, err, ReasonCallerRoleNotAllowed)
				if !strings.Contains(err.Error(), `"node-role"`) {
					t.Fatalf("denial %v does not name the role", err)
				}
			}
		})
	}
}

func TestSTSUnreachableIsTransient(t *testing.T) {
	f := newFixture(t, awsemu.Instance{})
	ev := f.attest(t)
	v := f.verifier(t)
	v.client = &http.Client{Transport: roundTripFunc(func(*http.Request) (*http.Response, error) {
		return nil, errors.New("connection refused")
	})}
	_, err := v.Verify(context.Background(), f.request(ev))
	if err == nil {
		t.Fatal("Verify accepted with STS down")
	}
	if d, ok := attestor.AsDenial(err); ok {
		t.Fatalf("STS down was a denial (%v), want a transient error", d)
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func TestNewVerifierValidates(t *testing.T) {
	_, err := NewVerifier(VerifierConfig{})
	if err == nil || !strings.Contains(err.Error(), "accounts") || !strings.Contains(err.Error(), "allowedRoles") || !strings.Contains(err.Error(), CAPANodesRole) {
		t.Fatalf("NewVerifier(empty) = %v, want errors naming accounts and allowedRoles (with CAPA's role as the example)", err)
	}
	if _, err := NewVerifier(VerifierConfig{ReplaceBuiltinCertificates: true, Accounts: []string{"111122223333"}, AllowedRoles: []string{"r"}}); err == nil || !strings.Contains(err.Error(), "replaceBuiltinCertificates") {
		t.Fatalf("replaceBuiltinCertificates without certificatesDir = %v", err)
	}
	for _, bad := range []string{"", "role/x", "arn:aws:iam::12:role/x", "arn:aws:sts::111122223333:assumed-role/x/y", "arn:aws:iam::111122223333:user/x", "has space"} {
		_, err := NewVerifier(VerifierConfig{Accounts: []string{"111122223333"}, AllowedRoles: []string{bad}})
		if err == nil || !strings.Contains(err.Error(), "allowedRoles") {
			t.Errorf("NewVerifier(allowedRoles %q) = %v, want an allowedRoles error", bad, err)
		}
	}
	_, err = NewVerifier(VerifierConfig{CertificatesDir: realdatapkg.Path(t, "aws", "region-certs", "rsa2048"), Accounts: []string{"12"}})
	if err == nil || !strings.Contains(err.Error(), "12-digit") {
		t.Fatalf("NewVerifier(bad account) = %v", err)
	}
	if _, err := NewAttestor(AttestorConfig{PresignExpiry: 120}); err == nil {
		t.Fatal("NewAttestor accepted a presign expiry over 60 s")
	}
}

func readReal(t *testing.T) (doc, p7 []byte) {
	t.Helper()
	doc, err := os.ReadFile(realdatapkg.Path(t, "aws", "ec2-iid-ap-southeast-2-2026-document.json"))
	if err != nil {
		t.Fatal(err)
	}
	b64, err := os.ReadFile(realdatapkg.Path(t, "aws", "ec2-iid-ap-southeast-2-2026-rsa2048.b64"))
	if err != nil {
		t.Fatal(err)
	}
	p7, err = base64.StdEncoding.DecodeString(strings.Join(strings.Fields(string(b64)), ""))
	if err != nil {
		t.Fatal(err)
	}
	der, err := os.ReadFile(realdatapkg.Path(t, "aws", "ec2-iid-ap-southeast-2-2026-rsa2048.p7.der"))
	if err != nil || !bytes.Equal(der, p7) {
		t.Fatalf("the .b64 and .p7.der samples differ (%v)", err)
	}
	return doc, p7
}

// TestRealDocument checks the PKCS#7 half against a real AWS rsa2048
// signature and AWS's published region certificates.
func TestRealDocument(t *testing.T) {
	doc, p7 := readReal(t)
	v, err := NewVerifier(VerifierConfig{CertificatesDir: realdatapkg.Path(t, "aws", "region-certs", "rsa2048"), Accounts: []string{"189292791360"}, AllowedRoles: []string{CAPANodesRole}})
	if err != nil {
		t.Fatal(err)
	}
	iid, err := v.verifyDocument(doc, p7)
	if err != nil {
		t.Fatalf("real document rejected: %v", err)
	}
	if iid.ProviderID() != "aws:///ap-southeast-2a/i-0c5541936caf78c12" || iid.Stable() != "aws:189292791360:i-0c5541936caf78c12" {
		t.Fatalf("real document parsed as %+v", iid)
	}

	t.Run("one byte of the signed content altered", func(t *testing.T) {
		i := bytes.Index(p7, []byte("i-0c5541936caf78c12"))
		if i < 0 {
			t.Fatal("document not embedded in the PKCS#7")
		}
		bad := bytes.Clone(p7)
		bad[i+5] ^= 1
		badDoc := bytes.Replace(doc, []byte("i-0c5541936caf78c12"), bad[i:i+19], 1)
		_, err := v.verifyDocument(badDoc, bad)
		attestortest.WantDenial(t, err, ReasonInvalidSignature)
	})
	t.Run("one byte of the signature altered", func(t *testing.T) {
		bad := bytes.Clone(p7)
		bad[len(bad)-10] ^= 1
		_, err := v.verifyDocument(doc, bad)
		attestortest.WantDenial(t, err, ReasonInvalidSignature)
	})
	t.Run("one byte of the document altered", func(t *testing.T) {
		bad := bytes.Clone(doc)
		bad[len(bad)-3] ^= 1
		_, err := v.verifyDocument(bad, p7)
		attestortest.WantDenial(t, err, ReasonDocumentMismatch)
	})
	t.Run("another region's certificate", func(t *testing.T) {
		dir := t.TempDir()
		pem, err := os.ReadFile(realdatapkg.Path(t, "aws", "region-certs", "rsa2048", "us-east-1.pem"))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "us-east-1.pem"), pem, 0o600); err != nil {
			t.Fatal(err)
		}
		v2, err := NewVerifier(VerifierConfig{CertificatesDir: dir, ReplaceBuiltinCertificates: true, Accounts: []string{"189292791360"}, AllowedRoles: []string{CAPANodesRole}})
		if err != nil {
			t.Fatal(err)
		}
		_, err = v2.verifyDocument(doc, p7)
		attestortest.WantDenial(t, err, ReasonUntrustedSigner)
	})
}

// TestRealDocumentEndToEnd verifies whole evidence made of the real
// AWS-signed document and a presigned request answered by the emulated STS
// for the same instance.
func TestRealDocumentEndToEnd(t *testing.T) {
	doc, p7 := readReal(t)
	f := newFixture(t, awsemu.Instance{AccountID: "189292791360", Region: "ap-southeast-2", AvailabilityZone: "ap-southeast-2a", InstanceID: "i-0c5541936caf78c12"})
	f.cfg.CertificatesDir = realdatapkg.Path(t, "aws", "region-certs", "rsa2048")
	ev := editEvidence(t, f.attest(t), func(e *Evidence) { e.Document, e.RSA2048 = doc, p7 })
	res, err := f.verifier(t).Verify(context.Background(), f.request(ev))
	if err != nil {
		t.Fatalf("Verify: %v", err)
	}
	if res.Identity.ProviderID != "aws:///ap-southeast-2a/i-0c5541936caf78c12" {
		t.Fatalf("identity %+v", res.Identity)
	}
}

// TestPresignKnownAnswer checks the SigV4 presigner against the example in
// AWS's documentation of query-string authentication.
func TestPresignKnownAnswer(t *testing.T) {
	u, _ := url.Parse("https://examplebucket.s3.amazonaws.com/test.txt")
	got := presignURL(u, nil, credentials{AccessKeyID: "AKIAIOSFODNN7EXAMPLE", SecretAccessKey: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"},
		"us-east-1", "s3", time.Date(2013, 5, 24, 0, 0, 0, 0, time.UTC), 86400, "UNSIGNED-PAYLOAD")
	const want = "X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404"
	if !strings.HasSuffix(got, want) {
		t.Fatalf("presigned URL %s does not end in %s", got, want)
	}
}

func FuzzVerifyEvidence(f *testing.F) {
	doc, _ := os.ReadFile(realdatapkg.Path(f, "aws", "ec2-iid-ap-southeast-2-2026-document.json"))
	p7, _ := os.ReadFile(realdatapkg.Path(f, "aws", "ec2-iid-ap-southeast-2-2026-rsa2048.p7.der"))
	seed, _ := json.Marshal(Evidence{Version: VersionV1, Document: doc, RSA2048: p7, STS: PresignedRequest{URL: "https://sts.amazonaws.com/?Action=GetCallerIdentity", Headers: map[string]string{BindingHeader: "00"}}})
	f.Add(seed)
	f.Add([]byte(`{"version":"v1"}`))
	v, err := NewVerifier(VerifierConfig{CertificatesDir: realdatapkg.Path(f, "aws", "region-certs", "rsa2048"), Accounts: []string{"189292791360"}, AllowedRoles: []string{CAPANodesRole}})
	if err != nil {
		f.Fatal(err)
	}
	v.client = &http.Client{Transport: roundTripFunc(func(*http.Request) (*http.Response, error) {
		return nil, errors.New("no network in fuzzing")
	})}
	f.Fuzz(func(t *testing.T, data []byte) {
		res, err := v.Verify(context.Background(), &attestor.VerifyRequest{Evidence: data, Version: VersionV1, Binding: make([]byte, 32), ProviderID: "aws:///ap-southeast-2a/i-0c5541936caf78c12"})
		if err == nil {
			t.Fatalf("fuzzed evidence accepted: %+v", res)
		}
	})
}

func TestConformance(t *testing.T) {
	f := newFixture(t, awsemu.Instance{})
	attestortest.Conformance(t, attestortest.Provider{
		Name:          Name,
		NewAttestor:   func(testing.TB) attestor.Attestor { return f.att },
		Verifier:      f.verifier(t),
		NodeName:      "node-a",
		ProviderID:    f.providerID(),
		BindingReason: ReasonBindingMismatch,
		WantStable:    "aws:" + f.emu.Instance.AccountID + ":" + f.emu.Instance.InstanceID,
	})
}

// TestSignedDocumentReadOneWay: an identity document that encoding/json
// would read as another instance (a case-folded second "instanceId") is
// refused by the node half and denied by the verifier, even though its
// signature is good.
func TestSignedDocumentReadOneWay(t *testing.T) {
	f := newFixture(t, awsemu.Instance{})
	good := f.attest(t)
	doc := bytes.Replace(f.emu.Document, []byte(`"instanceId"`), []byte(`"InstanceID": "i-0bbbbbbbbbbbbbbb0",
  "instanceId"`), 1)
	sig, err := f.emu.Sign(doc)
	if err != nil {
		t.Fatal(err)
	}
	ev := editEvidence(t, good, func(e *Evidence) { e.Document, e.RSA2048 = doc, sig })
	_, err = f.verifier(t).Verify(context.Background(), f.request(ev))
	attestortest.WantDenial(t, err, attestor.ReasonEvidenceFieldCase)

	f.emu.SetDocument(doc)
	if _, err := f.att.Attest(context.Background(), &attestor.Request{NodeName: "node-a", ProviderID: f.providerID(), Binding: f.binding}); err == nil {
		t.Fatal("the node half filed a document the signer refuses")
	}
}

// TestRealDocumentWithNoConfiguration (issue 13.6): what we ship starts and
// verifies a real 2026 identity document with nothing configured but the
// allowlists: AWS's certificates are built in.
func TestRealDocumentWithNoConfiguration(t *testing.T) {
	doc, p7 := readReal(t)
	v, err := NewVerifier(VerifierConfig{Accounts: []string{"189292791360"}, AllowedRoles: []string{CAPANodesRole}})
	if err != nil {
		t.Fatalf("NewVerifier with no certificatesDir: %v", err)
	}
	v.clock = clocktesting.NewFakePassiveClock(time.Date(2026, 11, 25, 0, 0, 0, 0, time.UTC))
	iid, err := v.verifyDocument(doc, p7)
	if err != nil {
		t.Fatalf("real document rejected by the built-in certificates: %v", err)
	}
	if iid.ProviderID() != "aws:///ap-southeast-2a/i-0c5541936caf78c12" {
		t.Fatalf("real document parsed as %+v", iid)
	}
	if len(v.certs) < 39 {
		t.Fatalf("only %d regions built in", len(v.certs))
	}
}

// TestBuiltinCertificatesMatchRealData: the compiled-in certificates are
// byte for byte AWS's, as the shared real-data set holds them, and the
// README next to them records each one's SHA-256.
func TestBuiltinCertificatesMatchRealData(t *testing.T) {
	dir := realdatapkg.Path(t, "aws", "region-certs", "rsa2048")
	want, err := filepath.Glob(filepath.Join(dir, "*.pem"))
	if err != nil || len(want) == 0 {
		t.Fatalf("no real-data certificates in %s (%v)", dir, err)
	}
	builtin := BuiltinCertificates()
	got, err := fs.Glob(builtin, "*.pem")
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Errorf("%d built-in certificates, %d in real data", len(got), len(want))
	}
	readme, err := fs.ReadFile(builtin, "README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range want {
		name := filepath.Base(w)
		genuine, err := os.ReadFile(w)
		if err != nil {
			t.Fatal(err)
		}
		b, err := fs.ReadFile(builtin, name)
		if err != nil {
			t.Errorf("%s is not built in: %v", name, err)
			continue
		}
		if !bytes.Equal(b, genuine) {
			t.Errorf("built-in %s differs from %s", name, w)
		}
		blk, _ := pem.Decode(b)
		if blk == nil {
			t.Errorf("%s holds no PEM block", name)
			continue
		}
		fileSum, derSum := sha256.Sum256(b), sha256.Sum256(blk.Bytes)
		row := fmt.Sprintf("| `%s` |", strings.TrimSuffix(name, ".pem"))
		line := ""
		for _, l := range strings.Split(string(readme), "\n") {
			if strings.HasPrefix(l, row) {
				line = l
			}
		}
		if !strings.Contains(line, hex.EncodeToString(fileSum[:])) || !strings.Contains(line, hex.EncodeToString(derSum[:])) {
			t.Errorf("README.md has no row for %s with its SHA-256 values %x, %x", name, fileSum, derSum)
		}
	}
}
