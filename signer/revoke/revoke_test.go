package revoke

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

var t0 = time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)

func sample() *State {
	return &State{Version: stateVersion, Entries: []Entry{
		{Node: "worker-a", Machine: Machine{Namespace: "team", Name: "worker-a", UID: "u1"}, RevokedAt: t0, Until: t0.Add(7 * 24 * time.Hour),
			Accepted: []Credential{{SHA256: strings.Repeat("ab", 32), Machine: Machine{Namespace: "team", Name: "worker-a", UID: "u2"}, NotAfter: t0.Add(24 * time.Hour)}}},
		{Node: "ip-10-0-0-1.ec2.internal", Machine: Machine{Namespace: "team", Name: "md-0-x", UID: "u3"}, RevokedAt: t0, Until: t0.Add(time.Hour)},
	}, Issued: []Credential{{SHA256: strings.Repeat("cd", 32), Node: "worker-b", Machine: Machine{Namespace: "team", Name: "worker-b", UID: "u4"}, NotAfter: t0.Add(24 * time.Hour)}}}
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
		"duplicate key":     strings.Replace(good, `{"version":"v1",`, `{"version":"v1","version":"v1",`, 1),
		"unknown field":     strings.Replace(good, `{"version":"v1",`, `{"version":"v1","extra":1,`, 1),
		"case-folded field": strings.Replace(good, `"entries"`, `"Entries"`, 1),
		"trailing data":     good + "{}",
		"other version":     strings.Replace(good, `"v1"`, `"v2"`, 1),
		"upper-case node":   strings.Replace(good, `"node":"worker-a"`, `"node":"Worker-A"`, 1),
		"quote in Machine":  strings.Replace(good, `"name":"md-0-x"`, `"name":"md-0-x\\\""`, 1),
		"empty node":        strings.Replace(good, `"node":"worker-a"`, `"node":""`, 1),
		"short fingerprint": strings.Replace(good, strings.Repeat("ab", 32), "abab", 1),
		"upper fingerprint": strings.Replace(good, strings.Repeat("ab", 32), strings.Repeat("AB", 32), 1),
		"issued bad node":   strings.Replace(good, `"node":"worker-b"`, `"node":"Worker_B"`, 1),
		"issued bad print":  strings.Replace(good, strings.Repeat("cd", 32), "cdcd", 1),
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
	f.Add(`{"version":"v1","entries":null}`)
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
