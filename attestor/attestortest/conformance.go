package attestortest

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"slices"
	"strings"
	"testing"
	"unicode"

	json "github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// Provider is one provider as the conformance suite drives it: a node half
// factory, a signer half, the machine the node is, and a way to make CSR
// keys. Nothing in it is specific to a kind of provider: a one-round cloud
// attestor and a two-round one (a Result.Challenge answered through the
// node half's attestor.Responder, as the TPM attestor does) run the same
// cases.
type Provider struct {
	// Name is the provider name on the wire (the provider block).
	Name string
	// NewAttestor returns a node half for the machine below. It is called
	// once per case.
	NewAttestor func(tb testing.TB) attestor.Attestor
	// Verifier is the signer half, configured to trust the machine.
	Verifier attestor.Verifier
	// NewKey returns a fresh CSR key; an ECDSA P-256 software key when nil.
	NewKey func(tb testing.TB) crypto.Signer
	// NodeName and ProviderID are what the node registers as; the
	// verifier must prove ProviderID.
	NodeName, ProviderID string
	// MachineAnnotations are handed to the verifier as the annotations of
	// the Machine the signer matched.
	MachineAnnotations map[string]string
	// Unbound is set for providers whose evidence does not commit to the
	// CSR key (insecure, null): the swapped-binding and replay cases are
	// skipped, since such evidence proves nothing a thief could not copy.
	Unbound bool
	// BindingReason is the reason a verifier must give for evidence bound
	// to another key; any denial is accepted when empty.
	BindingReason string
	// WantStable is the stable identity the round trip must prove; any
	// non-empty one when empty, unless Unbound.
	WantStable string
}

