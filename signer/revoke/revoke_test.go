package revoke

import (
	"context"
	"crypto/x509"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"
)

var t0 = time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)

func sample() *State {
	return &State{Version: stateVersion, Shards: ShardCount, Entries: []Entry{
		{Node: "worker-a", Machine: Machine{Namespace: "team", Name: "worker-a", UID: "u1"}, RevokedAt: t0, Until: t0.Add(7 * 24 * time.Hour),
			Accepted: []Credential{{SHA256: strings.Repeat("ab", 32), Machine: Machine{Namespace: "team", Name: "worker-a", UID: "u2"}, NotAfter: t0.Add(24 * time.Hour)}}},
		{Node: "ip-10-0-0-1.ec2.internal", Machine: Machine{Namespace: "team", Name: "md-0-x", UID: "u3"}, RevokedAt: t0, Until: t0.Add(time.Hour)},
	}, Issued: []Credential{{SHA256: strings.Repeat("cd", 32), Node: "worker-b", Machine: Machine{Namespace: "team", Name: "worker-b", UID: "u4"}, NotAfter: t0.Add(24 * time.Hour)}},
		Denied: []Denial{{Node: "worker-b", Request: "csr-b2", Reason: "SecureBootDisabled", At: t0.Add(time.Hour)}}}
}

// recorded reads and decodes the record and all its shards in the
// cluster of c.
func recorded(ctx context.Context, t *testing.T, c kubernetes.Interface) *State {
	t.Helper()
	s, err := Read(ctx, c.CoreV1())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func configMap(t *testing.T, s *State) *corev1.ConfigMap {
	t.Helper()
	d, err := data(s)
	if err != nil {
		t.Fatal(err)
	}
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: Namespace, Name: ConfigMapName}, Data: d}
}

// The state round-trips through its ConfigMap, and the policy carries what
// it says: each revoked name with the message of its refusal, each accepted
// certificate with its name.
func TestStateAndPolicy(t *testing.T) {
	cm := configMap(t, sample())
	if len(cm.Data) != 1 {
		t.Errorf("ConfigMap has keys %v, want only %s", cm.Data, StateKey)
	}
	got, err := Decode(cm)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, sample()) {
		t.Errorf("round trip:\n got %+v\nwant %+v", got, sample())
	}
	p, err := Policy(got)
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{}
	for _, v := range p.Spec.Variables {
		vars[v.Name] = v.Expression
	}
	wantRevoked := `{"ip-10-0-0-1.ec2.internal": "node ip-10-0-0-1.ec2.internal was revoked: its Machine team/md-0-x was deleted from the management cluster at 2026-11-25T10:00:00Z; ` +
		`certificates issued to the node before then are refused until 2026-11-25T11:00:00Z. A new Machine of this name joins through the node-attestation-controller, which accepts the certificates it issues to it", ` +
		`"worker-a": "node worker-a was revoked: its Machine team/worker-a was deleted from the management cluster at 2026-11-25T10:00:00Z; ` +
		`certificates issued to the node before then are refused until 2026-12-02T10:00:00Z. A new Machine of this name joins through the node-attestation-controller, which accepts the certificates it issues to it"}`
	if vars["revoked"] != wantRevoked {
		t.Errorf("variable revoked =\n%s\nwant\n%s", vars["revoked"], wantRevoked)
	}
	if want := `{"` + strings.Repeat("ab", 32) + `": "worker-a"}`; vars["accepted"] != want {
		t.Errorf("variable accepted = %s, want %s", vars["accepted"], want)
	}
	empty, err := Policy(&State{Version: stateVersion})
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range empty.Spec.Variables {
		if v.Name != "node" && v.Expression != "{}" {
			t.Errorf("empty state: variable %s = %s", v.Name, v.Expression)
		}
	}
}

// Nothing written into the policy can end its literal.
func TestCELMapRefuses(t *testing.T) {
	for _, s := range []string{`a"b`, `a\b`, "a\nb", "naïve"} {
		if _, err := celMap(map[string]string{"k": s}); err == nil {
			t.Errorf("celMap accepted value %q", s)
		}
		if _, err := celMap(map[string]string{s: "v"}); err == nil {
			t.Errorf("celMap accepted key %q", s)
		}
	}
}

