package attestor

import (
	"bytes"
	stdjson "encoding/json"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"
)

// sample is an evidence type shaped like the providers': nested structs, a
// map, a slice of structs, bytes.
type sample struct {
	Version    string            `json:"version"`
	ProviderID string            `json:"providerID"`
	Blob       []byte            `json:"blob,omitempty"`
	Inner      *sampleInner      `json:"inner,omitempty"`
	Headers    map[string]string `json:"headers,omitempty"`
	List       []sampleInner     `json:"list,omitempty"`
}

type sampleInner struct {
	Name  string `json:"name"`
	Count int    `json:"count,omitempty"`
	Kind  string `json:"kind,omitempty"`
}

// vendorDoc is shaped like a vendor-signed document: unknown members are
// skipped.
type vendorDoc struct {
	InstanceID string `json:"instanceId"`
	Region     string `json:"region"`
}

func TestDecodeEvidenceRules(t *testing.T) {
	good := `{"version":"v1","providerID":"test:///a","inner":{"name":"n","count":2},"headers":{"A":"b"},"list":[{"name":"x"}]}`
	huge := `{"version":"v1","providerID":"` + strings.Repeat("a", MaxEvidenceSize) + `"}`
	for _, tc := range []struct {
		name string
		in   string
		// check is the reason CheckEvidence gives ("" = it passes), decode
		// the one DecodeEvidence gives.
		check, decode string
		// mentions is a word the message must carry.
		mentions string
	}{
		{name: "good", in: good},
		{name: "good with white space", in: " \n" + good + "\n\t "},
		{name: "too large even if well-formed", in: huge, check: ReasonEvidenceTooLarge, decode: ReasonEvidenceTooLarge, mentions: "more than"},
		{name: "invalid UTF-8 in a value", in: `{"version":"v1","providerID":"test:///` + "\xff" + `"}`, check: ReasonEvidenceInvalidUTF8, decode: ReasonEvidenceInvalidUTF8, mentions: "offset 38"},
		{name: "invalid UTF-8 in a name", in: `{"version":"v1","provider` + "\xc3\x28" + `ID":"x"}`, check: ReasonEvidenceInvalidUTF8, decode: ReasonEvidenceInvalidUTF8},
		{name: "duplicate top-level key", in: `{"version":"v1","providerID":"test:///a","providerID":"test:///b"}`, check: ReasonEvidenceDuplicateKey, decode: ReasonEvidenceDuplicateKey, mentions: `"providerID"`},
		{name: "duplicate version", in: `{"version":"v1","providerID":"a","version":"v2"}`, check: ReasonEvidenceDuplicateKey, decode: ReasonEvidenceDuplicateKey},
		{name: "duplicate key spelled with an escape", in: `{"version":"v1","providerID":"a","provider\u0049D":"b"}`, check: ReasonEvidenceDuplicateKey, decode: ReasonEvidenceDuplicateKey},
		{name: "duplicate nested key", in: `{"version":"v1","providerID":"a","inner":{"name":"n","name":"m"}}`, check: ReasonEvidenceDuplicateKey, decode: ReasonEvidenceDuplicateKey, mentions: "/inner"},
		{name: "duplicate key in a map", in: `{"version":"v1","providerID":"a","headers":{"A":"1","A":"2"}}`, check: ReasonEvidenceDuplicateKey, decode: ReasonEvidenceDuplicateKey},
		{name: "duplicate key deep in an array", in: `{"version":"v1","providerID":"a","list":[{"name":"x"},{"name":"y","name":"z"}]}`, check: ReasonEvidenceDuplicateKey, decode: ReasonEvidenceDuplicateKey, mentions: "/list/1"},
		{name: "duplicate key in an unknown member", in: `{"version":"v1","providerID":"a","x":{"k":1,"k":2}}`, check: ReasonEvidenceDuplicateKey, decode: ReasonEvidenceDuplicateKey},
		{name: "trailing object", in: good + `{}`, check: ReasonEvidenceTrailingData, decode: ReasonEvidenceTrailingData},
		{name: "trailing garbage", in: good + ` x`, check: ReasonEvidenceTrailingData, decode: ReasonEvidenceTrailingData},
		{name: "trailing NUL", in: good + "\x00", check: ReasonEvidenceTrailingData, decode: ReasonEvidenceTrailingData},
		{name: "unknown top-level member", in: `{"version":"v1","providerID":"a","extra":1}`, decode: ReasonEvidenceUnknownField, mentions: `"extra"`},
		{name: "unknown nested member", in: `{"version":"v1","providerID":"a","inner":{"name":"n","extra":true}}`, decode: ReasonEvidenceUnknownField, mentions: "/inner"},
		{name: "unknown member in an array element", in: `{"version":"v1","providerID":"a","list":[{"name":"n","extra":null}]}`, decode: ReasonEvidenceUnknownField},
		{name: "case-folded member alone", in: `{"version":"v1","ProviderID":"test:///b"}`, decode: ReasonEvidenceFieldCase, mentions: `"providerID"`},
		{name: "case-folded member after the exact one", in: `{"version":"v1","providerID":"test:///a","PROVIDERID":"test:///b"}`, decode: ReasonEvidenceFieldCase},
		{name: "case-folded nested member", in: `{"version":"v1","providerID":"a","inner":{"Name":"n"}}`, decode: ReasonEvidenceFieldCase, mentions: "/inner"},
		{name: "Kelvin sign folds to k", in: `{"version":"v1","providerID":"a","inner":{"name":"n","\u212aind":"x"}}`, decode: ReasonEvidenceFieldCase, mentions: `"kind"`},
		{name: "case-folded version", in: `{"Version":"v1","providerID":"a"}`, check: ReasonMalformedEvidence, decode: ReasonMalformedEvidence, mentions: `no "version"`},
		{name: "truncated", in: good[:len(good)/2], check: ReasonMalformedEvidence, decode: ReasonMalformedEvidence, mentions: "truncated"},
		{name: "empty", in: ``, check: ReasonMalformedEvidence, decode: ReasonMalformedEvidence},
		{name: "not an object", in: `["v1"]`, check: ReasonMalformedEvidence, decode: ReasonMalformedEvidence},
		{name: "version not a string", in: `{"version":1}`, check: ReasonMalformedEvidence, decode: ReasonMalformedEvidence},
		{name: "version not a version name", in: `{"version":"v1 "}`, check: ReasonMalformedEvidence, decode: ReasonMalformedEvidence},
		{name: "escaped lone surrogate", in: `{"version":"v1","providerID":"\ud800"}`, check: ReasonMalformedEvidence, decode: ReasonMalformedEvidence},
		{name: "wrong type", in: `{"version":"v1","providerID":7}`, decode: ReasonMalformedEvidence},
		{name: "bad base64", in: `{"version":"v1","providerID":"a","blob":"!!"}`, decode: ReasonMalformedEvidence},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantReason(t, "CheckEvidence", CheckEvidence([]byte(tc.in)), tc.check, tc.mentions)
			var s sample
			wantReason(t, "DecodeEvidence", DecodeEvidence([]byte(tc.in), &s), tc.decode, tc.mentions)
			_, err := EvidenceVersion([]byte(tc.in))
			wantReason(t, "EvidenceVersion", err, tc.check, tc.mentions)
		})
	}
}

