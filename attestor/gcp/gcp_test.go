package gcp

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"k8s.io/utils/clock"

	"sigs.k8s.io/kubelet-authenticator/attestor/attestortest"
	realdatapkg "sigs.k8s.io/kubelet-authenticator/test/realdata"

	"github.com/go-jose/go-jose/v4"

	"sigs.k8s.io/kubelet-authenticator/attestor"
	"sigs.k8s.io/kubelet-authenticator/attestor/tlsconfig"
	gcpemu "sigs.k8s.io/kubelet-authenticator/test/emulators/gcp"
)

type fixture struct {
	emu     *gcpemu.Emulator
	att     *Attestor
	cfg     VerifierConfig
	binding []byte
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	emu := gcpemu.New(t, gcpemu.Instance{})
	att, err := NewAttestor(AttestorConfig{MetadataEndpoint: emu.MetadataURL})
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{emu: emu, att: att, binding: attestortest.NewBinding(t), cfg: VerifierConfig{
		Projects: []string{emu.Instance.ProjectID},
		JWKS:     JWKSConfig{URL: emu.JWKSURL, TLS: &tlsconfig.Config{TrustedCA: &tlsconfig.CABundle{PEM: emu.JWKSCAPEM}}},
	}}
}

func (f *fixture) providerID() string {
	i := f.emu.Instance
	return "gce://" + i.ProjectID + "/" + i.Zone + "/" + i.InstanceName
}

func (f *fixture) attest(t *testing.T) attestor.Evidence {
	t.Helper()
	ev, err := f.att.Attest(context.Background(), &attestor.Request{NodeName: f.emu.Instance.InstanceName, ProviderID: f.providerID(), Binding: f.binding})
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
	return &attestor.VerifyRequest{Evidence: ev, Version: VersionV1, Binding: f.binding, NodeName: f.emu.Instance.InstanceName, ProviderID: f.providerID()}
}

func tokenEvidence(t *testing.T, tok string) attestor.Evidence {
	t.Helper()
	ev, err := json.Marshal(Evidence{Version: VersionV1, Token: tok})
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func TestRoundTrip(t *testing.T) {
	f := newFixture(t)
	v := f.verifier(t)
	res, err := v.Verify(context.Background(), f.request(f.attest(t)))
	if err != nil {
		t.Fatalf("Verify: %v", err)
	}
	want := attestor.Identity{ProviderID: f.providerID(), Stable: "gcp:" + f.emu.Instance.InstanceID}
	if res.Identity == nil || *res.Identity != want {
		t.Fatalf("Verify = %+v, want %+v", res.Identity, want)
	}
	// A second verification uses the cached keys.
	f.binding = attestortest.NewBinding(t)
	if _, err := v.Verify(context.Background(), f.request(f.attest(t))); err != nil {
		t.Fatalf("second Verify: %v", err)
	}
	if n := f.emu.JWKSFetches(); n != 1 {
		t.Fatalf("JWKS fetched %d times, want 1 (cached)", n)
	}
}

func TestKeyRotation(t *testing.T) {
	f := newFixture(t)
	v := f.verifier(t)
	if _, err := v.Verify(context.Background(), f.request(f.attest(t))); err != nil {
		t.Fatal(err)
	}
	f.emu.RotateKey(t)
	// Within the minimum refresh interval an unknown key is not fetched.
	ev := f.attest(t)
	_, err := v.Verify(context.Background(), f.request(ev))
	attestortest.WantDenial(t, err, ReasonUnknownKey)
	later := time.Now().Add(time.Minute)
	v.clock = clocktesting.NewFakePassiveClock(later)
	f.emu.SetClock(func() time.Time { return later })
	if _, err := v.Verify(context.Background(), f.request(f.attest(t))); err != nil {
		t.Fatalf("Verify after rotation: %v", err)
	}
	if n := f.emu.JWKSFetches(); n != 2 {
		t.Fatalf("JWKS fetched %d times, want 2", n)
	}
}

func TestMetadataRequiresFlavorHeader(t *testing.T) {
	emu := gcpemu.New(t, gcpemu.Instance{})
	resp, err := http.Get(emu.MetadataURL + "/computeMetadata/v1/instance/service-accounts/default/identity?audience=x")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Fatalf("request without Metadata-Flavor answered %s, want 403", resp.Status)
	}
}

