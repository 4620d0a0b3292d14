// Package challengekey keeps the controller's challenge keys: the keys TPM
// challenges are sealed with and their secrets derived from, held in one
// Secret on the management cluster that every replica shares. The key is
// rotated with overlap: new challenges are made under the newest key, and
// the previous ones are kept until every challenge made under them has
// expired, so that whoever once read the Secret can answer challenges only
// until the keys they read have been dropped.
package challengekey

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"

	"sigs.k8s.io/kubelet-authenticator/attestor"
)

const (
	// LegacyDataKey is the Secret data key of the first format: one key,
	// never rotated (attestor.LegacyChallengeKeyID).
	LegacyDataKey = "key"
	// SetDataKey is the Secret data key of the key set (JSON).
	SetDataKey = "keys.json"
	// AnnotationRotate on the Secret asks for a rotation now; the
	// controller removes it when it rotates. Any value.
	AnnotationRotate = "kubelet-authenticator.x-k8s.io/rotate-challenge-key"
	// KeySize is the size of a generated key.
	KeySize = 32
	// MinKeySize is the size of the shortest key accepted.
	MinKeySize = 32
	// maxKeys bounds the keys a set may hold.
	maxKeys = 16
)

// Key is one challenge key.
type Key struct {
	// ID names the key in challenge seals: "k<generation>".
	ID string `json:"id"`
	// Secret is the key material.
	Secret []byte `json:"secret"`
	// Since is when the key became the current one.
	Since time.Time `json:"since"`
	// Retired is when a newer key replaced it; zero for the current key.
	Retired time.Time `json:"retired,omitzero"`
}

// Set is the controller's challenge keys, newest first: Keys[0] is the
// current key, the others are retired and kept for the challenges in
// flight. A Set is never modified once made.
type Set struct {
	Keys []Key `json:"keys"`
}

// generation is the number in a key id "k<n>".
func generation(id string) (int, bool) {
	n, err := strconv.Atoi(strings.TrimPrefix(id, "k"))
	if err != nil || !strings.HasPrefix(id, "k") || n < 0 || strconv.Itoa(n) != id[1:] {
		return 0, false
	}
	return n, true
}

// Current returns the current key.
func (s *Set) Current() Key { return s.Keys[0] }

// Key returns the key named id, or an error wrapping
// attestor.ErrChallengeKeyRetired when the set is newer than that key and no
// longer holds it.
func (s *Set) Key(id string) ([]byte, error) {
	for _, k := range s.Keys {
		if k.ID == id {
			return k.Secret, nil
		}
	}
	n, ok := generation(id)
	cur, _ := generation(s.Current().ID)
	switch {
	case ok && n < cur:
		return nil, fmt.Errorf("challenge key %q was dropped (the current key is %q): %w", id, s.Current().ID, attestor.ErrChallengeKeyRetired)
	case ok && n <= cur+maxAhead:
		return nil, fmt.Errorf("challenge key %q is newer than the current key %q: %w", id, s.Current().ID, attestor.ErrChallengeKeyNotYetRead)
	}
	return nil, fmt.Errorf("there is no challenge key %q (the current key is %q)", id, s.Current().ID)
}

// maxAhead is how many generations another replica may have rotated the
// key beyond what this one last read (rotations on demand in quick
// succession); a key id further ahead was never made.
const maxAhead = 3

// Rotated returns a set whose current key is a new one read from rand,
// the current key retired at now.
func (s *Set) Rotated(now time.Time, rand io.Reader) (*Set, error) {
	cur, _ := generation(s.Current().ID)
	k, err := newKey(cur+1, now, rand)
	if err != nil {
		return nil, err
	}
	keys := make([]Key, 0, len(s.Keys)+1)
	keys = append(keys, k)
	for i, k := range s.Keys {
		if i == 0 {
			k.Retired = now.UTC().Truncate(time.Second)
		}
		keys = append(keys, k)
	}
	return &Set{Keys: keys}, nil
}

