package azure

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"sigs.k8s.io/kubelet-authenticator/attestor/attestortest"
	realdatapkg "sigs.k8s.io/kubelet-authenticator/test/realdata"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	azemu "sigs.k8s.io/kubelet-authenticator/test/emulators/azure"
)

type fixture struct {
	emu     *azemu.Emulator
	att     *Attestor
	cfg     VerifierConfig
	binding []byte
}

func newFixture(t *testing.T, emu *azemu.Emulator) *fixture {
	t.Helper()
	if emu == nil {
		emu = azemu.New(t, azemu.VM{})
	}
	att, err := NewAttestor(AttestorConfig{IMDSEndpoint: emu.URL})
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{emu: emu, att: att, binding: attestortest.NewBinding(t), cfg: VerifierConfig{
		Roots:         []string{emu.Root.WriteFile(t)},
		Intermediates: []string{emu.Issuing.WriteFile(t)},
		Subscriptions: []string{emu.VM.SubscriptionID},
	}}
}

func (f *fixture) providerID() string {
	return "azure:///subscriptions/" + f.emu.VM.SubscriptionID + "/resourceGroups/rg-test/providers/Microsoft.Compute/virtualMachines/node-a"
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

func sigEvidence(t *testing.T, sig string) attestor.Evidence {
	t.Helper()
	ev, err := json.Marshal(Evidence{Version: VersionV1, Signature: sig})
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func TestRoundTrip(t *testing.T) {
	f := newFixture(t, nil)
	res, err := f.verifier(t).Verify(context.Background(), f.request(f.attest(t)))
	if err != nil {
		t.Fatalf("Verify: %v", err)
	}
	want := attestor.Identity{ProviderID: f.providerID(), Stable: "azure:" + f.emu.VM.VMID}
	if res.Identity == nil || *res.Identity != want {
		t.Fatalf("Verify = %+v, want %+v", res.Identity, want)
	}
	if n := Nonce(f.binding); len(n) != 32 || strings.Trim(n, "0123456789abcdef") != "" {
		t.Fatalf("nonce %q is not 32 alphanumeric characters", n)
	}
}

func TestIMDSRequiresMetadataHeader(t *testing.T) {
	emu := azemu.New(t, azemu.VM{})
	resp, err := http.Get(emu.URL + "/metadata/attested/document?api-version=2021-02-01")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("request without Metadata: true answered %s, want 400", resp.Status)
	}
}

func TestDenials(t *testing.T) {
	other := azemu.New(t, azemu.VM{VMID: "99999999-bbbb-cccc-dddd-eeeeeeeeeeee"})
	shared := azemu.New(t, azemu.VM{})
	tests := []struct {
		name   string
		reason string
		edit   func(t *testing.T, f *fixture, in *attestor.VerifyRequest) attestor.Evidence
	}{
		{"signature by an untrusted CA", ReasonUntrustedSigner, func(t *testing.T, f *fixture, in *attestor.VerifyRequest) attestor.Evidence {
			sig, err := azemu.Sign(f.emu.Content(Nonce(f.binding)), other.Signer)
			if err != nil {
				t.Fatal(err)
			}
			return sigEvidence(t, sig)
		}},
		{"trusted CA but not the metadata service", ReasonSignerNameNotAllowed, func(t *testing.T, f *fixture, in *attestor.VerifyRequest) attestor.Evidence {
			leaf := azemu.NewCA(t, f.emu.Issuing, "attacker.example", []string{"metadata.azure.com.attacker.example"})
			sig, err := azemu.Sign(f.emu.Content(Nonce(f.binding)), leaf)
			if err != nil {
				t.Fatal(err)
			}
			return sigEvidence(t, sig)
		}},
		{"document altered after signing", ReasonInvalidSignature, func(t *testing.T, f *fixture, in *attestor.VerifyRequest) attestor.Evidence {
			var ev Evidence
			_ = json.Unmarshal(f.attest(t), &ev)
			der, _ := base64.StdEncoding.DecodeString(ev.Signature)
			der = bytes.Replace(der, []byte(f.emu.VM.VMID), []byte(other.VM.VMID), 1)
			return sigEvidence(t, base64.StdEncoding.EncodeToString(der))
		}},
		{"binding from another key", ReasonNonceMismatch, func(t *testing.T, f *fixture, in *attestor.VerifyRequest) attestor.Evidence {
			ev := f.attest(t)
			in.Binding = attestortest.NewBinding(t)
			return ev
		}},
		{"expired document", ReasonDocumentExpired, func(t *testing.T, f *fixture, in *attestor.VerifyRequest) attestor.Evidence {
			f.emu.SetClock(func() time.Time { return time.Now().Add(-7 * time.Hour) })
			defer f.emu.SetClock(time.Now)
			return f.attest(t)
		}},
		{"wrong subscription", ReasonSubscriptionNotAllowed, func(t *testing.T, f *fixture, in *attestor.VerifyRequest) attestor.Evidence {
			f.cfg.Subscriptions = []string{"99999999-1111-2222-3333-444444444444"}
			return f.attest(t)
		}},
		{"provider ID not matching the document", attestor.ReasonAttestedProviderIDMismatch, func(t *testing.T, f *fixture, in *attestor.VerifyRequest) attestor.Evidence {
			in.ProviderID = strings.Replace(in.ProviderID, f.emu.VM.SubscriptionID, "99999999-1111-2222-3333-444444444444", 1)
			return f.attest(t)
		}},
		{"provider ID of another provider", attestor.ReasonAttestedProviderIDMismatch, func(t *testing.T, f *fixture, in *attestor.VerifyRequest) attestor.Evidence {
			in.ProviderID = "aws:///us-east-1a/i-0123"
			return f.attest(t)
		}},
		{"intermediate CA not configured", ReasonUntrustedSigner, func(t *testing.T, f *fixture, in *attestor.VerifyRequest) attestor.Evidence {
			f.cfg.Intermediates = nil
			return f.attest(t)
		}},
		{"unknown evidence field", attestor.ReasonEvidenceUnknownField, func(t *testing.T, f *fixture, in *attestor.VerifyRequest) attestor.Evidence {
			return attestor.Evidence(strings.Replace(string(f.attest(t)), "{", `{"x":1,`, 1))
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, shared)
			in := f.request(nil)
			in.Evidence = tc.edit(t, f, in)
			res, err := f.verifier(t).Verify(context.Background(), in)
			if err == nil {
				t.Fatalf("Verify accepted: %+v", res.Identity)
			}
			attestortest.WantDenial(t, err, tc.reason)
		})
	}
}

