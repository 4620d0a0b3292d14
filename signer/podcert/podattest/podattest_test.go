package podattest

import (
	"bytes"
	"crypto/x509/pkix"
	"encoding/asn1"
	"reflect"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

var (
	attestedAt = time.Date(2026, 11, 27, 4, 5, 6, 0, time.UTC)
	digest     = bytes.Repeat([]byte{0xab}, 32)
)

func sample() *Attestation {
	return &Attestation{
		Attestor:         "tpm",
		ProviderID:       "aws:///us-east-1a/i-0abc",
		MachineNamespace: "team-a",
		MachineName:      "md-0-x7k2p",
		NodeName:         "ip-10-0-1-7.ec2.internal",
		AttestedAt:       attestedAt,
		BootPolicySHA256: digest,
	}
}

// der returns the DER of v, failing the test otherwise.
func der(t *testing.T, v any, params ...string) []byte {
	t.Helper()
	b, err := asn1.MarshalWithParams(v, strings.Join(params, ","))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// seq returns a SEQUENCE of the DER elements given.
func seq(t *testing.T, elems ...[]byte) []byte {
	t.Helper()
	return der(t, asn1.RawValue{Class: asn1.ClassUniversal, Tag: asn1.TagSequence, IsCompound: true, Bytes: bytes.Join(elems, nil)})
}

// fields returns the DER of each field of a valid attestation, in order,
// for tests to replace one.
func fields(t *testing.T) [][]byte {
	t.Helper()
	return [][]byte{
		der(t, 1),
		der(t, "tpm", "utf8"),
		der(t, "aws:///us-east-1a/i-0abc", "utf8"),
		der(t, "team-a", "utf8"),
		der(t, "md-0-x7k2p", "utf8"),
		der(t, "ip-10-0-1-7.ec2.internal", "utf8"),
		der(t, attestedAt, "generalized"),
		der(t, digest, "tag:0"),
	}
}

func with(t *testing.T, i int, b []byte) []byte {
	t.Helper()
	f := fields(t)
	if b == nil {
		f = append(f[:i], f[i+1:]...)
	} else {
		f[i] = b
	}
	return seq(t, f...)
}

func rawTime(s string) []byte {
	return append([]byte{asn1.TagGeneralizedTime, byte(len(s))}, s...)
}

func TestRoundTrip(t *testing.T) {
	for name, a := range map[string]*Attestation{
		"with a boot policy": sample(),
		"without":            func() *Attestation { a := sample(); a.BootPolicySHA256 = nil; return a }(),
		"no provider ID":     func() *Attestation { a := sample(); a.ProviderID = ""; return a }(),
	} {
		t.Run(name, func(t *testing.T) {
			ext, err := a.Extension()
			if err != nil {
				t.Fatal(err)
			}
			if ext.Critical || !ext.Id.Equal(attestor.OIDPodAttestation) {
				t.Fatalf("extension %v critical=%t", ext.Id, ext.Critical)
			}
			got, err := FromExtensions([]pkix.Extension{{Id: attestor.OIDProviderID, Value: []byte{0x0c, 0}}, ext})
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, a) {
				t.Fatalf("parsed %+v, want %+v", got, a)
			}
		})
	}
	// The value is the module's DER: a hand-built SEQUENCE parses.
	if got, err := Parse(seq(t, fields(t)...)); err != nil || !reflect.DeepEqual(got, sample()) {
		t.Fatalf("hand-built value: %+v, %v", got, err)
	}
	// Sub-second times and other zones are written as whole seconds in UTC.
	a := sample()
	a.AttestedAt = attestedAt.Add(700 * time.Millisecond).In(time.FixedZone("x", 3600))
	ext, err := a.Extension()
	if err != nil {
		t.Fatal(err)
	}
	if got, err := Parse(ext.Value); err != nil || !got.AttestedAt.Equal(attestedAt) || got.AttestedAt.Location() != time.UTC {
		t.Fatalf("time written as %v, %v; want %v", got, err, attestedAt)
	}
}

func TestParseRefuses(t *testing.T) {
	longForm := seq(t, fields(t)...)
	longForm = append([]byte{0x30, 0x81, longForm[1]}, longForm[2:]...)
	for _, tc := range []struct {
		name, want string
		value      []byte
	}{
		{"empty", "not a NodeAttestation", nil},
		{"not a SEQUENCE", "not a NodeAttestation", der(t, []byte("tpm"))},
		{"trailing data", "trailing data", append(seq(t, fields(t)...), 0x05, 0x00)},
		{"an extra field", "not in DER", seq(t, append(fields(t), der(t, "more", "utf8"))...)},
		{"a field missing", "not a NodeAttestation", with(t, 5, nil)},
		{"version 2", "version 2", with(t, 0, der(t, 2))},
		{"version 0", "version 0", with(t, 0, der(t, 0))},
		{"PrintableString attestor", "not in DER", with(t, 1, der(t, "tpm", "printable"))},
		{"IA5String node name", "not in DER", with(t, 5, der(t, "ip-10-0-1-7.ec2.internal", "ia5"))},
		{"UTCTime", "not in DER", with(t, 6, der(t, attestedAt, "utc"))},
		{"time with an offset", "not in DER", with(t, 6, rawTime("20261127050506+0100"))},
		{"fractional seconds", "not in DER", with(t, 6, rawTime("20261127040506.5Z"))},
		{"explicit digest tag", "not in DER", with(t, 7, der(t, digest, "tag:0", "explicit"))},
		{"short digest", "bootPolicySHA256 is 31 bytes", with(t, 7, der(t, digest[:31], "tag:0"))},
		{"upper-case attestor", "not an attestor name", with(t, 1, der(t, "TPM", "utf8"))},
		{"empty attestor", "not an attestor name", with(t, 1, der(t, "", "utf8"))},
		{"bad namespace", "not a namespace name", with(t, 3, der(t, "Team_A", "utf8"))},
		{"empty Machine", "not a Machine name", with(t, 4, der(t, "", "utf8"))},
		{"bad node name", "not a node name", with(t, 5, der(t, "node/../x", "utf8"))},
		{"invalid UTF-8", "not a NodeAttestation", with(t, 2, []byte{asn1.TagUTF8String, 2, 0xff, 0xfe})},
		{"BER long-form length", "not a NodeAttestation", longForm},
		{"oversize", "more than the 4096 allowed", seq(t, with(t, 2, der(t, strings.Repeat("x", MaxSize), "utf8")))},
		{"provider ID too long", "providerID is not UTF-8", with(t, 2, der(t, strings.Repeat("x", MaxProviderIDLength+1), "utf8"))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Parse(tc.value)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Parse = %+v, %v; want an error containing %q", got, err, tc.want)
			}
		})
	}
}