func TestDenials(t *testing.T) {
	untrusted, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		reason string
		// edit returns the evidence to verify and may change the request
		// and the verifier.
		edit func(t *testing.T, f *fixture, v *Verifier, in *attestor.VerifyRequest) attestor.Evidence
	}{
		{"signature by an untrusted key", ReasonUnknownKey, func(t *testing.T, f *fixture, _ *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			tok, err := gcpemu.SignWith(f.emu.Claims(Audience("", f.binding)), untrusted, "attacker")
			if err != nil {
				t.Fatal(err)
			}
			return tokenEvidence(t, tok)
		}},
		{"untrusted key claiming Google's key ID", ReasonInvalidSignature, func(t *testing.T, f *fixture, v *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			good := f.attest(t)
			var ev Evidence
			_ = json.Unmarshal(good, &ev)
			var hdr struct {
				Kid string `json:"kid"`
			}
			b, _ := base64.RawURLEncoding.DecodeString(strings.Split(ev.Token, ".")[0])
			_ = json.Unmarshal(b, &hdr)
			tok, err := gcpemu.SignWith(f.emu.Claims(Audience("", f.binding)), untrusted, hdr.Kid)
			if err != nil {
				t.Fatal(err)
			}
			return tokenEvidence(t, tok)
		}},
		{"claims altered after signing", ReasonInvalidSignature, func(t *testing.T, f *fixture, _ *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			var ev Evidence
			_ = json.Unmarshal(f.attest(t), &ev)
			parts := strings.Split(ev.Token, ".")
			payload, _ := base64.RawURLEncoding.DecodeString(parts[1])
			payload = []byte(strings.Replace(string(payload), f.emu.Instance.ProjectID, "other-project", 1))
			parts[1] = base64.RawURLEncoding.EncodeToString(payload)
			return tokenEvidence(t, strings.Join(parts, "."))
		}},
		{"binding from another key", ReasonAudienceMismatch, func(t *testing.T, f *fixture, _ *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			ev := f.attest(t)
			in.Binding = attestortest.NewBinding(t)
			return ev
		}},
		{"expired token", ReasonTokenExpired, func(t *testing.T, f *fixture, v *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			ev := f.attest(t)
			v.clock = clocktesting.NewFakePassiveClock(time.Now().Add(2 * time.Hour))
			return ev
		}},
		{"token issued in the future", ReasonTokenExpired, func(t *testing.T, f *fixture, v *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			f.emu.SetClock(func() time.Time { return time.Now().Add(10 * time.Minute) })
			return f.attest(t)
		}},
		{"wrong issuer", ReasonIssuerMismatch, func(t *testing.T, f *fixture, _ *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			c := f.emu.Claims(Audience("", f.binding))
			c["iss"] = "https://attacker.example"
			tok, _ := f.emu.Sign(c)
			return tokenEvidence(t, tok)
		}},
		{"token without compute engine claims", ReasonNotComputeEngine, func(t *testing.T, f *fixture, _ *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			c := f.emu.Claims(Audience("", f.binding))
			delete(c, "google")
			tok, _ := f.emu.Sign(c)
			return tokenEvidence(t, tok)
		}},
		{"wrong project", ReasonProjectNotAllowed, func(t *testing.T, f *fixture, v *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			v.projects = []string{"another-project"}
			return f.attest(t)
		}},
		{"instance name is not the node name", attestor.ReasonNodeNameMismatch, func(t *testing.T, f *fixture, _ *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			in.NodeName = "control-plane-0"
			return f.attest(t)
		}},
		{"provider ID not matching the token", attestor.ReasonAttestedProviderIDMismatch, func(t *testing.T, f *fixture, _ *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			in.ProviderID = "gce://" + f.emu.Instance.ProjectID + "/other-zone/" + f.emu.Instance.InstanceName
			return f.attest(t)
		}},
		{"HS256 token", attestor.ReasonMalformedEvidence, func(t *testing.T, f *fixture, _ *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			s, _ := jose.NewSigner(jose.SigningKey{Algorithm: jose.HS256, Key: []byte("0123456789abcdef0123456789abcdef")}, nil)
			p, _ := json.Marshal(f.emu.Claims(Audience("", f.binding)))
			j, _ := s.Sign(p)
			tok, _ := j.CompactSerialize()
			return tokenEvidence(t, tok)
		}},
		{"unknown evidence field", attestor.ReasonEvidenceUnknownField, func(t *testing.T, f *fixture, _ *Verifier, in *attestor.VerifyRequest) attestor.Evidence {
			return attestor.Evidence(strings.Replace(string(f.attest(t)), "{", `{"extra":true,`, 1))
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			v := f.verifier(t)
			in := f.request(nil)
			in.Evidence = tc.edit(t, f, v, in)
			res, err := v.Verify(context.Background(), in)
			if err == nil {
				t.Fatalf("Verify accepted: %+v", res.Identity)
			}
			attestortest.WantDenial(t, err, tc.reason)
		})
	}
}