func TestNewVerifierValidates(t *testing.T) {
	_, err := NewVerifier(VerifierConfig{})
	if err == nil || strings.Contains(err.Error(), "roots") || !strings.Contains(err.Error(), "subscriptions") {
		t.Fatalf("NewVerifier(empty) = %v, want an error naming subscriptions only (roots default to the built-in ones)", err)
	}
	if _, err := NewVerifier(VerifierConfig{Subscriptions: []string{"s"}}); err != nil {
		t.Fatalf("NewVerifier(subscriptions only) = %v", err)
	}
}

// TestRealDocuments checks real IMDS attested documents: signature, chain
// to Microsoft's roots and signer name at a time inside their validity.
func TestRealDocuments(t *testing.T) {
	tests := []struct {
		stem          string
		root          string
		intermediates []string
		signerName    string
	}{
		{"imds-attested-2026-eastus", "digicert-global-root-g2.pem", []string{"microsoft-tls-g2-rsa-ca-ocsp-02.pem", "microsoft-tls-rsa-root-g2-xsign-by-digicert-global-root-g2.pem"}, ""},
		{"imds-attested-2024-eastus", "digicert-global-root-g2.pem", []string{"microsoft-azure-rsa-tls-issuing-ca-08.pem"}, ""},
		{"imds-attested-2023-usgovvirginia", "digicert-global-root-g2.pem", []string{"microsoft-azure-tls-issuing-ca-05.pem"}, "metadata.azure.us"},
		{"imds-attested-2022-southcentralus", "baltimore-cybertrust-root.pem", []string{"microsoft-rsa-tls-ca-01.pem"}, ""},
	}
	for _, tc := range tests {
		t.Run(tc.stem, func(t *testing.T) {
			raw, err := os.ReadFile(realdatapkg.Path(t, "azure", tc.stem+".signature.b64"))
			if err != nil {
				t.Fatal(err)
			}
			content, err := os.ReadFile(realdatapkg.Path(t, "azure", tc.stem+".content.json"))
			if err != nil {
				t.Fatal(err)
			}
			var want AttestedData
			if err := json.Unmarshal(content, &want); err != nil {
				t.Fatal(err)
			}
			created, _, err := want.Window()
			if err != nil {
				t.Fatal(err)
			}
			at := created.Add(time.Minute)
			cfg := VerifierConfig{Roots: []string{realdatapkg.Path(t, "azure", tc.root)}, Subscriptions: []string{want.SubscriptionID}}
			for _, i := range tc.intermediates {
				cfg.Intermediates = append(cfg.Intermediates, realdatapkg.Path(t, "azure", i))
			}
			if tc.signerName != "" {
				cfg.SignerNames = []string{tc.signerName}
			}
			v, err := NewVerifier(cfg)
			if err != nil {
				t.Fatal(err)
			}
			sig := string(raw)
			doc, err := v.verifyDocument(context.Background(), sig, at)
			if err != nil {
				t.Fatalf("real document rejected: %v", err)
			}
			if *doc != want {
				t.Fatalf("signed content %+v, want %+v", doc, want)
			}
			// The full verifier then stops at the nonce: the sample was not
			// requested for a CSR key.
			v.clock = clocktesting.NewFakePassiveClock(at)
			pid := "azure:///subscriptions/" + want.SubscriptionID + "/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm"
			_, err = v.Verify(context.Background(), &attestor.VerifyRequest{Evidence: sigEvidence(t, sig), Binding: make([]byte, 32), ProviderID: pid})
			attestortest.WantDenial(t, err, ReasonNonceMismatch)

			der, _ := base64.StdEncoding.DecodeString(sig)
			i := bytes.Index(der, []byte(want.VMID))
			if i < 0 {
				t.Fatal("content not embedded in the PKCS#7")
			}
			bad := bytes.Clone(der)
			bad[i] ^= 1
			_, err = v.verifyDocument(context.Background(), base64.StdEncoding.EncodeToString(bad), at)
			attestortest.WantDenial(t, err, ReasonInvalidSignature)

			_, err = v.verifyDocument(context.Background(), sig, time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
			attestortest.WantDenial(t, err, ReasonUntrustedSigner)
			if tc.signerName != "" {
				v.signerNames = []string{DefaultSignerName}
				_, err = v.verifyDocument(context.Background(), sig, at)
				attestortest.WantDenial(t, err, ReasonSignerNameNotAllowed)
			}
		})
	}
}

func FuzzVerifyEvidence(f *testing.F) {
	raw, _ := os.ReadFile(realdatapkg.Path(f, "azure", "imds-attested-2026-eastus.signature.b64"))
	seed, _ := json.Marshal(Evidence{Version: VersionV1, Signature: string(raw)})
	f.Add(seed)
	f.Add([]byte(`{"version":"v1","signature":"MIIB"}`))
	v, err := NewVerifier(VerifierConfig{Roots: []string{realdatapkg.Path(f, "azure", "digicert-global-root-g2.pem")}, Subscriptions: []string{"05e8b285-4ce1-46a3-b4c9-f51ba67d6acc"}})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if res, err := v.Verify(context.Background(), &attestor.VerifyRequest{Evidence: data, Binding: make([]byte, 32)}); err == nil {
			t.Fatalf("fuzzed evidence accepted: %+v", res)
		}
	})
}