func TestDecodeRefuses(t *testing.T) {
	good := configMap(t, sample()).Data[StateKey]
	for name, raw := range map[string]string{
		"duplicate key":     strings.Replace(good, `{"version":"v2",`, `{"version":"v2","version":"v2",`, 1),
		"case-folded field": strings.Replace(good, `"entries"`, `"Entries"`, 1),
		"case-folded inner": strings.Replace(good, `"accepted"`, `"Accepted"`, 1),
		"unknown case-fold": strings.Replace(good, `{"version":"v2",`, `{"version":"v2","DENIED":[],`, 1),
		"duplicate inner":   strings.Replace(good, `"reason":"SecureBootDisabled"`, `"reason":"SecureBootDisabled","reason":"Other"`, 1),
		"denial bad node":   strings.Replace(good, `"node":"worker-b","request"`, `"node":"Worker_B","request"`, 1),
		"denial no request": strings.Replace(good, `"request":"csr-b2"`, `"request":""`, 1),
		"denial bad reason": strings.Replace(good, `"reason":"SecureBootDisabled"`, `"reason":"Secure boot: off"`, 1),
		"denial no time":    strings.Replace(good, `"at":"2026-11-25T11:00:00Z"`, `"at":"0001-01-01T00:00:00Z"`, 1),
		"denial twice":      strings.Replace(good, `"denied":[`, `"denied":[{"node":"worker-b","request":"csr-b1","reason":"Other","at":"2026-11-25T10:00:00Z"},`, 1),
		"trailing data":     good + "{}",
		"other version":     strings.Replace(good, `"v2"`, `"v3"`, 1),
		"other shards":      strings.Replace(good, `"shards":64`, `"shards":32`, 1),
		"legacy of shards":  strings.Replace(good, `"v2"`, `"v1"`, 1),
		"no shards":         strings.Replace(good, `"shards":64,`, ``, 1),
		"upper-case node":   strings.Replace(good, `"node":"worker-a"`, `"node":"Worker-A"`, 1),
		"quote in Machine":  strings.Replace(good, `"name":"md-0-x"`, `"name":"md-0-x\\\""`, 1),
		"empty node":        strings.Replace(good, `"node":"worker-a"`, `"node":""`, 1),
		"short fingerprint": strings.Replace(good, strings.Repeat("ab", 32), "abab", 1),
		"upper fingerprint": strings.Replace(good, strings.Repeat("ab", 32), strings.Repeat("AB", 32), 1),
		"issued bad node":   strings.Replace(good, `"node":"worker-b"`, `"node":"Worker_B"`, 1),
		"issued bad print":  strings.Replace(good, strings.Repeat("cd", 32), "cdcd", 1),
		"null":              "null",
		"a list":            "[]",
		"not JSON":          "revoked: worker-a",
	} {
		t.Run(name, func(t *testing.T) {
			if raw == good {
				t.Fatal("test case changes nothing")
			}
			_, err := Decode(&corev1.ConfigMap{Data: map[string]string{StateKey: raw}})
			if !errors.Is(err, ErrMalformed) {
				t.Errorf("Decode = %v, want ErrMalformed", err)
			}
		})
	}
	if _, err := Decode(&corev1.ConfigMap{Data: map[string]string{"worker-a": "x"}}); !errors.Is(err, ErrMalformed) {
		t.Errorf("Decode without %s = %v, want ErrMalformed", StateKey, err)
	}
}

// A shard holds only what hashes to it, never entries, and is read as
// strictly as the record; Decode takes only the record's shards.
func TestDecodeShardRefuses(t *testing.T) {
	s := sample()
	k := ShardOf("worker-b")
	shard := &State{Version: stateVersion, Shards: ShardCount, Issued: s.Issued, Denied: s.Denied}
	good := configMap(t, shard).Data[StateKey]
	cm := func(name, raw string) *corev1.ConfigMap {
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: Namespace, Name: name}, Data: map[string]string{StateKey: raw}}
	}
	rec := configMap(t, &State{Version: stateVersion, Shards: ShardCount})
	got, err := Decode(rec, cm(ShardName(k), good))
	if err != nil || len(got.Issued) != 1 || got.FindDenial("worker-b") == nil {
		t.Fatalf("Decode of a record and a shard: %+v, %v", got, err)
	}
	other := (k + 1) % ShardCount
	withEntries := configMap(t, &State{Version: stateVersion, Shards: ShardCount, Entries: s.Entries[:1], Issued: s.Issued}).Data[StateKey]
	for name, c := range map[string]*corev1.ConfigMap{
		"another shard's node": cm(ShardName(other), good),
		"entries":              cm(ShardName(k), withEntries),
		"legacy version":       cm(ShardName(k), strings.Replace(good, `"version":"v2","shards":64`, `"version":"v1"`, 1)),
		"other count":          cm(ShardName(k), strings.Replace(good, `"shards":64`, `"shards":128`, 1)),
		"duplicate field":      cm(ShardName(k), strings.Replace(good, `{"version":"v2",`, `{"version":"v2","version":"v2",`, 1)),
	} {
		if _, err := Decode(rec, c); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: Decode = %v, want ErrMalformed", name, err)
		}
	}
	for _, name := range []string{ConfigMapName, ConfigMapName + "-64", ConfigMapName + "-7", "kube-proxy"} {
		if _, err := Decode(rec, cm(name, good)); err == nil {
			t.Errorf("Decode took %q for a shard", name)
		}
	}
}

