package attestor

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"errors"
	"strings"
	"testing"
)

func testCSR(t testing.TB, exts ...pkix.Extension) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:         pkix.Name{CommonName: "system:node:n1", Organization: []string{NodesGroup}},
		ExtraExtensions: exts,
	}, key)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

func pemBlock(typ string, body []byte) string {
	return string(pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: body}))
}

func TestRequestRoundTrip(t *testing.T) {
	ext, err := ProviderIDExtension("aws:///us-east-1a/i-0abc")
	if err != nil {
		t.Fatal(err)
	}
	der := testCSR(t, ext)
	ev := Evidence(`{"version":"v1","x":1}`)
	req, err := EncodeRequest(der, "insecure", ev)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ParseRequest(req)
	if err != nil {
		t.Fatal(err)
	}
	if got.Provider != "insecure" || got.Version != "v1" || !bytes.Equal(got.Evidence, ev) || !bytes.Equal(got.CSRDER, der) {
		t.Fatalf("round trip mismatch: %+v", got)
	}
	pid, err := ProviderIDFromExtensions(got.CSR.Extensions)
	if err != nil || pid != "aws:///us-east-1a/i-0abc" {
		t.Fatalf("provider ID = %q, %v", pid, err)
	}
}

func TestParseRequestRejects(t *testing.T) {
	der := testCSR(t)
	csrB := pemBlock(PEMTypeCSR, der)
	prov := pemBlock(PEMTypeProvider, []byte("tpm"))
	data := pemBlock(PEMTypeData, []byte(`{"version":"v1"}`))
	withHeader := string(pem.EncodeToMemory(&pem.Block{Type: PEMTypeData, Headers: map[string]string{"A": "b"}, Bytes: []byte(`{"version":"v1"}`)}))
	cases := map[string]struct {
		in   string
		want string
	}{
		"trailing garbage":   {csrB + prov + data + "garbage", "unexpected data after PEM block 3"},
		"leading garbage":    {"x" + csrB + prov + data, "unexpected data after PEM block 0"},
		"garbage between":    {csrB + "junk\n" + prov + data, "unexpected data after PEM block 1"},
		"duplicate data":     {csrB + prov + data + data, "more than 3 PEM blocks"},
		"duplicate provider": {csrB + prov + prov, `2 "KUBELET AUTHENTICATOR ATTESTATION PROVIDER" PEM blocks`},
		"missing data":       {csrB + prov, `no "KUBELET AUTHENTICATOR ATTESTATION DATA" PEM block`},
		"missing csr":        {prov + data, `no "CERTIFICATE REQUEST" PEM block`},
		"wrong order":        {csrB + data + prov, "PEM block 2 is"},
		"unknown block":      {csrB + prov + pemBlock("CERTIFICATE", []byte{1}), `no "KUBELET AUTHENTICATOR ATTESTATION DATA"`},
		"headers":            {csrB + prov + withHeader, "must not have headers"},
		"bad pkcs10":         {pemBlock(PEMTypeCSR, []byte{0x30, 0}) + prov + data, "unable to parse PKCS#10"},
		"pkcs10 trailing":    {pemBlock(PEMTypeCSR, append(append([]byte{}, der...), 0)) + prov + data, "unable to parse PKCS#10"},
		"bad provider":       {csrB + pemBlock(PEMTypeProvider, []byte("TPM!")) + data, "invalid provider name"},
		"data not json":      {csrB + prov + pemBlock(PEMTypeData, []byte("{")), "truncated"},
		"data no version":    {csrB + prov + pemBlock(PEMTypeData, []byte(`{"a":1}`)), `no "version"`},
		"data array":         {csrB + prov + pemBlock(PEMTypeData, []byte(`[1]`)), "not a JSON object"},
		"data json trailing": {csrB + prov + pemBlock(PEMTypeData, []byte(`{"version":"v1"} {}`)), "data after its JSON value"},
		"unterminated block": {csrB + prov + "-----BEGIN " + PEMTypeData + "-----\nabc\n", "malformed PEM block"},
		"too large":          {strings.Repeat(" ", MaxRequestSize+1), "larger than the"},
		"empty":              {"", `no "CERTIFICATE REQUEST"`},
		"bad version":        {csrB + prov + pemBlock(PEMTypeData, []byte(`{"version":"1.0"}`)), "invalid version"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := ParseRequest([]byte(tc.in))
			if err == nil {
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not say %q", err, tc.want)
			}
			if re := (*RequestError)(nil); !errors.As(err, &re) {
				t.Fatalf("error is %T, want *RequestError", err)
			}
		})
	}
	if _, err := ParseRequest([]byte("\n" + csrB + "\n" + prov + data + "\n\n")); err != nil {
		t.Fatalf("whitespace between blocks rejected: %v", err)
	}
}

func TestProviderIDExtensionRejects(t *testing.T) {
	good, _ := ProviderIDExtension("gce://p/z/n")
	ia5, _ := asn1.MarshalWithParams("gce://p/z/n", "ia5")
	trailing := append(append([]byte{}, good.Value...), 0)
	cases := map[string][]pkix.Extension{
		"missing":   nil,
		"twice":     {good, good},
		"critical":  {{Id: OIDProviderID, Critical: true, Value: good.Value}},
		"ia5string": {{Id: OIDProviderID, Value: ia5}},
		"trailing":  {{Id: OIDProviderID, Value: trailing}},
		"empty":     {{Id: OIDProviderID, Value: []byte{0x0c, 0}}},
		"not der":   {{Id: OIDProviderID, Value: []byte{0x0c}}},
	}
	for name, exts := range cases {
		if _, err := ProviderIDFromExtensions(exts); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestBinding(t *testing.T) {
	a := Binding([]byte("spki-a"))
	if len(a) != 32 || bytes.Equal(a, Binding([]byte("spki-b"))) || !bytes.Equal(a, Binding([]byte("spki-a"))) {
		t.Fatal("binding is not a deterministic 32-byte digest of the SPKI")
	}
}

func TestDecodeEvidenceStrict(t *testing.T) {
	var v struct {
		Version string `json:"version"`
	}
	if err := DecodeEvidence(Evidence(`{"version":"v1","extra":1}`), &v); err == nil {
		t.Error("unknown field accepted")
	}
	if err := DecodeEvidence(Evidence(`{"version":"v1"}x`), &v); err == nil {
		t.Error("trailing data accepted")
	}
	if err := DecodeEvidence(Evidence(`{"version":"v1"}`), &v); err != nil || v.Version != "v1" {
		t.Errorf("valid evidence: %v", err)
	}
}

func FuzzParseRequest(f *testing.F) {
	der := testCSR(f)
	good, _ := EncodeRequest(der, "insecure", Evidence(`{"version":"v1"}`))
	f.Add(good)
	f.Add([]byte("-----BEGIN CERTIFICATE REQUEST-----\n-----END CERTIFICATE REQUEST-----\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := ParseRequest(data)
		if err != nil {
			return
		}
		// Whatever parses must re-encode to something that parses the same.
		again, err := EncodeRequest(r.CSRDER, r.Provider, r.Evidence)
		if err != nil {
			t.Fatalf("parsed request does not re-encode: %v", err)
		}
		r2, err := ParseRequest(again)
		if err != nil || r2.Provider != r.Provider || !bytes.Equal(r2.Evidence, r.Evidence) {
			t.Fatalf("re-encoded request differs: %v", err)
		}
	})
}