// Conformance runs the shared attestor suite against p: a round trip
// through the wire format (attest, file a CSR, parse it as the signer does,
// verify, answering a challenge if the verifier sets one), then evidence
// the verifier must deny: bound to another key, replayed into another CSR,
// truncated, with an unknown member, a duplicate key (top level and
// nested), a case-folded member name, trailing data, invalid UTF-8,
// oversize, and a version the verifier does not know. The generic cases
// check both attestor.CheckEvidence (what the signer runs first) and the
// verifier on its own, which must deny with the same reason.
func Conformance(t *testing.T, p Provider) {
	t.Helper()
	if p.NewKey == nil {
		p.NewKey = func(tb testing.TB) crypto.Signer {
			tb.Helper()
			k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			if err != nil {
				tb.Fatal(err)
			}
			return k
		}
	}
	s := &suite{p: p, clusterCA: NewCACert(t), clusterUID: "cluster-uid-1"}

	t.Run("round trip", func(t *testing.T) {
		f := s.file(t, s.p.NewAttestor(t), s.p.NewKey(t), "")
		id := s.verify(t, f)
		if id.ProviderID != p.ProviderID {
			t.Fatalf("proved provider ID %q, want %q", id.ProviderID, p.ProviderID)
		}
		switch {
		case p.WantStable != "" && id.Stable != p.WantStable:
			t.Fatalf("proved stable identity %q, want %q", id.Stable, p.WantStable)
		case !p.Unbound && id.Stable == "":
			t.Fatal("proved no stable identity")
		case id.Stable != "" && !strings.HasPrefix(id.Stable, p.Name+":"):
			t.Fatalf("stable identity %q is not prefixed with %q", id.Stable, p.Name+":")
		}
	})

	t.Run("swapped binding", func(t *testing.T) {
		if p.Unbound {
			t.Skip("the provider's evidence does not commit to the CSR key")
		}
		f := s.file(t, s.p.NewAttestor(t), s.p.NewKey(t), "")
		in := s.request(f, f.req.Evidence, f.req.Version)
		other := s.file(t, s.p.NewAttestor(t), s.p.NewKey(t), "")
		in.Binding, in.CSR = other.binding, other.req.CSR
		s.wantDenied(t, in, p.BindingReason)
	})

	t.Run("replay into another CSR", func(t *testing.T) {
		if p.Unbound {
			t.Skip("the provider's evidence does not commit to the CSR key")
		}
		victim := s.file(t, s.p.NewAttestor(t), s.p.NewKey(t), "")
		// The thief reads the victim's CSR (every bootstrapper can) and
		// files its evidence block under a key of its own.
		thief := s.refile(t, victim.req.Evidence, s.p.NewKey(t))
		s.wantDenied(t, s.request(thief, thief.req.Evidence, thief.req.Version), p.BindingReason)
	})

	// Every version the node half produces round-trips (an older signer
	// asks for the older ones through supported-versions).
	for _, v := range p.NewAttestor(t).Versions() {
		t.Run("round trip "+v, func(t *testing.T) {
			f := s.file(t, s.p.NewAttestor(t), s.p.NewKey(t), v)
			if f.req.Version != v {
				t.Fatalf("asked for evidence %s, got %s", v, f.req.Version)
			}
			if id := s.verify(t, f); id.ProviderID != p.ProviderID {
				t.Fatalf("proved provider ID %q, want %q", id.ProviderID, p.ProviderID)
			}
		})
	}

	// The copy attack: a tenant who reads another cluster's CSRs copies a
	// fresh request and its evidence into its own cluster, where a Machine
	// claims the victim's provider ID. Evidence of binding v2 names the
	// victim's cluster CA and is denied there.
	t.Run("copied into another cluster", func(t *testing.T) {
		cb, ok := p.Verifier.(attestor.ClusterBinder)
		if p.Unbound || !ok {
			t.Skip("the provider's evidence does not commit to the cluster")
		}
		var bound []string
		for _, v := range p.NewAttestor(t).Versions() {
			if cb.ClusterBound(v) {
				bound = append(bound, v)
			}
		}
		if len(bound) == 0 {
			t.Fatal("the verifier has cluster-bound versions, the node half produces none")
		}
		for _, v := range bound {
			f := s.file(t, s.p.NewAttestor(t), s.p.NewKey(t), v)
			in := s.request(f, f.req.Evidence, f.req.Version)
			in.ClusterCAs, in.ClusterUID = [][]byte{NewCACert(t)}, "cluster-uid-copier"
			s.wantDenied(t, in, p.BindingReason)
			// A CA rotation: the copier's bundle without the victim's CA
			// is still denied; with it (the victim's own cluster) it
			// verifies.
			in = s.request(f, f.req.Evidence, f.req.Version)
			in.ClusterCAs = [][]byte{NewCACert(t), s.clusterCA}
			if _, err := p.Verifier.Verify(context.Background(), in); err != nil {
				t.Fatalf("evidence %s naming the second CA of the cluster's bundle: %v", v, err)
			}
		}
	})

	t.Run("version skew", func(t *testing.T) {
		a := s.p.NewAttestor(t)
		unknown := "v999"
		if slices.Contains(a.Versions(), unknown) || slices.Contains(p.Verifier.Versions(), unknown) {
			t.Fatalf("%s is meant to be unknown to both halves", unknown)
		}
		if _, err := a.Attest(context.Background(), s.attestRequest(t, s.p.NewKey(t), unknown)); err == nil {
			t.Fatalf("the node half produced evidence version %s it does not list", unknown)
		}
		f := s.file(t, a, s.p.NewKey(t), "")
		ev := setMember(t, f.req.Evidence, "version", `"`+unknown+`"`)
		if err := attestor.CheckEvidence(ev); err != nil {
			t.Fatalf("CheckEvidence denied a well-formed unknown version: %v", err)
		}
		s.wantDenied(t, s.request(f, ev, unknown), attestor.ReasonUnsupportedEvidenceVersion)
	})

	// Evidence that breaks a decoding rule: mutate returns the broken
	// document, or "" to skip when the evidence has no place for it.
	for _, tc := range []struct {
		name    string
		generic bool // CheckEvidence denies it too
		reason  string
		mutate  func(t *testing.T, ev []byte) (string, string)
	}{
		{"truncated", true, attestor.ReasonMalformedEvidence, func(t *testing.T, ev []byte) (string, string) {
			return string(ev[:len(ev)/2]), ""
		}},
		{"unknown member", false, attestor.ReasonEvidenceUnknownField, func(t *testing.T, ev []byte) (string, string) {
			return string(addMember(t, ev, "kaConformanceUnknown", "1")), ""
		}},
		{"unknown nested member", false, attestor.ReasonEvidenceUnknownField, func(t *testing.T, ev []byte) (string, string) {
			name, val := firstObjectMember(t, ev)
			if name == "" {
				return "", "the evidence has no nested object"
			}
			return string(setMember(t, ev, name, string(addMember(t, val, "kaConformanceUnknown", "1")))), ""
		}},
		{"duplicate key", true, attestor.ReasonEvidenceDuplicateKey, func(t *testing.T, ev []byte) (string, string) {
			name, val := firstMember(t, ev, func(n string, _ jsontext.Value) bool { return n != "version" })
			if name == "" {
				name, val = "version", member(t, ev, "version")
			}
			return string(addMember(t, ev, name, string(val))), ""
		}},
		{"duplicate version", true, attestor.ReasonEvidenceDuplicateKey, func(t *testing.T, ev []byte) (string, string) {
			return string(addMember(t, ev, "version", `"v1"`)), ""
		}},
		{"duplicate nested key", true, attestor.ReasonEvidenceDuplicateKey, func(t *testing.T, ev []byte) (string, string) {
			name, val := firstObjectMember(t, ev)
			if name == "" {
				return "", "the evidence has no nested object"
			}
			inner, innerVal := firstMember(t, val, nil)
			if inner == "" {
				return "", "the first nested object is empty"
			}
			return string(setMember(t, ev, name, string(addMember(t, val, inner, string(innerVal))))), ""
		}},
		{"case-folded member", false, attestor.ReasonEvidenceFieldCase, func(t *testing.T, ev []byte) (string, string) {
			name, _ := firstMember(t, ev, func(n string, _ jsontext.Value) bool { return n != "version" && swapCase(n) != n })
			if name == "" {
				return "", "the evidence has no member besides version"
			}
			return string(renameMember(t, ev, name, swapCase(name))), ""
		}},
		{"case-folded duplicate", false, attestor.ReasonEvidenceFieldCase, func(t *testing.T, ev []byte) (string, string) {
			name, val := firstMember(t, ev, func(n string, _ jsontext.Value) bool { return n != "version" && swapCase(n) != n })
			if name == "" {
				return "", "the evidence has no member besides version"
			}
			return string(addMember(t, ev, swapCase(name), string(val))), ""
		}},
		{"trailing data", true, attestor.ReasonEvidenceTrailingData, func(t *testing.T, ev []byte) (string, string) {
			return string(ev) + "{}", ""
		}},
		{"invalid UTF-8", true, attestor.ReasonEvidenceInvalidUTF8, func(t *testing.T, ev []byte) (string, string) {
			name, val := firstMember(t, ev, func(n string, v jsontext.Value) bool { return n != "version" && v.Kind() == '"' })
			if name == "" {
				return string(addMember(t, ev, "x\xff", "1")), ""
			}
			return string(setMember(t, ev, name, `"`+"\xff"+string(val[1:]))), ""
		}},
		{"oversize", true, attestor.ReasonEvidenceTooLarge, func(t *testing.T, ev []byte) (string, string) {
			// Still well-formed JSON: only its size is wrong.
			return "{" + strings.Repeat(" ", attestor.MaxEvidenceSize) + string(ev[1:]), ""
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := s.file(t, s.p.NewAttestor(t), s.p.NewKey(t), "")
			bad, skip := tc.mutate(t, f.req.Evidence)
			if skip != "" {
				t.Skip(skip)
			}
			err := attestor.CheckEvidence([]byte(bad))
			if tc.generic {
				WantDenial(t, err, tc.reason)
			} else if err != nil {
				t.Fatalf("CheckEvidence denied what only a schema can: %v", err)
			}
			s.wantDenied(t, s.request(f, attestor.Evidence(bad), f.req.Version), tc.reason)
		})
	}
}