// A record written by a newer controller, with fields this version does
// not know, is read during a rolling upgrade (and written back with its
// top-level ones kept), not refused as malformed: refusing it would stop
// issuance and revocation in the cluster until the upgrade ends.
func TestDecodeUnknownFields(t *testing.T) {
	good := configMap(t, sample()).Data[StateKey]
	raw := strings.Replace(good, `{"version":"v2",`, `{"version":"v2","quarantined":[{"node":"worker-c","n":12345678901234567890}],`, 1)
	raw = strings.Replace(raw, `"reason":"SecureBootDisabled"`, `"reason":"SecureBootDisabled","pcrs":[0,7]`, 1)
	got, err := Decode(&corev1.ConfigMap{Data: map[string]string{StateKey: raw}})
	if err != nil {
		t.Fatalf("Decode of a record with unknown fields: %v", err)
	}
	got.unknown = nil
	want := sample()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("read\n %+v\nwant\n %+v", got, want)
	}
	got, _ = Decode(&corev1.ConfigMap{Data: map[string]string{StateKey: raw}})
	got.Issued = nil // a change this version writes
	d, err := data(got)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(d[StateKey], `"quarantined":[{"n":12345678901234567890,"node":"worker-c"}]`) {
		t.Errorf("written back without the newer version's top-level field: %s", d[StateKey])
	}
	again, err := Decode(&corev1.ConfigMap{Data: d})
	if err != nil || again.Issued != nil || len(again.Denied) != 1 {
		t.Errorf("written back: %+v, %v", again, err)
	}
}

// An entry goes once every certificate issued before its revocation has
// expired; an accepted certificate once it has expired.
func TestPrune(t *testing.T) {
	s := sample()
	if d := s.prune(t0.Add(30 * time.Minute)); len(d) != 0 || len(s.Entries) != 2 {
		t.Fatalf("pruned %v early", d)
	}
	if d := s.prune(t0.Add(time.Hour)); !reflect.DeepEqual(d, []string{"ip-10-0-0-1.ec2.internal"}) || len(s.Entries) != 1 {
		t.Fatalf("pruned %v, left %d entries", d, len(s.Entries))
	}
	s.prune(t0.Add(24 * time.Hour))
	if len(s.Entries) != 1 || len(s.Entries[0].Accepted) != 0 || len(s.Issued) != 0 {
		t.Fatalf("after the accepted and issued certificates expired: %+v, issued %+v", s.Entries, s.Issued)
	}
	if d := s.prune(t0.Add(7 * 24 * time.Hour)); len(d) != 1 || len(s.Entries) != 0 {
		t.Fatalf("pruned %v, left %+v", d, s.Entries)
	}
}

func FuzzDecode(f *testing.F) {
	d, err := data(sample())
	if err != nil {
		f.Fatal(err)
	}
	f.Add(d[StateKey])
	f.Add(`{"version":"v2","shards":64,"entries":null}`)
	f.Add(`{"version":"v1","entries":null,"issued":[]}`)
	f.Fuzz(func(t *testing.T, raw string) {
		s, err := Decode(&corev1.ConfigMap{Data: map[string]string{StateKey: raw}})
		if err != nil {
			return
		}
		d, err := data(s)
		if err != nil {
			t.Fatal(err)
		}
		again, err := Decode(&corev1.ConfigMap{Data: d})
		if err != nil || !reflect.DeepEqual(again, s) {
			t.Fatalf("what Decode accepted does not round-trip: %v", err)
		}
	})
}

// TestUpdateCanceled: a request cut short by the caller's context (the
// workload cluster's controller stopped while it kept the revocations) is
// an error, not a state: client-go's retry helper reports a context error
// as success, and the controller crashed on the missing state.
func TestUpdateCanceled(t *testing.T) {
	c := fake.NewClientset()
	c.PrependReactor("get", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, context.Canceled
	})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r := &Revoker{Client: c, Lifetime: time.Hour}
	if _, _, err := r.Ensure(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Ensure() with its context canceled = %v, want context.Canceled", err)
	}
}