func TestJWKSUnreachableIsTransient(t *testing.T) {
	f := newFixture(t)
	srv := httptest.NewTLSServer(http.NotFoundHandler())
	srv.Close()
	f.cfg.JWKS.URL = srv.URL
	_, err := f.verifier(t).Verify(context.Background(), f.request(f.attest(t)))
	if err == nil {
		t.Fatal("Verify accepted without keys")
	}
	if d, ok := attestor.AsDenial(err); ok {
		t.Fatalf("JWKS down was a denial (%v), want a transient error", d)
	}
}

func TestJWKSTLSIsPerUpstream(t *testing.T) {
	// Without the emulator's CA in jwks.tls the JWKS is not trusted.
	f := newFixture(t)
	f.cfg.JWKS.TLS = nil
	_, err := f.verifier(t).Verify(context.Background(), f.request(f.attest(t)))
	if _, ok := attestor.AsDenial(err); err == nil || ok {
		t.Fatalf("Verify with an untrusted JWKS server = %v, want a transient TLS error", err)
	}
}

// realJWKS serves the real Google certificate of kid as a JWKS.
func realJWKS(t *testing.T, kid string) (string, *tlsconfig.Config) {
	t.Helper()
	data, err := os.ReadFile(realdatapkg.Path(t, "gcp", "google-oauth2-v1-cert-"+kid+".pem"))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := pem.Decode(data)
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	set := jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: cert.PublicKey, KeyID: kid, Algorithm: "RS256", Use: "sig"}}}
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _ = json.NewEncoder(w).Encode(set) }))
	t.Cleanup(srv.Close)
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	return srv.URL, &tlsconfig.Config{TrustedCA: &tlsconfig.CABundle{PEM: ca}}
}

// TestRealToken checks real GCE identity tokens against the Google key
// that signed them, at a time inside their validity.
func TestRealToken(t *testing.T) {
	const kid = "19fe2a7b6795239606ca0a750794a7bd9fd95961"
	url, tc := realJWKS(t, kid)
	for _, name := range []string{"gce-identity-token-2021-06-19-a.jwt", "gce-identity-token-2021-06-19-b.jwt"} {
		t.Run(name, func(t *testing.T) {
			raw, err := os.ReadFile(realdatapkg.Path(t, "gcp", name))
			if err != nil {
				t.Fatal(err)
			}
			tok := string(raw)
			v, err := NewVerifier(VerifierConfig{Projects: []string{"mineral-minutia-820"}, JWKS: JWKSConfig{URL: url, TLS: tc}})
			if err != nil {
				t.Fatal(err)
			}
			v.clock = clocktesting.NewFakePassiveClock(time.Unix(1624130200, 0))
			claims, err := v.verifyToken(context.Background(), tok)
			if err != nil {
				t.Fatalf("real token rejected: %v", err)
			}
			ce := claims.Google.ComputeEngine
			if ce.ProviderID() != "gce://mineral-minutia-820/us-central1-a/client" || ce.Stable() != "gcp:8698503547301626160" {
				t.Fatalf("real token claims %+v", ce)
			}
			// The full verifier then stops at the audience: the sample was
			// not requested for a CSR key.
			_, err = v.Verify(context.Background(), &attestor.VerifyRequest{Evidence: tokenEvidence(t, tok), Binding: make([]byte, 32), NodeName: "client", ProviderID: ce.ProviderID()})
			attestortest.WantDenial(t, err, ReasonAudienceMismatch)

			for _, pos := range []int{strings.Index(tok, ".") + 20, len(tok) - 20} {
				bad := []byte(tok)
				if bad[pos] == 'A' {
					bad[pos] = 'B'
				} else {
					bad[pos] = 'A'
				}
				_, err := v.verifyToken(context.Background(), string(bad))
				if d, ok := attestor.AsDenial(err); !ok || (d.Reason != ReasonInvalidSignature && d.Reason != attestor.ReasonMalformedEvidence) {
					t.Fatalf("token altered at %d: %v, want a denial", pos, err)
				}
			}
			v.clock = clock.RealClock{}
			_, err = v.verifyToken(context.Background(), tok)
			attestortest.WantDenial(t, err, ReasonTokenExpired)
		})
	}
	t.Run("another Google key", func(t *testing.T) {
		url, tc := realJWKS(t, "6a1d26d992be7a4b689bdce1911f4e9adc75d9f1")
		raw, _ := os.ReadFile(realdatapkg.Path(t, "gcp", "gce-identity-token-2021-06-19-a.jwt"))
		v, _ := NewVerifier(VerifierConfig{Projects: []string{"mineral-minutia-820"}, JWKS: JWKSConfig{URL: url, TLS: tc}})
		v.clock = clocktesting.NewFakePassiveClock(time.Unix(1624130200, 0))
		_, err := v.verifyToken(context.Background(), string(raw))
		attestortest.WantDenial(t, err, ReasonUnknownKey)
	})
}