type suite struct {
	p     Provider
	count int // CSRs filed, for names and UIDs
	// clusterCA (DER) and clusterUID are the workload cluster the node
	// files in.
	clusterCA  []byte
	clusterUID string
}

// filed is one CSR as the signer sees it.
type filed struct {
	name, uid   string
	key         crypto.Signer
	req         *attestor.AttestedRequest
	spki        []byte
	binding     []byte
	annotations map[string]string
}

func (s *suite) attestRequest(tb testing.TB, key crypto.Signer, version string) *attestor.Request {
	tb.Helper()
	spki, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		tb.Fatal(err)
	}
	return &attestor.Request{NodeName: s.p.NodeName, ProviderID: s.p.ProviderID, Binding: attestor.Binding(spki), SPKI: spki, Version: version,
		ClusterCA: s.clusterCA}
}

// file attests with key and files the evidence in a CSR, parsed back as
// the signer parses spec.request.
func (s *suite) file(tb testing.TB, a attestor.Attestor, key crypto.Signer, version string) *filed {
	tb.Helper()
	att, err := a.Attest(context.Background(), s.attestRequest(tb, key, version))
	if err != nil {
		tb.Fatalf("Attest: %v", err)
	}
	if v, err := attestor.EvidenceVersion(att.Evidence); err != nil || v != att.Version {
		tb.Fatalf("Attest returned evidence of version %q (%v) labelled %q", v, err, att.Version)
	}
	f := s.refile(tb, att.Evidence, key)
	f.annotations = att.Annotations
	return f
}