func wantReason(t *testing.T, what string, err error, reason, mentions string) {
	t.Helper()
	if reason == "" {
		if err != nil {
			t.Fatalf("%s: %v, want success", what, err)
		}
		return
	}
	d, ok := AsDenial(err)
	if !ok || d.Reason != reason {
		t.Fatalf("%s: %v, want a denial with reason %s", what, err, reason)
	}
	if mentions != "" && !strings.Contains(d.Message, mentions) {
		t.Fatalf("%s: message %q does not mention %s", what, d.Message, mentions)
	}
}

// TestCaseFoldedKeyFoolsEncodingJSON shows the hole the strict decoder
// closes: encoding/json takes "ProviderID" for the field tagged providerID,
// and keeps the last of two keys, so one document says two things.
func TestCaseFoldedKeyFoolsEncodingJSON(t *testing.T) {
	doc := []byte(`{"version":"v1","providerID":"test:///mine","ProviderID":"test:///victim"}`)
	var loose sample
	if err := stdjson.Unmarshal(doc, &loose); err != nil || loose.ProviderID != "test:///victim" {
		t.Fatalf("encoding/json read %q (%v); the premise of this test changed", loose.ProviderID, err)
	}
	var strict sample
	wantReason(t, "DecodeEvidence", DecodeEvidence(doc, &strict), ReasonEvidenceFieldCase, "ProviderID")
}