// newKey makes key generation gen, current from now.
func newKey(gen int, now time.Time, rand io.Reader) (Key, error) {
	secret := make([]byte, KeySize)
	if _, err := io.ReadFull(rand, secret); err != nil {
		return Key{}, fmt.Errorf("unable to make a challenge key: %w", err)
	}
	return Key{ID: "k" + strconv.Itoa(gen), Secret: secret, Since: now.UTC().Truncate(time.Second)}, nil
}

// Pruned returns the set without the retired keys retired at least overlap
// before now, and whether it dropped any. At most maxKeys are kept: older
// keys beyond them are dropped too.
func (s *Set) Pruned(now time.Time, overlap time.Duration) (*Set, bool) {
	keys := []Key{s.Keys[0]}
	for _, k := range s.Keys[1:] {
		if now.Sub(k.Retired) < overlap && len(keys) < maxKeys {
			keys = append(keys, k)
		}
	}
	return &Set{Keys: keys}, len(keys) != len(s.Keys)
}

// FromSecret reads the key set of a Secret in either format: the key set
// (SetDataKey), or the first format's single key (LegacyDataKey), which is
// the current key attestor.LegacyChallengeKeyID since the Secret's
// creation.
func FromSecret(s *corev1.Secret) (*Set, error) {
	if data, ok := s.Data[SetDataKey]; ok {
		var set Set
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&set); err != nil {
			return nil, fmt.Errorf("unable to decode %s: %w", SetDataKey, err)
		}
		return &set, set.validate()
	}
	key, ok := s.Data[LegacyDataKey]
	if !ok {
		return nil, fmt.Errorf("the Secret holds neither %q nor %q", SetDataKey, LegacyDataKey)
	}
	set := &Set{Keys: []Key{{ID: attestor.LegacyChallengeKeyID, Secret: key, Since: s.CreationTimestamp.UTC()}}}
	return set, set.validate()
}

// validate reports every problem of a key set.
func (s *Set) validate() error {
	if len(s.Keys) == 0 {
		return errors.New("the key set holds no key")
	}
	var errs []error
	if len(s.Keys) > maxKeys {
		errs = append(errs, fmt.Errorf("the key set holds %d keys; at most %d are kept", len(s.Keys), maxKeys))
	}
	seen := map[string]bool{}
	last := -1
	for i, k := range s.Keys {
		n, ok := generation(k.ID)
		switch {
		case !ok:
			errs = append(errs, fmt.Errorf("key %d: id %q is not k<number>", i, k.ID))
		case seen[k.ID]:
			errs = append(errs, fmt.Errorf("key %q is listed twice", k.ID))
		case last >= 0 && n >= last:
			errs = append(errs, fmt.Errorf("key %q is listed after a newer one", k.ID))
		}
		seen[k.ID], last = true, n
		if len(k.Secret) < MinKeySize {
			errs = append(errs, fmt.Errorf("key %q is %d bytes; at least %d are required", k.ID, len(k.Secret), MinKeySize))
		}
		if i > 0 && k.Retired.IsZero() {
			errs = append(errs, fmt.Errorf("key %q is not the current one but has no retirement time", k.ID))
		}
	}
	return errors.Join(errs...)
}

// encode returns the set as the Secret's SetDataKey value.
func (s *Set) encode() ([]byte, error) { return json.Marshal(s) }

// Ring holds the key set a replica last read; it implements
// attestor.ChallengeKeys for the engine and the TPM verifier. Safe for
// concurrent use.
type Ring struct {
	set atomic.Pointer[Set]
}

var _ attestor.ChallengeKeys = (*Ring)(nil)

// Store makes s the ring's key set.
func (r *Ring) Store(s *Set) { r.set.Store(s) }

// Load returns the ring's key set; nil before the first Store.
func (r *Ring) Load() *Set { return r.set.Load() }

// Current implements attestor.ChallengeKeys.
func (r *Ring) Current() (string, []byte) {
	s := r.set.Load()
	if s == nil {
		return "", nil
	}
	k := s.Current()
	return k.ID, k.Secret
}

// Key implements attestor.ChallengeKeys.
func (r *Ring) Key(id string) ([]byte, error) {
	s := r.set.Load()
	if s == nil {
		return nil, fmt.Errorf("no challenge key has been read yet: %w", attestor.ErrChallengeKeyNotYetRead)
	}
	return s.Key(id)
}