// refile files evidence in a new CSR for key.
func (s *suite) refile(tb testing.TB, evidence attestor.Evidence, key crypto.Signer) *filed {
	tb.Helper()
	ext, err := attestor.ProviderIDExtension(s.p.ProviderID)
	if err != nil {
		tb.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:         pkix.Name{CommonName: attestor.NodeUserPrefix + s.p.NodeName, Organization: []string{attestor.NodesGroup}},
		ExtraExtensions: []pkix.Extension{ext},
	}, key)
	if err != nil {
		tb.Fatal(err)
	}
	raw, err := attestor.EncodeRequest(der, s.p.Name, evidence)
	if err != nil {
		tb.Fatalf("EncodeRequest: %v", err)
	}
	req, err := attestor.ParseRequest(raw)
	if err != nil {
		tb.Fatalf("ParseRequest: %v", err)
	}
	if err := attestor.CheckEvidence(req.Evidence); err != nil {
		tb.Fatalf("CheckEvidence denied the node's own evidence: %v", err)
	}
	s.count++
	return &filed{
		name: fmt.Sprintf("csr-%d", s.count), uid: fmt.Sprintf("uid-%d", s.count),
		key: key, req: req, spki: req.CSR.RawSubjectPublicKeyInfo, binding: attestor.Binding(req.CSR.RawSubjectPublicKeyInfo),
	}
}

func (s *suite) request(f *filed, evidence attestor.Evidence, version string) *attestor.VerifyRequest {
	return &attestor.VerifyRequest{
		Evidence: evidence, Version: version, Binding: f.binding, CSR: f.req.CSR,
		ClusterCAs: [][]byte{s.clusterCA}, ClusterUID: s.clusterUID,
		NodeName: s.p.NodeName, ProviderID: s.p.ProviderID, UID: f.uid,
		Annotations: f.annotations, MachineAnnotations: s.p.MachineAnnotations,
	}
}

// verify plays the signer for f until the verifier proves an identity,
// answering a challenge through the node half if it sets one.
func (s *suite) verify(tb testing.TB, f *filed) *attestor.Identity {
	tb.Helper()
	ctx := context.Background()
	res, err := s.p.Verifier.Verify(ctx, s.request(f, f.req.Evidence, f.req.Version))
	if err != nil {
		tb.Fatalf("Verify: %v", err)
	}
	if res.Challenge == nil {
		if res.Identity == nil || res.Answers != "" {
			tb.Fatalf("Verify returned %+v, want an identity", res)
		}
		return res.Identity
	}
	// Second round: the node answers the challenge with the same key.
	a := s.p.NewAttestor(tb)
	r, ok := a.(attestor.Responder)
	if !ok {
		tb.Fatalf("the verifier challenged but the node half (%T) is not a Responder", a)
	}
	ch := &attestor.Challenge{CSRName: f.name, CSRUID: f.uid, Data: res.Challenge.Data, Expires: res.Challenge.Expires}
	att, err := r.Respond(ctx, s.attestRequest(tb, f.key, f.req.Version), ch)
	if err != nil {
		tb.Fatalf("Respond: %v", err)
	}
	// What the signer hands back is the challenge as it sealed it, with the
	// key it was made under (which the node never sees).
	sealed := &attestor.Challenge{CSRName: ch.CSRName, CSRUID: ch.CSRUID, Data: ch.Data, Expires: ch.Expires, KeyID: res.Challenge.KeyID}
	second := s.refile(tb, att.Evidence, f.key)
	in := s.request(second, second.req.Evidence, second.req.Version)
	res2, err := s.p.Verifier.Verify(ctx, in)
	if err != nil {
		tb.Fatalf("Verify (answer): %v", err)
	}
	if res2.Answers != f.name {
		tb.Fatalf("the answer names %q, want %q", res2.Answers, f.name)
	}
	in.Answered = &attestor.Round{Name: f.name, UID: f.uid, CSR: f.req.CSR, Evidence: f.req.Evidence, Version: f.req.Version,
		Annotations: f.annotations, Challenge: sealed}
	res3, err := s.p.Verifier.Verify(ctx, in)
	if err != nil {
		tb.Fatalf("Verify (answer with its round): %v", err)
	}
	if res3.Identity == nil {
		tb.Fatalf("Verify (answer with its round) returned %+v, want an identity", res3)
	}
	return res3.Identity
}

