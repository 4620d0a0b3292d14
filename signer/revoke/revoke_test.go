package revoke

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
)

var t0 = time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)

func sample() *State {
	return &State{Version: stateVersion, Entries: []Entry{
		{Node: "worker-a", Machine: Machine{Namespace: "team", Name: "worker-a", UID: "u1"}, RevokedAt: t0, Until: t0.Add(7 * 24 * time.Hour),
			Accepted: []Credential{{SHA256: strings.Repeat("ab", 32), Machine: Machine{Namespace: "team", Name: "worker-a", UID: "u2"}, NotAfter: t0.Add(24 * time.Hour)}}},
		{Node: "ip-10-0-0-1.ec2.internal", Machine: Machine{Namespace: "team", Name: "md-0-x", UID: "u3"}, RevokedAt: t0, Until: t0.Add(time.Hour)},
	}}
}

func configMap(t *testing.T, s *State) *corev1.ConfigMap {
	t.Helper()
	d, err := data(s)
	if err != nil {
		t.Fatal(err)
	}
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: Namespace, Name: ConfigMapName}, Data: d}
}

// The keys the policy reads: the message of each revoked name under the
// name, the node of each accepted certificate under its fingerprint, and
// none of the controller's own keys can be a node name.
func TestData(t *testing.T) {
	cm := configMap(t, sample())
	want := map[string]string{
		"worker-a":                               "node worker-a was revoked: its Machine team/worker-a was deleted from the management cluster at 2026-11-25T10:00:00Z; certificates issued to the node before then are refused until 2026-12-02T10:00:00Z",
		"ip-10-0-0-1.ec2.internal":               "node ip-10-0-0-1.ec2.internal was revoked: its Machine team/md-0-x was deleted",
		"X509SHA256." + strings.Repeat("ab", 32): "worker-a",
	}
	for k, v := range want {
		if !strings.HasPrefix(cm.Data[k], v) {
			t.Errorf("data[%s] = %q, want it to start with %q", k, cm.Data[k], v)
		}
	}
	if len(cm.Data) != len(want)+1 {
		t.Errorf("data has %d keys, want %d", len(cm.Data), len(want)+1)
	}
	for k, v := range cm.Data {
		if errs := validation.IsConfigMapKey(k); len(errs) > 0 {
			t.Errorf("key %q is not a ConfigMap key: %v", k, errs)
		}
		if _, ok := want[k]; !ok && k != StateKey {
			t.Errorf("unexpected key %q", k)
		}
		if strings.ContainsAny(v, "\n\r") && k != StateKey {
			t.Errorf("data[%s] spans lines; a policy message must not", k)
		}
	}
	for _, k := range []string{StateKey, CredentialKeyPrefix + strings.Repeat("ab", 32)} {
		if len(validation.IsDNS1123Subdomain(k)) == 0 {
			t.Errorf("controller key %q is a valid node name", k)
		}
	}
	got, err := Decode(cm)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, sample()) {
		t.Errorf("round trip:\n got %+v\nwant %+v", got, sample())
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
		"empty node":        strings.Replace(good, `"node":"worker-a"`, `"node":""`, 1),
		"short fingerprint": strings.Replace(good, strings.Repeat("ab", 32), "abab", 1),
		"upper fingerprint": strings.Replace(good, strings.Repeat("ab", 32), strings.Repeat("AB", 32), 1),
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
	if len(s.Entries) != 1 || len(s.Entries[0].Accepted) != 0 {
		t.Fatalf("after the accepted certificate expired: %+v", s.Entries)
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
