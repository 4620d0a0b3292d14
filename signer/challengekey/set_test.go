package challengekey

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

// TestSetKey: a key the set holds is found; one older than the set's
// oldest was rotated out; one slightly newer may be another replica's
// (asked again later); any other name was never made.
func TestSetKey(t *testing.T) {
	now := time.Now()
	set := &Set{Keys: []Key{
		{ID: "k3", Secret: bytes.Repeat([]byte{3}, 32), Since: now},
		{ID: "k2", Secret: bytes.Repeat([]byte{2}, 32), Since: now.Add(-time.Hour), Retired: now},
	}}
	if err := set.validate(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		id   string
		want error // nil: found
	}{
		{"k3", nil},
		{"k2", nil},
		{"k1", attestor.ErrChallengeKeyRetired},
		{"k0", attestor.ErrChallengeKeyRetired},
		{"k4", attestor.ErrChallengeKeyNotYetRead},
		{"k99", errNeither},
		{"k03", errNeither},
		{"x", errNeither},
	} {
		key, err := set.Key(tc.id)
		switch {
		case tc.want == nil && (err != nil || key == nil):
			t.Errorf("Key(%q) = %v, want the key", tc.id, err)
		case errors.Is(tc.want, errNeither) && (err == nil || errors.Is(err, attestor.ErrChallengeKeyRetired) || errors.Is(err, attestor.ErrChallengeKeyNotYetRead)):
			t.Errorf("Key(%q) = %v, want an error saying no such key was made", tc.id, err)
		case tc.want != nil && !errors.Is(tc.want, errNeither) && !errors.Is(err, tc.want):
			t.Errorf("Key(%q) = %v, want %v", tc.id, err, tc.want)
		}
	}
}

var errNeither = errors.New("neither retired nor not yet read")