// wantDenied requires the verifier to deny in (reason "" = any reason).
func (s *suite) wantDenied(tb testing.TB, in *attestor.VerifyRequest, reason string) {
	tb.Helper()
	res, err := s.p.Verifier.Verify(context.Background(), in)
	if err == nil {
		tb.Fatalf("Verify accepted: %+v", res)
	}
	if reason == "" {
		if _, ok := attestor.AsDenial(err); !ok {
			tb.Fatalf("Verify = %v, want a denial", err)
		}
		return
	}
	WantDenial(tb, err, reason)
}

// Generic edits of a JSON object that keep every other byte as it was.

type jsonMember struct {
	name  string
	value jsontext.Value
}

func members(tb testing.TB, obj []byte) []jsonMember {
	tb.Helper()
	dec := jsontext.NewDecoder(bytes.NewReader(obj), jsontext.AllowDuplicateNames(true))
	if tok, err := dec.ReadToken(); err != nil || tok.Kind() != '{' {
		tb.Fatalf("not a JSON object: %s", obj)
	}
	var ms []jsonMember
	for dec.PeekKind() != '}' {
		tok, err := dec.ReadToken()
		if err != nil {
			tb.Fatal(err)
		}
		name := tok.String()
		v, err := dec.ReadValue()
		if err != nil {
			tb.Fatal(err)
		}
		ms = append(ms, jsonMember{name, v.Clone()})
	}
	return ms
}

func build(tb testing.TB, ms []jsonMember) []byte {
	tb.Helper()
	var b bytes.Buffer
	b.WriteByte('{')
	for i, m := range ms {
		if i > 0 {
			b.WriteByte(',')
		}
		if !utf8Valid(m.name) {
			b.WriteString(`"` + m.name + `"`) // deliberately invalid, not escaped
		} else {
			name, err := json.Marshal(m.name)
			if err != nil {
				tb.Fatal(err)
			}
			b.Write(name)
		}
		b.WriteByte(':')
		b.Write(m.value)
	}
	b.WriteByte('}')
	return b.Bytes()
}

func utf8Valid(s string) bool { return strings.ToValidUTF8(s, "\uFFFD") == s }

func addMember(tb testing.TB, obj []byte, name, value string) []byte {
	tb.Helper()
	return build(tb, append(members(tb, obj), jsonMember{name, jsontext.Value(value)}))
}

func setMember(tb testing.TB, obj []byte, name, value string) []byte {
	tb.Helper()
	ms := members(tb, obj)
	for i := range ms {
		if ms[i].name == name {
			ms[i].value = jsontext.Value(value)
			return build(tb, ms)
		}
	}
	tb.Fatalf("no member %q in %s", name, obj)
	return nil
}

func renameMember(tb testing.TB, obj []byte, from, to string) []byte {
	tb.Helper()
	ms := members(tb, obj)
	for i := range ms {
		if ms[i].name == from {
			ms[i].name = to
		}
	}
	return build(tb, ms)
}

func member(tb testing.TB, obj []byte, name string) jsontext.Value {
	tb.Helper()
	_, v := firstMember(tb, obj, func(n string, _ jsontext.Value) bool { return n == name })
	return v
}

func firstMember(tb testing.TB, obj []byte, match func(string, jsontext.Value) bool) (string, jsontext.Value) {
	tb.Helper()
	for _, m := range members(tb, obj) {
		if match == nil || match(m.name, m.value) {
			return m.name, m.value
		}
	}
	return "", nil
}

func firstObjectMember(tb testing.TB, obj []byte) (string, jsontext.Value) {
	tb.Helper()
	return firstMember(tb, obj, func(_ string, v jsontext.Value) bool { return v.Kind() == '{' })
}

// swapCase flips the case of the first letter of s that has two cases.
func swapCase(s string) string {
	rs := []rune(s)
	for i, r := range rs {
		switch {
		case unicode.IsLower(r) && unicode.ToUpper(r) != r:
			rs[i] = unicode.ToUpper(r)
			return string(rs)
		case unicode.IsUpper(r) && unicode.ToLower(r) != r:
			rs[i] = unicode.ToLower(r)
			return string(rs)
		}
	}
	return s
}