func TestConformance(t *testing.T) {
	f := newFixture(t, nil)
	attestortest.Conformance(t, attestortest.Provider{
		Name:          Name,
		NewAttestor:   func(testing.TB) attestor.Attestor { return f.att },
		Verifier:      f.verifier(t),
		NodeName:      "node-a",
		ProviderID:    f.providerID(),
		BindingReason: ReasonNonceMismatch,
		WantStable:    "azure:" + f.emu.VM.VMID,
	})
}

// TestIssuingCAFetched: IMDS embeds only the signing certificate; the
// verifier fetches the issuing CA it names, from allowed hosts only, keeps
// it, and treats a failed fetch as transient.
func TestIssuingCAFetched(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, nil)
	host, fetches := f.emu.ServeIssuer(t)
	f.cfg.Intermediates = nil

	t.Run("fetched once and kept", func(t *testing.T) {
		f.cfg.Issuers = IssuersConfig{Hosts: []string{host}}
		v := f.verifier(t)
		for i := 0; i < 2; i++ {
			if _, err := v.Verify(ctx, f.request(f.attest(t))); err != nil {
				t.Fatalf("Verify %d: %v", i, err)
			}
		}
		if n := fetches(); n != 1 {
			t.Fatalf("issuing CA fetched %d times, want 1", n)
		}
	})
	t.Run("host not allowed", func(t *testing.T) {
		f.cfg.Issuers = IssuersConfig{}
		_, err := f.verifier(t).Verify(ctx, f.request(f.attest(t)))
		attestortest.WantDenial(t, err, ReasonUntrustedSigner)
	})
	t.Run("fetching disabled", func(t *testing.T) {
		f.cfg.Issuers = IssuersConfig{Disabled: true, Hosts: []string{host}}
		_, err := f.verifier(t).Verify(ctx, f.request(f.attest(t)))
		attestortest.WantDenial(t, err, ReasonUntrustedSigner)
	})
	t.Run("fetch failure is transient", func(t *testing.T) {
		f.cfg.Issuers = IssuersConfig{Hosts: []string{host}}
		v := f.verifier(t)
		v.issuers.client = &http.Client{Transport: roundTripFunc(func(*http.Request) (*http.Response, error) {
			return nil, errors.New("connection refused")
		})}
		_, err := v.Verify(ctx, f.request(f.attest(t)))
		if err == nil {
			t.Fatal("Verify accepted without the issuing CA")
		}
		if d, ok := attestor.AsDenial(err); ok {
			t.Fatalf("an unreachable issuer was a denial (%v), want a transient error", d)
		}
	})
}