// A denied renewal is recorded as its node's latest (one entry a node,
// the newest replacing it), only for a node the record holds a certificate
// of, and dropped once a certificate issued after it is recorded, once the
// node's certificates are gone, or after the longest certificate lifetime.
func TestDeny(t *testing.T) {
	ctx := context.Background()
	clock := clocktesting.NewFakePassiveClock(t0)
	c := fake.NewClientset()
	r := &Revoker{Client: c, Lifetime: 24 * time.Hour, Clock: clock}
	read := func() *State {
		t.Helper()
		return recorded(ctx, t, c)
	}
	m := Machine{Namespace: "team", Name: "worker-a", UID: "u1"}
	cert := func(raw string) *x509.Certificate {
		// Longer than the cap: the node keeps a certificate while its
		// denial expires.
		return &x509.Certificate{Raw: []byte(raw), NotAfter: clock.Now().Add(7 * 24 * time.Hour)}
	}
	att := Attestation{Provider: "tpm"}

	if err := r.Deny(ctx, "worker-a", "csr-0", "SecureBootDisabled"); err != nil {
		t.Fatal(err)
	}
	if s := read(); len(s.Denied) != 0 {
		t.Fatalf("denial recorded for a node without certificates: %+v", s.Denied)
	}
	if _, err := r.Accept(ctx, "worker-a", m, cert("first"), att); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Accept(ctx, "worker-b", Machine{Namespace: "team", Name: "worker-b", UID: "u2"}, cert("other"), att); err != nil {
		t.Fatal(err)
	}
	clock.SetTime(t0.Add(time.Hour))
	if err := r.Deny(ctx, "worker-a", "csr-1", "SecureBootDisabled"); err != nil {
		t.Fatal(err)
	}
	want := Denial{Node: "worker-a", Request: "csr-1", Reason: "SecureBootDisabled", At: t0.Add(time.Hour)}
	if s := read(); !reflect.DeepEqual(s.Denied, []Denial{want}) {
		t.Fatalf("denied %+v, want %+v", s.Denied, want)
	}
	clock.SetTime(t0.Add(2 * time.Hour))
	if err := r.Deny(ctx, "worker-a", "csr-1", "SecureBootDisabled"); err != nil {
		t.Fatal(err)
	}
	if s := read(); !reflect.DeepEqual(s.Denied, []Denial{want}) {
		t.Fatalf("the same denial recorded again: %+v, want %+v", s.Denied, want)
	}
	if err := r.Deny(ctx, "worker-a", "csr-2", "PCRMismatch"); err != nil {
		t.Fatal(err)
	}
	want = Denial{Node: "worker-a", Request: "csr-2", Reason: "PCRMismatch", At: t0.Add(2 * time.Hour)}
	if s := read(); !reflect.DeepEqual(s.Denied, []Denial{want}) {
		t.Fatalf("after a second denial: %+v, want only %+v", s.Denied, want)
	}
	if _, err := r.Accept(ctx, "worker-b", Machine{Namespace: "team", Name: "worker-b", UID: "u2"}, cert("other-2"), att); err != nil {
		t.Fatal(err)
	}
	if s := read(); len(s.Denied) != 1 {
		t.Fatalf("another node's certificate dropped the denial: %+v", s.Denied)
	}
	if _, err := r.Accept(ctx, "worker-a", m, cert("second"), att); err != nil {
		t.Fatal(err)
	}
	if s := read(); len(s.Denied) != 0 {
		t.Fatalf("denial kept after a newer certificate was recorded: %+v", s.Denied)
	}

	// Kept for the longest certificate lifetime (and margin), then gone.
	if err := r.Deny(ctx, "worker-a", "csr-3", "SecureBootDisabled"); err != nil {
		t.Fatal(err)
	}
	at := clock.Now()
	for _, c := range []struct {
		at   time.Time
		want int
	}{{at.Add(r.Lifetime + Margin - time.Second), 1}, {at.Add(r.Lifetime + Margin), 0}} {
		clock.SetTime(c.at)
		if _, _, err := r.Ensure(ctx); err != nil {
			t.Fatal(err)
		}
		if s := read(); len(s.Denied) != c.want {
			t.Fatalf("%s after the denial: %+v, want %d", c.at.Sub(at), s.Denied, c.want)
		}
	}

	// The node's Machine deleted: its certificates, and the denial, go.
	if err := r.Deny(ctx, "worker-a", "csr-5", "SecureBootDisabled"); err != nil {
		t.Fatal(err)
	}
	if s := read(); len(s.Denied) != 1 {
		t.Fatalf("denial not recorded: %+v", s.Denied)
	}
	if _, _, err := r.Revoke(ctx, m, []string{"worker-a"}, nil); err != nil {
		t.Fatal(err)
	}
	if s := read(); len(s.Denied) != 0 {
		t.Fatalf("denial kept for a node without certificates: %+v", s.Denied)
	}
	if err := r.Deny(ctx, "worker-a", "csr-6", "Secure boot off"); err == nil {
		t.Error("a reason that is no condition reason was recorded")
	}
}