func TestNewVerifierValidates(t *testing.T) {
	_, err := NewVerifier(VerifierConfig{JWKS: JWKSConfig{URL: "http://insecure.example/certs"}})
	if err == nil || !strings.Contains(err.Error(), "projects") || !strings.Contains(err.Error(), "https") {
		t.Fatalf("NewVerifier = %v, want errors naming projects and https", err)
	}
}

func FuzzVerifyEvidence(f *testing.F) {
	raw, _ := os.ReadFile(realdatapkg.Path(f, "gcp", "gce-identity-token-2021-06-19-a.jwt"))
	seed, _ := json.Marshal(Evidence{Version: VersionV1, Token: string(raw)})
	f.Add(seed)
	f.Add([]byte(`{"version":"v1","token":"a.b.c"}`))
	v, err := NewVerifier(VerifierConfig{Projects: []string{"mineral-minutia-820"}})
	if err != nil {
		f.Fatal(err)
	}
	v.keys.client = &http.Client{Transport: roundTripFunc(func(*http.Request) (*http.Response, error) {
		return nil, errors.New("no network in fuzzing")
	})}
	f.Fuzz(func(t *testing.T, data []byte) {
		if res, err := v.Verify(context.Background(), &attestor.VerifyRequest{Evidence: data, Binding: make([]byte, 32), NodeName: "client"}); err == nil {
			t.Fatalf("fuzzed evidence accepted: %+v", res)
		}
	})
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func TestConformance(t *testing.T) {
	f := newFixture(t)
	attestortest.Conformance(t, attestortest.Provider{
		Name:          Name,
		NewAttestor:   func(testing.TB) attestor.Attestor { return f.att },
		Verifier:      f.verifier(t),
		NodeName:      f.emu.Instance.InstanceName,
		ProviderID:    f.providerID(),
		BindingReason: ReasonAudienceMismatch,
		WantStable:    "gcp:" + f.emu.Instance.InstanceID,
	})
}

// TestJWKSCARotationWithoutRestart (issue 13.7): the verifier's JWKS client
// follows its tlsconfig.Upstream: after the upstream rotates its CA, the
// file is updated and the configuration set again (as the controller does
// when it polls), the next verification that must fetch the JWKS succeeds
// with the same verifier.
func TestJWKSCARotationWithoutRestart(t *testing.T) {
	f := newFixture(t)
	caFile := filepath.Join(t.TempDir(), "jwks-ca.pem")
	if err := os.WriteFile(caFile, f.emu.JWKSCAPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	tlsCfg := &tlsconfig.Config{TrustedCA: &tlsconfig.CABundle{File: caFile}}
	upstream, err := tlsconfig.NewUpstream(tlsCfg)
	if err != nil {
		t.Fatal(err)
	}
	f.cfg.JWKS.TLS = tlsCfg.WithUpstream(upstream)
	v := f.verifier(t)
	ctx := context.Background()
	if _, err := v.Verify(ctx, f.request(f.attest(t))); err != nil {
		t.Fatalf("before rotation: %v", err)
	}

	// The upstream rotates its CA and its signing key, so the next token
	// needs a JWKS fetch over a connection made with the new CA.
	newCA := f.emu.RotateTLS(t)
	f.emu.RotateKey(t)
	later := time.Now().Add(time.Minute)
	clk := clocktesting.NewFakePassiveClock(later)
	v.clock = clk
	f.binding = attestortest.NewBinding(t)
	if _, err := upstream.Set(tlsCfg); err != nil {
		t.Fatal(err)
	}
	_, err = v.Verify(ctx, f.request(f.attest(t)))
	if err == nil {
		t.Fatal("the rotated JWKS server was trusted before the bundle changed")
	}
	if d, ok := attestor.AsDenial(err); ok {
		t.Fatalf("an untrusted JWKS server was a denial (%v), want a transient error", d)
	}

	if err := os.WriteFile(caFile, newCA, 0o600); err != nil {
		t.Fatal(err)
	}
	if changed, err := upstream.Set(tlsCfg); !changed || err != nil {
		t.Fatalf("Set after the CA file changed = %v, %v", changed, err)
	}
	later = later.Add(time.Minute)
	clk.SetTime(later)
	if _, err := v.Verify(ctx, f.request(f.attest(t))); err != nil {
		t.Fatalf("after the CA bundle file changed: %v", err)
	}
}