// TestIssuingCAURLNotServed: the issuing CA URL comes from the node's
// certificate; an allowed host that does not serve it (404), or serves no
// CA certificate there, is a denial, not a transient error retried and
// fetched again; an issuer host's own trouble (5xx) is transient.
func TestIssuingCAURLNotServed(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, nil)
	host, _ := f.emu.ServeIssuer(t)
	f.cfg.Intermediates = nil
	f.cfg.Issuers = IssuersConfig{Hosts: []string{host}}
	for _, tc := range []struct {
		name   string
		status int
		body   string
		deny   bool
	}{
		{"not found", http.StatusNotFound, "", true},
		{"not a certificate", http.StatusOK, "<html>a page</html>", true},
		{"issuer down", http.StatusServiceUnavailable, "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := f.verifier(t)
			v.issuers.client = &http.Client{Transport: roundTripFunc(func(r *http.Request) (*http.Response, error) {
				return &http.Response{StatusCode: tc.status, Status: http.StatusText(tc.status), Body: io.NopCloser(strings.NewReader(tc.body)), Request: r}, nil
			})}
			_, err := v.Verify(ctx, f.request(f.attest(t)))
			if tc.deny {
				attestortest.WantDenial(t, err, ReasonUntrustedSigner)
				return
			}
			if _, ok := attestor.AsDenial(err); ok || err == nil {
				t.Fatalf("Verify = %v, want a transient error", err)
			}
		})
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestRealDocumentsWithBuiltinRoots (issue 13.6): with no roots and no
// intermediates configured, real documents verify against the built-in
// Microsoft roots, the issuing CA fetched from the URL the signing
// certificate names (served here from the real-data copy of it).
func TestRealDocumentsWithBuiltinRoots(t *testing.T) {
	for _, tc := range []struct{ stem, issuer string }{
		{"imds-attested-2026-eastus", "microsoft-tls-g2-rsa-ca-ocsp-02.pem"},
		{"imds-attested-2024-eastus", "microsoft-azure-rsa-tls-issuing-ca-08.pem"},
	} {
		t.Run(tc.stem, func(t *testing.T) {
			raw, err := os.ReadFile(realdatapkg.Path(t, "azure", tc.stem+".signature.b64"))
			if err != nil {
				t.Fatal(err)
			}
			content, _ := os.ReadFile(realdatapkg.Path(t, "azure", tc.stem+".content.json"))
			var want AttestedData
			if err := json.Unmarshal(content, &want); err != nil {
				t.Fatal(err)
			}
			created, _, _ := want.Window()
			issuerPEM, err := os.ReadFile(realdatapkg.Path(t, "azure", tc.issuer))
			if err != nil {
				t.Fatal(err)
			}
			v, err := NewVerifier(VerifierConfig{Subscriptions: []string{want.SubscriptionID}})
			if err != nil {
				t.Fatal(err)
			}
			var asked []string
			v.issuers.client = &http.Client{Transport: roundTripFunc(func(r *http.Request) (*http.Response, error) {
				asked = append(asked, r.URL.String())
				return &http.Response{StatusCode: http.StatusOK, Body: io.NopCloser(bytes.NewReader(issuerPEM)), Header: http.Header{}}, nil
			})}
			doc, err := v.verifyDocument(context.Background(), string(raw), created.Add(time.Minute))
			if err != nil {
				t.Fatalf("real document rejected with the built-in roots: %v", err)
			}
			if doc.VMID != want.VMID || len(asked) != 1 || !strings.Contains(asked[0], "microsoft.com/") {
				t.Fatalf("doc %+v; issuer fetched from %q", doc, asked)
			}
		})
	}
}

// TestBuiltinRootsMatchRealData: the compiled-in roots are byte for byte
// the real-data copies, and the README records their SHA-256.
func TestBuiltinRootsMatchRealData(t *testing.T) {
	readme, err := fs.ReadFile(BuiltinRoots(), "README.md")
	if err != nil {
		t.Fatal(err)
	}
	for name, real := range map[string]string{
		"digicert-global-root-g2.pem":   "digicert-global-root-g2.pem",
		"microsoft-tls-rsa-root-g2.pem": "microsoft-tls-rsa-root-g2-selfsigned.pem",
	} {
		b, err := fs.ReadFile(BuiltinRoots(), name)
		if err != nil {
			t.Fatal(err)
		}
		want, err := os.ReadFile(realdatapkg.Path(t, "azure", real))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(b, want) {
			t.Errorf("built-in %s differs from real data %s", name, real)
		}
		sum := sha256.Sum256(b)
		if !strings.Contains(string(readme), hex.EncodeToString(sum[:])) {
			t.Errorf("README.md does not record the SHA-256 of %s", name)
		}
	}
	if names, _ := fs.Glob(BuiltinRoots(), "*.pem"); len(names) != 2 {
		t.Errorf("built-in roots %v, want the two the README lists", names)
	}
}
