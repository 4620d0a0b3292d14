package attestor

import (
	"bytes"
	"encoding"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"

	json "github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// The one evidence decoder (DESIGN.md, "Evidence parsing"). Every evidence
// document, on both halves of every provider, and every vendor-signed
// document inside one (an AWS identity document, Azure attested data, GCP
// token claims) is read through it, so that no two parsers can disagree
// about what was attested: a parser that keeps the last of two equal keys
// and one that keeps the first, or one that matches "ProviderID" to the
// field providerID (as encoding/json does) and one that does not.
//
// The rules, each denied with its own reason:
//
//   - at most MaxEvidenceSize bytes (ReasonEvidenceTooLarge);
//   - valid UTF-8 throughout (ReasonEvidenceInvalidUTF8);
//   - no object, at any depth, names a member twice, after unescaping
//     (ReasonEvidenceDuplicateKey);
//   - exactly one JSON value: nothing but white space after it
//     (ReasonEvidenceTrailingData);
//   - for a schema-aware decode, every member name is a field of the
//     target, spelled exactly as its tag spells it: a name that equals a
//     field only when case is folded is ReasonEvidenceFieldCase, any other
//     unknown name is ReasonEvidenceUnknownField (vendor documents, which
//     grow fields over time, skip unknown names but not case-folded ones).
//
// Anything else that does not parse (bad syntax, a truncated document, an
// escaped lone surrogate, a value of the wrong type, bad base64) is
// ReasonMalformedEvidence.
//
// The decoding itself is github.com/go-json-experiment/json, the
// encoding/json/v2 implementation: case-sensitive, rejecting duplicate names
// and invalid UTF-8 on its own; the checks here come first so that each
// rule has its reason and its message names the member at fault.

// MaxEvidenceSize bounds an evidence document, before anything parses it.
// Base64 in the data block of spec.request, it still fits in MaxRequestSize
// beside the PKCS#10 block, with room for a TPM event log.
const MaxEvidenceSize = 160 << 10

// CheckEvidence applies the rules that need no schema to an evidence
// document: size, UTF-8, duplicate keys at any depth, trailing data, and a
// top-level object whose "version" member is a version name. A signer runs
// it on every request before any provider code; a failure is a *DenyError.
func CheckEvidence(raw []byte) error {
	_, err := checkEvidence(raw)
	return err
}

// DecodeEvidence decodes an evidence document into v (a pointer to the
// provider's evidence type) strictly: the rules of CheckEvidence, then no
// member name that is not a field of v at any depth, and names matched
// exactly, never case-folded. Every provider's verifier reads its evidence
// through it, and Encode runs it on what a node half produces. A failure is
// a *DenyError.
func DecodeEvidence(raw []byte, v any) error {
	if _, err := checkEvidence(raw); err != nil {
		return err
	}
	return decodeInto(raw, v, true, "attestation data")
}

// DecodeDocument decodes a vendor-signed JSON document found inside
// evidence (an AWS instance identity document, Azure attested data, GCP
// token claims) into v: the size, UTF-8, duplicate key and trailing data
// rules, and exact-case member names. Unlike DecodeEvidence it skips member
// names v does not know, since vendors add fields, and it needs no
// "version". what names the document in messages. A failure is a
// *DenyError.
func DecodeDocument(raw []byte, v any, what string) error {
	if err := checkSyntax(raw, what); err != nil {
		return err
	}
	return decodeInto(raw, v, false, what)
}

// checkEvidence applies the generic rules and returns the version.
func checkEvidence(raw []byte) (string, error) {
	const what = "attestation data"
	if err := checkSyntax(raw, what); err != nil {
		return "", err
	}
	if k := firstKind(raw); k != '{' {
		return "", Deny(ReasonMalformedEvidence, "%s is not a JSON object", what)
	}
	var head struct {
		Version *string `json:"version"`
	}
	if err := json.Unmarshal(raw, &head); err != nil {
		return "", Deny(ReasonMalformedEvidence, `%s has a "version" that is not a string`, what)
	}
	if head.Version == nil {
		return "", Deny(ReasonMalformedEvidence, `%s has no "version" member`, what)
	}
	if !versionRE().MatchString(*head.Version) {
		return "", Deny(ReasonMalformedEvidence, "%s has an invalid version %q", what, *head.Version)
	}
	return *head.Version, nil
}

// checkSyntax applies the size, UTF-8, syntax, duplicate key and trailing
// data rules.
func checkSyntax(raw []byte, what string) error {
	if len(raw) > MaxEvidenceSize {
		return Deny(ReasonEvidenceTooLarge, "%s is %d bytes, more than the %d allowed", what, len(raw), MaxEvidenceSize)
	}
	if !utf8.Valid(raw) {
		return Deny(ReasonEvidenceInvalidUTF8, "%s is not valid UTF-8 (first bad byte at offset %d)", what, invalidUTF8Offset(raw))
	}
	dec := jsontext.NewDecoder(bytes.NewReader(raw))
	if _, err := dec.ReadValue(); err != nil {
		switch {
		case errors.Is(err, jsontext.ErrDuplicateName):
			return Deny(ReasonEvidenceDuplicateKey, "%s names a member twice: %s", what, describeDuplicate(err))
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			return Deny(ReasonMalformedEvidence, "%s is empty or truncated", what)
		default:
			return Deny(ReasonMalformedEvidence, "%s is not valid JSON: %s", what, trimJSONError(err))
		}
	}
	if _, err := dec.ReadToken(); !errors.Is(err, io.EOF) {
		return Deny(ReasonEvidenceTrailingData, "%s has data after its JSON value, at offset %d", what, dec.InputOffset())
	}
	return nil
}

// decodeInto checks member names against v's type, then decodes.
func decodeInto(raw []byte, v any, rejectUnknown bool, what string) error {
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Pointer || rv.IsNil() {
		// A programming error, not a property of the evidence.
		panic(fmt.Sprintf("attestor: decode into non-pointer %T", v))
	}
	dec := jsontext.NewDecoder(bytes.NewReader(raw))
	if err := checkNames(dec, rv.Type().Elem(), rejectUnknown); err != nil {
		var d *DenyError
		if errors.As(err, &d) {
			d.Message = what + " " + d.Message
			return d
		}
		return Deny(ReasonMalformedEvidence, "%s is not valid JSON: %s", what, trimJSONError(err))
	}
	if err := json.Unmarshal(raw, v, json.RejectUnknownMembers(rejectUnknown)); err != nil {
		if errors.Is(err, json.ErrUnknownName) { // checkNames missed a name: still not a pass
			return Deny(ReasonEvidenceUnknownField, "%s has an unknown member: %s", what, trimJSONError(err))
		}
		return Deny(ReasonMalformedEvidence, "%s does not decode: %s", what, trimJSONError(err))
	}
	return nil
}

var (
	textUnmarshaler  = reflect.TypeFor[encoding.TextUnmarshaler]()
	jsonUnmarshaler  = reflect.TypeFor[json.Unmarshaler]()
	jsonUnmarshalerF = reflect.TypeFor[json.UnmarshalerFrom]()
)

// opaque reports whether t decodes itself: its members are not checked
// against a schema (the generic rules still applied to them).
func opaque(t reflect.Type) bool {
	for _, it := range []reflect.Type{textUnmarshaler, jsonUnmarshaler, jsonUnmarshalerF} {
		if t.Implements(it) || reflect.PointerTo(t).Implements(it) {
			return true
		}
	}
	return false
}

// checkNames reads one value from dec and checks the member names of every
// object in it that decodes into a struct of t.
func checkNames(dec *jsontext.Decoder, t reflect.Type, rejectUnknown bool) error {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil || opaque(t) {
		return dec.SkipValue()
	}
	kind := dec.PeekKind()
	switch {
	case t.Kind() == reflect.Struct && kind == '{':
		fs := fieldsOf(t)
		if _, err := dec.ReadToken(); err != nil {
			return err
		}
		for dec.PeekKind() != '}' {
			tok, err := dec.ReadToken()
			if err != nil {
				return err
			}
			name := tok.String()
			if ft, ok := fs.exact[name]; ok {
				if err := checkNames(dec, ft, rejectUnknown); err != nil {
					return err
				}
				continue
			}
			at := pointerOrRoot(dec.StackPointer().Parent())
			if want, ok := fs.folded[foldName(name)]; ok {
				return Deny(ReasonEvidenceFieldCase, "has member %q in the object at %s where %q is meant: member names are case-sensitive", name, at, want)
			}
			if rejectUnknown {
				return Deny(ReasonEvidenceUnknownField, "has unknown member %q in the object at %s", name, at)
			}
			if err := dec.SkipValue(); err != nil {
				return err
			}
		}
		_, err := dec.ReadToken()
		return err
	case t.Kind() == reflect.Map && kind == '{':
		if _, err := dec.ReadToken(); err != nil {
			return err
		}
		for dec.PeekKind() != '}' {
			if _, err := dec.ReadToken(); err != nil {
				return err
			}
			if err := checkNames(dec, t.Elem(), rejectUnknown); err != nil {
				return err
			}
		}
		_, err := dec.ReadToken()
		return err
	case (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) && kind == '[':
		if _, err := dec.ReadToken(); err != nil {
			return err
		}
		for dec.PeekKind() != ']' {
			if err := checkNames(dec, t.Elem(), rejectUnknown); err != nil {
				return err
			}
		}
		_, err := dec.ReadToken()
		return err
	default:
		// Scalars, interfaces, and values of the wrong JSON kind (which
		// json.Unmarshal then rejects).
		return dec.SkipValue()
	}
}

// fields is the member-name schema of a struct type.
type fields struct {
	exact  map[string]reflect.Type // JSON name -> field type
	folded map[string]string       // folded JSON name -> JSON name
}

var fieldCache sync.Map // reflect.Type -> *fields

// fieldsOf returns the JSON member names of struct type t as
// go-json-experiment/json names them: the json tag's name, else the Go
// field name; "-" and unexported fields are skipped; an embedded struct
// without a name contributes its own fields.
func fieldsOf(t reflect.Type) *fields {
	if f, ok := fieldCache.Load(t); ok {
		return f.(*fields)
	}
	fs := &fields{exact: map[string]reflect.Type{}, folded: map[string]string{}}
	var add func(reflect.Type)
	add = func(t reflect.Type) {
		for i := 0; i < t.NumField(); i++ {
			sf := t.Field(i)
			tag, hasTag := sf.Tag.Lookup("json")
			if tag == "-" {
				continue
			}
			name, _, _ := strings.Cut(tag, ",")
			name = strings.Trim(name, "'")
			if sf.Anonymous && name == "" {
				et := sf.Type
				if et.Kind() == reflect.Pointer {
					et = et.Elem()
				}
				if et.Kind() == reflect.Struct {
					add(et)
					continue
				}
			}
			if !sf.IsExported() {
				continue
			}
			if name == "" || !hasTag {
				name = sf.Name
			}
			fs.exact[name] = sf.Type
			fs.folded[foldName(name)] = name
		}
	}
	add(t)
	fieldCache.Store(t, fs)
	return fs
}

// foldName maps every rune of s to the least rune of its Unicode simple
// case-folding orbit, so that two names fold equal exactly when a
// case-insensitive matcher (encoding/json's) would take one for the other
// ("K", "k" and the Kelvin sign alike).
func foldName(s string) string {
	var b strings.Builder
	for _, r := range s {
		least := r
		for f := unicode.SimpleFold(r); f != r; f = unicode.SimpleFold(f) {
			if f < least {
				least = f
			}
		}
		b.WriteRune(least)
	}
	return b.String()
}

func firstKind(raw []byte) byte {
	s := bytes.TrimLeft(raw, " \t\r\n")
	if len(s) == 0 {
		return 0
	}
	return s[0]
}

func invalidUTF8Offset(raw []byte) int {
	for i := 0; i < len(raw); {
		r, n := utf8.DecodeRune(raw[i:])
		if r == utf8.RuneError && n <= 1 {
			return i
		}
		i += n
	}
	return len(raw)
}

// describeDuplicate names the duplicated member and where it is.
func describeDuplicate(err error) string {
	var se *jsontext.SyntacticError
	if errors.As(err, &se) {
		return fmt.Sprintf("%q in the object at %s", se.JSONPointer.LastToken(), pointerOrRoot(se.JSONPointer.Parent()))
	}
	return trimJSONError(err)
}

func pointerOrRoot(p jsontext.Pointer) string {
	if p == "" {
		return "the top level"
	}
	return string(p)
}

// trimJSONError drops the library's package prefix from its messages.
func trimJSONError(err error) string {
	s := err.Error()
	for _, p := range []string{"jsontext: ", "json: "} {
		s = strings.TrimPrefix(s, p)
	}
	return s
}