func TestFromExtensionsRefuses(t *testing.T) {
	ext, err := sample().Extension()
	if err != nil {
		t.Fatal(err)
	}
	critical := ext
	critical.Critical = true
	for _, tc := range []struct {
		name, want string
		exts       []pkix.Extension
	}{
		{"none", "no attestation extension", []pkix.Extension{{Id: attestor.OIDProviderID, Value: []byte{0x0c, 0}}}},
		{"twice", "more than once", []pkix.Extension{ext, ext}},
		{"critical", "must not be critical", []pkix.Extension{critical}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got, err := FromExtensions(tc.exts); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("FromExtensions = %+v, %v; want an error containing %q", got, err, tc.want)
			}
		})
	}
}

func TestExtensionRefusesWhatParseRefuses(t *testing.T) {
	a := sample()
	a.NodeName = "Not A Node"
	if _, err := a.Extension(); err == nil {
		t.Fatal("Extension encoded an invalid node name")
	}
}

func FuzzParse(f *testing.F) {
	ext, err := sample().Extension()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(ext.Value)
	f.Add([]byte{0x30, 0x00})
	f.Fuzz(func(t *testing.T, value []byte) {
		a, err := Parse(value)
		if err != nil {
			return
		}
		// What parses is exactly what Extension writes for it.
		again, err := a.Extension()
		if err != nil || !bytes.Equal(again.Value, value) {
			t.Fatalf("parsed %+v from %x, which encodes as %x (%v)", a, value, again.Value, err)
		}
	})
}