func TestDecodeDocument(t *testing.T) {
	for _, tc := range []struct {
		name, in, reason string
	}{
		{"vendor fields are skipped", `{"instanceId":"i-1","region":"r","architecture":"x86_64","billingProducts":null}`, ""},
		{"no version needed", `{"instanceId":"i-1"}`, ""},
		{"case-folded member", `{"instanceId":"i-1","InstanceId":"i-2"}`, ReasonEvidenceFieldCase},
		{"duplicate member", `{"instanceId":"i-1","instanceId":"i-2"}`, ReasonEvidenceDuplicateKey},
		{"trailing data", `{"instanceId":"i-1"}x`, ReasonEvidenceTrailingData},
		{"invalid UTF-8", "{\"instanceId\":\"\xfe\"}", ReasonEvidenceInvalidUTF8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var d vendorDoc
			err := DecodeDocument([]byte(tc.in), &d, "the identity document")
			wantReason(t, "DecodeDocument", err, tc.reason, "")
			if d, ok := AsDenial(err); err != nil && (!ok || !strings.HasPrefix(d.Message, "the identity document")) {
				t.Fatalf("message %q does not name the document", err)
			}
			if tc.reason == "" && d.InstanceID != "i-1" {
				t.Fatalf("decoded %+v", d)
			}
		})
	}
}

func TestEncodeChecksItsOutput(t *testing.T) {
	att, err := Encode("v1", sample{Version: "v1", ProviderID: "test:///a", Blob: []byte{1, 2}})
	if err != nil {
		t.Fatal(err)
	}
	var back sample
	if err := DecodeEvidence(att.Evidence, &back); err != nil || back.ProviderID != "test:///a" || !bytes.Equal(back.Blob, []byte{1, 2}) {
		t.Fatalf("round trip: %+v, %v", back, err)
	}
	if _, err := Encode("v2", sample{Version: "v1"}); err == nil {
		t.Fatal("Encode accepted a version that disagrees with the document")
	}
	type noVersion struct {
		ProviderID string `json:"providerID"`
	}
	if _, err := Encode("v1", noVersion{ProviderID: "a"}); err == nil {
		t.Fatal(`Encode accepted a document without "version"`)
	}
	if _, err := Encode("v1", sample{Version: "v1", ProviderID: strings.Repeat("a", MaxEvidenceSize)}); err == nil {
		t.Fatal("Encode accepted an oversize document")
	}
}

// TestParseRequestCarriesEvidenceReason: the signer learns the evidence
// rule a request breaks from ParseRequest's error.
func TestParseRequestCarriesEvidenceReason(t *testing.T) {
	der := testCSR(t)
	in := pemBlock(PEMTypeCSR, der) + pemBlock(PEMTypeProvider, []byte("tpm")) +
		pemBlock(PEMTypeData, []byte(`{"version":"v1","a":1,"a":2}`))
	_, err := ParseRequest([]byte(in))
	var re *RequestError
	if !errors.As(err, &re) {
		t.Fatalf("ParseRequest = %v, want a *RequestError", err)
	}
	if d, ok := AsDenial(err); !ok || d.Reason != ReasonEvidenceDuplicateKey {
		t.Fatalf("ParseRequest = %v, want it to carry %s", err, ReasonEvidenceDuplicateKey)
	}
}

// FuzzDecodeEvidence: whatever the strict decoder accepts, it accepts
// whole: the generic checks pass, and encoding/json (a parser with the
// opposite habits: case-insensitive, last key wins) reads the very same
// value, so no two parsers can disagree about accepted evidence.
func FuzzDecodeEvidence(f *testing.F) {
	for _, s := range []string{
		`{"version":"v1","providerID":"test:///a","inner":{"name":"n","count":2},"headers":{"A":"b"},"list":[{"name":"x"}],"blob":"AQI="}`,
		`{"version":"v1","providerID":"a","ProviderID":"b"}`,
		`{"version":"v1","providerID":"a","providerID":"b"}`,
		`{"version":"v1","providerID":"a"} {}`,
		`{"version":"v1","providerID":"\u00e9\ud83d\ude00"}`,
		"{\"version\":\"v1\",\"providerID\":\"\xff\"}",
		`{"version":"v1","inner":{"Name":"n","name":"m"}}`,
		`{"version":"v2","headers":{"a":"1","A":"2"}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var strict sample
		err := DecodeEvidence(data, &strict)
		if err != nil {
			if _, ok := AsDenial(err); !ok {
				t.Fatalf("DecodeEvidence failed without a denial: %v", err)
			}
			return
		}
		if err := CheckEvidence(data); err != nil {
			t.Fatalf("DecodeEvidence accepted what CheckEvidence denies: %v", err)
		}
		if len(data) > MaxEvidenceSize || !stdjson.Valid(data) {
			t.Fatal("accepted oversize or invalid JSON")
		}
		if dup := stdDuplicate(data); dup != "" {
			t.Fatalf("accepted a duplicate key %q", dup)
		}
		var loose sample
		if err := stdjson.Unmarshal(data, &loose); err != nil {
			t.Fatalf("encoding/json cannot read accepted evidence: %v", err)
		}
		if !reflect.DeepEqual(normalize(strict), normalize(loose)) {
			t.Fatalf("parsers disagree:\nstrict %+v\nloose  %+v", strict, loose)
		}
	})
}

// normalize maps empty and nil slices and maps alike (the two libraries
// differ only there, on "null" and "[]").
func normalize(s sample) sample {
	if len(s.Blob) == 0 {
		s.Blob = nil
	}
	if len(s.Headers) == 0 {
		s.Headers = nil
	}
	if len(s.List) == 0 {
		s.List = nil
	}
	return s
}

// stdDuplicate finds a duplicate key with encoding/json's tokenizer, an
// implementation independent of the decoder under test.
func stdDuplicate(data []byte) string {
	dec := stdjson.NewDecoder(bytes.NewReader(data))
	type frame struct {
		obj     bool
		seen    map[string]bool
		wantKey bool
	}
	var stack []*frame
	for {
		tok, err := dec.Token()
		if err == io.EOF || err != nil {
			return ""
		}
		var top *frame
		if len(stack) > 0 {
			top = stack[len(stack)-1]
		}
		if top != nil && top.obj && top.wantKey {
			if d, ok := tok.(stdjson.Delim); ok && d == '}' {
				stack = stack[:len(stack)-1]
				if len(stack) > 0 {
					stack[len(stack)-1].wantKey = true
				}
				continue
			}
			k := tok.(string)
			if top.seen[k] {
				return k
			}
			top.seen[k] = true
			top.wantKey = false
			continue
		}
		switch tok {
		case stdjson.Delim('{'):
			stack = append(stack, &frame{obj: true, seen: map[string]bool{}, wantKey: true})
			continue
		case stdjson.Delim('['):
			stack = append(stack, &frame{})
			continue
		case stdjson.Delim(']'):
			stack = stack[:len(stack)-1]
		}
		if len(stack) > 0 && stack[len(stack)-1].obj {
			stack[len(stack)-1].wantKey = true
		}
	}
}
